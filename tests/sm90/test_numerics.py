"""tilelang_sm90 on an sm90 GPU (`-m gpu`): the forward, each backward path and context parallelism against the
reference backend in float64; bitwise repeatable training gradients; a training call captured in a CUDA graph."""
import types

import pytest
import torch
import torch.nn.functional as F

import gdnkit

from .helpers import BF16_FWD_BAR, CU_SEQLENS, K, V, _rel, _tilelang


@pytest.mark.gpu
@pytest.mark.parametrize("block_v", [None, 32, 64, 128], ids=["auto", "bv32", "bv64", "bv128"])
@pytest.mark.parametrize("H,HV", [(2, 8), (16, 64)])
def test_forward_matches_float64_reference(H, HV, block_v, monkeypatch, sm90_config):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    sm90_config(block_v=block_v)
    forward = fwd.forward

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(H * 100 + HV)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    T = CU_SEQLENS[-1]
    N = len(CU_SEQLENS) - 1
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    g = F.logsigmoid(r(1, T, HV))
    beta = torch.sigmoid(r(1, T, HV))
    if HV == 64:  # contiguous views starting one element into a buffer: the kernels' TMA boxes need aligned bases
        q, v = (torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape) for x in (q, v))
        assert q.data_ptr() % 16 and v.data_ptr() % 16
    h0 = r(N, HV, K, V) * 0.1
    cu = torch.tensor(CU_SEQLENS, device=dev, dtype=torch.long)

    with torch.no_grad():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0,
                                          output_final_state=True, cu_seqlens=cu)
        o, ht, _ = forward(problem, inputs)
        torch.cuda.synchronize()
        d = lambda t: t.double()  # noqa: E731 - float64 truth on the same (bf16-rounded) values
        problem64, inputs64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                                              output_final_state=True, cu_seqlens=cu)
        ref_o, ref_ht = reference_forward(problem64, inputs64, chunked_gdn)

    assert o.shape == v.shape and o.dtype == v.dtype
    assert ht.shape == h0.shape and ht.dtype == torch.float32
    assert _rel(o, ref_o) <= BF16_FWD_BAR, f"o: {_rel(o, ref_o):.2e}"
    assert _rel(ht, ref_ht) <= BF16_FWD_BAR, f"final state: {_rel(ht, ref_ht):.2e}"
    # per sequence too: a wrong tail chunk or a lost initial state hides in the global norm
    for n in range(N):
        s, e = CU_SEQLENS[n], CU_SEQLENS[n + 1]
        assert _rel(o[:, s:e], ref_o[:, s:e]) <= BF16_FWD_BAR, f"o of sequence {n}: {_rel(o[:, s:e], ref_o[:, s:e]):.2e}"
        assert _rel(ht[n], ref_ht[n]) <= BF16_FWD_BAR, f"final state {n}: {_rel(ht[n], ref_ht[n]):.2e}"
    # deterministic: a second call gives identical bits
    o2, ht2, _ = forward(problem, inputs)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


@pytest.mark.gpu
def test_forward_wide_route_in_waves_matches_float64_reference():
    """The wide route in several waves (context_parallel.wide_waves_segment_chunks): 4/48 with one long and one
    short sequence (96 pairs fill the SMs, the long one bounds the plain pass) in 64-chunk segments, two waves of
    the H200's SMs; with initial states, a tail chunk, gates that settle (the device picks the segments); every
    sequence's output and final state against float64, and the call twice bitwise."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    pytest.importorskip("triton")
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    H, HV, lengths, dev = 4, 48, (16384, 1000), "cuda"
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    p = fwd.plan_of(types.SimpleNamespace(HV=HV, needs_grad=False), fwd.seqlayout.sequence_layout(cu),
                    torch.device(dev))
    seg, waves = p.segment_chunks, p.waves
    if waves < 2:
        pytest.skip(f"this GPU's SM count gives {waves} wave(s) here (the H200's 132 give 2)")
    T, N = int(cu[-1]), len(lengths)
    gen = torch.Generator(device=dev).manual_seed(48)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    v, g, beta = r(1, T, HV, V).to(torch.bfloat16), F.logsigmoid(r(1, T, HV)), torch.sigmoid(r(1, T, HV))
    h0 = r(N, HV, K, V) * 0.1
    with torch.no_grad():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu)
        got = {}
        o, ht, _ = fwd.forward(problem, inputs, intermediates=got)
        o2, ht2, _ = fwd.forward(problem, inputs)
        d = lambda t: t.double()  # noqa: E731
        p64, i64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                                   output_final_state=True, cu_seqlens=cu)
        ref_o, ref_ht = reference_forward(p64, i64, chunked_gdn)
    assert got["wide_segments"] and bool(got["wide_choice"])
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        assert _rel(o[:, s:e], ref_o[:, s:e]) <= BF16_FWD_BAR, f"o of sequence {n}: {_rel(o[:, s:e], ref_o[:, s:e]):.2e}"
        assert _rel(ht[n], ref_ht[n]) <= BF16_FWD_BAR, f"final state {n}: {_rel(ht[n], ref_ht[n]):.2e}"
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


@pytest.mark.gpu
def test_intra_chunk_bound_matches_the_walks_search():
    """The intra kernel's emit_bound (the walks' chunk sums, lead_in.py's bound per chunk-table row and value head)
    against the search's own sums (lead_in_bound._row_bounds_kernel, float64) on a varlen batch with chunk tails,
    GVA and beta up to 2 (so |1 - beta ||k||^2| > 1 on some tokens); Tb and gamma as without it."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    pytest.importorskip("triton")
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import lead_in_bound
    from gdnkit.backends.tilelang_sm90.forward import intra_chunk_kernel

    H, HV, dev = 2, 8, "cuda"
    cu_host = [0, 1, 65, 200, 333, 1000]
    T = cu_host[-1]
    gen = torch.Generator(device=dev).manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    k = (F.normalize(r(1, T, H, K), dim=-1) * 1.3).to(torch.bfloat16)
    g = F.logsigmoid(r(1, T, HV)) * 0.2
    beta = 2 * torch.rand(1, T, HV, generator=gen, device=dev)
    layout = seqlayout.sequence_layout(torch.tensor(cu_host, device=dev))
    n = layout.n_chunks
    outs = []
    for emit in (False, True):
        a = torch.full((1, T, HV, 64), float("nan"), device=dev, dtype=torch.bfloat16)
        gamma = torch.full((HV, n, 64), float("nan"), device=dev)
        bound = torch.full((n, HV), float("nan"), device=dev) if emit else torch.empty(1, 1, device=dev)
        tm = torch.empty(1, 1, 1, 1, device=dev, dtype=torch.bfloat16)
        intra_chunk_kernel(H, HV, "bfloat16", False, emit)(k, g, beta, layout.cu_seqlens, layout.chunk_indices, a,
                                                          gamma, tm, bound)
        outs.append((a, gamma, bound))
    torch.cuda.synchronize()
    (a0, g0, _), (a1, g1, got) = outs
    assert torch.equal(a0[:, :T], a1[:, :T]) and torch.equal(g0, g1)   # the bound changes nothing else
    want = torch.empty(n, HV, dtype=torch.float64, device=dev)
    starts = torch.tensor([s for a_, b_ in zip(cu_host[:-1], cu_host[1:]) for s in range(a_, b_, 64)], device=dev)
    ends = torch.tensor([min(s + 64, b_) for a_, b_ in zip(cu_host[:-1], cu_host[1:]) for s in range(a_, b_, 64)],
                        device=dev)
    walked = torch.ones(n, dtype=torch.int8, device=dev)
    lead_in_bound._row_bounds_kernel[(n, H)](g, k, beta, starts, ends, walked, want, T, H=H, HV=HV, K=K, GP=4, KP=K,
                                            num_warps=4)
    assert not got.isnan().any()
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4), (got.double() - want).abs().max()


