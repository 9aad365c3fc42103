"""Every backend available on this machine against check.py's float64 recurrence, one test per row of
`python -m gdnkit check` (its sweep, its tolerances), so a failing row shows up as a failing test.

On a CPU the reference is the only backend (float32 rows here; test_check.py runs the whole sweep); on a GPU every
available backend runs every dtype of the sweep, K = V = 64 plus the K = V = 128 rows tilelang_sm90 takes.
"""
from __future__ import annotations

import pytest
import torch

import gdnkit
from gdnkit import check


def _rows():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sweep = check.cases(64, hopper_rows=True) if device == "cuda" else check.cases(16, hopper_rows=False)
    for backend in gdnkit.available_backends():
        for i, case in enumerate(sweep):
            for dtype in case.dtypes if device == "cuda" else (torch.float32,):
                yield pytest.param(backend, case, device, dtype, 100 * i,
                                   id=f"{backend}-{case.name}-{str(dtype).removeprefix('torch.')}")


@pytest.mark.parametrize("backend,case,device,dtype,seed", list(_rows()))
def test_backend_matches_the_float64_recurrence(backend, case, device, dtype, seed):
    call = check.make_call(case, dtype, device, seed)
    want = check.truth(case, call, seed)
    for run in ("forward", "gradients") if case.grads else ("forward",):
        row = check.check_row(backend, case, dtype, run, call, want)
        if "skipped" in row:
            pytest.skip(f"{backend} declines {case.name} {run}: {row['skipped']}")
        assert row["ok"], row
