"""Context parallelism inside one GPU for few, long sequences (docs/algorithm.md section 4, the exact form): the
segments and the scan over them, shared by triton_generic (chunked.py) and tilelang_sm90 (context_parallel.py).

The state pass runs one program per (sequence, value head, V block) down a whole sequence; with few heads
that leaves most SMs idle. Cut every sequence into segments of whole chunks:
  1. every segment, in parallel, from a zero state: S_end = P S0 + E, with E [K, V] and the transition
     P [K, K] from the same kernel (triton_generic's state_pass in propagator mode: K extra identity columns
     with U' = 0; tilelang_sm90's propagator.py);
  2. per sequence, a short scan over its segments: S0 of segment j+1 = P_j S0_j + E_j (this module);
  3. every segment, in parallel, the ordinary state pass (+ output) from its true S0.
Segments are pseudo-sequences for the varlen code path: (cu_seqlens, chunk_offsets) over segments.
Chunk boundaries do not move, so the chunk-local gate cumsum, W and U' are shared by all passes.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from gdnkit.seqlayout import SequenceLayout

from .jit_helpers import CHUNK, grid_2d, state_tile
from .launch import launch
from .sizes import cdiv, flat_grid, next_power_of_2


@triton.jit
def _transition(aug, f, s, i_h, S, ck, cv, mv, tile, PREC: tl.constexpr, HV, K: tl.constexpr,
                V: tl.constexpr, REVERSE: tl.constexpr):
    """One step of the scan through segment s: P S + E (forward) or P^T S + F (REVERSE)."""
    ab = aug + (s * HV + i_h) * K * (V + K)
    if REVERSE:
        E = tl.load(f + (s * HV + i_h) * K * V + tile, mask=mv[None, :], other=0.0)
        P = tl.load(ab + ck[None, :] * (V + K) + V + ck[:, None])
    else:
        E = tl.load(ab + ck[:, None] * (V + K) + cv[None, :], mask=mv[None, :], other=0.0)
        P = tl.load(ab + ck[:, None] * (V + K) + V + ck[None, :])
    return tl.dot(P, S, input_precision=PREC) + E


@triton.jit(do_not_specialize=["N0"])
def segment_scan_kernel(aug, f, h0, s0, ht, seg_offsets, N0, PREC: tl.constexpr, HV, K: tl.constexpr,
                        V: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                        STATE_V_FIRST: tl.constexpr, REVERSE: tl.constexpr):
    """Forward: S0_{j+1} = P_j S0_j + E_j, storing every S0_j. REVERSE (the backward's dS): walking
    segments last to first, dS_end_{j-1} = P_j^T dS_end_j + F_j, storing every dS_end_j."""
    i_v, i_nh = grid_2d(N0)
    i_n, i_h = i_nh // HV, i_nh % HV
    s_begin = tl.load(seg_offsets + i_n).to(tl.int64)
    s_end = tl.load(seg_offsets + i_n + 1).to(tl.int64)
    ck, cv, mv, s_off = state_tile(i_v, K, V, BV, STATE_V_FIRST)
    tile = ck[:, None] * V + cv[None, :]
    S = tl.zeros([K, BV], dtype=tl.float32)
    if HAS_H0:
        S += tl.load(h0 + i_nh.to(tl.int64) * K * V + s_off, mask=mv[None, :], other=0.0)
    n = s_end - s_begin
    for j in range(n):
        s = s_end - 1 - j if REVERSE else s_begin + j
        tl.store(s0 + (s * HV + i_h) * K * V + tile, S, mask=mv[None, :])
        S = _transition(aug, f, s, i_h, S, ck, cv, mv, tile, PREC, HV, K, V, REVERSE)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + s_off, S, mask=mv[None, :])


@triton.jit(do_not_specialize=["N0"])
def gated_segment_states_kernel(aug, f, h0, s0, seg_offsets, seq_of, need, lead_in_states, N0,
                                PREC: tl.constexpr, HV, K: tl.constexpr, V: tl.constexpr,
                                BV: tl.constexpr, HAS_H0: tl.constexpr, REVERSE: tl.constexpr, IN_PLACE: tl.constexpr):
    """tilelang_sm90's graph-safe lead-in route: the scan's states, one program per (segment, head, V tile). Segment s's
    state is the boundary's (h0; dht with REVERSE) for its sequence's first segment (last), else lead_in_states[s] where
    need leaves its neighbour's transition uncomputed (need[s - 1, head] == 0; need[s + 1, head] with REVERSE), else
    that transition applied to the neighbour's state. So each program walks its flagged neighbours towards the boundary
    to the nearest state not made by a transition and applies their transitions back: one load and store where no pair
    is flagged, where the scan took a dependent step per segment. IN_PLACE (s0 is lead_in_states): a segment whose state
    is its own lead-in state loads and stores nothing; the others write over theirs, which no program reads (a program
    reads lead_in_states only at the segment its walk stops at, whose own walk stops at once)."""
    i_v, i_sh = grid_2d(N0)
    s, i_h = (i_sh // HV).to(tl.int64), i_sh % HV
    i_n = tl.load(seq_of + s).to(tl.int64)
    s_begin = tl.load(seg_offsets + i_n).to(tl.int64)
    s_end = tl.load(seg_offsets + i_n + 1).to(tl.int64)
    ck, cv, mv, s_off = state_tile(i_v, K, V, BV, False)
    tile = ck[:, None] * V + cv[None, :]
    edge = s_end - 1 if REVERSE else s_begin
    step = 1 if REVERSE else -1
    t = s
    go = t != edge
    while go:
        nt = t + step
        flagged = tl.load(need + nt * HV + i_h) != 0
        t = tl.where(flagged, nt, t)
        go = flagged & (nt != edge)
    made = mv   # the tile's columns this program writes (as tiles: scalar masks the interpreter refuses)
    if IN_PLACE:
        made = mv & (((cv * 0 + t) != s) | ((cv * 0 + t) == edge))
    from_lead_in = made & ((cv * 0 + t) != edge)
    S = tl.load(lead_in_states + (t * HV + i_h) * K * V + tile, mask=from_lead_in[None, :], other=0.0)
    if HAS_H0:
        at_edge = made & ((cv * 0 + t) == edge)
        S += tl.load(h0 + (i_n * HV + i_h) * K * V + s_off, mask=at_edge[None, :], other=0.0)
    for j in range((t - s) * step):
        S = _transition(aug, f, t - j * step, i_h, S, ck, cv, mv, tile, PREC, HV, K, V, REVERSE)
    tl.store(s0 + (s * HV + i_h) * K * V + tile, S, mask=made[None, :])


def segment_scan(aug, h0, seg_offsets, N, HV, K, V, state_v_first, output_final_state, prec, f=None, need=None,
                 lead_in_states=None, seq_of=None, in_place=False):
    """Returns (S0 of every segment [n_seg, HV, K, V] fp32, the sequences' final states or None).

    With f (the segments' dS0 from a zero terminal gradient) it runs the backward's reverse scan instead: h0 is dht, the
    first return the true dS_end of every segment, the second dh0. With need ([n_seg, HV] int32), lead_in_states
    ([n_seg, HV, K, V] fp32, states from lead-ins) and seq_of ([n_seg], each segment's sequence): a segment's state
    comes from lead_in_states where need says its neighbour's transition was not computed (gated_segment_states_kernel;
    no final states); in_place: the states are written over lead_in_states, which is returned (where no pair is flagged
    the launch then moves no state, the copy of lead_in_states that it was otherwise)."""
    n_seg = aug.shape[0]
    assert not in_place or need is not None
    s0 = lead_in_states if in_place else torch.empty(n_seg, HV, K, V, device=aug.device, dtype=torch.float32)
    # P [K, K] fp32 goes through shared memory: narrow S blocks keep it at ~80 KB (sm86/89 fit)
    BV = min(16, next_power_of_2(V))
    if need is not None:
        assert not output_final_state and not state_v_first and seq_of is not None
        launch("segment_scan", aug.dtype, gated_segment_states_kernel, flat_grid(cdiv(V, BV), n_seg * HV),
               aug, f, h0, s0, seg_offsets, seq_of, need, lead_in_states, cdiv(V, BV), PREC=prec, HV=HV, K=K, V=V,
               BV=BV, HAS_H0=h0 is not None, REVERSE=f is not None, IN_PLACE=in_place)
        return s0, None
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    ht = torch.empty(shape, device=aug.device, dtype=torch.float32) if output_final_state else None
    launch("segment_scan", aug.dtype, segment_scan_kernel, flat_grid(cdiv(V, BV), N * HV),
           aug, f, h0, s0, ht, seg_offsets, cdiv(V, BV), PREC=prec, HV=HV, K=K, V=V, BV=BV, HAS_H0=h0 is not None,
           STORE_HT=output_final_state, STATE_V_FIRST=state_v_first, REVERSE=f is not None)
    return s0, ht


@dataclasses.dataclass(frozen=True)
class Segments:
    n_seg: int
    cu_seqlens: torch.Tensor      # [n_seg + 1] token offsets of the segments (pseudo-sequences)
    chunk_offsets: torch.Tensor   # [n_seg] global index of each segment's first chunk
    seg_offsets: torch.Tensor     # [N + 1] first segment of every real sequence


@functools.lru_cache(maxsize=64)
def cut_segments(layout: SequenceLayout, seg_chunks: int) -> Segments:
    """Cached per layout (itself cached per cu_seqlens tensor, or per shape for a dense batch): a repeated
    call builds and copies nothing."""
    # Sequences are packed back to back, so segments are too: segment i ends where i+1 starts, and the
    # starts plus the last end form an ordinary cu_seqlens over the segments.
    cu, chunk_off, seg_off = [], [], [0]
    chunk = 0
    for start, length in zip(layout.offsets[:-1], layout.lengths):
        n_chunks = cdiv(length, CHUNK)
        for j in range(0, n_chunks, seg_chunks):
            cu.append(start + j * CHUNK)
            chunk_off.append(chunk + j)
        chunk += n_chunks
        seg_off.append(len(chunk_off))
    cu.append(layout.offsets[-1])
    device = layout.cu_seqlens.device
    return Segments(len(chunk_off), torch.tensor(cu, dtype=torch.int32, device=device),
                    torch.tensor(chunk_off, dtype=torch.int32, device=device),
                    torch.tensor(seg_off, dtype=torch.int32, device=device))
