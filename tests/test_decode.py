"""The decode / serving path: the fused recurrent Triton kernel and the state-pool interface.

Without a GPU the kernel runs in the Triton interpreter on CPU tensors (small shapes, fp32/fp16), called
through its wrapper (dispatch rightly declines CPU problems), and is checked against the reference
backend's serving semantics, which are themselves checked against plain recurrent calls. With a GPU the
`gpu` tests run the decode grid's shapes in bf16 with fp32 and bf16 state pools.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # before any triton kernel is defined: triton.jit reads it at decoration time
    os.environ["TRITON_INTERPRET"] = "1"

import gdnkit  # noqa: E402
from gdnkit.backends.reference import BACKEND as REFERENCE  # noqa: E402
from gdnkit.problem import RECURRENT_MODE, validate_inputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("q", "k", "v", "g", "beta")


def rel(x, ref):
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def make_call(T, H, HV, K, V, *, B=1, lengths=None, seed=0, raw=False, gate=False, dt_bias=True,
              dtype=torch.float32, device=DEVICE, **options):
    """Random inputs of a recurrent call (float64 drawn, then cast), without any state argument."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if lengths is not None:
        B = 1
    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    if not options.get("use_qk_l2norm_in_kernel"):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = rnd(B, T, HV) if gate else F.logsigmoid(rnd(B, T, HV))
    beta = rnd(B, T, HV) if raw else torch.sigmoid(rnd(B, T, HV))
    call = dict(q=q, k=k, v=rnd(B, T, HV, V), g=g, beta=beta, **options)
    if gate:
        call.update(use_gate_in_kernel=True, A_log=rnd(HV) * 0.5)
        if dt_bias:
            call["dt_bias"] = rnd(HV)
    for n in ("q", "k", "v"):
        call[n] = call[n].to(device=device, dtype=dtype)
    for n in ("g", "beta", "A_log", "dt_bias"):
        if n in call:
            call[n] = call[n].to(device=device, dtype=torch.float32)
    if lengths is not None:
        call["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                          device=device)
    return call


def make_pool(slots, HV, K, V, *, v_first=False, dtype=torch.float32, seed=1, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    shape = (slots, HV, V, K) if v_first else (slots, HV, K, V)
    return (torch.randn(shape, generator=gen) * 0.3).to(device=device, dtype=dtype)


def triton_run(call, **kw):
    """The kernel's wrapper on a validated problem (serving pools are updated in place)."""
    pytest.importorskip("triton")  # the gpu extra (a CPU install with only the test extra has no Triton)
    from gdnkit.backends.triton_generic.fused_recurrent import fused_recurrent_forward
    problem, inputs = validate_inputs(RECURRENT_MODE, **call)
    with torch.no_grad():
        return fused_recurrent_forward(problem, inputs, **kw)


def reference_run(call):
    with torch.no_grad():
        return gdnkit.fused_recurrent_gated_delta_rule(**call, backend="reference")


def serve_both(call, pool, **serving):
    """(o, pool) after the same serving call through Triton and through the reference, each on a copy."""
    p_tri, p_ref = pool.clone(), pool.clone()
    o_tri, h_tri = triton_run(dict(call, initial_state=p_tri, **serving))
    o_ref, h_ref = reference_run(dict(call, initial_state=p_ref, **serving))
    return o_tri, h_tri, p_tri, o_ref, h_ref, p_ref


interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests (the GPU runs `gpu` ones)")


# ---------------------------------------------------------------- the reference's serving semantics
def test_reference_pool_semantics_match_plain_calls():
    """1-D indices = gathering initial states, running, scattering final states back; -1 = untouched."""
    call = make_call(3, 2, 4, 16, 8, B=3, device="cpu", dtype=torch.float64)
    pool = make_pool(6, 4, 16, 8, dtype=torch.float64, device="cpu")
    before = pool.clone()
    o, ht = reference_run(dict(call, initial_state=pool, ssm_state_indices=torch.tensor([4, -1, 1])))
    assert ht is pool
    o_p, h_p = reference_run(dict(call, initial_state=before[[4, 0, 1]], output_final_state=True))
    torch.testing.assert_close(o[[0, 2]], o_p[[0, 2]], rtol=0, atol=0)
    assert o[1].abs().max() == 0
    torch.testing.assert_close(pool[[4, 1]], h_p[[0, 2]], rtol=0, atol=0)
    assert torch.equal(pool[[0, 2, 3, 5]], before[[0, 2, 3, 5]])


def test_reference_rollback_semantics():
    """Per-token slots keep every intermediate state; the next call resumes from the accepted one."""
    T, HV, K, V = 3, 2, 8, 8
    call = make_call(T, 1, HV, K, V, B=2, device="cpu", dtype=torch.float64)
    pool = make_pool(8, HV, K, V, dtype=torch.float64, device="cpu")
    start = pool.clone()
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]])
    reference_run(dict(call, initial_state=pool, ssm_state_indices=idx,
                       num_accepted_tokens=torch.tensor([1, 1])))
    for t in range(T):  # state after token t of sequence n == plain run over its first t + 1 tokens
        part = {n: call[n][:, :t + 1] for n in FIELDS}
        _, h = reference_run(dict(part, initial_state=start[[0, 3]], output_final_state=True))
        torch.testing.assert_close(pool[idx[:, t]], h, rtol=1e-12, atol=1e-12)
    # next step: sequence 0 accepted 2 tokens, sequence 1 accepted 3; one new token each
    nxt = make_call(1, 1, HV, K, V, B=2, seed=5, device="cpu", dtype=torch.float64)
    idx2 = torch.tensor([[0, 1, 2], [3, 4, 5]])
    o2, _ = reference_run(dict(nxt, initial_state=pool, ssm_state_indices=idx2,
                               num_accepted_tokens=torch.tensor([2, 3])))
    for n, accepted in ((0, 2), (1, 3)):
        seq = {f: torch.cat([call[f][n:n + 1, :accepted], nxt[f][n:n + 1]], 1) for f in FIELDS}
        o_p, h_p = reference_run(dict(seq, initial_state=start[idx[n, 0]][None], output_final_state=True))
        torch.testing.assert_close(o2[n], o_p[0, -1:], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pool[idx2[n, 0]], h_p[0], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- Triton kernel in the interpreter
@interpreter
@pytest.mark.parametrize("options", [
    dict(),
    dict(raw=True, gate=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
         allow_neg_eigval=True),
    dict(gate=True, dt_bias=False, state_v_first=True, raw=True, use_beta_sigmoid_in_kernel=True),
], ids=["plain", "all-options", "v-first-gate-no-bias"])
def test_plain_call_matches_reference(options):
    call = make_call(5, 2, 4, 16, 32, B=2, **options)
    shape = (2, 4, 32, 16) if options.get("state_v_first") else (2, 4, 16, 32)
    call.update(initial_state=torch.randn(shape) * 0.3, output_final_state=True)
    o, ht = triton_run(call)
    o_ref, ht_ref = reference_run(call)
    assert rel(o, o_ref) < 1e-5 and rel(ht, ht_ref) < 1e-5


@interpreter
def test_varlen_no_state_fp16_and_tail_zero():
    call = make_call(9, 1, 2, 16, 16, lengths=[3, 0, 1, 4], dtype=torch.float16)
    call["output_final_state"] = True
    o, ht = triton_run(call)
    o_ref, ht_ref = reference_run(call)
    assert rel(o, o_ref) < 2e-3 and rel(ht, ht_ref) < 1e-5
    assert o[:, 8:].abs().max() == 0  # the 9th token belongs to no sequence
    o, ht = triton_run(dict(call, output_final_state=False))
    assert ht is None and rel(o, o_ref) < 2e-3


@interpreter
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v_first", [False, True])
def test_pool_one_slot_per_sequence(pool_dtype, v_first):
    call = make_call(1, 2, 4, 16, 32, B=4, raw=True, gate=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, state_v_first=v_first)
    pool = make_pool(7, 4, 16, 32, v_first=v_first, dtype=pool_dtype)
    idx = torch.tensor([5, -1, 0, 3], dtype=torch.int32)
    o, h, p, o_ref, h_ref, p_ref = serve_both(call, pool, ssm_state_indices=idx)
    assert h is p and h_ref is p_ref
    assert rel(o, o_ref) < 1e-5
    assert o[1].abs().max() == 0  # padding sequence
    touched = [0, 3, 5]
    untouched = [1, 2, 4, 6]
    assert torch.equal(p[untouched], pool[untouched])  # bitwise, bf16 included
    # the interpreter rounds fp32 -> bf16 toward zero (a GPU rounds to nearest even, as torch): ~1 ulp apart
    bound = 1e-5 if pool_dtype == torch.float32 else 1e-2
    assert rel(p[touched], p_ref[touched]) < bound
    assert not torch.equal(p[touched], pool[touched])


@interpreter
def test_pool_with_slot_stride_and_not_inplace():
    """A pool that is a view (slot stride != slot size) is written in place through the public layout;
    inplace_final_state=False reads it and returns dense final states, padding rows zero."""
    call = make_call(2, 1, 2, 16, 16, B=3)
    big = make_pool(5, 2 * 2, 16, 16).view(5, 2, 2, 16, 16)
    pool = big[:, 1]  # every other head block: slot stride 2 * HV * K * V
    before = big.clone()
    idx = torch.tensor([2, 4, -1])
    o, h = triton_run(dict(call, initial_state=pool, ssm_state_indices=idx, inplace_final_state=False,
                           output_final_state=True))
    assert torch.equal(big, before)
    o_ref, h_ref = reference_run(dict(call, initial_state=before[:, 1].contiguous(), ssm_state_indices=idx,
                                      inplace_final_state=False, output_final_state=True))
    assert rel(o, o_ref) < 1e-5 and rel(h, h_ref) < 1e-5 and h[2].abs().max() == 0
    o, h = triton_run(dict(call, initial_state=pool, ssm_state_indices=idx))
    assert h is pool and torch.equal(big[:, 0], before[:, 0]) and torch.equal(big[[0, 1, 3], 1], before[[0, 1, 3], 1])
    assert rel(big[[2, 4], 1], h_ref[:2]) < 1e-5


@interpreter
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_multi_token_per_token_slots_and_rollback(pool_dtype):
    """Varlen verify (1..4 tokens), 2-D indices with -1 writes, num_accepted_tokens, then a second step."""
    HV, K, V = 2, 16, 16
    lengths = [4, 1, 3, 2]
    call = make_call(sum(lengths), 1, HV, K, V, lengths=lengths, gate=True, raw=True,
                     use_beta_sigmoid_in_kernel=True)
    pool = make_pool(20, HV, K, V, dtype=pool_dtype)
    idx = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [-1, 9, 10, 11], [12, -1, 14, 15]])
    idx[1, 0] = -1  # padding sequence: its read slot (column accepted - 1 = 0) is -1
    accepted = torch.tensor([2, 1, 3, 4], dtype=torch.int32)
    o, _, p, o_ref, _, p_ref = serve_both(call, pool, ssm_state_indices=idx, num_accepted_tokens=accepted)
    assert rel(o, o_ref) < 1e-5
    assert o[:, 4:5].abs().max() == 0
    written = [0, 1, 2, 3, 9, 10, 12]  # seq 2 skips column 0 (-1); seq 3 has 2 tokens, column 1 is -1
    kept = [s for s in range(20) if s not in written]
    assert torch.equal(p[kept], pool[kept])
    bound = 1e-5 if pool_dtype == torch.float32 else 1e-2  # interpreter bf16 rounding, as above
    assert rel(p[written], p_ref[written]) < bound
    # second step from the kept states, one token each
    call2 = make_call(4, 1, HV, K, V, lengths=[1, 1, 1, 1], seed=3)
    idx2 = torch.tensor([[1], [16], [10], [13]])
    o2, _, p2, o2_ref, _, p2_ref = serve_both(call2, p_ref, ssm_state_indices=idx2)
    assert rel(o2, o2_ref) < 1e-5 and rel(p2, p2_ref) < bound


