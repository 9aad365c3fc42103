"""Errors and warnings a user can act on: a head-first layout named as such, positive gates warned about."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import gdnkit
from gdnkit.problem import CHUNK_MODE, PositiveGateWarning, validate_inputs, warn_positive_gates

from conftest import make_inputs


def _head_first(x: dict) -> dict:
    """FLA's old head_first=True layout: q/k/v [B, H, T, K], g/beta [B, HV, T]."""
    return {n: (t.transpose(1, 2).contiguous() if t is not None and n != "initial_state" else t) for n, t in x.items()}


# (Every tensor transposed with H == HV reads as a valid call of H tokens and T heads: nothing to diagnose.)
@pytest.mark.parametrize("H,HV,gates_head_first", [(2, 4, True), (2, 4, False), (4, 4, False)])
def test_head_first_layout_is_named(H, HV, gates_head_first):
    x = make_inputs(B=2, T=50, H=H, HV=HV, K=16, V=16, dtype=torch.float32)
    y = _head_first(x)
    if not gates_head_first:
        y.update(g=x["g"], beta=x["beta"])
    with pytest.raises(ValueError, match=r"look head-first.*\[B, T, H, K\].*transpose\(1, 2\)") as err:
        gdnkit.chunk_gated_delta_rule(**y)
    assert f"H={H}, HV={HV} heads and T=50 tokens" in str(err.value)


def test_a_wrong_v_in_the_usual_layout_still_blames_v():
    x = make_inputs(B=1, T=50, H=2, HV=4, K=16, V=16, dtype=torch.float32)
    x["v"] = x["v"][:, :49]
    with pytest.raises(ValueError, match=r"^v must have shape \[B, T, HV, V\] with B=1, T=50"):
        gdnkit.chunk_gated_delta_rule(**x)


def test_positive_gates_warn_on_cpu_and_the_call_still_runs():
    x = make_inputs(T=20, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gdnkit.chunk_gated_delta_rule(**x)
        assert not [w for w in caught if issubclass(w.category, PositiveGateWarning)]
        x["g"] = x["g"].clone()
        x["g"][0, 3, 1] = 0.5
        o, _ = gdnkit.chunk_gated_delta_rule(**x)
    (w,) = [w for w in caught if issubclass(w.category, PositiveGateWarning)]
    assert "g has positive values (max 0.5)" in str(w.message) and "use_gate_in_kernel=True" in str(w.message)
    assert w.filename == __file__  # points at the user's line, not at gdnkit's internals
    assert torch.isfinite(o).all()
    # raw gates under use_gate_in_kernel are pre-activation values: positive is normal there
    raw = make_inputs(T=20, dtype=torch.float32, raw_gates=True)
    assert (raw["g"] > 0).any()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PositiveGateWarning)
        gdnkit.chunk_gated_delta_rule(**raw, use_gate_in_kernel=True, A_log=torch.zeros(4))


def test_positive_gate_warning_shows_once_per_call_site():
    """Python's default filter shows a warning once per location: the location is the caller's line."""
    r = torch.randn
    q, k, v = r(1, 9, 2, 16), F.normalize(r(1, 9, 2, 16), dim=-1), r(1, 9, 2, 16)
    g = torch.full((1, 9, 2), 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            gdnkit.chunk_gated_delta_rule(q, k, v, g, torch.rand(1, 9, 2))
        gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, torch.rand(1, 9, 2))
    shown = [w for w in caught if issubclass(w.category, PositiveGateWarning)]
    assert len(shown) == 2 and {w.filename for w in shown} == {__file__}   # the loop's line once, the last one once
    assert shown[1].lineno == shown[0].lineno + 1


def test_positive_gates_on_the_gpu_are_not_read_back():
    """On CUDA the check would cost a host sync per call: it reads nothing and warns nothing there."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = make_inputs(T=20, dtype=torch.float32, device="cuda")
    x["g"] = x["g"].abs() + 0.1
    problem, _ = validate_inputs(CHUNK_MODE, **x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PositiveGateWarning)
        torch.cuda.set_sync_debug_mode("error")
        try:
            warn_positive_gates(problem, x["g"])
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_zero_heads_read_head_first_is_no_crash():
    """q [1, 0, 1, 1] read head-first has H = 0 heads: the layout hint must not divide by it (found by the fuzz);
    the call is refused naming v's shape."""
    x = torch.zeros(1, 0, 1, 1, dtype=torch.float64)
    gates = torch.zeros(1, 0, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="v must have shape"):
        gdnkit.chunk_gated_delta_rule(x, x, torch.ones(1, 1, 1, 1, dtype=torch.float64), gates, gates)
