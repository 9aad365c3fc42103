"""Per chunk, in parallel: gate cumsum, beta-scaled K K^T with the decay mask, the unit lower-triangular
solve T = (I + A)^-1, then W = T diag(beta Gamma) K and U' = T diag(beta) V (docs/algorithm.md section 2).

Four launches, each with the warp count its tiles want:
    kkt_kernel           gamma and A (one 64 x 64 product per chunk), A stored fp32
    diag_inverse_kernel  A's four diagonal 16 x 16 blocks replaced by their inverses (substitution), one
                         warp per block
    solve_kernel         the rest of T from those by block products
    w_u_kernel           W and U' from T (also the backward's recomputation from a saved T)
They were one kernel at 8 warps, which held 255 registers and spilled (sm90 builds); split, every launch
compiles spill-free, and the substitution reads each row of A from memory (one reduction per row, where
extracting it from registers took a second). A lives only between the first two launches (fp32, 64 values
per token and value head), before W and U' are allocated.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_shared.jit_helpers import CHUNK, LOG2E, chunk_rows, decay, dot_precision, grid_2d
from ..triton_shared.launch import launch
from ..triton_shared.sizes import flat_grid, next_power_of_2



@triton.jit
def _load_rows(ptr, rows, row_mask, stride, cols, col_mask):
    return tl.load(ptr + rows[:, None] * stride + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)


@triton.jit(do_not_specialize=["T", "N0"])
def kkt_kernel(k, g, beta, gcum, a, cu_seqlens, chunk_indices, T, N0, H, HV,
               K: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, CUMSUM: tl.constexpr,
               PREC: tl.constexpr):
    """gamma (stored as gcum, log2 units, when CUMSUM; else read from it) and
    A = strictly_lower(diag(beta) (K K^T (.) D)), one 64 x 64 product per chunk, stored fp32 (rows < L)."""
    pid_t, i_bh = grid_2d(N0)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos, L, i_t, _, r, m = chunk_rows(pid_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    i_hk = i_h // (HV // H)
    cb = gcum + bos * HV + i_h
    if CUMSUM:
        x = tl.load(g + bos * HV + i_h + r * HV, mask=m, other=0.0).to(tl.float32) * LOG2E
        gg = tl.cumsum(x, 0)
        tl.store(cb + r * HV, gg, mask=m)
    else:
        gg = tl.load(cb + r * HV, mask=m, other=0.0)
    bt = tl.load(beta + bos * HV + i_h + r * HV, mask=m, other=0.0).to(tl.float32)
    kb = k + bos * H * K + i_hk * K
    acc = tl.zeros([64, 64], dtype=tl.float32)
    for ik in tl.static_range(0, K, BK):
        ck = ik + tl.arange(0, BK)
        kk = _load_rows(kb, r, m, H * K, ck, ck < K)
        acc += tl.dot(kk, tl.trans(kk), input_precision=PREC)
    o64 = tl.arange(0, 64)
    acc *= decay(gg, gg, (o64[:, None] > o64[None, :]) & m[:, None] & m[None, :]) * bt[:, None]
    tl.store(a + (bos * HV + i_h) * 64 + r[:, None] * (HV * 64) + o64[None, :], acc, mask=m[:, None])


@triton.jit
def _block(a, rows, L, col0, HV):
    """The 16 x 16 block of a chunk's stored A at rows `rows`, columns col0.. (rows past L read as 0)."""
    o16 = tl.arange(0, 16)
    return tl.load(a + rows[:, None] * (HV * 64) + col0 + o16[None, :], mask=(rows < L)[:, None], other=0.0)


@triton.jit
def _diag_inverse(a, row0, col0, L, HV):
    """(I + A_bb)^-1 of the diagonal block at rows row0.. (within the sequence) and columns col0.. (within the
    chunk), by forward substitution: with N = (I + A_bb)^-1 - I, row i is N[i] = -A[i] - sum_{s<i} A[i, s] N[s].
    Each row of A is read from memory, so a row costs one reduction; rows 0 and 1 are -A as loaded."""
    o16 = tl.arange(0, 16)
    N = -_block(a, row0 + o16, L, col0, HV)
    for i in range(2, 16):
        row = -tl.load(a + (row0 + i) * (HV * 64) + col0 + o16, mask=(o16 < i) & (row0 + i + 0 * o16 < L),
                       other=0.0)
        row += tl.sum(row[:, None] * N, 0)
        N = tl.where((o16 == i)[:, None], row[None, :], N)
    return N + (o16[:, None] == o16[None, :]).to(tl.float32)


