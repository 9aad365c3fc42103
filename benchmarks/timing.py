"""How time and memory are measured.

Kernel time, on a GPU: CUDA-graph replay where the call can be captured (launch gaps and Python
overhead drop out), otherwise the sum of device activity torch.profiler records per call. Both
warm up first (module load, JIT compiles and autotuning stay out of the numbers) and report the
median of >= 20 samples. Small problems whose inputs would sit in L2 are rotated over several
independent input sets (`fns`, one closure per set) so repeated calls do not measure the cache.

Eager wall time: host clock around one call plus a synchronize, median over calls: what a user who
calls the op from Python pays, host overhead included (~1 ms per FLA call on the H200).

On a CPU (the tiny grid) kernel time is the host wall time of the call: there is nothing else.
"""
from __future__ import annotations

import bisect
import dataclasses
import gc
import statistics
import time
from typing import Any, Callable, Sequence

import torch

Fn = Callable[[], Any]

MIN_REPS = 20  # the floor for a median
# Graph replays shorter than this are dominated by replay launch cost; such a graph is recaptured
# with the calls repeated inside it, and the replay time divided by the number of calls.
MIN_REPLAY_MS = 0.5
MAX_CALLS_PER_GRAPH = 64
MARKER = "gdnkit_bench_call_"


@dataclasses.dataclass
class Timing:
    median_ms: float
    samples_ms: list[float]
    method: str  # "cuda-graph", "profiler", "cpu-wall"
    note: str = ""  # e.g. why the graph path was not taken

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how far apart repeated measurements lie."""
        s = sorted(self.samples_ms)
        if len(s) < 2 or self.median_ms <= 0:
            return 0.0
        lo, hi = s[len(s) // 10], s[min(len(s) - 1, (len(s) * 9) // 10)]
        return (hi - lo) / self.median_ms


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def _cycle(fns: Sequence[Fn], n: int):
    for i in range(n):
        yield fns[i % len(fns)]


def _sync(device) -> None:
    if _is_cuda(device):
        torch.cuda.synchronize(device)


def time_cpu(fns: Sequence[Fn], reps: int = MIN_REPS, warmup: int = 2) -> Timing:
    for fn in _cycle(fns, warmup):
        fn()
    samples = []
    for fn in _cycle(fns, reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return Timing(statistics.median(samples), samples, "cpu-wall")


def time_eager(fns: Sequence[Fn], device, reps: int = MIN_REPS, warmup: int = 2) -> float:
    """Median host wall time per call, synchronized after each call (ms)."""
    return _wall_per_call(fns, device, reps, warmup, sync_each=True)


def time_host(fns: Sequence[Fn], device, reps: int = MIN_REPS, warmup: int = 2) -> float:
    """Median host time per call over calls made back to back, the GPU never waited on (ms): what a call costs the
    CPU. Beside time_eager (a synchronize after each call) it tells a host-bound call (the two agree) from one whose
    eager time is its kernels' or its synchronize's."""
    return _wall_per_call(fns, device, reps, warmup, sync_each=False)


def _wall_per_call(fns: Sequence[Fn], device, reps: int, warmup: int, sync_each: bool) -> float:
    if not _is_cuda(device):
        return time_cpu(fns, reps, warmup).median_ms
    for fn in _cycle(fns, warmup):
        fn()
    _sync(device)
    samples = []
    for fn in _cycle(fns, reps):
        t0 = time.perf_counter()
        fn()
        if sync_each:
            torch.cuda.synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    return statistics.median(samples)


def _capture(fns: Sequence[Fn], calls: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in _cycle(fns, calls):
            fn()
    return graph


def _replay_samples(graph: torch.cuda.CUDAGraph, reps: int) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


class GraphMissesWork(RuntimeError):
    """Replaying the graph does less device work than calling the function: something the call
    launches (another stream, a host-side step) escaped the capture, so replay time would flatter it."""


# A replay must show at least this share of the device time an eager call shows (rounding and
# profiler jitter stay well inside it; a kernel that escaped capture usually does not).
GRAPH_WORK_RATIO = 0.9
VERIFY_REPS = 5


def time_cuda_graph(fns: Sequence[Fn], device, reps: int = MIN_REPS, warmup: int = 3,
                    verify: bool = True) -> Timing:
    """Median per-call time of graph replays. Raises if the call cannot be captured, or (verify)
    if a replay's device activity falls short of an eager call's (GraphMissesWork)."""
    # Warm up on a side stream, as torch's graph docs require before capture: lazy inits (cuBLAS
    # handles, autotuning, JIT, the anchors' index caches) must not happen inside the capture.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for fn in _cycle(fns, max(warmup, 1) * len(fns)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)

    calls = len(fns)
    graph = _capture(fns, calls)
    graph.replay()
    torch.cuda.synchronize(device)
    probe = statistics.median(_replay_samples(graph, 3))
    if probe < MIN_REPLAY_MS and calls < MAX_CALLS_PER_GRAPH:
        # Repeat whole rounds of the input sets so every set is used equally often.
        rounds = max(1, min(MAX_CALLS_PER_GRAPH // len(fns), int(MIN_REPLAY_MS / max(probe, 1e-3)) + 1))
        if rounds > 1:
            del graph
            calls = rounds * len(fns)
            graph = _capture(fns, calls)
            graph.replay()
            torch.cuda.synchronize(device)
    samples = [s / calls for s in _replay_samples(graph, reps)]
    note = f"{calls} calls per replay"
    if verify:
        eager_dev = statistics.median(_profiled_per_call(fns, device, VERIFY_REPS)[0])
        replay_dev = statistics.median(_profiled_per_call([graph.replay], device, 3)[0]) / calls
        if replay_dev > 0 and replay_dev < GRAPH_WORK_RATIO * eager_dev:
            del graph
            raise GraphMissesWork(f"graph replay shows {replay_dev:.4f} ms of device work per call, "
                                  f"an eager call {eager_dev:.4f} ms")
        note += (f"; device work per call: replay {replay_dev:.4f} ms, eager {eager_dev:.4f} ms"
                 if replay_dev > 0 else "; replay not visible to the profiler, unverified")
    del graph
    return Timing(statistics.median(samples), samples, "cuda-graph", note=note)


def _device_events(prof) -> list:
    """Device activity (kernels, memcpy, memset) from a profile, without annotations."""
    out = []
    for ev in prof.events():
        if getattr(ev, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        # kineto mirrors user annotations onto the GPU timeline; they span work, they are not work
        if ev.name.startswith(MARKER) or getattr(ev, "is_user_annotation", False):
            continue
        out.append(ev)
    return out


def _profiled_per_call(fns: Sequence[Fn], device, reps: int) -> tuple[list[float], str]:
    """Device time (ms) of each of `reps` calls, from one torch.profiler run.

    Kernels are attributed to calls by time, not by the CPU op tree: backward kernels are launched
    from autograd's own thread and would escape a record_function on the calling thread. Each call
    is synchronized inside its window, so its kernels finish before the next window opens.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i, fn in enumerate(_cycle(fns, reps)):
            with record_function(f"{MARKER}{i}"):
                fn()
                torch.cuda.synchronize(device)
    windows = [(ev.time_range.start, int(ev.name[len(MARKER):])) for ev in prof.events()
               if ev.name.startswith(MARKER) and ev.device_type == torch.autograd.DeviceType.CPU]
    activity = [(ev.time_range.start, ev.time_range.elapsed_us()) for ev in _device_events(prof)]
    return attribute(windows, activity, reps)


