"""Chunked prefill on the serving state pool: ssm_state_indices [N], has_initial_state, prefix-cache checkpoints.

Every result is checked against a token-by-token float64 recurrence written here (not gdnkit's code): the
reference backend on CPU, triton_generic's chunked forward in the Triton interpreter (fp32/fp16 inputs: bf16
dots are garbage there), and on a GPU (`-m gpu`) the public call in bf16 at the Qwen shape, including a CUDA
graph replay.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # before any triton kernel is defined: triton.jit reads it at decoration time
    os.environ["TRITON_INTERPRET"] = "1"

import gdnkit  # noqa: E402
from gdnkit.backends.reference import BACKEND as REFERENCE  # noqa: E402
from gdnkit.problem import CHUNK_MODE, RECURRENT_MODE, validate_inputs  # noqa: E402

H, HV = 1, 2


def oracle(q, k, v, g, beta, scale, S):
    """One sequence token by token in float64: q, k [T, HV, K] (already on the value heads), v [T, HV, V],
    g, beta [T, HV], S [HV, K, V]. Returns o [T, HV, V] and the state after every token (index t = after t)."""
    q, k, v, g, beta, S = (x.double() for x in (q, k, v, g, beta, S))
    outs, states = [], [S]
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
        S = S + k[t][:, :, None] * u[:, None, :]
        outs.append(scale * torch.einsum("hk,hkv->hv", q[t], S))
        states.append(S)
    o = torch.stack(outs) if outs else v.new_zeros(0, *v.shape[1:]).double()
    return o, states


def make_tokens(lengths, K, V, *, dtype, device="cpu", seed=0, garbage=()):
    """Packed random inputs ([1, T, ...]); sequences listed in `garbage` get large unnormalised values."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(rnd(1, T, H, K), dim=-1), F.normalize(rnd(1, T, H, K), dim=-1)
    v = rnd(1, T, HV, V)
    g = F.logsigmoid(rnd(1, T, HV))
    beta = torch.sigmoid(rnd(1, T, HV))
    start = 0
    for n, L in enumerate(lengths):
        if n in garbage:
            for x in (q, k, v, g, beta):
                x[:, start:start + L] = rnd(*x[:, start:start + L].shape) * 3
        start += L
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cast = lambda x, dt: x.to(device=device, dtype=dt)  # noqa: E731
    return dict(q=cast(q, dtype), k=cast(k, dtype), v=cast(v, dtype), g=cast(g, torch.float32),
                beta=cast(beta, torch.float32), cu_seqlens=cu)


def make_pool(num_slots, K, V, *, dtype, device="cpu", slot_pad=0, v_first=False, seed=1):
    """A pool of random states; slot_pad > 0 spaces the slots apart (slot stride > one state)."""
    gen = torch.Generator().manual_seed(seed)
    inner = (HV, V, K) if v_first else (HV, K, V)
    base = torch.randn(num_slots, HV * K * V + slot_pad, generator=gen, dtype=torch.float64)
    return base.to(device=device, dtype=dtype)[:, :HV * K * V].unflatten(1, inner)