@interpreter
def test_launch_settings_do_not_change_numbers():
    call = make_call(3, 2, 4, 16, 64, B=2)
    pool = make_pool(3, 4, 16, 64)
    outs = []
    for block_v, warps in ((8, 1), (64, 4)):
        p = pool.clone()
        o, _ = triton_run(dict(call, initial_state=p, ssm_state_indices=torch.tensor([2, 0])),
                          block_v=block_v, num_warps=warps)
        outs.append((o, p))
    assert rel(outs[0][0], outs[1][0]) < 1e-6 and rel(outs[0][1], outs[1][1]) < 1e-6


@pytest.mark.parametrize("pool_dtype, v_first, warps", [(torch.float32, False, 4), (torch.float32, True, 4),
                                                        (torch.bfloat16, False, 2), (torch.bfloat16, True, 4)])
def test_state_tile_warps_follow_the_state_dtype_and_layout(pool_dtype, v_first, warps, monkeypatch):
    """A 128 x 64 state tile takes 2 warps for a 16-bit pool stored [K, V], else 4 (launch_config's H100 sweep);
    the wrapper hands launch_config the pool's element size and layout, and a dense state (made fp32) 4 bytes."""
    pytest.importorskip("triton")
    from gdnkit.backends.triton_generic import fused_recurrent
    from gdnkit.backends.triton_shared.recurrence import launch_config
    assert launch_config(128, 128, 64 * 64, pool_dtype.itemsize, v_first) == (64, warps)
    seen = []
    monkeypatch.setattr(fused_recurrent, "launch_config", lambda *a: seen.append(a) or launch_config(*a))
    call = make_call(1, 1, 2, 16, 16, B=2, state_v_first=v_first)
    triton_run(dict(call, initial_state=make_pool(3, 2, 16, 16, v_first=v_first, dtype=pool_dtype),
                    ssm_state_indices=torch.tensor([2, 0])))
    triton_run(dict(call, initial_state=make_pool(2, 2, 16, 16, v_first=v_first, dtype=pool_dtype)))
    assert seen == [(16, 16, 4, pool_dtype.itemsize, v_first, False), (16, 16, 4, 4, v_first, False)]


