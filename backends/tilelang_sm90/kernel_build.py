"""Building the TileLang kernels a call needs, all at once in parallel processes, the first time it needs them.

Each kernel is specialised on (H, HV, dtype) and a few flags and compiles in 2-40 s; a first training call at a
new head configuration needs ~15 of them, which one process used to compile one after another (minutes). Here:

- Every factory of forward.py / backward.py is a `kernel_factory`: it caches its kernel in the process, and once
  a kernel is compiled (here or in any process) leaves a marker beside TileLang's disk cache (TILELANG_CACHE_DIR),
  so a later process knows the kernel loads from disk instead of compiling.
- `first_call` runs a call with factories that raise NotBuilt instead of compiling a kernel that has no marker.
  When one does, it runs the call again "dry": TileLang launches are no-ops and every factory only records what it
  was asked for (the Triton and PyTorch work around them still runs, on real inputs and scratch buffers whose
  values only ever feed values, never addresses). A training forward's dry run takes its backward too (with and
  without a final-state gradient), so one build serves the whole step. Each kernel the dry run asks for that has
  no marker starts building at once, in a worker process (all cores by default; GDNKIT_BUILD_WORKERS), while the
  dry run goes on to the Triton compiles after it; one progress line on stderr. Then the call waits for the builds
  and runs for real, its kernels loaded from the disk cache; or, called with defer (an auto-dispatched forward:
  Backend.chunk_forward_unless_building), it raises KernelsBuilding at once and the caller runs a stand-in backend
  (triton_generic) while the builds go on in the background; so does every later call that needs a kernel of that
  build until the whole build has ended (a training step switches over forward and backward together, never a
  forward here with a backward still building). Up to PRESTARTED workers are started when the first NotBuilt is
  raised, so their start (an interpreter importing torch and TileLang, seconds) runs beside the dry run. After the
  dry run, a thread of the calling process (idle but for waiting) imports TileLang and loads each kernel as its
  build ends, and the recorded kernels already on disk at once: a load elaborates the kernel's program and opens its
  library (~1 s), so only the last kernel's load is left after the build.
- Every compile holds a file lock on its kernel's marker: two threads or processes that want the same kernel
  build it once; the second finds the marker and loads.

Workers are fresh interpreters (`python -m <this module>`), never forks or spawns of the caller: a spawn would
re-run the caller's __main__, and a fork would copy its CUDA context. They hide the GPU (compiling needs nvcc,
not a device). Under CUDA graph capture, or with GDNKIT_BUILD_WORKERS=1, a call compiles what it needs itself.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import inspect
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch


class Job(NamedTuple):
    """One kernel: the factory of this package's `module` and the full positional arguments it was called with."""
    module: str      # "forward" or "backward"
    factory: str     # the factory function there
    args: tuple

    def __str__(self) -> str:
        return f"{self.factory}{self.args}"


class NotBuilt(Exception):
    """Raised by a factory inside first_call's first attempt: this kernel would compile now, or a build this
    process started is still building it."""

    def __init__(self, job: Job):
        super().__init__(str(job))
        self.job = job


def _workers_from_environment() -> int:
    value = os.environ.get("GDNKIT_BUILD_WORKERS", "")
    if not value:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"GDNKIT_BUILD_WORKERS must be a positive integer, got {value!r}")
    return int(value)


WORKERS = _workers_from_environment()
# Kernels that compile for tens of seconds: started first, so the build ends soon after the longest.
SLOWEST = ("chunk_grads_kernel", "backward_fused_kernel")

_STRICT, _RECORD = "strict", "record"


class _Mode(threading.local):
    mode: str | None = None        # None: compile what is asked; _STRICT: raise NotBuilt instead; _RECORD: record
    recorded: dict | None = None   # the jobs a dry run asked for, in order
    on_record: Callable[[Job], None] | None = None   # told of each job a dry run asks for, the first time


