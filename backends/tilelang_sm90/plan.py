"""How the sm90 backend runs a call: plan(problem, layout, resources, config) -> Plan, from the sequence layout, the
heads, the SM count and the Config (config.py), never from the data.

The Plan holds every host decision of the forward and the backward (docs/sm90-design.md, "Routes"):
- the route: plain (no segments), wide (the chained route at 128 columns in one wave of segments, the plain pass
  launched beside it and the device picking), waves (the same in several waves), chained, gated or
  exact (segments at 32 / 64 columns, each segment's entering state by walks, by a fixed lead-in checked on the
  device with the exact kernels behind it, or by the exact kernels alone);
- the segments (chunks per segment, their count) and the gated lead-in's window;
- each state pass's V tile, whether the intra kernel writes the walks' chunk sums (emit_bound);
- for training: the backward's path (fused or staged), its segments and route, the reverse pass's V tile, whether
  the S0 recompute runs beside it, and the recompute's tiles.

What depends on the data (how fast the gates decay) is decided on the device (lead_in_bound.py, context_parallel.
pick), so nothing here reads a tensor and CUDA graphs capture every route. forward.py and backward.py follow the
Plan; the rules below are the only place each decision is made.
"""
from __future__ import annotations

import dataclasses
import math
import weakref

from gdnkit.problem import Problem
from gdnkit.seqlayout import SequenceLayout

from .config import Config

# V tiles run by the three-warpgroup state kernel (state_output_narrow.py); 128 columns run state_output_wide.py (or,
# storing S0, state_output_pipelined.py)
NARROW_BLOCK_V = (32, 64)


@dataclasses.dataclass(frozen=True)
class Resources:
    """What the machine offers the plan."""
    sms: int                  # the device's SM count; 0 off CUDA (no context parallelism there)
    triton: bool = True       # context parallelism's scan and decay-bound kernels are Triton's


@dataclasses.dataclass(frozen=True)
class Plan:
    config: Config
    sms: int
    HV: int
    N: int                          # sequences
    train: bool
    route: str                      # "plain", "wide", "waves", "chained", "gated" or "exact"
    segment_chunks: int | None      # chunks per segment (None: plain)
    n_segments: int                 # segments (N where plain)
    waves: int                      # the wide route's waves of the SMs (0: not the wide route)
    window: int                     # the gated route's fixed lead-in, chunks (0 where plain)
    emit_bound: bool                # the intra kernel writes the walks' chunk sums (the chained and wide routes)
    block_v: int                    # the forward's state pass (over segments where cut)
    plain_block_v: int | None       # the wide routes' pass without segments, launched beside
    launches: tuple[int, ...]       # the forward's state passes' program rows: (segments[, sequences]) or (N,)
    stores_states: bool             # the training forward keeps every S0 (config.keep_states)
    # training only (None / () / False otherwise)
    fused_backward: bool = False
    fused_segment_chunks: int | None = None  # the fused path's segments: the wide route's, where the forward took it
    backward_route: str | None = None       # the staged reverse pass: "plain", "chained", "gated" or "exact"
    reverse_block_v: int | None = None      # its V tile where the recompute does not run beside it
    recompute_beside: bool = False          # the staged path's S0 recompute on a side stream (64 columns both)
    ds_only_block_v: int | None = None      # the gated route's reverse lead-in / exact passes
    recompute_block_v: tuple[int, ...] = ()  # the staged path's S0 recompute, per forward launch
    recompute_x: tuple[tuple[int, int], ...] = ()  # the fused path's S0 + X recompute: (V tile, programs an SM)

    @property
    def initial_states(self) -> str | None:
        """How segments get their entering states: "chained", "gated", "exact", or None (no segments)."""
        return {"plain": None, "wide": "chained", "waves": "chained"}.get(self.route, self.route)

    @property
    def wide(self) -> bool:
        return self.waves > 0

    def describe(self) -> str:
        """The plan in a few lines (gdnkit.explain)."""
        seg = "" if self.segment_chunks is None else \
            f", {self.n_segments} segments of {self.segment_chunks} chunks"
        waves = f" in {self.waves} waves" if self.waves > 1 else ""
        lines = [f"route: {self.route}{seg}{waves} ({self.sms} SMs)",
                 f"state pass: {self.block_v} columns" +
                 ("" if self.plain_block_v is None else f"; the pass without segments beside it: "
                  f"{self.plain_block_v} columns, the device picks")]
        if self.train:
            if self.fused_backward:
                back = "fused (backward_fused.py)" + (f", in the wide route's {self.n_segments} segments"
                                                      if self.fused_segment_chunks else "")
            else:
                back = f"staged, reverse pass {self.backward_route} at " + \
                    ("64 columns, the S0 recompute beside it" if self.recompute_beside
                     else f"{self.reverse_block_v} columns")
            lines.append(f"backward: {back}" + (", S0 kept from the forward" if self.stores_states else ""))
        return "\n".join(lines)