@pytest.mark.parametrize("pool_dtype, v_first, tile", [(torch.float32, False, (64, 4)), (torch.float32, True, (16, 1)),
                                                       (torch.bfloat16, False, (32, 2)), (torch.bfloat16, True, (16, 1))])
def test_verify_takes_narrower_state_tiles(pool_dtype, v_first, tile, monkeypatch):
    """A verify (every token's state written) walks its tokens in a chain of stores: [V, K] states take 16 x 128
    tiles on 1 warp, 16-bit [K, V] ones 128 x 32 on 2, fp32 [K, V] the decode tile (launch_config's H100 sweep);
    only a call with per-token slots is a verify."""
    pytest.importorskip("triton")
    from gdnkit.backends.triton_generic import fused_recurrent
    from gdnkit.backends.triton_shared.recurrence import launch_config
    assert launch_config(128, 128, 256 * 32, pool_dtype.itemsize, v_first, per_token_states=True) == tile
    assert launch_config(128, 128, 256 * 32, pool_dtype.itemsize, v_first) == (64, 2 if tile == (32, 2) else 4)
    seen = []
    monkeypatch.setattr(fused_recurrent, "launch_config", lambda *a: seen.append(a) or launch_config(*a))
    call = make_call(3, 1, 2, 16, 16, B=2, state_v_first=v_first)
    triton_run(dict(call, initial_state=make_pool(6, 2, 16, 16, v_first=v_first, dtype=pool_dtype),
                    ssm_state_indices=torch.tensor([[0, 1, 2], [3, 4, 5]])))
    assert seen == [(16, 16, 4, pool_dtype.itemsize, v_first, True)]


