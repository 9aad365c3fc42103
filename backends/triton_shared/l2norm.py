"""use_qk_l2norm_in_kernel's normalisation of q and k and its backward, one Triton pass each (gdnkit/prologue.py
takes them for tensors a Triton kernel can read; its torch form serves elsewhere).

    y = x * rstd,  rstd = 1 / sqrt(sum(x^2) + eps)     over the last dim, in fp32, y in x's dtype
    dx = rstd * (dy - y (y . dy))                        y made again from x and rstd, dx in x's dtype

The torch form took ~5 passes over an fp32 copy of each tensor forward (the cast, the square, the sum, the
scaling, the cast back) and ~6 backward, each as many bytes as a bf16 q or k twice over (16/32 1x32768: q and k
are 128 MB each in bf16). These read x once and write y and rstd (or read x, rstd, dy and write dx) once. The
kernels and torch's form agree to fp32 rounding: the row sum's order differs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnkit.prep import L2NORM_EPS

from .launch import launch
from .sizes import cdiv, next_power_of_2

ELEMENTS = 4096   # a program's [ROWS, BK] tile: 32 values a thread at 4 warps


@triton.jit
def l2norm_forward_kernel(x, y, rstd, n_rows, K: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr,
                          EPS: tl.constexpr):
    """ROWS rows of x [n_rows, K] a program: y and rstd [n_rows]."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BK)
    row_in = r < n_rows
    m = row_in[:, None] & (c < K)[None, :]
    off = r[:, None] * K + c[None, :]
    b = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
    s = 1.0 / tl.sqrt(tl.sum(b * b, axis=1) + EPS)
    tl.store(y + off, (b * s[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(rstd + r, s, mask=row_in)


@triton.jit
def l2norm_backward_kernel(x, rstd, dy, dx, n_rows, K: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr):
    """ROWS rows a program: dx [n_rows, K] from x, rstd [n_rows] and dy [n_rows, K] (fp32 or x's dtype)."""
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BK)
    row_in = r < n_rows
    m = row_in[:, None] & (c < K)[None, :]
    off = r[:, None] * K + c[None, :]
    s = tl.load(rstd + r, mask=row_in, other=0.0)
    yv = tl.load(x + off, mask=m, other=0.0).to(tl.float32) * s[:, None]
    g = tl.load(dy + off, mask=m, other=0.0).to(tl.float32)
    proj = tl.sum(yv * g, axis=1)
    tl.store(dx + off, (s[:, None] * (g - yv * proj[:, None])).to(dx.dtype.element_ty), mask=m)


def _tile(K: int) -> tuple[int, int]:
    """(BK, ROWS) for rows of K elements."""
    BK = next_power_of_2(K)
    return BK, max(1, ELEMENTS // BK)


def l2norm_forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y in x's dtype and shape, rstd [..., 1] fp32) of x [..., K]."""
    x = x.contiguous()
    K = x.shape[-1]
    y = torch.empty_like(x)
    rstd = torch.empty(*x.shape[:-1], 1, device=x.device, dtype=torch.float32)
    n = x.numel() // K if K else 0
    if n:
        BK, ROWS = _tile(K)
        launch("l2norm", x.dtype, l2norm_forward_kernel, (cdiv(n, ROWS),), x, y, rstd, n, K=K, BK=BK, ROWS=ROWS,
               EPS=L2NORM_EPS)
    return y, rstd


def l2norm_backward(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dx in x's dtype and shape from l2norm_forward's x and rstd and the gradient dy of y (x's shape)."""
    x, rstd, dy = x.contiguous(), rstd.contiguous(), dy.contiguous()
    K = x.shape[-1]
    dx = torch.empty_like(x)
    n = x.numel() // K if K else 0
    if n:
        BK, ROWS = _tile(K)
        launch("l2norm", x.dtype, l2norm_backward_kernel, (cdiv(n, ROWS),), x, rstd, dy, dx, n, K=K, BK=BK,
               ROWS=ROWS)
    return dx
