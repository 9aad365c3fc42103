"""`python -m gdnkit check`: its own float64 recurrence, its verdict (PASS; FAIL with exit code 1 when a backend is
off), and --json / --compare."""
from __future__ import annotations

import json
import math

import pytest
import torch

from gdnkit import check
from gdnkit.__main__ import main
from gdnkit.backends.reference import ReferenceBackend


@pytest.fixture(scope="module")
def report():
    return check.run_check()


def test_the_recurrence_of_one_token_from_zero_state_is_its_closed_form():
    """From S = 0 one token gives S = beta k v^T, so o = scale (q . k) beta v: checks the loop's algebra, layouts
    (GVA head mapping, v-first states) and options without any library code."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 2, 8, generator=gen), torch.randn(1, 1, 2, 8, generator=gen)
    v, g, beta = torch.randn(1, 1, 4, 8, generator=gen), torch.randn(1, 1, 4, generator=gen), torch.rand(1, 1, 4)
    A_log = torch.randn(4, generator=gen)
    o, ht = check.recurrence(dict(q=q, k=k, v=v, g=g, beta=beta, output_final_state=True, use_gate_in_kernel=True,
                                  A_log=A_log, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                  use_qk_l2norm_in_kernel=True, state_v_first=True))
    qn, kn = (x.double() / torch.sqrt((x.double() ** 2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    b = 2 * torch.sigmoid(beta.double())
    for j in range(4):
        kj, qj = kn[0, 0, j // 2], qn[0, 0, j // 2]
        want_o = 8 ** -0.5 * (qj @ kj) * b[0, 0, j] * v[0, 0, j].double()
        assert torch.allclose(o[0, 0, j], want_o, atol=1e-12)
        # v-first: the state comes back [V, K]
        assert torch.allclose(ht[0, j], b[0, 0, j] * torch.outer(v[0, 0, j].double(), kj), atol=1e-12)


def test_reference_passes_every_row_on_cpu(report):
    assert check.verdict_line(report) == "PASS" and report["verdict"] == {"pass": True, "failed": 0, "rows": 36}
    rows = report["rows"]
    assert not [r for r in rows if "skipped" in r or "failure" in r]
    assert {r["case"] for r in rows} == set(report["cases"]) >= {"varlen", "options", "pool", "pool-verify"}
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16", "float16"}
    assert {(r["case"], r["run"]) for r in rows} >= {("varlen", "gradients"), ("options", "gradients")}
    for r in rows:
        assert r["tol"] == check.TOLERANCES[getattr(torch, r["dtype"])][r["run"] == "gradients"]
        assert 0 < r["error"] <= r["tol"], r   # nonzero: the comparison sees the rounding of the row's dtype
    pool = [r for r in rows if r["case"].startswith("pool")]
    assert all("pool" in r["errors"] for r in pool)
    grads = next(r for r in rows if r["case"] == "options" and r["run"] == "gradients")
    assert set(grads["errors"]) == {"dq", "dk", "dv", "dg", "dbeta", "dinitial_state", "dA_log", "ddt_bias"}


def test_a_backend_one_percent_off_fails_with_exit_code_1(monkeypatch, capsys):
    forward = ReferenceBackend.chunk_forward

    def off(self, problem, inputs):
        o, ht, saved = forward(self, problem, inputs)
        return o * 1.01, ht, saved
    monkeypatch.setattr(ReferenceBackend, "chunk_forward", off)
    assert main(["check"]) == 1
    out = capsys.readouterr().out
    # the chunked forward rows (4 cases x 3 dtypes); gradients come from the backward, which is right
    assert out.rstrip().splitlines()[-1] == "FAIL (12 of 36 rows)"
    failed = [line.split() for line in out.splitlines() if line.endswith("FAIL")]
    assert len(failed) == 12 and all(f[3] == "forward" and f[5] == "o" for f in failed)


def test_a_backend_that_raises_fails_its_rows_and_the_others_still_run(monkeypatch):
    def broken(self, problem, inputs):
        raise RuntimeError("kernel exploded")
    monkeypatch.setattr(ReferenceBackend, "recurrent_forward", broken)
    report = check.run_check()
    failed = [r for r in report["rows"] if not r["ok"]]
    assert len(failed) == 12 and all(r["failure"] == "RuntimeError: kernel exploded" for r in failed)
    assert check.verdict_line(report) == "FAIL (12 of 36 rows)"
    assert "kernel exploded" in check.format_report(report)


def test_table_columns_hold_their_cells(report):
    text = check.format_report(report).splitlines()
    header = text[1]
    starts = [header.index(name) for name in ("case", "dtype", "run")]
    for line in text[3:3 + report["verdict"]["rows"]]:
        for s in starts:
            assert line[s - 2:s] == "  ", (line, header)   # every cell ends before the next column starts


def test_json_and_compare_round_trip(report, tmp_path, capsys):
    a = tmp_path / "a.json"
    check.write_json(report, str(a))
    other = json.loads(a.read_text())
    assert other["verdict"]["pass"] and other["machine"]["torch_version"] == torch.__version__
    other["gpu"] = "NVIDIA H200"
    other["rows"][0].update(error=math.inf, worst="o", ok=False)
    other["verdict"] = {"pass": False, "failed": 1, "rows": other["verdict"]["rows"]}
    b = tmp_path / "b.json"
    b.write_text(json.dumps(other))
    assert main(["check", "--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("A: CPU, torch") and "\nB: NVIDIA H200, torch" in out
    first = report["rows"][0]
    line = next(line for line in out.splitlines() if line.startswith("reference") and first["case"] in line)
    assert f"{first['error']:.1e} ({first['worst']})" in line and line.endswith("inf (o)  FAIL")
    assert out.rstrip().endswith("A: PASS   B: FAIL (1 of 36 rows)")
