"""gdnkit under torch.compile: each call is one gdnkit:: custom op in the graph (no graph break), and a compiled
model gives eager's outputs and gradients. tests/test_integrations_compile.py covers dynamic shapes and options."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import gdnkit


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    B, T, H, HV, K, V = 1, 70, 1, 2, 16, 16
    return dict(q=F.normalize(r(B, T, H, K), dim=-1), k=F.normalize(r(B, T, H, K), dim=-1), v=r(B, T, HV, V),
                g=F.logsigmoid(r(B, T, HV)), beta=torch.rand(B, T, HV, generator=gen))


def _layer(q, k, v, g, beta):
    o, _ = gdnkit.chunk_gated_delta_rule(q * 1.5, k, v, g, beta, backend="reference")
    o2, _ = gdnkit.fused_recurrent_gated_delta_rule(q, k, o, g, beta, backend="reference")
    return (o2 * o).sum()


def test_compiled_model_matches_eager_with_gradients():
    x = _inputs()
    eager_leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    want = _layer(**eager_leaves)
    want_grads = torch.autograd.grad(want, list(eager_leaves.values()))
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    got = torch.compile(_layer, backend="eager")(**leaves)
    got_grads = torch.autograd.grad(got, list(leaves.values()))
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_calls_are_custom_ops_not_graph_breaks():
    explanation = torch._dynamo.explain(_layer)(**_inputs(1))
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
    ops = "\n".join(str(g.graph) for g in explanation.graphs)
    assert "gdnkit.chunk_gated_delta_rule" in ops and "gdnkit.fused_recurrent_gated_delta_rule" in ops, ops
