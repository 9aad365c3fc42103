"""The chunked (WY/UT-transform) form of the gated delta rule, as the fast kernels compute it.

Same prepared-tensor convention as recurrent.py. Every intermediate the kernels produce is returned
in a ChunkTrace so a kernel can be checked stage by stage (docs/algorithm.md, section 2, names them).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from gdnkit.prep import CHUNK


class ChunkTrace(NamedTuple):
    """Intermediates per batch row, value head and chunk (NT chunks of C tokens, tail zero-padded)."""

    gamma: torch.Tensor  # [B, HV, NT, C]     chunk-local cumulative log-gate
    A: torch.Tensor  # [B, HV, NT, C, C]  strictly lower diag(beta) (K K^T * D)
    T: torch.Tensor  # [B, HV, NT, C, C]  (I + A)^-1, unit lower-triangular
    W: torch.Tensor  # [B, HV, NT, C, K]  T diag(beta * Gamma) K
    U_prime: torch.Tensor  # [B, HV, NT, C, V]  T diag(beta) V (state-independent new values)
    U: torch.Tensor  # [B, HV, NT, C, V]  U' - W S0 (the new values)
    h: torch.Tensor  # [B, HV, NT, K, V]  state entering each chunk


def _to_chunks(x: torch.Tensor, NT: int, C: int) -> torch.Tensor:
    """[B, T, HV, ...] -> [B, HV, NT, C, ...], zero-padding T up to NT * C."""
    B, T, HV = x.shape[:3]
    pad = NT * C - T
    if pad:
        x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
    x = x.reshape(B, NT, C, HV, *x.shape[3:])
    return x.movedim(3, 1)


def chunked_gdn(q, k, v, g, beta, scale: float, h0: torch.Tensor | None = None, chunk: int = CHUNK
                ) -> tuple[torch.Tensor, torch.Tensor, ChunkTrace]:
    """Returns o [B, T, HV, V], the final state [B, HV, K, V] and the ChunkTrace.

    Padding the tail with g = 0, beta = 0, k = v = 0 leaves the state untouched, so T need not be
    a multiple of the chunk.
    """
    B, T, HV, K = k.shape
    V = v.shape[-1]
    C = chunk
    NT = -(-T // C)
    qc, kc, vc = (_to_chunks(x, NT, C) for x in (q, k, v))
    gc = _to_chunks(g, NT, C)
    bc = _to_chunks(beta, NT, C)

    gamma = gc.cumsum(-1)
    Gamma = torch.exp(gamma)
    incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    strict = incl.tril(-1)
    # D[t, s] = exp(gamma_t - gamma_s) for s <= t; mask before the exp (positive above, overflows).
    D = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~incl, float("-inf")))

    A = (bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * D).masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    W = Tm @ ((bc * Gamma)[..., None] * kc)
    U_prime = Tm @ (bc[..., None] * vc)
    QK = (qc @ kc.transpose(-1, -2)) * D  # D is 0 above the diagonal: causal within the chunk
    decay_to_end = torch.exp(gamma[..., -1:] - gamma)  # Gamma_C / Gamma_t

    S = h0 if h0 is not None else k.new_zeros(B, HV, K, V)
    states, news, outs = [], [], []
    for n in range(NT):  # the only sequential part: the state pass over chunks
        states.append(S)
        U = U_prime[:, :, n] - W[:, :, n] @ S
        news.append(U)
        outs.append(scale * (Gamma[:, :, n, :, None] * (qc[:, :, n] @ S) + QK[:, :, n] @ U))
        Kt = decay_to_end[:, :, n, :, None] * kc[:, :, n]
        S = Gamma[:, :, n, -1, None, None] * S + Kt.transpose(-1, -2) @ U

    def stack(xs, shape):
        return torch.stack(xs, 2) if xs else k.new_zeros(shape)

    h = stack(states, (B, HV, 0, K, V))
    U_all = stack(news, (B, HV, 0, C, V))
    o = stack(outs, (B, HV, 0, C, V))
    o = o.movedim(1, 3).reshape(B, NT * C, HV, V)[:, :T]
    return o, S, ChunkTrace(gamma, A, Tm, W, U_prime, U_all, h)
