"""The device-side check that a caller's CUDA cu_seqlens still holds the offsets gdnkit read from it earlier
(gdnkit/seqlayout.py says why every call that uses cached offsets enqueues one), in one launch.

torch's form, (cu == own).all() and then torch._assert_async, is three launches (~44 us of host time an eager
forward on the H100's host, benchmarks/results/h100/host-time.md). Here one program compares both and fails a
device assert on any difference: the kernel is built with debug=True, the build option that keeps tl.device_assert
(it compiles to nothing otherwise). No sync, capturable; a failed assert ends the CUDA context as torch's does."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import enqueue

BLOCK_MAX = 1024


@triton.jit(debug=True, do_not_specialize=["n"])   # one build whatever the number of offsets
def _offsets_agree_kernel(cu, own, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        inside = i < n
        a = tl.load(cu + i, mask=inside, other=0).to(tl.int64)
        b = tl.load(own + i, mask=inside, other=0).to(tl.int64)
        tl.device_assert(a == b, "cu_seqlens no longer holds the offsets gdnkit read from it (a write torch "
                                 "could not see, or a CUDA graph replayed after the buffer changed)")


def assert_offsets_agree(cu_seqlens: torch.Tensor, own: torch.Tensor) -> None:
    """Enqueue the check that cu_seqlens (the caller's, any integer dtype) equals own (the layout's int32 copy);
    both on one CUDA device, one dimension, the same length."""
    n = own.numel()
    enqueue(_offsets_agree_kernel, (1,), cu_seqlens, own, n, BLOCK=min(triton.next_power_of_2(max(n, 1)), BLOCK_MAX),
            num_warps=4)
