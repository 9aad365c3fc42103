"""What a serving or training user relies on beyond the numbers: state pools whose slots share memory are refused,
final states never alias the caller's tensors, second-order gradients raise instead of vanishing."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import gdnkit

H, HV, K, V = 1, 2, 8, 4


def _decode(N=3, T=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=rnd(N, T, H, K), k=rnd(N, T, H, K), v=rnd(N, T, HV, V), g=F.logsigmoid(rnd(N, T, HV)),
                beta=torch.rand(N, T, HV, generator=gen))


@pytest.mark.parametrize("pool", [
    torch.zeros(1, HV, K, V).expand(5, HV, K, V),                            # one memory for every slot
    torch.zeros(5 * HV * K * V).as_strided((5, HV, K, V), (K * V, K * V, V, 1)),  # slot n overlaps slot n + 1
], ids=["expanded", "overlapping"])
@pytest.mark.parametrize("idx", [[0, 1, 2], [[0, 1], [2, 3], [4, -1]]], ids=["1d", "2d"])
def test_pool_slots_sharing_memory_are_refused(pool, idx):
    idx = torch.tensor(idx, dtype=torch.int32)
    call = _decode(T=idx.dim())
    with pytest.raises(ValueError, match="initial_state.*share memory"):
        gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=idx)
    assert (pool == 0).all()  # refused before anything ran


def test_read_only_expanded_pool_is_fine():
    """inplace_final_state=False only reads the pool: one shared start state for every sequence is legitimate."""
    call = _decode()
    start = torch.randn(1, HV, K, V)
    o, ht = gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=start.expand(4, HV, K, V),
                                                    ssm_state_indices=torch.tensor([3, 0, 2]),
                                                    inplace_final_state=False, output_final_state=True)
    o_ref, ht_ref = gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=start.expand(3, HV, K, V).clone(),
                                                            output_final_state=True)
    assert torch.allclose(o, o_ref) and torch.allclose(ht, ht_ref)


@pytest.mark.parametrize("fn", [gdnkit.chunk_gated_delta_rule, gdnkit.fused_recurrent_gated_delta_rule])
def test_final_state_is_new_memory(fn):
    """A plain call's final state never aliases initial_state (expanded or not): the caller's tensor is untouched."""
    call = _decode()
    for h0 in (torch.randn(3, HV, K, V), torch.randn(1, HV, K, V).expand(3, HV, K, V)):
        before = h0.clone()
        _, ht = fn(**call, initial_state=h0, output_final_state=True)
        assert torch.equal(h0, before)
        assert ht.untyped_storage().data_ptr() != h0.untyped_storage().data_ptr()
        ht.add_(1)
        assert torch.equal(h0, before)


def _grad_inputs(seed=1):
    call = _decode(N=2, T=5, seed=seed)
    return {n: t.double().requires_grad_() for n, t in call.items()}


@pytest.mark.parametrize("fn", [gdnkit.chunk_gated_delta_rule, gdnkit.fused_recurrent_gated_delta_rule])
def test_double_backward_raises(fn):
    """create_graph=True through gdnkit raises, naming double backward, where dq used to come back without a graph
    (a gradient penalty silently lost gdnkit's term). Plain first-order gradients are unaffected."""
    call = _grad_inputs()
    o, _ = fn(**call)
    dq, = torch.autograd.grad((o ** 2).sum(), call["q"])
    assert torch.isfinite(dq).all() and dq.abs().sum() > 0
    o, _ = fn(**call)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((o ** 2).sum(), call["q"], create_graph=True)
    o, _ = fn(**call)
    with pytest.raises(RuntimeError, match="double backward"):
        (o ** 2).sum().backward(create_graph=True)
    o, _ = fn(**call)
    loss = (o ** 2).sum() + call["k"].pow(2).sum()
    with pytest.raises(RuntimeError, match="double backward"):  # a loss with other terms beside gdnkit's
        torch.autograd.grad(loss, [call["q"], call["k"]], create_graph=True)


@pytest.mark.parametrize("backend", ["reference", "triton_generic"])
def test_garbage_past_the_last_sequence_gets_zero_gradient(backend):
    """Tokens past cu_seqlens[-1] belong to no sequence: whatever they hold (NaN, Inf), their outputs and their
    gradients are zero, and the gradients of what every token shares (A_log, dt_bias) stay those of the live tokens.
    triton_generic runs its entry points (the Triton interpreter on a CPU)."""
    if backend == "triton_generic":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton_generic needs a GPU or the Triton interpreter")
    gen = torch.Generator().manual_seed(7)
    T, end, H, HV, K, V = 90, 70, 1, 2, 16, 16
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    live = dict(q=torch.randn(1, T, H, K, generator=gen), k=F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1),
                v=torch.randn(1, T, HV, V, generator=gen), g=torch.randn(1, T, HV, generator=gen),
                beta=torch.randn(1, T, HV, generator=gen))
    live = {n: t.to(dev) for n, t in live.items()}
    shared = dict(A_log=torch.randn(HV, generator=gen).to(dev) * 0.1, dt_bias=torch.randn(HV, generator=gen).to(dev) * 0.1)
    cu = torch.tensor([0, 30, end], dtype=torch.int32, device=dev)
    weights = torch.linspace(-1, 1, V, device=dev)

    def grads(tensors):
        leaves = {n: t.clone().requires_grad_() for n, t in {**tensors, **shared}.items()}
        call = dict(leaves, cu_seqlens=cu, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
        if backend == "triton_generic" and dev == "cpu":   # the entry points: the autograd glue needs dispatch
            from gdnkit.backends.triton_generic import BACKEND
            from gdnkit.problem import CHUNK_MODE, validate_inputs
            problem, inputs = validate_inputs(CHUNK_MODE, **call)
            o, _, saved = BACKEND.chunk_forward(problem, inputs)
            do = torch.zeros_like(o)
            do[:, :end] = weights
            got = BACKEND.chunk_backward(problem, saved, do, None)
            return o, dict(zip(("q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias"), got))
        o, _ = gdnkit.chunk_gated_delta_rule(**call, backend=backend)
        (o[:, :end] * weights).sum().backward()
        return o, {n: t.grad for n, t in leaves.items()}

    o_clean, clean = grads(live)
    garbage = {n: t.clone() for n, t in live.items()}
    for n, t in garbage.items():
        t[:, end:] = float("nan") if n in ("g", "v") else float("inf")
    o_bad, bad = grads(garbage)
    assert torch.equal(o_bad[:, end:], torch.zeros_like(o_bad[:, end:]))
    torch.testing.assert_close(o_bad, o_clean, rtol=0, atol=0)
    for n in (*live, *shared):
        assert torch.isfinite(bad[n]).all(), n
        torch.testing.assert_close(bad[n], clean[n], rtol=1e-6, atol=1e-6, msg=n)
        if n in live:
            assert not bad[n][:, end:].any(), n


@pytest.mark.parametrize("lengths,state_v_first", [((0, 0), False), ((0,), True)])
def test_sm90_training_call_with_no_chunk(lengths, state_v_first):
    """A tilelang_sm90 training call where no sequence has a token (T = 0, or only tokens past cu_seqlens[-1])
    keeps nothing from its forward; its backward still returns every gradient, as the reference does: zeros, and
    dh0 = dht (each final state is its initial state). Runs the backward's host code on a CPU."""
    pytest.importorskip("tilelang")
    from gdnkit.backends.tilelang_sm90.backward import backward
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    gen = torch.Generator().manual_seed(5)
    N, T, H, HV, K, V = len(lengths), 3, 1, 2, 8, 8
    call = dict(q=torch.randn(1, T, H, K, generator=gen), k=torch.randn(1, T, H, K, generator=gen),
                v=torch.randn(1, T, HV, V, generator=gen), g=-torch.rand(1, T, HV, generator=gen),
                beta=torch.rand(1, T, HV, generator=gen), initial_state=torch.randn(N, HV, K, V, generator=gen),
                A_log=torch.zeros(HV), dt_bias=torch.zeros(HV))
    call = {n: t.requires_grad_() for n, t in call.items()}
    cu = torch.tensor([0, *lengths], dtype=torch.int32)
    options = dict(cu_seqlens=cu, use_gate_in_kernel=True, state_v_first=state_v_first)
    o, ht = gdnkit.chunk_gated_delta_rule(**call, output_final_state=True, backend="reference", **options)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    want = torch.autograd.grad([o, ht], list(call.values()), [do, dht], allow_unused=True)
    problem, _ = validate_inputs(CHUNK_MODE, **call, output_final_state=True, **options)
    got = backward(problem, None, do, dht)
    for name, w, x in zip(call, want, got):
        w = torch.zeros_like(call[name]) if w is None else w
        assert x is not None and x.shape == w.shape, name
        torch.testing.assert_close(x.float(), w.float(), msg=name)
