"""Per chunk, in parallel: the gradients through W = T diag(beta Gamma) K and U' = T diag(beta) V, through
T = (I + A)^-1 and A = strictly_lower(diag(beta) (K K^T (.) D)) (docs/algorithm.md section 5), then the gate
gradient as the reverse cumulative sum of dgamma inside the chunk. dK is the key head's (summed over the
value heads that share it, one launch per value head of the group, as backward_chunk.py).

    dBv = T^T dU, dBk = T^T dW, dT = dU Bv^T + dW Bk^T, dA = strictly_lower(-T^T dT T^T)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gdnkit.seqlayout import packed_output

from ..triton_shared.jit_helpers import chunk_rows, decay, dot_precision, grid_2d
from ..triton_shared.launch import launch
from ..triton_shared.sizes import flat_grid, next_power_of_2


# Block widths of the WY gradient kernel (see backward_wy); knobs for GPU A/B runs.
BLOCK_K = 64
BLOCK_V = 64


@triton.jit(do_not_specialize=["T", "J", "N0", "B"])
def backward_wy_kernel(k, v, beta, gcum, tmat, dw, du, dkp, dgp, dk, dv, dbeta, dg, cu_seqlens, chunk_indices, T, J,
                       N0, B,
                       H, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, NK: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    """One launch per value head of a key head's group (J), one program per (chunk, key head): value head
    i_hk * HV / H + J adds its WY terms to the key head's dk rows in place (dkp: backward_chunk's sum over the
    group, then each launch's in turn: a fixed order, no atomics)."""
    pid_t, i_bk = grid_2d(N0)
    i_b, i_hk = i_bk // H, i_bk % H
    i_h = i_hk * (HV // H) + J
    bos, L, i_t, _, r, m = chunk_rows(pid_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    dt = k.dtype.element_ty
    o64 = tl.arange(0, 64)
    tok = (bos + r) * HV + i_h
    # T as stored (k's dtype): widened only where the fp32 product for dA needs it
    tt = tl.load(tmat + tok[:, None] * 64 + o64[None, :], mask=m[:, None], other=0.0)
    bt = tl.load(beta + tok, mask=m, other=0.0).to(tl.float32)
    gg = tl.load(gcum + tok, mask=m, other=0.0)
    gam = tl.exp2(gg)
    kb = k + bos * H * K + i_hk * K

    dT = tl.zeros([64, 64], dtype=tl.float32)
    db = tl.zeros([64], dtype=tl.float32)
    dgam = tl.zeros([64], dtype=tl.float32)
    for iv in range(0, V, BV):
        cv = iv + tl.arange(0, BV)
        mt = m[:, None] & (cv < V)[None, :]
        vv = tl.load(v + tok[:, None] * V + cv[None, :], mask=mt, other=0.0).to(tl.float32)
        dU = tl.load(du + tok[:, None] * V + cv[None, :], mask=mt, other=0.0)
        dT += tl.dot(dU.to(dt), tl.trans((vv * bt[:, None]).to(dt)), input_precision=PREC)
        dBv = tl.dot(tl.trans(tt.to(dt)), dU.to(dt), input_precision=PREC)
        tl.store(dv + tok[:, None] * V + cv[None, :], (dBv * bt[:, None]).to(dv.dtype.element_ty), mask=mt)
        db += tl.sum(dBv * vv, 1)

    # K K^T and the dW products in one unpipelined loop (static_range): inside a pipelined loop, Triton 3.6's
    # sm90 build left K K^T's wgmma in flight (its only wait after the loop) while the loop's predicated-off
    # prefetch zero-filled the shared-memory slot it read (a two-slot ring; TTGIR, offline build at 4 warps / 3
    # stages): dbeta and dg, its only consumers, differed between identical calls on the H200. One
    # loop reads K once (H200: 4/8 1x8192 backward 0.652 -> 0.625 ms against a K K^T loop of its own
    # beside the pipelined dW loop; 16/32 even)
    kkt = tl.zeros([64, 64], dtype=tl.float32)
    for ik in tl.static_range(0, K, BK):
        ck = ik + tl.arange(0, BK)
        kk = tl.load(kb + r[:, None] * (H * K) + ck[None, :], mask=m[:, None], other=0.0)
        kkt += tl.dot(kk, tl.trans(kk), input_precision=PREC)
        dW = tl.load(dw + tok[:, None] * K + ck[None, :], mask=m[:, None], other=0.0)
        bk = (kk.to(tl.float32) * (bt * gam)[:, None]).to(dt)
        dT += tl.dot(dW.to(dt), tl.trans(bk), input_precision=PREC)

    # dA in fp32 products: it feeds every key gradient through the decay-weighted K K^T
    low = (o64[:, None] > o64[None, :]) & m[:, None] & m[None, :]
    tf = tt.to(tl.float32)
    dA = -tl.dot(tl.dot(tl.trans(tf), dT, input_precision=PREC), tl.trans(tf), input_precision=PREC)
    dA = tl.where(low, dA, 0.0)
    G = dA * decay(gg, gg, low)          # dL / d(beta_t k_t.k_s) for t > s
    db += tl.sum(G * kkt, 1)
    G = G * bt[:, None]                  # dL / d(k_t.k_s)
    M = G * kkt
    dgam += tl.sum(M, 1) - tl.sum(M, 0)
    Gd = G.to(dt)

    for ik in range(0, K, BK):
        ck = ik + tl.arange(0, BK)
        kk = tl.load(kb + r[:, None] * (H * K) + ck[None, :], mask=m[:, None], other=0.0)
        dW = tl.load(dw + tok[:, None] * K + ck[None, :], mask=m[:, None], other=0.0)
        dBk = tl.dot(tl.trans(tt.to(dt)), dW.to(dt), input_precision=PREC)
        kf = kk.to(tl.float32)
        tok_k = (bos + r) * H + i_hk    # dk's rows: the key head's
        part = tl.load(dkp + tok_k[:, None] * K + ck[None, :], mask=m[:, None], other=0.0)
        part += dBk * (bt * gam)[:, None]
        part += tl.dot(Gd, kk, input_precision=PREC) + tl.dot(tl.trans(Gd), kk, input_precision=PREC)
        tl.store(dk + tok_k[:, None] * K + ck[None, :], part, mask=m[:, None])
        s = tl.sum(dBk * kf, 1)
        db += s * gam
        dgam += s * gam * bt

    for i in tl.static_range(NK):
        dgam += tl.load(dgp + i * B.to(tl.int64) * T * HV + tok, mask=m, other=0.0)
    dgam = tl.where(m, dgam, 0.0)
    # dg_t = sum_{s >= t} dgamma_s within the chunk
    rc = tl.sum(dgam, 0) - tl.cumsum(dgam, 0) + dgam
    tl.store(dg + tok, rc, mask=m)
    tl.store(dbeta + tok, db, mask=m)


def backward_wy(k, v, beta, gcum, tmat, dw, du, dkp, dgp, T, grid_t, cu_seqlens, chunk_indices):
    """Returns dk ([B,T,H,K] fp32: dkp itself, every value head's WY terms added in place), dv (v's dtype), and
    dbeta, dg (fp32, w.r.t. the kernels' inputs: before the options' prologue is undone)."""
    B, _, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    # Five 64x64 fp32 tiles are live here. Blocks no narrower than 64 (BLOCK_K, BLOCK_V): 32-wide ones made
    # 32-wide wgmma operands in 64-byte-swizzled shared memory, a layout no forward kernel uses and the
    # suspect of the backward's illegal memory access on the H200 (Triton 3.6; the addresses themselves are in
    # bounds, tests/test_triton_generic.py checks them). At the launch table's 4 warps / 3 stages: 254
    # registers, no spills (sm90 build, Triton 3.6; 8 warps spilled 284-724 bytes a thread); 255 with dk's rows
    # per key head (offline build: triton.compile + cuobjdump -res-usage). A loop over the group's value heads
    # in one program spilled 352 bytes a thread: one launch per value head instead, as backward_chunk.
    BK = min(BLOCK_K, K)
    BV = min(BLOCK_V, next_power_of_2(V))
    dev = k.device
    dk = dkp  # each program reads its tile of the partial before writing the sum there
    dv = packed_output(v.shape, cu_seqlens, device=dev, dtype=v.dtype)
    dbeta, dg = (packed_output((B, T, HV), cu_seqlens, device=dev, dtype=torch.float32) for _ in range(2))
    for j in range(HV // H):  # the group's value heads in turn, as backward_chunk
        launch("backward_wy", k.dtype, backward_wy_kernel, flat_grid(grid_t, B * H),
            k, v, beta, gcum, tmat, dw, du, dkp, dgp, dk, dv, dbeta, dg, cu_seqlens, chunk_indices, T, j, grid_t, B,
            H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, NK=dgp.shape[0], IS_VARLEN=cu_seqlens is not None,
            PREC=dot_precision(k.dtype))
    return dk, dv, dbeta, dg