# Plans per layout (SequenceLayout hashes by identity, and seqlayout keeps one per offsets and device), then per
# (heads, training, machine, Config): an eager training loop calls with the same few layouts over and over, and
# planning costs tens of microseconds of Python a call. Weak keys: a plan goes with its layout, so this holds no
# more than seqlayout does.
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan(problem: Problem, layout: SequenceLayout, resources: Resources, config: Config) -> Plan:
    """The Plan of a chunked call (forward, and for a problem that needs gradients its backward): a function of
    the layout, the value heads, whether the call trains, the machine and the Config, kept per key."""
    plans = _PLANS.setdefault(layout, {})
    key = (problem.HV, problem.needs_grad, resources, config)
    found = plans.get(key)
    if found is None:
        found = plans[key] = _plan(layout, problem.HV, problem.needs_grad, resources, config)
    return found


def _plan(layout: SequenceLayout, HV: int, train: bool, res: Resources, cfg: Config) -> Plan:
    sms, N = res.sms, len(layout.lengths)
    stores_states = train and cfg.keep_states
    seg, waves = _segments(layout, HV, res, cfg)
    route = "plain"
    if seg:
        if waves or not exact_route_pays(layout, HV, sms, cfg):
            route = "chained" if chained_route_available(cfg) else "plain"
        else:
            route = "gated" if cfg.lead_in_route else "exact"
        if route == "chained" and waves:
            route = "wide" if waves == 1 else "waves"
    if route == "plain":
        seg, waves = None, 0
    n_seg = N if seg is None else sum(-(-c // seg) for c in layout.chunk_counts)
    block_v = state_block_v(n_seg, HV, sms, cfg, wide=not stores_states)
    plain_block_v = None
    launches = (n_seg,)
    if waves:
        # beside several waves the 128-column kernel, unless the pass must store S0 (keep_states), which it cannot
        plain_block_v = state_block_v(N, HV, sms, cfg, wide=not stores_states) if waves > 1 \
            else block_v_split(N, HV, sms, cfg)
        launches = (n_seg, N)
    fields = dict(config=cfg, sms=sms, HV=HV, N=N, train=train, route=route, segment_chunks=seg, n_segments=n_seg,
                  waves=waves, window=0 if seg is None else window(seg, cfg),
                  emit_bound=route in ("chained", "wide", "waves"),
                  block_v=block_v, plain_block_v=plain_block_v, launches=launches, stores_states=stores_states)
    if train and layout.n_chunks:
        fields.update(_backward(layout, HV, res, cfg, route, seg, n_seg, launches, stores_states))
    return Plan(**fields)


def _backward(layout: SequenceLayout, HV: int, res: Resources, cfg: Config, route: str, seg: int | None,
              n_seg: int, launches: tuple[int, ...], stores_states: bool) -> dict:
    """The training plan's backward fields. Its segments are the training forward's (the wide route in one wave,
    else the segment rule), run right to left by the same route."""
    sms = res.sms
    backward_route = {"wide": "chained", "waves": "chained"}.get(route, route)
    n_reverse = n_seg
    beside = not stores_states and sms > 0 and cfg.block_v is None and 2 * HV * (sum(launches) + n_reverse) <= sms
    recompute_x = []
    for n in launches:
        bv = block_v_split(n, HV, sms, cfg)
        bv = bv if bv in NARROW_BLOCK_V else NARROW_BLOCK_V[-1]
        recompute_x.append((bv, recompute_per_sm(bv, True, cfg)))
    return dict(fused_backward=fused_pays(layout, HV, sms, cfg, stores_states, res),
                fused_segment_chunks=seg if route in ("wide", "waves") else None, backward_route=backward_route,
                reverse_block_v=state_block_v(n_reverse, HV, sms, cfg, wide=True), recompute_beside=beside,
                ds_only_block_v=state_block_v(n_seg, HV, sms, cfg, wide=True) if route != "plain" else None,
                recompute_block_v=tuple(block_v_split(n, HV, sms, cfg) for n in launches),
                recompute_x=tuple(recompute_x))


def _segments(layout: SequenceLayout, HV: int, res: Resources, cfg: Config) -> tuple[int | None, int]:
    """(chunks per segment or None, the waves of the wide route's programs, 0 where they do not take it): the
    wide route where it applies, in one wave (wide_segment_chunks), else in several (wide_waves_segment_chunks);
    everything else segment_chunks' segments. Training takes the wide routes as inference does (docs/performance.md:
    its forward is inference's, 15-45% faster than the 64-column pass it ran before at the quick points; the
    backward's recompute replays the same segments at 32 / 64 columns, and the fused backward runs one program per
    segment and head, so that in waves packed documents of unequal lengths walk ~2 x 48 chunks where their longest
    sequence walked 128)."""
    if wide_route_available(cfg, res):
        seg = wide_segment_chunks(layout, HV, res.sms, cfg)
        if seg:
            return seg, 1
        cut = wide_waves_segment_chunks(layout, HV, res.sms, cfg)
        if cut:
            return cut
    return (segment_chunks(layout, HV, res.sms, cfg) if res.triton else None), 0


def chained_route_available(cfg: Config) -> bool:
    """Whether the chained route can run (forward and backward): it needs the decay bound (lead_in_route) and a
    three-warpgroup state pass to walk in (a 32- or 64-column tile: not block_v forced to 128)."""
    return cfg.lead_in_route and (cfg.block_v or NARROW_BLOCK_V[0]) in NARROW_BLOCK_V


def wide_route_available(cfg: Config, res: Resources) -> bool:
    """Whether the wide route can run: on, not forced off by block_v, with the chained route (its walks)."""
    return cfg.wide_route and cfg.block_v is None and res.triton and chained_route_available(cfg)


def window(segment_chunks: int, cfg: Config) -> int:
    """The fixed lead-in's length in chunks: first_window, or half a segment where that is less (each lead-in
    chunk lies on the critical path as a segment's own chunk does)."""
    return min(segment_chunks // 2, cfg.first_window)


def block_v_split(N: int, HV: int, sms: int, cfg: Config) -> int:
    """The V tile of a pass over N sequences (or segments) whose kernels split V: 32 or 64 (the backward's reverse
    pass and recompute, the forward's training / chained builds), or block_v where forced."""
    if cfg.block_v is not None:
        return cfg.block_v
    return 64 if 2 * N * HV >= cfg.target_sm_fraction * sms else 32


def state_block_v(N: int, HV: int, sms: int, cfg: Config, wide: bool) -> int:
    """A state pass's V tile: all 128 columns where the pass may take its full-width kernel (wide: the forward's
    state_output_wide.py where it writes O and stores no S0; the backward's reverse pass, backward_state_wide.py,
    always) and one program per (sequence or segment, head) fills target_sm_fraction of the SMs, else
    block_v_split's."""
    if cfg.block_v is None and wide and N * HV >= cfg.target_sm_fraction * sms:
        return 128
    return block_v_split(N, HV, sms, cfg)


def recompute_per_sm(block_v: int, store_x: bool, cfg: Config) -> int:
    """The programs an SM of a state pass's build: recompute_per_sm for the fused backward's recompute at 64
    columns (S0 and X stored, no output: the only build that fits two), else 1."""
    return cfg.recompute_per_sm if store_x and block_v == 64 else 1


def fused_pays(layout: SequenceLayout, HV: int, sms: int, cfg: Config, stores_states: bool = False,
               res: Resources | None = None) -> bool:
    """Whether the backward runs the fused kernel: config.fused_backward where set, else the rule (config.py's
    fused_min_work and fused_max_imbalance)."""
    if cfg.fused_backward is not None:
        return cfg.fused_backward
    if stores_states:   # the forward kept S0: the staged path reads it, the fused one recomputes it
        return False
    work = layout.n_chunks * HV
    if work < cfg.fused_min_work or sms == 0:
        return False
    longest = max(layout.chunk_counts)
    seg, waves = _segments(layout, HV, res or Resources(sms), cfg)
    if waves:   # the fused path's programs are the wide routes' segments
        longest = min(longest, seg)
    return longest <= cfg.fused_max_imbalance * work / sms


def _narrowest_programs(layout: SequenceLayout, HV: int) -> int:
    return 4 * len(layout.lengths) * HV


def exact_route_pays(layout: SequenceLayout, HV: int, sms: int, cfg: Config) -> bool:
    """Whether segments with the exact route (propagator + scan) beat no segments (sms_per_program)."""
    if cfg.exact_route_pays is not None:
        return cfg.exact_route_pays
    return cfg.segment_chunks is not None or _narrowest_programs(layout, HV) * cfg.sms_per_program <= sms


def segment_chunks(layout: SequenceLayout, HV: int, sms: int, cfg: Config) -> int | None:
    """Chunks per segment of the 32 / 64-column routes (chained, gated, exact), or None for no segments.

    At most sms / 2 (segment, head) pairs in all, so the output pass over segments fits one wave (at its
    64-wide V tile: two programs per pair, one per SM). Measured on the H200 (2/8, docs/performance.md):
    more, shorter segments cost more than they give. The segment scan grows with their number while the
    propagator pass barely shrinks, and one program past the SM count starts a second wave of the output
    pass. 1x32768: 16 chunks a segment 0.83 ms, 64 chunks 0.73 ms, 57 chunks (144 programs) 0.94 ms;
    1x8192: 16 chunks 0.21 ms, 8 chunks 0.24 ms."""
    if cfg.segment_chunks is not None:
        return cfg.segment_chunks or None
    if sms == 0 or _narrowest_programs(layout, HV) * cfg.lead_in_sms_per_program > sms:
        return None
    longest = max(layout.chunk_counts, default=0)
    per_sequence = max(1, sms // (2 * len(layout.lengths) * HV))
    seg = max(cfg.min_segment_chunks, math.ceil(longest / per_sequence))
    return seg if seg < longest else None


def wide_segment_chunks(layout: SequenceLayout, HV: int, sms: int, cfg: Config) -> int | None:
    """Chunks per segment for the wide route in one wave (inference and training): the chained route with one
    128-column state-pass program per (segment, head), or None. Segments are cut where one program per (sequence,
    head) fills less than target_sm_fraction of the SMs, every sequence at one length, the shortest that keeps the
    (segment, head) pairs within one wave (H200: the wide pass walks a chunk in ~2.7 us at 128 columns where the
    64-column one needs ~2.0 us for half of it, and loads Q, K and Tb once per head); None where even those
    segments leave the pairs short of the fraction. Forced segment_chunks leaves segmenting to the other routes
    (their tests)."""
    if cfg.wide_segment_chunks is not None:
        return cfg.wide_segment_chunks or None
    fill = cfg.target_sm_fraction
    pairs = len(layout.lengths) * HV
    if cfg.segment_chunks is not None or sms == 0 or pairs >= fill * sms:
        return None
    if sms // pairs < 2:
        return None
    chunks = layout.chunk_counts
    # the shortest segments whose (segment, head) programs fit one wave, every sequence cut at the same length:
    # cutting each sequence into sms // pairs pieces left unequal ones with long programs (28672 + 4096 tokens at
    # 2/8: 56-chunk segments, 0.373 ms against 0.172 for 1x32768 in 32-chunk ones; H200)
    seg = max(cfg.wide_min_segment_chunks, math.ceil(sum(chunks) * HV / sms))
    while sum(-(-c // seg) for c in chunks) * HV > sms:
        seg += 1
    # where the 64-column pass without segments fills the SMs by itself (two programs per pair), the wide route
    # gains only a shorter walk, which short segments do not buy back: 16/64 1x2048 in 16-chunk segments 0.106
    # against 0.109 ms with gates that settle, 0.120 with model gates (the plain pass picked behind the pick's
    # launches; H200). Long segments there gain a third (16/64 1x32768: 1.30 against 1.55).
    if 2 * pairs >= fill * sms and seg < cfg.min_segment_chunks:
        return None
    # sequences too short for segments that fill the SMs keep the other routes (the wide pass needs the pairs)
    return seg if sum(-(-c // seg) for c in chunks) * HV >= fill * sms else None


def wide_waves_segment_chunks(layout: SequenceLayout, HV: int, sms: int, cfg: Config) -> tuple[int, int] | None:
    """(chunks per segment, waves) for the forward's wide route where one program per (sequence, head) fills
    target_sm_fraction of the SMs already (wide_segment_chunks declines: no cut fits one wave) but the longest
    sequence keeps the plain pass, the same 128-column kernel, waiting: at 16/48 with 28672 + 4096 tokens 48 of its
    96 programs walk 448 chunks after the other 48 finished at 64 (1.57 ms, FlashQLA 1.10; H200; 0.885 in waves,
    benchmarks/results/h200/full-results.md). Every sequence is cut at one length and the (segment, head) programs
    run in several waves of the SMs, one program an SM (the kernel's 201 KB of shared memory): at 64 chunks 384
    programs in three waves, ~198 wide steps against 448. The cost model, in wide steps: waves * (seg +
    wave_step_overhead) for the segments, max(longest, total / SMs) for the plain pass (a lower bound of its time,
    so the segments are taken only where the longest sequence dominates it); segment lengths from
    _wave_segment_lengths; None unless they cost at most waves_margin of the plain pass. The device's pick
    (context_parallel.pick, with the walks) still has the last word."""
    if cfg.wide_waves_segment_chunks is not None:
        return cfg.wide_waves_segment_chunks
    pairs = len(layout.lengths) * HV
    if cfg.segment_chunks is not None or sms == 0 or pairs < cfg.target_sm_fraction * sms:
        return None
    chunks = layout.chunk_counts
    longest = max(chunks, default=0)
    plain = max(longest, sum(chunks) * HV / sms)
    if longest < plain:   # the total work, not the longest sequence, bounds the plain pass: segments cannot help
        return None
    best = None
    for seg in _wave_segment_lengths(longest, cfg):
        waves = -(-sum(-(-c // seg) for c in chunks) * HV // sms)
        cost = waves * (seg + cfg.wave_step_overhead)
        if cost <= cfg.waves_margin * plain and (best is None or cost < best[0]):
            best = (cost, seg, waves)
    return None if best is None else best[1:]


def _wave_segment_lengths(longest: int, cfg: Config):
    """The waves rule's candidate segment lengths below `longest`: 32 to 128 chunks by 16, then four a doubling
    (160, 192, 224, 256, 320, ...), so that the search costs the host a few dozen passes over the sequences
    whatever their length (every chunk count from 32 up was ~1000 passes at 1M tokens)."""
    seg, step = cfg.min_segment_chunks, 16
    while seg < longest:
        yield seg
        if seg >= 8 * step:
            step *= 2
        seg += step
