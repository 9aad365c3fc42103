"""Every backend available on this machine against tests/oracle.py (the README's recurrence written in the tests,
in float64), on `gdnkit check`'s problems: output, final state and every gradient.

The truth is never the library's own reference: on a CPU the reference is the only backend, and holding its
float32 run to its float64 run would let a mistake common to both (a default, a formula) pass.
"""
from __future__ import annotations

import pytest
import torch

import gdnkit
from gdnkit.check import make_call, problems

from test_oracle import assert_gradients_match  # noqa: E402  (tests/ is on sys.path)

BOUNDS = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (5e-3, 1e-2), torch.float16: (5e-3, 1e-2)}


def _setups():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtypes = [torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32]
    K = 128 if device == "cuda" else 16
    for backend in gdnkit.available_backends():
        for dtype in dtypes:
            for p in problems(K):
                yield pytest.param(backend, p, device, dtype, id=f"{backend}-{p.name}-{str(dtype)[6:]}")


@pytest.mark.parametrize("backend,problem,device,dtype", list(_setups()))
def test_backend_matches_the_oracle(backend, problem, device, dtype):
    if backend == "tilelang_sm90" and problem.K != 128:
        pytest.skip("tilelang_sm90 is built for K = V = 128")
    call = make_call(problem, dtype, device, seed=123)
    fwd_bound, grad_bound = BOUNDS[dtype]
    assert_gradients_match(backend, gdnkit.chunk_gated_delta_rule, call, dtype, grad_bound, fwd_bound)