def expected(call, pool, idx, starts=None, ckpt=None, every=0, v_first=False):
    """The oracle's outputs and the pool after the call (float64), sequence by sequence."""
    cu = call["cu_seqlens"].tolist()
    K = call["q"].shape[-1]
    o = torch.zeros(call["v"].shape, dtype=torch.float64)
    after = pool.detach().double().cpu().clone()
    kv = (lambda s: s.transpose(-1, -2)) if v_first else (lambda s: s)
    for n, slot in enumerate(idx.tolist()):
        if slot < 0:
            continue
        a, b = cu[n], cu[n + 1]
        seq = {x: call[x][0, a:b].cpu().double() for x in ("q", "k", "v", "g", "beta")}
        fresh = starts is not None and not bool(starts[n])
        S0 = torch.zeros(HV, K, call["v"].shape[-1], dtype=torch.float64) if fresh else kv(after[slot])
        o_n, states = oracle(seq["q"].repeat_interleave(HV // H, 1), seq["k"].repeat_interleave(HV // H, 1),
                             seq["v"], seq["g"], seq["beta"], K ** -0.5, S0)
        o[0, a:b] = o_n
        if ckpt is not None:
            for j, c in enumerate(ckpt[n].tolist()):
                if c >= 0 and (j + 1) * every <= b - a:
                    after[c] = kv(states[(j + 1) * every])
        after[slot] = kv(states[-1])
    return o, after


def run(backend, call, pool, idx, **serving):
    problem, inputs = validate_inputs(CHUNK_MODE, initial_state=pool, ssm_state_indices=idx, **call, **serving)
    o, ht, _ = backend.chunk_forward(problem, inputs)
    assert ht is pool
    return o


def check(o, pool, want_o, want_pool, idx, *, o_tol, state_tol, untouched):
    scale = want_o.abs().max()
    assert (o.double().cpu() - want_o).abs().max() <= o_tol * scale
    written = pool.double().cpu()
    assert (written - want_pool).abs().max() <= state_tol * want_pool.abs().max()
    for slot in untouched:  # bit for bit: no state memory the call does not own is touched
        assert torch.equal(pool[slot].cpu(), untouched[slot])


def _triton():
    pytest.importorskip("triton")
    from gdnkit.backends.triton_generic import BACKEND
    return BACKEND


# ---- the reference backend (float64 inputs): exact semantics -------------------------------------------------

@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("v_first", [False, True])
def test_reference_pool_prefill(pool_dtype, v_first):
    lengths = [70, 33, 0, 129]
    call = make_tokens(lengths, 8, 8, dtype=torch.float64, garbage=(1,))
    pool = make_pool(9, 8, 8, dtype=pool_dtype, slot_pad=5, v_first=v_first)
    idx = torch.tensor([4, -1, 2, 7])
    starts = torch.tensor([True, True, False, True])
    ckpt = torch.tensor([[0, 8], [1, 3], [5, 6], [3, -1]])
    want_o, want_pool = expected(call, pool, idx, starts, ckpt, 64, v_first)
    before = {s: pool[s].clone() for s in (1, 5, 6, 8)}  # 5, 6: the empty sequence's checkpoints
    o = run(REFERENCE, call, pool, idx, state_v_first=v_first, has_initial_state=starts, checkpoint_indices=ckpt,
            checkpoint_every=64)
    # states rounded once, on store, as the oracle's are (a 16-bit pool: at most one ulp apart)
    tol = 1e-6 if pool_dtype == torch.float32 else 8e-3
    check(o, pool, want_o, want_pool.to(pool_dtype).double(), idx, o_tol=1e-12, state_tol=tol, untouched=before)
    assert torch.equal(o[0, 70:103], torch.zeros_like(o[0, 70:103]))  # padding: exact zeros from garbage


def test_reference_prefill_then_decode_is_one_run():
    """Prefill on the pool, then decode steps on the same pool: one run of the whole sequences."""
    lengths, steps = [65, 20], 3
    whole = make_tokens([L + steps for L in lengths], 8, 8, dtype=torch.float64, seed=3)
    pool = make_pool(4, 8, 8, dtype=torch.float32)
    idx = torch.tensor([3, 0])
    want_o, want_pool = expected(whole, pool, idx)
    cu = whole["cu_seqlens"].tolist()
    take = lambda rows: {x: whole[x][:, rows] for x in ("q", "k", "v", "g", "beta")}  # noqa: E731
    prefill_rows = torch.cat([torch.arange(cu[n], cu[n] + L) for n, L in enumerate(lengths)])
    o_pre = run(REFERENCE, dict(take(prefill_rows), cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0)])),
                pool, idx)
    o_steps = []
    for s in range(steps):
        rows = torch.tensor([cu[n] + L + s for n, L in enumerate(lengths)])
        step = {x: t.transpose(0, 1) for x, t in take(rows).items()}  # [N, 1, ...]: one token per sequence
        o_s, _ = gdnkit.fused_recurrent_gated_delta_rule(**step, initial_state=pool, ssm_state_indices=idx,
                                                         backend="reference")
        o_steps.append((rows, o_s[:, 0]))
    o = torch.zeros_like(want_o)
    o[0, prefill_rows] = o_pre[0].double()
    for rows, o_s in o_steps:
        o[0, rows] = o_s.double()
    assert (o - want_o).abs().max() <= 1e-6 * want_o.abs().max()
    assert (pool.double() - want_pool).abs().max() <= 1e-6 * want_pool.abs().max()


