"""Where gdnkit's eager calls meet torch.compile, without importing Dynamo for those who never compile.

`torch.compiler.disable` as a decorator imports torch._dynamo (and through it Triton): seconds at `import gdnkit`,
paid by every CPU user and every serving process that never compiles. Dynamo can only be tracing, or running a
frame under its callback, once it has been imported; so the marker is applied on the first call made after that,
and until then the call runs as it is.
"""
from __future__ import annotations

import functools
import sys

import torch


def outside_dynamo(fn):
    """fn, opaque to Dynamo (torch.compiler.disable) once Dynamo is loaded; plain before."""
    disabled = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
            compile_ops()   # registered before anything traces a call (tracing may start right after this one)
        return disabled(*args, **kwargs)

    return run


def compile_ops():
    """gdnkit.integrations.torch_compile: the custom ops a traced call becomes (registering them imports Dynamo)."""
    from gdnkit.integrations import torch_compile
    return torch_compile
