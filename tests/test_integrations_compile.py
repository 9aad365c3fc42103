"""torch.compile(fullgraph=True) over a module calling both gdnkit functions: no graph break, eager's outputs and
gradients, no recompilation across sequence lengths or packings, and a second-order gradient raises."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import gdnkit


class TwoCalls(torch.nn.Module):
    """A prefill by the chunked call, then the recurrent call over the same tokens from its final state, with the
    in-kernel gate, beta sigmoid and qk l2norm options (parameters A_log and dt_bias get gradients)."""

    def __init__(self, HV):
        super().__init__()
        self.A_log = torch.nn.Parameter(torch.linspace(-1.0, 0.5, HV))
        self.dt_bias = torch.nn.Parameter(torch.linspace(0.2, -0.3, HV))

    def forward(self, q, k, v, a, b, cu_seqlens=None):
        o, ht = gdnkit.chunk_gated_delta_rule(q, k, v, a, b, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                              A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True,
                                              output_final_state=True, cu_seqlens=cu_seqlens)
        o2, ht2 = gdnkit.fused_recurrent_gated_delta_rule(q, k, o, a, b.sigmoid(), initial_state=ht,
                                                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                          use_gate_in_kernel=True, A_log=self.A_log,
                                                          cu_seqlens=cu_seqlens)
        return o2, ht2


def _inputs(T, seed, H=1, HV=2, K=16, V=8):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return [r(1, T, H, K), r(1, T, H, K), r(1, T, HV, V), r(1, T, HV), r(1, T, HV)]


def _loss(o, ht):
    return (o * torch.linspace(-1, 1, o.shape[-1])).sum() + ht.square().sum()


def _run(fn, module, x, cu=None):
    leaves = [t.clone().requires_grad_() for t in x]
    module.zero_grad(set_to_none=True)
    o, ht = fn(*leaves, cu)
    _loss(o, ht).backward()
    return o.detach(), ht.detach(), [t.grad for t in leaves] + [p.grad.clone() for p in module.parameters()]


def _assert_same(got, want):
    (o, ht, grads), (wo, wht, wgrads) = got, want
    assert torch.allclose(o, wo, rtol=1e-6, atol=1e-6) and torch.allclose(ht, wht, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, wgrads):
        assert b.abs().max() > 0 and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_matches_eager_without_recompiling(backend):
    module = TwoCalls(HV=2)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=True)
    for T, seed in ((23, 0), (64, 1), (97, 2)):
        x = _inputs(T, seed)
        _assert_same(_run(compiled, module, x), _run(module, module, x))
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times for 3 lengths"


def test_varlen_cu_seqlens_do_not_recompile():
    # Two or more sequences each time: torch specialises a size of 1 (one sequence) into its own graph.
    module = TwoCalls(HV=2)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=True)
    for T, offsets in ((40, [0, 7, 40]), (75, [0, 1, 30, 30, 75]), (52, [0, 20, 52])):
        x = _inputs(T, T)
        cu = torch.tensor(offsets, dtype=torch.int32)
        _assert_same(_run(compiled, module, x, cu), _run(module, module, x, cu))
    assert counter.frame_count == 1


def test_mark_dynamic_inputs_compile_once():
    module = TwoCalls(HV=2)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    for T in (30, 31, 70):
        x = _inputs(T, T)
        for t in x:
            torch._dynamo.mark_dynamic(t, 1)
        _assert_same(_run(compiled, module, x), _run(module, module, x))
    assert counter.frame_count == 1


def test_fake_shapes_without_values():
    """The fake impl gives every output's shape and dtype from shapes alone: N from cu_seqlens' length, the state
    [N, HV, K, V] ([N, HV, V, K] with state_v_first), float64 for float64 inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(1, 50, 2, 16, dtype=torch.float64), torch.empty(1, 50, 2, 16, dtype=torch.float64)
        v = torch.empty(1, 50, 4, 8, dtype=torch.float64)
        g, beta = torch.empty(1, 50, 4), torch.empty(1, 50, 4)
        cu = torch.empty(4, dtype=torch.int32)
        o, ht = torch.ops.gdnkit.chunk_gated_delta_rule(q, k, v, g, beta, None, None, None, cu, None, True, False,
                                                        False, False, False, True, None, False)
        assert o.shape == v.shape and o.dtype == v.dtype
        assert ht.shape == (3, 4, 8, 16) and ht.dtype == torch.float64
        o, ht = torch.ops.gdnkit.fused_recurrent_gated_delta_rule(q.float(), k.float(), v.float(), g, beta, None, None,
                                                                  None, None, 0.5, False, False, False, False, False,
                                                                  False, None, False)
        assert o.shape == v.shape and ht.numel() == 0


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_second_order_gradient_raises(backend):
    x = [t.requires_grad_() for t in _inputs(12, 5)]
    compiled = torch.compile(lambda q, k, v, g, b: gdnkit.chunk_gated_delta_rule(q, k, v, F.logsigmoid(g),
                                                                                 b.sigmoid())[0],
                             backend=backend, fullgraph=True)
    o = compiled(*x)
    (dq,) = torch.autograd.grad(o.sum(), x[0], create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(dq.sum(), x[0])


def test_serving_call_stays_a_graph_break():
    """The serving interface writes a state pool in place; it runs eagerly, outside the graph."""
    x = _inputs(1, 7)
    pool = torch.randn(4, 2, 16, 8)
    idx = torch.tensor([2], dtype=torch.int32)

    def step(q, k, v, g, b, pool):
        o, _ = gdnkit.fused_recurrent_gated_delta_rule(q, k, v, F.logsigmoid(g), b.sigmoid(), initial_state=pool,
                                                       ssm_state_indices=idx)
        return o * 2

    want_pool = pool.clone()
    want = step(*x, want_pool)
    assert torch._dynamo.explain(step)(*x, pool.clone()).graph_break_count >= 1
    got_pool = pool.clone()
    got = torch.compile(step, backend="aot_eager")(*x, got_pool)
    assert torch.allclose(got, want) and torch.allclose(got_pool, want_pool)
    assert not torch.equal(got_pool[2], pool[2]) and torch.equal(got_pool[[0, 1, 3]], pool[[0, 1, 3]])


@pytest.mark.gpu
def test_inductor_on_gpu_matches_eager():
    """On the GPU with inductor: the compiled module (gdnkit's GPU backends inside the ops) equals eager, forward and
    backward, and compiles once for three lengths."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    module = TwoCalls(HV=32).cuda()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=True)

    def run(fn, x):
        leaves = [t.clone().requires_grad_() for t in x]
        module.zero_grad(set_to_none=True)
        o, ht = fn(*leaves)
        (o.float().square().sum() + ht.square().sum()).backward()
        return [o.detach(), ht.detach()] + [t.grad for t in leaves] + [p.grad.clone() for p in module.parameters()]

    for T in (300, 1000, 4096):
        x = [t.cuda().bfloat16() if i < 3 else t.cuda() for i, t in enumerate(_inputs(T, T, H=16, HV=32, K=128, V=128))]
        for a, b in zip(run(compiled, x), run(module, x)):
            assert torch.equal(a, b) or float((a.float() - b.float()).norm() / b.float().norm()) < 1e-3
    assert counter.frame_count == 1