def test_pool_prefill_public_call_returns_the_pool():
    call = make_tokens([64, 5], 8, 8, dtype=torch.float64)
    pool = make_pool(3, 8, 8, dtype=torch.float32)
    want_o, want_pool = expected(call, pool, torch.tensor([2, 0]))
    o, ht = gdnkit.chunk_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=torch.tensor([2, 0]),
                                          backend="reference")
    assert ht is pool
    assert (o - want_o).abs().max() <= 1e-12
    assert (pool.double() - want_pool).abs().max() <= 1e-6


# ---- validation -----------------------------------------------------------------------------------------------

BAD = [
    (dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3]])), ValueError, "1-D ssm_state_indices"),
    (dict(ssm_state_indices=torch.tensor([0, 9])), ValueError, "slots in \\[0, 6\\)"),
    (dict(ssm_state_indices=torch.tensor([1, 1])), ValueError, "written by sequences"),
    (dict(has_initial_state=torch.tensor([True, False])), ValueError, "needs ssm_state_indices"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), has_initial_state=torch.tensor([1, 0])), TypeError,
     "has_initial_state must be a bool"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), has_initial_state=torch.tensor([True])), ValueError,
     "has_initial_state must have shape"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), checkpoint_indices=torch.tensor([[2], [3]])), ValueError,
     "go together"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), checkpoint_indices=torch.tensor([[2], [3]]), checkpoint_every=32),
     ValueError, "multiple of the chunk size 64"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), checkpoint_indices=torch.tensor([2, 3]), checkpoint_every=64),
     ValueError, "checkpoint_indices must have shape"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), checkpoint_indices=torch.tensor([[2], [6]]), checkpoint_every=64),
     ValueError, "checkpoint_indices must hold pool slots"),
    # sequence 0 (70 tokens) checkpoints into sequence 1's state slot; into its own; two into one slot
    (dict(ssm_state_indices=torch.tensor([0, 1]), checkpoint_indices=torch.tensor([[1], [-1]]), checkpoint_every=64),
     ValueError, "written by sequences"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), checkpoint_indices=torch.tensor([[0], [-1]]), checkpoint_every=64),
     ValueError, "written twice"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), checkpoint_indices=torch.tensor([[4], [4]]), checkpoint_every=64),
     ValueError, "written by sequences"),
    (dict(ssm_state_indices=torch.tensor([0, 1]), num_accepted_tokens=torch.tensor([1, 1])), ValueError,
     "fused_recurrent_gated_delta_rule only"),
]


@pytest.mark.parametrize("bad, error, match", BAD, ids=range(len(BAD)))
def test_pool_prefill_rejects(bad, error, match):
    call = make_tokens([70, 64], 8, 8, dtype=torch.float64)
    pool = make_pool(6, 8, 8, dtype=torch.float32)
    with pytest.raises(error, match=match):
        validate_inputs(CHUNK_MODE, initial_state=pool, **call, **bad)


def test_pool_prefill_checks_pass_when_slots_are_distinct():
    # a checkpoint that the sequence never reaches (sequence 1 has 64 tokens, checkpoint 1 is at 128) may reuse
    # any slot: it is not written
    call = make_tokens([70, 64], 8, 8, dtype=torch.float64)
    problem, _ = validate_inputs(CHUNK_MODE, initial_state=make_pool(6, 8, 8, dtype=torch.float32), **call,
                                 ssm_state_indices=torch.tensor([0, 1]), checkpoint_every=64,
                                 checkpoint_indices=torch.tensor([[2, 3], [4, 0]]))
    assert problem.serving and problem.checkpoint_every == 64


