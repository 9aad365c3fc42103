"""Every backend available on this machine against the reference, on random problems.

Today the reference is the only backend on a CPU, so this checks the chunked reference (the form the
kernels follow) against the float64 recurrence; each new backend is picked up by registering it.
"""
from __future__ import annotations

import pytest
import torch

import gdnkit
from gdnkit.check import check_backend, problems

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
def test_backend_matches_float64_reference(backend, problem, device, dtype):
    row = check_backend(backend, problem, device, dtype, seed=123)
    fwd_bound, grad_bound = BOUNDS[dtype]
    ran = [k for k in ("fwd_err", "grad_err") if row.get(k) is not None]
    assert ran, f"{backend} ran nothing: {row.get('skipped')}"
    if row.get("fwd_err") is not None:
        assert row["fwd_err"] < fwd_bound and row["state_err"] < fwd_bound, row
    if row.get("grad_err") is not None:
        assert row["grad_err"] < grad_bound, row
