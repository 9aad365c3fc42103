"""What this machine can run: GPUs, compute capability, driver/toolkit and compiler versions.

The probe runs once per process and its result is plain data, so tests can inject the machine of any GPU
generation with `use_machine`. It imports no compiler: triton and tilelang are found through their install
metadata (importing them costs ~1 s on a CPU machine that never runs them), and the driver is asked through
libcuda itself. A backend imports its compiler when it first runs.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import importlib.metadata
import importlib.util
import platform
from typing import Iterator

import torch


@dataclasses.dataclass(frozen=True)
class GPU:
    index: int
    name: str
    capability: tuple[int, int]
    sm_count: int
    total_memory_bytes: int

    @property
    def sm(self) -> int:
        """Compute capability as one number, e.g. 90 for Hopper."""
        return self.capability[0] * 10 + self.capability[1]


@dataclasses.dataclass(frozen=True)
class Machine:
    """Everything dispatch needs to know about the host; backends read it in supports()."""

    gpus: tuple[GPU, ...] = ()
    torch_version: str = torch.__version__
    torch_cuda_version: str | None = None  # the CUDA toolkit torch was built with
    cuda_driver_version: str | None = None  # from the driver itself (cuda-python), when reachable
    cuda_driver_error: str | None = None  # why the driver could not be asked
    # Optional compilers: name -> installed version (from its metadata, not imported), or None when it is not
    # installed (the reason in import_errors).
    packages: dict[str, str | None] = dataclasses.field(default_factory=dict)
    import_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    python_version: str = platform.python_version()

    def gpu(self, index: int | None) -> GPU | None:
        for gpu in self.gpus:
            if gpu.index == (index or 0):
                return gpu
        return None

    def has_package(self, name: str) -> bool:
        return self.packages.get(name) is not None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


OPTIONAL_PACKAGES = ("triton", "tilelang")


def _package_version(name: str) -> tuple[str | None, str | None]:
    """(version, None) when the package is installed, else (None, why); imports nothing.

    An installed package that fails to import is found here and fails when its backend first runs, with the
    import's own error."""
    try:
        if importlib.util.find_spec(name) is None:
            return None, "not installed"
    except (ImportError, ValueError) as exc:  # a parent package that cannot be found or a broken spec
        return None, f"{type(exc).__name__}: {exc}".strip()
    try:
        return importlib.metadata.version(name), None
    except importlib.metadata.PackageNotFoundError:
        # importable under another distribution name (e.g. pytorch-triton): installed, version unknown
        return "unknown", None


def _driver_version() -> tuple[str | None, str | None]:
    """The CUDA driver's version, asked of libcuda directly (torch does not expose it; cuDriverGetVersion
    needs no cuInit, so nothing is initialised)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None, "no NVIDIA driver (libcuda.so.1 not found)"
    version = ctypes.c_int(0)
    err = libcuda.cuDriverGetVersion(ctypes.byref(version))
    if err != 0:
        return None, f"cuDriverGetVersion failed (CUresult {err})"
    return f"{version.value // 1000}.{(version.value % 1000) // 10}", None


def _gpus() -> tuple[GPU, ...]:
    if not torch.cuda.is_available():
        return ()
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append(GPU(index=index, name=props.name, capability=(props.major, props.minor),
                        sm_count=props.multi_processor_count, total_memory_bytes=props.total_memory))
    return tuple(gpus)


def probe_machine() -> Machine:
    """Probe the real machine (uncached; `machine()` is the cached entry point)."""
    packages, errors = {}, {}
    for name in OPTIONAL_PACKAGES:
        packages[name], error = _package_version(name)
        if error:
            errors[name] = error
    gpus = _gpus()
    driver, driver_error = _driver_version()
    return Machine(gpus=gpus, torch_cuda_version=torch.version.cuda, cuda_driver_version=driver,
                   cuda_driver_error=driver_error, packages=packages, import_errors=errors)


_injected: list[Machine] = []


@functools.lru_cache(maxsize=1)
def _probed() -> Machine:
    return probe_machine()


def machine() -> Machine:
    """The machine dispatch decides for: an injected one (tests) or the probed one (cached)."""
    return _injected[-1] if _injected else _probed()


def probed_machine() -> Machine:
    """This machine as probed (cached), whatever is injected."""
    return _probed()


@contextlib.contextmanager
def use_machine(fake: Machine) -> Iterator[Machine]:
    """Make dispatch see `fake` instead of the real machine, e.g. an Ada GPU without tilelang."""
    _injected.append(fake)
    try:
        yield fake
    finally:
        _injected.pop()