@pytest.mark.gpu
def test_intra_chunk_stage_matches_reference_trace(monkeypatch, sm90_config):
    """The intra-chunk kernel alone (gamma, Tb = T diag(beta)) against the reference's ChunkTrace, one dense
    sequence of 135 tokens (a chunk tail of 7): tells an intra-chunk bug from a state-pass bug. The
    context-parallel path runs the same kernel."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit.backends.reference.chunked import to_chunks, chunked_gdn
    from gdnkit.backends.tilelang_sm90 import context_parallel
    from gdnkit.backends.tilelang_sm90.forward import forward
    from gdnkit.problem import CHUNK_MODE, validate_inputs

    H, HV, T = 2, 8, 135
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    g = F.logsigmoid(r(1, T, HV))
    beta = torch.sigmoid(r(1, T, HV))
    with torch.no_grad():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta)
        got, got_cp = {}, {}
        forward(problem, inputs, intermediates=got)
        sm90_config(segment_chunks=1)
        forward(problem, inputs, intermediates=got_cp)
        torch.cuda.synchronize()
        rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
        _, _, trace = chunked_gdn(rep(q), rep(k), v.double(), g.double(), beta.double(), problem.scale)
    per_token = lambda x: x.movedim(1, 3).reshape(1, -1, HV, x.shape[-1])[:, :T]  # noqa: E731
    gamma_ref = trace.gamma.reshape(1, HV, -1)[0, :, :T]
    assert _rel(got["gamma"][:, :T], gamma_ref) <= 1e-5, f"gamma: {_rel(got['gamma'][:, :T], gamma_ref):.2e}"
    tb_ref = per_token(trace.T * to_chunks(beta.double(), trace.T.shape[2], 64).unsqueeze(-2))
    assert _rel(got["a"], tb_ref) <= 1e-2, f"Tb: {_rel(got['a'], tb_ref):.2e}"
    assert torch.equal(got["a"], got_cp["a"]) and torch.equal(got["gamma"], got_cp["gamma"])


@pytest.mark.gpu
def test_public_api_fp16_options_and_trailing_tokens():
    """Through gdnkit.chunk_gated_delta_rule with backend="tilelang_sm90": fp16, the options run as the
    PyTorch prologue (qk l2norm, gate from A_log/dt_bias, beta sigmoid), state_v_first, and tokens past
    cu_seqlens[-1], whose output must be exactly zero."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    import gdnkit

    dev, H, HV, T = "cuda", 4, 16, 300
    cu = torch.tensor([0, 7, 150, 290], device=dev, dtype=torch.int32)  # 10 trailing tokens
    gen = torch.Generator(device=dev).manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    call = dict(q=r(1, T, H, K).half(), k=r(1, T, H, K).half(), v=r(1, T, HV, V).half(), g=r(1, T, HV),
                beta=r(1, T, HV), initial_state=r(3, HV, V, K) * 0.1, output_final_state=True, cu_seqlens=cu,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=r(HV) * 0.5, dt_bias=r(HV),
                use_beta_sigmoid_in_kernel=True, state_v_first=True)
    with torch.no_grad():
        o, ht = gdnkit.chunk_gated_delta_rule(**call, backend="tilelang_sm90")
        d = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in call.items()}
        ref_o, ref_ht = gdnkit.chunk_gated_delta_rule(**d, backend="reference")
    assert o.dtype == torch.float16 and ht.shape == (3, HV, V, K)
    assert _rel(o[:, :290], ref_o[:, :290]) <= BF16_FWD_BAR, f"o: {_rel(o[:, :290], ref_o[:, :290]):.2e}"
    assert _rel(ht, ref_ht) <= BF16_FWD_BAR, f"final state: {_rel(ht, ref_ht):.2e}"
    assert o[:, 290:].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("H,HV,T,segment_chunks,gate_scale,lead_in_on,route,settled", [
    (2, 8, 8200, None, 1.0, True, "gated", True),
    (2, 8, 8200, None, 1.0, False, "exact", None),
    (2, 8, 8200, 3, 1.0, True, "gated", True),
    (2, 8, 8200, None, 1e-3, True, "gated", False),   # gates barely decay: the exact route behind the lead-in runs
    (2, 8, 65536 + 37, None, 1.0, True, "gated", True),
    (8, 32, 32768, None, 1.0, True, "chained", True),   # the exact route does not pay: the chained route
    (8, 32, 32768, None, 1e-3, True, "chained", False),  # ... where every unsettled program walks back
    # 16-chunk segments, the exact route made not to pay: half the heads barely decay, so their programs walk
    # back to the sequence's start (up to 8 segments), the others start from their lead-in
    (2, 8, 8200, 16, "mixed", True, "chained", "mixed"),
    # inference's wide route: the chained route with one 128-column program per (segment, head), 4 and 16
    # segments filling the SMs
    (8, 32, 32768, None, 1.0, True, "wide", True),
    (8, 32, 32768, None, 1e-3, True, "wide", False),
    (2, 8, 65536 + 37, None, "mixed", True, "wide", "mixed"),
    # short sequences: 2/8 2000 tokens in 2-chunk segments (a tail chunk of 16): the wide pass where every head
    # settles, the plain one picked with mixed gates
    (2, 8, 2000, None, 1.0, True, "wide", True),
    (2, 8, 2000, None, "mixed", True, "wide", "mixed"),
    # where the 64-column pass without segments fills the SMs too, the device picks: the wide route where every
    # head settles at once, the pass without segments where half the heads walk far
    (16, 64, 32768, None, 1.0, True, "wide", True),
    (16, 64, 32768, None, "mixed", True, "wide", "mixed"),
], ids=["auto", "exact", "seg3", "weak-gates", "auto-64k", "8-32", "8-32-weak-gates", "chained-long-walks",
        "wide-8-32", "wide-8-32-weak-gates", "wide-64k-mixed-gates", "wide-short", "wide-short-mixed-gates",
        "wide-16-64-picked", "wide-16-64-plain"])
