"""tilelang_sm90's first-call build (backends/tilelang_sm90/kernel_build.py): a call whose kernels no process has
built builds exactly those, once, in worker processes, then runs; later calls and processes load them."""
from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref

import pytest

from gdnkit.backends.tilelang_sm90 import kernel_build
from gdnkit.dispatch import KernelsBuilding
from gdnkit.backends.tilelang_sm90.kernel_build import Job


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_build, "WORKERS", 4)
    monkeypatch.setattr(kernel_build, "_started_workers", lambda n: [])   # the fake builds below start none
    monkeypatch.setattr(kernel_build, "_pending", {})
    monkeypatch.setattr(kernel_build, "_failed", set())
    return tmp_path


def _factories(compiled: list):
    """Two factories whose "kernels" add their arguments into a list; `compiled` logs each compile."""
    @kernel_build.kernel_factory
    def add_kernel(a: int, b: int = 1):
        compiled.append(("add_kernel", a, b))
        return lambda out: out.append(a + b)

    @kernel_build.kernel_factory
    def mul_kernel(a: int, b: int):
        compiled.append(("mul_kernel", a, b))
        return lambda out: out.append(a * b)
    return add_kernel, mul_kernel


def _fake_build(built: list):
    """kernel_build.build's stand-in: "compiles" in this process, as a worker would, leaving the markers."""
    def build(jobs, workers, report=lambda *r: None, started=None):
        built.append(list(jobs))
        for job in jobs:
            kernel_build._mark_built(job)
            report(job, 0.5, None)
        return [(job, 0.5, None) for job in jobs]
    return build


def test_a_first_call_builds_exactly_its_missing_kernels_once(cache, monkeypatch, capsys):
    compiled, built = [], []
    add_kernel, mul_kernel = _factories(compiled)
    monkeypatch.setattr(kernel_build, "build", _fake_build(built))
    module = add_kernel.__module__.rsplit(".", 1)[-1]
    kernel_build._mark_built(Job(module, "mul_kernel", (2, 3)))   # another process built this one already

    def call(x):
        out = []
        add_kernel(x)(out)
        mul_kernel(2, 3)(out)
        if x > 5:
            add_kernel(x, b=x)(out)
        return out

    assert kernel_build.first_call(lambda: call(7), lambda: call(7), lambda: "H=1, HV=2") == [8, 6, 14]
    # a build of each kernel no process had built (a defaulted argument spelt out), and of no other
    assert all(len(b) == 1 for b in built)
    assert sorted(j for b in built for j in b) == [Job(module, "add_kernel", (7, 1)), Job(module, "add_kernel", (7, 7))]
    # the call then compiled (here: loaded) each kernel once, the dry run none
    assert sorted(compiled) == [("add_kernel", 7, 1), ("add_kernel", 7, 7), ("mul_kernel", 2, 3)]
    assert "gdnkit: building 2 TileLang kernels for H=1, HV=2: 2/2" in capsys.readouterr().err
    # a second call: nothing built, nothing compiled
    assert kernel_build.first_call(lambda: call(7), lambda: call(7), lambda: "H=1, HV=2") == [8, 6, 14]
    assert len(built) == 2 and len(compiled) == 3
    # a new process (the factories' caches empty) finds every marker: no build
    add_kernel.cache_clear()
    mul_kernel.cache_clear()
    assert kernel_build.first_call(lambda: call(7), lambda: call(7), lambda: "H=1, HV=2") == [8, 6, 14]
    assert len(built) == 2 and len(compiled) == 6


def test_each_build_starts_while_the_dry_run_goes_on(cache, monkeypatch):
    """A kernel the dry run asks for starts building at once, not after the dry run: here the dry run, after
    asking for its first kernel, waits (up to 10 s) for that kernel's build to have begun."""
    begun = threading.Event()
    built = []

    def build(jobs, workers, report=lambda *r: None, started=None):
        begun.set()
        return _fake_build(built)(jobs, workers, report, started)
    monkeypatch.setattr(kernel_build, "build", build)
    add_kernel, mul_kernel = _factories([])
    seen_during_dry_run = []

    def dry():
        add_kernel(2)
        seen_during_dry_run.append(begun.wait(10))
        mul_kernel(2, 5)

    kernel_build.first_call(lambda: [add_kernel(2), mul_kernel(2, 5)], dry, lambda: "x")
    assert seen_during_dry_run == [True] and len(built) == 2


