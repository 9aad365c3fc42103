"""Context parallelism for the sm90 forward: few (sequence x value head) programs, long sequences.

The state pass runs one program per (sequence, value head, V tile), each walking its whole sequence. At
H=2 HV=8 with one sequence of 32768 tokens that is 32 programs at the narrowest V tile, for 132 SMs. So
the sequences are cut into segments of `seg` chunks, and the pass runs per segment with the right initial
state (docs/algorithm.md section 4), found by one of these routes:

    warm-up (warmup.py): where the gates decay, a few chunks before each segment run from a zero state give
        its initial state within e^-12 of the state's size (exact where they reach the sequence's start);
        a gather and one short launch of the state kernel. The gated route starts with it.
    exact: every segment's transition S_end = P S_0 + E as [E | P] (TileLang, propagator.py), then a scan
        over each sequence's segments (triton_generic's segment scan, ~0.02 ms at 2/8 1x32768). It costs
        ~1.3 output passes, so it is taken only where it pays (exact_route_pays): alone where WARMUP_ROUTE is
        off (tests), else behind the gated warm-up.
    gated (where the exact route pays): a warm-up of a fixed few chunks, then the exact route's kernels
        launched behind it but run only for the (segment, head) pairs whose successor the warm-up left outside
        the bound, flagged on the device; each segment then takes the warm state or its flagged neighbours'
        transitions (one program per segment and head: triton_generic's gated_segment_states_kernel;
        forward._initial_states); no host read, so a CUDA graph captures it whatever the flags.
    chained (where the exact route does not pay): no separate warm-up; the pass over segments (forward and
        reverse) reads, per (segment, head), how many chunks next to the segment the bound needs (warmup.
        walk_lengths, one search on the device), and each program walks those chunks from zero, state only,
        before its own (from h0 / dht where the walk reaches the sequence's boundary: exact): a segment never
        costs more than its sequence without segments, and nothing is read back.
    wide (inference, before the others where it applies: wide_segment_chunks): the chained route with one
        128-column program per (segment, head) (state_output_wide.py) and segments cut to fill the SMs in one
        wave, or, where one program per (sequence, head) fills them already but one long sequence keeps the
        others waiting, in several (wide_waves_segment_chunks); the pass without segments is launched beside it,
        and the device picks which of the two runs (pick): behind heads that barely decay the segments' walks
        would cost more than the plain pass.

then the state pass fused with the output, per segment, from those initial states; each sequence's final
state is its last segment's. Without triton installed, the forward runs without context parallelism.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from gdnkit.seqlayout import SequenceLayout

from . import warmup

# None: decide from the SM count; 0: never; n: segments of n chunks whenever a sequence is longer (tests)
SEGMENT_CHUNKS = None
# Below 32 chunks a segment, the kernel time gained is nil (2/8 1x2048: 0.068 ms plain, 0.066 with 8-chunk
# segments; 1x8192: 16 and 32 chunks within 2%) while the extra launches cost ~0.6 ms of host time per
# eager call (2/8 1x2048: 0.79 ms eager against 0.07 of device time).
MIN_SEGMENT_CHUNKS = 32
# The wide route's floor (wide_segment_chunks). Its cost per segment is a program and a walk of a chunk or two
# where gates settle, not a propagator and a scan step, so short sequences may take it too: 2/8 1x2048 in 16
# segments of 2 chunks is 128 programs of ~3 wide steps, where the 64-column pass without segments walks 32
# chunks on 16 SMs (0.051 of that point's 0.064 ms). Measured (H200, docs/performance.md): 1x2048
# 0.0626 -> 0.0295 ms at 2/8, 0.0654 -> 0.0380 at 4/16.
WIDE_MIN_SEGMENT_CHUNKS = 2
# Only when even the narrowest V tile (32: 4 programs per sequence and head) leaves this many SMs per program,
# i.e. at most ~half the SMs busy without it. H200 (after the row-decay and block-solve
# changes; forward ms, plain / 64-chunk / 128-chunk segments): 4/16 1x32768 (64 narrowest programs)
# 0.905 / 0.780 / 0.757; 8/32 1x32768 (128) 1.033 / 1.526 / 1.509. So 2: on at 64 programs, off at 128.
SMS_PER_PROGRAM = 2
# The chained route costs each segment only the chunks its heads walk, not ~1.3 output passes, so segments pay
# with fewer idle SMs: cut when the narrowest programs leave >= 1 SM each (8/32 with one long sequence); below
# SMS_PER_PROGRAM the forward and the backward take the chained route.
WARMUP_SMS_PER_PROGRAM = 1
# False: always the exact route (tests of the propagator path)
WARMUP_ROUTE = True
# False: inference segments take the routes above at 32 / 64 columns, not the wide one (tests of those routes)
WIDE_ROUTE = True
# The wide pass's chunk-step over the 64-column pass's, each at one program per SM (H200: ~2.9 vs
# ~2.0 us): the wide route pays only while its longest program (own chunks + walk) takes fewer than (longest
# sequence's chunks) / this steps (pick). With few plain programs (short sequences, few heads) the 64-column
# step is shorter than that and the ratio flatters the wide route; not yet calibrated there.
WIDE_STEP_RATIO = 1.45


def segment_chunks(layout: SequenceLayout, HV: int, sms: int) -> int | None:
    """Chunks per segment, or None for no context parallelism.

    At most sms / 2 (segment, head) pairs in all, so the output pass over segments fits one wave (at its
    64-wide V tile: two programs per pair, one per SM). Measured on the H200 (2/8, docs/performance.md):
    more, shorter segments cost more than they give. The segment scan grows with their number while the
    propagator pass barely shrinks, and one program past the SM count starts a second wave of the output
    pass. 1x32768: 16 chunks a segment 0.83 ms, 64 chunks 0.73 ms, 57 chunks (144 programs) 0.94 ms;
    1x8192: 16 chunks 0.21 ms, 8 chunks 0.24 ms."""
    if SEGMENT_CHUNKS is not None:
        return SEGMENT_CHUNKS or None
    if sms == 0 or _narrowest_programs(layout, HV) * WARMUP_SMS_PER_PROGRAM > sms:
        return None
    longest = max(layout.chunk_counts, default=0)
    per_sequence = max(1, sms // (2 * len(layout.lengths) * HV))
    seg = max(MIN_SEGMENT_CHUNKS, math.ceil(longest / per_sequence))
    return seg if seg < longest else None


def wide_segment_chunks(layout: SequenceLayout, HV: int, sms: int, fill: float) -> int | None:
    """Chunks per segment for the wide route (forward.py, inference and training): the chained route with one 128-column
    state-pass program per (segment, head), or None. Segments are cut where one program per (sequence, head)
    fills less than `fill` of the SMs, every sequence at one length, the shortest that keeps the (segment, head)
    pairs within one wave (H200: the wide pass walks a chunk in ~2.7 us at 128 columns where the
    64-column one needs ~2.0 us for half of it, and loads Q, K and Tb once per head); None where even those
    segments leave the pairs short of `fill`. Forced SEGMENT_CHUNKS leaves segmenting to the other routes (their tests)."""
    pairs = len(layout.lengths) * HV
    if SEGMENT_CHUNKS is not None or sms == 0 or pairs >= fill * sms:
        return None
    if sms // pairs < 2:
        return None
    chunks = layout.chunk_counts
    # the shortest segments whose (segment, head) programs fit one wave, every sequence cut at the same length:
    # cutting each sequence into sms // pairs pieces left unequal ones with long programs (28672 + 4096 tokens at
    # 2/8: 56-chunk segments, 0.373 ms against 0.172 for 1x32768 in 32-chunk ones; H200)
    seg = max(WIDE_MIN_SEGMENT_CHUNKS, math.ceil(sum(chunks) * HV / sms))
    while sum(-(-c // seg) for c in chunks) * HV > sms:
        seg += 1
    # where the 64-column pass without segments fills the SMs by itself (two programs per pair), the wide route
    # gains only a shorter walk, which short segments do not buy back: 16/64 1x2048 in 16-chunk segments 0.106
    # against 0.109 ms with gates that settle, 0.120 with model gates (the plain pass picked behind the pick's
    # launches; H200). Long segments there gain a third (16/64 1x32768: 1.30 against 1.55).
    if 2 * pairs >= fill * sms and seg < MIN_SEGMENT_CHUNKS:
        return None
    # sequences too short for segments that fill the SMs keep the other routes (the wide pass needs the pairs)
    return seg if sum(-(-c // seg) for c in chunks) * HV >= fill * sms else None


# Beyond one wave (wide_waves_segment_chunks): a program's share of its walk and of its pipeline's fill and drain,
# in wide steps, added to its own chunks
WAVE_STEP_OVERHEAD = 2
# In wide_waves_segment_chunks' domain the plain pass runs the wide pass's own 128-column kernel: one step for one
# (the pick's ratio there, times the waves)
WAVES_STEP_RATIO = 1.0
# the segments in waves are cut only where their estimate is at most this fraction of the plain pass's: the
# estimate leaves out the pick's and the walks' launches and the walks beyond WAVE_STEP_OVERHEAD
WAVES_MARGIN = 0.8


def wide_waves_segment_chunks(layout: SequenceLayout, HV: int, sms: int, fill: float) -> tuple[int, int] | None:
    """(chunks per segment, waves) for the forward's wide route where one program per (sequence, head) fills
    `fill` of the SMs already (wide_segment_chunks declines: no cut fits one wave) but the longest sequence keeps
    the plain pass, the same 128-column kernel, waiting: at 16/48 with 28672 + 4096 tokens 48 of its 96 programs
    walk 448 chunks after the other 48 finished at 64 (1.57 ms, FlashQLA 1.10; H200; 0.885 in waves,
    benchmarks/results/h200/full-results.md). Every sequence
    is cut at one length and the (segment, head) programs run in several waves of the SMs, one program an SM
    (the kernel's 201 KB of shared memory): at 64 chunks 384 programs in three waves, ~198 wide steps against 448.
    The cost model, in wide steps: waves * (seg + WAVE_STEP_OVERHEAD) for the segments, max(longest, total /
    SMs) for the plain pass (a lower bound of its time, so the segments are taken only where the longest
    sequence dominates it); segment lengths from _wave_segment_lengths; None unless they cost at most WAVES_MARGIN
    of the plain pass. The device's pick (pick, with the walks) still has the last word."""
    pairs = len(layout.lengths) * HV
    if SEGMENT_CHUNKS is not None or sms == 0 or pairs < fill * sms:
        return None
    chunks = layout.chunk_counts
    longest = max(chunks, default=0)
    plain = max(longest, sum(chunks) * HV / sms)
    if longest < plain:   # the total work, not the longest sequence, bounds the plain pass: segments cannot help
        return None
    best = None
    for seg in _wave_segment_lengths(longest):
        waves = -(-sum(-(-c // seg) for c in chunks) * HV // sms)
        cost = waves * (seg + WAVE_STEP_OVERHEAD)
        if cost <= WAVES_MARGIN * plain and (best is None or cost < best[0]):
            best = (cost, seg, waves)
    return None if best is None else best[1:]


def _wave_segment_lengths(longest: int):
    """The waves rule's candidate segment lengths below `longest`: 32 to 128 chunks by 16, then four a doubling
    (160, 192, 224, 256, 320, ...), so that the search costs the host a few dozen passes over the sequences
    whatever their length (every chunk count from 32 up was ~1000 passes at 1M tokens)."""
    seg, step = MIN_SEGMENT_CHUNKS, 16
    while seg < longest:
        yield seg
        if seg >= 8 * step:
            step *= 2
        seg += step


def pick(plan: SegmentPlan, walk: torch.Tensor, layout: SequenceLayout, waves: int = 1):
    """The device's pick between the wide route's pass over segments and the 64-column pass over whole
    sequences, both launched behind it (forward.py), each over its own cu_seqlens: (the wide pass's cu_seqlens
    and walks, the plain pass's cu_seqlens, a 0-dim bool: wide). The wide route is picked while its longest
    program (own chunks plus walk, in wide steps, WIDE_STEP_RATIO of a 64-column step) is shorter than the longest
    sequence: with gates that settle in a chunk it is (16/64 1x32768: 257 wide steps against 512); behind heads
    that barely decay (model-like gates: 76-175 chunks to e^-12) the segments walk far and the plain pass wins
    (16/64 1x32768: 1.90 against 1.55 ms; short sequences the more: a segment may walk to
    the sequence's start). The pass not picked runs over empty sequences; nothing is read back, so a CUDA graph
    captures both launches. One Triton launch (warmup_bound.pick_wide): the pick as torch ops and where-masks
    cost ~20-26 us of launches. waves: how many waves of the SMs the segments' programs take,
    each as long as its longest; more than one only in wide_waves_segment_chunks' domain, where the plain pass
    runs the same 128-column kernel (WAVES_STEP_RATIO), else the 64-column one (WIDE_STEP_RATIO)."""
    from .warmup_bound import pick_wide
    longest = max(layout.chunk_counts, default=0)
    ratio = waves * WAVES_STEP_RATIO if waves > 1 else WIDE_STEP_RATIO
    return pick_wide(walk, plan.own, plan.segments.cu_seqlens, layout.cu_seqlens, longest, ratio)


def _narrowest_programs(layout: SequenceLayout, HV: int) -> int:
    return 4 * len(layout.lengths) * HV


def exact_route_pays(layout: SequenceLayout, HV: int, sms: int) -> bool:
    """Whether segments with the exact route (propagator + scan) beat no segments (SMS_PER_PROGRAM)."""
    return SEGMENT_CHUNKS is not None or _narrowest_programs(layout, HV) * SMS_PER_PROGRAM <= sms


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
    # (int32 copies of WarmupTables' int64 ones: the TileLang kernels take int32, the Triton search int64 for
    # its token arithmetic)


@dataclasses.dataclass(frozen=True)
class SegmentPlan:
    segments: object                 # triton_generic.context_parallel.Segments
    chunk_offsets: torch.Tensor      # [n_seg + 1] int32: chunk-table row of each segment's first chunk
    warmup: warmup.WarmupTables      # what the warm-up routes need (warmup.py)
    window: int                      # the gated route's warm-up length in chunks (warmup.window)
    gated: warmup.WarmupRun          # the forward's gated warm-up launch (gathered chunks before each segment)
    walks: Walks                     # the chained route's segment tables
    own: torch.Tensor                # [n_seg] int32: each segment's own chunks


@functools.lru_cache(maxsize=32)
def plan_segments(layout: SequenceLayout, seg: int) -> SegmentPlan:
    """Cached per layout (itself cached per cu_seqlens tensor): a repeated call builds nothing."""
    from gdnkit.backends.triton_generic.context_parallel import cut_segments
    segments = cut_segments(layout, seg)
    dev = layout.cu_seqlens.device
    chunk_offsets = torch.cat([segments.chunk_offsets,
                               torch.tensor([layout.n_chunks], dtype=torch.int32, device=dev)])
    tables = warmup.tables(segments.cu_seqlens.tolist(), segments.seg_offsets.tolist(),
                           segments.chunk_offsets.tolist(), list(layout.offsets), dev)
    # the forward's gated warm-up, built here so that no call builds (copies) anything later, not even a training
    # call captured after an inference-only first call (the backward's walks its chunks in place: no launch table)
    window = warmup.window(seg)
    gated = warmup.fixed_warmup(tables, window, dev)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
    walks = Walks(i32(tables.before_host), i32(tables.after_host), i32(tables.seq_ends_host),
                  torch.tensor(tables.seq_of, dtype=torch.int64, device=dev))
    return SegmentPlan(segments, chunk_offsets, tables, window, gated, walks, chunk_offsets.diff())


def segment_states(plan: SegmentPlan, aug: torch.Tensor, h0, N: int, output_final_state: bool, dtype: torch.dtype,
                   f: torch.Tensor | None = None, need: torch.Tensor | None = None, warm: torch.Tensor | None = None,
                   in_place: bool = False):
    """Step 2, from step 1's aug [n_seg, HV, K, V + K]: every segment's initial state [n_seg, HV, K, V] fp32 and
    the sequences' final states. With f (the backward's dS at each segment's start from a zero dS_end), the
    reverse scan dS_end_{j-1} = P_j^T dS_end_j + f_j instead: h0 is dht, and it returns every segment's dS_end
    and the sequences' dh0. need, warm (the gated route): each segment's state from warm where need says its
    neighbour's transition was not computed; in_place: written over warm (triton_generic's segment_scan)."""
    from gdnkit.backends.triton_generic._common import dot_precision
    from gdnkit.backends.triton_generic.context_parallel import segment_scan

    _, HV, K, VK = aug.shape
    return segment_scan(aug, h0, plan.segments.seg_offsets, N, HV, K, VK - K, False, output_final_state,
                        dot_precision(dtype), f=f, need=need, warm=warm, seq_of=plan.walks.seq_of, in_place=in_place)
