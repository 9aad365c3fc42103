"""Properties of the reference backend, in float64, on problems drawn by hypothesis."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import gdnkit
from gdnkit.backends.reference import chunked_gdn, recurrent_gdn
from gdnkit.prep import beta_activation, gate, l2norm

from conftest import make_inputs, rel_err

TIGHT = 1e-10
SETTINGS = settings(max_examples=25, deadline=None)

heads = st.sampled_from([(1, 1), (1, 2), (2, 2), (2, 4), (1, 3)])
dims = st.sampled_from([(4, 4), (8, 16), (16, 8)])


def call(fn=gdnkit.chunk_gated_delta_rule, **kw):
    return fn(**kw, backend="reference")


@SETTINGS
@given(B=st.integers(1, 2), T=st.integers(1, 150), heads=heads, dims=dims, seed=st.integers(0, 2**16),
       h0=st.booleans())
def test_chunked_equals_recurrent(B, T, heads, dims, seed, h0):
    inputs = make_inputs(B, T, *heads, *dims, seed=seed, initial_state=h0)
    o_c, s_c = call(**inputs, output_final_state=True)
    o_r, s_r = call(gdnkit.fused_recurrent_gated_delta_rule, **inputs, output_final_state=True)
    assert o_c.dtype == torch.float64 and s_c.dtype == torch.float64
    assert rel_err(o_c, o_r) < TIGHT
    assert rel_err(s_c, s_r) < TIGHT


@SETTINGS
@given(lengths=st.lists(st.integers(0, 90), min_size=1, max_size=4), heads=heads, seed=st.integers(0, 2**16),
       chunked=st.booleans())
def test_varlen_equals_separate_calls(lengths, heads, seed, chunked):
    fn = gdnkit.chunk_gated_delta_rule if chunked else gdnkit.fused_recurrent_gated_delta_rule
    T = sum(lengths)
    inputs = make_inputs(1, T, *heads, 8, 8, seed=seed, N=len(lengths))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.long)
    o, s = call(fn, **inputs, cu_seqlens=cu, output_final_state=True)
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {n: t[:, start:end] for n, t in inputs.items() if n != "initial_state"}
        o_i, s_i = call(fn, **part, initial_state=inputs["initial_state"][i:i + 1], output_final_state=True)
        if end > start:
            assert rel_err(o[:, start:end], o_i) < TIGHT
        assert rel_err(s[i:i + 1], s_i) < TIGHT  # a zero-length sequence hands its state through


@SETTINGS
@given(T=st.integers(2, 200), split=st.floats(0.05, 0.95), heads=heads, seed=st.integers(0, 2**16))
def test_two_halves_passing_state_equal_one_call(T, split, heads, seed):
    inputs = make_inputs(2, T, *heads, 8, 8, seed=seed)
    cut = max(1, min(T - 1, int(T * split)))
    o, s = call(**inputs, output_final_state=True)
    first = {n: t[:, :cut] for n, t in inputs.items() if n != "initial_state"}
    second = {n: t[:, cut:] for n, t in inputs.items() if n != "initial_state"}
    o1, s1 = call(**first, initial_state=inputs["initial_state"], output_final_state=True)
    o2, s2 = call(**second, initial_state=s1, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), o) < TIGHT
    assert rel_err(s2, s) < TIGHT


@SETTINGS
@given(T=st.integers(1, 130), H=st.integers(1, 3), group=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_gva_equals_repeated_qk(T, H, group, seed):
    inputs = make_inputs(1, T, H, H * group, 8, 8, seed=seed)
    o, s = call(**inputs, output_final_state=True)
    repeated = dict(inputs, q=inputs["q"].repeat_interleave(group, 2), k=inputs["k"].repeat_interleave(group, 2))
    o_rep, s_rep = call(**repeated, output_final_state=True)
    assert rel_err(o, o_rep) < TIGHT and rel_err(s, s_rep) < TIGHT


@SETTINGS
@given(T=st.integers(1, 100), l2=st.booleans(), gate_on=st.booleans(), dt_bias=st.booleans(),
       sigmoid=st.booleans(), neg=st.booleans(), v_first=st.booleans(), seed=st.integers(0, 2**16))
def test_flags_equal_doing_it_by_hand(T, l2, gate_on, dt_bias, sigmoid, neg, v_first, seed):
    neg = neg and sigmoid
    inputs = make_inputs(1, T, 2, 4, 8, 8, seed=seed, raw_gates=True)
    gen = torch.Generator().manual_seed(seed + 1)
    A_log = torch.randn(4, generator=gen, dtype=torch.float64) if gate_on else None
    bias = torch.randn(4, generator=gen, dtype=torch.float64) if gate_on and dt_bias else None
    flagged = dict(inputs, initial_state=inputs["initial_state"].transpose(-1, -2) if v_first else inputs["initial_state"])
    o, s = call(**flagged, output_final_state=True, use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate_on,
                A_log=A_log, dt_bias=bias, use_beta_sigmoid_in_kernel=sigmoid, allow_neg_eigval=neg,
                state_v_first=v_first)
    by_hand = dict(inputs)
    if l2:
        by_hand["q"], by_hand["k"] = l2norm(inputs["q"]), l2norm(inputs["k"])
    if gate_on:
        by_hand["g"] = gate(inputs["g"], A_log, bias)
    else:  # without the in-kernel gate, g must be a log-decay: use the raw draw through logsigmoid
        by_hand["g"] = flagged["g"] = F.logsigmoid(inputs["g"])
        o, s = call(**flagged, output_final_state=True, use_qk_l2norm_in_kernel=l2,
                    use_beta_sigmoid_in_kernel=sigmoid, allow_neg_eigval=neg, state_v_first=v_first)
    by_hand["beta"] = beta_activation(inputs["beta"], neg) if sigmoid else inputs["beta"]
    o_h, s_h = call(**by_hand, output_final_state=True)
    assert rel_err(o, o_h) < TIGHT
    assert rel_err(s.transpose(-1, -2) if v_first else s, s_h) < TIGHT


def test_chunk_trace_intermediates_are_consistent():
    """The exposed intermediates satisfy their defining equations (docs/algorithm.md, section 2)."""
    x = make_inputs(1, 150, 1, 1, 8, 8, seed=3)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    o, s, trace = chunked_gdn(q, k, v, g, beta, 0.5, x["initial_state"])
    eye = torch.eye(64, dtype=torch.float64)
    assert trace.T.shape == (1, 1, 3, 64, 64)
    assert rel_err(trace.T @ (eye + trace.A), eye.expand_as(trace.A)) < TIGHT
    assert torch.equal(trace.A.triu(), torch.zeros_like(trace.A))  # strictly lower
    # h[n] is the recurrent state after the first 64 n tokens.
    for n in range(3):
        _, s_n = recurrent_gdn(q[:, :64 * n], k[:, :64 * n], v[:, :64 * n], g[:, :64 * n], beta[:, :64 * n],
                               0.5, x["initial_state"])
        assert rel_err(trace.h[:, :, n], s_n) < TIGHT
    # U = U' - W S0 per chunk, and the chunk-local cumsum restarts every chunk.
    assert rel_err(trace.U, trace.U_prime - trace.W @ trace.h) < TIGHT
    assert rel_err(trace.gamma[0, 0, 1], g[0, 64:128, 0].cumsum(0)) < TIGHT


def test_padded_tail_past_last_offset_is_zero_and_ignored():
    x = make_inputs(1, 100, 2, 2, 8, 8, seed=4, N=2)
    cu = torch.tensor([0, 30, 80])
    o, s = call(**x, cu_seqlens=cu, output_final_state=True)
    assert torch.equal(o[:, 80:], torch.zeros_like(o[:, 80:]))
    x2 = dict(x, v=x["v"].clone())
    x2["v"][:, 80:] = 1e6  # tail content must not leak anywhere
    o2, s2 = call(**x2, cu_seqlens=cu, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(s, s2)


def test_edge_cases_T1_noncontiguous_and_low_precision():
    x = make_inputs(2, 1, 2, 4, 8, 8, seed=5)
    o_c, s_c = call(**x, output_final_state=True)
    o_r, s_r = call(gdnkit.fused_recurrent_gated_delta_rule, **x, output_final_state=True)
    assert o_c.shape == (2, 1, 4, 8) and rel_err(o_c, o_r) < TIGHT and rel_err(s_c, s_r) < TIGHT

    y = make_inputs(1, 90, 2, 2, 8, 8, seed=6)
    wide = {n: torch.stack([t, t], -1)[..., 0] if n in ("q", "k", "v") else t for n, t in y.items()}
    assert not wide["q"].is_contiguous()
    assert rel_err(call(**wide)[0], call(**y)[0]) < TIGHT

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        z = make_inputs(1, 90, 2, 2, 16, 16, seed=7, dtype=dtype)
        o, s = call(**z, output_final_state=True)
        assert o.dtype == dtype and s.dtype == torch.float32
        exact = {n: t.double() for n, t in z.items()}
        o64, _ = call(gdnkit.fused_recurrent_gated_delta_rule, **exact)
        assert rel_err(o, o64) < (1e-5 if dtype == torch.float32 else 1e-2)


@settings(max_examples=12, deadline=None)
@given(T=st.integers(1, 150), HV=st.integers(1, 2), dims=dims, seed=st.integers(0, 2**16), h0=st.booleans(),
       dht=st.booleans(), chunk=st.sampled_from([16, 64]))
def test_chunked_backward_equals_autograd_of_recurrent(T, HV, dims, seed, h0, dht, chunk):
    """The Tb-form chunked backward (the sm90 backward's definition) against autograd through the token
    recurrence: every gradient, initial state and final-state gradient included, odd lengths."""
    from gdnkit.backends.reference.chunked_backward import chunked_gdn_backward
    K, V = dims
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    leaves = dict(q=F.normalize(r(1, T, HV, K), dim=-1), k=F.normalize(r(1, T, HV, K), dim=-1), v=r(1, T, HV, V),
                  g=F.logsigmoid(r(1, T, HV)), beta=torch.sigmoid(r(1, T, HV)))
    if h0:
        leaves["h0"] = r(1, HV, K, V) * 0.5
    leaves = {n: t.requires_grad_() for n, t in leaves.items()}
    do, dst = r(1, T, HV, V), (r(1, HV, K, V) if dht else None)
    o, S = recurrent_gdn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], 0.3, leaves.get("h0"))
    loss = (o * do).sum() + ((S * dst).sum() if dht else 0)
    ref = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    got = chunked_gdn_backward(*(leaves[n].detach() for n in ("q", "k", "v", "g", "beta")), 0.3, do,
                               h0=leaves["h0"].detach() if h0 else None, dht=dst, chunk=chunk)
    pairs = {"q": got.dq, "k": got.dk, "v": got.dv, "g": got.dg, "beta": got.dbeta}
    if h0:
        pairs["h0"] = got.dh0
    for name, value in pairs.items():
        assert rel_err(value, ref[name]) < 1e-9, (name, rel_err(value, ref[name]))
