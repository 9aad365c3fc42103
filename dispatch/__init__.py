"""Backend dispatch: probe the machine, keep the registry, choose a backend and explain the choice."""
from .machine import GPU, Machine, machine, probe_machine, use_machine
from .registry import Backend, KernelsBuilding, backends, get, register
from .select import (ENV_VAR, SHORT_SEQUENCE, BackendNotSupportedError, Decision, decide, select, short_sequences,
                     stand_in, valid_names)

__all__ = ["GPU", "Machine", "machine", "probe_machine", "use_machine", "Backend", "KernelsBuilding", "backends", "get",
           "register", "ENV_VAR", "SHORT_SEQUENCE", "BackendNotSupportedError", "Decision", "decide", "select",
           "short_sequences", "stand_in", "valid_names"]