def test_context_parallel_on_gpu(H, HV, T, segment_chunks, gate_scale, lead_in_on, route, settled, monkeypatch,
                                 sm90_config):
    """The forward with context parallelism (one long sequence: auto dispatch cuts it into segments on an
    H200) against float64, with an initial and a final state, by each route to the segments' initial states
    (gated and chained: whether the fixed lead-in settled every segment, as the device flagged; wide: the chained
    route in the 128-column state pass); a second call gives the same bits."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    pytest.importorskip("triton")
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import context_parallel
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    sm90_config(segment_chunks=segment_chunks)
    sm90_config(lead_in_route=lead_in_on)
    sm90_config(wide_route=route == "wide")
    if route == "wide" and settled is False:   # the wide pass's long walks: made to be picked over the plain pass
        sm90_config(wide_step_ratio=0.0)
    if route == "chained" and segment_chunks:
        sm90_config(exact_route_pays=False)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    if gate_scale == "mixed":
        gate_scale = torch.tensor([1.0, 1e-3], device=dev).repeat(HV // 2)
    v, g = r(1, T, HV, V).to(torch.bfloat16), F.logsigmoid(r(1, T, HV)) * gate_scale
    beta = torch.sigmoid(r(1, T, HV))
    h0 = r(1, HV, K, V) * 0.1
    cu = torch.tensor([0, T], device=dev)
    with torch.no_grad():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu)
        layout = fwd.seqlayout.sequence_layout(cu)
        p = fwd.plan_of(problem, layout, q.device)
        seg, wide = p.segment_chunks, p.wide
        assert seg and wide == (route == "wide")  # segments are cut
        got = {}
        o, ht, _ = fwd.forward(problem, inputs, intermediates=got)
        o2, ht2, _ = fwd.forward(problem, inputs)
        assert got["context_parallel"] == ("chained" if wide else route) and got["wide_segments"] == wide
        if route == "gated":
            assert (int(got["transitions_needed"].sum()) == 0) == settled
        if wide:   # the device's pick (context_parallel.pick): the pass without segments where half the heads
            # walk far enough that the longest program, in wide steps, outlasts the longest sequence
            walk, own = got["walk_lengths"], context_parallel.plan_segments(layout, seg).own
            step = p.waves * p.config.waves_step_ratio if p.waves > 1 else p.config.wide_step_ratio
            longest_program = float((walk + own.to(walk.device)[:, None]).max()) * step
            assert bool(got["wide_choice"]) == (longest_program < -(-T // 64))
            if T < 4096:   # short sequences: the slow heads walk to the start, so the pick follows the gates
                assert bool(got["wide_choice"]) == (settled != "mixed")
        if route in ("chained", "wide"):   # decaying heads walk one chunk, barely decaying ones far (e^-12 takes ~240 chunks)
            walk, before = got["walk_lengths"], context_parallel.plan_segments(layout, seg).walks.before[:, None]
            short, far = walk == before.clamp_max(1), (walk > 1) | (before <= 1)
            if settled == "mixed":
                assert short[:, 0::2].all() and far[:, 1::2].all()
            else:
                assert (short if settled else far).all()
        d = lambda t: t.double()  # noqa: E731
        p64, i64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                                   output_final_state=True, cu_seqlens=cu)
        ref_o, ref_ht = reference_forward(p64, i64, chunked_gdn)
    assert _rel(o, ref_o) <= BF16_FWD_BAR, f"o: {_rel(o, ref_o):.2e}"
    assert _rel(ht, ref_ht) <= BF16_FWD_BAR, f"final state: {_rel(ht, ref_ht):.2e}"
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


@pytest.mark.gpu
@pytest.mark.parametrize("wide", [False, True], ids=["bv64", "wide"])
def test_backward_state_matches_reference_chunked_backward(wide):
    """The sm90 backward's sequential pass alone (backward_state.py, or its full-width form
    backward_state_wide.py), fed by the forward's intra kernel (Tb, gamma), against
    backends/reference/chunked_backward.py: dU and dS_end of every chunk, dV and dh0, one sequence of 200
    tokens (a chunk tail of 8) with a final-state gradient."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    tl = _tilelang()
    from gdnkit.backends.reference.chunked_backward import chunked_gdn_backward
    from gdnkit.backends.tilelang_sm90 import backward_state, backward_state_wide
    from gdnkit.backends.tilelang_sm90.backward import _no_walks
    from gdnkit.backends.tilelang_sm90.forward import TARGET, forward, open_gate
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    from gdnkit import seqlayout

    H, HV, T, dev = 2, 4, 200, "cuda"
    gen = torch.Generator(device=dev).manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    g, beta, do, dht = F.logsigmoid(r(1, T, HV)), torch.sigmoid(r(1, T, HV)), r(1, T, HV, V).to(torch.bfloat16), r(1, HV, K, V)
    with torch.no_grad():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta)
        got = {}
        forward(problem, inputs, intermediates=got)
        layout = seqlayout.sequence_layout(torch.tensor([0, T], device=dev, dtype=torch.int32))
        module, program = (backward_state_wide, backward_state_wide.backward_state_wide_program) if wide else \
            (backward_state, backward_state.backward_state_program)
        kernel = tl.compile(program(H, HV, "bfloat16", True, True), target=TARGET, pass_configs=module.PASS_CONFIGS)
        nc = layout.n_chunks
        du, dv = (torch.full((1, T, HV, V), float("nan"), device=dev, dtype=torch.bfloat16) for _ in range(2))
        dh = torch.full((nc, HV, K, V), float("nan"), device=dev, dtype=torch.bfloat16)
        dh0 = torch.full((1, HV, K, V), float("nan"), device=dev)
        kernel(q, k, got["a"], do, got["gamma"].reshape(HV, nc, 64), layout.cu_seqlens, layout.chunk_offsets, dht,
               du, dv, dh, dh0, float(problem.scale), open_gate(q.device, HV), *_no_walks(q.device, HV))
        torch.cuda.synchronize()
        rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
        ref = chunked_gdn_backward(rep(q), rep(k), v.double(), g.double(), beta.double(), problem.scale,
                                   do.double(), dht=dht.double())
    per_token = lambda x: x.movedim(1, 3).reshape(1, -1, HV, x.shape[-1])[:, :T]  # noqa: E731
    checks = {"dU": (du, per_token(ref.dU)), "dV": (dv, ref.dv), "dh0": (dh0, ref.dh0),
              "dS_end": (dh, ref.dh[0].movedim(1, 0))}
    for name, (out, want) in checks.items():
        assert not out.isnan().any(), name
        assert _rel(out, want) <= 1e-2, f"{name}: {_rel(out, want):.2e}"


