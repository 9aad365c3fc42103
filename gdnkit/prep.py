"""Math every backend shares: the in-kernel options as plain PyTorch (varlen layout: gdnkit.seqlayout).

Fast kernels fuse these; the reference backend (and any prologue) uses them as written here, so
their meaning is decided in exactly one place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's use_qk_l2norm_in_kernel)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """use_gate_in_kernel: log-decay g = -exp(A_log) * softplus(g + dt_bias), per value head."""
    if dt_bias is not None:
        g = g + dt_bias.to(g.dtype)
    return -torch.exp(A_log.to(g.dtype)) * F.softplus(g)


def beta_activation(beta: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """use_beta_sigmoid_in_kernel: beta = sigmoid(beta), times 2 with allow_neg_eigval (range [0, 2))."""
    beta = torch.sigmoid(beta)
    return beta * 2 if allow_neg_eigval else beta
