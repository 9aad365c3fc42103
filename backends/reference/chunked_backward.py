"""The chunked backward in the form the sm90 kernels use (Tb = T diag(beta), the new values made from X),
in PyTorch: the stage-by-stage definition the TileLang backward (issue 6, docs/sm90-design.md)
is checked against, as ChunkTrace serves the forward.

Per chunk, with S0 the state entering it (docs/sm90-design.md has the equations):

    X = V - diag(Gamma) K S0,  U = Tb X,  O = s (diag(Gamma) Q S0 + P U),  P = Q K^T (.) D_incl,
    S_end = Gamma_C S0 + K^T diag(Gamma_C / Gamma) U

and right to left over the chunks, dS_end -> dS0. tests/test_reference.py checks every gradient against
autograd through the recurrent definition, in float64.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from gdnkit.prep import floor_gate, floor_gate_backward

from .chunked import CHUNK, to_chunks, chunked_gdn


class ChunkGrads(NamedTuple):
    dq: torch.Tensor      # [B, T, HV, K] per value head (GVA callers sum the heads of one q/k head)
    dk: torch.Tensor      # [B, T, HV, K] per value head
    dv: torch.Tensor      # [B, T, HV, V]
    dg: torch.Tensor      # [B, T, HV]
    dbeta: torch.Tensor   # [B, T, HV]
    dh0: torch.Tensor     # [B, HV, K, V]
    dU: torch.Tensor      # [B, HV, NT, C, V] the new values' gradient per chunk (stage checks)
    dh: torch.Tensor      # [B, HV, NT, K, V] dS_end of every chunk (stage checks)


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, HV, NT, C, ...] -> [B, T, HV, ...]."""
    B, HV, NT, C = x.shape[:4]
    return x.movedim(1, 3).reshape(B, NT * C, HV, *x.shape[4:])[:, :T]


def chunked_gdn_backward(q, k, v, g, beta, scale: float, do, h0=None, dht=None, chunk: int = CHUNK
                         ) -> ChunkGrads:
    """Gradients of chunked_gdn's (o, final state) for the output gradient `do` and final-state gradient
    `dht` (None: zero). q and k have HV heads (repeat them for GVA), as chunked_gdn takes them. Gates below
    prep.GATE_FLOOR are floored, as chunked_gdn floors them, and get a zero gradient; inputs are finite."""
    g_unfloored, g = g, floor_gate(g)
    B, T, HV, K = k.shape
    V = v.shape[-1]
    C = chunk
    NT = -(-T // C)
    _, _, tr = chunked_gdn(q, k, v, g, beta, scale, h0, chunk)
    qc, kc, vc, doc = (to_chunks(x, NT, C) for x in (q, k, v, do))
    bc = to_chunks(beta, NT, C)
    gamma, T_m, h = tr.gamma, tr.T, tr.h
    Gam = torch.exp(gamma)                                   # [B, HV, NT, C]
    e = torch.exp(gamma[..., -1:] - gamma)                   # Gamma_C / Gamma_t
    incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    D = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~incl, float("-inf")))
    P = (qc @ kc.transpose(-1, -2)) * D
    Tb = T_m * bc[..., None, :]

    # the sequential part, right to left: dU and dS0 per chunk
    dS = dht.clone() if dht is not None else k.new_zeros(B, HV, K, V)
    dUs, dXs, dhs = [None] * NT, [None] * NT, [None] * NT
    for n in reversed(range(NT)):
        dhs[n] = dS
        dUs[n] = scale * P[:, :, n].transpose(-1, -2) @ doc[:, :, n] + e[:, :, n, :, None] * (kc[:, :, n] @ dS)
        dXs[n] = Tb[:, :, n].transpose(-1, -2) @ dUs[n]
        dS = (scale * qc[:, :, n].transpose(-1, -2) @ (Gam[:, :, n, :, None] * doc[:, :, n])
              + Gam[:, :, n, -1, None, None] * dS
              - kc[:, :, n].transpose(-1, -2) @ (Gam[:, :, n, :, None] * dXs[n]))
    dU, dX, dhe = torch.stack(dUs, 2), torch.stack(dXs, 2), torch.stack(dhs, 2)   # dhe: dS_end of every chunk
    # everything else per chunk, from h (S0 of every chunk)
    dq, dk, dg, dbeta = chunk_local_grads(qc, kc, vc, doc, bc, gamma, T_m, h, dU, dX, dhe, scale)
    dg = floor_gate_backward(g_unfloored, _from_chunks(dg, T))
    return ChunkGrads(_from_chunks(dq, T), _from_chunks(dk, T), _from_chunks(dX, T), dg,
                      _from_chunks(dbeta, T), dS, dU, dhe)


