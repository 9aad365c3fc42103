"""CPU tests of the benchmark harness (gdnkit.benchmarks): grids, inputs, timing, runner, merging, report.

Results written here go to pytest's tmp dirs; fake implementations stand in for the anchors so the
failure, skip and cached-anchor paths run without a GPU.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from gdnkit.benchmarks import cli, grids, impls, inputs, report, runner, timing
from gdnkit.benchmarks.grids import Grid, Point

ROW_TYPES = {"pass": str, "H": int, "HV": int, "seqlens": str, "B": (int, type(None)), "impl": str,
             "kernel_ms": float, "eager_ms": (float, type(None)), "peak_mem_bytes": (int, type(None)),
             "rel_err_vs_ref": (float, type(None)), "anchor_same_run": bool, "gpu": str, "date": str,
             "versions": dict, "gates": str, "qk_l2norm": bool, "state_dtype": str}


def check_row(row: dict) -> None:
    assert tuple(row) == runner.ROW_FIELDS, f"row keys {tuple(row)}"
    for k, t in ROW_TYPES.items():
        assert isinstance(row[k], t), f"{k}={row[k]!r} is not {t}"
    assert row["pass"] in grids.PASSES
    assert row["impl"] in impls.ANCHORS or row["impl"].startswith("gdnkit:")
    assert row["kernel_ms"] > 0 and math.isfinite(row["kernel_ms"])
    assert (row["B"] is None) == (row["pass"] not in grids.STATE_PASSES)
    assert len(row["date"]) == 10 and row["date"][4] == "-"
    assert row["versions"]["torch"] == torch.__version__


# -- fakes ---------------------------------------------------------------------------------------
class FakeImpl(impls.Impl):
    """Cheap stand-in: o = beta * v (wrong on purpose; accuracy is only recorded, not judged here)."""

    def __init__(self, name="gdnkit:fake", anchor=False, fail_at=None, calls=None):
        self.name, self.is_anchor, self.fail_at = name, anchor, fail_at
        self.version_keys = ("fla", "torch") if anchor else ("torch",)
        self.calls = calls if calls is not None else []

    def _check(self, inp):
        self.calls.append(inp.q.shape[1])
        if self.fail_at is not None and inp.q.shape[1] == self.fail_at:
            raise RuntimeError("planted failure")

    def chunk(self, inp, output_final_state=False):
        self._check(inp)
        return (inp.v.float() * inp.beta[..., None]).to(inp.v.dtype), None

    def decode(self, inp):
        self._check(inp)
        return (inp.v.float() * inp.beta[..., None]).to(inp.v.dtype), inp.initial_state * 0.5


SMALL = Grid("small", (Point("fwd", 1, 2, (8,), K=8, V=8), Point("fwd", 1, 2, (3, 9), K=8, V=8),
                       Point("decode", 1, 2, (1, 1), B=2, K=8, V=8)),
             accuracy_seqlens=(1, 5), accuracy_decode_B=2)


def run_small(impl_list, grid=SMALL, **kw):
    logs = []
    cfg = runner.RunConfig(grid=grid, impls=impl_list, device=torch.device("cpu"), log=logs.append,
                           progress=False, run_id="test", **kw)
    return runner.run_grid(cfg), logs


# -- grids and inputs ----------------------------------------------------------------------------
def test_quick_grid_is_the_issue_grid():
    g = grids.get_grid("quick")
    fwd = [p for p in g.points if p.pass_ == "fwd"]
    assert {(p.H, p.HV) for p in fwd} == {(2, 8), (4, 16), (8, 32), (16, 64)}
    assert {p.label for p in fwd} == {"1x32768", "1x2048", "4096x8"}
    assert {p.seqlens for p in fwd} == {(32768,), (2048,), (4096,) * 8}  # 4096x8: eight sequences of 4096
    bwd = [p for p in g.points if p.pass_ == "bwd"]
    single, several = ("1x8192", "1x32768"), ("8192+8192+4096", "4096x4")  # several: packed training documents
    assert {(p.H, p.HV, p.label) for p in bwd} == ({(4, 8, s) for s in single} | {(8, 32, s) for s in several}
                                                   | {(16, 32, s) for s in single + several})
    dec = [p for p in g.points if p.pass_ == "decode"]
    assert {(p.B, p.H, p.HV) for p in dec} == {(1, 16, 64), (64, 16, 64), (256, 2, 8), (256, 16, 32)}
    mtp = [p for p in g.points if p.pass_ == "mtp"]   # MTP T=4: a verify of four draft tokens a sequence
    assert {(p.B, p.H, p.HV, p.seqlens[0]) for p in mtp} == {(64, 16, 64, 4), (256, 16, 32, 4), (256, 2, 8, 4)}
    assert all(p.seqlens == (4,) * p.B and p.label == f"4x{p.B}" for p in mtp)
    assert all(p.K == p.V == 128 for p in g.points)
    order = [(p.pass_, p.H, p.HV) for p in g.points]
    assert all(order.index(x) == i or order[i - 1] == x for i, x in enumerate(order))
    full = grids.get_grid("full")
    assert len([p for p in full.points if p.pass_ == "fwd"]) == 9 * 19
    assert len([p for p in full.points if p.pass_ == "bwd"]) == 4 * 8
    assert all(sum(p.seqlens) in (8192, 32768) for p in full.points if p.pass_ == "bwd")
    assert len({p.key for p in full.points}) == len(full.points)
    # head configs of one pass stay together (one compile per config for the TileLang anchor)
    order = [(p.pass_, p.H, p.HV) for p in full.points]
    assert all(order.index(x) == i or order[i - 1] == x for i, x in enumerate(order))


def test_select_and_labels():
    g = grids.get_grid("quick").select(passes=["bwd"], heads=[(4, 8)])
    assert [p.label for p in g.points] == ["1x8192", "1x32768"]
    assert grids.seqlens_label((28672, 4096)) == "28672+4096"
    full = grids.get_grid("full").select(passes=["fwd"], heads=[(2, 8), (16, 64)], mixes={"28672+4096", "1x2048"})
    assert [(p.HV, p.label) for p in full.points] == [(8, "1x2048"), (8, "28672+4096"), (64, "1x2048"),
                                                      (64, "28672+4096")]
    assert sum(grids.random_split(8192, 4)) == 8192 and grids.random_split(8192, 4) == grids.random_split(8192, 4)


def test_inputs_follow_the_anchor_recipe():
    p = Point("fwd", 2, 4, (5, 11), K=16, V=8)
    a = inputs.make_point_inputs(p, "cpu")
    b = inputs.make_point_inputs(p, "cpu")
    c = inputs.make_point_inputs(p, "cpu", set_index=1)
    assert torch.equal(a.q, b.q) and not torch.equal(a.q, c.q)  # seeded per point and set
    assert a.q.dtype == a.k.dtype == a.v.dtype == torch.bfloat16
    assert a.g.dtype == a.beta.dtype == torch.float32
    assert a.q.shape == (1, 16, 2, 16) and a.v.shape == (1, 16, 4, 8) and a.g.shape == (1, 16, 4)
    assert a.cu_seqlens.tolist() == [0, 5, 16] and a.cu_seqlens.dtype == torch.long
    norms = a.k.float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)
    assert (a.g < 0).all() and (a.beta >= 0.5).all() and (a.beta < 0.74).all()
    for t in (a.q, a.k, a.v, a.g, a.beta):
        assert (t != 0).float().mean() > 0.99  # never zeros
    d = inputs.make_point_inputs(Point("decode", 2, 4, (1,) * 3, B=3, K=16, V=8), "cpu")
    assert d.q.shape == (3, 1, 2, 16) and d.cu_seqlens is None
    assert d.initial_state.shape == (3, 4, 16, 8) and d.initial_state.dtype == torch.float32
    bw = inputs.make_point_inputs(Point("bwd", 1, 2, (7,), K=8, V=8), "cpu")
    assert bw.do is not None and bw.do.shape == bw.v.shape


def test_gates_random_keep_the_recipe_and_model_gates_decay_slowly(monkeypatch):
    p = Point("fwd", 1, 16, (2048,), K=8, V=8)
    a = inputs.make_point_inputs(p, "cpu")
    gen = torch.Generator().manual_seed(inputs.seed_for(p, "set0"))
    for shape in ((1, 2048, 1, 8), (1, 2048, 1, 8), (1, 2048, 16, 8)):   # q, k, v drawn first
        torch.randn(*shape, generator=gen)
    assert torch.equal(a.g, torch.nn.functional.logsigmoid(torch.randn(1, 2048, 16, generator=gen)))
    monkeypatch.setenv(inputs.GATES_ENV, "model")
    m = inputs.make_point_inputs(p, "cpu")
    assert torch.equal(m.q, a.q) and torch.isfinite(m.g).all() and (m.g <= 0).all()
    rate = -m.g[0].mean(0)                       # per value head, per token
    assert rate.min() < 0.02 and rate.max() > 0.1 and -a.g.mean() > 0.5
    assert cli.result_kind("quick") == "model-gates" and cli.default_out_dir(torch.device("cpu")).name == "cpu"
    monkeypatch.setenv(inputs.GATES_ENV, "uniform")
    with pytest.raises(ValueError, match="GDNKIT_BENCH_GATES"):
        inputs.make_point_inputs(p, "cpu")


def test_qk_l2norm_option_draws_raw_qk_that_every_call_normalises(monkeypatch):
    """bench --qk-l2norm (GDNKIT_BENCH_QK_L2NORM=1): q and k drawn raw from the same draws, every call given
    use_qk_l2norm_in_kernel (gdnkit's and the float64 truth's: their outputs are the pre-normalised call's), rows
    in their own folder and never standing in for the other kind's."""
    p = Point("bwd", 1, 2, (70,), K=8, V=8)
    plain = inputs.make_point_inputs(p, "cpu")
    assert inputs.call_options() == {} and torch.allclose(plain.q.float().norm(dim=-1), torch.ones(1), atol=1e-2)
    monkeypatch.setenv(inputs.QK_L2NORM_ENV, "1")
    raw = inputs.make_point_inputs(p, "cpu")
    assert inputs.call_options() == {"use_qk_l2norm_in_kernel": True}
    assert raw.q.float().norm(dim=-1).std() > 0.1
    assert torch.allclose(torch.nn.functional.normalize(raw.k.float(), dim=-1), plain.k.float(), atol=1e-2)
    assert torch.equal(raw.v, plain.v) and torch.equal(raw.g, plain.g)
    assert cli.result_kind("quick") == "qk-l2norm" and cli.default_out_dir(torch.device("cpu")).name == "cpu"
    (ours,) = impls.resolve("gdnkit:reference", "cpu")
    o_raw = ours.chunk(raw)[0]
    (ref_raw,) = runner.accuracy.reference_outputs(raw, "fwd")
    monkeypatch.setenv(inputs.QK_L2NORM_ENV, "0")
    o_plain = ours.chunk(plain)[0]
    err = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    assert err(o_raw, o_plain) < 2e-2 and err(ref_raw, o_plain) < 2e-2
    monkeypatch.setenv(inputs.QK_L2NORM_ENV, "yes")
    with pytest.raises(ValueError, match="GDNKIT_BENCH_QK_L2NORM"):
        inputs.make_point_inputs(p, "cpu")


# -- timing --------------------------------------------------------------------------------------
def test_timing_helpers_return_positive_medians():
    x = torch.randn(64, 64)
    fns = [lambda: x @ x, lambda: x @ x.T]
    t = timing.time_kernel(fns, "cpu", reps=5)  # raised to the floor of 20
    assert t.method == "cpu-wall" and len(t.samples_ms) >= 20
    assert t.median_ms > 0 and all(s > 0 for s in t.samples_ms) and t.spread >= 0
    assert timing.time_eager(fns, "cpu") > 0 and timing.time_host(fns, "cpu") > 0
    assert timing.peak_memory(fns[0], "cpu") is None


def test_profiler_attribution_by_time_windows():
    # three calls opening at 0, 100, 200 us (out of order); kernels land after their window opened
    windows = [(100.0, 1), (0.0, 0), (200.0, 2)]
    activity = [(5.0, 10.0), (20.0, 30.0), (110.0, 40.0), (205.0, 50.0), (260.0, 10.0)]
    per_call, note = timing.attribute(windows, activity, 3)
    assert per_call == pytest.approx([0.04, 0.04, 0.06]) and note == ""
    per_call, note = timing.attribute(windows[:2], activity, 3)  # a window missing: the mean, said so
    assert per_call == pytest.approx([0.14 / 3] * 3) and "failed" in note


def test_stage_times_group_kernels_per_call():
    # two calls: kernel a twice per call (20 + 30 us), b once (100 us); names cut to the width
    events = [("a_kernel", 20.0), ("b_kernel_with_a_long_name", 100.0), ("a_kernel", 30.0),
              ("a_kernel", 20.0), ("b_kernel_with_a_long_name", 100.0), ("a_kernel", 30.0)]
    stages = timing.group_stages(events, calls=2, width=8)
    assert list(stages) == ["b_kernel", "a_kernel"]  # largest first
    assert stages == {"b_kernel": pytest.approx(0.1), "a_kernel": pytest.approx(0.05)}
    assert timing.stage_times([lambda: None], "cpu") == {}  # the profiler's device view exists on CUDA only


# -- runner --------------------------------------------------------------------------------------
def test_failure_at_one_point_is_recorded_and_the_run_goes_on():
    bad = FakeImpl("gdnkit:bad", fail_at=12)  # fails on the 3+9 point only
    good = FakeImpl("gdnkit:good")
    out, logs = run_small([good, bad])
    got = {(r["seqlens"], r["impl"]) for r in out.rows}
    assert ("3+9", "gdnkit:bad") not in got
    assert {("1x8", "gdnkit:bad"), ("1x8", "gdnkit:good"), ("3+9", "gdnkit:good"),
            ("1x2", "gdnkit:bad"), ("1x2", "gdnkit:good")} <= got
    failed = [e for e in out.events if e["status"] == "failed"]
    assert len(failed) == 1 and failed[0]["impl"] == "gdnkit:bad" and "planted" in failed[0]["reason"]
    assert ("fwd", 1, 2, "3+9", None, "gdnkit:bad") in out.failed_keys
    assert any("planted failure" in line for line in logs)  # traceback kept in the log
    for r in out.rows:
        check_row(r)
    # the second implementation at a point is compared with the first on the same inputs
    d = out.details[runner.key_str(("fwd", 1, 2, "1x8", None, "gdnkit:bad"))]
    assert d["diff_vs"] == {"gdnkit:good": 0.0}


def test_unavailable_and_unsupported_are_not_failures():
    class Gone(FakeImpl):
        def unavailable(self, device):
            return "not installed here"

    class NoDecode(FakeImpl):
        def skip_reason(self, point):
            return "no decode" if point.pass_ == "decode" else None

    out, _ = run_small([Gone("fla", anchor=True), NoDecode("flashqla", anchor=True)])
    assert out.unavailable == {"fla": "not installed here"}
    assert [e["status"] for e in out.events] == ["unsupported"]
    assert not out.failed_keys
    assert {r["impl"] for r in out.rows} == {"flashqla"}
    assert all(r["anchor_same_run"] for r in out.rows)


@pytest.mark.parametrize("medians,expected", [
    ([2.0, 3.0, 5.0, 1.0], 4.0),   # fwd+bwd 2 <= fwd 3 (a burst of load): measured again, 5 - 1
    ([2.0, 3.0, 2.0, 3.0], None),  # inverted twice: a failure, not a negative time
])
def test_backward_pair_is_measured_again_once_when_inverted(medians, expected, monkeypatch):
    script = iter(medians)
    monkeypatch.setattr(timing, "time_kernel", lambda *a, **k: timing.Timing(next(script), [1.0], "cpu-wall"))
    class Differentiable(FakeImpl):
        def chunk(self, inp, output_final_state=False):
            o, _ = super().chunk(inp)
            return o + 0 * sum(x.float().sum() for x in inp.leaves()), None

    grid = Grid("bwd1", (Point("bwd", 1, 2, (8,), K=8, V=8),), accuracy_seqlens=(1, 5), accuracy_decode_B=2)
    out, _ = run_small([Differentiable()], grid=grid)
    if expected is None:
        assert not out.rows and "not resolvable" in out.events[0]["reason"]
    else:
        assert [r["kernel_ms"] for r in out.rows] == [expected]


def test_budget_stops_new_measurements():
    out, _ = run_small([FakeImpl()], budget_s=0.0)
    assert out.rows == [] and out.stopped_early
    assert {e["status"] for e in out.events} == {"skipped"}


def test_cached_anchor_rows_are_reused_and_marked(monkeypatch):
    versions = dict(impls.environment_versions(), fla="0.6.0")  # as on the GPU bundle
    monkeypatch.setattr(runner, "environment_versions", lambda: dict(versions))
    point = SMALL.points[0]
    cached = {"pass": "fwd", "H": 1, "HV": 2, "seqlens": "1x8", "B": None, "impl": "fla", "kernel_ms": 0.5,
              "eager_ms": 1.0, "peak_mem_bytes": None, "rel_err_vs_ref": 3e-3, "anchor_same_run": True,
              "gpu": "cpu", "date": "2026-01-01", "versions": dict(versions)}
    stale = dict(cached, seqlens="3+9", versions=dict(versions, fla="0.0.1"))  # other fla version: unusable
    other_gpu = dict(cached, seqlens="1x2", B=2, **{"pass": "decode"}, gpu="NVIDIA H100")
    calls = []
    fla = FakeImpl("fla", anchor=True, calls=calls)
    ours = FakeImpl("gdnkit:x")
    out, logs = run_small([fla, ours], anchors="cached", cached_rows=[cached, stale, other_gpu])
    rows = {(r["seqlens"], r["impl"]): r for r in out.rows}
    assert rows[("1x8", "fla")]["kernel_ms"] == 0.5 and rows[("1x8", "fla")]["anchor_same_run"] is False
    assert rows[("1x8", "gdnkit:x")]["anchor_same_run"] is False
    # no usable cache -> measured live, and then the point's rows say so
    assert rows[("3+9", "fla")]["kernel_ms"] != 0.5 and rows[("3+9", "fla")]["anchor_same_run"] is True
    assert rows[("3+9", "gdnkit:x")]["anchor_same_run"] is True
    assert rows[("1x2", "fla")]["anchor_same_run"] is True
    assert 8 not in calls  # the cached point never ran the anchor
    assert sum("[cache-miss]" in line for line in logs) == 2
    assert runner.find_cached([cached], point, fla, "cpu", versions) is cached
    assert runner.find_cached([cached], point, fla, "NVIDIA H200", versions) is None
    # a row measured on other gates never stands in (rows from before the field existed are random gates)
    assert runner.find_cached([dict(cached, gates="model")], point, fla, "cpu", versions) is None
    monkeypatch.setenv(inputs.GATES_ENV, "model")
    assert runner.find_cached([cached], point, fla, "cpu", versions) is None
    assert runner.find_cached([dict(cached, gates="model")], point, fla, "cpu", versions) is not None
    # nor one measured with the other q / k normalisation (rows from before the field: normalised before)
    monkeypatch.setenv(inputs.GATES_ENV, "random")
    assert runner.find_cached([dict(cached, qk_l2norm=True)], point, fla, "cpu", versions) is None
    monkeypatch.setenv(inputs.QK_L2NORM_ENV, "1")
    assert runner.find_cached([cached], point, fla, "cpu", versions) is None
    assert runner.find_cached([dict(cached, qk_l2norm=True)], point, fla, "cpu", versions) is not None


def test_warm_up_skips_what_cached_anchor_rows_answer():
    from gdnkit.benchmarks.warm import jobs_of
    quick = grids.get_grid("quick").select(passes=["fwd"])
    names = ["fla", "gdnkit:triton_generic"]
    every = jobs_of(quick, names)
    assert {j[0] for j in every} == set(names) and all(j[4] for j in every)
    # each job also runs its head config's accuracy problem, last
    accuracy = grids.seqlens_label(quick.accuracy_seqlens)
    assert all(j[4][-1].label == accuracy and (j[4][-1].H, j[4][-1].HV) == (j[2], j[3]) for j in every)
    # fla cached everywhere but at H=2 HV=8 1x2048: one fla job left, holding that one point
    left = lambda name, p: name == "fla" and not (p.H == 2 and p.label == "1x2048")  # noqa: E731
    jobs = jobs_of(quick, names, cached=left)
    fla_jobs = [j for j in jobs if j[0] == "fla"]
    assert len(fla_jobs) == 1 and [p.label for p in fla_jobs[0][4]] == ["1x2048", accuracy]
    assert [j for j in jobs if j[0] != "fla"] == [j for j in every if j[0] != "fla"]


def test_warm_job_says_whether_anything_ran(monkeypatch):
    from gdnkit.benchmarks.warm import _warm_job
    monkeypatch.setattr(timing, "MIN_REPS", 3)
    points = tuple(grids.get_grid("tiny").select(passes=["fwd"], heads=[(1, 2)]).points)
    seconds, error, ran = _warm_job("gdnkit:reference", points, "cpu")
    assert error is None and ran and seconds > 0
    assert _warm_job("gdnkit:tilelang_sm90", points, "cpu")[1:] == (None, False)  # cannot run here


def test_merge_replaces_same_key_keeps_others_drops_failed():
    def row(seq, impl, ms):
        return {"pass": "fwd", "H": 1, "HV": 2, "seqlens": seq, "B": None, "impl": impl, "kernel_ms": ms}
    old = [row("1x8", "fla", 1.0), row("1x16", "fla", 2.0), row("1x32", "gdnkit:x", 3.0),
           {**row("1x2", "fla", 4.0), "pass": "decode", "B": 2}]
    new = [row("1x8", "fla", 9.0)]
    merged = runner.merge_rows(old, new, drop={("fwd", 1, 2, "1x32", None, "gdnkit:x")})
    got = {(r["pass"], r["seqlens"], r["impl"]): r["kernel_ms"] for r in merged}
    assert got == {("fwd", "1x8", "fla"): 9.0, ("fwd", "1x16", "fla"): 2.0, ("decode", "1x2", "fla"): 4.0}


# -- end to end and report -----------------------------------------------------------------------
def test_tiny_grid_end_to_end(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")  # the chart: the bench extra
    # Fewer repetitions than the floor of 20 keep this smoke test fast on a busy CPU; the rows'
    # shape and the merging are what it checks, not the numbers.
    monkeypatch.setattr(timing, "MIN_REPS", 3)
    out = tmp_path / "res"
    argv = ["--grid", "tiny", "--device", "cpu", "--heads", "1x2", "--out", str(out), "--no-progress",
            "--passes", "fwd,decode"]
    assert cli.main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["details.json", "latest.json", "results.md",
                                                     "run-fwd-decode.log", "speedup.png"]
    rows = json.loads((out / "latest.json").read_text())
    assert {(r["pass"], r["seqlens"]) for r in rows} == {("fwd", "1x64"), ("fwd", "5+27+1"), ("decode", "1x2")}
    for r in rows:
        check_row(r)
        assert r["impl"] == "gdnkit:reference" and r["gpu"] == "cpu" and r["anchor_same_run"] is False
        # bf16 inputs and output: the error is the output's rounding, ~2e-3, never NaN
        assert r["rel_err_vs_ref"] is not None and r["rel_err_vs_ref"] < 5e-3
    assert "--heads 1x2" in json.loads((out / "details.json").read_text())["runs"][0]["command"]
    printed = capsys.readouterr().out
    assert "gdnkit:reference ms" in printed  # the short table comes last

    # a second run of another pass merges into the same latest.json
    assert cli.main(["--grid", "tiny", "--device", "cpu", "--heads", "1x2", "--out", str(out), "--no-progress",
                     "--passes", "bwd", "--json"]) == 0
    rows2 = json.loads((out / "latest.json").read_text())
    assert {r["pass"] for r in rows2} == {"fwd", "bwd", "decode"} and len(rows2) == len(rows) + 1
    details = json.loads((out / "details.json").read_text())
    assert len(details["runs"]) == 2 and set(details["rows"]) == {runner.key_str(runner.row_key(r)) for r in rows2}
    bwd = next(r for r in rows2 if r["pass"] == "bwd")
    extras = details["rows"][runner.key_str(runner.row_key(bwd))]
    assert extras["fwdbwd_ms"] > extras["fwd_train_ms"] and bwd["kernel_ms"] == pytest.approx(
        extras["fwdbwd_ms"] - extras["fwd_train_ms"])
    assert extras["fwdbwd_host_ms"] > 0 and extras["host_ms"] == pytest.approx(
        extras["fwdbwd_host_ms"] - extras["fwd_train_host_ms"])
    # the verify pass (not in the default passes) through the same command
    assert cli.main(["--grid", "tiny", "--device", "cpu", "--heads", "1x2", "--out", str(out), "--no-progress",
                     "--passes", "mtp"]) == 0
    (mtp,) = [r for r in json.loads((out / "latest.json").read_text()) if r["pass"] == "mtp"]
    check_row(mtp)
    assert mtp["seqlens"] == "3x2" and mtp["B"] == 2 and mtp["rel_err_vs_ref"] < 5e-3
    extras = json.loads((out / "details.json").read_text())["rows"][runner.key_str(runner.row_key(mtp))]
    assert extras["state_GBps"] > 0
    assert cli.main(["--out", str(out), "--report-only"]) == 0


def test_each_kind_of_result_is_files_in_the_gpu_models_folder(tmp_path, monkeypatch):
    """One folder per GPU model; the full grid, model gates and raw q / k write their own prefixed files beside
    the quick grid's, never into its rows."""
    monkeypatch.delenv(inputs.GATES_ENV, raising=False)
    monkeypatch.delenv(inputs.QK_L2NORM_ENV, raising=False)
    monkeypatch.delenv(inputs.STATE_DTYPE_ENV, raising=False)
    assert cli.result_kind("quick") == cli.result_kind("tiny") == ""
    assert cli.result_kind("full") == "full"
    monkeypatch.setenv(inputs.GATES_ENV, "model")
    assert cli.result_kind("quick") == "model-gates"
    monkeypatch.setenv(inputs.QK_L2NORM_ENV, "1")
    assert cli.result_kind("full") == "full-model-gates-qk-l2norm"
    monkeypatch.setenv(inputs.STATE_DTYPE_ENV, "bfloat16")
    assert cli.result_kind("full") == "full-model-gates-qk-l2norm-bf16-state"
    files = report.ResultFiles(tmp_path, "full")
    assert (files.latest.name, files.details.name, files.results.name, files.chart.name) == (
        "full-latest.json", "full-details.json", "full-results.md", "full-speedup.png")
    assert report.ResultFiles(tmp_path).latest == tmp_path / "latest.json"
    assert cli.default_out_dir(torch.device("cpu")) == cli.RESULTS_DIR / "cpu"


def test_committed_results_are_one_folder_per_gpu_model():
    """benchmarks/results holds a folder per GPU model and only result files in it: a kind's latest.json,
    details.json, results.md and speedup.png, and the tables derived from them (a folder with no bench rows yet
    holds its reliability records alone)."""
    if not cli.RESULTS_DIR.is_dir():
        pytest.skip("an installed copy without the repository's results")
    folders = [p for p in cli.RESULTS_DIR.iterdir() if p.name != "cpu"]
    assert folders and all(p.is_dir() for p in folders)
    for folder in folders:
        for p in folder.iterdir():
            assert p.is_file() and p.suffix in (".json", ".md", ".png", ".log"), p
        names = {p.name for p in folder.iterdir()}
        if any(name.endswith(".json") for name in names):
            assert {"latest.json", "details.json", "results.md", "speedup.png"} <= names


def test_first_call_table_takes_the_newest_run():
    details = {"runs": [{"id": "a", "date": "2026-11-28", "first_call_s": {"fla|fwd|2|8": 70.0,
                                                                          "gdnkit:tilelang_sm90|fwd|2|8": 40.0}},
                        {"id": "b", "date": "2026-11-29", "first_call_s": {"gdnkit:tilelang_sm90|fwd|2|8": 9.5,
                                                                          "gdnkit:tilelang_sm90|bwd|4|8": 30.0}},
                        {"id": "c", "date": "2026-11-30"}]}  # a run without warm-up changes nothing
    lines = report.first_call_table(details)
    body = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| impl")]
    assert body == ["| fla | fwd | 2 | 8 | 70 | 2026-11-28 |",
                    "| gdnkit:tilelang_sm90 | fwd | 2 | 8 | 10 | 2026-11-29 |",
                    "| gdnkit:tilelang_sm90 | bwd | 4 | 8 | 30 | 2026-11-29 |"]
    assert report.first_call_table({"runs": [{"id": "x"}]}) == []


def test_report_ratios_and_chart(tmp_path):
    pytest.importorskip("matplotlib")  # the chart: the bench extra
    def row(impl, ms, seq="1x2048", same=True):
        return {"pass": "fwd", "H": 2, "HV": 8, "seqlens": seq, "B": None, "impl": impl, "kernel_ms": ms,
                "eager_ms": ms + 1, "peak_mem_bytes": 2**20, "rel_err_vs_ref": 2e-3, "anchor_same_run": same,
                "gpu": "NVIDIA H200", "date": "2026-01-01", "versions": {"torch": "x"}}
    rows = [row("fla", 1.0), row("flashqla", 0.5), row("gdnkit:t", 0.25),
            row("fla", 2.0, "1x32768", same=False), row("gdnkit:t", 1.0, "1x32768", same=False)]
    md = report.markdown(rows, report.empty_details())
    assert "gdnkit:t vs FLA" in md and "gdnkit:t vs FlashQLA" in md and "flashqla vs FLA" in md
    assert "vs FlashInfer" not in md   # no such rows
    assert "| 2 | 8 | 1x2048 | 1.000 | 0.5000 | 0.2500 | 2.00x | 4.00x | 2.00x |" in md
    assert "2.000*" in md  # a cached anchor is marked
    # a live anchor row whose gdnkit row a later run replaced (that row says its anchors are another run's)
    later = report.markdown([row("fla", 1.0), row("flashqla", 0.5), row("gdnkit:t", 0.25, same=False)],
                            report.empty_details())
    assert "| 2 | 8 | 1x2048 | 1.000* | 0.5000* | 0.2500 |" in later
    assert "**2.83x**" in md  # geomean of 4x and 2x
    assert report.chart(rows, tmp_path / "c.png") and (tmp_path / "c.png").stat().st_size > 1000


def test_resolve_implementations():
    names = [i.name for i in impls.resolve("all", "cpu")]
    assert names[:3] == ["fla", "flashqla", "flashinfer"] and "gdnkit:reference" in names
    assert [i.name for i in impls.resolve("gdnkit:reference,flashinfer,fla", "cpu")] == [
        "fla", "flashinfer", "gdnkit:reference"]
    with pytest.raises(ValueError):
        impls.resolve("flashattention", "cpu")
    assert impls.gpu_slug("NVIDIA H200") == "h200" and impls.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert impls.FlaImpl().unavailable("cpu") and impls.FlashQLAImpl().unavailable("cpu")
    assert impls.FlashInferImpl().unavailable("cpu")


class _FlashInferStandIn:
    """FlashInfer's documented GDN conventions, computed by a plain float64 recurrence written here: packed
    [T, H, D] inputs, g as the decay factor, V-major states [.., HV, V, K], and the decode's raw gate inputs
    (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)) on a pool read at one set of slots and written at
    another. What the adapter must turn the harness's FLA-layout inputs into, and back."""

    @staticmethod
    def _walk(q, k, v, alpha, beta, M, scale):
        """One sequence: q, k [T, H, K], v [T, HV, V], alpha/beta [T, HV], M [HV, V, K]; returns o, M."""
        HV, group = v.shape[1], v.shape[1] // q.shape[1]
        o = torch.empty(v.shape, dtype=torch.float64)
        for t in range(q.shape[0]):
            for h in range(HV):
                kt, qt = k[t, h // group], q[t, h // group]
                M[h] = alpha[t, h] * M[h]
                u = beta[t, h] * (v[t, h] - M[h] @ kt)
                M[h] = M[h] + torch.outer(u, kt)
                o[t, h] = scale * (M[h] @ qt)
        return o, M

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False):
        assert q.dim() == 3 and g.dtype == torch.float32 and bool((g > 0).all() and (g <= 1).all())
        d = lambda x: x.double()  # noqa: E731
        HV, V, K = v.shape[1], v.shape[2], k.shape[2]
        scale = K ** -0.5 if scale is None else scale
        o = torch.empty(v.shape, dtype=torch.float64)
        cu = cu_seqlens.tolist()
        states = torch.empty(len(cu) - 1, HV, V, K, dtype=torch.float64)
        for n in range(len(cu) - 1):
            s = slice(cu[n], cu[n + 1])
            M = torch.zeros(HV, V, K, dtype=torch.float64) if initial_state is None else d(initial_state[n]).clone()
            o[s], states[n] = self._walk(d(q[s]), d(k[s]), d(v[s]), d(g[s]), d(beta[s]), M, scale)
        o = o.to(q.dtype)
        return (o, states.float()) if output_final_state else o

    def gated_delta_rule_decode_pretranspose(self, q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None,
                                             use_qk_l2norm=True, initial_state=None, initial_state_indices=None,
                                             output_state_indices=None, intermediate_states_buffer=None,
                                             disable_state_update=False, backend="auto"):
        assert state is None and a.dtype == b.dtype == torch.bfloat16 and backend == "flashinfer"
        given = dict(q=q, k=k, v=v, A_log=A_log, a=a, dt_bias=dt_bias, b=b, output=output,
                     initial_state=initial_state, initial_state_indices=initial_state_indices,
                     output_state_indices=output_state_indices, intermediate_states_buffer=intermediate_states_buffer)
        misaligned = [n for n, t in given.items() if t is not None and t.data_ptr() % 16]
        assert not misaligned, f"its kernels take 16-byte aligned tensors only: {misaligned}"
        T = q.shape[1]
        assert (T > 1) == (intermediate_states_buffer is not None) == disable_state_update
        g = -torch.exp(A_log.double()) * F.softplus(a.double() + dt_bias.double())
        beta = torch.sigmoid(b.double())
        K = k.shape[-1]
        for i in range(q.shape[0]):
            M = initial_state[initial_state_indices[i]].double().clone()
            for t in range(T):
                s = slice(t, t + 1)
                o, M = self._walk(q[i, s].double(), k[i, s].double(), v[i, s].double(), g[i, s].exp(), beta[i, s],
                                  M, K ** -0.5 if scale is None else scale)
                output[i, t] = o[0].to(output.dtype)
                if intermediate_states_buffer is not None:
                    intermediate_states_buffer[i, t] = M.to(intermediate_states_buffer.dtype)
            if not disable_state_update:
                slot = initial_state_indices[i] if output_state_indices is None else output_state_indices[i]
                initial_state[slot] = M.to(initial_state.dtype)
        return output, initial_state


def test_flashinfer_adapter_converts_to_its_conventions_and_back(monkeypatch):
    """The FlashInfer adapter against a stand-in that keeps FlashInfer's documented conventions: its prefill
    and decode results, read back in FLA's layout, are gdnkit's reference results (decode within the bf16 rounding
    of its raw gate inputs); decode calls repeat exactly and never write the harness's state."""
    import sys
    import types
    stand_in = _FlashInferStandIn()
    for name in ("flashinfer.gdn_prefill", "flashinfer.gdn_decode"):
        module = types.ModuleType(name)
        for fn in ("chunk_gated_delta_rule", "gated_delta_rule_decode_pretranspose"):
            setattr(module, fn, getattr(stand_in, fn))
        monkeypatch.setitem(sys.modules, name, module)
    fi, ref = impls.FlashInferImpl(), impls.GdnkitImpl("reference")
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731

    inp = inputs.make_chunk_inputs(1, 2, (3, 6), 128, 128, "cpu", seed=5, initial_state=True)
    o, state = fi.chunk(inp, output_final_state=True)
    o_ref, state_ref = ref.chunk(inp, output_final_state=True)
    assert o.shape == o_ref.shape and state.shape == state_ref.shape
    assert rel(o, o_ref) < 1e-2 and rel(state, state_ref) < 1e-5
    assert fi.chunk(inp)[1] is None

    dec = inputs.make_decode_inputs(3, 1, 2, 128, 128, "cpu", seed=6)
    h0 = dec.initial_state.clone()
    o, state = fi.decode(dec)
    o_ref, state_ref = ref.decode(dec)
    assert rel(o, o_ref) < 1e-2 and rel(state, state_ref) < 1e-2
    o2, state2 = fi.decode(dec)
    assert torch.equal(o, o2) and torch.equal(state, state2) and torch.equal(dec.initial_state, h0)
    point = grids.Point("bwd", 1, 2, (64,), K=128, V=128)
    assert fi.skip_reason(point) == impls.FlashInferImpl.NO_BACKWARD

    verify = inputs.make_decode_inputs(2, 1, 2, 128, 128, "cpu", seed=7, T=3)
    o, states = fi.mtp(verify)
    o_ref, states_ref = runner.accuracy.reference_outputs(verify, "mtp")
    assert o.shape == (2, 3, 2, 128) and states.shape == (2, 3, 2, 128, 128)
    assert rel(o, o_ref) < 1e-2 and rel(states, states_ref) < 1e-2
    assert torch.equal(fi.mtp(verify)[0], o)                  # the pool is left as it was: calls repeat exactly


def test_bf16_state_decode_updates_each_implementations_own_pool(monkeypatch):
    """--state-dtype bfloat16: decode states in bf16, which gdnkit updates in a pool of its own in place (the
    serving call), each state stored [V, K] as FlashInfer's, and returned [K, V] as a view; equal to the fp32-state
    call on the same values within bf16; FLA, which takes no pool, is skipped; rows and files say the state dtype."""
    monkeypatch.setenv(inputs.STATE_DTYPE_ENV, "bfloat16")
    point = Point("decode", 1, 2, (1,) * 3, B=3, K=16, V=16)
    inp = inputs.make_point_inputs(point, "cpu")
    assert inp.initial_state.dtype == torch.bfloat16
    assert inputs.state_bytes(point) == 3 * 2 * 16 * 16 * 2 and inputs.state_dtype_name(point) == "bfloat16"
    assert inputs.state_dtype_name(Point("fwd", 1, 2, (8,), K=16, V=16)) == "float32"
    h0 = inp.initial_state.clone()
    (ours,) = impls.resolve("gdnkit:reference", "cpu")
    o, pool = ours.decode(inp)
    assert pool.dtype == torch.bfloat16 and torch.equal(inp.initial_state, h0)   # the harness's state untouched
    assert pool.shape == h0.shape and pool.transpose(-1, -2).is_contiguous()       # stored [V, K]
    monkeypatch.setenv(inputs.STATE_DTYPE_ENV, "float32")
    dense = dataclasses.replace(inp, initial_state=h0.float())
    o32, h32 = ours.decode(dense)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    assert rel(o, o32) < 1e-2 and rel(pool, h32) < 1e-2
    monkeypatch.setenv(inputs.STATE_DTYPE_ENV, "bfloat16")
    verify = inputs.make_decode_inputs(2, 1, 2, 16, 16, "cpu", seed=7, T=3)   # a verify on the [V, K] pool too
    assert verify.initial_state.dtype == torch.bfloat16
    o_v, states = ours.mtp(verify)
    o_ref, states_ref = runner.accuracy.reference_outputs(verify, "mtp")
    assert states.shape == (2, 3, 2, 16, 16) and rel(o_v, o_ref) < 1e-2 and rel(states, states_ref) < 1e-2
    _, pool2 = ours.decode(inp)
    assert pool2.data_ptr() == pool.data_ptr() and not torch.equal(pool2, h0)   # one pool, updated in place
    assert impls.FlaImpl().skip_reason(point) == impls.FlaImpl.NO_POOL and impls.FlaImpl().skip_reason(
        Point("fwd", 1, 2, (8,), K=16, V=16)) is None
    decode_only = Grid("small-decode", (SMALL.points[-1],), accuracy_seqlens=(1, 5), accuracy_decode_B=2)
    out, _ = run_small([impls.GdnkitImpl("reference")], grid=decode_only)
    assert {r["state_dtype"] for r in out.rows} == {"bfloat16"}
    assert "Decode (one token, bf16 pool state)" in report.markdown(out.rows, report.empty_details())
    monkeypatch.setenv(inputs.STATE_DTYPE_ENV, "float16")
    with pytest.raises(ValueError, match="GDNKIT_BENCH_STATE_DTYPE"):
        inputs.decode_state_dtype()


def test_short_sequences_table_names_the_faster_form(tmp_path):
    """benchmarks/short_sequences.py: its table says which of the chunked and token-by-token forms was faster at
    each length (the crossover dispatch.SHORT_SEQUENCE should sit at), and it needs a GPU to measure."""
    from gdnkit.benchmarks import short_sequences
    rows = [dict(heads="16/64", length=8, sequences=4096, chunked_ms=12.0, recurrent_ms=1.5, auto_ms=1.5,
                 auto_form="recurrent"),
            dict(heads="16/64", length=256, sequences=128, chunked_ms=1.2, recurrent_ms=9.0, auto_ms=1.2,
                 auto_form="chunk", flashinfer_ms=None)]
    md = short_sequences.markdown(rows, "NVIDIA H100")
    assert "| 16/64 | 8 | 4096 | 12.0000 | 1.5000 | 1.5000 | — | recurrent | recurrent |" in md
    assert "| 16/64 | 256 | 128 | 1.2000 | 9.0000 | 1.2000 | — | chunk | chunked |" in md
    if not torch.cuda.is_available():
        assert short_sequences.main([str(tmp_path)]) == 2


def test_mtp_pass_times_a_verify_and_checks_every_tokens_state(monkeypatch):
    """The mtp pass: T draft tokens a sequence from its state, every token's state kept (gdnkit's serving verify
    on a pool of its own), checked against a float64 run token by token; anchors without a verify are skipped."""
    monkeypatch.delenv(inputs.STATE_DTYPE_ENV, raising=False)
    point = Point("mtp", 1, 2, (3,) * 2, B=2, K=16, V=16)
    inp = inputs.make_point_inputs(point, "cpu")
    assert inp.q.shape == (2, 3, 1, 16) and inputs.state_traffic_bytes(point) == 4 * inputs.state_bytes(point)
    (ours,) = impls.resolve("gdnkit:reference", "cpu")
    o, states = ours.mtp(inp)
    o_ref, states_ref = runner.accuracy.reference_outputs(inp, "mtp")
    assert runner.accuracy.rel_l2(o, o_ref) < 1e-2 and runner.accuracy.rel_l2(states, states_ref) < 1e-5  # o: bf16
    assert impls.FlaImpl().skip_reason(point) == impls.FlaImpl.NO_VERIFY
    assert impls.FlashQLAImpl().skip_reason(point) == impls.FlashQLAImpl.NO_DECODE
    grid = Grid("small-mtp", (point,), accuracy_seqlens=(1, 5), accuracy_decode_B=2)
    out, logs = run_small([impls.GdnkitImpl("reference"), FakeImpl()], grid=grid)
    rows = {r["impl"]: r for r in out.rows}
    assert set(rows) == {"gdnkit:reference"} and rows["gdnkit:reference"]["rel_err_vs_ref"] < 1e-2, logs
    assert "Verify (draft tokens a sequence" in report.markdown(out.rows, report.empty_details())


def test_pool_prefill_study_runs_its_three_ways(tmp_path):
    """benchmarks/pool_prefill.py on the CPU (reference backend, tiny sizes): the plain prefill, the prefill on the
    pool and gather + prefill + scatter each time a call, and the table puts them side by side."""
    from gdnkit.benchmarks import pool_prefill
    row = pool_prefill.measure(1, 2, 8, 2, torch.bfloat16, device="cpu")
    assert all(row[f"{way}_ms"] > 0 for way in ("plain", "pool", "gather_scatter")), row
    assert row["plain_backend"] == row["pool_backend"] == "reference"
    md = pool_prefill.markdown([row], "cpu")
    assert "| 1/2 | 8x2 | bfloat16 |" in md and "(reference)" in md
    if not torch.cuda.is_available():
        assert pool_prefill.main([str(tmp_path)]) == 2


def test_a_study_writes_its_rows_and_table(tmp_path, capsys):
    """report.write_study: the studies' one way of leaving results (json with meta and rows, the markdown table,
    printed too); grids.parse_heads: their --heads."""
    report.write_study(tmp_path / "s", "study", [{"a": 1}], "| a |\n", gpu="X")
    assert json.loads((tmp_path / "s" / "study.json").read_text()) == {"gpu": "X", "rows": [{"a": 1}]}
    assert (tmp_path / "s" / "study.md").read_text() == "| a |\n" and "| a |" in capsys.readouterr().out
    assert grids.parse_heads("4x8, 16X32") == [(4, 8), (16, 32)]


def test_host_time_study_splits_a_call_into_its_layers(tmp_path):
    """benchmarks/host_time.py on the CPU (the reference backend): every call kind gets host and wall times, and
    gdnkit's rows the cumulative time of its layers, each inside the whole call, and the functions with the most
    own time; an unknown call kind is refused."""
    import json

    from gdnkit.benchmarks import host_time
    host_time.main([str(tmp_path), "--heads", "1x2", "--tokens", "64", "--batch", "2", "--impls", "gdnkit:reference",
                    "--repeats", "3", "--device", "cpu"])
    rows = json.loads((tmp_path / "host_time.json").read_text())["rows"]
    assert [r["call"] for r in rows] == list(host_time.CALLS) and not any("error" in r for r in rows)
    for r in rows:
        assert 0 < r["enqueue_ms"] <= r["wall_ms"] * 1.5
        layers = r["layers_us"]
        public = layers["public call (decode)" if r["call"] == "decode" else "public call"]
        assert {"validation", "dispatch"} <= set(layers) and all(0 < us <= layers["whole call"] * 1.01
                                                                  for us in layers.values())
        assert layers["validation"] < public and layers["dispatch"] < public
        assert r["top_functions"] and r["top_functions"][0]["own_us"] >= r["top_functions"][-1]["own_us"]
    assert "| layer | cumulative us |" in (tmp_path / "host_time.md").read_text()
    with pytest.raises(SystemExit):
        host_time.main([str(tmp_path), "--calls", "prefill"])
