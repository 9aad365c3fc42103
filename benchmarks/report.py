"""What a run leaves in its GPU model's results folder, and how runs merge.

  latest.json   the rows (see ROW_FIELDS in runner.py), merged over runs: a new run's row replaces the
                row with the same (pass, H, HV, seqlens, B, impl), every other row is kept
  details.json  per-row extras (timing method, spread, fwd/fwd+bwd split, decode bandwidth, output
                difference vs the first implementation), failures and skips, and the runs' commands
  results.md    the tables: kernel time, speedups over FLA, FlashQLA and FlashInfer, accuracy, eager, memory
  speedup.png   speedup over FLA per grid point
  run-<passes>.log  the last run's log (not committed)

One folder per GPU model holds every kind of result: the quick grid with the default inputs under the names
above, another kind (the full grid, model gates, raw q/k) under the same names prefixed with the kind
("full-latest.json", "model-gates-results.md"); see ResultFiles.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

from .grids import PASSES, STATE_PASSES
from .impls import ANCHOR_TITLES, ANCHORS
from .runner import key_str, row_key, sort_rows

@dataclasses.dataclass(frozen=True)
class ResultFiles:
    """The files of one kind of result inside a GPU model's folder: kind "" names them latest.json, details.json,
    results.md, speedup.png; kind "full" names them full-latest.json, full-details.json, ..."""
    folder: Path
    kind: str = ""

    def path(self, name: str) -> Path:
        return self.folder / (f"{self.kind}-{name}" if self.kind else name)

    latest = property(lambda self: self.path("latest.json"))
    details = property(lambda self: self.path("details.json"))
    results = property(lambda self: self.path("results.md"))
    chart = property(lambda self: self.path("speedup.png"))

    def log(self, passes: list[str]) -> Path:
        return self.path(f"run-{'-'.join(passes)}.log")


ANCHOR_FLA = ANCHORS[0]
PASS_TITLES = {"fwd": "Forward (no grad)", "bwd": "Backward ((fwd+bwd) - fwd)", "decode": "Decode (one token, {state} state)",
               "mtp": "Verify (draft tokens a sequence, every token's state kept, {state} state)"}


def pass_title(rows: list[dict], pass_: str) -> str:
    """PASS_TITLES[pass_], with the decode rows' state dtype(s) ("fp32", "bf16 pool")."""
    names = {"float32": "fp32", "bfloat16": "bf16 pool"}
    states = sorted({names.get(r.get("state_dtype", "float32"), r.get("state_dtype"))
                     for r in rows if r["pass"] == pass_}) or ["fp32"]
    return PASS_TITLES[pass_].format(state=" / ".join(states))


