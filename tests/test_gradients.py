"""Gradients through the public calls: torch.autograd.gradcheck in float64 on tiny problems."""
from __future__ import annotations

import pytest
import torch

import gdnkit

from conftest import make_inputs, rel_err

CALLS = [gdnkit.chunk_gated_delta_rule, gdnkit.fused_recurrent_gated_delta_rule]


def _leaves(x: dict) -> dict:
    return {n: t.clone().requires_grad_() for n, t in x.items() if t is not None}


# the chunked form at T = 67 runs the chunked reference ~2000 times: 50-90 s each on a busy 2-core machine
@pytest.mark.parametrize("fn", [pytest.param(CALLS[0], marks=pytest.mark.slow), CALLS[1]], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("options", [
    {},
    {"use_qk_l2norm_in_kernel": True, "use_beta_sigmoid_in_kernel": True, "allow_neg_eigval": True},
    {"use_gate_in_kernel": True, "state_v_first": True},
], ids=["plain", "l2norm+sigmoid", "gate+v_first"])
def test_gradcheck_every_input(fn, options):
    gate_on = options.get("use_gate_in_kernel", False)
    x = make_inputs(1, 67 if fn is CALLS[0] else 5, 1, 2, 3, 2, seed=11,
                    raw_gates=gate_on or options.get("use_beta_sigmoid_in_kernel", False))
    if not gate_on and options.get("use_beta_sigmoid_in_kernel"):
        x["g"] = torch.nn.functional.logsigmoid(x["g"])
    if options.get("state_v_first"):
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    extra = {}
    if gate_on:
        gen = torch.Generator().manual_seed(12)
        extra = {"A_log": torch.randn(2, generator=gen, dtype=torch.float64) * 0.3,
                 "dt_bias": torch.randn(2, generator=gen, dtype=torch.float64)}
    leaves = _leaves({**x, **extra})
    names = list(leaves)

    def f(*tensors):
        kw = dict(zip(names, tensors))
        o, s = fn(**kw, output_final_state=True, **options, backend="reference")
        return o, s  # gradcheck feeds random dO and dht: the final state's gradient flows back

    assert torch.autograd.gradcheck(f, tuple(leaves.values()), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_varlen_gradients_match_separate_sequences():
    x = make_inputs(1, 90, 1, 2, 4, 4, seed=13, N=3)
    cu = torch.tensor([0, 0, 37, 90])
    leaves = _leaves(x)
    o, s = gdnkit.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, output_final_state=True)
    (o.square().sum() + s.sum()).backward()
    for i, (a, b) in enumerate([(0, 0), (0, 37), (37, 90)]):
        part = _leaves({n: t[:, a:b] for n, t in x.items() if n != "initial_state"}
                       | {"initial_state": x["initial_state"][i:i + 1]})
        o_i, s_i = gdnkit.chunk_gated_delta_rule(**part, output_final_state=True)
        (o_i.square().sum() + s_i.sum()).backward()
        assert rel_err(leaves["initial_state"].grad[i:i + 1], part["initial_state"].grad) < 1e-10
        if b > a:
            for n in ("q", "k", "v", "g", "beta"):
                assert rel_err(leaves[n].grad[:, a:b], part[n].grad) < 1e-10, n


def test_no_graph_without_grad_and_backward_through_output_only():
    x = make_inputs(1, 20, 1, 1, 4, 4, seed=14)
    o, s = gdnkit.chunk_gated_delta_rule(**x, output_final_state=True)
    assert o.grad_fn is None and s.grad_fn is None
    leaves = _leaves(x)
    o, _ = gdnkit.chunk_gated_delta_rule(**leaves)  # no final state: dht is absent
    o.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves.values())


@pytest.mark.parametrize("group", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_gva_sums_round_once(group, dtype):
    # dq / dk of a q/k head: its value heads' fp32 gradients summed in head order, then rounded once to the
    # output dtype, written by the sum itself (the backends skip a cast pass over the fp32 sums)
    from gdnkit import prologue
    x = torch.randn(2, 7, 3 * group, 16, generator=torch.Generator().manual_seed(group))
    parts = x.view(2, 7, 3, group, 16).unbind(3)
    want = parts[0]
    for p in parts[1:]:
        want = want + p
    want = want if dtype is None else want.to(dtype)
    got = prologue.sum_head_groups(x, 3, dtype)
    assert got.dtype == (dtype or torch.float32) and torch.equal(got, want)
    leaf = x.clone().requires_grad_()  # under autograd too (no out= there)
    assert torch.equal(prologue.sum_head_groups(leaf, 3, dtype).detach(), want)
