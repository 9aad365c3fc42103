"""What this machine can run: GPUs, compute capability, driver/toolkit and compiler versions.

The probe runs once per process (it imports triton/tilelang, which is slow) and its result is
plain data, so tests can inject the machine of any GPU generation with `use_machine`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
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
    # Optional compilers: name -> version, or None when the import failed (reason in import_errors).
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
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # a broken install raises more than ImportError
        return None, f"{type(exc).__name__}: {exc}".strip()
    return str(getattr(module, "__version__", "unknown")), None


def _driver_version() -> tuple[str | None, str | None]:
    """The CUDA driver's version through cuda-python; torch does not expose it.

    Without a driver (CPU machines) cuda-python raises from its library finder rather than
    returning an error code, so every failure is caught and reported as a reason.
    """
    try:
        from cuda.bindings import driver
    except Exception as exc:
        return None, f"cuda-python is not importable ({type(exc).__name__})"
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None, f"cuInit failed: {err.name}"
        err, version = driver.cuDriverGetVersion()
        if err != driver.CUresult.CUDA_SUCCESS:
            return None, f"cuDriverGetVersion failed: {err.name}"
    except Exception as exc:
        return None, f"no NVIDIA driver ({type(exc).__name__})"
    return f"{version // 1000}.{(version % 1000) // 10}", None


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


@contextlib.contextmanager
def use_machine(fake: Machine) -> Iterator[Machine]:
    """Make dispatch see `fake` instead of the real machine, e.g. an Ada GPU without tilelang."""
    _injected.append(fake)
    try:
        yield fake
    finally:
        _injected.pop()