def attribute(windows: list[tuple[float, int]], activity: list[tuple[float, float]], reps: int
              ) -> tuple[list[float], str]:
    """Per-call device ms from call windows (start us, call index) and activity (start us, length us):
    each activity belongs to the last window that opened before it started."""
    windows = sorted(windows)
    per_call = [0.0] * reps
    total = sum(d for _, d in activity) / 1e3
    if len(windows) == reps:
        starts = [w[0] for w in windows]
        for start, dur in activity:
            idx = max(0, bisect.bisect_right(starts, start) - 1)
            per_call[windows[idx][1]] += dur / 1e3
    note = ""
    if len(windows) != reps or any(t <= 0 for t in per_call):
        # Attribution failed (clock skew, missing annotations): fall back to the mean, said so.
        per_call = [total / reps] * reps
        note = "per-call attribution failed; samples are the mean"
    return per_call, note


def group_stages(events: list[tuple[str, float]], calls: int, width: int = 80) -> dict[str, float]:
    """Device ms per call of each kernel name (names cut to `width` characters) from (name, us) pairs
    recorded over `calls` calls, largest first."""
    per: dict[str, float] = {}
    for name, us in events:
        key = name[:width]
        per[key] = per.get(key, 0.0) + us / 1e3 / calls
    return {name: round(ms, 5) for name, ms in sorted(per.items(), key=lambda kv: -kv[1])}


def stage_times(fns: Sequence[Fn], device, reps: int = MIN_REPS) -> dict[str, float]:
    """Where a call's device time goes: ms per call of each kernel (copies and memsets included), from one
    profiler run over `reps` calls. Empty off CUDA."""
    if not _is_cuda(device):
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for fn in _cycle(fns, reps):
            fn()
        torch.cuda.synchronize(device)
    return group_stages([(ev.name, ev.time_range.elapsed_us()) for ev in _device_events(prof)], reps)


def time_profiler(fns: Sequence[Fn], device, reps: int = MIN_REPS, warmup: int = 3) -> Timing:
    """Median per-call sum of device time (kernels, copies, memsets) over `reps` profiled calls."""
    for fn in _cycle(fns, max(warmup, 1) * len(fns)):
        fn()
    per_call, note = _profiled_per_call(fns, device, reps)
    if sum(per_call) <= 0:
        raise RuntimeError("the profiler recorded no device activity for this call")
    return Timing(statistics.median(per_call), per_call, "profiler", note=note)


def time_kernel(fns: Sequence[Fn], device, reps: int = MIN_REPS, warmup: int = 3,
                method: str = "auto") -> Timing:
    """Kernel time per call. method: "auto" (graph, else profiler), "graph", "profiler"."""
    reps = max(reps, MIN_REPS)
    if not _is_cuda(device):
        return time_cpu(fns, reps, warmup)
    note = ""
    if method in ("auto", "graph"):
        try:
            return time_cuda_graph(fns, device, reps, warmup)
        except Exception as exc:  # capture refused: host syncs, CPU-side decisions, allocator use
            if method == "graph":
                raise
            first_line = str(exc).splitlines()[0][:160] if str(exc) else ""
            note = f"graph timing not used ({type(exc).__name__}: {first_line})"
            _recover_after_capture_failure(device)
    timing = time_profiler(fns, device, reps, warmup)
    timing.note = "; ".join(x for x in (note, timing.note) if x)
    return timing


def _recover_after_capture_failure(device) -> None:
    """A failed capture leaves the stream's capture ended by torch; clear what it allocated."""
    gc.collect()
    try:
        torch.cuda.synchronize(device)
    except Exception:
        pass
    torch.cuda.empty_cache()


def peak_memory(fn: Fn, device) -> int | None:
    """torch.cuda.max_memory_allocated over one call, with this point's inputs resident (bytes)."""
    if not _is_cuda(device):
        return None
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return int(peak)
