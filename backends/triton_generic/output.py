"""O = scale (diag(Gamma) Q S0 + (Q K^T (.) D_incl) U) per chunk, in parallel over chunks, from the
per-chunk states written by the state pass (the unfused path, for when the state pass alone cannot fill
the GPU)."""
from __future__ import annotations

import triton
import triton.language as tl

from gdnkit.seqlayout import packed_output

from ..triton_shared.jit_helpers import chunk_rows, decay, dot_precision, grid_3d
from ..triton_shared.launch import launch
from ..triton_shared.sizes import cdiv, flat_grid, next_power_of_2


# V columns per program; every program also forms its chunk's Q K^T, so wider blocks form it fewer times.
# 128 at 4 warps: 16/64 1x32768 1.49 -> 1.04 ms against 64 (H200, docs/performance.md); at 2 warps 128
# spills (8x slower)
BLOCK_V = 128


@triton.jit(do_not_specialize=["T", "N0", "N1"])
def output_kernel(q, k, vnew, h, gcum, o, cu_seqlens, chunk_indices, T, N0, N1, scale,
                  H, HV, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    i_v, pid_t, i_bh = grid_3d(N0, N1)
    i_b, i_h = i_bh // HV, i_bh % HV
    bos, L, i_t, i_c, r, m = chunk_rows(pid_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN)
    i_hk = i_h // (HV // H)
    dt = k.dtype.element_ty
    o64 = tl.arange(0, 64)
    cv = i_v * BV + tl.arange(0, BV)
    mv = cv < V
    qb = q + bos * H * K + i_hk * K
    kb = k + bos * H * K + i_hk * K
    hb = h + (i_c * HV + i_h) * K * V

    acc = tl.zeros([64, BV], dtype=tl.float32)
    qk = tl.zeros([64, 64], dtype=tl.float32)
    for ik in tl.static_range(0, K, BK):
        ck = ik + tl.arange(0, BK)
        qq = tl.load(qb + r[:, None] * (H * K) + ck[None, :], mask=m[:, None], other=0.0)
        kk = tl.load(kb + r[:, None] * (H * K) + ck[None, :], mask=m[:, None], other=0.0)
        hh = tl.load(hb + ck[:, None] * V + cv[None, :], mask=mv[None, :], other=0.0)
        acc += tl.dot(qq, hh.to(dt), input_precision=PREC)
        qk += tl.dot(qq, tl.trans(kk), input_precision=PREC)
    gg = tl.load(gcum + (bos + r) * HV + i_h, mask=m, other=0.0)
    acc *= tl.exp2(gg)[:, None]
    qk *= decay(gg, gg, (o64[:, None] >= o64[None, :]) & m[:, None] & m[None, :])
    vn = tl.load(vnew + (bos * HV + i_h) * V + r[:, None] * (HV * V) + cv[None, :], mask=m[:, None] & mv[None, :],
                 other=0.0)
    acc += tl.dot(qk.to(dt), vn, input_precision=PREC)
    tl.store(o + (bos * HV + i_h) * V + r[:, None] * (HV * V) + cv[None, :], (acc * scale).to(dt),
             mask=m[:, None] & mv[None, :])


def output(q, k, vnew, h, gcum, scale, T, grid_t, cu_seqlens, chunk_indices):
    B, _, H, K = q.shape
    HV, V = vnew.shape[2], vnew.shape[3]
    BK = min(64, K)
    BV = min(BLOCK_V, next_power_of_2(V))
    o = packed_output(vnew.shape, cu_seqlens, device=vnew.device, dtype=vnew.dtype)
    n_v = cdiv(V, BV)
    launch("output", q.dtype, output_kernel, flat_grid(n_v, grid_t, B * HV),
        q, k, vnew, h, gcum, o, cu_seqlens, chunk_indices, T, n_v, grid_t, scale,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, IS_VARLEN=cu_seqlens is not None, PREC=dot_precision(q.dtype))
    return o
