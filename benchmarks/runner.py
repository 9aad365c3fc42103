"""Run a grid: every implementation at every point, a row per measurement, failures recorded.

Per (point, implementation): one eager call (JIT compiles, autotuning), peak memory over one call,
eager wall time, kernel time (timing.py), and the output kept to compare with the first
implementation measured at this point (FLA when present). Per (pass, head config, implementation):
the error against the float64 reference on a small varlen problem (accuracy.py). A failure or an
unsupported problem at one point is written down and the run goes on to the next.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import math
import time
import traceback
from typing import Any, Callable

import torch

from . import accuracy, timing
from .grids import PASSES, STATE_PASSES, Grid, Point
from .impls import ANCHORS, Impl, Unsupported, environment_versions, gpu_name
from .inputs import ChunkInputs, gates_kind, make_chunk_inputs, make_decode_inputs, make_point_inputs, \
    qk_l2norm_on, requires_grad_, seed_for, state_dtype_name, state_traffic_bytes

ROW_FIELDS = ("pass", "H", "HV", "seqlens", "B", "impl", "kernel_ms", "eager_ms", "peak_mem_bytes",
              "rel_err_vs_ref", "anchor_same_run", "gpu", "date", "versions", "gates", "qk_l2norm", "state_dtype")

# Rotate input sets until they span this many L2 caches, so small problems are not timed from cache.
L2_MULTIPLE = 4
MAX_INPUT_SETS = 8
DEFAULT_L2_BYTES = 50 * 2**20  # H100/H200 when the property is missing


def row_key(row: dict) -> tuple:
    return (row["pass"], row["H"], row["HV"], row["seqlens"], row["B"], row["impl"])


def key_str(key: tuple) -> str:
    return "|".join("" if x is None else str(x) for x in key)


def point_row_key(point: Point, impl_name: str) -> tuple:
    return (*point.key, impl_name)


def merge_rows(old: list[dict], new: list[dict], drop: set[tuple] = frozenset()) -> list[dict]:
    """Rows of `new` replace rows of `old` with the same key; keys in `drop` (measured and failed
    in the new run) lose their old row, since it no longer describes the code; others are kept."""
    replaced = {row_key(r) for r in new} | set(drop)
    kept = [r for r in old if row_key(r) not in replaced]
    return sort_rows(kept + list(new))


def sort_rows(rows: list[dict]) -> list[dict]:
    order = {p: i for i, p in enumerate(PASSES)}
    return sorted(rows, key=lambda r: (order.get(r["pass"], 9), r["H"], r["HV"], r["B"] or 0,
                                       _tokens(r["seqlens"]), r["seqlens"], r["impl"]))


def _tokens(label: str) -> int:
    if "x" in label:
        n, length = label.split("x", 1)
        return int(n) * int(length)
    return sum(int(x) for x in label.split("+"))


def find_cached(rows: list[dict], point: Point, impl: Impl, gpu: str, versions: dict) -> dict | None:
    """An earlier row that may stand in for measuring `impl` at `point` now: same point, same GPU
    model, same gate distribution, q / k normalisation and state dtype, and the same versions of what decides
    that implementation's speed (where known here)."""
    want = point_row_key(point, impl.name)
    for row in rows:
        if row_key(row) != want or row.get("gpu") != gpu or row.get("gates", "random") != gates_kind() \
                or row.get("qk_l2norm", False) != qk_l2norm_on() \
                or row.get("state_dtype", "float32") != state_dtype_name(point):
            continue
        old = row.get("versions") or {}
        if all(versions.get(k) is None or old.get(k) == versions.get(k) for k in impl.version_keys):
            return row
    return None


@dataclasses.dataclass
class Outcome:
    rows: list[dict] = dataclasses.field(default_factory=list)
    details: dict[str, dict] = dataclasses.field(default_factory=dict)  # key_str(row key) -> extras
    events: list[dict] = dataclasses.field(default_factory=list)  # failures, skips, cache misses
    failed_keys: set = dataclasses.field(default_factory=set)
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)  # impl -> why it cannot run here
    stopped_early: str | None = None