def test_a_dry_run_compiles_and_launches_nothing(cache):
    compiled = []
    add_kernel, _ = _factories(compiled)
    out = []
    jobs = kernel_build.recorded_jobs(lambda: add_kernel(3)(out))
    assert [j.args for j in jobs] == [(3, 1)] and out == [] and compiled == []


def test_a_dry_run_that_fails_still_yields_what_it_recorded(cache):
    add_kernel, _ = _factories([])

    def dry():
        add_kernel(1)
        raise RuntimeError("scratch values are not real")
    assert [j.args for j in kernel_build.recorded_jobs(dry)] == [(1, 1)]


def test_one_worker_or_a_capture_compiles_in_the_call(cache, monkeypatch):
    compiled, built = [], []
    add_kernel, _ = _factories(compiled)
    monkeypatch.setattr(kernel_build, "build", _fake_build(built))
    monkeypatch.setattr(kernel_build, "WORKERS", 1)
    out = []
    kernel_build.first_call(lambda: add_kernel(4)(out), lambda: add_kernel(4)(out), lambda: "x")
    assert out == [5] and built == [] and compiled == [("add_kernel", 4, 1)]


def test_threads_build_a_kernel_once(cache, monkeypatch):
    compiled, built = [], []
    add_kernel, _ = _factories(compiled)
    gate = threading.Barrier(4)
    monkeypatch.setattr(kernel_build, "build", _fake_build(built))

    def run():
        gate.wait()
        out = []
        kernel_build.first_call(lambda: add_kernel(9)(out), lambda: add_kernel(9)(out), lambda: "x")
        assert out == [10]
    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(len(b) for b in built) == 1   # the others waited for the build lock, then found the marker


def test_markers_depend_on_the_job_and_the_cache(cache, tmp_path_factory, monkeypatch):
    a, b = Job("forward", "intra_chunk_kernel", (4, 8, "bfloat16", False, False)), \
        Job("forward", "intra_chunk_kernel", (4, 8, "bfloat16", True, False))
    kernel_build._mark_built(a)
    assert kernel_build.is_built(a) and not kernel_build.is_built(b)
    monkeypatch.setenv("TILELANG_DISABLE_CACHE", "1")   # nothing on disk: nothing to load
    assert not kernel_build.is_built(a)
    monkeypatch.delenv("TILELANG_DISABLE_CACHE")
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path_factory.mktemp("other")))
    assert not kernel_build.is_built(a)


def test_markers_follow_the_kernel_sources_only():
    """The markers' identity hashes what the kernels are made from: every module that writes a TileLang program
    (a `*_program` function), the helpers those import (sequence_macros, group_sum), and no host-side module, whose
    edits must not send every kernel back to a rebuild."""
    import pathlib
    import re
    names = {p.name for p in kernel_build.kernel_sources()}
    package = pathlib.Path(kernel_build.__file__).parent
    writers = {p.name for p in package.glob("*.py") if re.search(r"^def \w+_program\(", p.read_text(), re.MULTILINE)}
    assert len(writers) >= 9 and writers <= names
    assert {"sequence_macros.py", "group_sum.py"} <= names
    assert not names & {"kernel_build.py", "forward.py", "backward.py", "plan.py", "config.py", "precompile.py",
                        "__init__.py"}


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_build_workers_from_the_environment_are_checked(monkeypatch, value):
    monkeypatch.setenv("GDNKIT_BUILD_WORKERS", value)
    with pytest.raises(ValueError, match="GDNKIT_BUILD_WORKERS"):
        kernel_build._workers_from_environment()