def chunk_local_grads(qc, kc, vc, doc, bc, gamma, T_m, S0, dU, dX, dhe, scale: float):
    """The backward's parallel part for chunks of C rows (any leading dims; rows past a sequence's end are
    zero, as to_chunks pads them): from the state S0 entering each chunk, its dS_end (dhe), dU and dX, the
    gradients w.r.t. q and k (per value head), g and beta. backends/tilelang_sm90/chunk_grads.py computes this
    per (chunk, value head)."""
    C = qc.shape[-2]
    Gam = torch.exp(gamma)
    e = torch.exp(gamma[..., -1:] - gamma)
    incl = torch.ones(C, C, dtype=torch.bool, device=qc.device).tril()
    D = torch.exp((gamma[..., :, None] - gamma[..., None, :]).masked_fill(~incl, float("-inf")))
    KK = kc @ kc.transpose(-1, -2)
    QK = qc @ kc.transpose(-1, -2)
    Tb = T_m * bc[..., None, :]
    X = vc - Gam[..., None] * (kc @ S0)
    U = Tb @ X
    dP = scale * doc @ U.transpose(-1, -2)
    dPD = dP * D
    dq = scale * Gam[..., None] * (doc @ S0.transpose(-1, -2)) + dPD @ kc
    dk = (dPD.transpose(-1, -2) @ qc + e[..., None] * (U @ dhe.transpose(-1, -2))
          - Gam[..., None] * (dX @ S0.transpose(-1, -2)))
    dTb = dU @ X.transpose(-1, -2)
    dT = dTb * bc[..., None, :]
    dbeta = (dTb * T_m).sum(-2)
    strict = incl.tril(-1)
    dA = (-(T_m.transpose(-1, -2) @ dT @ T_m.transpose(-1, -2))).masked_fill(~strict, 0)
    dbeta = dbeta + (dA * KK * D).sum(-1)
    H = dA * bc[..., :, None] * D                            # d(K K^T) from A
    dk = dk + H @ kc + H.transpose(-1, -2) @ kc
    dD = dP * QK + dA * bc[..., :, None] * KK                 # both on or below the diagonal
    dDD = (dD * D).masked_fill(~incl, 0)
    dgam = dDD.sum(-1) - dDD.sum(-2)
    dgam = dgam + scale * Gam * (doc * (qc @ S0)).sum(-1)     # diag(Gamma) Q S0
    dgam = dgam - Gam * (dX * (kc @ S0)).sum(-1)              # diag(Gamma) K S0 in X
    de = ((kc @ dhe) * U).sum(-1) * e                         # Gamma_C / Gamma_t
    dgam = dgam - de
    last = Gam[..., -1] * (S0 * dhe).sum((-1, -2)) + de.sum(-1)   # Gamma_C: the state carry and the decays
    dgam = dgam + torch.nn.functional.pad(last[..., None], (C - 1, 0))
    dg = dgam.flip(-1).cumsum(-1).flip(-1)                   # gamma = cumsum(g) within the chunk
    return dq, dk, dg, dbeta
