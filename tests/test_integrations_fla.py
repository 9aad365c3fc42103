"""FLA's own chunk_gated_delta_rule routed to gdnkit through FLA's backend registry (fla-core 0.6 from the index).

FLA's chunked kernels do not run on the CPU (its Triton launch finds no driver there, interpreter or not), so on
the CPU a call that returns the right values is one gdnkit served; with the backend off, FLA's own path runs and
fails. The GPU test checks the routing where FLA's kernels do run, against them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule")

import gdnkit  # noqa: E402
from gdnkit.integrations import fla as gdn_fla  # noqa: E402


def _oracle(q, k, v, g, beta, h0, cu):
    """Token-by-token float64 recurrence, one sequence per cu_seqlens span; GVA by q/k head j // (HV // H)."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    HV, H = v.shape[2], q.shape[2]
    q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
    o = torch.zeros_like(v)
    states = []
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        S = h0[n].double().clone()
        for t in range(s, e):
            S = S * g[0, t].exp()[:, None, None]
            u = beta[0, t][:, None] * (v[0, t] - torch.einsum("hkv,hk->hv", S, k[0, t]))
            S = S + torch.einsum("hk,hv->hkv", k[0, t], u)
            o[0, t] = torch.einsum("hkv,hk->hv", S, q[0, t]) * q.shape[-1] ** -0.5
        states.append(S)
    return o, torch.stack(states)


def _inputs(T=45, H=2, HV=4, K=16, V=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return (F.normalize(r(1, T, H, K), dim=-1), F.normalize(r(1, T, H, K), dim=-1), r(1, T, HV, V),
            F.logsigmoid(r(1, T, HV)), torch.rand(1, T, HV, generator=gen), r(3, HV, K, V))


@pytest.fixture
def routed():
    gdn_fla.enable()
    gdn_fla.calls.clear()
    yield
    gdn_fla.disable()


def test_fla_chunk_returns_gdnkit_results_on_cpu(routed):
    q, k, v, g, beta, h0 = _inputs()
    cu = torch.tensor([0, 20, 20, 45], dtype=torch.long)
    # FLA's positional order, its varlen hints and its keyword-only gate options, as an FLA user writes them
    o, ht = fla_gdn.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, True, cu_seqlens=cu, cu_seqlens_cpu=cu,
                                           chunk_size=64)
    assert gdn_fla.calls == {"chunk_gated_delta_rule": 1}
    want_o, want_ht = _oracle(q, k, v, g, beta, h0, cu)
    assert torch.allclose(o.double(), want_o, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ht.double(), want_ht, rtol=1e-5, atol=1e-5)
    direct = gdnkit.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(o, direct[0]) and torch.equal(ht, direct[1])


def test_fla_chunk_gradients_through_gdnkit(routed):
    q, k, v, g, beta, h0 = (t.requires_grad_() for t in _inputs(T=21, seed=1))
    h0 = h0[:1].detach().requires_grad_()
    o, ht = fla_gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    loss = (o * o.detach().sin()).sum() + ht.square().sum()
    got = torch.autograd.grad(loss, (q, k, v, g, beta, h0))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, g, beta, h0)]
    wo, wht = _oracle(*leaves, torch.tensor([0, 21]))
    want = torch.autograd.grad((wo * o.detach().double().sin()).sum() + wht.square().sum(), leaves)
    for a, b in zip(got, want):
        assert torch.allclose(a.double(), b, rtol=1e-4, atol=1e-5)


def test_disabled_backend_leaves_fla_alone(routed):
    q, k, v, g, beta, _ = _inputs(T=8)
    gdn_fla.disable()
    assert not gdn_fla.is_enabled()
    with pytest.raises(Exception):  # FLA's own Triton path, which has no CPU driver
        fla_gdn.chunk_gated_delta_rule(q, k, v, g, beta)
    assert not gdn_fla.calls
    gdn_fla.enable()
    fla_gdn.chunk_gated_delta_rule(q, k, v, g, beta)
    assert gdn_fla.calls == {"chunk_gated_delta_rule": 1}


def test_env_switch_turns_it_off(routed, monkeypatch):
    monkeypatch.setenv(gdn_fla.ENV_VAR, "0")
    assert not gdn_fla.is_enabled()
    monkeypatch.setenv(gdn_fla.ENV_VAR, "1")
    assert gdn_fla.is_enabled()


def test_declined_calls_go_back_to_fla(routed):
    """An FLA option gdnkit does not implement is declined by the verifier, so FLA's own path gets it."""
    q, k, v, g, beta, _ = _inputs(T=8)
    backend = gdn_fla._backend_class()
    accepted, reason = backend.chunk_gated_delta_rule_verifier(q, k, v, g, beta, cp_context=object())
    assert not accepted and "cp_context" in reason
    assert backend.chunk_gated_delta_rule_verifier(q, k, v, g, beta) == (True, None)


@pytest.mark.gpu
def test_fla_chunk_routed_matches_fla_kernels_on_gpu():
    """On the GPU: FLA's function with gdnkit registered equals FLA's own kernels (bf16, 16/32 heads, K=V=128)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    T, H, HV, K = 1000, 16, 32, 128
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    q, k = (F.normalize(r(1, T, H, K), dim=-1).bfloat16() for _ in range(2))
    v = r(1, T, HV, K).bfloat16()
    g, beta = F.logsigmoid(r(1, T, HV)), torch.rand(1, T, HV, generator=gen, device="cuda")
    cu = torch.tensor([0, 300, 1000], device="cuda", dtype=torch.long)
    want, want_ht = fla_gdn.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    gdn_fla.enable()
    gdn_fla.calls.clear()
    try:
        got, got_ht = fla_gdn.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    finally:
        gdn_fla.disable()
    assert gdn_fla.calls == {"chunk_gated_delta_rule": 1}
    err = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    assert err(got, want) < 5e-3 and err(got_ht, want_ht) < 5e-3
