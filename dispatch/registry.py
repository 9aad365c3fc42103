"""The backend contract and the registry of backends.

A backend is an object with a name, a priority, what it takes as data (`support`, dispatch/support.py) and three
kinds of method:
  - `unavailable_reasons(machine)`: why it cannot run on this machine at all (package missing, no GPU);
  - `supports(problem, machine)`: why it cannot take this problem (plain-language reasons, empty = yes);
    both derived from `support` unless a backend adds to them;
  - entry points that take a validated Problem and plain tensors and return plain tensors.
Backends never import each other; the shared math they all use lives in `gdnkit.prep`.
"""
from __future__ import annotations

import abc
import importlib
from typing import Any, Callable

import torch

from gdnkit.problem import GDNGrads, GDNInputs, Problem

from .machine import Machine
from .support import Support


class KernelsBuilding(Exception):
    """Raised by `Backend.chunk_forward_unless_building`, before the call writes anything, when the kernels it
    needs are being built in the background (a backend's first call at a new configuration). The caller may run
    the call on another backend meanwhile (gdnkit.autograd: the stand-in), or `resume()`: wait for the kernels
    and run the call on this backend, returning what chunk_forward returns."""

    def __init__(self, what: str, resume: Callable[[], tuple], first: bool):
        super().__init__(f"kernels for {what} are being built")
        self.what, self.resume = what, resume
        self.first = first   # raised by the call that started the build (the one that announces a stand-in)


class Backend(abc.ABC):
    name: str
    priority: int  # higher wins in auto selection
    description: str
    # The serving interface (problem.serving: a state pool written in place through ssm_state_indices) is
    # opt-in: a backend that has not implemented it would read the pool as a dense initial state.
    serves_state_pool: bool = False
    # What it takes, as data (dispatch/support.py): the reasons below are derived from it. A backend without one
    # (a test's stand-in) states its reasons itself.
    support: Support | None = None

    def unavailable_reasons(self, machine: Machine) -> list[str]:
        """Reasons this backend cannot run on `machine` whatever the problem; empty when it can."""
        return [] if self.support is None else self.support.machine_reasons(machine)

    def supports(self, problem: Problem, machine: Machine) -> list[str]:
        """Reasons this backend cannot take `problem`; empty when it can."""
        if self.support is None:
            raise NotImplementedError(f"{self.name} declares no support: it must override supports()")
        return self.support.problem_reasons(problem, machine)

    def reasons(self, problem: Problem, machine: Machine) -> list[str]:
        reasons = self.unavailable_reasons(machine) or self.supports(problem, machine)
        if problem.serving and not self.serves_state_pool:
            reasons = [*reasons, "does not implement the serving state pool (ssm_state_indices)"]
        return reasons

    def plan(self, problem: Problem, inputs: GDNInputs, machine: Machine) -> str | None:
        """How this backend would run the call, in a few lines (gdnkit.explain); None where it has nothing to
        add."""
        return None

    # Entry points. `saved` is whatever the backend's forward keeps for its backward (tensors or
    # an object holding them); gdnkit's autograd glue stores it and hands it back unchanged.
    @abc.abstractmethod
    def chunk_forward(self, problem: Problem, inputs: GDNInputs
                      ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """Chunked prefill: returns (o [B,T,HV,V] in v's dtype, final state or None, saved)."""

    def chunk_forward_unless_building(self, problem: Problem, inputs: GDNInputs
                                      ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """chunk_forward, or KernelsBuilding where the kernels for this call are still being built (a backend
        that builds kernels in the background overrides this; every other one just runs)."""
        return self.chunk_forward(problem, inputs)

    @abc.abstractmethod
    def chunk_backward(self, problem: Problem, saved: Any, do: torch.Tensor,
                       dht: torch.Tensor | None) -> GDNGrads:
        """Gradients of the chunked forward given dO and the final state's gradient (or None)."""

    @abc.abstractmethod
    def recurrent_forward(self, problem: Problem, inputs: GDNInputs
                          ) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        """Token-by-token form (decode, short inputs); same returns as chunk_forward."""

    @abc.abstractmethod
    def recurrent_backward(self, problem: Problem, saved: Any, do: torch.Tensor,
                           dht: torch.Tensor | None) -> GDNGrads:
        """Gradients of the recurrent forward."""


# Modules that define backends. Each is imported lazily and calls `register`; a backend whose
# compiler is missing still registers and says so in unavailable_reasons().
BACKEND_MODULES = (
    "gdnkit.backends.reference",
    "gdnkit.backends.triton_generic",
    "gdnkit.backends.tilelang_sm90",
)

_registry: dict[str, Backend] = {}
_loaded = False
_sorted: tuple[tuple, list] = ((), [])   # (the registry's backends, them by priority)


def register(backend: Backend) -> Backend:
    if backend.name in _registry and _registry[backend.name] is not backend:
        raise ValueError(f"a backend named {backend.name!r} is already registered")
    _registry[backend.name] = backend
    return backend


def backends() -> list[Backend]:
    """Every registered backend, highest priority first (sorted again only when the registry changed: every
    eager call asks)."""
    global _loaded, _sorted
    if not _loaded:
        for module in BACKEND_MODULES:
            importlib.import_module(module)
        _loaded = True
    members = tuple(_registry.values())
    if _sorted[0] != members:
        _sorted = (members, sorted(members, key=lambda b: -b.priority))
    return list(_sorted[1])


def get(name: str) -> Backend | None:
    backends()
    return _registry.get(name)
