"""Shared helpers: random GDN problems (never zeros) and error measures."""
from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Triton defines its own jit helpers (tl.sum, ...) when first imported, and test modules import it while
    # they are collected: the interpreter must be chosen before any test module loads.
    os.environ["TRITON_INTERPRET"] = "1"
    # The tests' tensors are small: a second intra-op thread buys nothing there and, on a busy machine, its spinning
    # tripled the CPU time of the reference tests (2 cores, one thread each: 62 s against 113 s).
    torch.set_num_threads(1)

# A test checks the backend that auto dispatch (or its argument) picks, on every call: a first call must not run on
# a stand-in while that backend builds its kernels (test_stand_in.py turns the stand-in back on for itself).
os.environ.setdefault("GDNKIT_STAND_IN", "0")


# Compiling kernels without a GPU takes 20-190 s a test on 2 cores (~40 minutes in all): these run in CI, not in the
# default quick run. TileLang's: the tests that build a kernel (through _tilelang, _kernel or _source); Triton's:
# the whole of test_triton_compile.py.
_BUILDS_TILELANG = ("_tilelang()", "_kernel(", "_source(")


def _compiles_kernels(item) -> bool:
    module = item.module.__name__ if getattr(item, "module", None) else ""
    if module.endswith("test_triton_compile"):
        return True
    if "sm90" not in module.split("."):   # tests/sm90/: the tilelang_sm90 tests
        return False
    source = inspect.getsource(item.function)
    return any(call in source for call in _BUILDS_TILELANG)


@pytest.hookimpl(tryfirst=True)   # before -m "not slow" deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _compiles_kernels(item):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ||x - ref|| / ||ref||, in float64; NaN never passes a < bound."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def make_inputs(B=1, T=70, H=2, HV=4, K=16, V=8, dtype=torch.float64, device="cpu", seed=0,
                initial_state=True, N=None, raw_gates=False):
    """Random inputs in the anchors' style: L2-normalised k, g = logsigmoid(randn), beta in (0, 1).

    raw_gates=True gives pre-activation g/beta (for the in-kernel gate/sigmoid options).
    N overrides the number of states (varlen).
    """
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q = rnd(B, T, H, K)
    k = F.normalize(rnd(B, T, H, K), dim=-1)
    v = rnd(B, T, HV, V)
    if raw_gates:
        g, beta = rnd(B, T, HV), rnd(B, T, HV)
    else:
        g = F.logsigmoid(rnd(B, T, HV))
        beta = torch.rand(B, T, HV, generator=gen, dtype=torch.float64)
    h0 = rnd(N if N is not None else B, HV, K, V) if initial_state else None
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    out = dict(q=cast(q), k=cast(k), v=cast(v), g=cast(g), beta=cast(beta))
    out["initial_state"] = None if h0 is None else h0.to(device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    return out


@pytest.fixture
def sm90_config():
    """configure(**changes): the sm90 backend plans with its Config changed so for the rest of the test
    (config.configured, undone at the test's end), e.g. configure(fused_backward=True)."""
    import contextlib

    from gdnkit.backends.tilelang_sm90 import config
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(config.configured(**changes))


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / empty_like / new_empty hand out NaN-filled floating tensors: an output row no kernel
    writes (and nothing zeroes) shows up as NaN instead of as whatever zeros the allocator had."""
    poison_empty(monkeypatch)


def poison_empty(monkeypatch) -> None:
    """The poisoned_empty fixture's patch, for a test that first runs a call on clean memory."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **k: poison(new_empty(self, *a, **k)))


@pytest.fixture
def bf16_interpreter(monkeypatch):
    """Makes the Triton interpreter compute bfloat16 as a GPU does, so CPU runs can check the bf16 path:
    its tl.dot multiplies bf16 operands' raw uint16 bits (garbage: the interpreter does not round them), and its
    fp32 -> bf16 cast truncates where the GPU rounds to nearest even. Patched here: dot operands widened to
    fp32 (exact, as tensor cores multiply bf16), the cast rounded by torch. Nothing to do on a GPU."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        return  # no interpreter to patch (an install without the gpu extra has no Triton)
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if not (hasattr(builder, "create_dot") and hasattr(builder, "cast_impl") and hasattr(interpreter, "TensorHandle")):
        pytest.skip("this Triton's interpreter has another shape: the bf16 patch does not apply")
    dot, cast = builder.create_dot, builder.cast_impl

    def widened_dot(self, a, b, d, *rest):
        a = cast(self, a, tl.float32) if a.dtype.scalar == tl.bfloat16 else a
        b = cast(self, b, tl.float32) if b.dtype.scalar == tl.bfloat16 else b
        return dot(self, a, b, d, *rest)

    def rounded_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(builder, "create_dot", widened_dot)
    monkeypatch.setattr(builder, "cast_impl", rounded_cast)
