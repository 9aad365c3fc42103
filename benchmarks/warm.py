"""Compile every implementation's kernels for a grid in parallel worker processes, before timing.

A TileLang anchor compiles its kernel family once per (H, HV): about a minute forward and four
backward on the H200, serially in one process, which alone overruns a 10-minute GPU
run for the quick grid. The GPU machine has 16 CPU cores, so each (implementation, pass, head
config) compiles in its own process: the shared on-disk caches (TILELANG_CACHE_DIR,
TRITON_CACHE_DIR) fill in about the time of the slowest job, and the timing process then loads
compiled kernels. Warm-up runs every sequence mix of the job, since long sequences may take other
kernels (context parallelism) than short ones.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import time
from typing import Callable

from .grids import STATE_PASSES, Grid, Point


def jobs_of(grid: Grid, impl_names: list[str], cached: Callable[[str, Point], bool] | None = None
            ) -> list[tuple[str, str, int, int, tuple[Point, ...]]]:
    """(impl, pass, H, HV, points) per warm-up job, longest compiles (backward) first. `cached(impl, point)`
    says a point will not be measured (an anchor row reused from an earlier run): it needs no compile. A job that
    measures also runs the accuracy check's small varlen problem (grid.accuracy_seqlens) of its pass and head
    config, which may take other kernels (gdnkit's staged backward: compiled in the timing
    process, they took a 110 s budget's last three points)."""
    jobs = []
    for pass_ in ("bwd", "fwd", *STATE_PASSES):
        for H, HV in grid.head_configs(pass_):
            points = tuple(p for p in grid.points if p.pass_ == pass_ and (p.H, p.HV) == (H, HV))
            for name in impl_names:
                todo = tuple(p for p in points if cached is None or not cached(name, p))
                if todo and pass_ not in STATE_PASSES:   # their check is a batch as their points are
                    todo += (dataclasses.replace(todo[0], seqlens=grid.accuracy_seqlens),)
                if todo:
                    jobs.append((name, pass_, H, HV, todo))
    return jobs


def _warm_job(impl_name: str, points: tuple[Point, ...], device: str) -> tuple[float, str | None, bool]:
    """Runs in a worker process: call what the timing will call, once per point.
    Returns (seconds, error or None, whether any point ran: an unsupported pass compiles nothing)."""
    import torch

    from .impls import Unsupported, resolve
    from .inputs import make_point_inputs, requires_grad_
    from .runner import timed_closures

    start = time.monotonic()
    ran = False
    try:
        (impl,) = resolve(impl_name, device)
        if impl.unavailable(device):
            return time.monotonic() - start, None, False
        for point in points:
            if impl.skip_reason(point):
                continue
            inputs = make_point_inputs(point, device)
            if point.pass_ == "bwd":
                requires_grad_(inputs)
            try:
                for fns in timed_closures(impl, point, [inputs]).values():
                    fns[0]()
            except Unsupported:
                continue
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
            ran = True
    except Exception as exc:  # reported, and the timing run measures (and records) it again
        return time.monotonic() - start, f"{type(exc).__name__}: {exc}", ran
    return time.monotonic() - start, None, ran


def warm(grid: Grid, impl_names: list[str], device: str, workers: int, log: Callable[[str], None],
         cached: Callable[[str, Point], bool] | None = None) -> dict[str, float]:
    """Returns each job's seconds, keyed "impl|pass|H|HV": a fresh process's first calls of that head config,
    i.e. the compile time (or the load time, where the on-disk kernel caches were warm already)."""
    jobs = jobs_of(grid, impl_names, cached)
    seconds_of: dict[str, float] = {}
    if not jobs or workers <= 0:
        return seconds_of
    log(f"warm-up: {len(jobs)} compile jobs on {workers} processes")
    start = time.monotonic()
    # spawn, not fork: CUDA cannot be used in a forked child of a process that touched it.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {pool.submit(_warm_job, name, points, device): (name, pass_, H, HV)
                   for name, pass_, H, HV, points in jobs}
        for future in concurrent.futures.as_completed(futures):
            name, pass_, H, HV = futures[future]
            try:
                seconds, error, ran = future.result()
            except Exception as exc:  # a worker that died (e.g. out of memory) must not stop the run
                seconds, error, ran = float("nan"), f"worker died: {type(exc).__name__}: {exc}", False
            log(f"  warm {name} {pass_} H={H} HV={HV}: {seconds:.0f} s" + (f" ({error[:300]})" if error else ""))
            if ran and not error:
                seconds_of[f"{name}|{pass_}|{H}|{HV}"] = round(seconds, 1)
    log(f"warm-up done in {time.monotonic() - start:.0f} s")
    return seconds_of