# ---------------------------------------------------------------- validation of the serving arguments
def _base(**kw):
    call = make_call(2, 1, 2, 8, 8, B=3, device="cpu")
    call.update(initial_state=make_pool(5, 2, 8, 8, device="cpu"), ssm_state_indices=torch.tensor([0, 1, 2]))
    call.update(kw)
    return call


@pytest.mark.parametrize("change, error, words", [
    (dict(initial_state=None), ValueError, "initial_state=None"),
    (dict(ssm_state_indices=torch.tensor([0.0, 1.0, 2.0])), TypeError, "ssm_state_indices must be an int32"),
    (dict(ssm_state_indices=torch.tensor([0, 1])), ValueError, "ssm_state_indices must have shape [N]"),
    (dict(ssm_state_indices=torch.tensor([0, 5, 1])), ValueError, "[0, 5) or -1"),
    (dict(ssm_state_indices=torch.tensor([0, -2, 1])), ValueError, "or -1 for padding, got -2"),
    (dict(ssm_state_indices=torch.tensor([0, 1, 1])), ValueError, "pool slot 1 is written by sequences"),
    (dict(ssm_state_indices=torch.tensor([[0, 1], [1, 2], [3, 4]])), ValueError, "pool slot 1 is written"),
    (dict(ssm_state_indices=torch.tensor([[0], [1], [2]])), ValueError, "C=1 columns"),
    (dict(ssm_state_indices=torch.tensor([[0, 1, -1], [2, 3, 0], [4, -1, -1]]),
          num_accepted_tokens=torch.tensor([1, 3, 1])), ValueError, "sequence 1 reads pool slot 0, which sequence 0"),
    (dict(initial_state=make_pool(5, 2, 8, 8, device="cpu", dtype=torch.float64)), TypeError, "float32, bfloat16"),
    (dict(initial_state=make_pool(5, 3, 8, 8, device="cpu")), ValueError, "initial_state must have shape"),
    (dict(initial_state=make_pool(5, 2, 8, 8, device="cpu").transpose(-1, -2)), ValueError, "contiguous within"),
    (dict(num_accepted_tokens=torch.tensor([1, 1, 1])), ValueError, "needs 2-D ssm_state_indices"),
    (dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3], [4, -1]]), num_accepted_tokens=torch.tensor([1, 3, 1])),
     ValueError, "num_accepted_tokens must be in [1, 2]"),
    (dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3], [4, -1]]), num_accepted_tokens=torch.tensor([1, 1])),
     ValueError, "num_accepted_tokens must have shape"),
    (dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3], [4, -1]]), num_accepted_tokens=torch.tensor([1., 1, 1])),
     TypeError, "num_accepted_tokens must be an int32"),
    (dict(ssm_state_indices=torch.tensor([[0, 1], [2, 3], [4, -1]]), inplace_final_state=False), ValueError,
     "only possible with 1-D"),
    (dict(inplace_final_state=1), TypeError, "inplace_final_state must be a bool"),
    (dict(ssm_state_indices=None, inplace_final_state=True), ValueError, "got ssm_state_indices=None"),
    (dict(ssm_state_indices=None, num_accepted_tokens=torch.tensor([1, 1, 1])), ValueError,
     "got ssm_state_indices=None"),
])
def test_serving_validation(change, error, words):
    with pytest.raises(error) as info:
        gdnkit.fused_recurrent_gated_delta_rule(**_base(**change))
    assert words in str(info.value)