_mode = _Mode()
_loaded: set[Job] = set()             # kernels this process holds (compiled or loaded from disk)
# What this process did: kernels built by worker processes (and their compile seconds, summed), kernels a call
# compiled itself (no marker: a capture, a single worker, or one a dry run missed) and kernels loaded from disk;
# and where its first calls' time went, summed over them: the dry runs, the builds (from the dry run's end to the
# last kernel built), the loads left after the builds, and the time calls waited for a build to end (resume: a
# call with no stand-in, or a backward).
counts = {"built_by_workers": 0, "worker_seconds": 0.0, "compiled_in_call": 0, "loaded_from_disk": 0,
          "dry_run_seconds": 0.0, "build_seconds": 0.0, "load_wait_seconds": 0.0, "resume_wait_seconds": 0.0}
# Every factory by (module, name): what a Job names, for loading it ahead of its call (_Preloader).
_FACTORIES: dict[tuple[str, str], Callable] = {}
_build_lock = threading.Lock()        # one dry run at a time in a process; guards _pending and _failed
_pending: dict[Job, "_Build"] = {}    # kernels a build this process started is building, until all of its end
_failed: set[Job] = set()             # kernels whose build failed: a call compiles them itself (and says why)


_NOTHING = (None, None)


def _no_launch(*args, **kwargs) -> None:
    """What a factory returns during a dry run: the call's launch does nothing."""


def launcher(kernel):
    """What a launch of `kernel` calls: a TileLang kernel's TVM-FFI executable itself, where TileLang's torch wrapper
    (`JITKernel.__call__` -> the adapter's `func`) would only count the arguments and pass them on, as for every
    kernel here: none has outputs for the wrapper to allocate (no out_idx) and the device is CUDA (the wrapper's
    only device work is for NPUs). The wrapper is ~8 us of Python a launch on the 2-core development CPU (the
    executable stubbed out; 0.4 us calling it directly: docs/performance.md, host time), paid ~3 times an eager forward and ~10 times a training
    step. Anything else (another execution backend or TileLang version without these attributes, a test's
    stand-in) is returned as it is. The executable checks the argument count and types itself; its owner (the
    JITKernel) must stay alive while it is used (kernel_factory keeps it)."""
    adapter = getattr(kernel, "adapter", None)
    get_executable = getattr(adapter, "_get_executable", None)
    if (type(adapter).__name__ != "TVMFFIKernelAdapter" or get_executable is None
            or getattr(adapter, "result_idx", None) != []
            or getattr(adapter, "_ffi_callee_allocated_output_abi", False)):
        return kernel
    return get_executable()


def kernel_factory(fn: Callable) -> Callable:
    """fn(*args) -> kernel, cached per arguments, recorded in dry runs and built under its marker's lock."""
    module = fn.__module__.rsplit(".", 1)[-1]
    signature = inspect.signature(fn)
    kernels: dict = {}   # the call's own arguments -> (build, kernel): what every launch after the first looks up
    by_job: dict = {}    # Job -> (build, kernel): every kernel this process holds, whoever asked for it first
    owners: dict = {}    # Job -> what build returned, where kernel is its launcher (it owns the executable)

    def obtain(job: Job):
        """job's kernel: held, else loaded from disk or compiled (under its marker's lock), once per process."""
        # A kernel of a build still under way counts as missing even where it is built already: a training
        # forward must not run here while its backward's kernels are still building.
        if _mode.mode == _STRICT and (job in _pending or (job not in _loaded and not is_built(job))):
            raise NotBuilt(job)
        built_by, kernel = by_job.get(job, _NOTHING)
        if built_by is factory.uncached:
            return kernel
        build = factory.uncached
        with _marker_lock(job):
            built_by, kernel = by_job.get(job, _NOTHING)
            if built_by is build:            # another thread of this process got it meanwhile
                return kernel
            from_disk = is_built(job)
            built = build(*job.args)
            kernel = launcher(built)
            owners[job] = built
            counts["loaded_from_disk" if from_disk else "compiled_in_call"] += 1
            _mark_built(job)
            by_job[job] = (build, kernel)
        _loaded.add(job)
        return kernel

    @functools.wraps(fn)
    def factory(*args, **kwargs):
        key = (args, tuple(kwargs.items())) if kwargs else args
        built_by, kernel = kernels.get(key, _NOTHING)
        if built_by is not factory.uncached:   # a stand-in put in its place (tests), or back: not this kernel
            kernel = None
        elif _mode.mode is not _RECORD:         # every launch after the first (first_call's included): a lookup
            return kernel
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        job = Job(module, fn.__name__, tuple(bound.arguments.values()))
        if _mode.mode == _RECORD:
            if job not in _mode.recorded:
                _mode.recorded[job] = None
                if _mode.on_record is not None:
                    _mode.on_record(job)
            return _no_launch
        if kernel is None:
            kernel = obtain(job)
            kernels[key] = (factory.uncached, kernel)
        return kernel

    def cache_clear() -> None:
        for job in [j for j in _loaded if j.module == module and j.factory == fn.__name__]:
            _loaded.discard(job)
        kernels.clear()
        by_job.clear()
        owners.clear()

    factory.uncached = fn            # what compiles (tests put stand-ins here, under the caching and recording)
    factory.obtain = obtain
    factory.cache_clear = cache_clear
    _FACTORIES[(module, fn.__name__)] = factory
    return factory


