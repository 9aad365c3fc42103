"""A call whose backend is still building its kernels (a first call at a new configuration) runs on a stand-in
under auto dispatch, forward and backward alike, and waits where the backend was named or GDNKIT_STAND_IN=0.

The backends here are test doubles: "building" raises KernelsBuilding as tilelang_sm90 does while its build is
under way, "stand_in" computes with the reference backend's entry points, so every result can be checked against
a recurrence written here."""
from __future__ import annotations

import pytest
import torch

import gdnkit
from gdnkit import dispatch
from gdnkit.backends.reference import BACKEND as REFERENCE
from gdnkit.dispatch import KernelsBuilding, registry

from conftest import make_inputs


def recurrence(q, k, v, g, beta, initial_state, scale):
    """o and the final state, token by token, in float64 (no in-place writes: autograd goes through it)."""
    T, H, HV = q.shape[1], q.shape[2], v.shape[2]
    states = list(initial_state.unbind(1))   # per value head: [B, K, V]
    rows = []
    for t in range(T):
        row = []
        for hv in range(HV):
            h = hv // (HV // H)
            S = states[hv] * g[:, t, hv].exp()[:, None, None]
            err = v[:, t, hv] - torch.einsum("bk,bkv->bv", k[:, t, h], S)
            S = S + beta[:, t, hv][:, None, None] * k[:, t, h][:, :, None] * err[:, None, :]
            states[hv] = S
            row.append(scale * torch.einsum("bk,bkv->bv", q[:, t, h], S))
        rows.append(torch.stack(row, 1))
    return torch.stack(rows, 1), torch.stack(states, 1)


class _Delegating(dispatch.Backend):
    """Runs the reference backend's entry points (counted), under its own name and priority."""

    description = "test backend"

    def __init__(self, name, priority):
        self.name, self.priority, self.calls = name, priority, []

    def supports(self, problem, machine):
        return []

    def chunk_forward(self, problem, inputs):
        self.calls.append("forward")
        return REFERENCE.chunk_forward(problem, inputs)

    def chunk_backward(self, problem, saved, do, dht):
        self.calls.append("backward")
        return REFERENCE.chunk_backward(problem, saved, do, dht)

    recurrent_forward = recurrent_backward = None


class Building(_Delegating):
    """Its kernels are building for the first `building_calls` forwards that may be deferred."""

    def __init__(self, building_calls):
        super().__init__("building", 1001)
        self.building_calls, self.resumed, self.raised = building_calls, 0, 0

    def chunk_forward_unless_building(self, problem, inputs):
        if self.building_calls == 0:
            return self.chunk_forward(problem, inputs)
        self.building_calls -= 1

        def resume():
            self.resumed += 1
            return self.chunk_forward(problem, inputs)
        self.raised += 1
        raise KernelsBuilding("H=1, HV=2", resume, first=self.raised == 1)   # the call that started the build


@pytest.fixture
def backends(monkeypatch):
    building, stand_in = Building(building_calls=2), _Delegating("stand_in", 1000)
    for backend in (building, stand_in):
        monkeypatch.setitem(registry._registry, backend.name, backend)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.delenv("GDNKIT_STAND_IN", raising=False)
    return building, stand_in


def _inputs(seed):
    x = make_inputs(1, 37, 1, 2, 8, 4, seed=seed)
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        x[name].requires_grad_(True)
    return x


def test_a_training_step_runs_on_the_stand_in_while_kernels_build(backends, capsys):
    building, stand_in = backends
    x = _inputs(seed=1)
    o, ht = gdnkit.chunk_gated_delta_rule(**x, output_final_state=True)
    expected_o, expected_ht = recurrence(*(x[n].detach() for n in ("q", "k", "v", "g", "beta", "initial_state")),
                                         scale=8 ** -0.5)
    assert torch.linalg.norm(o - expected_o) / torch.linalg.norm(expected_o) < 1e-10
    assert torch.linalg.norm(ht - expected_ht) / torch.linalg.norm(expected_ht) < 1e-10
    (o.square().sum() + ht.sum()).backward()
    # the stand-in ran the forward and its own backward; the building backend ran nothing and waited for nothing
    assert stand_in.calls == ["forward", "backward"] and building.calls == [] and building.resumed == 0
    assert "until building's kernels for H=1, HV=2 are built, its calls run on stand_in" in capsys.readouterr().err
    # the gradient is the recurrence's
    leaves = [x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    ro, rht = recurrence(*leaves, scale=8 ** -0.5)
    (ro.square().sum() + rht.sum()).backward()
    for name, leaf in zip(("q", "k", "v", "g", "beta", "initial_state"), leaves):
        assert torch.linalg.norm(x[name].grad - leaf.grad) / torch.linalg.norm(leaf.grad) < 1e-9, name

    # a second call while the build goes on: the stand-in again, announced once only
    gdnkit.chunk_gated_delta_rule(**_inputs(seed=2), output_final_state=True)
    assert stand_in.calls == ["forward", "backward", "forward"] and "until" not in capsys.readouterr().err
    # built: the backend itself, forward and backward
    y = _inputs(seed=3)
    o, _ = gdnkit.chunk_gated_delta_rule(**y)
    o.sum().backward()
    assert building.calls == ["forward", "backward"] and len(stand_in.calls) == 3


@pytest.mark.parametrize("how", ["argument", "environment", "no stand-in"])
def test_a_named_backend_or_GDNKIT_STAND_IN_0_waits_for_the_kernels(backends, monkeypatch, how):
    building, stand_in = backends
    kwargs = {}
    if how == "argument":
        kwargs["backend"] = "building"
    else:
        monkeypatch.setenv("GDNKIT_STAND_IN", "0") if how == "no stand-in" else monkeypatch.setenv(
            dispatch.ENV_VAR, "building")
    x = make_inputs(1, 20, 1, 2, 8, 4, seed=4)
    o, _ = gdnkit.chunk_gated_delta_rule(**x, **kwargs)
    expected, _ = recurrence(*(x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")), scale=8 ** -0.5)
    assert torch.linalg.norm(o - expected) / torch.linalg.norm(expected) < 1e-10
    assert building.resumed == 1 and building.calls == ["forward"] and stand_in.calls == []


def test_the_reference_is_never_a_stand_in(backends, monkeypatch):
    building, stand_in = backends
    monkeypatch.delitem(registry._registry, stand_in.name)
    x = make_inputs(1, 20, 1, 2, 8, 4, seed=5)
    gdnkit.chunk_gated_delta_rule(**x)
    assert building.resumed == 1   # waited: its float64 recurrence would be slower than the build


def test_GDNKIT_STAND_IN_is_checked(backends, monkeypatch):
    monkeypatch.setenv("GDNKIT_STAND_IN", "yes")
    with pytest.raises(ValueError, match="GDNKIT_STAND_IN must be 0 .* or 1 .*, got 'yes'"):
        gdnkit.chunk_gated_delta_rule(**make_inputs(1, 20, 1, 2, 8, 4, seed=6))