def test_a_build_uses_the_workers_started_before_it(tmp_path, monkeypatch):
    """first_call starts workers before its dry run; the build hands its jobs to those processes (a job that
    cannot build comes back as an error from one of them) and starts no other."""
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    started = kernel_build._started_workers(2)
    assert len(started) == 2
    fresh = []
    monkeypatch.setattr(kernel_build, "_start_worker", lambda: fresh.append(1))
    results = kernel_build.build([Job("forward", "no_such_kernel", (1,))], 4, started=started)
    assert fresh == [] and len(started) == 1      # one job: one of the two taken, the other left to its owner
    assert results[0][2] is not None and "no_such_kernel" in results[0][2]
    kernel_build._stop(started.pop())


@pytest.mark.slow
def test_workers_compile_real_kernels_that_a_process_then_loads(tmp_path):
    """Two real TileLang kernels built by two worker processes (nvcc, no GPU): markers left, and a fresh process's
    factory loads them from the disk cache instead of compiling."""
    pytest.importorskip("tilelang")
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path))
    script = """
import sys
from gdnkit.backends.tilelang_sm90 import kernel_build as kb
jobs = [kb.Job("forward", "propagator_kernel", (1, 2, "float16")),
        kb.Job("forward", "intra_chunk_kernel", (1, 2, "float16", False, False))]
if sys.argv[1] == "build":
    started = kb._started_workers(2)   # as first_call starts them, before the jobs are known
    results = kb.build(jobs, 2, started=started)
    assert not started and all(error is None for _, _, error in results), results
    assert all(kb.is_built(j) for j in jobs)
else:
    from gdnkit.backends.tilelang_sm90 import forward
    forward.propagator_kernel(1, 2, "float16"); forward.intra_chunk_kernel(1, 2, "float16")
    assert kb.counts["loaded_from_disk"] == 2 and kb.counts["compiled_in_call"] == 0, kb.counts
print("ok")
"""
    for step in ("build", "load"):
        out = subprocess.run([sys.executable, "-c", script, step], env=env, capture_output=True, text=True,
                             timeout=900)
        assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_kernels_load_in_a_thread_as_their_builds_end(cache, monkeypatch):
    """While the workers build, a thread of the calling process loads each kernel whose build ended (and those a
    recorded job found on disk), so the call itself loads none; a kernel that thread cannot load is left to the
    call."""
    threads, built = [], []
    monkeypatch.setattr(kernel_build, "build", _fake_build(built))

    @kernel_build.kernel_factory
    def sub_kernel(a: int, b: int):
        threads.append(threading.current_thread().name)
        return lambda out: out.append(a - b)

    @kernel_build.kernel_factory
    def flaky_kernel(a: int):
        threads.append(threading.current_thread().name)
        if threading.current_thread().name == "gdnkit-kernel-preload":
            raise RuntimeError("not in that thread")
        return lambda out: out.append(-a)

    module = sub_kernel.__module__.rsplit(".", 1)[-1]
    kernel_build._mark_built(Job(module, "sub_kernel", (9, 1)))    # on disk already: preloaded at once

    def call():
        out = []
        sub_kernel(5, 2)(out)
        sub_kernel(9, 1)(out)
        flaky_kernel(4)(out)
        return out

    before = dict(kernel_build.counts)
    assert kernel_build.first_call(call, call, lambda: "H=1, HV=2") == [3, 8, -4]
    assert sorted(j for b in built for j in b) == [Job(module, "flaky_kernel", (4,)), Job(module, "sub_kernel", (5, 2))]
    preload = "gdnkit-kernel-preload"
    assert threads.count(preload) == 3            # both sub_kernels and the flaky kernel's failed load
    assert [t for t in threads if t != preload] == [threading.main_thread().name]   # the flaky one, by the call
    assert kernel_build.counts["loaded_from_disk"] - before["loaded_from_disk"] == 3
    assert kernel_build.counts["dry_run_seconds"] > before["dry_run_seconds"]
    assert kernel_build.counts["build_seconds"] > before["build_seconds"]