def test_recurrent_call_refuses_prefill_arguments():
    call = make_tokens([3, 3], 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule"):
        validate_inputs(RECURRENT_MODE, initial_state=make_pool(4, 8, 8, dtype=torch.float32), **call,
                        ssm_state_indices=torch.tensor([0, 1]), has_initial_state=torch.tensor([True, True]))


def test_pool_prefill_is_inference_only():
    call = make_tokens([5], 8, 8, dtype=torch.float64)
    call["q"].requires_grad_()
    with pytest.raises(ValueError, match="inference-only"):
        validate_inputs(CHUNK_MODE, initial_state=make_pool(2, 8, 8, dtype=torch.float32), **call,
                        ssm_state_indices=torch.tensor([0]))


def test_tilelang_sm90_declines_pool_prefill_with_its_reason():
    from gdnkit.backends.tilelang_sm90 import BACKEND as SM90
    from gdnkit.dispatch import machine
    call = make_tokens([5], 8, 8, dtype=torch.float64)
    problem, _ = validate_inputs(CHUNK_MODE, initial_state=make_pool(2, 8, 8, dtype=torch.float32), **call,
                                 ssm_state_indices=torch.tensor([0]))
    assert any("triton_generic" in r and "state pool" in r for r in SM90.supports(problem, machine()))


# ---- triton_generic: the chunked forward's state pass on pool slots (interpreter on CPU) -----------------------

@pytest.mark.parametrize("dtype, pool_dtype, fuse", [
    (torch.float32, torch.float32, "always"),
    (torch.float16, torch.bfloat16, "never"),
    (torch.float16, torch.float16, "always"),
])
def test_triton_pool_prefill(monkeypatch, dtype, pool_dtype, fuse):
    backend = _triton()
    from gdnkit.backends.triton_generic import chunked
    monkeypatch.setattr(chunked, "FUSE_OUTPUT", fuse)
    lengths = [70, 40, 0, 128]
    K = V = 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    call = make_tokens(lengths, K, V, dtype=dtype, device=device, garbage=(1,))
    pool = make_pool(9, K, V, dtype=pool_dtype, device=device, slot_pad=3)
    idx = torch.tensor([4, -1, 2, 7], device=device)
    starts = torch.tensor([True, True, False, True], device=device)
    ckpt = torch.tensor([[0, 8], [1, 3], [5, 6], [3, 6]], device=device)
    want_o, want_pool = expected(call, pool, idx.cpu(), starts.cpu(), ckpt.cpu(), 64)
    before = {s: pool[s].clone().cpu() for s in (1, 5, 8)}
    o = run(backend, call, pool, idx, has_initial_state=starts, checkpoint_indices=ckpt, checkpoint_every=64)
    o_tol, state_tol = (2e-3, 2e-3) if dtype == torch.float32 else (2e-2, 2e-2)
    check(o, pool, want_o, want_pool, idx, o_tol=o_tol, state_tol=state_tol, untouched=before)
    assert torch.equal(o[0, 70:110].cpu(), torch.zeros_like(o[0, 70:110].cpu()))  # padding from garbage


def test_triton_prefill_then_decode_is_one_run():
    """triton_generic's pool prefill, then its decode kernel on the same pool: one run of the whole sequences."""
    backend = _triton()
    from gdnkit.backends.triton_generic.fused_recurrent import fused_recurrent_forward
    lengths, steps = [66, 9], 2
    K = V = 16
    device = "cuda" if torch.cuda.is_available() else "cpu"
    whole = make_tokens([L + steps for L in lengths], K, V, dtype=torch.float32, device=device, seed=5)
    pool = make_pool(3, K, V, dtype=torch.float32, device=device)
    idx = torch.tensor([2, 0], device=device)
    want_o, want_pool = expected(whole, pool, idx.cpu())
    cu = whole["cu_seqlens"].tolist()
    take = lambda rows: {x: whole[x][:, rows] for x in ("q", "k", "v", "g", "beta")}  # noqa: E731
    prefill_rows = torch.cat([torch.arange(cu[n], cu[n] + L) for n, L in enumerate(lengths)]).to(device)
    pre_cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0)], dtype=torch.int32, device=device)
    o = torch.zeros_like(want_o)
    o[0, prefill_rows.cpu()] = run(backend, dict(take(prefill_rows), cu_seqlens=pre_cu), pool, idx)[0].double().cpu()
    for s in range(steps):
        rows = torch.tensor([cu[n] + L + s for n, L in enumerate(lengths)], device=device)
        step = {x: t.transpose(0, 1).contiguous() for x, t in take(rows).items()}
        problem, inputs = validate_inputs(RECURRENT_MODE, **step, initial_state=pool, ssm_state_indices=idx)
        o_s, _ = fused_recurrent_forward(problem, inputs)
        o[0, rows.cpu()] = o_s[:, 0].double().cpu()
    assert (o - want_o).abs().max() <= 2e-3 * want_o.abs().max()
    assert (pool.double().cpu() - want_pool).abs().max() <= 2e-3 * want_pool.abs().max()