def test_serving_slot_check_takes_padding_and_names_clashes_after_it():
    """1-D slots: any number of -1 paddings pass; a live slot named twice, or one out of range, is named after
    them too; a pool only read (inplace_final_state=False) may have sequences share a slot."""
    ok = _base(ssm_state_indices=torch.tensor([-1, 4, -1]))
    validate_inputs(RECURRENT_MODE, **ok)
    with pytest.raises(ValueError, match="pool slot 4 is written by sequences 1 and 2"):
        validate_inputs(RECURRENT_MODE, **_base(ssm_state_indices=torch.tensor([-1, 4, 4])))
    with pytest.raises(ValueError, match=r"got 5 at \[2\]"):
        validate_inputs(RECURRENT_MODE, **_base(ssm_state_indices=torch.tensor([-1, -1, 5])))
    validate_inputs(RECURRENT_MODE, **_base(ssm_state_indices=torch.tensor([3, 3, -1]), inplace_final_state=False,
                                            output_final_state=True))


def test_serving_validation_grad_mode_and_chunk_mode():
    call = _base()
    call["q"] = call["q"].requires_grad_()
    with pytest.raises(ValueError, match="inference-only"):
        gdnkit.fused_recurrent_gated_delta_rule(**call)
    # the chunked call takes a pool with one slot per sequence (prefill), not per-token slots or decode's options
    with pytest.raises(ValueError, match="fused_recurrent_gated_delta_rule only"):
        validate_inputs("chunk", **_base(inplace_final_state=True))
    with pytest.raises(ValueError, match="1-D ssm_state_indices"):
        validate_inputs("chunk", **_base(ssm_state_indices=torch.tensor([[0], [1], [2]])))


