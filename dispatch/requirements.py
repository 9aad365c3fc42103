"""Reasons shared by the GPU backends' unavailable_reasons() and supports(): a compiler package that must
import, and a GPU whose compute capability the backend's kernels are built for. Each backend states its
capability rule once (`accepts`) with the words a user reads when it fails (`needs`)."""
from __future__ import annotations

from typing import Callable

from gdnkit.problem import Problem

from .machine import Machine

Capability = tuple[int, int]


def _cc(capability: Capability) -> str:
    return f"{capability[0]}.{capability[1]}"


def package_reasons(machine: Machine, package: str) -> list[str]:
    if machine.has_package(package):
        return []
    return [f"{package} is not importable ({machine.import_errors.get(package, 'not installed')})"]


def gpu_reasons(machine: Machine, accepts: Callable[[Capability], bool], needs: str) -> list[str]:
    """Machine level: some visible GPU has a capability the kernels accept."""
    if not machine.gpus:
        return ["no CUDA GPU visible"]
    if any(accepts(gpu.capability) for gpu in machine.gpus):
        return []
    return [f"needs {needs}, found " + ", ".join(f"{gpu.name} ({_cc(gpu.capability)})" for gpu in machine.gpus)]


def cuda_tensor_reasons(problem: Problem, machine: Machine, accepts: Callable[[Capability], bool],
                        needs: str) -> list[str]:
    """Problem level: the tensors are CUDA tensors on a GPU the kernels accept."""
    if problem.device_type != "cuda":
        return [f"runs on CUDA tensors, got tensors on {problem.device_type}"]
    gpu = machine.gpu(problem.device_index)
    if gpu is not None and not accepts(gpu.capability):
        return [f"needs {needs}, the tensors are on {gpu.name} ({_cc(gpu.capability)})"]
    return []