# -- files ---------------------------------------------------------------------------------------
def load_json(path: Path, default):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def write_json(path: Path, data) -> None:
    """Write through a temporary file: a run killed mid-write must not leave half a latest.json."""
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def measure_each(cases, measure) -> list[dict]:
    """A study's rows: measure(*case) for each case, each row printed (as JSON) as it comes, so a run cut by its
    time limit still shows what it measured."""
    rows = []
    for case in cases:
        rows.append(measure(*case))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def write_study(out: Path, name: str, rows: list[dict], table: str, **meta) -> None:
    """A study's files (first_call.py, host_time.py, short_sequences.py, pool_prefill.py, transformers_e2e.py):
    OUT/<name>.json (meta and rows) and OUT/<name>.md (the table), which is also printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    (out / f"{name}.md").write_text(table)
    print(table)


def empty_details() -> dict:
    return {"rows": {}, "events": [], "runs": []}


def merge_details(old: dict, new_rows: list[dict], new_details: dict, new_events: list[dict], run: dict,
                  rows_after: list[dict]) -> dict:
    """Extras of the new rows replace the old; events (failures, skips) of a (point, impl) the new
    run touched replace the old ones; runs no row or event refers to any more are dropped."""
    out = {"rows": dict(old.get("rows", {})), "events": [], "runs": list(old.get("runs", []))}
    out["rows"].update(new_details)
    touched = {row_key(r) for r in new_rows} | {row_key(e) for e in new_events}
    out["events"] = [e for e in old.get("events", []) if row_key(e) not in touched] + list(new_events)
    live = {key_str(row_key(r)) for r in rows_after}
    out["rows"] = {k: v for k, v in out["rows"].items() if k in live}
    out["runs"] = [r for r in out["runs"] if r.get("id") != run.get("id")] + [run]
    used = {v.get("run") for v in out["rows"].values()} | {e.get("run") for e in out["events"]}
    out["runs"] = [r for r in out["runs"] if r.get("id") in used or r is run]
    return out


# -- tables --------------------------------------------------------------------------------------
def _fmt_ms(x) -> str:
    return "" if x is None else f"{x:.4f}" if x < 1 else f"{x:.3f}"


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _point_key(row: dict) -> tuple:
    return (row["pass"], row["H"], row["HV"], row["seqlens"], row["B"])


def _impl_order(impls) -> list[str]:
    return sorted(set(impls), key=lambda n: (ANCHORS.index(n) if n in ANCHORS else len(ANCHORS), n))


def pass_table(rows: list[dict], pass_: str, details: dict | None = None) -> list[str]:
    """Markdown lines: one row per grid point, kernel ms per implementation, then speedups."""
    rows = [r for r in rows if r["pass"] == pass_]
    if not rows:
        return []
    details = details or {}
    impls = _impl_order(r["impl"] for r in rows)
    by_point: dict[tuple, dict[str, dict]] = {}
    for r in sort_rows(rows):
        by_point.setdefault(_point_key(r), {})[r["impl"]] = r
    # every implementation against FLA; gdnkit's against each other anchor present
    others = [i for i in impls if i != ANCHOR_FLA]
    ours = [i for i in impls if i not in ANCHORS]
    ratio_cols = [(i, ANCHOR_FLA) for i in others] if ANCHOR_FLA in impls else []
    for anchor in ANCHORS[1:]:
        if anchor in impls:
            ratio_cols += [(i, anchor) for i in ours]
    head = ["H", "HV", "B" if pass_ == "decode" else "T x B" if pass_ == "mtp" else "seqlens"] + [f"{i} ms" for i in impls]
    head += [f"{i} vs {ANCHOR_TITLES[base]}" for i, base in ratio_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios: dict[tuple, list[float]] = {c: [] for c in ratio_cols}
    for pk, cells in by_point.items():
        _, H, HV, label, B = pk
        line = [str(H), str(HV), str(B) if pass_ == "decode" else label]
        # an anchor figure from another run than the rows it is compared with: reused by a later run (its own
        # flag), or measured live in an earlier run whose gdnkit rows a later run replaced (theirs)
        other_run = any(not cells[o].get("anchor_same_run", True) for o in ours if o in cells)
        for i in impls:
            r = cells.get(i)
            if r is None:
                line.append("—")
                continue
            txt = _fmt_ms(r["kernel_ms"])
            if pass_ in STATE_PASSES:
                gbps = (details.get(key_str(row_key(r))) or {}).get("state_GBps")
                if gbps:
                    txt += f" ({gbps:.4g} GB/s)"
            if i in ANCHORS and (other_run or not r.get("anchor_same_run", True)):
                txt += "*"
            line.append(txt)
        for c in ratio_cols:
            a, b = cells.get(c[0]), cells.get(c[1])
            if a and b and a["kernel_ms"] > 0:
                s = b["kernel_ms"] / a["kernel_ms"]
                ratios[c].append(s)
                line.append(f"{s:.2f}x")
            else:
                line.append("—")
        lines.append("| " + " | ".join(line) + " |")
    if ratio_cols:
        gm = ["geomean", "", ""] + [""] * len(impls)
        for c in ratio_cols:
            g = _geomean(ratios[c])
            gm.append("" if g is None else f"**{g:.2f}x**")
        lines.append("| " + " | ".join(gm) + " |")
    return lines


def first_call_table(details: dict) -> list[str]:
    """Per implementation and head config, the newest run's warm-up seconds (cli --warm-jobs)."""
    latest: dict[str, tuple[str, float]] = {}  # "impl|pass|H|HV" -> (date, seconds), newest run wins
    for run in details.get("runs", []):
        for key, seconds in (run.get("first_call_s") or {}).items():
            latest[key] = (run.get("date", ""), seconds)
    if not latest:
        return []
    out = ["## First call (compile)", "",
           "Seconds for a fresh process to make its first calls at one head config: every sequence mix "
           "the grid times there, with the kernels compiled then (or loaded, where the on-disk kernel cache "
           "already held them). Taken from the parallel warm-up, so concurrent compiles share the CPU.", "",
           "| impl | pass | H | HV | seconds | date |", "|---|---|---|---|---|---|"]
    impls = _impl_order(key.split("|")[0] for key in latest)
    passes = PASSES

    def order(key):
        impl, p, H, HV = key.split("|")
        return impls.index(impl), passes.index(p) if p in passes else len(passes), int(H), int(HV)
    for key in sorted(latest, key=order):
        impl, p, H, HV = key.split("|")
        date, seconds = latest[key]
        out.append(f"| {impl} | {p} | {H} | {HV} | {seconds:.0f} | {date} |")
    return out + [""]


