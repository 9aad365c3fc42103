"""use_qk_l2norm_in_kernel's Triton passes (triton_shared/l2norm.py) against the float64 formulas, and the prologue
taking them: on CPU tensors under the Triton interpreter (conftest sets it without a GPU), on CUDA ones with a GPU."""
from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from gdnkit import prep, prologue

pytest.importorskip("triton")
from gdnkit.backends.triton_shared import l2norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# rel. L2 error bounds per dtype: a rounding of the result (the interpreter's bf16 cast is rounded by the fixture)
BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel(x, ref):
    x, ref = x.double().cpu(), ref.double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def want(x, dy):
    """(y, rstd, dx) in float64."""
    x64, dy64 = x.double(), dy.double()
    rstd = torch.rsqrt((x64 * x64).sum(-1, keepdim=True) + prep.L2NORM_EPS)
    y = x64 * rstd
    return y, rstd, rstd * (dy64 - y * (y * dy64).sum(-1, keepdim=True))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(0, 80), heads=st.integers(1, 3), K=st.sampled_from([16, 64, 100, 128, 256]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), dy_fp32=st.booleans(),
       scale=st.sampled_from([1e-3, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_l2norm_passes_match_float64(bf16_interpreter, rows, heads, K, dtype, dy_fp32, scale, seed):
    """Forward (y, rstd) and backward (dx from x, rstd, dy) on random rows of any length (a program's tile is
    ROWS rows: counts off it leave a partial tile), head dims that are powers of two or not, dy in fp32 (as the
    backends' summed dq / dk) or in x's dtype; outputs in x's dtype, rstd fp32 [..., 1]."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, rows, heads, K, generator=gen) * scale).to(DEVICE, dtype)
    dy = torch.randn(1, rows, heads, K, generator=gen).to(DEVICE, torch.float32 if dy_fp32 else dtype)
    y, rstd = l2norm.l2norm_forward(x)
    dx = l2norm.l2norm_backward(x, rstd, dy)
    assert (y.dtype, dx.dtype, rstd.dtype) == (dtype, dtype, torch.float32)
    assert y.shape == dx.shape == x.shape and rstd.shape == (1, rows, heads, 1)
    if not rows:
        return
    y64, rstd64, dx64 = want(x, dy)
    assert rel(rstd, rstd64) <= 1e-6
    assert rel(y, y64) <= BOUND[dtype]
    assert rel(dx, dx64) <= BOUND[dtype]


def test_prologue_takes_the_passes_and_agrees_with_its_torch_form(bf16_interpreter, monkeypatch):
    """prologue.forward / backward with the qk l2norm run the Triton passes on tensors Triton reads, and give what
    their torch form gives (the kernel inputs q, k within a rounding; dq, dk in q's and k's dtypes)."""
    ran = []
    for name in ("l2norm_forward", "l2norm_backward"):
        real = getattr(l2norm, name)
        monkeypatch.setattr(l2norm, name, lambda *a, _real=real, _name=name: ran.append(_name) or _real(*a))
    # the options prologue reads (a Problem's fields)
    problem = types.SimpleNamespace(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False,
                                    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False)
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 70, 2, 64, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(2))
    g, beta = torch.randn(1, 70, 4, generator=gen).to(DEVICE), torch.rand(1, 70, 4, generator=gen).to(DEVICE)
    dq, dk = (torch.randn(1, 70, 2, 64, generator=gen).to(DEVICE) for _ in range(2))
    dg, dbeta = torch.randn(1, 70, 4, generator=gen).to(DEVICE), torch.randn(1, 70, 4, generator=gen).to(DEVICE)
    outs = {}
    for form in ("triton", "torch"):
        if form == "torch":
            monkeypatch.setattr(prologue, "triton_reads", lambda x: False)
        qn, kn, _, _, stash = prologue.forward(problem, q, k, g, beta, None, None)
        grads = prologue.backward(problem, stash, dq, dk, dg, dbeta, None, None)
        outs[form] = (qn, kn, *grads[:2])
    assert ran == ["l2norm_forward", "l2norm_forward", "l2norm_backward", "l2norm_backward"]
    for a, b in zip(outs["triton"], outs["torch"]):
        assert a.dtype == b.dtype == torch.bfloat16
        assert rel(a, b) <= 1e-2
