"""Per chunk, in parallel: gate cumsum, beta-scaled K K^T with the decay mask, the unit lower-triangular
solve T = (I + A)^-1, then W = T diag(beta Gamma) K and U' = T diag(beta) V (ALGORITHM.md section 2).

One kernel: A never leaves the chip. T itself is written out because W/U' are formed as one 64x64 product
(read back after a barrier) and because the backward needs it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import CHUNK, LOG2E, chunk_rows, decay, dot_precision, solve_unit_lower16


@triton.jit
def _load_rows(ptr, rows, row_mask, stride, cols, col_mask):
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit
def _store_band(tb, rows, m, b0, b1, b2, b3, HV: tl.constexpr):
    """One 16-row band of T (rows `rows` of the chunk, valid where m): its four 16 x 16 blocks side by side."""
    p = tb + rows[:, None] * (HV * 64) + tl.arange(0, 16)[None, :]
    dt = tb.dtype.element_ty
    tl.store(p, b0.to(dt), mask=m[:, None])
    tl.store(p + 16, b1.to(dt), mask=m[:, None])
    tl.store(p + 32, b2.to(dt), mask=m[:, None])
    tl.store(p + 48, b3.to(dt), mask=m[:, None])


@triton.jit
def _solve_chunk(k, g, beta, gcum, tmat, bos, L, t0, i_h, i_hk, H: tl.constexpr, HV: tl.constexpr,
                 K: tl.constexpr, BK: tl.constexpr, CUMSUM: tl.constexpr, PREC: tl.constexpr):
    """gamma (stored as gcum when CUMSUM, else read from it), A, and T = (I + A)^-1 stored to tmat."""
    o16 = tl.arange(0, 16)
    r0, r1, r2, r3 = t0 + o16, t0 + 16 + o16, t0 + 32 + o16, t0 + 48 + o16
    m0, m1, m2, m3 = r0 < L, r1 < L, r2 < L, r3 < L
    cb = gcum + bos * HV + i_h
    # chunk-local cumulative gate, per 16-row block plus the running offset of the blocks before it;
    # kept in log2 units so every decay is one exp2
    if CUMSUM:
        gb = g + bos * HV + i_h
        x0 = tl.load(gb + r0 * HV, mask=m0, other=0.0).to(tl.float32) * LOG2E
        x1 = tl.load(gb + r1 * HV, mask=m1, other=0.0).to(tl.float32) * LOG2E
        x2 = tl.load(gb + r2 * HV, mask=m2, other=0.0).to(tl.float32) * LOG2E
        x3 = tl.load(gb + r3 * HV, mask=m3, other=0.0).to(tl.float32) * LOG2E
        g0 = tl.cumsum(x0, 0)
        g1 = tl.cumsum(x1, 0) + tl.sum(x0, 0)
        g2 = tl.cumsum(x2, 0) + tl.sum(x0, 0) + tl.sum(x1, 0)
        g3 = tl.cumsum(x3, 0) + tl.sum(x0, 0) + tl.sum(x1, 0) + tl.sum(x2, 0)
        tl.store(cb + r0 * HV, g0, mask=m0)
        tl.store(cb + r1 * HV, g1, mask=m1)
        tl.store(cb + r2 * HV, g2, mask=m2)
        tl.store(cb + r3 * HV, g3, mask=m3)
    else:
        g0 = tl.load(cb + r0 * HV, mask=m0, other=0.0)
        g1 = tl.load(cb + r1 * HV, mask=m1, other=0.0)
        g2 = tl.load(cb + r2 * HV, mask=m2, other=0.0)
        g3 = tl.load(cb + r3 * HV, mask=m3, other=0.0)
    bb = beta + bos * HV + i_h
    b0 = tl.load(bb + r0 * HV, mask=m0, other=0.0).to(tl.float32)
    b1 = tl.load(bb + r1 * HV, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(bb + r2 * HV, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(bb + r3 * HV, mask=m3, other=0.0).to(tl.float32)

    # the ten lower blocks of K K^T, 16x16 each, accumulated over K
    a00 = tl.zeros([16, 16], dtype=tl.float32)
    a10 = tl.zeros([16, 16], dtype=tl.float32)
    a11 = tl.zeros([16, 16], dtype=tl.float32)
    a20 = tl.zeros([16, 16], dtype=tl.float32)
    a21 = tl.zeros([16, 16], dtype=tl.float32)
    a22 = tl.zeros([16, 16], dtype=tl.float32)
    a30 = tl.zeros([16, 16], dtype=tl.float32)
    a31 = tl.zeros([16, 16], dtype=tl.float32)
    a32 = tl.zeros([16, 16], dtype=tl.float32)
    a33 = tl.zeros([16, 16], dtype=tl.float32)
    kb = k + bos * H * K + i_hk * K
    for ik in tl.static_range(0, K, BK):
        ck = ik + tl.arange(0, BK)
        mk = ck < K
        k0 = _load_rows(kb, r0, m0, H * K, ck, mk)
        k1 = _load_rows(kb, r1, m1, H * K, ck, mk)
        k2 = _load_rows(kb, r2, m2, H * K, ck, mk)
        k3 = _load_rows(kb, r3, m3, H * K, ck, mk)
        a00 += tl.dot(k0, tl.trans(k0), input_precision=PREC)
        a10 += tl.dot(k1, tl.trans(k0), input_precision=PREC)
        a11 += tl.dot(k1, tl.trans(k1), input_precision=PREC)
        a20 += tl.dot(k2, tl.trans(k0), input_precision=PREC)
        a21 += tl.dot(k2, tl.trans(k1), input_precision=PREC)
        a22 += tl.dot(k2, tl.trans(k2), input_precision=PREC)
        a30 += tl.dot(k3, tl.trans(k0), input_precision=PREC)
        a31 += tl.dot(k3, tl.trans(k1), input_precision=PREC)
        a32 += tl.dot(k3, tl.trans(k2), input_precision=PREC)
        a33 += tl.dot(k3, tl.trans(k3), input_precision=PREC)

    low = o16[:, None] > o16[None, :]
    a00 *= decay(g0, g0, low & m0[:, None] & m0[None, :]) * b0[:, None]
    a11 *= decay(g1, g1, low & m1[:, None] & m1[None, :]) * b1[:, None]
    a22 *= decay(g2, g2, low & m2[:, None] & m2[None, :]) * b2[:, None]
    a33 *= decay(g3, g3, low & m3[:, None] & m3[None, :]) * b3[:, None]
    a10 *= decay(g1, g0, m1[:, None] & m0[None, :]) * b1[:, None]
    a20 *= decay(g2, g0, m2[:, None] & m0[None, :]) * b2[:, None]
    a21 *= decay(g2, g1, m2[:, None] & m1[None, :]) * b2[:, None]
    a30 *= decay(g3, g0, m3[:, None] & m0[None, :]) * b3[:, None]
    a31 *= decay(g3, g1, m3[:, None] & m1[None, :]) * b3[:, None]
    a32 *= decay(g3, g2, m3[:, None] & m2[None, :]) * b3[:, None]

    # block forward substitution: diagonal inverses on CUDA cores, the rest as block products,
    # T_ij = -T_ii sum_{j<=m<i} A_im T_mj
    t00 = solve_unit_lower16(a00, o16)
    t11 = solve_unit_lower16(a11, o16)
    t22 = solve_unit_lower16(a22, o16)
    t33 = solve_unit_lower16(a33, o16)
    t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision="ieee"), input_precision="ieee")
    t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision="ieee"), input_precision="ieee")
    t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision="ieee"), input_precision="ieee")
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision="ieee") + tl.dot(a21, t10, input_precision="ieee"),
                  input_precision="ieee")
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision="ieee") + tl.dot(a32, t21, input_precision="ieee"),
                  input_precision="ieee")
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision="ieee") + tl.dot(a31, t10, input_precision="ieee")
                  + tl.dot(a32, t20, input_precision="ieee"), input_precision="ieee")

    tb = tmat + (bos * HV + i_h) * 64
    zero = tl.zeros([16, 16], dtype=tl.float32)
    _store_band(tb, r0, m0, t00, zero, zero, zero, HV)
    _store_band(tb, r1, m1, t10, t11, zero, zero, HV)
    _store_band(tb, r2, m2, t20, t21, t22, zero, HV)
    _store_band(tb, r3, m3, t30, t31, t32, t33, HV)


@triton.jit
def _w_u_chunk(k, v, beta, gcum, tmat, w, u, bos, r, m, i_h, i_hk, H: tl.constexpr, HV: tl.constexpr,
               K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """W = T diag(beta Gamma) K and U' = T diag(beta) V from the stored T (tmat) and gamma (gcum)."""
    dt = k.dtype.element_ty
    kb = k + bos * H * K + i_hk * K
    cb = gcum + bos * HV + i_h
    bb = beta + bos * HV + i_h
    tb = tmat + (bos * HV + i_h) * 64
    o64 = tl.arange(0, 64)
    tt = tl.load(tb + r[:, None] * (HV * 64) + o64[None, :], mask=m[:, None], other=0.0)
    gg = tl.load(cb + r * HV, mask=m, other=0.0)
    bt = tl.load(bb + r * HV, mask=m, other=0.0).to(tl.float32)
    wk = bt * tl.exp2(gg)
    wb = w + (bos * HV + i_h) * K
    for ik in tl.static_range(0, K, BK):
        ck = ik + tl.arange(0, BK)
        mk = ck < K
        kk = _load_rows(kb, r, m, H * K, ck, mk).to(tl.float32)
        ww = tl.dot(tt.to(dt), (kk * wk[:, None]).to(dt), input_precision=PREC)
        tl.store(wb + r[:, None] * (HV * K) + ck[None, :], ww.to(dt), mask=m[:, None] & mk[None, :])
    vb = v + (bos * HV + i_h) * V
    ub = u + (bos * HV + i_h) * V
    for iv in tl.static_range(0, V, BV):
        cv = iv + tl.arange(0, BV)
        mv = cv < V
        vv = _load_rows(vb, r, m, HV * V, cv, mv).to(tl.float32)
        uu = tl.dot(tt.to(dt), (vv * bt[:, None]).to(dt), input_precision=PREC)
        tl.store(ub + r[:, None] * (HV * V) + cv[None, :], uu.to(dt), mask=m[:, None] & mv[None, :])


