"""`python -m gdnkit bench ...` (also `python -m gdnkit.benchmarks ...`).

Passes can run in separate invocations (compiles make a cold quick grid too long for one 10-minute
GPU run): each run merges its rows into its kind's latest.json in the GPU model's folder, replacing rows
with the same key and keeping the others.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
import uuid
from pathlib import Path

import torch

from . import grids, report, timing
from .grids import PASSES
from .impls import environment_versions, gpu_name, gpu_slug, resolve
from .inputs import DECODE_STATE_DTYPES, GATES, GATES_ENV, QK_L2NORM_ENV, STATE_DTYPE_ENV, decode_state_dtype, \
    gates_kind, qk_l2norm_on
from .warm import warm
from .runner import RunConfig, find_cached, merge_rows, run_grid

PROG = "python -m gdnkit bench"
RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _parse_heads(text: str | None):
    return grids.parse_heads(text) if text else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Benchmark gdnkit's backends against FLA and FlashQLA.")
    p.add_argument("--grid", choices=grids.GRIDS, default=None,
                   help="quick (one GPU run per pass group), full (FlashQLA's published grid), tiny (CPU). "
                        "Default: quick on a GPU, tiny on a CPU")
    p.add_argument("--passes", default="fwd,bwd,decode",
                   help="comma list of fwd, bwd, decode, mtp (a verify of draft tokens with every token's state kept; "
                        "not in the default)")
    p.add_argument("--heads", default=None, help="only these head configs, as HxHV comma list, e.g. 4x8,16x32")
    p.add_argument("--mixes", default=None,
                   help="only these sequence mixes, comma list of their labels, e.g. 1x32768,28672+4096")
    p.add_argument("--impls", default="all",
                   help="all | comma list of gdnkit, gdnkit:<backend>, fla, flashqla, flashinfer (default all; on a GPU "
                        "'gdnkit' leaves out the slow PyTorch reference)")
    p.add_argument("--anchors", choices=("live", "cached"), default="live",
                   help="cached: reuse anchor rows of an earlier latest.json from the same GPU model and "
                        "versions (rows say anchor_same_run=false); points without one are measured")
    p.add_argument("--anchors-from", default=None, help="latest.json to take cached anchor rows from "
                                                        "(default: the one in --out)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/<gpu>/; "
                                               "benchmarks/results/cpu/ on a CPU, not committed); the run's "
                                               "kind (see --grid, --gates, --qk-l2norm) prefixes its files")
    p.add_argument("--device", default=None, help="default cuda when available, else cpu")
    p.add_argument("--reps", type=int, default=timing.MIN_REPS, help=f"timed repetitions (>= {timing.MIN_REPS})")
    p.add_argument("--timing", choices=("auto", "graph", "profiler"), default="auto",
                   help="kernel timing: CUDA graph with profiler fallback (auto), or force one")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting new measurements after this many seconds (the rest is recorded as "
                        "skipped), so a run inside a time limit still writes its results")
    p.add_argument("--warm-jobs", type=int, default=0,
                   help="compile every implementation's kernels for the grid first, in this many parallel "
                        "processes (16 on the H200: FlashQLA's compiles otherwise overrun a 10-minute run)")
    p.add_argument("--stages", action="store_true",
                   help="also record where each call's device time goes, per kernel (profiler; CUDA only): "
                        "details.json stages_ms, and one log line per row")
    p.add_argument("--report-only", action="store_true", help="rewrite results.md/speedup.png from latest.json")
    p.add_argument("--json", action="store_true", help="print this run's rows as JSON on stdout at the end")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--gates", choices=GATES, default=None,
                   help="random: g = logsigmoid(randn) (FlashQLA's published inputs, the default); model: "
                        "gates drawn as a Qwen3-Next layer's at initialisation (slow heads decay ~1e-3 a token). "
                        "Model-gate rows go to their own files (model-gates-latest.json, ...)")
    p.add_argument("--qk-l2norm", action="store_true",
                   help="raw q / k, normalised by every implementation in the call (use_qk_l2norm_in_kernel, as "
                        "Qwen3.5-style layers call it); rows go to their own files (qk-l2norm-latest.json, ...)")
    p.add_argument("--state-dtype", choices=tuple(DECODE_STATE_DTYPES), default=None,
                   help="the decode points' states: float32 (the default: a dense state in, a new final state out) "
                        "or bfloat16 (a state pool each implementation updates in place, as serving engines keep "
                        "it); bf16 rows go to their own files (bf16-state-latest.json, ...)")
    return p


def default_out_dir(device: torch.device) -> Path:
    """One folder per GPU model: every kind of result of that model lives in it, as files."""
    return RESULTS_DIR / gpu_slug(gpu_name(device))


def result_kind(grid_name: str) -> str:
    """The prefix of a run's files in its folder: "" for the quick (or CPU tiny) grid with the default inputs,
    else the grid, the gate distribution, the q / k normalisation and the decode state dtype that set it apart,
    e.g. "full", "model-gates", "qk-l2norm", "full-model-gates", "bf16-state". Kinds never merge into one another's
    rows."""
    parts = [] if grid_name in ("quick", "tiny") else [grid_name]
    if gates_kind() != "random":
        parts.append(f"{gates_kind()}-gates")
    if qk_l2norm_on():
        parts.append("qk-l2norm")
    if decode_state_dtype() == torch.bfloat16:
        parts.append("bf16-state")
    return "-".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.gates:  # the environment carries it to the compile workers too
        os.environ[GATES_ENV] = args.gates
    if args.qk_l2norm:
        os.environ[QK_L2NORM_ENV] = "1"
    if args.state_dtype:
        os.environ[STATE_DTYPE_ENV] = args.state_dtype
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    grid_name = args.grid or ("quick" if device.type == "cuda" else "tiny")
    out_dir = Path(args.out) if args.out else default_out_dir(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = report.ResultFiles(out_dir, result_kind(grid_name))
    latest_path, details_path = files.latest, files.details
    old_rows = report.load_json(latest_path, [])
    old_details = report.load_json(details_path, report.empty_details())

    if args.report_only:
        report.write_report(files, old_rows, old_details)
        print(report.short_table(old_rows, old_details))
        return 0

    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    bad = [p for p in passes if p not in PASSES]
    if bad:
        print(f"unknown pass(es) {bad}; choose from {', '.join(PASSES)}", file=sys.stderr)
        return 2
    mixes = None if args.mixes is None else set(args.mixes.split(","))
    grid = grids.get_grid(grid_name).select(passes=passes, heads=_parse_heads(args.heads), mixes=mixes)
    if not grid.points:
        print("no grid points selected", file=sys.stderr)
        return 2
    try:
        impls = resolve(args.impls, device)
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if not impls:
        print("no implementation to run (see --impls)", file=sys.stderr)
        return 2

    run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:6]
    log_file = open(files.log(passes), "w")

    def log(msg: str) -> None:
        log_file.write(msg.rstrip("\n") + "\n")
        log_file.flush()

    command = PROG + (" " + shlex.join(argv) if argv else "")
    run = {"id": run_id, "date": datetime.date.today().isoformat(), "gpu": gpu_name(device),
           "command": command, "grid": grid_name, "passes": passes}
    cached_rows = old_rows
    if args.anchors_from:
        cached_rows = report.load_json(Path(args.anchors_from), [])
    log(f"{command}\nrun {run_id} on {run['gpu']} ({device}); grid {grid_name}: {len(grid.points)} points; "
        f"impls {', '.join(i.name for i in impls)}; anchors {args.anchors}")

    def persist(outcome) -> list[dict]:
        run["unavailable"] = dict(outcome.unavailable)
        rows = merge_rows(old_rows, outcome.rows, drop=outcome.failed_keys)
        details = report.merge_details(old_details, outcome.rows, outcome.details, outcome.events, run, rows)
        report.write_json(latest_path, rows)
        report.write_json(details_path, details)
        return rows

    cfg = RunConfig(grid=grid, impls=impls, device=device, anchors=args.anchors, cached_rows=cached_rows,
                    reps=max(args.reps, timing.MIN_REPS), timing_method=args.timing, budget_s=args.budget_s,
                    run_id=run_id, log=log, on_point_done=persist, progress=not args.no_progress,
                    stages=args.stages)
    t0 = time.monotonic()
    if args.warm_jobs and device.type == "cuda":
        def log_both(msg: str) -> None:
            log(msg)
            print(msg, flush=True)
        cached = None
        if args.anchors == "cached":  # anchors answered from cached rows need no compile
            by_name, gpu, versions = {i.name: i for i in impls}, gpu_name(device), environment_versions()
            cached = lambda name, point: (by_name[name].is_anchor  # noqa: E731
                                          and find_cached(cached_rows, point, by_name[name], gpu, versions) is not None)
        run["first_call_s"] = warm(grid, [i.name for i in impls], str(device), args.warm_jobs, log_both, cached)
    outcome = run_grid(cfg)
    rows = persist(outcome)
    details = report.load_json(details_path, report.empty_details())
    report.write_report(files, rows, details)
    log(f"done in {time.monotonic() - t0:.1f} s: {len(outcome.rows)} rows, "
        f"{sum(e['status'] == 'failed' for e in outcome.events)} failures")
    log_file.close()

    if args.json:
        print(json.dumps(outcome.rows, indent=1))
    touched = {p.key for p in grid.points}
    n_fail = sum(e["status"] == "failed" for e in outcome.events)
    print(f"\n{len(outcome.rows)} rows, {n_fail} failed, "
          f"{sum(e['status'] == 'unsupported' for e in outcome.events)} unsupported"
          f"{'; stopped early: ' + outcome.stopped_early if outcome.stopped_early else ''}; "
          f"{time.monotonic() - t0:.0f} s; results in {files.results}")
    for name, why in outcome.unavailable.items():
        print(f"  not run: {name}: {why[:200]}")
    for e in outcome.events:
        if e["status"] == "failed":
            print(f"  FAILED {e['pass']} H={e['H']} HV={e['HV']} {e['seqlens']} {e['impl']}: {e['reason'][:200]}")
    print(report.short_table(rows, details, touched))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
