"""Context parallelism for the sm90 forward: few (sequence x value head) programs, long sequences.

The state pass runs one program per (sequence, value head, V tile), each walking its whole sequence. At
H=2 HV=8 with one sequence of 32768 tokens that is 32 programs at the narrowest V tile, for 132 SMs. So
the sequences are cut into segments of `seg` chunks, and the pass runs per segment with the right initial
state (docs/algorithm.md section 4), found by one of these routes:

    lead-in (lead_in.py): where the gates decay, a few chunks before each segment run from a zero state give
        its initial state within e^-12 of the state's size (exact where they reach the sequence's start);
        a gather and one short launch of the state kernel. The gated route starts with it.
    exact: every segment's transition S_end = P S_0 + E as [E | P] (TileLang, propagator.py), then a scan
        over each sequence's segments (triton_generic's segment scan, ~0.02 ms at 2/8 1x32768). It costs
        ~1.3 output passes, so it is taken only where it pays (plan.exact_route_pays): alone where lead_in_route is
        off (tests), else behind the gated lead-in.
    gated (where the exact route pays): a lead-in of a fixed few chunks, then the exact route's kernels
        launched behind it but run only for the (segment, head) pairs whose successor the lead-in left outside
        the bound, flagged on the device; each segment then takes the lead-in state or its flagged neighbours'
        transitions (one program per segment and head: triton_generic's gated_segment_states_kernel;
        forward._initial_states); no host read, so a CUDA graph captures it whatever the flags.
    chained (where the exact route does not pay): no separate lead-in; the pass over segments (forward and
        reverse) reads, per (segment, head), how many chunks next to the segment the bound needs (lead_in.
        walk_lengths, one search on the device), and each program walks those chunks from zero, state only,
        before its own (from h0 / dht where the walk reaches the sequence's boundary: exact): a segment never
        costs more than its sequence without segments, and nothing is read back.
    wide (inference, before the others where it applies: plan.wide_segment_chunks): the chained route with one
        128-column program per (segment, head) (state_output_wide.py) and segments cut to fill the SMs in one
        wave, or, where one program per (sequence, head) fills them already but one long sequence keeps the
        others waiting, in several (plan.wide_waves_segment_chunks); the pass without segments is launched beside it,
        and the device picks which of the two runs (pick): behind heads that barely decay the segments' walks
        would cost more than the plain pass.

then the state pass fused with the output, per segment, from those initial states; each sequence's final
state is its last segment's. Without triton installed, the forward runs without context parallelism.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from gdnkit.seqlayout import SequenceLayout

from . import lead_in, plan
from .config import Config, current

def pick(plan: SegmentPlan, walk: torch.Tensor, layout: SequenceLayout, waves: int = 1, cfg: Config | None = None):
    """The device's pick between the wide route's pass over segments and the 64-column pass over whole
    sequences, both launched behind it (forward.py), each over its own cu_seqlens: (the wide pass's cu_seqlens
    and walks, the plain pass's cu_seqlens, a 0-dim bool: wide). The wide route is picked while its longest
    program (own chunks plus walk, in wide steps, wide_step_ratio of a 64-column step) is shorter than the longest
    sequence: with gates that settle in a chunk it is (16/64 1x32768: 257 wide steps against 512); behind heads
    that barely decay (model-like gates: 76-175 chunks to e^-12) the segments walk far and the plain pass wins
    (16/64 1x32768: 1.90 against 1.55 ms; short sequences the more: a segment may walk to
    the sequence's start). The pass not picked runs over empty sequences; nothing is read back, so a CUDA graph
    captures both launches. One Triton launch (lead_in_bound.pick_wide): the pick as torch ops and where-masks
    cost ~20-26 us of launches. waves: how many waves of the SMs the segments' programs take,
    each as long as its longest; more than one only in plan.wide_waves_segment_chunks' domain, where the plain
    pass runs the same 128-column kernel (waves_step_ratio), else the 64-column one (wide_step_ratio); cfg: the
    plan's Config (default: the current one)."""
    from .lead_in_bound import pick_wide
    cfg = cfg or current()
    longest = max(layout.chunk_counts, default=0)
    ratio = waves * cfg.waves_step_ratio if waves > 1 else cfg.wide_step_ratio
    return pick_wide(walk, plan.own, plan.segments.cu_seqlens, layout.cu_seqlens, longest, ratio)


def available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: run without context parallelism
        return False
    return True


@dataclasses.dataclass(frozen=True)
class Walks:
    """Per segment, on the device, what the chained route's kernels read beside the walk lengths."""
    before: torch.Tensor             # [n_seg] int32: whole chunks between its sequence's start and it
    after: torch.Tensor              # [n_seg] int32: chunks between it and its sequence's end (a tail counts)
    seq_end: torch.Tensor            # [n_seg] int32: the token after its sequence's last
    seq_of: torch.Tensor             # [n_seg] int64: its sequence (gathers h0 / dht per segment)
    # (int32 copies of LeadInTables' int64 ones: the TileLang kernels take int32, the Triton search int64 for
    # its token arithmetic)


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    segments: object                 # triton_shared.segments.Segments (imported with triton, lazily)
    chunk_offsets: torch.Tensor      # [n_seg + 1] int32: chunk-table row of each segment's first chunk
    lead_in: lead_in.LeadInTables    # what the lead-in routes need (lead_in.py)
    window: int                      # the gated route's lead-in length in chunks (plan.window)
    gated: lead_in.LeadInRun         # the forward's gated lead-in launch (gathered chunks before each segment)
    walks: Walks                     # the chained route's segment tables
    own: torch.Tensor                # [n_seg] int32: each segment's own chunks


@functools.lru_cache(maxsize=32)
def plan_segments(layout: SequenceLayout, seg: int, window: int | None = None) -> SegmentPlan:
    """Cached per layout (itself cached per cu_seqlens tensor): a repeated call builds nothing. window: the gated
    route's lead-in in chunks (the Plan's), else plan.window's under the current Config."""
    from gdnkit.backends.triton_shared.segments import cut_segments
    segments = cut_segments(layout, seg)
    dev = layout.cu_seqlens.device
    chunk_offsets = torch.cat([segments.chunk_offsets,
                               torch.tensor([layout.n_chunks], dtype=torch.int32, device=dev)])
    tables = lead_in.tables(segments.cu_seqlens.tolist(), segments.seg_offsets.tolist(),
                           segments.chunk_offsets.tolist(), list(layout.offsets), dev)
    # the forward's gated lead-in, built here so that no call builds (copies) anything later, not even a training
    # call captured after an inference-only first call (the backward's walks its chunks in place: no launch table)
    window = plan.window(seg, current()) if window is None else window
    gated = lead_in.fixed_lead_in(tables, window, dev)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    walks = Walks(i32(tables.before_host), i32(tables.after_host), i32(tables.seq_ends_host),
                  torch.tensor(tables.seq_of, dtype=torch.int64, device=dev))
    return SegmentPlan(segments, chunk_offsets, tables, window, gated, walks, chunk_offsets.diff())


def segment_states(plan: SegmentPlan, aug: torch.Tensor, h0, N: int, output_final_state: bool, dtype: torch.dtype,
                   f: torch.Tensor | None = None, need: torch.Tensor | None = None,
                   lead_in_states: torch.Tensor | None = None,
                   in_place: bool = False):
    """Step 2, from step 1's aug [n_seg, HV, K, V + K]: every segment's initial state [n_seg, HV, K, V] fp32 and the
    sequences' final states. With f (the backward's dS at each segment's start from a zero dS_end), the reverse scan
    dS_end_{j-1} = P_j^T dS_end_j + f_j instead: h0 is dht, and it returns every segment's dS_end and the sequences'
    dh0. need, lead_in_states (the gated route): each segment's state from lead_in_states where need says its
    neighbour's transition was not computed; in_place: written over lead_in_states (triton_shared/segments.py's
    segment_scan)."""
    from gdnkit.backends.triton_shared.jit_helpers import dot_precision
    from gdnkit.backends.triton_shared.segments import segment_scan

    _, HV, K, VK = aug.shape
    return segment_scan(aug, h0, plan.segments.seg_offsets, N, HV, K, VK - K, False, output_final_state,
                        dot_precision(dtype), f=f, need=need, lead_in_states=lead_in_states, seq_of=plan.walks.seq_of,
                        in_place=in_place)