@dataclasses.dataclass
class RunConfig:
    grid: Grid
    impls: list[Impl]
    device: torch.device
    anchors: str = "live"  # "live" | "cached"
    cached_rows: list[dict] = dataclasses.field(default_factory=list)
    reps: int = timing.MIN_REPS
    timing_method: str = "auto"
    budget_s: float | None = None
    run_id: str = ""
    log: Callable[[str], None] = print
    on_point_done: Callable[[Outcome], None] | None = None
    progress: bool = True
    stages: bool = False  # also record each kernel's device ms per call (extras["stages_ms"], CUDA only)


def _n_input_sets(point: Point, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    T = point.tokens
    elem = 2  # bf16
    per_set = T * (2 * point.H * point.K + 2 * point.HV * point.V) * elem + T * point.HV * 8
    if point.pass_ in STATE_PASSES:
        per_set += state_traffic_bytes(point)
    if point.pass_ == "bwd":
        per_set *= 3  # dO and the gradients travel too
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES
    return int(max(1, min(MAX_INPUT_SETS, math.ceil(L2_MULTIPLE * l2 / max(per_set, 1)))))


def timed_closures(impl: Impl, point: Point, sets: list[ChunkInputs]) -> dict[str, list]:
    """What is timed, per input set. fwd: forward without autograd. bwd: forward with autograd
    ("fwd_train", the forward that precedes a backward) and forward+backward ("fwdbwd"); the
    backward's time is their difference. decode: one recurrent step with a state. mtp: a verify of T draft tokens
    a sequence, every token's state kept."""
    def forward(inp, grad: bool):
        def fn():
            with torch.set_grad_enabled(grad):
                return impl.chunk(inp)[0]
        return fn

    if point.pass_ == "fwd":
        return {"main": [forward(s, False) for s in sets]}
    if point.pass_ == "bwd":
        def fwdbwd(inp):
            def fn():
                with torch.enable_grad():
                    o = impl.chunk(inp)[0]
                    return torch.autograd.grad(o, inp.leaves(), inp.do)
            return fn
        return {"main": [fwdbwd(s) for s in sets], "fwd_train": [forward(s, True) for s in sets]}

    step = impl.decode if point.pass_ == "decode" else impl.mtp

    def stepped(inp):
        def fn():
            with torch.no_grad():
                return step(inp)
        return fn
    return {"main": [stepped(s) for s in sets]}


def _as_list(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception:
            pass
        torch.cuda.empty_cache()


def _open_matmul_workspaces(device: torch.device) -> None:
    """cuBLAS keeps a workspace per handle, one handle per thread, from its first matmul on (memory_allocated
    counts them: 32 MiB for the main thread's on the H200). The float64 reference's first forward and backward
    (the autograd engine's thread) made them in the middle of the first point, so every row after that point's
    first implementation carried 64 MiB in its peak and that one did not (4/8 1x8192's gdnkit row
    was over FLA's for that alone). Made here, on both threads, every row carries them."""
    if device.type != "cuda":
        return
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        a = torch.ones(64, 64, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
    torch.cuda.synchronize(device)


class Runner:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.gpu = gpu_name(self.device)
        self.versions = environment_versions()
        self.date = datetime.date.today().isoformat()
        self.outcome = Outcome()
        self._ref_cache: dict[tuple, tuple[ChunkInputs, list[torch.Tensor]]] = {}
        self._acc_cache: dict[tuple, float | None] = {}
        self._unavailable: dict[str, str | None] = {}
        self._t0 = time.monotonic()

    # -- bookkeeping -------------------------------------------------------------------------
    def _event(self, point: Point, impl: str, status: str, reason: str) -> None:
        ev = {"pass": point.pass_, "H": point.H, "HV": point.HV, "seqlens": point.label, "B": point.B,
              "impl": impl, "status": status, "reason": reason, "run": self.cfg.run_id}
        self.outcome.events.append(ev)
        self.cfg.log(f"[{status}] {point.describe()} {impl}: {reason}")

    def _row(self, point: Point, impl: str, kernel_ms: float, eager_ms: float | None, peak: int | None,
             rel_err: float | None, anchor_same_run: bool) -> dict:
        return {"pass": point.pass_, "H": point.H, "HV": point.HV, "seqlens": point.label, "B": point.B,
                "impl": impl, "kernel_ms": float(kernel_ms),
                "eager_ms": None if eager_ms is None else float(eager_ms),
                "peak_mem_bytes": None if peak is None else int(peak),
                "rel_err_vs_ref": None if rel_err is None or not math.isfinite(rel_err) else float(rel_err),
                "anchor_same_run": bool(anchor_same_run), "gpu": self.gpu, "date": self.date,
                "versions": dict(self.versions), "gates": gates_kind(), "qk_l2norm": qk_l2norm_on(),
                "state_dtype": state_dtype_name(point)}

    def _unavailable_reason(self, impl: Impl) -> str | None:
        if impl.name not in self._unavailable:
            try:
                self._unavailable[impl.name] = impl.unavailable(self.device)
            except Exception as exc:
                self._unavailable[impl.name] = f"{type(exc).__name__}: {exc}"
        return self._unavailable[impl.name]

    def _over_budget(self) -> bool:
        b = self.cfg.budget_s
        return b is not None and time.monotonic() - self._t0 > b

    # -- accuracy ----------------------------------------------------------------------------
    def _accuracy_problem(self, point: Point) -> tuple[ChunkInputs, list[torch.Tensor]]:
        """The small problem of this (pass, head config), made afresh from its seed, and its float64 truth
        (computed once, kept on the host: left on the device, every later measurement's peak memory counted it)."""
        grid = self.cfg.grid
        seed = seed_for(Point(point.pass_, point.H, point.HV, grid.accuracy_seqlens, K=point.K, V=point.V),
                        "accuracy")
        if point.pass_ in STATE_PASSES:
            inp = make_decode_inputs(grid.accuracy_decode_B, point.H, point.HV, point.K, point.V, self.device, seed,
                                     T=point.seqlens[0])
        else:
            inp = make_chunk_inputs(point.H, point.HV, grid.accuracy_seqlens, point.K, point.V, self.device,
                                    seed, with_do=point.pass_ == "bwd")
        key = (point.pass_, point.H, point.HV, point.K, point.V)
        if key not in self._ref_cache:
            self._ref_cache[key] = [r.cpu() for r in accuracy.reference_outputs(inp, point.pass_)]
        return inp, self._ref_cache[key]

    def _accuracy(self, impl: Impl, point: Point) -> float | None:
        key = (point.pass_, point.H, point.HV, point.K, point.V, impl.name)
        if key in self._acc_cache:
            return self._acc_cache[key]
        try:
            inp, ref = self._accuracy_problem(point)
            if point.pass_ == "bwd":
                # fresh leaves per implementation: gradients must not meet another's graph
                inp = dataclasses.replace(inp, **{n: getattr(inp, n).detach().clone().requires_grad_(True)
                                                  for n in ("q", "k", "v", "g", "beta")})
            fn = timed_closures(impl, point, [inp])["main"][0]
            err = accuracy.max_rel_l2(_as_list(fn()), ref)
        except Unsupported:
            raise
        except Exception as exc:
            self.cfg.log(f"[accuracy-failed] {point.pass_} H={point.H} HV={point.HV} {impl.name}: "
                         f"{type(exc).__name__}: {exc}")
            err = None
        self._acc_cache[key] = err
        return err

    # -- one measurement ---------------------------------------------------------------------
    def _measure(self, impl: Impl, point: Point, sets: list[ChunkInputs]) -> tuple[dict, dict, list]:
        fns = timed_closures(impl, point, sets)
        dev, cfg = self.device, self.cfg
        first = fns["main"][0]()  # compiles / autotunes; raises Unsupported early
        del first
        # what was resident when the peak was taken (inputs, caches, anything an earlier point left): the
        # peak less this is the call's own footprint, comparable across runs whatever ran before
        resident = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
        peak = timing.peak_memory(fns["main"][0], dev)
        out = _as_list(fns["main"][0]())  # kept for the cross-implementation comparison
        eager = timing.time_eager(fns["main"], dev, reps=cfg.reps)
        host = timing.time_host(fns["main"], dev, reps=cfg.reps)
        kern = timing.time_kernel(fns["main"], dev, reps=cfg.reps, method=cfg.timing_method)
        kernel_ms, eager_ms = kern.median_ms, eager
        bwd_extras: dict[str, Any] = {}
        if point.pass_ == "bwd":
            # backward = (fwd+bwd) - fwd. Where the two are close (tiny CPU problems) a burst of load from
            # another process can invert them; measure the pair once more before calling it unresolvable.
            for attempt in range(2):
                if attempt:
                    kern = timing.time_kernel(fns["main"], dev, reps=cfg.reps, method=cfg.timing_method)
                    eager = timing.time_eager(fns["main"], dev, reps=cfg.reps)
                fwd_kern = timing.time_kernel(fns["fwd_train"], dev, reps=cfg.reps, method=cfg.timing_method)
                fwd_eager = timing.time_eager(fns["fwd_train"], dev, reps=cfg.reps)
                if kern.median_ms > fwd_kern.median_ms:
                    break
            else:
                raise RuntimeError(f"backward time not resolvable: fwd+bwd {kern.median_ms:.4f} ms <= "
                                   f"fwd {fwd_kern.median_ms:.4f} ms")
            fwd_host = timing.time_host(fns["fwd_train"], dev, reps=cfg.reps)
            bwd_extras = dict(fwdbwd_ms=kern.median_ms, fwd_train_ms=fwd_kern.median_ms, fwd_timing=fwd_kern.method,
                              fwdbwd_eager_ms=eager, fwd_train_eager_ms=fwd_eager,
                              fwdbwd_host_ms=host, fwd_train_host_ms=fwd_host)
            kernel_ms, eager_ms, host = kern.median_ms - fwd_kern.median_ms, eager - fwd_eager, host - fwd_host
        extras: dict[str, Any] = {"timing": kern.method, "timing_note": kern.note, "spread": round(kern.spread, 4),
                                  "resident_mem_bytes": resident,
                                  "samples": len(kern.samples_ms), "input_sets": len(sets), "run": cfg.run_id,
                                  # host time of the timed call, calls back to back (bwd: the step's less the
                                  # forward's, as eager_ms): eager_ms less this is what the synchronize after
                                  # each call and the kernels behind it add
                                  "host_ms": host, **bwd_extras}
        if cfg.stages:
            extras["stages_ms"] = timing.stage_times(fns["main"], dev, reps=cfg.reps)
        if point.pass_ in STATE_PASSES:
            extras["state_GBps"] = round(state_traffic_bytes(point) / (kernel_ms * 1e-3) / 1e9, 2)
        acc = self._accuracy(impl, point)
        row = self._row(point, impl.name, kernel_ms, eager_ms, peak, acc, anchor_same_run=True)
        return row, extras, out

    # -- the grid ----------------------------------------------------------------------------
    def run(self) -> Outcome:
        cfg = self.cfg
        _open_matmul_workspaces(self.device)
        points = list(cfg.grid.points)
        bar = _progress(points, cfg.progress)
        for point in bar:
            if self._over_budget():
                self.outcome.stopped_early = f"time budget of {cfg.budget_s:.0f} s spent"
                for impl in cfg.impls:
                    self._event(point, impl.name, "skipped", self.outcome.stopped_early)
                continue
            self._run_point(point, bar)
            if cfg.on_point_done is not None:
                cfg.on_point_done(self.outcome)
        return self.outcome

    def _run_point(self, point: Point, bar) -> None:
        cfg = self.cfg
        rows: list[dict] = []
        anchors_live = True
        anchor_seen = False
        baseline: tuple[str, list[torch.Tensor]] | None = None
        sets: list[ChunkInputs] | None = None
        for impl in cfg.impls:
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(f"{point.describe()} {impl.name}")
            if impl.is_anchor and cfg.anchors == "cached":
                cached = find_cached(cfg.cached_rows, point, impl, self.gpu, self.versions)
                if cached is not None:
                    row = dict(cached, anchor_same_run=False)
                    rows.append(row)
                    anchor_seen = True
                    anchors_live = False
                    self.cfg.log(f"[cached] {point.describe()} {impl.name}: {row['kernel_ms']:.4f} ms "
                                 f"from {row.get('date')}")
                    continue
                self.cfg.log(f"[cache-miss] {point.describe()} {impl.name}: measuring live")
            reason = self._unavailable_reason(impl)
            if reason:
                # said once per run (Outcome.unavailable), not once per point
                if impl.name not in self.outcome.unavailable:
                    self.outcome.unavailable[impl.name] = reason
                    self.cfg.log(f"[unavailable] {impl.name}: {reason}")
                continue
            reason = impl.skip_reason(point)
            if reason:
                self._event(point, impl.name, "unsupported", reason)
                continue
            if self._over_budget():
                self.outcome.stopped_early = f"time budget of {cfg.budget_s:.0f} s spent"
                self._event(point, impl.name, "skipped", self.outcome.stopped_early)
                continue
            t0 = time.monotonic()
            try:
                if sets is None:
                    cu = None
                    n = _n_input_sets(point, self.device)
                    sets = []
                    for i in range(n):
                        s = make_point_inputs(point, self.device, i, cu_seqlens=cu)
                        cu = s.cu_seqlens  # one offsets tensor for all sets (anchors cache per tensor)
                        sets.append(requires_grad_(s) if point.pass_ == "bwd" else s)
                row, extras, out = self._measure(impl, point, sets)
                if baseline is None:
                    # kept on the host: left on the device, the first implementation's outputs counted in
                    # every later one's peak memory (FLA's gradients, 520 MiB at bwd 16/32 1x32768)
                    baseline = (impl.name, [t.detach().cpu() for t in out])
                else:
                    try:
                        extras["diff_vs"] = {baseline[0]: accuracy.max_rel_l2(out, baseline[1])}
                    except Exception as exc:
                        extras["diff_vs"] = {baseline[0]: f"not comparable: {exc}"}
                del out
                extras["seconds"] = round(time.monotonic() - t0, 2)
                rows.append(row)
                self.outcome.details[key_str(row_key(row))] = extras
                if impl.is_anchor:
                    anchor_seen = True
                self.cfg.log(f"[ok] {point.describe()} {impl.name}: {row['kernel_ms']:.4f} ms "
                             f"({extras['timing']}{'; ' + extras['timing_note'] if extras['timing_note'] else ''}), "
                             f"eager {row['eager_ms']:.4f} ms, peak {row['peak_mem_bytes']}, "
                             f"err {row['rel_err_vs_ref']}, diff {extras.get('diff_vs')}, {extras['seconds']} s")
                if extras.get("stages_ms"):
                    self.cfg.log(f"[stages] {point.describe()} {impl.name}: "
                                 + ", ".join(f"{name} {ms:.4f}" for name, ms in extras["stages_ms"].items()))
            except Unsupported as exc:
                self._event(point, impl.name, "unsupported", str(exc))
            except Exception as exc:
                self.outcome.failed_keys.add(point_row_key(point, impl.name))
                tb = traceback.format_exc(limit=6)
                self._event(point, impl.name, "failed", f"{type(exc).__name__}: {str(exc)[:300]}")
                self.cfg.log(tb)
                _cleanup(self.device)
        # Whether this point's anchors were measured in this run, said on every row of the point.
        same_run = anchor_seen and anchors_live
        for row in rows:
            if row["impl"] not in ANCHORS:
                row["anchor_same_run"] = same_run
        self.outcome.rows.extend(rows)
        del sets, baseline
        _cleanup(self.device)


def _progress(points, enabled: bool):
    if not enabled:
        return points
    try:
        from tqdm import tqdm
    except ImportError:
        return points
    import sys
    # Off a terminal (a GPU run's captured output) a redraw every second would bury the summary
    # printed last; one line every 30 s still shows where a long compile sits.
    interval = 1.0 if sys.stderr.isatty() else 30.0
    return tqdm(points, desc="bench", unit="pt", file=sys.stderr, mininterval=interval, dynamic_ncols=True)


def run_grid(cfg: RunConfig) -> Outcome:
    return Runner(cfg).run()