def _gates_text(rows: list[dict]) -> str:
    kinds = {r.get("gates", "random") for r in rows}
    text = {"random": "logsigmoid(randn)",
            "model": "-A softplus(a + dt_bias) as a Qwen3-Next layer at initialisation (A ~ U(0, 16), dt ~ "
                     "logU(1e-3, 0.1) per head, a ~ N(0, 1))"}
    return " / ".join(text[k] for k in sorted(kinds)) or text["random"]


def _qk_text(rows: list[dict]) -> str:
    text = {False: "L2-normalised q/k", True: "raw q/k normalised in the call (use_qk_l2norm_in_kernel)"}
    return " / ".join(text[k] for k in sorted({bool(r.get("qk_l2norm", False)) for r in rows})) or text[False]


def markdown(rows: list[dict], details: dict) -> str:
    rows = sort_rows(rows)
    gpus = sorted({r["gpu"] for r in rows})
    out = [f"# gdnkit benchmarks on {', '.join(gpus) or '(no rows)'}", ""]
    out += ["Kernel time per call in ms: CUDA-graph replay where the call can be captured, else the "
            "per-call sum of device time from torch.profiler; median of >= 20 after warm-up. "
            f"bf16 q/k/v, K = V = 128, {_qk_text(rows)}, fp32 g = {_gates_text(rows)}, beta = "
            "sigmoid(rand), packed with cu_seqlens. \"X vs FLA\" is FLA's time over X's (above 1: X "
            "is faster). `*`: anchor figure reused from an earlier run (anchor_same_run = false). "
            "Backward is (forward+backward) - forward, both with autograd on. Decode bandwidth counts "
            "the state read and written once, in its dtype (a bf16 pool is updated in place by each "
            "implementation that takes one, each state stored [V, K] for gdnkit as for FlashInfer).", ""]
    if "cpu" in gpus:
        out += ["CPU rows come from the `tiny` grid (K = V = 16, host wall time): a smoke test of the "
                "harness, not a result.", ""]
    drow = details.get("rows", {})
    for p in PASSES:
        t = pass_table(rows, p, drow)
        if t:
            out += [f"## {pass_title(rows, p)}", ""] + t + [""]

    # accuracy: one value per (pass, head config, implementation)
    acc: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r.get("rel_err_vs_ref") is not None:
            acc.setdefault((r["pass"], r["H"], r["HV"]), {})[r["impl"]] = r["rel_err_vs_ref"]
    if acc:
        impls = _impl_order(i for v in acc.values() for i in v)
        out += ["## Accuracy vs the float64 reference", "",
                "Relative L2 error on a small varlen problem per head config (fwd: o; bwd: the largest "
                "over dq, dk, dv, dg, dbeta; decode: o and the final state).", "",
                "| pass | H | HV | " + " | ".join(impls) + " |", "|" + "---|" * (3 + len(impls))]
        for (p, H, HV), v in sorted(acc.items(), key=lambda kv: (PASSES.index(kv[0][0]),) + kv[0][1:]):
            out.append(f"| {p} | {H} | {HV} | " + " | ".join(
                "—" if i not in v else f"{v[i]:.2e}" for i in impls) + " |")
        out.append("")

    out += first_call_table(details)
    out += ["## Every row", "",
            "eager ms: a synchronize after each call; host ms: the same call's host time, calls back to back (bwd: "
            "both are the step's less the forward's). Where eager is well above host, the "
            "call's kernels or its synchronize bound it, not its host work.", "",
            "| pass | H | HV | seqlens | B | impl | kernel ms | eager ms | host ms | peak MiB | err vs ref | "
            "max diff vs first impl | timing | same-run anchor | date |",
            "|" + "---|" * 15]
    for r in rows:
        d = drow.get(key_str(row_key(r)), {})
        diff = d.get("diff_vs") or {}
        diff_txt = ", ".join(f"{v:.1e} ({k})" if isinstance(v, float) else f"{v} ({k})" for k, v in diff.items())
        peak = "" if r.get("peak_mem_bytes") is None else f"{r['peak_mem_bytes'] / 2**20:.0f}"
        err = "" if r.get("rel_err_vs_ref") is None else f"{r['rel_err_vs_ref']:.2e}"
        out.append(f"| {r['pass']} | {r['H']} | {r['HV']} | {r['seqlens']} | {'' if r['B'] is None else r['B']} | "
                   f"{r['impl']} | {_fmt_ms(r['kernel_ms'])} | {_fmt_ms(r.get('eager_ms'))} | {_fmt_ms(d.get('host_ms'))} | "
                   f"{peak} | {err} | "
                   f"{diff_txt} | {d.get('timing', '')} | {'yes' if r.get('anchor_same_run') else 'no'} | {r['date']} |")
    out.append("")

    events = details.get("events", [])
    if events:
        out += ["## Not measured", "", "| pass | H | HV | seqlens | B | impl | status | reason |", "|" + "---|" * 8]
        for e in events:
            reason = str(e.get("reason", "")).replace("|", "/").replace("\n", " ")[:240]
            out.append(f"| {e['pass']} | {e['H']} | {e['HV']} | {e['seqlens']} | {'' if e['B'] is None else e['B']} | "
                       f"{e['impl']} | {e['status']} | {reason} |")
        out.append("")

    runs = details.get("runs", [])
    if runs:
        out += ["## Produced by", ""]
        for r in runs:
            out.append(f"- {r.get('date')} ({r.get('gpu')}): `{r.get('command')}`")
            for name, why in (r.get("unavailable") or {}).items():
                out.append(f"  - not run: {name}: {str(why)[:200]}")
        versions = sorted({json.dumps(r["versions"], sort_keys=True) for r in rows})
        if versions:
            out += ["", "Versions: " + "; ".join(
                ", ".join(f"{k} {v}" for k, v in json.loads(s).items() if v) for s in versions)]
        out.append("")
    return "\n".join(out)


