"""Build the sm90 kernel family of a head configuration ahead of its first call, in parallel processes.

Every kernel is specialised on (H, HV, dtype) and a few flags, and compiles in 2-40 s (chunk_grads the
longest); a first training call at a new head configuration needs ~15 of them, which kernel_build.py builds in
parallel at the call; this builds a whole family ahead of time. TileLang keeps what it builds in its on-disk cache (TILELANG_CACHE_DIR), keyed
on the kernel alone, not on the machine: so the family can be built here with nothing but nvcc, one kernel
per process, on a machine without a GPU too, and the cache directory copied to where the GPU is.

`family` lists every kernel the forward and backward can ask for (forward.py and backward.py's factories
with the values their arguments take there); `build` runs them in worker processes (kernel_build.py, which also
builds, at a call, exactly the kernels that call needs and no process has built yet).
"""
from __future__ import annotations

import itertools

from . import kernel_build
from .kernel_build import Job


BACKWARDS = ("both", "staged", "fused")


def family(H: int, HV: int, dtype: str, training: bool = True, backward: str = "both") -> list[Job]:
    """The kernels a call at (H, HV, dtype) can need: the forward's (intra chunk; the state pass with or
    without initial / final states at each V tile the plan picks, chained or not, and at 128 columns; the
    propagator), and with `training` the intra kernel that also writes T, the state pass that stores S0 (without
    output: the backward's recompute, with X for the fused path; with it: the forward with keep_states), and the
    backward's: `staged` the reverse pass and the per-chunk gradients, `fused` the fused kernel and the reverse
    passes its segments' gated route runs, `both` all of them (backward.fused_pays picks either per call)."""
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {', '.join(BACKWARDS)}, got {backward!r}")
    from .forward import NARROW_BLOCK_V, recompute_per_sm

    flags = (False, True)
    # the last flag: emit_bound (the chained and wide routes' walks read the intra kernel's chunk sums)
    jobs = [Job("forward", "intra_chunk_kernel", (H, HV, dtype, False, bound)) for bound in flags]
    # the last arguments: chained (context parallelism's chained route), store_x (the fused backward's recompute),
    # its programs an SM (forward.recompute_per_sm; 1 for every other pass)
    jobs += [Job("forward", "state_output_kernel", (H, HV, dtype, h0, ht, bv, False, True, chained, False, 1))
             for h0, ht, bv, chained in itertools.product(flags, flags, NARROW_BLOCK_V, flags)]
    # the wide kernel: passes without S0 stores whose (sequence or segment, head) programs fill the SMs
    jobs += [Job("forward", "state_output_kernel", (H, HV, dtype, h0, ht, 128, False, True, chained, False, 1))
             for h0, ht, chained in itertools.product(flags, flags, flags)]
    jobs.append(Job("forward", "propagator_kernel", (H, HV, dtype)))
    if training:
        jobs += [Job("forward", "intra_chunk_kernel", (H, HV, dtype, True, bound)) for bound in flags]
        # the recompute: S0 alone (the staged path), S0 and X (the fused path)
        stores_x = {"staged": (False,), "fused": (True,), "both": flags}[backward]
        jobs += [Job("forward", "state_output_kernel", (H, HV, dtype, h0, False, bv, True, False, chained, x,
                                                        recompute_per_sm(bv, x)))
                 for h0, bv, chained, x in itertools.product(flags, NARROW_BLOCK_V, flags, stores_x)]
        jobs += [Job("forward", "state_output_kernel", (H, HV, dtype, h0, ht, bv, True, True, chained, False, 1))
                 for h0, ht, bv, chained in itertools.product(flags, flags, NARROW_BLOCK_V, flags)]   # keep_states
        if backward != "fused":
            jobs += [Job("backward", "backward_state_kernel", (H, HV, dtype, dht, dh0, bv, chained, False))
                     for dht, dh0, bv, chained in itertools.product(flags, flags, NARROW_BLOCK_V + (128,), flags)]
        # the gated route's passes (both paths' segments): its exact pass per segment and its fixed lead-in, walked
        # from each segment's end from zero or dht, each storing only its dS (ds_only)
        jobs += [Job("backward", "backward_state_kernel", (H, HV, dtype, dht, True, bv, chained, True))
                 for dht, bv, chained in itertools.product(flags, NARROW_BLOCK_V + (128,), flags) if chained or not dht]
        if backward != "fused":
            # dq / dk written in the inputs' dtype, or fp32 where the l2norm backward follows
            jobs += [Job("backward", "chunk_grads_kernel", (H, HV, dtype, grads)) for grads in (dtype, "float32")]
        if backward != "staged":
            # the fused backward, from a dS_end (dht or a segment's) or not, storing dh0 or not
            jobs += [Job("backward", "backward_fused_kernel", (H, HV, dtype, dinit, dh0))
                     for dinit, dh0 in itertools.product(flags, flags)]
    return jobs


def build(jobs: list[Job], workers: int, report=print) -> list[tuple[Job, float, str | None]]:
    """Builds every job in `workers` processes (kernel_build.build: the slowest first); returns (job, seconds,
    error) per job, printing each as it ends."""
    return kernel_build.build(jobs, workers, lambda job, seconds, error: report(
        f"  {job}: {seconds:.0f} s" + (f"  FAILED {error[:300]}" if error else "")))
