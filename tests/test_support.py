"""Each backend's Support (dispatch/support.py) is what the backend does: every call inside the declared values is
taken (no reasons), every call outside is declined with a reason that names what is outside; docs/support.md's
table is generated from the same data, and the README's backend table agrees with it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gdnkit import dispatch
from gdnkit.dispatch.registry import BACKEND_MODULES
from gdnkit.dispatch.support import Support, support_table
from gdnkit.problem import CHUNK_MODE, FLOAT_DTYPES, RECURRENT_MODE, Problem

ROOT = Path(__file__).resolve().parent.parent
NAMES = [module.rsplit(".", 1)[1] for module in BACKEND_MODULES]


def _backends():
    return [dispatch.get(name) for name in NAMES]


def _machine(support: Support, capability=None) -> dispatch.Machine:
    """A machine the backend runs on: its packages, and a GPU of a capability it accepts (or `capability`)."""
    packages = {"triton": "3.6.0", "tilelang": "0.1.15"}
    if support.devices != ("cuda",):
        return dispatch.Machine(gpus=(), packages=packages)
    capability = capability or (support.capabilities[0] if support.capabilities else support.min_capability)
    gpu = dispatch.GPU(index=0, name="GPU", capability=capability, sm_count=132, total_memory_bytes=1 << 37)
    return dispatch.Machine(gpus=(gpu,), packages=packages)


def _problem(support: Support, **over) -> Problem:
    dim = support.head_dims[0] if support.head_dims else 128
    cuda = support.devices == ("cuda",)
    fields = dict(mode=support.modes[0], B=1, T=256, H=2, HV=4, K=dim, V=dim, N=1, dtype=support.dtypes[0],
                  gate_dtype=torch.float32, device_type="cuda" if cuda else "cpu", device_index=0 if cuda else None,
                  scale=dim ** -0.5, varlen=False, has_initial_state=False, state_dtype=None, output_final_state=True)
    fields.update(over)
    return Problem(**fields)


@pytest.mark.parametrize("name", NAMES)
def test_every_declared_value_is_taken(name):
    backend = dispatch.get(name)
    s, m = backend.support, _machine(backend.support)
    assert backend.unavailable_reasons(m) == []
    dims = s.head_dims or (64, 128)
    for dtype in s.dtypes:
        for mode in s.modes:
            for K in dims:
                for V in dims:
                    assert backend.reasons(_problem(s, dtype=dtype, mode=mode, K=K, V=V), m) == [], (dtype, mode, K, V)
    for state in s.state_dtypes:
        assert backend.reasons(_problem(s, has_initial_state=True, state_dtype=state), m) == [], state
    for state in s.pool_state_dtypes:
        pool = _problem(s, mode=RECURRENT_MODE if RECURRENT_MODE in s.modes else s.modes[0], serving=True,
                        num_slots=8, has_initial_state=True, state_dtype=state,
                        dtype=torch.float64 if state == torch.float64 and torch.float64 in s.dtypes else s.dtypes[0])
        assert backend.reasons(pool, m) == [], state
    if s.max_sequences is not None:
        assert backend.reasons(_problem(s, N=s.max_sequences, varlen=True), m) == []
    options = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                   allow_neg_eigval=True, state_v_first=True, varlen=True, has_initial_state=True,
                   state_dtype=torch.float32, output_final_state=True)
    assert backend.reasons(_problem(s, **options), m) == []


@pytest.mark.parametrize("name", NAMES)
def test_every_value_outside_is_declined_by_name(name):
    backend = dispatch.get(name)
    s, m = backend.support, _machine(backend.support)
    for dtype in FLOAT_DTYPES:
        if dtype not in s.dtypes:
            reasons = backend.reasons(_problem(s, dtype=dtype), m)
            assert any(str(dtype).removeprefix("torch.") in r for r in reasons), (dtype, reasons)
    for dim in (32, 64, 96, 128, 256):
        if s.head_dims is not None and dim not in s.head_dims:
            assert any(f"K={dim}" in r for r in backend.reasons(_problem(s, K=dim), m)), dim
            assert any(f"V={dim}" in r for r in backend.reasons(_problem(s, V=dim), m)), dim
    for mode in (CHUNK_MODE, RECURRENT_MODE):
        if mode not in s.modes:
            assert any("form" in r for r in backend.reasons(_problem(s, mode=mode), m)), mode
    for state in FLOAT_DTYPES:
        if state not in s.state_dtypes:
            reasons = backend.reasons(_problem(s, has_initial_state=True, state_dtype=state), m)
            assert any("initial_state" in r for r in reasons), (state, reasons)
    if not s.pool_state_dtypes:
        pool = _problem(s, serving=True, num_slots=8, has_initial_state=True, state_dtype=torch.float32)
        assert any("state pool" in r for r in backend.reasons(pool, m))
    if s.max_sequences is not None:
        assert any("sequences" in r for r in backend.reasons(_problem(s, N=s.max_sequences + 1, varlen=True), m))
    if s.devices == ("cuda",):
        assert any("CUDA" in r for r in backend.reasons(_problem(s, device_type="cpu", device_index=None), m))
        older = _machine(s, capability=(7, 0))
        assert any("compute capability" in r for r in backend.unavailable_reasons(older))
        assert any(p in r for p in s.packages for r in backend.unavailable_reasons(dispatch.Machine(gpus=())))


def test_why_notes_follow_their_reason():
    s = Support(devices=("cuda",), dtypes=(torch.float16,), head_dims=(128,), modes=(CHUNK_MODE,),
                state_dtypes=(torch.float32,), pool_state_dtypes=(), min_capability=(8, 0),
                why={"dtype": "a reason", "mode": "decode elsewhere"})
    m = _machine(s)
    assert s.problem_reasons(_problem(s, dtype=torch.float32), m) == ["dtype float32 is not float16: a reason"]
    decode = s.problem_reasons(_problem(s, mode=RECURRENT_MODE), m)
    assert decode == ["has no recurrent (decode) form: decode elsewhere"]
    with pytest.raises(AssertionError):
        Support(devices=None, dtypes=(torch.float16,), head_dims=None, modes=(CHUNK_MODE,), state_dtypes=(),
                pool_state_dtypes=(), why={"colour": "not a limit"})


def _doc_table(text: str) -> str:
    return re.search(r"<!-- support table[^>]*-->\n(.*?)\n<!-- end of support table -->", text, re.S).group(1)


def test_docs_support_table_is_generated_from_the_data():
    expected = support_table(sorted(_backends(), key=lambda b: -b.priority))
    assert _doc_table((ROOT / "docs" / "support.md").read_text()) == expected, (
        "docs/support.md is stale: paste gdnkit.dispatch.support.support_table(...) in")


def test_readme_backend_table_agrees_with_the_data():
    """The README's one-line-per-backend table: a row for every registered backend, whose 'runs on' cell names
    its packages and GPU generation (or any device)."""
    readme = (ROOT / "README.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z0-9_]+)` \| ([^|]*) \|", readme, re.M)}
    assert set(rows) >= set(NAMES), rows
    for backend in _backends():
        s, cell = backend.support, rows[backend.name]
        assert all(p in cell for p in s.packages), (backend.name, cell)
        if s.devices is None:
            assert "any torch device" in cell, cell
        for c in s.capabilities or ():
            assert f"sm{c[0]}{c[1]}" in cell, cell
        if s.min_capability is not None:
            assert f"{s.min_capability[0]}.{s.min_capability[1]}" in cell, cell