# ---- GPU: the public call at the Qwen shape, bf16, and a CUDA graph replay -------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_pool_prefill_matches_oracle(pool_dtype):
    lengths = [300, 64, 1000, 0, 130]
    call = make_tokens(lengths, 128, 128, dtype=torch.bfloat16, device="cuda", garbage=(1,))
    pool = make_pool(32, 128, 128, dtype=pool_dtype, device="cuda", slot_pad=64)
    idx = torch.tensor([3, -1, 11, 5, 0], device="cuda")
    starts = torch.tensor([True, True, True, False, False], device="cuda")
    ckpt = torch.full((5, 16), -1, device="cuda")
    ckpt[2, :15] = torch.arange(16, 31)  # 1000 tokens: 15 checkpoints
    ckpt[0, 1] = 12  # 300 tokens: the state after 128
    ckpt[1, 0] = 1  # a padding sequence: not written
    want_o, want_pool = expected(call, pool, idx.cpu(), starts.cpu(), ckpt.cpu(), 64)
    before = {s: pool[s].clone().cpu() for s in (1, 2, 31)}
    with torch.inference_mode():
        o, ht = gdnkit.chunk_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=idx,
                                              has_initial_state=starts, checkpoint_indices=ckpt, checkpoint_every=64)
    assert ht is pool
    assert gdnkit.explain(**call, initial_state=pool, ssm_state_indices=idx).chosen == "triton_generic"
    check(o, pool, want_o, want_pool, idx, o_tol=2e-2, state_tol=2e-2, untouched=before)
    assert torch.equal(o[0, 300:364].cpu(), torch.zeros(64, HV, 128, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_gpu_pool_prefill_cuda_graph_replay():
    lengths = [200, 64, 77]
    call = make_tokens(lengths, 128, 128, dtype=torch.bfloat16, device="cuda", seed=7)
    pool = make_pool(8, 128, 128, dtype=torch.float32, device="cuda")
    start = pool.clone()
    idx = torch.tensor([6, 1, 2], device="cuda")
    want_o, want_pool = expected(call, pool, idx.cpu())
    with torch.inference_mode():
        gdnkit.chunk_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=idx)  # builds the kernels
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, _ = gdnkit.chunk_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=idx)
        pool.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
    check(o, pool, want_o, want_pool, idx, o_tol=2e-2, state_tol=2e-2, untouched={})


# ---- docs/serving.md's examples run as written (reference backend, CPU) -----------------------------------------

DOC_BLOCKS = re.findall(r"```python\n(.*?)```", (Path(__file__).resolve().parents[1] / "docs" / "serving.md")
                        .read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(DOC_BLOCKS)))
def test_serving_doc_example_runs(index):
    torch.manual_seed(index)
    exec(compile(DOC_BLOCKS[index], f"docs/serving.md python block {index + 1}", "exec"), {"__name__": "doc_example"})