# -- chart ---------------------------------------------------------------------------------------
def chart(rows: list[dict], path: Path) -> bool:
    """Speedup over FLA per grid point, one panel per pass. Returns False when nothing to draw."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    passes = [p for p in PASSES if any(r["pass"] == p for r in rows)]
    if not passes:
        return False
    have_fla = any(r["impl"] == ANCHOR_FLA for r in rows)
    fig, axes = plt.subplots(len(passes), 1, figsize=(max(8.0, 0.5 * len(rows) / len(passes) + 4), 3.6 * len(passes)),
                             squeeze=False)
    for ax, p in zip(axes[:, 0], passes):
        prow = sort_rows([r for r in rows if r["pass"] == p])
        points: list[tuple] = []
        for r in prow:
            if _point_key(r) not in points:
                points.append(_point_key(r))
        cell = {(_point_key(r), r["impl"]): r["kernel_ms"] for r in prow}
        impls = [i for i in _impl_order(r["impl"] for r in prow) if not (have_fla and i == ANCHOR_FLA)]
        width = 0.8 / max(1, len(impls))
        for j, impl in enumerate(impls):
            xs, ys = [], []
            for x, pk in enumerate(points):
                ms = cell.get((pk, impl))
                if ms is None:
                    continue
                if have_fla:
                    base = cell.get((pk, ANCHOR_FLA))
                    if base is None:
                        continue
                    ys.append(base / ms)
                else:
                    ys.append(ms)
                xs.append(x - 0.4 + width * (j + 0.5))
            ax.bar(xs, ys, width=width, label=impl)
        labels = [f"B={pk[4]} {pk[1]}/{pk[2]}" if p == "decode" else f"{pk[1]}/{pk[2]} {pk[3]}" for pk in points]
        ax.set_xticks(range(len(points)))
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
        if have_fla:
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_ylabel("speedup over FLA")
        else:
            ax.set_yscale("log")
            ax.set_ylabel("kernel ms (no FLA rows)")
        ax.set_title(f"{pass_title(prow, p)} — H/HV seqlens", fontsize=9)
        if impls:
            ax.legend(fontsize=7)
    gpus = ", ".join(sorted({r["gpu"] for r in rows}))
    fig.suptitle(f"gdnkit vs anchors on {gpus}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(files: ResultFiles, rows: list[dict], details: dict) -> None:
    files.folder.mkdir(parents=True, exist_ok=True)
    files.results.write_text(markdown(rows, details))
    try:
        chart(rows, files.chart)
    except Exception as exc:  # a chart must never cost the measured numbers
        files.path("chart_error.txt").write_text(f"{type(exc).__name__}: {exc}\n")


def short_table(rows: list[dict], details: dict, points: set | None = None) -> str:
    """The tables of the points this run touched, for the end of the console output."""
    if points is not None:
        rows = [r for r in rows if _point_key(r) in points]
    out = []
    for p in PASSES:
        t = pass_table(rows, p, details.get("rows", {}))
        if t:
            out += [f"{pass_title(rows, p)}:"] + t + [""]
    return "\n".join(out)
