"""Choosing a backend for a problem, and saying why the others were not chosen.

Order: the call's `backend=` argument, then the GDNKIT_BACKEND environment variable, then auto
(the highest-priority backend with no reasons). A forced backend that cannot take the problem
raises one error with its reasons; auto never fails while the reference backend can run.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from gdnkit.problem import Problem

from . import registry
from .machine import Machine, machine as current_machine
from .registry import Backend

log = logging.getLogger("gdnkit")

ENV_VAR = "GDNKIT_BACKEND"
AUTO = "auto"


class BackendNotSupportedError(ValueError):
    """A forced backend cannot take the problem, or no backend can."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """The outcome of a selection: who runs, why, and every other backend's reasons."""

    problem: Problem
    chosen: str | None  # None: auto found no backend that can take the problem
    source: str  # "argument", "environment" or "auto"
    reasons: dict[str, list[str]]  # backend name -> reasons it can't take the problem (empty = could)
    plan: str | None = None  # how the chosen backend would run it (explain(): Backend.plan), where it says

    @property
    def runs(self) -> bool:
        """Whether the call would run (False: a forced backend with reasons, or no backend at all)."""
        return self.chosen is not None and not self.reasons.get(self.chosen)

    def __str__(self) -> str:
        lines = [f"problem: {self.problem.describe()}"]
        if self.chosen is None:
            lines.append("chosen: none, no backend can take this problem (the call raises BackendNotSupportedError)")
        elif not self.runs:
            lines.append(f"chosen: {self.chosen} (by {self.source}), which cannot take this problem (the call "
                         f"raises BackendNotSupportedError):")
            lines += [f"    - {why}" for why in self.reasons.get(self.chosen, [])]
        else:
            lines.append(f"chosen: {self.chosen} (by {self.source})")
        for name, why in self.reasons.items():
            if name == self.chosen:
                continue
            could = "could run" + (", lower priority" if self.source == "auto" else "")
            lines.append(f"  {name}: " + (could if not why else "; ".join(why)))
        if self.plan:
            lines += ["plan:", *(f"  {line}" for line in self.plan.splitlines())]
        return "\n".join(lines)


def valid_names() -> list[str]:
    return [AUTO] + [b.name for b in registry.backends()]


def _requested(backend: str | None) -> tuple[str, str]:
    if backend is not None and backend != AUTO:
        return backend, "argument"
    env = os.environ.get(ENV_VAR, "").strip()
    if env and env != AUTO:
        return env, "environment"
    return AUTO, "auto"


def _origin(source: str) -> str:
    """How the user named the backend, as the error repeats it."""
    return "backend=" if source == "argument" else f"{ENV_VAR}="


def decide(problem: Problem, backend: str | None = None, machine: Machine | None = None) -> Decision:
    """The decision for `problem` without acting on it: a forced backend that cannot take the problem, or
    auto with no backend able to, is described (`Decision.runs` is False) rather than raised. An unknown
    backend name still raises ValueError."""
    machine = machine or current_machine()
    name, source = _requested(backend)
    if not isinstance(name, str):
        raise TypeError(f"backend must be a backend name (str) or None, got {type(name).__name__}")
    candidates = registry.backends()
    if name != AUTO and name not in {b.name for b in candidates}:
        raise ValueError(f"unknown backend {_origin(source)}{name!r}; valid names: {', '.join(valid_names())}")
    reasons = {b.name: b.reasons(problem, machine) for b in candidates}
    if name == AUTO:
        name = next((b.name for b in candidates if not reasons[b.name]), None)
    return Decision(problem=problem, chosen=name, source=source, reasons=reasons)


def select(problem: Problem, backend: str | None = None, machine: Machine | None = None) -> tuple[Backend, Decision]:
    decision = decide(problem, backend, machine)
    if decision.chosen is None:
        detail = "\n".join(f"  {n}: {'; '.join(r)}" for n, r in decision.reasons.items())
        raise BackendNotSupportedError(f"no backend can run {problem.describe()}:\n{detail}")
    if not decision.runs:
        raise BackendNotSupportedError(f"{_origin(decision.source)}{decision.chosen!r} cannot run {problem.describe()}:\n  - "
                                       + "\n  - ".join(decision.reasons[decision.chosen]))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("gdnkit dispatch: %s", str(decision).replace("\n", " | "))
    return registry.get(decision.chosen), decision