@triton.jit(do_not_specialize=["T"])
def intra_chunk_kernel(k, v, g, beta, gcum, tmat, w, u, cu_seqlens, chunk_indices, T,
                       H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
                       CUMSUM: tl.constexpr, PREC: tl.constexpr):
    pid_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos, L, i_t, _, r, m = chunk_rows(pid_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    i_hk = i_h // (HV // H)
    _solve_chunk(k, g, beta, gcum, tmat, bos, L, i_t * 64, i_h, i_hk, H, HV, K, BK, CUMSUM, PREC)
    # the 64x64 T is read back whole so W and U' are single full-size products
    tl.debug_barrier()
    _w_u_chunk(k, v, beta, gcum, tmat, w, u, bos, r, m, i_h, i_hk, H, HV, K, V, BK, BV, PREC)


@triton.jit(do_not_specialize=["T"])
def w_u_kernel(k, v, beta, gcum, tmat, w, u, cu_seqlens, chunk_indices, T,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """The second half alone, from a T the forward kept (the backward's recomputation of W and U')."""
    pid_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos, L, i_t, _, r, m = chunk_rows(pid_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    _w_u_chunk(k, v, beta, gcum, tmat, w, u, bos, r, m, i_h, i_h // (HV // H), H, HV, K, V, BK, BV, PREC)


def intra_chunk(k, v, g, beta, T, grid_t, cu_seqlens, chunk_indices, gcum=None, tmat=None):
    """Launch over (chunks, B*HV). g is the raw per-token log gate unless gcum (log2 units) is given. With
    tmat (T as an earlier call returned it, gcum given too) only W and U' are recomputed from it.

    Returns (gcum [B,T,HV] fp32 log2 units, T matrices [B,T,HV,64] in k's dtype, W [B,T,HV,K], U' [B,T,HV,V])."""
    B, _, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    w = torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype)
    u = torch.empty(B, T, HV, V, device=k.device, dtype=k.dtype)
    shapes = dict(H=H, HV=HV, K=K, V=V, BK=min(64, K), BV=min(64, triton.next_power_of_2(V)),
                  IS_VARLEN=cu_seqlens is not None, PREC=dot_precision(k.dtype), num_warps=8)  # 4 warps spill at K=128
    if tmat is not None:
        assert gcum is not None
        w_u_kernel[(grid_t, B * HV)](k, v, beta, gcum, tmat, w, u, cu_seqlens, chunk_indices, T, **shapes)
        return gcum, tmat, w, u
    cumsum = gcum is None
    if cumsum:
        gcum = torch.empty(B, T, HV, device=k.device, dtype=torch.float32)
    # T in the inputs' dtype, as its products use it; fp32 inputs keep it fp32
    tmat = torch.empty(B, T, HV, CHUNK, device=k.device, dtype=k.dtype)
    intra_chunk_kernel[(grid_t, B * HV)](k, v, g, beta, gcum, tmat, w, u, cu_seqlens, chunk_indices, T,
                                         CUMSUM=cumsum, **shapes)
    return gcum, tmat, w, u