@pytest.mark.gpu
def test_chunk_grads_matches_reference_chunked_backward():
    """The backward's per-chunk kernel alone, fed by the training forward (Tb, T, gamma, S0 per chunk) and the
    reverse pass (dS_end, dU, dX), against chunk_local_grads in float64 via chunked_gdn_backward: dq, dk summed
    over each key head's value heads, dg, dbeta; one sequence of 200 tokens (a chunk tail of 8), GVA 2 -> 4."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit import seqlayout
    from gdnkit.backends.reference.chunked_backward import chunked_gdn_backward
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    from gdnkit.backends.tilelang_sm90.forward import entering_states, forward
    from gdnkit.problem import CHUNK_MODE, validate_inputs

    H, HV, T, dev = 2, 4, 200, "cuda"
    gen = torch.Generator(device=dev).manual_seed(6)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16).requires_grad_()
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    g, beta, dht = F.logsigmoid(r(1, T, HV)), torch.sigmoid(r(1, T, HV)), r(1, HV, K, V)
    do = r(1, T, HV, V).to(torch.bfloat16)
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, output_final_state=True)
    assert problem.needs_grad
    got = {}
    with torch.no_grad():
        saved = forward(problem, inputs, intermediates=got)[2]
        hs = entering_states(problem, saved)  # the backward's S0 per chunk: the state pass run again
        layout = seqlayout.sequence_layout(torch.tensor([0, T], device=dev, dtype=torch.int32))
        nc, dt = layout.n_chunks, "bfloat16"
        gamma = got["gamma"].reshape(HV, nc, 64)
        du, dv = (torch.zeros(1, T, HV, V, device=dev, dtype=torch.bfloat16) for _ in range(2))
        dh = torch.empty(nc, HV, K, V, device=dev, dtype=torch.bfloat16)
        stub = torch.empty(1, HV, K, V, device=dev)
        bwd.backward_state_kernel(H, HV, dt, True, False, 64)(q, k, got["a"], do, gamma, layout.cu_seqlens,
                                                               layout.chunk_offsets, dht, du, dv, dh, stub,
                                                               float(problem.scale), bwd.open_gate(q.device, HV),
                                                               *bwd._no_walks(q.device, HV))
        outs = [torch.full((1, T, H, K), float("nan"), device=dev) for _ in range(2)]
        outs += [torch.full((1, T, HV), float("nan"), device=dev) for _ in range(2)]
        bwd.chunk_grads_kernel(H, HV, dt, "float32")(q, k, v, do, du, dv, got["a"], got["tm"], gamma, beta, hs, dh,
                                          layout.cu_seqlens, layout.chunk_indices, *outs, float(problem.scale))
        torch.cuda.synchronize()
        rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
        ref = chunked_gdn_backward(rep(q), rep(k), v.double(), g.double(), beta.double(), problem.scale,
                                   do.double(), dht=dht.double())
    group_sum = lambda x: x.view(1, T, H, HV // H, K).sum(3)  # noqa: E731
    for name, out, want in zip(("dq", "dk", "dg", "dbeta"), outs, (group_sum(ref.dq), group_sum(ref.dk), ref.dg,
                                                                   ref.dbeta)):
        assert not out.isnan().any(), name
        assert _rel(out, want) <= 1e-2, f"{name}: {_rel(out, want):.2e}"


def _fused_backward_forced(monkeypatch, sm90_config) -> list:
    """On an sm90 GPU (else the test skips): tilelang_sm90's fused backward switched on for this test; returns the
    list its kernel factory's calls are recorded in (a test asserts the kernel ran)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    sm90_config(fused_backward=True)
    launched = []
    real = bwd.backward_fused_kernel
    monkeypatch.setattr(bwd, "backward_fused_kernel", lambda *a: launched.append(a) or real(*a))
    return launched