@functools.lru_cache(maxsize=None)
def jitted(module: str):
    """tilelang.jit over the program `module`.py of this package defines as `<module>_program`, made at its first
    use (importing the factories needs no tilelang): a wrapper costs ~0.7 s (it reads the program's source), and a
    call or a build worker needs only the programs of its own kernels."""
    import tilelang

    from .forward import TARGET
    owner = importlib.import_module(f"{__spec__.parent}.{module}")
    return tilelang.jit(getattr(owner, f"{module}_program"), target=TARGET, pass_configs=owner.PASS_CONFIGS)


# ---- markers: which kernels TileLang's disk cache holds ----

def cache_dir() -> Path:
    """TileLang's disk cache (tilelang.env's rule, read without importing tilelang)."""
    return Path(os.environ.get("TILELANG_CACHE_DIR") or Path.home() / ".tilelang" / "cache")


def kernel_sources() -> list[Path]:
    """The files the kernels are made from: the modules that write TileLang programs (they import
    tilelang.language) and the modules of this package those import. Host-side files (planning, this one) are not
    among them, so editing those keeps every marker: a marker only says TileLang's disk cache holds the kernel,
    and TileLang keys that cache on the program itself, so a stale marker costs a compile in the call, never a
    wrong kernel."""
    here = Path(__file__).parent
    programs = [p for p in sorted(here.glob("*.py"))
                if re.search(r"^import tilelang\.language", p.read_text(), re.MULTILINE)]
    imported = {m for p in programs for m in re.findall(r"^from \.(\w+) import", p.read_text(), re.MULTILINE)}
    return sorted({*programs, *(here / f"{m}.py" for m in imported if (here / f"{m}.py").exists())})


@functools.lru_cache(maxsize=None)
def _build_identity() -> str:
    """What else a compiled kernel depends on: the kernel sources (kernel_sources) and the TileLang version."""
    from importlib import metadata
    digest = hashlib.sha256()
    for path in kernel_sources():
        digest.update(path.name.encode() + path.read_bytes())
    try:
        digest.update(metadata.version("tilelang").encode())
    except metadata.PackageNotFoundError:
        pass
    return digest.hexdigest()


def _marker(job: Job) -> Path:
    key = hashlib.sha256(f"{job}|{_build_identity()}".encode()).hexdigest()[:40]
    return cache_dir() / "gdnkit-built" / key


def is_built(job: Job) -> bool:
    """Whether some process compiled this kernel into the disk cache (TileLang's cache switched off: never)."""
    return os.environ.get("TILELANG_DISABLE_CACHE", "0") in ("0", "") and _marker(job).exists()


def _mark_built(job: Job) -> None:
    marker = _marker(job)
    with contextlib.suppress(OSError):   # a read-only cache: the kernel still runs, later processes compile again
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(job) + "\n")


