"""compute-sanitizer over every kernel of the GPU backends (tests/sanitizer_workload.py), one tool and one
workload case per process: memcheck (out-of-bounds and misaligned accesses), racecheck (shared-memory hazards),
synccheck (barrier misuse), initcheck (reads of device memory nothing wrote). Marked gpu and slow: each run
instruments every launch; run them side by side (`-n 8`): one case is what keeps initcheck within its limit. Each
case runs once unsanitized first, so the sanitized run loads built kernels and checks the call itself.

Whether initcheck sees TMA stores (tilelang_sm90's state passes store full chunks of o that way) is checked, not
assumed: each probe case writes one half of a tensor by a TMA tensor store and the other by threads, and torch
reads both (after checking both hold the source). `tma-store-probe` and `-32` store a 64- or 32-column tile of a
3-D tensor from a plain kernel; `-4d` stores the way the 32- and 64-column state pass stores a full chunk of o: a
[1, tokens, heads, V] tensor at a V tile, issued by one elected thread of a warpgroup whose registers setmaxnreg
moved. On the H100's compute-sanitizer (2025.3.1) the first two are clean and `-4d` is reported in full (every byte
of its TMA-stored half, none of the threads'): initcheck misses that store form. Only where a probe is reported
does a tilelang_sm90 case pass with reports, and then only if each report it printed reads an output of the call
(tests/sanitizer_reports.py attributes them), bytes that test_gpu_reliability.py's
`test_every_output_is_written_by_the_kernels` shows the kernels write in full (every buffer poisoned first). A
launch that fills initcheck's record buffer has its further reports dropped unprinted (a notice says so, counted
in the summary); those cannot be attributed.

GDNKIT_SANITIZER_LOGS=<dir> keeps each run's output there (benchmarks/results/<gpu>/reliability.md records them).
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

from sanitizer_reports import parse, table   # tests/ is on sys.path

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WORKLOAD = pathlib.Path(__file__).with_name("sanitizer_workload.py")
TOOLS = ["memcheck", "racecheck", "synccheck", "initcheck"]
# initcheck: torch's caching allocator hands out memory it never wrote (by design); only reads count, and
# only of memory a kernel was given, which --track-unused-memory does not change.
# initcheck prints every report (--print-limit 0), without backtraces, so each one can be attributed.
TOOL_ARGS = {"memcheck": ["--leak-check", "no"], "racecheck": ["--racecheck-report", "hazard"],
             "synccheck": [], "initcheck": ["--print-limit", "0", "--show-backtrace", "no"]}


def _runs() -> list[tuple[str, str]]:
    """(backend, workload case) for every GPU backend here, or one ("none", "none") to skip on."""
    try:
        import gdnkit
        from sanitizer_workload import cases_for   # tests/ is on sys.path (pytest's rootdir-relative import)
        return [(b, case) for b in gdnkit.available_backends() if b != "reference" for case in cases_for(b)]
    except Exception:
        return []


_BUILT: set[tuple[str, str]] = set()


def _built_first(backend: str, case: str) -> None:
    """The case once without the sanitizer, so every kernel it launches is built and on disk before the sanitized
    run: that run then loads them, and takes no first-call dry run (tilelang_sm90's kernel_build), whose launches
    are no-ops and whose Triton and PyTorch work reads scratch no kernel wrote (by design: its values are dropped;
    initcheck would count every such read)."""
    if (backend, case) in _BUILT:
        return
    run = subprocess.run([sys.executable, str(WORKLOAD), backend, case], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "WORKLOAD DONE" in run.stdout, (run.stdout + run.stderr)[-4000:]
    _BUILT.add((backend, case))


def _exe() -> str:
    exe = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    if exe is None:
        pytest.skip("compute-sanitizer is not installed")
    return exe


def _sanitized(tool: str, backend: str, case: str) -> tuple[str, int]:
    """The run's output (stdout and stderr) and exit code. --report-api-errors no: torch and Triton probe the
    driver's entry points (cuGetProcAddress) and expect some lookups to fail; those are API return codes, not
    kernel errors, and would count in the summary."""
    _built_first(backend, case)
    cmd = [_exe(), "--tool", tool, "--error-exitcode", "99", "--report-api-errors", "no", *TOOL_ARGS[tool],
           sys.executable, str(WORKLOAD), backend, case]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    out = run.stdout + run.stderr
    logs = os.environ.get("GDNKIT_SANITIZER_LOGS")
    if logs:
        pathlib.Path(logs).mkdir(parents=True, exist_ok=True)
        pathlib.Path(logs, f"{tool}-{backend}-{case}.log").write_text(out)
    assert "WORKLOAD DONE" in out, out[-4000:]
    return out, run.returncode


PROBES = ("tma-store-probe", "tma-store-probe-32", "tma-store-probe-4d")   # workload cases
_BLIND: dict[str, bool] = {}


def _initcheck_misses_tma_stores() -> list[str]:
    """The probes under initcheck: those whose TMA-stored half initcheck reports as read uninitialized (never the
    threads' half, which would make the probe itself wrong)."""
    for case in PROBES:
        if case not in _BLIND:
            log = parse(_sanitized("initcheck", "tilelang_sm90", case)[0].splitlines())
            read = {where for _, where in log.attributed()}
            assert "by-threads" not in read, table(log)
            _BLIND[case] = "by-tma" in read
    return [case for case in PROBES if _BLIND[case]]


@pytest.mark.parametrize("backend,case", _runs() or [("none", "none")])
@pytest.mark.parametrize("tool", TOOLS)
def test_compute_sanitizer_clean(tool, backend, case):
    if backend == "none":
        pytest.skip("no GPU backend on this machine")
    if case in PROBES:
        if tool != "initcheck":
            pytest.skip("the probe is for initcheck")
        _initcheck_misses_tma_stores()
        return
    out, rc = _sanitized(tool, backend, case)
    # memcheck, synccheck, initcheck: "ERROR SUMMARY: n errors"; racecheck: "RACECHECK SUMMARY: n hazards displayed
    # (e errors, w warnings)"
    summary = re.search(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error", out)
    assert summary is not None, out[-4000:]
    errors = int(summary.group(1) or summary.group(2))
    if errors and tool == "initcheck" and backend == "tilelang_sm90":
        log = parse(out.splitlines())
        assert len(log.reports) + log.overflows == errors, f"{errors} reported, {len(log.reports)} parsed:\n{table(log)}"
        assert _initcheck_misses_tma_stores(), f"initcheck sees TMA stores here, so these reads are real:\n{table(log)}"
        outputs = {"o", "final_state"}
        unexplained = {where for _, where in log.attributed() if where not in outputs and not where.startswith("grad:")}
        assert not unexplained, table(log)
        return
    assert errors == 0 and rc == 0, out[-6000:]
