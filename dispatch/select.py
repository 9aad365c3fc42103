"""Choosing a backend for a problem, and saying why the others were not chosen.

Order: the call's `backend=` argument, then the GDNKIT_BACKEND environment variable, then auto
(the highest-priority backend with no reasons). A forced backend that cannot take the problem
raises one error with its reasons; auto never fails while the reference backend can run.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from gdnkit import seqlayout
from gdnkit.problem import CHUNK_MODE, RECURRENT_MODE, Problem

from . import registry
from .machine import Machine, machine as current_machine, probed_machine
from .registry import Backend

log = logging.getLogger("gdnkit")

ENV_VAR = "GDNKIT_BACKEND"
AUTO = "auto"
# "0": a call whose backend is still building its kernels waits for them instead of running on a stand-in.
STAND_IN_ENV_VAR = "GDNKIT_STAND_IN"
# Under auto dispatch, an inference chunked call on a GPU whose sequences are all at most this many tokens runs in
# the token-by-token form (the same function): each of its programs walks a few tokens where the chunked kernels
# pay a whole 64-token chunk per sequence and several launches (an H100 took 12 ms for 4096 sequences of 8 tokens
# at 16/64 in the chunked form, 1.1 ms for one sequence of 32768). 16 is a bound the recurrent form wins by a wide
# margin; where the two cross over is still to be measured.
SHORT_SEQUENCE = 16


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
    # why the call runs in another form than it was made in (the problem above is then that form's)
    form_note: str | None = None

    @property
    def runs(self) -> bool:
        """Whether the call would run (False: a forced backend with reasons, or no backend at all)."""
        return self.chosen is not None and not self.reasons.get(self.chosen)

    def __str__(self) -> str:
        lines = [f"problem: {self.problem.describe()}"]
        if self.form_note:
            lines.append(f"form: {self.form_note}")
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


def short_sequences(problem: Problem, cu_seqlens: torch.Tensor | None) -> bool:
    """Whether auto dispatch may run this chunked call token by token: inference on a GPU, no state pool, and
    every sequence at most SHORT_SEQUENCE tokens (cu_seqlens: the call's validated offsets, None for a dense
    [B, T] batch). The offsets are read only for a call that qualifies otherwise (a CUDA tensor's are cached since
    validation read them: no sync), and the longest sequence only looked for where the mean length is short
    already (it costs a pass over N)."""
    if problem.mode != CHUNK_MODE or problem.needs_grad or problem.serving or problem.device_type != "cuda":
        return False
    if cu_seqlens is None:
        return 0 < problem.T <= SHORT_SEQUENCE
    offsets = seqlayout.host_offsets(cu_seqlens)
    tokens, n = offsets[-1] - offsets[0], len(offsets) - 1
    if tokens == 0 or tokens > SHORT_SEQUENCE * n:
        return False
    return max(b - a for a, b in zip(offsets[:-1], offsets[1:])) <= SHORT_SEQUENCE


# Recent decisions: an eager loop repeats its problem call after call (a decode step, a training step of one
# shape), and deciding again asks every backend for its reasons (~30 us of host time a call on a 2-core CPU). Kept
# for the probed machine only (an injected one is a test's or explain()'s), keyed on the whole problem, the name
# asked for, the short-sequence form and the registered backends themselves; a backend whose instance overrides
# its reasons (a test's monkeypatch) is decided afresh.
_DECIDED: dict[tuple, tuple[Decision, Machine]] = {}   # the machine kept alive: its id is in the key
_DECIDED_MAX = 256
_OVERRIDES = frozenset({"reasons", "supports", "unavailable_reasons", "support"})


def decide(problem: Problem, backend: str | None = None, machine: Machine | None = None,
           short: bool = False) -> Decision:
    """The decision for `problem` without acting on it: a forced backend that cannot take the problem, or
    auto with no backend able to, is described (`Decision.runs` is False) rather than raised. An unknown
    backend name still raises ValueError. short: short_sequences(problem, ...) holds; auto then runs the call in
    the recurrent form where a backend other than the reference takes it (Decision.problem is that form)."""
    machine = machine or current_machine()
    name, source = _requested(backend)
    if not isinstance(name, str):
        raise TypeError(f"backend must be a backend name (str) or None, got {type(name).__name__}")
    candidates = registry.backends()
    key = None
    if machine is probed_machine() and all(_OVERRIDES.isdisjoint(vars(b)) for b in candidates):
        key = (problem, name, source, short, tuple(candidates), id(machine))
        decided = _DECIDED.get(key)
        if decided is not None:
            return decided[0]
    decision = _decide(problem, name, source, short, candidates, machine)
    if key is not None:
        if len(_DECIDED) >= _DECIDED_MAX:
            _DECIDED.pop(next(iter(_DECIDED)))
        _DECIDED[key] = (decision, machine)
    return decision


def _decide(problem: Problem, name: str, source: str, short: bool, candidates: list[Backend],
            machine: Machine) -> Decision:
    if name != AUTO and name not in {b.name for b in candidates}:
        raise ValueError(f"unknown backend {_origin(source)}{name!r}; valid names: {', '.join(valid_names())}")
    if name == AUTO and short:
        recurrent = dataclasses.replace(problem, mode=RECURRENT_MODE)
        reasons = {b.name: b.reasons(recurrent, machine) for b in candidates}
        fast = next((b.name for b in candidates if not reasons[b.name]), None)
        if fast is not None and fast != "reference":
            return Decision(problem=recurrent, chosen=fast, source=source, reasons=reasons,
                            form_note=f"a chunked call run token by token: every sequence is at most "
                                      f"{SHORT_SEQUENCE} tokens (dispatch.select.SHORT_SEQUENCE)")
    reasons = {b.name: b.reasons(problem, machine) for b in candidates}
    if name == AUTO:
        name = next((b.name for b in candidates if not reasons[b.name]), None)
    return Decision(problem=problem, chosen=name, source=source, reasons=reasons)


def select(problem: Problem, backend: str | None = None, machine: Machine | None = None,
           short: bool = False) -> tuple[Backend, Decision]:
    """The backend to run `problem` (or, where short, its recurrent form: run Decision.problem) and the decision."""
    decision = decide(problem, backend, machine, short)
    if decision.chosen is None:
        detail = "\n".join(f"  {n}: {'; '.join(r)}" for n, r in decision.reasons.items())
        raise BackendNotSupportedError(f"no backend can run {problem.describe()}:\n{detail}")
    if not decision.runs:
        raise BackendNotSupportedError(f"{_origin(decision.source)}{decision.chosen!r} cannot run {problem.describe()}:\n  - "
                                       + "\n  - ".join(decision.reasons[decision.chosen]))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("gdnkit dispatch: %s", str(decision).replace("\n", " | "))
    return registry.get(decision.chosen), decision


def stand_in(problem: Problem, building: str, backend: str | None = None) -> Backend | None:
    """The backend that runs `problem` while `building`'s kernels for it are being built (Backend.
    chunk_forward_unless_building): under auto dispatch, the next backend by priority that takes the problem,
    the reference excepted (its float64 recurrence would take longer than the wait). None where the call must
    wait: the backend was named (backend= or GDNKIT_BACKEND), GDNKIT_STAND_IN=0, or no other backend takes it."""
    wanted = os.environ.get(STAND_IN_ENV_VAR, "").strip()
    if wanted not in ("", "0", "1"):
        raise ValueError(f"{STAND_IN_ENV_VAR} must be 0 (wait for the kernels) or 1 (run on a stand-in), "
                         f"got {wanted!r}")
    if _requested(backend)[1] != "auto" or wanted == "0":
        return None
    reasons = decide(problem, backend).reasons
    name = next((n for n, why in reasons.items() if not why and n not in (building, "reference")), None)
    return None if name is None else registry.get(name)
