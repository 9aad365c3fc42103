"""The chunked (WY/UT-transform) form of the gated delta rule, as the fast kernels compute it.

Same prepared-tensor convention as recurrent.py. Every intermediate the kernels produce is returned
in a ChunkTrace so a kernel can be checked stage by stage (docs/algorithm.md, section 2, names them).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from gdnkit.prep import CHUNK, floor_gate


class ChunkTrace(NamedTuple):
    """Intermediates per batch row, value head and chunk (NT chunks of C tokens, tail zero-padded)."""

    gamma: torch.Tensor  # [B, HV, NT, C]     chunk-local cumulative log-gate
    A: torch.Tensor  # [B, HV, NT, C, C]  strictly lower diag(beta) (K K^T * D)
    T: torch.Tensor  # [B, HV, NT, C, C]  (I + A)^-1, unit lower-triangular
    W: torch.Tensor  # [B, HV, NT, C, K]  T diag(beta * Gamma) K
    U_prime: torch.Tensor  # [B, HV, NT, C, V]  T diag(beta) V (state-independent new values)
    U: torch.Tensor  # [B, HV, NT, C, V]  U' - W S0 (the new values)
    h: torch.Tensor  # [B, HV, NT, K, V]  state entering each chunk


def to_chunks(x: torch.Tensor, NT: int, C: int) -> torch.Tensor:
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

    Gates are floored at prep.GATE_FLOOR (g = -inf: a reset). Non-finite inputs stay causal: a token whose
    k, v, g or beta is not finite (g = -inf excepted) makes the output NaN from that token on and the final
    state NaN; a non-finite q makes its own output NaN. The products of the chunked form would otherwise spread
    them to the chunk's earlier rows (0 * NaN), so such tokens enter the computation as zeros and the NaNs are
    put back afterwards; the ChunkTrace holds the zeroed form's intermediates.
    """
    g = floor_gate(g)
    (q, k, v, g, beta), poisoned = _zero_non_finite(q, k, v, g, beta)
    o, S, trace = _chunked(q, k, v, g, beta, scale, h0, chunk)
    if poisoned is not None:
        o_nan, state_nan = poisoned
        o = torch.where(o_nan[..., None], float("nan"), o)
        S = torch.where(state_nan[..., None, None], float("nan"), S)
    return o, S, trace


def _zero_non_finite(q, k, v, g, beta):
    """(the inputs with their non-finite tokens, per (row, value head), zeroed, or as they are where all are finite;
    None or (o's NaN mask [B, T, HV], the final state's [B, HV])): the state is poisoned from the first token
    whose k, v, g or beta is not finite, an output also by its own q."""
    bad_q = ~torch.isfinite(q).all(-1)
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1) & torch.isfinite(g) & torch.isfinite(beta))
    if not (bad | bad_q).any():  # the usual case: the inputs as they are
        return (q, k, v, g, beta), None
    state_bad = bad.cumsum(1) > 0
    # a bad q alone leaves the state's inputs of its token as they are (the state does not read q)
    q = torch.where((bad | bad_q)[..., None], 0.0, q)
    k, v = (torch.where(bad[..., None], 0.0, x) for x in (k, v))
    g, beta = (torch.where(bad, 0.0, x) for x in (g, beta))
    return (q, k, v, g, beta), (state_bad | bad_q, state_bad[:, -1])


def _chunked(q, k, v, g, beta, scale: float, h0, chunk: int):
    """chunked_gdn on finite inputs (g floored)."""
    B, T, HV, K = k.shape
    V = v.shape[-1]
    C = chunk
    NT = -(-T // C)
    qc, kc, vc = (to_chunks(x, NT, C) for x in (q, k, v))
    gc = to_chunks(g, NT, C)
    bc = to_chunks(beta, NT, C)

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