@contextlib.contextmanager
def _marker_lock(job: Job):
    """An exclusive lock on the kernel's marker file, across threads and processes (no lock where none can be
    taken: a read-only cache, or no fcntl)."""
    try:
        import fcntl
        path = _marker(job).with_suffix(".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---- the first call ----

def first_call(call: Callable, dry_run: Callable[[], None], what: Callable[[], str], defer: bool = False):
    """call(), with the kernels it needs that no process has built built first, in parallel (module doc). dry_run
    makes every launch the call can make (for a training forward, its backward's too); what() names the call in
    the progress line (asked only when something is built: every call passes here). defer: where kernels the
    call needs are being built (by this call's dry run or an earlier call's), raise KernelsBuilding at once (its
    resume() waits for them and runs the call) instead of waiting."""
    if WORKERS < 2 or _mode.mode is not None or _capturing():
        return call()
    _mode.mode = _STRICT
    try:
        return call()
    except NotBuilt as missing:
        job = missing.job
    finally:
        _mode.mode = None
    with _build_lock:
        build = _pending.get(job)
        started_here = build is None and job not in _failed
        if started_here:
            build = _Build.start(dry_run, what)
    if build is None:   # the dry run found every kernel built meanwhile, or this one failed to build before
        return call()
    resume = functools.partial(_resume, build, call, dry_run, what)
    if not defer:
        return resume()
    from gdnkit.dispatch import KernelsBuilding
    raise KernelsBuilding(build.what, resume, first=started_here)


def _resume(build: "_Build", call: Callable, dry_run: Callable[[], None], what: Callable[[], str]):
    """call() once `build` has ended, through first_call again: a kernel the call needs that another call's build
    did not cover (a training call meeting an inference call's build) is built in parallel too, not compiled in
    the call."""
    begun = time.monotonic()
    build.done.wait()
    counts["resume_wait_seconds"] += time.monotonic() - begun
    return first_call(call, dry_run, what)


def building() -> list[str]:
    """What each kernel being built in the background belongs to (its build's progress-line name), one entry a
    kernel: empty when nothing is being built."""
    with _build_lock:
        return [build.what for build in _pending.values()]


def wait_for_builds(timeout: float | None = None) -> bool:
    """Waits for every build this process has started (first calls that ran on a stand-in meanwhile) to end;
    False where `timeout` seconds passed first."""
    with _build_lock:
        builds = set(_pending.values())
    deadline = None if timeout is None else time.monotonic() + timeout
    return all(b.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic())) for b in builds)


class _Build:
    """The kernels one first call's dry run found unbuilt, built in worker processes and loaded into this process
    by a thread of it (`_Builds`, `_Preloader`), while the call that started them and any later one that needs
    them runs elsewhere or waits (`_resume`). Its kernels stay in _pending until the last of them is built."""

    def __init__(self, what: str, jobs: list[Job]):
        self.what, self.jobs = what, jobs
        self.done = threading.Event()

    @classmethod
    def start(cls, dry_run: Callable[[], None], what: Callable[[], str]) -> "_Build | None":
        """Runs the dry run (the caller holds _build_lock) and starts building what it found unbuilt; None where
        it found nothing to build."""
        started = _started_workers(min(WORKERS, PRESTARTED))   # they import while the dry run runs
        preloader = _Preloader()
        builds = _Builds(what, started, preloader.built)
        try:
            begun = time.monotonic()
            jobs = recorded_jobs(dry_run, builds.record)
            counts["dry_run_seconds"] += time.monotonic() - begun
            # started after the dry run, which would otherwise share the interpreter with its imports
            preloader.start([j for j in jobs if j not in builds.submitted and j not in _loaded and is_built(j)])
        except BaseException:
            _end(builds, started, preloader)
            raise
        submitted = [j for j in jobs if j in builds.submitted]
        if not submitted:   # (the dry run missed the kernel, or another process built them all meanwhile)
            _end(builds, started, preloader)
            return None
        build = cls(builds.what, submitted)
        for job in submitted:
            _pending[job] = build
        threading.Thread(target=build._finish, args=(builds, started, preloader), daemon=True,
                         name="gdnkit-kernel-build-finish").start()
        return build

    def _finish(self, builds: "_Builds", started: list, preloader: "_Preloader") -> None:
        """In the background: the builds ended (`_end`), then this build's kernels released from _pending."""
        try:
            _end(builds, started, preloader)
        finally:
            with _build_lock:
                for job in self.jobs:
                    _pending.pop(job, None)
                    if not is_built(job):
                        _failed.add(job)
            self.done.set()