@pytest.mark.gpu
@pytest.mark.parametrize("H,HV,lengths,state,final", [(2, 4, (200,), True, True),
                                                      (4, 16, (77, 0, 1000, 1333), True, True),
                                                      (2, 8, (8200,), True, True), (16, 32, (4096,), False, True),
                                                      (4, 8, (1000, 333), False, False),
                                                      (4, 4, (1000, 0, 333), True, True)],
                         ids=["one", "varlen", "segments", "16x32", "no-states", "one-per-key-head"])
def test_backward_fused_matches_float64(H, HV, lengths, state, final, monkeypatch, sm90_config):
    """The fused backward (backward_fused.py, one launch after the S0 recompute) through the public API: every
    gradient against the float64 chunked backward, with GVA; a chunk tail of 8 (one), sequences of odd and zero
    length with initial states (varlen), one long sequence in the wide route's segments, each from its dS_end by
    the gated route (segments), 16/32 without an initial state, and a training call with neither state (the
    kernel's dS from zero, no dh0: the usual training call), one value
    head a key head with an empty sequence (one-per-key-head: groups of one); and the
    same call six times, bitwise: dg's chunk-end term (the owner's and g's warpgroup reductions) is where forms that
    moved the roles' timing went wrong from call to call, in a segment's first chunk (K and Q in alternating
    slots; ordered pairs of value heads; docs/performance.md)."""
    launched = _fused_backward_forced(monkeypatch, sm90_config)
    from gdnkit.backends.reference.chunked_backward import chunked_gdn_backward
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit import seqlayout
    states = []   # the state passes' builds: (block_v, store_states, emit_output, chained, store_x)
    real_state = fwd.state_output_kernel
    monkeypatch.setattr(fwd, "state_output_kernel", lambda *a: states.append(a[5:10]) or real_state(*a))
    dev, N = "cuda", len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    T = int(cu[-1])
    gen = torch.Generator(device=dev).manual_seed(21)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = dict(q=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16), k=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16),
             v=r(1, T, HV, V).to(torch.bfloat16), g=F.logsigmoid(r(1, T, HV)), beta=torch.sigmoid(r(1, T, HV)))
    if state:
        x["initial_state"] = r(N, HV, K, V) * 0.1
    do, dht = r(1, T, HV, V).to(torch.bfloat16), r(N, HV, K, V) * 0.1
    runs = []
    for _ in range(6):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, ht = gdnkit.chunk_gated_delta_rule(**leaves, output_final_state=final, cu_seqlens=cu,
                                              backend="tilelang_sm90")
        outs, grads = ([o, ht], [do, dht]) if final else ([o], [do])
        runs.append(dict(zip(leaves, torch.autograd.grad(outs, list(leaves.values()), grads))))
    assert launched, "the fused kernel did not run"
    # where the training forward took the wide route (one program per segment and head at 128 columns), the
    # recompute of S0 and X replays its segments' walks at 32 / 64 columns, as it replays every other pass
    wide = fwd.plan_of(types.SimpleNamespace(HV=HV, needs_grad=True), seqlayout.sequence_layout(cu.to(torch.int32)),
                       torch.device(dev)).route == "wide"
    recomputes = {(bv, chained) for bv, keep, emit, chained, store_x in states if keep and not emit and store_x}
    assert recomputes and all(bv in fwd.NARROW_BLOCK_V for bv, _ in recomputes), states
    assert any(chained for _, chained in recomputes) == wide, (wide, states)
    rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
    want = {n: [] for n in ("q", "k", "v", "g", "beta", "initial_state")}
    with torch.no_grad():
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if a == b:   # no tokens: dh0 is dht (zero without a final state)
                want["initial_state"].append(dht[n:n + 1].double() * final)
                continue
            h0 = x["initial_state"][n:n + 1].double() if state else None
            ref = chunked_gdn_backward(rep(x["q"][:, a:b]), rep(x["k"][:, a:b]), x["v"][:, a:b].double(),
                                       x["g"][:, a:b].double(), x["beta"][:, a:b].double(), K ** -0.5,
                                       do[:, a:b].double(), h0=h0, dht=dht[n:n + 1].double() if final else None)
            for name, t in (("q", _fold_group(ref.dq, H)), ("k", _fold_group(ref.dk, H)), ("v", ref.dv),
                            ("g", ref.dg), ("beta", ref.dbeta), ("initial_state", ref.dh0)):
                want[name].append(t)
    want = {n: torch.cat(ts, dim=0 if n == "initial_state" else 1) for n, ts in want.items() if n in runs[0]}
    errs = {n: _rel(runs[0][n], want[n]) for n in want}
    assert all(e <= 1e-2 for e in errs.values()), errs
    for n in runs[0]:
        assert all(torch.equal(runs[0][n], run[n]) for run in runs[1:]), n


