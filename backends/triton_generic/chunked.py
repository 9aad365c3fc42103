"""The chunked forward and backward: the options' prologue, then the kernels in order.

Forward: intra_chunk (cumsum + K K^T + solve + W/U') -> state_pass (fused with the output when the
state pass alone fills the GPU, else it writes per-chunk states and output.py runs over all chunks).
With few long sequences the state pass runs context parallel (triton_shared/segments.py).
Backward recomputes W, U', T and the per-chunk states from the saved inputs (nothing chunk-sized is
kept between forward and backward), then: backward_state (reverse pass, context parallel like the
forward) -> backward_chunk -> backward_wy.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from gdnkit import prologue, seqlayout
from gdnkit.problem import GDNGrads, GDNInputs, Problem

from ..triton_shared.jit_helpers import CHUNK, dot_precision
from ..triton_shared.segments import Segments, cut_segments, segment_scan
from ..triton_shared.sizes import cdiv, next_power_of_2
from .backward_chunk import backward_chunk
from .backward_state import backward_state, local_du
from .backward_wy import backward_wy
from .intra_chunk import intra_chunk
from .output import output
from .state_pass import NewValues, PoolSlots, state_pass

# "auto" | "always" | "never": whether the forward computes the output inside the state pass.
FUSE_OUTPUT = "auto"
# Pretend this many SMs (tests drive the narrow-block path on CPU); None: ask the device.
SM_COUNT = None


@dataclasses.dataclass
class Saved:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gcum: torch.Tensor
    beta: torch.Tensor
    tmat: torch.Tensor | None  # T = (I + A)^-1 per chunk (as FLA keeps its A): the backward recomputes only W, U'
    h0: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    index: Index
    stash: dict
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    dtypes: dict


@dataclasses.dataclass
class Index:
    """Where the chunks are: per-chunk grid size, (sequence, chunk) table and per-sequence chunk offsets."""
    grid_t: int
    n_chunks: int
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None


def make_index(B: int, T: int, cu_seqlens: torch.Tensor | None) -> Index:
    if cu_seqlens is None:
        nt = cdiv(T, CHUNK)
        return Index(nt, B * nt, None, None)
    layout = seqlayout.sequence_layout(cu_seqlens)
    return Index(layout.n_chunks, layout.n_chunks, layout.chunk_indices, layout.chunk_offsets[:-1])


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Context parallelism: None = decide from the SM count, 0 = off, n = segments of n chunks (tests).
CP_SEGMENT_CHUNKS = None
CP_MIN_SEGMENT_CHUNKS = 8
# segments per sequence: as many as keep the programs within one per SM (H200, CUDA graphs, ms:
# forward 2/8 1x32768 0.576 at 17 segments (the old rule, 2 per SM rounded up: 272 programs on 132 SMs), 0.547 at
# 8; 4/16 1x32768 1.216 at 9, 1.052 at 4; backward 4/8 1x8192 0.632 at 16, 0.577 at 8; 4/8 1x32768 1.897 at 16,
# 1.934 at 8, the one point where two per SM won)
CP_PROGRAMS_PER_SM = 1
# Context parallelism only while the sequential passes' programs (at the widest V block) cover at most this
# share of the SMs; V blocks narrow to no less than MIN_BLOCK_V while programs are fewer than SMs.
CP_MAX_SM_SHARE = 0.25
MIN_BLOCK_V = 32


@dataclasses.dataclass(frozen=True)
class Plan:
    fuse_output: bool
    block_v: int
    segments: Segments | None  # context parallelism: the sequences cut into segments, else None


def _widest(K: int, V: int) -> int:
    return min(32 if K > 128 else 64, next_power_of_2(V))


def _layout(problem: Problem, cu_seqlens, device: torch.device) -> seqlayout.SequenceLayout:
    return seqlayout.dense_layout(problem.B, problem.T, device) if cu_seqlens is None \
        else seqlayout.sequence_layout(cu_seqlens)


def _segment_chunks(problem: Problem, cu_seqlens, device: torch.device, sms: int) -> int | None:
    if problem.serving:
        # prefill on the pool: the state pass addresses pool slots itself; the segment scan does not (yet)
        return None
    if CP_SEGMENT_CHUNKS is not None:
        return CP_SEGMENT_CHUNKS or None
    programs = problem.N * problem.HV * cdiv(problem.V, _widest(problem.K, problem.V))
    # the segment scan holds P [K, K] in fp32 on chip: fine to K = 128, too big at 256
    if sms == 0 or programs > CP_MAX_SM_SHARE * sms or problem.K > 128:
        return None
    longest = max(cdiv(n, CHUNK) for n in _layout(problem, cu_seqlens, device).lengths)
    per_sequence = max(1, CP_PROGRAMS_PER_SM * sms // programs)
    seg = max(CP_MIN_SEGMENT_CHUNKS, cdiv(longest, per_sequence))
    return seg if seg < longest else None


def plan(problem: Problem, cu_seqlens, device: torch.device, fusable: bool = True) -> Plan:
    """How the sequential passes run: context parallel or not, V block width, output fused or not.

    Their programs (sequence or segment x value head x V block) each walk a whole sequence (segment).
    Few of them: cut sequences into segments (triton_shared/segments.py). Still fewer than SMs: narrower V
    blocks buy parallelism (each re-reads its chunk's W and K, from L2). Fusing the output serialises its
    work behind the recurrence; it pays only once the programs about cover the SMs at the widest block."""
    widest = _widest(problem.K, problem.V)
    sms = SM_COUNT if SM_COUNT is not None else (_sm_count(device.index or 0) if device.type == "cuda" else 0)
    seg = _segment_chunks(problem, cu_seqlens, device, sms)
    segments = cut_segments(_layout(problem, cu_seqlens, device), seg) if seg else None
    n = segments.n_seg if segments is not None else problem.N
    programs = lambda bv: n * problem.HV * cdiv(problem.V, bv)  # noqa: E731
    if not fusable:
        fuse = False
    elif FUSE_OUTPUT != "auto":
        fuse = FUSE_OUTPUT == "always"
    else:
        fuse = 4 * programs(widest) >= 3 * sms and problem.dtype != torch.float32
    bv = widest
    if problem.dtype == torch.float32 and device.type == "cuda":
        # fp32 tiles double the shared memory: 16-wide blocks stay under Ada's ~99 KB per block
        bv = 16
    if not fuse:
        while bv > MIN_BLOCK_V and programs(bv) < sms:
            bv //= 2
    return Plan(fuse, bv, segments)


def _states(problem: Problem, p: Plan, q, k, values: NewValues, gcum, h0, T, cu, index: Index, store: bool,
            want_ht: bool, pool: PoolSlots | None = None):
    """The forward's sequential part. Returns (o if fused, h, U, final state, [E | P] per segment or None).
    With `pool` (no segments), states come from and go to its slots and the final state is the pool."""
    K, V, N, HV = problem.K, problem.V, problem.N, problem.HV
    flags = dict(fuse_output=p.fuse_output, store_h=store, store_vnew=store, BV=p.block_v)
    if p.segments is None:
        o, h, vnew, ht = state_pass(q, k, values, gcum, problem.scale, h0, T, N, cu, index.chunk_offsets,
                                    index.n_chunks, problem.state_v_first, want_ht, pool=pool, **flags)
        if pool is not None:
            ht = pool.pool
        return o, h, vnew, ht, None
    sg = p.segments
    aug_bv = 16 if k.dtype == torch.float32 else _widest(K, V + K)
    aug = state_pass(q, k, values, gcum, problem.scale, None, T, sg.n_seg, sg.cu_seqlens, sg.chunk_offsets,
                     index.n_chunks, False, False, fuse_output=False, store_h=False, store_vnew=False,
                     BV=aug_bv, propagator=True)[3]
    s0, ht = segment_scan(aug, h0, sg.seg_offsets, N, HV, K, V, problem.state_v_first, want_ht,
                          dot_precision(k.dtype))
    o, h, vnew, _ = state_pass(q, k, values, gcum, problem.scale, s0, T, sg.n_seg, sg.cu_seqlens, sg.chunk_offsets,
                               index.n_chunks, False, False, **flags)
    return o, h, vnew, ht, aug


def _pool_slots(problem: Problem, inputs) -> PoolSlots | None:
    """A serving call's pool arguments (GDNServingInputs), else None."""
    if not problem.serving:
        return None
    return PoolSlots(inputs.initial_state, inputs.ssm_state_indices, inputs.has_initial_state,
                     inputs.checkpoint_indices, problem.checkpoint_every // CHUNK)


def forward(problem: Problem, inputs: GDNInputs):
    q, k, v, g, beta, h0, A_log, dt_bias, cu = inputs[:9]
    pool = _pool_slots(problem, inputs)
    dtypes = prologue.input_dtypes(inputs[:9])
    q, k, g, beta, stash = prologue.forward(problem, q, k, g, beta, A_log, dt_bias)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    if pool is not None:
        h0 = None  # the pool is read and written through its slots
    elif h0 is not None:
        h0 = h0.float().contiguous()
    B, T = q.shape[0], q.shape[1]
    if cu is not None:
        # the kernels read the layout's own copy of the offsets, which its chunk tables were built from (and the
        # backward, keeping it, finds the same layout whatever the caller does to its tensor meanwhile)
        cu = seqlayout.sequence_layout(cu).cu_seqlens
    index = make_index(B, T, cu)
    if index.n_chunks == 0 and pool is not None:
        # no tokens, but new sequences' slots still become zero states: the state pass over no chunks
        o = v.new_zeros(v.shape)
        gcum = torch.zeros(g.shape, device=g.device, dtype=torch.float32)
        tmat = None
        p = dataclasses.replace(plan(problem, cu, v.device), fuse_output=False)
        _, _, _, ht, _ = _states(problem, p, q, k, NewValues.on_chip(v, beta, gcum), gcum, None, T, cu, index,
                                 store=False, want_ht=False, pool=pool)
    elif index.n_chunks == 0:
        o = v.new_zeros(v.shape)
        ht = None
        if problem.output_final_state:
            ht = h0.clone() if h0 is not None else torch.zeros(problem.state_shape, device=v.device,
                                                               dtype=torch.float32)
        gcum = torch.zeros(g.shape, device=g.device, dtype=torch.float32)
        tmat = None
    else:
        # no W or U' here: the state pass makes each chunk's new values from T, beta and V on chip
        gcum, tmat, _, _ = intra_chunk(k, v, g, beta, T, index.grid_t, cu, index.chunk_indices, wu=False)
        p = plan(problem, cu, v.device)
        o, h, vnew, ht, _ = _states(problem, p, q, k, NewValues.on_chip(v, beta, tmat), gcum, h0, T, cu, index,
                                    store=not p.fuse_output, want_ht=problem.output_final_state and pool is None,
                                    pool=pool)
        if not problem.needs_grad:
            tmat = None  # inference: freed before the output pass allocates o
        if not p.fuse_output:
            o = output(q, k, vnew, h, gcum, problem.scale, T, index.grid_t, cu, index.chunk_indices)
    saved = None
    if problem.needs_grad:
        saved = Saved(q, k, v, gcum, beta, tmat, h0, cu, index, stash, A_log, dt_bias, dtypes)
    return o, ht, saved


def backward(problem: Problem, saved: Saved, do: torch.Tensor, dht: torch.Tensor | None) -> GDNGrads:
    q, k, v, gcum, beta, h0, cu, index = (saved.q, saved.k, saved.v, saved.gcum, saved.beta, saved.h0,
                                          saved.cu_seqlens, saved.index)
    B, T, H, K = q.shape
    HV, V, N = problem.HV, problem.V, problem.N
    do = do.to(v.dtype).contiguous()
    if dht is not None:
        dht = dht.float().contiguous()
    if index.n_chunks == 0:
        dq = torch.zeros(B, T, H, K, device=q.device, dtype=torch.float32)
        dk = torch.zeros_like(dq)
        dv = torch.zeros_like(v)
        dg = torch.zeros(B, T, HV, device=q.device, dtype=torch.float32)
        dbeta = torch.zeros_like(dg)
        dh0 = None
        if problem.has_initial_state:
            dh0 = dht.clone() if dht is not None else torch.zeros(problem.state_shape, device=q.device)
    else:
        _, tmat, w, u = intra_chunk(k, v, None, beta, T, index.grid_t, cu, index.chunk_indices, gcum=gcum,
                                    tmat=saved.tmat, precise_u=True)
        p = plan(problem, cu, v.device, fusable=False)
        _, h, vnew, _, aug = _states(problem, p, q, k, NewValues.from_wu(w, u), gcum, h0, T, cu, index, store=True,
                                     want_ht=False)
        del u
        du = local_du(q, k, gcum, do, problem.scale, T, index.grid_t, cu, index.chunk_indices)
        if p.segments is None:
            dh, du, dh0 = backward_state(q, k, w, gcum, do, du, dht, problem.scale, T, N, cu, index.chunk_offsets,
                                         index.n_chunks, problem.state_v_first, problem.has_initial_state,
                                         BV=p.block_v)
        else:
            # the reverse pass in segments: dS0 = P^T dS_end + F per segment, F from a zero dS_end
            sg = p.segments
            _, _, f = backward_state(q, k, w, gcum, do, du, None, problem.scale, T, sg.n_seg, sg.cu_seqlens,
                                     sg.chunk_offsets, index.n_chunks, False, True, store=False, BV=p.block_v)
            ds_end, dh0 = segment_scan(aug, dht, sg.seg_offsets, N, HV, K, V, problem.state_v_first,
                                       problem.has_initial_state, dot_precision(k.dtype), f=f)
            # the segments' [E | P] and F are dead: freed before dS is allocated (bwd 4/8 1x8192: -24 MiB at
            # that moment, one of the backward's two equal memory peaks)
            del f, aug
            dh, du, _ = backward_state(q, k, w, gcum, do, du, ds_end, problem.scale, T, sg.n_seg, sg.cu_seqlens,
                                       sg.chunk_offsets, index.n_chunks, False, False, BV=p.block_v)
            del ds_end
        del w  # dead before the per-chunk kernels' outputs exist
        dq, dkp, dw, dgp = backward_chunk(q, k, vnew, h, dh, gcum, do, du, problem.scale, T, index.grid_t, cu,
                                          index.chunk_indices)
        del h, dh, vnew
        dk, dv, dbeta, dg = backward_wy(k, v, beta, gcum, tmat, dw, du, dkp, dgp, T, index.grid_t, cu,
                                        index.chunk_indices)
        del dw, du, dkp, dgp
        # dq, dk come summed over each key head's value heads ([B, T, H, K] fp32): this only casts them
        dq, dk = prologue.sum_qk_head_groups(problem, saved.dtypes, dq, dk, H)
    dq, dk, dg, dbeta, dA_log, ddt_bias = prologue.backward(problem, saved.stash, dq, dk, dg, dbeta,
                                                           saved.A_log, saved.dt_bias)
    return prologue.grads_in_input_dtypes(saved.dtypes, dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)
