"""What a backend takes, declared as data (one frozen Support per backend), and the reasons derived from it.

A backend's unavailable_reasons() and supports() are `Support.machine_reasons` and `Support.problem_reasons`;
docs/support.md's table is `support_table()` of the registered backends (tests/test_support.py checks both). A
`why` note names the reason behind a limit (where a declined call goes instead); it follows the plain reason.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from gdnkit.problem import CHUNK_MODE, RECURRENT_MODE, Problem

from .machine import Machine
from .requirements import Capability, cuda_tensor_reasons, gpu_reasons, package_reasons

# The API's options, by their FLA names, and the Problem flag each sets.
OPTIONS = {
    "use_qk_l2norm_in_kernel": "use_qk_l2norm_in_kernel",
    "use_gate_in_kernel": "use_gate_in_kernel",
    "use_beta_sigmoid_in_kernel": "use_beta_sigmoid_in_kernel",
    "allow_neg_eigval": "allow_neg_eigval",
    "state_v_first": "state_v_first",
    "cu_seqlens": "varlen",
    "initial_state": "has_initial_state",
    "output_final_state": "output_final_state",
}
MODES = (CHUNK_MODE, RECURRENT_MODE)
WHY_KEYS = ("capability", "mode", "dtype", "head_dim", "state_dtype", "serving", "sequences")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _either(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _cc(capability: Capability) -> str:
    return f"{capability[0]}.{capability[1]}"


@dataclasses.dataclass(frozen=True)
class Support:
    devices: tuple[str, ...] | None             # torch device types; None: any
    dtypes: tuple[torch.dtype, ...]             # of q, k, v
    head_dims: tuple[int, ...] | None           # K and V each; None: any
    modes: tuple[str, ...]                      # CHUNK_MODE (chunk_gated_delta_rule) and / or RECURRENT_MODE
    state_dtypes: tuple[torch.dtype, ...]       # a dense initial_state's
    pool_state_dtypes: tuple[torch.dtype, ...]  # a serving pool's slots (ssm_state_indices); (): no serving
    options: tuple[str, ...] = tuple(OPTIONS)   # the options it takes (OPTIONS' names)
    packages: tuple[str, ...] = ()              # what must import for it to run at all
    min_capability: Capability | None = None    # CUDA compute capability: at least this
    capabilities: tuple[Capability, ...] | None = None  # ... or exactly one of these
    max_sequences: int | None = None            # sequences in one call
    why: Mapping[str, str] = dataclasses.field(default_factory=dict)   # WHY_KEYS -> the reason behind a limit

    def __post_init__(self):
        assert set(self.why) <= set(WHY_KEYS), set(self.why) - set(WHY_KEYS)
        assert set(self.options) <= set(OPTIONS) and set(self.modes) <= set(MODES)

    @property
    def serving(self) -> bool:
        return bool(self.pool_state_dtypes)

    def accepts(self, capability: Capability) -> bool:
        return ((self.min_capability is None or capability >= self.min_capability)
                and (self.capabilities is None or capability in self.capabilities))

    @property
    def needs(self) -> str:
        """The capability rule in words."""
        if self.capabilities is not None:
            words = "compute capability " + _either([_cc(c) for c in self.capabilities])
        elif self.min_capability is not None:
            words = f"compute capability >= {_cc(self.min_capability)}"
        else:
            words = "a CUDA GPU"
        return words + (f" ({self.why['capability']})" if "capability" in self.why else "")

    def _because(self, reason: str, key: str) -> str:
        return f"{reason}: {self.why[key]}" if key in self.why else reason

    def machine_reasons(self, machine: Machine) -> list[str]:
        """Why the backend cannot run on this machine at all (its unavailable_reasons)."""
        reasons = [r for package in self.packages for r in package_reasons(machine, package)]
        if self.devices == ("cuda",):
            reasons += gpu_reasons(machine, self.accepts, self.needs)
        return reasons

    def problem_reasons(self, problem: Problem, machine: Machine) -> list[str]:
        """Why the backend cannot take this call (its supports())."""
        reasons = []
        if self.devices == ("cuda",):
            reasons += cuda_tensor_reasons(problem, machine, self.accepts, self.needs)
        elif self.devices is not None and problem.device_type not in self.devices:
            reasons.append(f"runs on {_either(list(self.devices))} tensors, got tensors on {problem.device_type}")
        if problem.mode not in self.modes:
            form = "chunked" if problem.mode == CHUNK_MODE else "recurrent (decode)"
            reasons.append(self._because(f"has no {form} form", "mode"))
        if problem.dtype not in self.dtypes:
            dtypes = _either([_name(d) for d in self.dtypes])
            reasons.append(self._because(f"dtype {_name(problem.dtype)} is not {dtypes}", "dtype"))
        if self.head_dims is not None:
            if len(self.head_dims) == 1 and (problem.K, problem.V) != self.head_dims * 2:
                reasons.append(self._because(f"built for K = V = {self.head_dims[0]}, got K={problem.K}, "
                                             f"V={problem.V}", "head_dim"))
            elif len(self.head_dims) > 1:
                dims = _either([str(d) for d in self.head_dims])
                reasons += [self._because(f"{what} head dim {name}={dim} is not {dims}", "head_dim")
                            for what, name, dim in (("key", "K", problem.K), ("value", "V", problem.V))
                            if dim not in self.head_dims]
        if problem.serving:
            if not self.serving:
                reasons.append(self._because("takes no serving state pool (ssm_state_indices)", "serving"))
            elif problem.state_dtype not in self.pool_state_dtypes:
                reasons.append(f"a state pool must be {_either([_name(d) for d in self.pool_state_dtypes])} here, "
                               f"got {_name(problem.state_dtype)}")
        elif problem.state_dtype is not None and problem.state_dtype not in self.state_dtypes:
            reasons.append(self._because(f"initial_state must be {_either([_name(d) for d in self.state_dtypes])} "
                                         f"here, got {_name(problem.state_dtype)}", "state_dtype"))
        if self.max_sequences is not None and problem.N > self.max_sequences:
            reasons.append(self._because(f"{problem.N} sequences, more than {self.max_sequences}", "sequences"))
        reasons += [f"does not take {option}" for option, flag in OPTIONS.items()
                    if option not in self.options and getattr(problem, flag)]
        return reasons

    def row(self) -> dict[str, str]:
        """This support as the cells of docs/support.md's table."""
        if self.devices == ("cuda",):
            device = "CUDA, " + self.needs
        else:
            device = "any torch device" if self.devices is None else _either(list(self.devices))
        forms = {CHUNK_MODE: "chunked (prefill, training)", RECURRENT_MODE: "recurrent (decode)"}
        return {
            "devices": device,
            "packages": ", ".join(self.packages) or "torch",
            "dtypes": ", ".join(_name(d) for d in self.dtypes),
            "head dims (K, V)": "any" if self.head_dims is None else ", ".join(map(str, self.head_dims)),
            "modes": ", ".join(forms[m] for m in self.modes),
            "initial state": ", ".join(_name(d) for d in self.state_dtypes),
            "serving pool": ", ".join(_name(d) for d in self.pool_state_dtypes) or "no",
            "sequences": "any" if self.max_sequences is None else f"up to {self.max_sequences}",
            "options": "all" if set(self.options) == set(OPTIONS) else ", ".join(self.options),
        }


def support_table(backends) -> str:
    """The markdown table of docs/support.md: one row per backend (objects with .name and .support)."""
    rows = [(b.name, b.support.row()) for b in backends]
    columns = list(rows[0][1])
    lines = ["| backend | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| `{name}` | " + " | ".join(row[c] for c in columns) + " |" for name, row in rows]
    return "\n".join(lines)
