"""Math every backend shares: the in-kernel options as plain PyTorch (varlen layout: gdnkit.seqlayout).

Fast kernels fuse these; the reference backend (and any prologue) uses them as written here, so
their meaning is decided in exactly one place.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

CHUNK = 64
L2NORM_EPS = 1e-6
# The chunked form's floor on the log-gate g (docs/semantics.md, "Non-finite inputs and gate resets" and
# "Precision of the chunked form"). g = -inf is a hard reset (exp(g) = 0), but the chunked form works with
# differences of in-chunk cumulative sums, and -inf - -inf is NaN. Clamped here, a reset keeps exp(-30) ~ 9.4e-14 of
# the state, below fp32's resolution (2^-24 ~ 6e-8) by six orders of magnitude; and |F| bounds what one token adds
# to the cumulative sum, so the rounding error of a decay between two tokens is at most ~|F| * eps_fp32 per token at
# the floor between or before them in the chunk (a spike of -1e4 costs ~1.8e-6 instead of ~6e-4). Gates of
# ordinary models stay far above it (logsigmoid of a unit normal: > -10 with overwhelming probability), where
# the clamp is the identity, bit for bit.
GATE_FLOOR = -30.0


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's use_qk_l2norm_in_kernel)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """use_gate_in_kernel: log-decay g = -exp(A_log) * softplus(g + dt_bias), per value head."""
    if dt_bias is not None:
        g = g + dt_bias.to(g.dtype)
    return -torch.exp(A_log.to(g.dtype)) * F.softplus(g)


def floor_gate(g: torch.Tensor) -> torch.Tensor:
    """g clamped from below at GATE_FLOOR (the chunked form's log-gates): -inf becomes a reset to within
    exp(GATE_FLOOR); NaN stays NaN. Its gradient is zero below the floor, where d exp(g) / dg = exp(g) < 1e-13."""
    return g.clamp_min(GATE_FLOOR)


@functools.lru_cache(maxsize=16)
def _zero(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A 0-dim zero on `device`, never written: torch.where turns a Python scalar into a new device tensor each call,
    one fill launch that an eager backward felt (H100 profile, benchmarks/results/h100/host-time.md). Made once per
    device and dtype; one made during a CUDA-graph capture keeps its block of the graph's pool while kept."""
    return torch.zeros((), device=device, dtype=dtype)


def floor_gate_backward(g: torch.Tensor, dg: torch.Tensor) -> torch.Tensor:
    """dg w.r.t. floor_gate's input g from dg w.r.t. its output: zero where g was below the floor (or NaN)."""
    return torch.where(g >= GATE_FLOOR, dg, _zero(dg.device, dg.dtype))


def beta_activation(beta: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """use_beta_sigmoid_in_kernel: beta = sigmoid(beta), times 2 with allow_neg_eigval (range [0, 2))."""
    beta = torch.sigmoid(beta)
    return beta * 2 if allow_neg_eigval else beta
