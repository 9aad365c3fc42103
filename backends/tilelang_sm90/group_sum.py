"""The fused backward's dq / dk per value head summed over each key head's group of value heads (GVA), in value
head order with fp32 sums, and written in the gradients' dtype: one Triton launch per tensor. torch's reduction
over the group dimension and the cast after it took 0.76 ms of the fused path's 4.7 at 16/32 1x32768 (both
tensors; H200, session 16's stages), ~3x what their ~0.8 GB of reads and writes take at the HBM's rate."""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reduction below serves
    triton = None

BLOCK_TOKENS = 32


def group_sum(x: torch.Tensor, H: int, dtype: torch.dtype) -> torch.Tensor:
    """x [1, T, HV, K] (per value head) -> [1, T, H, K] in dtype, each key head's HV // H value heads summed in
    order in fp32."""
    _, T, HV, K = x.shape
    if HV == H:
        return x.to(dtype)
    if triton is None or (x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        return x.view(1, T, H, HV // H, K).sum(3, dtype=torch.float32).to(dtype)
    y = torch.empty(1, T, H, K, device=x.device, dtype=dtype)
    if T:
        _group_sum_kernel[(triton.cdiv(T, BLOCK_TOKENS), H)](x, y, T, H=H, G=HV // H, K=K, BT=BLOCK_TOKENS,
                                                            num_warps=4)
    return y


if triton is not None:
    @triton.jit
    def _group_sum_kernel(x, y, n_tok, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
        """One program per (BT tokens, key head): its G value heads' rows added in order."""
        t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
        h = tl.program_id(1)
        k = tl.arange(0, K)
        m = (t < n_tok)[:, None]
        acc = tl.zeros([BT, K], dtype=tl.float32)
        for j in tl.static_range(G):
            acc += tl.load(x + (t[:, None] * (H * G) + h * G + j) * K + k[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(y + (t[:, None] * H + h) * K + k[None, :], acc.to(y.dtype.element_ty), mask=m)
