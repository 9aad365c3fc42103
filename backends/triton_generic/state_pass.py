"""The sequential pass over chunks (docs/algorithm.md section 2): per (sequence, value head, V block) the state
S [K, BV] stays in fp32 registers from the first chunk to the last.

Per chunk: U = U' - W S0 (or, U_ON_CHIP, T diag(beta) (V - diag(Gamma) K S0): NewValues), S_end = Gamma_C S0 +
Kt^T U. With FUSE_OUTPUT the chunk's output
O = scale (Gamma Q S0 + (Q K^T (.) D_incl) U) is formed here too, so neither the per-chunk states nor U
go to memory; otherwise the states (STORE_H) and U are written for output.py / the backward.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from gdnkit.seqlayout import packed_output

from ..triton_shared.jit_helpers import decay, dot_precision, grid_2d, sequence_bounds, state_tile
from ..triton_shared.launch import launch
from ..triton_shared.sizes import cdiv, flat_grid



@triton.jit
def _store_checkpoint(pool, ckpt, i_n, m, n_ckpt, every, live, S, tile, mask, slot_stride):
    """The state after m chunks goes to checkpoint slot ckpt[i_n, m / every - 1] when m is a positive
    multiple of `every` (chunks) within the n_ckpt columns; -1 (and a padding sequence) writes nothing."""
    j = m // every - 1
    due = (m > 0) & (m % every == 0) & (j < n_ckpt) & (live != 0)
    slot = tl.load(ckpt + i_n * n_ckpt + tl.maximum(j, 0), mask=due, other=-1).to(tl.int64)
    tl.store(pool + tl.maximum(slot, 0) * slot_stride + tile, S.to(pool.dtype.element_ty),
             mask=mask & ((tile * 0 + slot) >= 0))


@triton.jit(do_not_specialize=["T", "N0", "n_ckpt", "every"])
def state_pass_kernel(q, k, w, u, v, beta, tmat, gcum, h, vnew, o, h0, ht, cu_seqlens, chunk_offsets, T, N0,
                      scale,
                      slots, start_flags, ckpt, slot_stride, n_ckpt, every,
                      H, HV, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                      IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                      STATE_V_FIRST: tl.constexpr, STORE_H: tl.constexpr, STORE_VNEW: tl.constexpr,
                      FUSE_OUTPUT: tl.constexpr, PROPAGATOR: tl.constexpr, U_ON_CHIP: tl.constexpr,
                      PREC: tl.constexpr, POOL: tl.constexpr, HAS_STARTS: tl.constexpr,
                      CHECKPOINTS: tl.constexpr):
    i_v, i_nh = grid_2d(N0)
    i_n, i_h = i_nh // HV, i_nh % HV
    bos, L, boh = sequence_bounds(i_n, T, cu_seqlens, chunk_offsets, IS_VARLEN)
    NT = tl.cdiv(L, 64)
    i_hk = i_h // (HV // H)
    dt = k.dtype.element_ty

    ck, cv, mv, s_off = state_tile(i_v, K, V, BV, STATE_V_FIRST)
    S = tl.zeros([K, BV], dtype=tl.float32)
    if PROPAGATOR:
        # columns V..V+K-1 carry the identity with U' = 0: they evolve into the segment's transition
        # matrix P (S_end = P S0 + E), the first V columns from S0 = 0 into E
        S += (ck[:, None] == (cv - V)[None, :]).to(tl.float32)
    # live: 0 for a padding sequence of the pool (slot -1), whose loads are all masked off so its outputs,
    # per-chunk states and new values are exact zeros and no state memory is touched. Flags are int
    # tiles, not scalar bools: the interpreter rejects a scalar bool broadcast into a mask.
    live = i_n * 0 + 1
    if POOL:
        slot = tl.load(slots + i_n).to(tl.int64)
        live = (slot >= 0).to(tl.int32)
        fetch = live
        if HAS_STARTS:
            fetch = fetch * (tl.load(start_flags + i_n) != 0).to(tl.int32)
        head_tile = i_h * K * V + s_off  # the tile within a slot
        pool_tile = tl.maximum(slot, 0) * slot_stride + head_tile
        S += tl.load(h0 + pool_tile, mask=mv[None, :] & ((s_off * 0 + fetch) != 0), other=0.0).to(tl.float32)
    elif HAS_H0:
        S += tl.load(h0 + i_nh.to(tl.int64) * K * V + s_off, mask=mv[None, :], other=0.0).to(tl.float32)
    live_mask = (s_off * 0 + live) != 0

    o64 = tl.arange(0, 64)
    qb = q + bos * H * K + i_hk * K
    kb = k + bos * H * K + i_hk * K
    cb = gcum + bos * HV + i_h
    for it in range(NT):
        r = it * 64 + o64.to(tl.int64)
        m_in = r < L  # the chunk's rows: stored to (o, U)
        m = m_in & ((r * 0 + live) != 0)  # the rows loaded
        if CHECKPOINTS:
            _store_checkpoint(ht, ckpt, i_n, it, n_ckpt, every, live, S, head_tile, mv[None, :] & live_mask,
                              slot_stride)
        if POOL and not FUSE_OUTPUT:
            # output.py forms a padding sequence's output from its zero states and new values, and from its gate
            # cumsum: zeroed here, so arbitrary inputs there cannot overflow a decay into 0 * inf
            tl.store(cb + r * HV, tl.zeros([64], dtype=tl.float32), mask=m_in & ((r * 0 + live) == 0))
        if STORE_H:
            hb = h + ((boh + it) * HV + i_h) * K * V
            tl.store(hb + ck[:, None] * V + cv[None, :], S.to(h.dtype.element_ty), mask=mv[None, :])
        Sd = S.to(dt)
        gg = tl.load(cb + r * HV, mask=m, other=0.0)
        g_last = tl.load(cb + (tl.minimum(it * 64 + 64, L) - 1) * HV) * live
        kk = tl.load(kb + r[:, None] * (H * K) + ck[None, :], mask=m[:, None], other=0.0)
        tok = (bos + r) * HV + i_h
        if U_ON_CHIP:
            # U = T diag(beta) (V - diag(Gamma) K S): W and U' never go through memory (tilelang_sm90's form)
            vv = tl.load(v + tok[:, None] * V + cv[None, :], mask=m[:, None] & mv[None, :], other=0.0)
            x = vv.to(tl.float32) - tl.dot(kk, Sd, input_precision=PREC) * tl.exp2(gg)[:, None]
            bt = tl.load(beta + tok, mask=m, other=0.0).to(tl.float32)
            xb = tl.where(m[:, None], x * bt[:, None], 0.0)
            tt = tl.load(tmat + tok[:, None] * 64 + o64[None, :], mask=m[:, None], other=0.0)
            un = tl.dot(tt, xb.to(dt), input_precision=PREC)
        else:
            ww = tl.load(w + tok[:, None] * K + ck[None, :], mask=m[:, None], other=0.0)
            uu = tl.load(u + tok[:, None] * V + cv[None, :], mask=m[:, None] & mv[None, :], other=0.0)
            un = uu.to(tl.float32) - tl.dot(ww, Sd, input_precision=PREC)
        if STORE_VNEW:
            tl.store(vnew + tok[:, None] * V + cv[None, :], un.to(dt), mask=m_in[:, None] & mv[None, :])
        if FUSE_OUTPUT:
            qq = tl.load(qb + r[:, None] * (H * K) + ck[None, :], mask=m[:, None], other=0.0)
            qk = tl.dot(qq, tl.trans(kk), input_precision=PREC)
            qk = qk * decay(gg, gg, (o64[:, None] >= o64[None, :]) & m[:, None] & m[None, :])
            oo = tl.dot(qq, Sd, input_precision=PREC) * tl.exp2(gg)[:, None]
            oo += tl.dot(qk.to(dt), un.to(dt), input_precision=PREC)
            tl.store(o + (bos * HV + i_h) * V + r[:, None] * (HV * V) + cv[None, :], (oo * scale).to(dt),
                     mask=m_in[:, None] & mv[None, :])
        dec = tl.where(m, tl.exp2(g_last - gg), 0.0)    # Gamma_C / Gamma per row
        if dt == tl.float32:
            # fp32 keeps the decay on K's rows: the U-rows form below, with the raw K load transposed into
            # a tf32x3 dot, gave o errors of 8e-2 on the H200 (Triton 3.6); bf16 was exact
            kt = kk * dec[:, None]
            S = S * tl.exp2(g_last) + tl.dot(tl.trans(kt), un, input_precision=PREC)
        else:
            # 16-bit: the decay on U's rows (64 x BV) instead of K's (64 x K), a smaller live tile (sm90
            # spills 596 -> 448 bytes fused); state pass 16/64 1x32768 3.39 -> 2.48 ms (H200, docs/performance.md)
            ud = (un * dec[:, None]).to(dt)
            S = S * tl.exp2(g_last) + tl.dot(tl.trans(kk), ud, input_precision=PREC)

    if POOL:
        if CHECKPOINTS:
            # the final state is a checkpoint too when the sequence ends on one
            _store_checkpoint(ht, ckpt, i_n, tl.where(L % 64 == 0, NT, 0), n_ckpt, every, live, S, head_tile,
                              mv[None, :] & live_mask, slot_stride)
        tl.store(ht + pool_tile, S.to(ht.dtype.element_ty), mask=mv[None, :] & live_mask)
    elif PROPAGATOR:
        tl.store(ht + i_nh.to(tl.int64) * K * (V + K) + ck[:, None] * (V + K) + cv[None, :], S,
                 mask=(cv < V + K)[None, :])
    elif STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + s_off, S, mask=mv[None, :])


@dataclasses.dataclass(frozen=True)
class PoolSlots:
    """Prefill on a state pool: sequence n starts from pool[slots[n]] (zero where starts[n] is False, nothing
    for slot -1) and its final state is stored back there; with checkpoints [N, C] the state after every
    `every` chunks goes to slot checkpoints[n, j] too. No gather or scatter pass: the kernel addresses the
    slots (pool + slot * slot stride, each slot contiguous)."""
    pool: torch.Tensor
    slots: torch.Tensor
    starts: torch.Tensor | None = None
    checkpoints: torch.Tensor | None = None
    every: int = 0


def state_pass(q, k, values, gcum, scale, h0, T, N, cu_seqlens, chunk_offsets, n_chunks, state_v_first,
               output_final_state, fuse_output, store_h, store_vnew, BV, propagator=False,
               pool: PoolSlots | None = None):
    """Returns (o or None, h [n_chunks, HV, K, V] or None, U or None, final state or None).

    pool: read the initial and write the final states (and checkpoints) through pool slots in place of h0
    and a new final state; the final state returned is then the pool itself.

    values: where each chunk's new values U come from: NewValues.from_wu (U = U' - W S, W and U' from
    intra_chunk) or NewValues.on_chip (U = T diag(beta) (V - diag(Gamma) K S), from V, beta and T).
    propagator=True (a pass over segments of context parallelism): from a zero state, the final states
    come back as [N, HV, K, V + K] = [E | P], S_end = P S0 + E; nothing else is written."""
    B, _, H, K = k.shape
    like = values.like
    HV, V = like.shape[2], like.shape[3]
    dev = k.device
    h = torch.empty(n_chunks, HV, K, V, device=dev, dtype=k.dtype) if store_h else None
    vnew = torch.empty_like(like) if store_vnew else None
    o = packed_output(like.shape, cu_seqlens, device=dev, dtype=like.dtype) if fuse_output else None
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    ht = torch.empty(shape, device=dev, dtype=torch.float32) if output_final_state else None
    columns = V
    if propagator:
        assert h0 is None and not (fuse_output or store_h or store_vnew)
        ht = torch.empty(N, HV, K, V + K, device=dev, dtype=torch.float32)
        columns = V + K
    n_v = cdiv(columns, BV)
    if pool is not None:
        assert h0 is None and not (output_final_state or propagator)
        h0 = ht = pool.pool
    checkpoints = pool.checkpoints if pool is not None else None
    launch("fused" if fuse_output else "state", k.dtype, state_pass_kernel, flat_grid(n_v, N * HV),
        q, k, values.w, values.u, values.v, values.beta, values.tmat, gcum, h, vnew, o, h0, ht, cu_seqlens,
        chunk_offsets, T, n_v, scale, pool.slots if pool is not None else None,
        # a bool tensor read as bytes: no conversion pass
        pool.starts.view(torch.uint8) if pool is not None and pool.starts is not None else None, checkpoints,
        pool.pool.stride(0) if pool is not None else 0,
        checkpoints.shape[1] if checkpoints is not None else 0, pool.every if pool is not None else 0,
        H=H, HV=HV, K=K, V=V, BV=BV, IS_VARLEN=cu_seqlens is not None,
        HAS_H0=h0 is not None, STORE_HT=output_final_state, STATE_V_FIRST=state_v_first, STORE_H=store_h,
        STORE_VNEW=store_vnew, FUSE_OUTPUT=fuse_output, PROPAGATOR=propagator, U_ON_CHIP=values.v is not None,
        PREC=dot_precision(k.dtype), POOL=pool is not None,
        HAS_STARTS=pool is not None and pool.starts is not None, CHECKPOINTS=checkpoints is not None)
    return o, h, vnew, ht


@dataclasses.dataclass(frozen=True)
class NewValues:
    """The state pass's source of each chunk's new values U. from_wu: U = U' - W S with W, U' [B, T, HV, K / V]
    from intra_chunk's w_u kernel (the backward: its U' keeps beta V's rounding error, intra_chunk's precise_u).
    on_chip: U = T diag(beta) (V - diag(Gamma) K S) with T [B, T, HV, 64] in k's dtype, beta [B, T, HV] and V:
    no W or U' in memory (the forward: one launch and ~1 GB of traffic fewer at 8/32 1x32768, one 64 x 64 x BV
    product more on the chain per chunk)."""
    w: torch.Tensor | None = None
    u: torch.Tensor | None = None
    v: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    tmat: torch.Tensor | None = None

    @staticmethod
    def from_wu(w, u) -> "NewValues":
        return NewValues(w=w, u=u)

    @staticmethod
    def on_chip(v, beta, tmat) -> "NewValues":
        return NewValues(v=v, beta=beta, tmat=tmat)

    @property
    def like(self) -> torch.Tensor:
        """A tensor shaped and typed as U."""
        return self.u if self.u is not None else self.v