def _end(builds: "_Builds", started: list, preloader: "_Preloader") -> None:
    """Waits for the builds, stops the started workers no job took and waits for the preloader's last load. Takes
    no lock: it also runs inside _Build.start, whose caller holds _build_lock."""
    begun = time.monotonic()
    try:
        builds.finish()
        counts["build_seconds"] += time.monotonic() - begun
    finally:
        for process in started:   # those no job needed
            _stop(process)
        begun = time.monotonic()
        preloader.finish()
        counts["load_wait_seconds"] += time.monotonic() - begun


class _Builds:
    """The first call's builds: each kernel a dry run records (`record`) that no process has built goes at once
    to a thread of its own, which builds it in a worker process (a pre-started one while any is left), at most
    WORKERS at a time; built(job) as each ends well; `finish` waits for them all."""

    def __init__(self, what: Callable[[], str], started: list, built: Callable[[Job], None]):
        self._what, self._started, self._built = what, started, built
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max(1, WORKERS))
        self._threads: list[threading.Thread] = []
        self.submitted: set[Job] = set()
        self._progress: _Progress | None = None

    @functools.cached_property
    def what(self) -> str:
        return self._what()

    def record(self, job: Job) -> None:
        if job in self.submitted or job in _loaded or is_built(job):
            return
        self.submitted.add(job)
        if self._progress is None:
            self._progress = _Progress(self.what)
        self._progress.add()
        thread = threading.Thread(target=self._build, args=(job,), name="gdnkit-kernel-build", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _build(self, job: Job) -> None:
        with self._slots:
            with self._lock:
                given = [self._started.pop()] if self._started else []
            for _, seconds, error in build([job], 1, self._report, given):
                with self._lock:
                    counts["built_by_workers"] += error is None
                    counts["worker_seconds"] += seconds

    def _report(self, job: Job, seconds: float, error: str | None) -> None:
        with self._lock:
            self._progress(job, seconds, error)
        if error is None:
            self._built(job)

    def finish(self) -> None:
        for thread in self._threads:
            thread.join()
        if self._progress is not None:
            self._progress.close()


class _Preloader:
    """A thread that imports TileLang, then loads into this process each job handed to it (`built`), in order,
    until `finish`. A job it cannot load is left for the call itself, which loads or compiles it and reports any
    error where it happens."""

    def __init__(self):
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, jobs: list[Job]) -> None:
        """Starts loading: `jobs` first, then those handed to `built` (before or after this)."""
        queued = []
        while not self._jobs.empty():
            queued.append(self._jobs.get())
        for job in [*jobs, *queued]:
            self._jobs.put(job)
        self._thread = threading.Thread(target=self._run, name="gdnkit-kernel-preload", daemon=True)
        self._thread.start()

    def built(self, job: Job) -> None:
        self._jobs.put(job)

    def finish(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            import tilelang  # noqa: F401
        while (job := self._jobs.get()) is not None:
            factory = _FACTORIES.get((job.module, job.factory))
            if factory is not None:
                with contextlib.suppress(Exception):
                    factory.obtain(job)


def _capturing() -> bool:
    """A CUDA graph capture is under way (nothing may compile off the stream's order, nor read back)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def recorded_jobs(dry_run: Callable[[], None], on_record: Callable[[Job], None] | None = None) -> list[Job]:
    """The kernels dry_run's factories ask for, none compiled and nothing launched by TileLang; on_record(job) as
    each is first asked for. A dry run that fails part-way (its scratch values are not real) still yields what it
    asked for until then; the call itself compiles anything it missed."""
    _mode.mode, _mode.recorded, _mode.on_record = _RECORD, {}, on_record
    try:
        dry_run()
    except Exception:  # noqa: BLE001 - the call proper reports any real error
        pass
    finally:
        jobs = list(_mode.recorded)
        _mode.mode, _mode.recorded, _mode.on_record = None, None, None
    return jobs


class _Progress:
    """One line on stderr, rewritten in place on a terminal; elsewhere a line at most every 10 s, and the last (at
    `close`). The kernels to build are counted as the dry run finds them (`add`)."""

    def __init__(self, what: str):
        self.what, self.total, self.done, self.failed = what, 0, 0, 0
        self.start = self.shown = time.monotonic()
        self.tty = sys.stderr.isatty()

    def add(self) -> None:
        self.total += 1
        self._show(force=self.total == 1)

    def __call__(self, job: Job, seconds: float, error: str | None) -> None:
        self.done += 1
        self.failed += error is not None
        self._show()
        if error:
            print(f"gdnkit: building {job} failed ({error[:300]}); the call compiles it itself", file=sys.stderr)

    def close(self) -> None:
        if self.total:
            self._show(force=True, last=True)
            self.total = 0   # closed: a second close prints nothing

    def _show(self, force: bool = False, last: bool = False) -> None:
        now = time.monotonic()
        if not (self.tty or force or now - self.shown >= 10):
            return
        self.shown = now
        line = (f"gdnkit: building {self.total} TileLang kernels for {self.what}: {self.done}/{self.total} "
                f"in {now - self.start:.0f} s")
        end = "\n" if not self.tty or last else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


# Workers started before their jobs are known (first_call): enough for an inference call's kernels and most of a
# training step's; a build that needs more starts the rest then.
PRESTARTED = 4


def _start_worker() -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, bufsize=1)


def _started_workers(n: int) -> list[subprocess.Popen]:
    """n worker processes, importing while the caller goes on; an empty list where they cannot start."""
    started = []
    with contextlib.suppress(OSError):
        for _ in range(n):
            started.append(_start_worker())
    return started


def _stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(OSError, ValueError):
        process.stdin.close()
    process.wait()


def build(jobs: list[Job], workers: int, report: Callable[[Job, float, str | None], None] = lambda *r: None,
          started: list | None = None) -> list[tuple[Job, float, str | None]]:
    """Compiles every job in up to `workers` worker processes, the slowest first, each worker taking the next
    job when it finishes one; report(job, seconds, error) as each ends. Returns (job, seconds, error) per job.
    started: worker processes already running (first_call's), used before any new one; the ones this build takes
    are removed from the list."""
    todo: queue.Queue = queue.Queue()
    for job in sorted(jobs, key=lambda j: j.factory not in SLOWEST):
        todo.put(job)
    results: list[tuple[Job, float, str | None]] = []
    lock = threading.Lock()
    n = max(1, min(workers, len(jobs)))
    given = [started.pop() for _ in range(min(n, len(started or [])))]

    def worker(process: subprocess.Popen | None) -> None:
        process = process or _start_worker()
        try:
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    break
                start = time.monotonic()
                process.stdin.write(json.dumps([job.module, job.factory, list(job.args)]) + "\n")
                process.stdin.flush()
                reply = process.stdout.readline()
                error = json.loads(reply)["error"] if reply else "the build process ended"
                with lock:
                    results.append((job, time.monotonic() - start, error))
                    report(job, time.monotonic() - start, error)
                if not reply:
                    break
        finally:
            _stop(process)

    threads = [threading.Thread(target=worker, args=(given[i] if i < len(given) else None,), daemon=True)
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _serve() -> None:
    """A worker: one JSON job per line on stdin ([module, factory, args]), one reply per line on stdout."""
    package = __spec__.parent
    # replies go to the real stdout; anything a compiler prints goes to stderr, which the parent discards
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # the imports every build needs, done before the first job arrives (first_call starts workers early)
    with contextlib.suppress(Exception):
        import tilelang  # noqa: F401
    for line in sys.stdin:
        module, factory, args = json.loads(line)
        try:
            getattr(importlib.import_module(f"{package}.{module}"), factory)(*args)
            error = None
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which compiles it itself
            error = f"{type(exc).__name__}: {exc}"
        replies.write(json.dumps({"error": error}) + "\n")
        replies.flush()


if __name__ == "__main__":
    _serve()