@pytest.mark.gpu
def test_backward_fused_with_options(monkeypatch, sm90_config):
    """The fused backward under the options' prologue (qk l2norm, whose backward runs inside the group sums;
    the gate from A_log / dt_bias; beta's sigmoid), varlen with a chunk tail and an empty sequence,
    both states: every gradient, dA_log and ddt_bias included, against autograd through the float64 reference, and
    the call twice bitwise."""
    launched = _fused_backward_forced(monkeypatch, sm90_config)
    H, HV, dev = 4, 16, "cuda"
    cu = torch.tensor([0, 77, 77, 1000, 1333], device=dev)
    T, N = int(cu[-1]), cu.numel() - 1
    gen = torch.Generator(device=dev).manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = dict(q=r(1, T, H, K).to(torch.bfloat16), k=r(1, T, H, K).to(torch.bfloat16),
             v=r(1, T, HV, V).to(torch.bfloat16), g=r(1, T, HV), beta=r(1, T, HV), initial_state=r(N, HV, K, V) * 0.1,
             A_log=r(HV) * 0.5, dt_bias=r(HV))
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                output_final_state=True, cu_seqlens=cu)
    do, dht = r(1, T, HV, V).to(torch.bfloat16), r(N, HV, K, V) * 0.1
    runs = []
    for _ in range(2):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, ht = gdnkit.chunk_gated_delta_rule(**leaves, **opts, backend="tilelang_sm90")
        runs.append(dict(zip(leaves, torch.autograd.grad([o, ht], list(leaves.values()), [do, dht]))))
    assert launched, "the fused kernel did not run"
    d64 = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    o, ht = gdnkit.chunk_gated_delta_rule(**d64, **opts, backend="reference")
    want = dict(zip(d64, torch.autograd.grad([o, ht], list(d64.values()), [do.double(), dht.double()])))
    errs = {n: _rel(runs[0][n], want[n]) for n in want}
    assert all(e <= 1e-2 for e in errs.values()), errs
    for n in runs[0]:
        assert torch.equal(runs[0][n], runs[1][n]), n


def _fold_group(t, H):
    """dq / dk of one sequence from the reference's per-value-head [1, L, HV, K], summed over each key head's group."""
    return t.view(1, t.shape[1], H, -1, t.shape[-1]).sum(3)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["staged", "fused"])
def test_training_gradients_repeat_bitwise(fused, monkeypatch, sm90_config):
    """Two backward passes of the same training call give bitwise-identical gradients (no float atomics),
    through the public API with GVA, varlen and an initial state; the default backward and the fused one."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    sm90_config(fused_backward=fused)
    H, HV, dev = 4, 16, "cuda"
    cu = torch.tensor([0, 77, 1000, 1333], device=dev)
    T = int(cu[-1])
    gen = torch.Generator(device=dev).manual_seed(8)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = dict(q=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16), k=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16),
             v=r(1, T, HV, V).to(torch.bfloat16), g=F.logsigmoid(r(1, T, HV)), beta=torch.sigmoid(r(1, T, HV)),
             initial_state=r(3, HV, K, V) * 0.1)
    do = r(1, T, HV, V).to(torch.bfloat16)
    runs = []
    for _ in range(2):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, ht = gdnkit.chunk_gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=cu, backend="tilelang_sm90")
        runs.append(torch.autograd.grad([o, ht], list(leaves.values()), [do, torch.ones_like(ht)]))
    for name, a, b in zip(x, *runs):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("H,HV,T", [(2, 8, 1000), (4, 16, 4160)], ids=["side-stream", "segments"])
@pytest.mark.parametrize("fused", [False, True], ids=["staged", "fused"])
def test_training_call_in_a_cuda_graph_matches_eager(H, HV, T, fused, monkeypatch, sm90_config):
    """A training call (forward and backward) captured in a CUDA graph and replayed gives the eager call's
    gradients, its outputs poisoned before the replay. side-stream: no segments, so the backward's S0 recompute
    runs on a side stream beside the reverse pass (backward._recompute_beside), forked and joined inside the
    capture; the first replay reads S0 from graph-pool memory no earlier call wrote, so a read before the join
    shows. segments: the forward's gated lead-in route (nothing read back) and the backward's exact route under
    capture, where eager may take the backward's lead-in route (dS_end within e^-12 of each other): gradients
    compared to 2e-3, not bitwise. fused: the same calls through the fused backward (its S0 recompute in series,
    then one kernel)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    sm90_config(fused_backward=fused)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(12)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = dict(q=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16), k=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16),
             v=r(1, T, HV, V).to(torch.bfloat16), g=F.logsigmoid(r(1, T, HV)), beta=torch.sigmoid(r(1, T, HV)))
    do = r(1, T, HV, V).to(torch.bfloat16)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}

    def call():
        o = gdnkit.chunk_gated_delta_rule(**leaves, backend="tilelang_sm90")[0]
        return torch.autograd.grad(o, list(leaves.values()), do)

    want = [t.clone() for t in call()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    for t in got:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(x, want, got):
        assert torch.isfinite(b).all(), name
        assert _rel(b, a) <= 2e-3, f"{name}: {_rel(b, a):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("route,gate_scale", [("gated", 1.0), ("gated", 1e-3), ("chained", (1.0, 1e-3)),
                                              ("wide", (1.0, 1e-3))],
                         ids=["lead_in", "weak-gates", "chained-mixed-gates", "wide-mixed-gates"])