def _gated_build(built: list, gates: dict):
    """kernel_build.build's stand-in whose build of a job waits for gates[job.factory] (an Event) where there is
    one, then leaves the marker; a job whose factory is in gates as None fails."""
    def build(jobs, workers, report=lambda *r: None, started=None):
        built.append(list(jobs))
        results = []
        for job in jobs:
            gate = gates.get(job.factory, False)
            if gate is None:
                results.append((job, 0.1, "RuntimeError: nvcc failed"))
            else:
                if gate:
                    assert gate.wait(20)
                kernel_build._mark_built(job)
                results.append((job, 0.1, None))
            report(*results[-1])
        return results
    return build


def test_a_deferred_first_call_goes_on_while_its_kernels_build(cache, monkeypatch):
    """With defer, the first call raises KernelsBuilding once its dry run has started the builds, and so does
    every later call that needs them, without a second dry run; resume() waits and runs the call; once built, the
    call runs here with nothing built again."""
    gate, built, dry_runs = threading.Event(), [], []
    monkeypatch.setattr(kernel_build, "build", _gated_build(built, {"add_kernel": gate}))
    add_kernel, mul_kernel = _factories([])

    def call():
        out = []
        add_kernel(3)(out)
        mul_kernel(3, 3)(out)
        return out

    def dry():
        dry_runs.append(1)
        call()

    with pytest.raises(KernelsBuilding) as first:
        kernel_build.first_call(call, dry, lambda: "H=1, HV=2", defer=True)
    assert first.value.first and first.value.what == "H=1, HV=2" and len(dry_runs) == 1
    with pytest.raises(KernelsBuilding) as later:
        kernel_build.first_call(call, dry, lambda: "H=1, HV=2", defer=True)
    assert not later.value.first and len(dry_runs) == 1
    assert not kernel_build.wait_for_builds(timeout=0.05)   # the add kernel's build is held
    assert kernel_build.building() == ["H=1, HV=2"] * 2     # what explain() reports of it
    gate.set()
    assert later.value.resume() == [4, 9]
    assert kernel_build.wait_for_builds(timeout=20)
    assert kernel_build.first_call(call, dry, lambda: "H=1, HV=2", defer=True) == [4, 9]
    assert len(dry_runs) == 1 and sorted(j.factory for b in built for j in b) == ["add_kernel", "mul_kernel"]
    assert kernel_build.building() == []


def test_a_call_waits_for_the_whole_build_it_belongs_to(cache, monkeypatch):
    """A training forward's dry run records its backward's kernels too: while any kernel of that build is still
    building, a call needing only the forward's (built already) is deferred, so forward and backward switch over
    together."""
    gate, built = threading.Event(), []
    monkeypatch.setattr(kernel_build, "build", _gated_build(built, {"mul_kernel": gate}))
    add_kernel, mul_kernel = _factories([])

    def forward():
        out = []
        add_kernel(5)(out)
        return out

    def step():   # the dry run of a training forward: the forward's kernel, then the backward's
        forward()
        mul_kernel(5, 5)([])

    with pytest.raises(KernelsBuilding):
        kernel_build.first_call(forward, step, lambda: "x", defer=True)
    module = add_kernel.__module__.rsplit(".", 1)[-1]
    deadline = time.monotonic() + 20
    while not kernel_build.is_built(Job(module, "add_kernel", (5, 1))):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(KernelsBuilding):   # its own kernel is built, the backward's is not
        kernel_build.first_call(forward, step, lambda: "x", defer=True)
    gate.set()
    assert kernel_build.wait_for_builds(timeout=20)
    assert kernel_build.first_call(forward, step, lambda: "x", defer=True) == [6]


