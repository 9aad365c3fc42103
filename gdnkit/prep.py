"""Math every backend shares: the in-kernel options as plain PyTorch, and varlen index prep.

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


def seq_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of every sequence; reads the offsets to the host (one sync on a GPU tensor)."""
    offsets = cu_seqlens.tolist()
    return list(zip(offsets[:-1], offsets[1:]))


def chunk_indices(cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """[num_chunks, 2] (sequence, chunk-within-sequence) for every chunk of a packed batch.

    Kernels launch one program per chunk from this table; compute it once per cu_seqlens (it costs a
    host sync) and pass it along to keep the call capturable in a CUDA graph.
    """
    offsets = chunk_offsets(cu_seqlens, chunk)
    n_chunks = offsets[1:] - offsets[:-1]
    seq = torch.repeat_interleave(torch.arange(len(n_chunks), device=cu_seqlens.device), n_chunks)
    within = torch.arange(len(seq), device=cu_seqlens.device) - offsets[:-1][seq]
    return torch.stack([seq, within], 1)


def chunk_offsets(cu_seqlens: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """[N + 1]: row of chunk_indices' table where each sequence's chunks begin (the last entry: their count)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n_chunks = (lengths + chunk - 1) // chunk
    return torch.cat([n_chunks.new_zeros(1), torch.cumsum(n_chunks, 0)])
