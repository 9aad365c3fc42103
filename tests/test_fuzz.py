"""Hypothesis fuzz of both public functions with odd and bad inputs, against tests/oracle.py.

Every call either returns what the oracle says (within the input dtype's tolerance) or raises ValueError /
TypeError whose message names the argument that was made bad. Odd but valid inputs: zero-length and one-token
sequences, tokens past cu_seqlens[-1] (holding NaN), strided and expanded tensors, GVA, every option, 16-bit
inputs, serving pools with padding rows (holding NaN/Inf) and per-token slots. Non-finite values in a live token
are only held to: no other error than ValueError/TypeError, padding and tokens past the end stay exact zeros,
and every other sequence is unaffected (what the poisoned sequence itself gives is docs/semantics.md's).

CPU time stays a few seconds by default: GDNKIT_FUZZ_EXAMPLES=2000 (and a GPU, GDNKIT_FUZZ_DEVICE=cuda, where
the same calls go to the GPU backends) runs longer.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import gdnkit  # noqa: E402
import oracle  # noqa: E402  (tests/ is on sys.path)

EXAMPLES = int(os.environ.get("GDNKIT_FUZZ_EXAMPLES", "25"))
DEVICE = os.environ.get("GDNKIT_FUZZ_DEVICE", "cpu")
# fp32 on a GPU: the kernels' dots run as tf32
BARS = {torch.float64: 1e-9, torch.float32: 1e-4 if DEVICE == "cpu" else 5e-3, torch.float16: 1e-2,
        torch.bfloat16: 3e-2}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _rnd(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _odd_layout(t: torch.Tensor, how: str) -> torch.Tensor:
    """The same values in a strided or expanded (stride 0) tensor."""
    if how == "strided":  # every other element of a wider tensor along the last dim
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]
    if how == "expanded" and t.dim() >= 3:  # one head's values for every head
        return t[:, :, :1].expand(t.shape)
    if how == "transposed":
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    return t


@st.composite
def problems(draw, device):
    """A valid call as a dict of public arguments, plus what the fuzz needs to judge it."""
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    mode = draw(st.sampled_from(["chunk", "recurrent"]))
    H = draw(st.integers(1, 2))
    HV = H * draw(st.sampled_from([1, 2]))
    K = draw(st.sampled_from([1, 2, 8, 16]))
    V = draw(st.sampled_from([1, 3, 8]))
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]))
    if device == "cuda":  # the GPU backends' head dims (smaller ones go to the reference there too)
        K, V = draw(st.sampled_from([(128, 128), (64, 64)]))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    serving = mode == "recurrent" and draw(st.booleans())
    varlen = draw(st.booleans())
    lengths = None
    tail = 0
    if varlen:
        lengths = draw(st.lists(st.sampled_from([0, 1, 2, 5, 63, 64, 65]), min_size=1, max_size=4))
        tail = draw(st.sampled_from([0, 0, 1, 3]))
        B, T = 1, sum(lengths) + tail
    else:
        B = draw(st.integers(1, 3))
        T = draw(st.sampled_from([0, 1, 2, 7, 65])) if not serving else draw(st.integers(1, 3))
    N = len(lengths) if varlen else B
    opts = dict(use_qk_l2norm_in_kernel=draw(st.booleans()), use_gate_in_kernel=draw(st.booleans()),
                use_beta_sigmoid_in_kernel=draw(st.booleans()), state_v_first=draw(st.booleans()))
    opts["allow_neg_eigval"] = opts["use_beta_sigmoid_in_kernel"] and draw(st.booleans())
    q, k = _rnd(gen, B, T, H, K), _rnd(gen, B, T, H, K)
    if not opts["use_qk_l2norm_in_kernel"]:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = _rnd(gen, B, T, HV) if opts["use_gate_in_kernel"] else F.logsigmoid(_rnd(gen, B, T, HV))
    beta = _rnd(gen, B, T, HV) if opts["use_beta_sigmoid_in_kernel"] else torch.rand(B, T, HV, generator=gen,
                                                                                    dtype=torch.float64)
    gate_dtype = dtype if dtype == torch.float64 else draw(st.sampled_from([torch.float32, dtype]))
    call = dict(q=q.to(dtype), k=k.to(dtype), v=_rnd(gen, B, T, HV, V).to(dtype), g=g.to(gate_dtype),
                beta=beta.to(gate_dtype), **opts)
    call["scale"] = draw(st.sampled_from([None, None, 0.5, 2.0]))
    state_dims = (V, K) if opts["state_v_first"] else (K, V)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if opts["use_gate_in_kernel"]:
        call["A_log"] = (_rnd(gen, HV) * 0.5).to(gate_dtype)
        if draw(st.booleans()):
            call["dt_bias"] = _rnd(gen, HV).to(gate_dtype)
    if varlen:
        call["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                          dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    seq_tokens = ([(b, 0, T) for b in range(B)] if not varlen else
                  [(0, int(s), int(e)) for s, e in zip(call["cu_seqlens"][:-1], call["cu_seqlens"][1:])])
    padding = []
    if serving:
        slots = N + draw(st.integers(0, 3))
        free = torch.randperm(4 * N * max(T, 1) + slots, generator=gen)
        per_token = draw(st.booleans())
        pool_dtype = state_dtype if dtype == torch.float64 else draw(st.sampled_from(
            [torch.float32, torch.bfloat16, torch.float16]))
        if per_token:
            C = max(max(e - s for _, s, e in seq_tokens), 1) + draw(st.integers(0, 1))
            slots = max(slots, N * C)
            idx = free[free < slots][:N * C].view(N, C)
            if draw(st.booleans()):
                call["num_accepted_tokens"] = torch.randint(1, C + 1, (N,), generator=gen, dtype=torch.int32)
        else:
            idx = free[free < slots][:N]
        pad = torch.rand(N, generator=gen) < 0.3
        if per_token:
            read_col = (call["num_accepted_tokens"].long() - 1 if "num_accepted_tokens" in call
                        else torch.zeros(N, dtype=torch.long))
            idx[pad.nonzero()[:, 0], read_col[pad]] = -1
            idx[torch.rand(idx.shape, generator=gen) < 0.1] = -1  # skipped writes (a read made -1 is padding)
            read = idx.gather(1, read_col[:, None])[:, 0]
        else:
            idx[pad] = -1
            read = idx
        padding = (read < 0).nonzero()[:, 0].tolist()
        call["ssm_state_indices"] = idx.to(draw(st.sampled_from([torch.int32, torch.int64])))
        pool = (_rnd(gen, slots, HV, *state_dims) * 0.5).to(pool_dtype)
        if draw(st.booleans()):  # any slot stride: slots inside a wider buffer
            pool = torch.zeros(slots, 2, HV, *state_dims, dtype=pool_dtype).select(1, 0).copy_(pool)
        call["initial_state"] = pool
        if not per_token and draw(st.booleans()):
            call["inplace_final_state"] = False
            call["output_final_state"] = draw(st.booleans())
    else:
        if draw(st.booleans()):
            h0 = _rnd(gen, N, HV, *state_dims) * 0.5
            call["initial_state"] = (h0[:1].expand(h0.shape) if draw(st.booleans()) else h0).to(state_dtype)
        call["output_final_state"] = draw(st.booleans())
    # garbage where no sequence reads: tokens past cu_seqlens[-1], padding rows of a pool
    garbage = draw(st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e30]))
    dead = [(0, T - tail, T)] if tail else []
    dead += [seq_tokens[n] for n in padding]
    poisoned = poisoned_from = None
    if draw(st.integers(0, 4)) == 0:  # one live token of one sequence gets a non-finite value
        live = [n for n, (_, s, e) in enumerate(seq_tokens) if e > s and n not in padding]
        if live:
            poisoned = draw(st.sampled_from(live))
            b, s, e = seq_tokens[poisoned]
            t = draw(st.integers(s, e - 1))
            name = draw(st.sampled_from(["q", "k", "v", "g", "beta"]))
            call[name][b, t] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
            poisoned_from = t   # what it may reach (docs/semantics.md): its sequence from t on
    for b, s, e in dead:
        for name in ("q", "k", "v", "g", "beta"):
            call[name][b, s:e] = garbage
    # then the same values in an odd memory layout (expanded: one head's values, garbage included, for all)
    how = draw(st.sampled_from(["plain", "plain", "strided", "expanded", "transposed"]))
    name = draw(st.sampled_from(["q", "k", "v", "g", "beta"]))
    call[name] = _odd_layout(call[name], how)
    call = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in call.items()}
    return dict(mode=mode, call=call, seq_tokens=seq_tokens, padding=padding, poisoned=poisoned,
                poisoned_from=poisoned_from, dead=dead, dtype=dtype)


def _function(mode):
    return gdnkit.chunk_gated_delta_rule if mode == "chunk" else gdnkit.fused_recurrent_gated_delta_rule


def _oracle(case):
    call = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in case["call"].items()}
    if "ssm_state_indices" in call:
        call["initial_state"] = call["initial_state"].clone()
    return oracle.run(**call)


def _judge(case):
    call, dtype = case["call"], case["dtype"]
    expected_o, expected_ht, expected_pool = _oracle(case)
    pool_before = call["initial_state"].clone() if "ssm_state_indices" in call else None
    with torch.no_grad():
        o, ht = _function(case["mode"])(**call)
    assert o.shape == call["v"].shape and o.dtype == call["v"].dtype
    o = o.cpu().double()
    for b, s, e in case["dead"]:  # padding rows and tokens past the end: exact zeros whatever they held
        assert (o[b, s:e] == 0).all(), (b, s, e)
    keep = torch.ones(o.shape[:2], dtype=torch.bool)
    seq_keep = torch.ones(len(case["seq_tokens"]), dtype=torch.bool)
    if case["poisoned"] is not None:
        b, s, e = case["seq_tokens"][case["poisoned"]]
        keep[b, case["poisoned_from"]:e] = False   # its tokens before the bad one are as the recurrence gives
        seq_keep[case["poisoned"]] = False
    bar = BARS[dtype]
    got, want = o[keep], expected_o[keep]
    assert torch.isfinite(got).all()
    assert (got - want).norm() <= bar * want.norm() + 1e-30, float((got - want).norm() / want.norm().clamp_min(1e-300))
    if expected_ht is not None:
        got_ht = ht.cpu().double()[seq_keep]
        want_ht = expected_ht[seq_keep]
        assert (got_ht - want_ht).norm() <= bar * want_ht.norm() + 1e-30
    if expected_pool is not None:
        pool = call["initial_state"].cpu().double()
        if case["poisoned"] is not None:  # the poisoned sequence's slots hold what its semantics say
            idx = call["ssm_state_indices"].cpu().long()
            mine = idx[case["poisoned"]].reshape(-1)
            others = torch.ones(pool.shape[0], dtype=torch.bool)
            others[mine[mine >= 0]] = False
            pool, expected_pool = pool[others], expected_pool[others]
        pool_bar = max(bar, 1e-2 if call["initial_state"].dtype != torch.float32 else bar)
        assert (pool - expected_pool).norm() <= pool_bar * expected_pool.norm() + 1e-30
    elif pool_before is not None:
        assert torch.equal(call["initial_state"], pool_before)  # read-only pool untouched


# --- bad arguments: each mutation makes one argument wrong and names it ------------------------------------------

def _mutations(case):
    call = case["call"]
    q = call["q"]
    B, T, H, K = q.shape
    HV = call["v"].shape[2]
    serving = "ssm_state_indices" in call
    out = [
        ("q", lambda c: c.update(q=c["q"][0]), ValueError),
        ("q", lambda c: c.update(q=c["q"].tolist()), TypeError),
        ("q", lambda c: c.update(q=c["q"].to(torch.int32)), TypeError),
        ("k", lambda c: c.update(k=torch.cat([c["k"], c["k"][..., :1]], -1)), ValueError),
        ("k", lambda c: c.update(k=c["k"].to(torch.float64 if q.dtype != torch.float64 else torch.float32)), TypeError),
        ("v", lambda c: c.update(v=torch.cat([c["v"], c["v"].new_ones(B, 1, *c["v"].shape[2:])], 1)), ValueError),
        ("g", lambda c: c.update(g=c["g"][..., :1].expand(B, T, HV + 1)), ValueError),
        ("g", lambda c: c.update(g=c["g"].to(torch.int64)), TypeError),
        ("beta", lambda c: c.update(beta=c["beta"][..., 0]), ValueError),
        ("scale", lambda c: c.update(scale="0.5"), TypeError),
        ("A_log", lambda c: c.update(use_gate_in_kernel=True, A_log=torch.zeros(HV + 1, device=q.device)), ValueError),
        ("allow_neg_eigval", lambda c: c.update(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=False), ValueError),
    ]
    if call.get("use_gate_in_kernel"):
        out.append(("A_log", lambda c: c.update(A_log=None), ValueError))
        out.append(("dt_bias", lambda c: c.update(dt_bias=torch.zeros(HV, 2, device=q.device)), ValueError))
    if "cu_seqlens" in call:
        cu = call["cu_seqlens"]
        out += [
            ("cu_seqlens", lambda c: c.update(cu_seqlens=cu + 1), ValueError),
            ("cu_seqlens", lambda c: c.update(cu_seqlens=cu.float()), TypeError),
            ("cu_seqlens", lambda c: c.update(cu_seqlens=torch.cat([cu, cu[-1:] + T + 1])), ValueError),
            ("cu_seqlens", lambda c: c.update(cu_seqlens=cu[None]), ValueError),
        ]
        if cu.numel() > 2 and int(cu[-1]) > 0:
            out.append(("cu_seqlens", lambda c: c.update(cu_seqlens=cu.flip(0)), ValueError))
    if serving:
        idx, pool = call["ssm_state_indices"], call["initial_state"]
        slots = pool.shape[0]
        out += [
            ("ssm_state_indices", lambda c: c.update(ssm_state_indices=torch.full_like(idx, slots)), ValueError),
            ("ssm_state_indices", lambda c: c.update(ssm_state_indices=idx.float()), TypeError),
        ]
        if c_inplace(call):  # slots sharing memory (read-only, an expanded pool is fine)
            out.append(("initial_state", lambda c: c.update(initial_state=pool[:1].expand(max(slots, 2),
                                                                                          *pool.shape[1:])),
                        ValueError))
        if pool.shape[-2:] != (1, 1):
            out.append(("initial_state", lambda c: c.update(initial_state=pool.transpose(-1, -2)), ValueError))
        live = (idx.reshape(idx.shape[0], -1)[:, 0] >= 0).nonzero()[:, 0]
        if idx.dim() == 1 and live.numel() >= 2 and c_inplace(call):
            def duplicate(c, a=int(live[0]), b=int(live[1])):
                dup = idx.clone()
                dup[b] = dup[a]
                c.update(ssm_state_indices=dup)
            out.append(("ssm_state_indices", duplicate, ValueError))
        if "num_accepted_tokens" in call:
            out.append(("num_accepted_tokens",
                        lambda c: c.update(num_accepted_tokens=torch.zeros_like(c["num_accepted_tokens"])),
                        ValueError))
    elif call.get("initial_state") is not None:
        h0 = call["initial_state"]
        out.append(("initial_state", lambda c: c.update(initial_state=torch.cat([h0, h0])), ValueError))
        out.append(("initial_state", lambda c: c.update(initial_state=h0.to(torch.int32)), TypeError))
    return out


def c_inplace(call):
    return call.get("inplace_final_state", True) is not False


@FUZZ
@given(case=problems(DEVICE))
def test_valid_odd_calls_match_the_oracle(case):
    _judge(case)


@FUZZ
@given(case=problems(DEVICE), pick=st.integers(0, 10**6))
def test_bad_calls_raise_naming_the_argument(case, pick):
    mutations = _mutations(case)
    name, mutate, error = mutations[pick % len(mutations)]
    call = dict(case["call"])
    mutate(call)
    with pytest.raises(error) as raised, torch.no_grad():
        _function(case["mode"])(**call)
    assert name in str(raised.value), (name, str(raised.value))