def test_a_kernel_whose_build_failed_is_compiled_by_the_call(cache, monkeypatch, capsys):
    """A failed build is not retried by every later call (no build loop, no endless stand-in): the next call
    compiles the kernel itself, where its error, if any, is raised."""
    compiled, built = [], []
    monkeypatch.setattr(kernel_build, "build", _gated_build(built, {"add_kernel": None}))
    add_kernel, _ = _factories(compiled)

    def call():
        out = []
        add_kernel(6)(out)
        return out

    with pytest.raises(KernelsBuilding):
        kernel_build.first_call(call, call, lambda: "x", defer=True)
    assert kernel_build.wait_for_builds(timeout=20)
    assert "failed (RuntimeError: nvcc failed)" in capsys.readouterr().err
    assert kernel_build.first_call(call, call, lambda: "x", defer=True) == [7]
    assert len(built) == 1 and compiled == [("add_kernel", 6, 1)]


def test_a_call_that_waits_for_another_calls_build_builds_the_rest_in_parallel(cache, monkeypatch):
    """A call that waits (no stand-in) for a build started by another call, whose kernels cover only part of its
    own (an inference call's build, then a training call), then builds what it still lacks through workers, not
    one after another inside the call."""
    gate, built = threading.Event(), []
    monkeypatch.setattr(kernel_build, "build", _gated_build(built, {"add_kernel": gate}))
    add_kernel, mul_kernel = _factories([])

    def inference():
        out = []
        add_kernel(8)(out)
        return out

    def training():
        out = inference()
        mul_kernel(8, 2)(out)
        return out

    with pytest.raises(KernelsBuilding):
        kernel_build.first_call(inference, inference, lambda: "x", defer=True)
    result = []
    waiting = threading.Thread(target=lambda: result.append(kernel_build.first_call(training, training, lambda: "y")))
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive()   # waiting for the inference call's build
    gate.set()
    waiting.join(20)
    assert result == [[9, 16]]
    assert [[j.factory for j in b] for b in built] == [["add_kernel"], ["mul_kernel"]]


def test_a_dry_run_that_finds_nothing_to_build_returns_to_the_call(cache, monkeypatch):
    """The kernel the first attempt missed is not among what the dry run asks for (a dry run can miss one): the
    call then compiles it itself, without deadlocking on the build lock the dry run ran under."""
    compiled, built = [], []
    monkeypatch.setattr(kernel_build, "build", _fake_build(built))
    add_kernel, _ = _factories(compiled)
    out = []
    caller = threading.Thread(target=lambda: kernel_build.first_call(lambda: add_kernel(3)(out), lambda: None,
                                                                     lambda: "x", defer=True), daemon=True)
    caller.start()
    caller.join(20)
    assert not caller.is_alive(), "first_call never returned"
    assert out == [4] and built == [] and compiled == [("add_kernel", 3, 1)]


def test_a_factory_launches_a_tilelang_kernel_through_its_executable(cache):
    """A factory whose build returns a TileLang kernel (an object with a TVM-FFI adapter and no outputs) hands out
    the kernel's executable (kernel_build.launcher) and keeps the kernel that owns it; other kernels as built."""
    class TVMFFIKernelAdapter:   # the attributes launcher reads of TileLang's adapter of that name
        result_idx: list = []

        def __init__(self):
            self.executable = lambda out: out.append("executable")

        def _get_executable(self):
            return self.executable

    class Kernel:
        def __init__(self):
            self.adapter = TVMFFIKernelAdapter()

        def __call__(self, out):
            out.append("wrapper")

    built = []

    @kernel_build.kernel_factory
    def tilelang_like_kernel(n: int):
        built.append(Kernel())
        return built[-1]

    out = []
    tilelang_like_kernel(3)(out)
    tilelang_like_kernel(3)(out)
    assert out == ["executable", "executable"] and len(built) == 1
    owner = weakref.ref(built.pop())
    gc.collect()
    assert owner() is not None, "the factory let go of the kernel that owns the executable it hands out"
    job = Job("test_kernel_build", "tilelang_like_kernel", (3,))
    assert tilelang_like_kernel(3) is tilelang_like_kernel.obtain(job)
