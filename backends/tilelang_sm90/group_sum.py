"""The fused backward's dq / dk, written per chunk and value head (backward_fused.py: dqk [n_chunks, HV, 2, 64, K],
dq's rows then dk's, in S0's buffer), summed over each key head's group of value heads (GVA) in value head order
with fp32 sums and written in the gradients' dtype at their tokens: one Triton launch for both. torch's reduction
over the group dimension and the cast after it took 0.76 ms of the fused path's 4.7 at 16/32 1x32768 (both
tensors; H200, session 16's stages), ~3x what their ~0.8 GB of reads and writes take at the HBM's rate."""
from __future__ import annotations

import os

import torch

from gdnkit import seqlayout

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch form below serves
    triton = None


def chunk_group_sums(dqk: torch.Tensor, layout, H: int, total: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """dqk [n_chunks, HV, 2, C, K] -> (dq, dk) [1, total, H, K] in dtype: each token's rows from its chunk's slots
    (layout: seqlayout.SequenceLayout, whose chunks dqk's are; a tail chunk's rows past its sequence are not
    read), each key head's HV // H value heads summed in order in fp32. Tokens past the last sequence are zero."""
    n_chunks, HV, _, C, K = dqk.shape
    dq, dk = (seqlayout.packed_output((1, total, H, K), layout.cu_seqlens, device=dqk.device, dtype=dtype)
              for _ in range(2))
    if not n_chunks:
        return dq, dk
    if triton is None or (dqk.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1"):
        _sums_torch(dqk, layout, H, dq, dk)
    else:
        _chunk_group_sums_kernel[(n_chunks, H)](dqk, layout.chunk_indices, layout.cu_seqlens, dq, dk, H=H,
                                                G=HV // H, C=C, K=K, num_warps=4)
    return dq, dk


def _sums_torch(dqk, layout, H, dq, dk):
    n_chunks, HV, _, C, K = dqk.shape
    seq, within = layout.chunk_indices.long().unbind(1)
    cu = layout.cu_seqlens.long()
    tokens = cu[seq][:, None] + within[:, None] * C + torch.arange(C, device=dqk.device)   # [n_chunks, C]
    valid = tokens < cu[seq + 1][:, None]
    sums = dqk.view(n_chunks, H, HV // H, 2, C, K).float().sum(2)                            # [n_chunks, H, 2, C, K]
    for which, out in enumerate((dq, dk)):
        out[0, tokens[valid]] = sums[:, :, which].transpose(1, 2)[valid].to(out.dtype)


if triton is not None:
    @triton.jit
    def _chunk_group_sums_kernel(dqk, chunk_indices, cu_seqlens, dq, dk, H: tl.constexpr, G: tl.constexpr,
                                 C: tl.constexpr, K: tl.constexpr):
        """One program per (chunk, key head): its G value heads' dq rows added in order, then their dk rows."""
        c = tl.program_id(0)
        h = tl.program_id(1)
        seq = tl.load(chunk_indices + 2 * c)
        t0 = tl.load(cu_seqlens + seq) + tl.load(chunk_indices + 2 * c + 1) * C
        r = tl.arange(0, C)
        k = tl.arange(0, K)
        m = (t0 + r < tl.load(cu_seqlens + seq + 1))[:, None]
        rows = (t0 + r).to(tl.int64)[:, None]
        for which in tl.static_range(2):
            acc = tl.zeros([C, K], dtype=tl.float32)
            for j in tl.static_range(G):
                slot = ((c * (H * G) + h * G + j) * 2 + which).to(tl.int64) * (C * K)
                acc += tl.load(dqk + slot + r[:, None] * K + k[None, :], mask=m, other=0.0).to(tl.float32)
            out = dq if which == 0 else dk
            tl.store(out + (rows * H + h) * K + k[None, :], acc.to(out.dtype.element_ty), mask=m)