def test_training_with_context_parallelism(route, gate_scale, monkeypatch, sm90_config):
    """One long sequence at 2/8 (segments on an H200): forward and backward in segments, by lead-ins with
    decaying gates, by the exact routes (propagator and segment scans) with gates that barely decay, by the
    chained routes (16-chunk segments, the exact route made not to pay) with half the heads barely decaying, so
    their programs walk up to 8 segments both ways; by the backward's wide route (at 65573 tokens: 16 segments,
    one 128-column reverse-pass program per segment and head, half the heads walking far); every gradient
    against the float64 chunked backward."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    pytest.importorskip("triton")
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.reference.chunked_backward import chunked_gdn_backward
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    from gdnkit.backends.tilelang_sm90 import context_parallel
    H, HV, T, dev = 2, 8, 65536 + 37 if route == "wide" else 8200, "cuda"
    # the staged path's routes (fused_pays would give 2/8 at 65573 tokens to the fused kernel, whose segments
    # test_backward_fused_matches_float64[segments] checks)
    sm90_config(fused_backward=False)
    sm90_config(wide_route=route == "wide")
    if route == "chained":
        sm90_config(segment_chunks=16)
        sm90_config(exact_route_pays=False)
    routes = []
    real_segments = bwd._segments
    monkeypatch.setattr(bwd, "_segments", lambda *a: routes.append(real_segments(*a)[1]) or real_segments(*a))
    tiles = []   # the reverse pass's V tiles
    real_kernel = bwd.backward_state_kernel
    monkeypatch.setattr(bwd, "backward_state_kernel", lambda *a: tiles.append(a[5]) or real_kernel(*a))
    gen = torch.Generator(device=dev).manual_seed(9)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    rates = torch.tensor(gate_scale, device=dev).repeat(HV // 2) if isinstance(gate_scale, tuple) else gate_scale
    x = dict(q=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16), k=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16),
             v=r(1, T, HV, V).to(torch.bfloat16), g=F.logsigmoid(r(1, T, HV)) * rates,
             beta=torch.sigmoid(r(1, T, HV)), initial_state=r(1, HV, K, V) * 0.1)
    do, dht = r(1, T, HV, V).to(torch.bfloat16), r(1, HV, K, V) * 0.1
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    cu = torch.tensor([0, T], device=dev)
    o, ht = gdnkit.chunk_gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=cu, backend="tilelang_sm90")
    got = dict(zip(leaves, torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])))
    rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
    scale = K ** -0.5
    with torch.no_grad():
        ref = chunked_gdn_backward(rep(x["q"]), rep(x["k"]), x["v"].double(), x["g"].double(), x["beta"].double(),
                                   scale, do.double(), h0=x["initial_state"].double(), dht=dht.double())
        ref_o, _, _ = chunked_gdn(rep(x["q"]), rep(x["k"]), x["v"].double(), x["g"].double(), x["beta"].double(),
                                  scale, x["initial_state"].double())
    fold = lambda t: t.view(1, T, H, HV // H, K).sum(3)  # noqa: E731
    want = dict(q=fold(ref.dq), k=fold(ref.dk), v=ref.dv, g=ref.dg, beta=ref.dbeta, initial_state=ref.dh0)
    assert _rel(o, ref_o) <= BF16_FWD_BAR
    errs = {n: _rel(got[n], want[n]) for n in want}
    assert all(e <= 1e-2 for e in errs.values()), errs
    # the route is planned once per backward pass, and a first call's dry run plans the backward too
    assert routes and set(routes) == {"chained" if route == "wide" else route}, routes
    assert (128 in tiles) == (route == "wide"), tiles   # the wide route's reverse pass runs all 128 columns



@pytest.mark.gpu
@pytest.mark.parametrize("fused,mixed", [(True, False), (True, True), (False, False)],
                         ids=["fused", "fused-mixed-gates", "staged"])
def test_training_in_waves(fused, mixed, monkeypatch, sm90_config):
    """Packed training documents at 8/32, 8192 + 8192 + 4096 tokens (96 (sequence, head) pairs: the longest
    sequence bounds one program per pair), planned in the wide route's waves (plan.wide_waves_segment_chunks,
    48-chunk segments in two waves of 132 SMs): the forward launches the pass over segments and the one over
    sequences and the device picks (the segments where the gates decay; the sequences where half the heads barely
    decay, mixed), and the backward runs in the segments either way, each from its dS_end (fused: the fused kernel,
    one program per segment and head; staged: the reverse pass walking the chained route). Every gradient
    against the float64 chunked backward of each document, the forward's output too, and the call twice bitwise."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    pytest.importorskip("triton")
    from gdnkit import seqlayout
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.reference.chunked_backward import chunked_gdn_backward
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    H, HV, lengths, dev = 8, 32, (8192, 8192, 4096), "cuda"
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    planned = fwd.plan_of(types.SimpleNamespace(HV=HV, needs_grad=True), seqlayout.sequence_layout(cu),
                          torch.device(dev))
    if planned.route != "waves":
        pytest.skip(f"this GPU's SM count plans {planned.route} here (132 SMs plan waves)")
    assert planned.fused_backward and planned.fused_segment_chunks == planned.segment_chunks
    sm90_config(fused_backward=fused)
    fused_launches = []
    real_fused = bwd.backward_fused_kernel
    monkeypatch.setattr(bwd, "backward_fused_kernel", lambda *a: fused_launches.append(a) or real_fused(*a))
    picks = []   # the device's pick per training forward (the backend imports forward at each call)
    real_forward = fwd.forward

    def forward_recording_pick(problem, inputs, intermediates=None):
        got = {} if intermediates is None else intermediates
        out = real_forward(problem, inputs, intermediates=got)
        picks.append(bool(got["wide_choice"]))
        return out
    monkeypatch.setattr(fwd, "forward", forward_recording_pick)
    T, N = int(cu[-1]), len(lengths)
    gen = torch.Generator(device=dev).manual_seed(31)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    rates = torch.tensor((1.0, 1e-3), device=dev).repeat(HV // 2) if mixed else 1.0
    x = dict(q=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16),
             k=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16), v=r(1, T, HV, V).to(torch.bfloat16),
             g=F.logsigmoid(r(1, T, HV)) * rates, beta=torch.sigmoid(r(1, T, HV)))
    do = r(1, T, HV, V).to(torch.bfloat16)
    runs, outs = [], []
    for _ in range(2):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, _ = gdnkit.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, backend="tilelang_sm90")
        outs.append(o.detach())
        runs.append(dict(zip(leaves, torch.autograd.grad(o, list(leaves.values()), do))))
    assert bool(fused_launches) == fused
    # the device's pick in the last call (a first call's dry run may pick too, on unwritten buffers): the segments
    # unless half the heads barely decay (their walks would reach back to their sequences' starts)
    assert picks and picks[-1] == (not mixed), picks
    rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
    want = {n: [] for n in x}
    ref_o = []
    with torch.no_grad():
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            args = (rep(x["q"][:, a:b]), rep(x["k"][:, a:b]), x["v"][:, a:b].double(), x["g"][:, a:b].double(),
                    x["beta"][:, a:b].double(), K ** -0.5)
            ref_o.append(chunked_gdn(*args)[0])
            ref = chunked_gdn_backward(*args, do[:, a:b].double())
            for name, t in (("q", _fold_group(ref.dq, H)), ("k", _fold_group(ref.dk, H)), ("v", ref.dv),
                            ("g", ref.dg), ("beta", ref.dbeta)):
                want[name].append(t)
    want = {n: torch.cat(ts, dim=1) for n, ts in want.items()}
    assert _rel(outs[0], torch.cat(ref_o, dim=1)) <= BF16_FWD_BAR
    errs = {n: _rel(runs[0][n], want[n]) for n in want}
    assert all(e <= 1e-2 for e in errs.values()), errs
    assert torch.equal(outs[0], outs[1]) and all(torch.equal(runs[0][n], runs[1][n]) for n in want)