def test_serving_needs_a_backend_that_opts_in():
    """Dispatch never hands a pool to a backend that would read it as dense initial states."""
    from gdnkit import dispatch
    problem, _ = validate_inputs(RECURRENT_MODE, **_base())
    for backend in dispatch.backends():
        reasons = backend.reasons(problem, dispatch.machine())
        if not backend.serves_state_pool:
            assert any("serving state pool" in r for r in reasons)
    assert REFERENCE.serves_state_pool
    assert "serving pool of 5 slots" in problem.describe()


def test_padding_only_and_plain_calls_unchanged():
    call = _base(ssm_state_indices=torch.tensor([-1, -1, -1]))
    before = call["initial_state"].clone()
    o, ht = gdnkit.fused_recurrent_gated_delta_rule(**call)
    assert ht is call["initial_state"] and torch.equal(ht, before) and o.abs().max() == 0
    plain = make_call(2, 1, 2, 8, 8, B=3, device="cpu")
    o, ht = gdnkit.fused_recurrent_gated_delta_rule(**plain)
    assert ht is None and o.shape == plain["v"].shape


# ---------------------------------------------------------------- GPU: decode grid shapes
DECODE_SHAPES = [(1, 16, 64), (64, 16, 64), (256, 2, 8), (256, 16, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, H, HV", DECODE_SHAPES)
def test_gpu_decode_grid_matches_reference(B, H, HV, pool_dtype):
    K = V = 128
    call = make_call(1, H, HV, K, V, B=B, dtype=torch.bfloat16, raw=True, gate=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    pool = make_pool(B + 3, HV, K, V, dtype=pool_dtype)
    idx = torch.randperm(B + 3, device=DEVICE)[:B].int()
    idx[3::7] = -1
    o, _, p, o_ref, _, p_ref = serve_both(call, pool, ssm_state_indices=idx)
    bound = 1e-5 if pool_dtype == torch.float32 else 2e-3
    assert rel(o, o_ref) < 1e-2  # o is bf16
    assert rel(p, p_ref) < bound
    untouched = torch.ones(B + 3, dtype=torch.bool, device=DEVICE)
    untouched[idx[idx >= 0].long()] = False
    assert torch.equal(p[untouched], pool[untouched])


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_multi_token_verify_matches_reference(pool_dtype):
    B, H, HV, K, V, T = 64, 16, 64, 128, 128, 4
    call = make_call(T, H, HV, K, V, B=B, dtype=torch.bfloat16, use_qk_l2norm_in_kernel=True)
    pool = make_pool(B * T + 1, HV, K, V, dtype=pool_dtype)
    idx = torch.arange(B * T, device=DEVICE).view(B, T)
    accepted = torch.randint(1, T + 1, (B,), device=DEVICE)
    o, _, p, o_ref, _, p_ref = serve_both(call, pool, ssm_state_indices=idx, num_accepted_tokens=accepted)
    assert rel(o, o_ref) < 1e-2 and rel(p, p_ref) < (1e-5 if pool_dtype == torch.float32 else 2e-3)
    assert torch.equal(p[-1], pool[-1])


@pytest.mark.gpu
def test_gpu_plain_call_matches_reference_all_options():
    call = make_call(7, 4, 16, 128, 128, B=3, dtype=torch.bfloat16, raw=True, gate=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                     state_v_first=True)
    call.update(initial_state=torch.randn(3, 16, 128, 128, device=DEVICE) * 0.3, output_final_state=True)
    o, ht = triton_run(call)
    o_ref, ht_ref = reference_run(call)
    assert rel(o, o_ref) < 1e-2 and rel(ht, ht_ref) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_gpu_prefill_then_decode_equals_one_reference_run(pool_dtype):
    """Chunked prefill (reference), its final state into a pool slot, then N decode steps through the
    Triton kernel == one reference run over the whole sequences."""
    lengths, steps, H, HV, K, V = [100, 37, 64], 6, 2, 8, 128, 128
    total = [n + steps for n in lengths]
    full = make_call(sum(total), H, HV, K, V, lengths=total, dtype=torch.bfloat16, gate=True, raw=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    h0 = torch.randn(len(lengths), HV, K, V, device=DEVICE) * 0.3
    with torch.no_grad():
        o_full, h_full = gdnkit.fused_recurrent_gated_delta_rule(**full, initial_state=h0, output_final_state=True,
                                                                 backend="reference")
    starts = [0, *torch.tensor(total).cumsum(0).tolist()]
    token_fields = FIELDS
    prefill_pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).to(DEVICE)
    prefill = {n: (full[n][:, prefill_pos] if n in token_fields else full[n]) for n in full}
    prefill["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE,
                                         dtype=torch.int32)
    with torch.no_grad():
        _, h_prefill = gdnkit.chunk_gated_delta_rule(**prefill, initial_state=h0, output_final_state=True,
                                                     backend="reference")
    slots = torch.tensor([5, 0, 2], device=DEVICE, dtype=torch.int32)
    pool = make_pool(6, HV, K, V, dtype=pool_dtype)
    pool[slots.long()] = h_prefill.to(pool_dtype)
    outs = []
    for step in range(steps):
        pos = torch.tensor([s + n + step for s, n in zip(starts, lengths)], device=DEVICE)
        dec = {n: (full[n][:, pos] if n in token_fields else full[n]) for n in full}
        dec = {n: (t.view(len(lengths), 1, *t.shape[2:]) if n in token_fields else t) for n, t in dec.items()
               if n != "cu_seqlens"}
        o, _ = triton_run(dict(dec, initial_state=pool, ssm_state_indices=slots))
        outs.append(o)
    o_dec = torch.cat(outs, 1)
    last = torch.stack([torch.arange(s + n, s + n + steps) for s, n in zip(starts, lengths)]).to(DEVICE)
    o_want = o_full[0, last]
    bound = 2e-2 if pool_dtype == torch.float32 else 3e-2
    assert rel(o_dec, o_want) < bound
    assert rel(pool[slots.long()].float(), h_full) < (1e-4 if pool_dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_public_api():
    """Decode steps captured once in a CUDA graph and replayed == the reference stepped eagerly; through
    the public API (validation skips its host reads while capturing) once triton_generic serves pools."""
    from gdnkit.backends.triton_generic import BACKEND as TRITON
    B, H, HV, K, V = 8, 2, 8, 128, 128
    call = make_call(1, H, HV, K, V, B=B, dtype=torch.bfloat16, raw=True, gate=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    pool = make_pool(B + 2, HV, K, V)
    idx = torch.tensor([9, 0, 3, -1, 5, 1, 7, 2], device=DEVICE, dtype=torch.int32)
    p_ref = pool.clone()
    if TRITON.serves_state_pool:
        step = lambda: gdnkit.fused_recurrent_gated_delta_rule(  # noqa: E731
            **call, initial_state=pool, ssm_state_indices=idx, backend="triton_generic")
    else:
        from gdnkit.backends.triton_generic.fused_recurrent import fused_recurrent_forward
        problem, inputs = validate_inputs(RECURRENT_MODE, **call, initial_state=pool, ssm_state_indices=idx)
        step = lambda: fused_recurrent_forward(problem, inputs)  # noqa: E731
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compile outside the capture; this is step 1
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, _ = step()  # captured, not run
        graph.replay()  # step 2
        graph.replay()  # step 3
        torch.cuda.synchronize()
    for _ in range(3):
        o_ref, _ = reference_run(dict(call, initial_state=p_ref, ssm_state_indices=idx))
    assert rel(o, o_ref) < 1e-2 and rel(pool, p_ref) < 1e-5
