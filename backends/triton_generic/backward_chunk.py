"""Per chunk and K block, in parallel: the gradients that flow through the output and the state update
(docs/algorithm.md section 5), given the chunk's S0 (h), dS_end (dh), U, dO and dU:

    dQ  = scale (diag(Gamma) dO S0^T + ((dO U^T) (.) D_incl) K)
    dK  = scale ((dO U^T) (.) D_incl)^T Q + diag(Gamma_C / Gamma) U dS_end^T      (WY terms come later)
    dW  = -dU S0^T
and this chunk's share of dgamma from Gamma, D_incl, Gamma_C and Kt. Every piece is a sum over K, so
each K block writes its own dgamma partial and backward_wy.py adds them up. dQ and dK are summed over the
value heads that share a key head (GVA) as they are written, one launch per value head of the group.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnkit.seqlayout import packed_output

from ..triton_shared.jit_helpers import chunk_rows, decay, dot_precision, grid_3d
from ..triton_shared.launch import launch
from ..triton_shared.sizes import cdiv, flat_grid, next_power_of_2


# K block width of the per-chunk gradient kernel (see backward_chunk); a knob for GPU A/B runs.
BLOCK_K = 64


@triton.jit(do_not_specialize=["T", "J", "N0", "N1", "B"])
def backward_chunk_kernel(q, k, vnew, h, dh, gcum, do, du, dq, dk, dw, dgp, cu_seqlens, chunk_indices, T, scale, J,
                          N0, N1, B,
                          H, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, IS_VARLEN: tl.constexpr, ACCUMULATE: tl.constexpr, PREC: tl.constexpr):
    """One launch per value head of a key head's group (J = 0 .. HV / H - 1), one program per (K block, chunk,
    key head): value head i_hk * HV / H + J. dQ and dK go to the key head's rows, summed over the group by
    the launches in turn (ACCUMULATE: every launch after the first adds to what the earlier ones stored; a
    fixed order, no atomics), so no per-value-head dq / dk exists in memory. dW and the dgamma partials are
    per value head."""
    i_k, pid_t, i_bk = grid_3d(N0, N1)
    i_b, i_hk = i_bk // H, i_bk % H
    i_h = i_hk * (HV // H) + J
    bos, L, i_t, i_c, r, m = chunk_rows(pid_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    dt = k.dtype.element_ty
    o64 = tl.arange(0, 64)
    ck = i_k * BK + tl.arange(0, BK)
    hb = h + (i_c * HV + i_h) * K * V
    dhb = dh + (i_c * HV + i_h) * K * V
    vb = vnew + (bos * HV + i_h) * V
    dob = do + (bos * HV + i_h) * V
    dub = du + (bos * HV + i_h) * V

    # Two passes over V, each with two accumulators (all four in one pass spilled at 8 warps, sm90 build):
    # the state-gradient side (dW, U dS_end^T, <S0, dS_end>), then the output side (dO S0^T, dO U^T).
    dkt = tl.zeros([64, BK], dtype=tl.float32)    # U dS_end^T
    dww = tl.zeros([64, BK], dtype=tl.float32)    # -dU S0^T
    sdh = tl.zeros([BK], dtype=tl.float32)        # <S0, dS_end>, this K block's rows
    for iv in range(0, V, BV):
        cv = iv + tl.arange(0, BV)
        mv = cv < V
        mt = m[:, None] & mv[None, :]
        hh = tl.load(hb + ck[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
        dhh = tl.load(dhb + ck[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
        vv = tl.load(vb + r[:, None] * (HV * V) + cv[None, :], mask=mt, other=0.0)
        dU = tl.load(dub + r[:, None] * (HV * V) + cv[None, :], mask=mt, other=0.0).to(dt)
        dkt += tl.dot(vv, tl.trans(dhh.to(dt)), input_precision=PREC)
        dww -= tl.dot(dU, tl.trans(hh.to(dt)), input_precision=PREC)
        sdh += tl.sum(hh.to(tl.float32) * dhh.to(tl.float32), 1)
    tl.store(dw + (bos * HV + i_h) * K + r[:, None] * (HV * K) + ck[None, :], dww.to(dw.dtype.element_ty),
             mask=m[:, None])

    hq = tl.zeros([64, BK], dtype=tl.float32)     # dO S0^T
    dA = tl.zeros([64, 64], dtype=tl.float32)     # dO U^T
    for iv in range(0, V, BV):
        cv = iv + tl.arange(0, BV)
        mv = cv < V
        mt = m[:, None] & mv[None, :]
        hh = tl.load(hb + ck[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
        vv = tl.load(vb + r[:, None] * (HV * V) + cv[None, :], mask=mt, other=0.0)
        dd = tl.load(dob + r[:, None] * (HV * V) + cv[None, :], mask=mt, other=0.0).to(dt)
        hq += tl.dot(dd, tl.trans(hh.to(dt)), input_precision=PREC)
        dA += tl.dot(dd, tl.trans(vv), input_precision=PREC)

    # Each tile below is consumed as early as it can be and stored at once: the row sums that need hq and
    # dkt, then dQ, dK, and the 64 x 64 products last (program order sets what is live together)
    off = (bos * H + i_hk) * K + r[:, None] * (H * K) + ck[None, :]    # q, k, dq, dk: the key head's rows
    qq = tl.load(q + off, mask=m[:, None], other=0.0)
    kk = tl.load(k + off, mask=m[:, None], other=0.0)
    gg = tl.load(gcum + (bos + r) * HV + i_h, mask=m, other=0.0)
    last = tl.minimum(i_t * 64 + 64, L) - 1 - i_t * 64
    g_last = tl.load(gcum + (bos + i_t * 64 + last) * HV + i_h)

    kscale = tl.where(m, tl.exp2(g_last - gg), 0.0)
    dkt = dkt * kscale[:, None]
    Z = tl.sum(dkt * kk.to(tl.float32), 1)
    hq = hq * (tl.exp2(gg) * scale)[:, None]
    dgam = tl.sum(hq * qq.to(tl.float32), 1) - Z
    dgam += tl.where(o64 == last, tl.sum(Z, 0) + tl.exp2(g_last) * tl.sum(sdh, 0), 0.0)

    P = dA * decay(gg, gg, (o64[:, None] >= o64[None, :]) & m[:, None] & m[None, :]) * scale
    dQ = hq + tl.dot(P.to(dt), kk, input_precision=PREC)
    if ACCUMULATE:
        dQ = tl.load(dq + off, mask=m[:, None], other=0.0) + dQ
    tl.store(dq + off, dQ, mask=m[:, None])
    dK = tl.dot(tl.trans(P.to(dt)), qq, input_precision=PREC) + dkt
    if ACCUMULATE:
        dK = tl.load(dk + off, mask=m[:, None], other=0.0) + dK
    tl.store(dk + off, dK, mask=m[:, None])
    M = P * tl.dot(qq, tl.trans(kk), input_precision=PREC)
    dgam += tl.sum(M, 1) - tl.sum(M, 0)
    tl.store(dgp + i_k.to(tl.int64) * B * T * HV + (bos + r) * HV + i_h, dgam, mask=m)


def backward_chunk(q, k, vnew, h, dh, gcum, do, du, scale, T, grid_t, cu_seqlens, chunk_indices):
    """Returns dq and dk (partial: backward_wy adds the WY terms), both [B,T,H,K] fp32 summed over each key
    head's value heads, dW [B,T,HV,K] in k's dtype (backward_wy takes it as a product operand only), and
    dgamma partials [NK,B,T,HV] fp32."""
    B, _, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    # Tiles no narrower than 64 (BLOCK_K): a 32-wide K block made most products here wgmmas of N = 32
    # (N = 16 per warpgroup) on 64-byte-swizzled shared operands, a form no forward kernel uses and the
    # suspect of the backward's illegal memory access on the H200 (Triton 3.6; the addresses themselves are in
    # bounds, tests/test_triton_generic.py checks them). At the launch table's 4 warps / 3 stages: 248
    # registers (252 for the launches that ACCUMULATE), no spills (sm90 build, Triton 3.6; the later figures
    # from an offline build, triton.compile + cuobjdump -res-usage, pointers 16-byte aligned as launched).
    BK = min(BLOCK_K, K)
    BV = min(64, next_power_of_2(V))
    NK = cdiv(K, BK)
    dev = q.device
    # Per key head, summed in the kernels: per value head, fp32 dq and dk were the backward's largest buffers
    # (2 x 512 MiB at 16/32 1x32768), live with h and dh at its memory peak. The group's launches in turn
    # rather than one program walking the group: a loop over the value heads around this body spilled (the
    # compiler keeps loop-invariant tiles live across it; sm90, Triton 3.6: 248 registers -> 255 + 320 bytes).
    dq, dk = (packed_output((B, T, H, K), cu_seqlens, device=dev, dtype=torch.float32) for _ in range(2))
    dw = packed_output((B, T, HV, K), cu_seqlens, device=dev, dtype=k.dtype)
    dgp = packed_output((NK, B, T, HV), cu_seqlens, token_dim=2, device=dev, dtype=torch.float32)
    for j in range(HV // H):
        launch("backward_chunk", q.dtype, backward_chunk_kernel, flat_grid(NK, grid_t, B * H),
            q, k, vnew, h, dh, gcum, do, du, dq, dk, dw, dgp, cu_seqlens, chunk_indices, T, scale, j, NK, grid_t, B,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None, ACCUMULATE=j > 0,
            PREC=dot_precision(q.dtype))
    return dq, dk, dw, dgp