@triton.jit
def _store_band(tb, rows, m, b0, b1, b2, b3, HV):
    """One 16-row band of T (rows `rows` of the chunk, valid where m): its four 16 x 16 blocks side by side."""
    p = tb + rows[:, None] * (HV * 64) + tl.arange(0, 16)[None, :]
    dt = tb.dtype.element_ty
    tl.store(p, b0.to(dt), mask=m[:, None])
    tl.store(p + 16, b1.to(dt), mask=m[:, None])
    tl.store(p + 32, b2.to(dt), mask=m[:, None])
    tl.store(p + 48, b3.to(dt), mask=m[:, None])


@triton.jit(do_not_specialize=["T", "N0"])
def diag_inverse_kernel(a, cu_seqlens, chunk_indices, T, N0, HV, IS_VARLEN: tl.constexpr):
    """One diagonal 16 x 16 block of a chunk's A per program (grid: 4 x chunks, B*HV), replaced in place by its
    inverse (I + A_bb)^-1 (rows < L). The substitution is a chain of dependent loads, so its speed is how many
    chains an SM runs at once: one warp per program, where one 8-warp program walked all four blocks in turn
    (H200, 16/64 1x32768: 1.95 ms for that solve)."""
    pid, i_bh = grid_2d(N0)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos, L, i_t, _, _, _ = chunk_rows(pid // 4, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    ab = a + (bos * HV + i_h) * 64
    row0, col0 = i_t * 64 + 16 * (pid % 4), 16 * (pid % 4)
    inv = _diag_inverse(ab, row0, col0, L, HV)
    rows = row0 + tl.arange(0, 16)
    tl.store(ab + rows[:, None] * (HV * 64) + col0 + tl.arange(0, 16)[None, :], inv, mask=(rows < L)[:, None])


@triton.jit(do_not_specialize=["T", "N0"])
def solve_kernel(a, tmat, cu_seqlens, chunk_indices, T, N0, HV, IS_VARLEN: tl.constexpr):
    """T = (I + A)^-1 per chunk from A whose diagonal blocks diag_inverse_kernel replaced by their inverses
    T_ii: the rest by block forward substitution, T_ij = -T_ii sum_{j<=m<i} A_im T_mj (fp32 products). Rows of
    T_ii past L read as 0 (not the identity's): they meet only A's columns past L, which are 0."""
    pid_t, i_bh = grid_2d(N0)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos, L, i_t, _, _, _ = chunk_rows(pid_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    ab = a + (bos * HV + i_h) * 64
    t0 = i_t * 64
    o16 = tl.arange(0, 16)
    r0, r1, r2, r3 = t0 + o16, t0 + 16 + o16, t0 + 32 + o16, t0 + 48 + o16
    t00, t11 = _block(ab, r0, L, 0, HV), _block(ab, r1, L, 16, HV)
    t22, t33 = _block(ab, r2, L, 32, HV), _block(ab, r3, L, 48, HV)
    a10, a21, a32 = _block(ab, r1, L, 0, HV), _block(ab, r2, L, 16, HV), _block(ab, r3, L, 32, HV)
    a20, a31, a30 = _block(ab, r2, L, 0, HV), _block(ab, r3, L, 16, HV), _block(ab, r3, L, 0, HV)
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
    _store_band(tb, r0, r0 < L, t00, zero, zero, zero, HV)
    _store_band(tb, r1, r1 < L, t10, t11, zero, zero, HV)
    _store_band(tb, r2, r2 < L, t20, t21, t22, zero, HV)
    _store_band(tb, r3, r3 < L, t30, t31, t32, t33, HV)


@triton.jit(do_not_specialize=["T", "N0"])
def w_u_kernel(k, v, beta, gcum, tmat, w, u, cu_seqlens, chunk_indices, T, N0,
               H, HV, K: tl.constexpr, V: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
               SPLIT_U: tl.constexpr):
    """W = T diag(beta Gamma) K and U' = T diag(beta) V from the stored T (tmat) and gamma (gcum): the
    forward's third launch, and the backward's recomputation of W and U' from a T the forward kept."""
    pid_t, i_bh = grid_2d(N0)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos, L, i_t, _, r, m = chunk_rows(pid_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    i_hk = i_h // (HV // H)
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
        vv = _load_rows(vb, r, m, HV * V, cv, mv).to(tl.float32) * bt[:, None]
        v_hi = vv.to(dt)
        uu = tl.dot(tt.to(dt), v_hi, input_precision=PREC)
        if SPLIT_U:
            uu += tl.dot(tt.to(dt), (vv - v_hi.to(tl.float32)).to(dt), input_precision=PREC)
        tl.store(ub + r[:, None] * (HV * V) + cv[None, :], uu.to(dt), mask=m[:, None] & mv[None, :])


def intra_chunk(k, v, g, beta, T, grid_t, cu_seqlens, chunk_indices, gcum=None, tmat=None, precise_u=False,
                wu=True):
    """Launch over (chunks, B*HV). g is the raw per-token log gate unless gcum (log2 units) is given. With
    tmat (T as an earlier call returned it, gcum given too) only W and U' are recomputed from it. precise_u
    (16-bit inputs): U' = T (beta V) with beta V's rounding error carried by a second product, T (beta V - hi),
    instead of dropped: the backward's dg is that rounding's most sensitive consumer (test_gpu_options_gradients_bf16
    at K = 256: dg 9.9e-3 -> 6.6e-3 in the bf16-faithful interpreter; dq, dk 10% lower), W's does not matter there.

    wu=False: no W or U' (the forward's state pass makes the new values from T on chip): both None.

    Returns (gcum [B,T,HV] fp32 log2 units, T matrices [B,T,HV,64] in k's dtype, W [B,T,HV,K], U' [B,T,HV,V])."""
    B, _, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    grid = flat_grid(grid_t, B * HV)
    if tmat is None:
        cumsum = gcum is None
        if cumsum:
            gcum = torch.empty(B, T, HV, device=k.device, dtype=torch.float32)
        a = torch.empty(B, T, HV, CHUNK, device=k.device, dtype=torch.float32)
        launch("kkt", k.dtype, kkt_kernel, grid, k, g, beta, gcum, a, cu_seqlens, chunk_indices, T, grid_t, H=H,
               HV=HV, K=K, BK=min(64, K), IS_VARLEN=varlen, CUMSUM=cumsum, PREC=dot_precision(k.dtype))
        # T in the inputs' dtype, as its products use it; fp32 inputs keep it fp32
        tmat = torch.empty(B, T, HV, CHUNK, device=k.device, dtype=k.dtype)
        launch("diag_inverse", k.dtype, diag_inverse_kernel, flat_grid(4 * grid_t, B * HV), a, cu_seqlens,
               chunk_indices, T, 4 * grid_t, HV=HV, IS_VARLEN=varlen)
        launch("solve", k.dtype, solve_kernel, grid, a, tmat, cu_seqlens, chunk_indices, T, grid_t, HV=HV,
               IS_VARLEN=varlen)
        del a
    assert gcum is not None
    if not wu:
        return gcum, tmat, None, None
    w = torch.empty(B, T, HV, K, device=k.device, dtype=k.dtype)
    u = torch.empty(B, T, HV, V, device=k.device, dtype=k.dtype)
    launch("w_u", k.dtype, w_u_kernel, grid, k, v, beta, gcum, tmat, w, u, cu_seqlens, chunk_indices, T, grid_t,
           H=H, HV=HV, K=K, V=V, BK=min(64, K), BV=min(64, next_power_of_2(V)), IS_VARLEN=varlen,
           PREC=dot_precision(k.dtype), SPLIT_U=precise_u and k.dtype != torch.float32)
    return gcum, tmat, w, u
