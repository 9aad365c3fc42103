"""The reverse sequential pass of the backward (docs/algorithm.md section 5): per (sequence, value head, V block)
dS [K, BV] stays in fp32 registers from the last chunk to the first.

Per chunk (given dS_end): dU = scale (Q K^T (.) D_incl)^T dO + Kt dS_end,
dS0 = scale Q^T diag(Gamma) dO + Gamma_C dS_end - W^T dU. dS_end of every chunk is written for the
per-chunk gradient kernel; the first chunk's dS0 is dh0. The first term of dU needs no state: a parallel
kernel (local_du_kernel) computes it beforehand.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnkit.seqlayout import packed_output

from ..triton_shared.jit_helpers import chunk_rows, decay, dot_precision, grid_2d, grid_3d, sequence_bounds, state_tile
from ..triton_shared.launch import launch
from ..triton_shared.sizes import cdiv, flat_grid, next_power_of_2



@triton.jit(do_not_specialize=["T", "N0", "N1"])
def local_du_kernel(q, k, gcum, do, du, cu_seqlens, chunk_indices, T, N0, N1, scale, H,
                    HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """du = scale (Q K^T (.) D_incl)^T dO per chunk, in parallel: the part of dU that needs no state, kept
    out of the sequential pass to shorten its critical path and its register footprint."""
    i_v, pid_t, i_bh = grid_3d(N0, N1)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos, L, i_t, _, r, m = chunk_rows(pid_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    i_hk = i_h // (HV // H)
    dt = k.dtype.element_ty
    o64 = tl.arange(0, 64)
    qk = tl.zeros([64, 64], dtype=tl.float32)
    for ik in tl.static_range(0, K, BK):
        ck = ik + tl.arange(0, BK)
        qq = tl.load(q + bos * H * K + i_hk * K + r[:, None] * (H * K) + ck[None, :], mask=m[:, None], other=0.0)
        kk = tl.load(k + bos * H * K + i_hk * K + r[:, None] * (H * K) + ck[None, :], mask=m[:, None], other=0.0)
        qk += tl.dot(qq, tl.trans(kk), input_precision=PREC)
    gg = tl.load(gcum + (bos + r) * HV + i_h, mask=m, other=0.0)
    qk = qk * decay(gg, gg, (o64[:, None] >= o64[None, :]) & m[:, None] & m[None, :]) * scale
    cv = i_v * BV + tl.arange(0, BV)
    mt = m[:, None] & (cv < V)[None, :]
    off = (bos * HV + i_h) * V + r[:, None] * (HV * V) + cv[None, :]
    dd = tl.load(do + off, mask=mt, other=0.0).to(dt)
    tl.store(du + off, tl.dot(tl.trans(qk.to(dt)), dd, input_precision=PREC).to(du.dtype.element_ty), mask=mt)


@triton.jit(do_not_specialize=["T", "N0"])
def backward_state_kernel(q, k, w, gcum, do, dht, dh, du, dh0, cu_seqlens, chunk_offsets, T, N0, scale,
                          H, HV, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                          IS_VARLEN: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                          STATE_V_FIRST: tl.constexpr, STORE_DH: tl.constexpr, PREC: tl.constexpr):
    i_v, i_nh = grid_2d(N0)
    i_n, i_h = i_nh // HV, i_nh % HV
    bos, L, boh = sequence_bounds(i_n, T, cu_seqlens, chunk_offsets, IS_VARLEN)
    NT = tl.cdiv(L, 64)
    i_hk = i_h // (HV // H)
    dt = k.dtype.element_ty

    ck, cv, mv, s_off = state_tile(i_v, K, V, BV, STATE_V_FIRST)
    dS = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_DHT:
        dS += tl.load(dht + i_nh.to(tl.int64) * K * V + s_off, mask=mv[None, :], other=0.0).to(tl.float32)

    o64 = tl.arange(0, 64)
    qb = q + bos * H * K + i_hk * K
    kb = k + bos * H * K + i_hk * K
    wb = w + (bos * HV + i_h) * K
    cb = gcum + bos * HV + i_h
    dob = do + (bos * HV + i_h) * V
    for j in range(NT):
        it = NT - 1 - j
        r = it * 64 + o64.to(tl.int64)
        m = r < L
        if STORE_DH:
            hb = dh + ((boh + it) * HV + i_h) * K * V
            tl.store(hb + ck[:, None] * V + cv[None, :], dS.to(dh.dtype.element_ty), mask=mv[None, :])
        gg = tl.load(cb + r * HV, mask=m, other=0.0)
        g_last = tl.load(cb + (tl.minimum(it * 64 + 64, L) - 1) * HV)
        qq = tl.load(qb + r[:, None] * (H * K) + ck[None, :], mask=m[:, None], other=0.0)
        kk = tl.load(kb + r[:, None] * (H * K) + ck[None, :], mask=m[:, None], other=0.0)
        ww = tl.load(wb + r[:, None] * (HV * K) + ck[None, :], mask=m[:, None], other=0.0)
        dd = tl.load(dob + r[:, None] * (HV * V) + cv[None, :], mask=m[:, None] & mv[None, :], other=0.0).to(dt)
        # diag(Gamma_C / Gamma) K dS_end, plus the chunk-local term that local_du_kernel left in du, added after
        # the product rather than loaded as its accumulator: Triton can then prefetch that load with the others
        # when the loop is pipelined (sm90 builds read with cuobjdump). The decay scales K before the
        # product: scaling the product's rows instead, with the dS update below scaling dO, made a build that
        # faulted (illegal memory access) on the H200 with Triton 3.6, though each change alone ran
        kt = (kk.to(tl.float32) * tl.where(m, tl.exp2(g_last - gg), 0.0)[:, None]).to(dt)
        dU = tl.dot(kt, dS.to(dt), input_precision=PREC)
        dU += tl.load(du + (bos * HV + i_h) * V + r[:, None] * (HV * V) + cv[None, :], mask=m[:, None] & mv[None, :],
                      other=0.0).to(tl.float32)
        if STORE_DH:
            tl.store(du + (bos * HV + i_h) * V + r[:, None] * (HV * V) + cv[None, :], dU.to(du.dtype.element_ty),
                     mask=m[:, None] & mv[None, :])
        # scale (Q^T diag(Gamma) dO): the row scaling on dO's tile rather than Q's, so Q, like K above, goes to
        # the tensor cores as loaded (one 16-bit rounding of a scaled operand either way)
        dd_g = (dd.to(tl.float32) * (tl.exp2(gg) * scale)[:, None]).to(dt)
        dS = dS * tl.exp2(g_last) + tl.dot(tl.trans(qq), dd_g, input_precision=PREC)
        dS -= tl.dot(tl.trans(ww), dU.to(dt), input_precision=PREC)

    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + s_off, dS, mask=mv[None, :])


def local_du(q, k, gcum, do, scale, T, grid_t, cu_seqlens, chunk_indices):
    """The chunk-local part of dU [B,T,HV,V] in the inputs' dtype (backward_state adds the state's part in place,
    in fp32, and stores the sum rounded again). Every consumer of dU takes it as a 16-bit product operand, so
    16-bit storage loses only the local part's own rounding (as FLA's dv) and halves its bytes and memory."""
    B, _, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    BV = min(64, next_power_of_2(V))
    du = packed_output(do.shape, cu_seqlens, device=q.device, dtype=q.dtype)
    n_v = cdiv(V, BV)
    launch("local_du", q.dtype, local_du_kernel, flat_grid(n_v, grid_t, B * HV),
        q, k, gcum, do, du, cu_seqlens, chunk_indices, T, n_v, grid_t, scale, H=H, HV=HV, K=K, V=V, BK=min(64, K),
        BV=BV, IS_VARLEN=cu_seqlens is not None, PREC=dot_precision(q.dtype))
    return du


def backward_state(q, k, w, gcum, do, du, dht, scale, T, N, cu_seqlens, chunk_offsets, n_chunks, state_v_first,
                   want_dh0, BV, store=True):
    """Returns (dh [n_chunks, HV, K, V] = dS_end per chunk, dU [B,T,HV,V] (local_du's dtype), dh0 or None).

    du holds local_du's chunk-local part and receives the full dU in place; store=False computes only
    dh0 and leaves du as it is (context parallelism's first backward pass)."""
    B, _, H, K = k.shape
    HV, V = do.shape[2], do.shape[3]
    dev = k.device
    dh = torch.empty(n_chunks, HV, K, V, device=dev, dtype=k.dtype) if store else None
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    dh0 = torch.empty(shape, device=dev, dtype=torch.float32) if want_dh0 else None
    n_v = cdiv(V, BV)
    launch("reverse", k.dtype, backward_state_kernel, flat_grid(n_v, N * HV),
        q, k, w, gcum, do, dht, dh, du, dh0, cu_seqlens, chunk_offsets, T, n_v, scale,
        H=H, HV=HV, K=K, V=V, BV=BV, IS_VARLEN=cu_seqlens is not None, HAS_DHT=dht is not None,
        STORE_DH0=want_dh0, STATE_V_FIRST=state_v_first, STORE_DH=store, PREC=dot_precision(k.dtype))
    return dh, du, dh0