def test_forward_copies_inputs_whose_base_tma_cannot_take():
    """A TMA descriptor needs a 16-byte aligned base: a contiguous view one element into a buffer is copied,
    an aligned tensor passes through as it is (no copy)."""
    from gdnkit.backends.tilelang_sm90.forward import _tma_aligned
    buf = torch.randn(1 + 4 * 128, dtype=torch.bfloat16)
    view = buf[1:].view(1, 4, 1, 128)
    assert view.data_ptr() % 16 != 0
    out = _tma_aligned(view)
    assert out.data_ptr() % 16 == 0 and torch.equal(out, view)
    aligned = torch.randn(1, 4, 1, 128, dtype=torch.bfloat16)
    assert _tma_aligned(aligned) is aligned


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["staged", "fused"])
def test_training_below_the_gate_floor(fused, sm90_config):
    """Gates at -inf (resets) and at -40 (finite, under the chunked form's floor) in a GVA varlen training call with
    the qk l2norm on: every gradient against the token-by-token float64 recurrence's autograd (tests/oracle.py),
    and dg exactly 0 at each gate under the floor (the fused path zeroes it in the group sums' launch, the staged
    one in the prologue's backward)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    import oracle  # tests/ is on sys.path
    sm90_config(fused_backward=fused)
    H, HV, lengths, dev = 4, 8, (300, 64, 1000), "cuda"
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    T = int(cu[-1])
    gen = torch.Generator(device=dev).manual_seed(12)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = dict(q=r(1, T, H, K).to(torch.bfloat16), k=r(1, T, H, K).to(torch.bfloat16), v=r(1, T, HV, V).to(torch.bfloat16),
             g=F.logsigmoid(r(1, T, HV) + 2), beta=torch.sigmoid(r(1, T, HV)))
    under = [(5, 0), (64, 3), (300, 7), (301, 1), (700, 2), (1363, 5)]   # (token, value head)
    for i, (t, h) in enumerate(under):
        x["g"][0, t, h] = float("-inf") if i % 2 == 0 else -40.0
    do = r(1, T, HV, V).to(torch.bfloat16)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, _ = gdnkit.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, backend="tilelang_sm90")
    got = dict(zip(leaves, torch.autograd.grad(o, list(leaves.values()), do)))
    ref_leaves = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    o_ref, _, _ = oracle.run(**ref_leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    want = dict(zip(ref_leaves, torch.autograd.grad(o_ref, list(ref_leaves.values()), do.double())))
    assert all(torch.isfinite(w).all() for w in want.values()), "the oracle's gradients are finite here"
    assert _rel(o.detach(), o_ref.detach()) <= BF16_FWD_BAR
    errs = {n: _rel(got[n], want[n]) for n in want}
    assert all(e <= 1e-2 for e in errs.values()), errs
    for t, h in under:
        assert got["g"][0, t, h] == 0, (t, h, float(got["g"][0, t, h]))
