"""Every knob of the sm90 backend's planning, in one frozen Config.

The environment (GDNKIT_SM90_*) is read once, here, at import: `environment()` is that Config. A call plans
with `current()`, which is the environment's Config unless a caller chose another for the calls it makes
(`configured`: a context variable, so threads and tests do not see each other's choice and nothing module-global
is patched):

    with configured(fused_backward=True):     # every backward in this block takes the fused kernel
        ...

The thresholds' measurements are in docs/performance.md and benchmarks/results/h200/; plan.py says how each is
used.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Iterator, Mapping


@dataclasses.dataclass(frozen=True)
class Config:
    # -- the state pass's V tile (plan.state_block_v) --
    # None: from the SM count; 32 / 64 / 128: forced for every pass (tests, A/Bs)
    block_v: int | None = None
    # the state pass has N * HV * (V / BV) programs, each walking a whole sequence: narrower V tiles buy parallelism
    # when (sequences x heads) leave SMs idle (FlashQLA's rule: aim at ~70% of the SMs)
    target_sm_fraction: float = 0.7
    # -- training --
    # keep every chunk's entering state S0 from the training forward (512 bytes per token and value head in bf16:
    # 16/32 1x32768: 537 MB per layer, alive from a layer's forward to its backward) instead of recomputing it with
    # one more state pass (~0.3-0.6 ms, H200), as FLA and FlashQLA do. GDNKIT_SM90_KEEP_STATES=1
    keep_states: bool = False
    # programs an SM of the fused backward's recompute (S0 and X, no output) at 64 columns: 2 (state_output_narrow.py's
    # per_sm build, X made in V's stage tile) or 1. GDNKIT_SM90_RECOMPUTE_PER_SM
    recompute_per_sm: int = 2
    # -- context parallelism: segments and routes (plan.py) --
    # None: decide from the SM count; 0: never; n: segments of n chunks whenever a sequence is longer (tests)
    segment_chunks: int | None = None
    # Below 32 chunks a segment, the kernel time gained is nil (2/8 1x2048: 0.068 ms plain, 0.066 with 8-chunk
    # segments; 1x8192: 16 and 32 chunks within 2%) while the extra launches cost ~0.6 ms of host time per
    # eager call (2/8 1x2048: 0.79 ms eager against 0.07 of device time).
    min_segment_chunks: int = 32
    # The wide route's floor (plan.wide_segment_chunks). Its cost per segment is a program and a walk of a chunk or
    # two where gates settle, not a propagator and a scan step, so short sequences may take it too: 2/8 1x2048 in
    # 16 segments of 2 chunks is 128 programs of ~3 wide steps, where the 64-column pass without segments walks 32
    # chunks on 16 SMs (0.051 of that point's 0.064 ms). Measured (H200, docs/performance.md): 1x2048
    # 0.0626 -> 0.0295 ms at 2/8, 0.0654 -> 0.0380 at 4/16.
    wide_min_segment_chunks: int = 2
    # The exact route only when even the narrowest V tile (32: 4 programs per sequence and head) leaves this many SMs
    # per program, i.e. at most ~half the SMs busy without it. H200 (forward ms, plain / 64-chunk / 128-chunk
    # segments): 4/16 1x32768 (64 narrowest programs) 0.905 / 0.780 / 0.757; 8/32 1x32768 (128) 1.033 / 1.526 /
    # 1.509. So 2: on at 64 programs, off at 128.
    sms_per_program: int = 2
    # The chained route costs each segment only the chunks its heads walk, not ~1.3 output passes, so segments pay
    # with fewer idle SMs: cut when the narrowest programs leave >= 1 SM each (8/32 with one long sequence); below
    # sms_per_program the forward and the backward take the chained route.
    lead_in_sms_per_program: int = 1
    # False: always the exact route where segments are cut (tests of the propagator path)
    lead_in_route: bool = True
    # Forced rules, for tests on a CPU (no SMs to fill) and A/Bs; None: the rule decides. exact_route_pays: whether
    # cut segments take the gated / exact route (else the chained one); wide_segment_chunks: the wide route's
    # segments in one wave (0: none); wide_waves_segment_chunks: (chunks per segment, waves) in several
    exact_route_pays: bool | None = None
    wide_segment_chunks: int | None = None
    wide_waves_segment_chunks: tuple[int, int] | None = None
    # False: segments take the routes above at 32 / 64 columns, not the wide one (tests of those routes)
    wide_route: bool = True
    # The wide pass's chunk-step over the 64-column pass's, each at one program per SM (H200: ~2.9 vs ~2.0 us): the
    # wide route pays only while its longest program (own chunks + walk) takes fewer than (longest sequence's
    # chunks) / this steps (context_parallel.pick). With few plain programs (short sequences, few heads) the
    # 64-column step is shorter than that and the ratio flatters the wide route; not yet calibrated there.
    wide_step_ratio: float = 1.45
    # Beyond one wave (plan.wide_waves_segment_chunks): a program's share of its walk and of its pipeline's fill
    # and drain, in wide steps, added to its own chunks
    wave_step_overhead: int = 2
    # In the waves rule's domain the plain pass runs the wide pass's own 128-column kernel: one step for one (the
    # pick's ratio there, times the waves)
    waves_step_ratio: float = 1.0
    # the segments in waves are cut only where their estimate is at most this fraction of the plain pass's: the
    # estimate leaves out the pick's and the walks' launches and the walks beyond wave_step_overhead
    waves_margin: float = 0.8
    # -- the decay bound (lead_in.py) --
    log_bound: float = -12.0
    # Chunks per fixed lead-in: the quick grid's gates (logsigmoid(randn), ~0.8 a token) settle in one; model-like
    # gates' median head in 2-3, their slowest in 76-175 (the bench's --gates model), which no short window
    # reaches.
    first_window: int = 4
    # -- the backward's path (plan.fused_pays) --
    # True / False: always the fused kernel / always the staged path; None: the rule. GDNKIT_SM90_FUSED_BACKWARD
    fused_backward: bool | None = None
    # The rule (H200, the full grid's 32 backward points with each path forced,
    # benchmarks/results/h200/backward-paths.md): the fused path where the work is at least fused_min_work chunks x
    # value heads (below, the staged path's fixed costs are lower: its S0 recompute runs beside its reverse pass,
    # the fused kernel waits for all of it) and its longest program (a sequence, or a segment of the wide route's
    # cut) at most fused_max_imbalance times the SMs' even share of the work (the fused kernel walks each
    # program's chunks in series; the staged path's per-chunk kernel runs every chunk at once, so one long
    # sequence among short ones keeps only the fused kernel waiting). It picked the faster path at 29 of the 32
    # points, the other three within 2%. With the fused path's segment fix-ups cut from ~0.08 to ~0.03 ms, a
    # second measurement of the 18 points under 4096 and at it: the fused path wins from 1024 (4/8 at 8192 tokens
    # 1.05-1.09x, 8/16 1.22-1.25x, 2/4 at 32768 1.16-1.20x where the imbalance rule lets it; 2/4 at 8192,
    # 512-532, 0.89-0.96x but for one 1.12x): 17 of the 18 picked right. The imbalance bound lies between the
    # largest imbalance where the fused path measured faster (1.65: 8/32 and 16/32 at 8192+8192+4096 on the H100,
    # backward 1.19x the staged path's, peak memory 480 MiB lower; performance.md, "Packed training documents")
    # and the smallest where the staged one did (2.14 and 2.17 on the H200: one long program among short ones).
    fused_min_work: int = 1024
    fused_max_imbalance: float = 2.0

    def __post_init__(self):
        if self.block_v not in (None, 32, 64, 128):
            raise ValueError(f"block_v must be None, 32, 64 or 128, got {self.block_v!r}")
        if self.recompute_per_sm not in (1, 2):
            raise ValueError(f"recompute_per_sm must be 1 or 2, got {self.recompute_per_sm!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "Config":
        """The Config the GDNKIT_SM90_* variables set (each refused by name where it holds something else)."""
        fused = environ.get("GDNKIT_SM90_FUSED_BACKWARD", "")
        if fused not in _FUSED_SETTINGS:
            raise ValueError(f"GDNKIT_SM90_FUSED_BACKWARD must be 1, 0 or auto, got {fused!r}")
        per_sm = environ.get("GDNKIT_SM90_RECOMPUTE_PER_SM", "2")
        if per_sm not in ("1", "2"):
            raise ValueError(f"GDNKIT_SM90_RECOMPUTE_PER_SM must be 1 or 2, got {per_sm!r}")
        return cls(keep_states=environ.get("GDNKIT_SM90_KEEP_STATES", "0") == "1", recompute_per_sm=int(per_sm),
                   fused_backward=_FUSED_SETTINGS[fused])


_FUSED_SETTINGS = {"1": True, "0": False, "auto": None, "": None}
_ENVIRONMENT = Config.from_environment()
_CURRENT: contextvars.ContextVar[Config] = contextvars.ContextVar("gdnkit_sm90_config", default=_ENVIRONMENT)


def environment() -> Config:
    """The Config the environment set when this module was imported."""
    return _ENVIRONMENT


def current() -> Config:
    """The Config calls plan with now: the innermost `configured` block's, else the environment's."""
    return _CURRENT.get()


@contextlib.contextmanager
def configured(config: Config | None = None, **changes) -> Iterator[Config]:
    """Calls inside the block plan with `config` (default: the current one) with `changes` applied."""
    chosen = dataclasses.replace(config or current(), **changes)
    token = _CURRENT.set(chosen)
    try:
        yield chosen
    finally:
        _CURRENT.reset(token)
