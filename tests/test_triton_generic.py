"""triton_generic against the float64 reference.

Without a GPU the kernels run in the Triton interpreter on CPU tensors (small shapes, fp32/fp16: the
interpreter's bf16 tl.dot is broken), called through the backend's entry points since dispatch rightly
declines CPU problems. With a GPU the same tests run on CUDA tensors, plus the `gpu` ones at the quick
grid's head configs through the public API.
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
from gdnkit import dispatch  # noqa: E402
from gdnkit.backends.triton_generic import BACKEND  # noqa: E402
from gdnkit.problem import CHUNK_MODE, validate_inputs  # noqa: E402

pytest.importorskip("triton")
np = pytest.importorskip("numpy")  # Triton's interpreter needs it (the gpu extra brings it; the test extra does not)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRADS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def rel(x, ref):
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def make_call(T, H, HV, K, V, *, lengths=None, seed=0, initial_state=True, raw=False, gate=False,
              dt_bias=True, **options):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    N = 1 if lengths is None else len(lengths)
    if lengths is not None:
        B = 1
    else:
        B, N = options.pop("B", 1), None
    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    if not options.get("use_qk_l2norm_in_kernel"):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = rnd(B, T, HV) if gate else F.logsigmoid(rnd(B, T, HV))
    beta = rnd(B, T, HV) if raw else torch.sigmoid(rnd(B, T, HV))
    call = dict(q=q, k=k, v=rnd(B, T, HV, V), g=g, beta=beta, output_final_state=True, **options)
    if initial_state:
        shape = (N or B, HV, V, K) if options.get("state_v_first") else (N or B, HV, K, V)
        call["initial_state"] = rnd(*shape) * 0.3
    if gate:
        call.update(use_gate_in_kernel=True, A_log=rnd(HV) * 0.5)
        if dt_bias:
            call["dt_bias"] = rnd(HV)
    if lengths is not None:
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        call["cu_seqlens"] = offsets
    return call


def reference(call):
    """o, final state and gradients by autograd through the float64 reference (public API)."""
    leaves = {n: call[n].detach().clone().requires_grad_() for n in GRADS if call.get(n) is not None}
    o, ht = gdnkit.chunk_gated_delta_rule(**{**call, **leaves}, backend="reference")
    gen = torch.Generator().manual_seed(99)
    do, dht = torch.randn(o.shape, generator=gen, dtype=o.dtype), torch.randn(ht.shape, generator=gen, dtype=ht.dtype)
    grads = torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])
    return o.detach(), ht.detach(), dict(zip(leaves, grads)), do, dht


def run_backend(call, dtype, do, dht, device=DEVICE, fuse="auto", sm_count=None, segment_chunks=None):
    """The backend's entry points directly (dispatch declines CPU tensors)."""
    from gdnkit.backends.triton_generic import chunked
    cast = {n: (t.to(device=device, dtype=dtype if n in ("q", "k", "v") else torch.float32)
                if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in call.items()}
    if "cu_seqlens" in cast:
        cast["cu_seqlens"] = cast["cu_seqlens"].to(device)
    for n in GRADS:
        if cast.get(n) is not None:
            cast[n].requires_grad_()
    problem, inputs = validate_inputs(CHUNK_MODE, **cast)
    assert problem.needs_grad
    old, chunked.FUSE_OUTPUT = chunked.FUSE_OUTPUT, fuse
    old_sms, chunked.SM_COUNT = chunked.SM_COUNT, sm_count
    old_cp, chunked.CP_SEGMENT_CHUNKS = chunked.CP_SEGMENT_CHUNKS, segment_chunks
    try:
        if segment_chunks:
            segments = chunked.plan(problem, inputs.cu_seqlens, inputs.q.device).segments
            assert (segments.seg_offsets[1:] - segments.seg_offsets[:-1]).max() > 1
        o, ht, saved = BACKEND.chunk_forward(problem, inputs)
        grads = BACKEND.chunk_backward(problem, saved, do.to(device=device, dtype=o.dtype), dht.to(device).float())
    finally:
        chunked.FUSE_OUTPUT, chunked.SM_COUNT, chunked.CP_SEGMENT_CHUNKS = old, old_sms, old_cp
    names = dict(zip(GRADS, grads))
    return o, ht, {n: names[n] for n in GRADS if call.get(n) is not None}


def check(call, dtype=torch.float32, bound=None, fuse="auto", sm_count=None, segment_chunks=None):
    # fp32: exact products in the interpreter, tf32x3 on a GPU
    bound = bound or ((2e-5 if DEVICE == "cpu" else 1e-4) if dtype == torch.float32 else 3e-3)
    o_ref, ht_ref, g_ref, do, dht = reference(call)
    o, ht, grads = run_backend(call, dtype, do, dht, fuse=fuse, sm_count=sm_count, segment_chunks=segment_chunks)
    errs = {"o": rel(o, o_ref), "ht": rel(ht, ht_ref)}
    errs.update({f"d{n}": rel(grads[n], g_ref[n]) for n in g_ref})
    bad = {n: e for n, e in errs.items() if not e < bound}
    assert not bad, f"errors over {bound}: {bad} (all: {errs})"
    return errs


# K = V = 32 keeps the interpreter quick; the kernels are shape-generic over powers of two.
@pytest.mark.parametrize("fuse", ["always", "never"])
def test_fixed_length_with_state(fuse):
    check(make_call(130, 1, 2, 32, 32, B=2), fuse=fuse)


@pytest.mark.parametrize("segment_chunks", [None, 1])
def test_forward_and_backward_read_only_what_they_wrote(segment_chunks, request):
    """Every buffer the forward and the backward allocate comes NaN-filled (conftest.poisoned_empty), so a
    kernel that reads an element no program wrote (a tail chunk's rows or columns past the sequence, a partial
    sum no program made) turns an output NaN even where the arithmetic multiplies it by zero. A chunk tail,
    GVA, initial state and dht; plain and context-parallel (one-chunk segments)."""
    call = make_call(150, 2, 4, 32, 32, B=1)
    o_ref, ht_ref, g_ref, do, dht = reference(call)
    request.getfixturevalue("poisoned_empty")  # after the reference: only the backend's buffers
    o, ht, grads = run_backend(call, torch.float32, do, dht, segment_chunks=segment_chunks)
    errs = {"o": rel(o, o_ref), "ht": rel(ht, ht_ref), **{f"d{n}": rel(grads[n], g_ref[n]) for n in g_ref}}
    bound = 2e-5 if DEVICE == "cpu" else 1e-4
    assert all(e < bound for e in errs.values()), f"errors (NaN: a read of unwritten memory): {errs}"


def test_gva_varlen_odd_and_empty_sequences():
    check(make_call(200, 2, 4, 32, 32, lengths=[37, 0, 93, 1, 69]), fuse="never")


def test_varlen_fused_no_initial_state():
    check(make_call(193, 1, 3, 32, 32, lengths=[0, 64, 129], initial_state=False), fuse="always")


@pytest.mark.parametrize("fuse", ["always", "never"])
def test_varlen_tokens_past_the_last_offset_get_zero(fuse, poisoned_empty):
    """Every output row of every sequence is written by a kernel, and only the tokens past cu_seqlens[-1]
    are zeroed (outputs are allocated empty): with poisoned allocations, no NaN survives anywhere."""
    call = make_call(150, 1, 2, 32, 32, lengths=[50, 70])
    call = {n: (t[:, :150] if n in ("q", "k", "v", "g", "beta") else t) for n, t in call.items()}
    o_ref, ht_ref, g_ref, do, dht = reference(call)
    o, ht, grads = run_backend(call, torch.float32, do, dht, fuse=fuse)
    assert rel(o, o_ref) < 2e-5 and rel(ht, ht_ref) < 2e-5
    assert o[:, 120:].abs().max() == 0
    for name in ("q", "k", "v", "g", "beta"):
        assert grads[name][:, 120:].abs().max() == 0, name
        assert rel(grads[name], g_ref[name]) < 2e-5, name


def test_all_options():
    check(make_call(150, 1, 2, 32, 32, raw=True, gate=True, use_qk_l2norm_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True))


def test_gate_without_dt_bias_and_state_v_first():
    check(make_call(90, 1, 2, 32, 64, gate=True, dt_bias=False, state_v_first=True))


def test_k_and_v_differ_and_gva_fixed():
    check(make_call(100, 1, 4, 64, 32), fuse="never")


def test_one_value_head_per_key_head():
    # H == HV: the per-chunk gradient kernels' one launch per group member is a single launch, nothing summed
    check(make_call(100, 2, 2, 32, 32, B=2))


@pytest.mark.parametrize("narrowest", [16, 32])
def test_narrow_v_blocks_when_few_programs(narrowest, monkeypatch):
    # a huge SM count makes the plan split V into the narrowest blocks allowed and leave the output unfused
    from gdnkit.backends.triton_generic import chunked
    monkeypatch.setattr(chunked, "MIN_BLOCK_V", narrowest)
    problem, _ = validate_inputs(CHUNK_MODE, **make_call(100, 1, 2, 32, 64, B=1))
    monkeypatch.setattr(chunked, "SM_COUNT", 10 ** 6)
    p = chunked.plan(problem, None, torch.device("cpu"))
    assert (p.block_v, p.fuse_output, p.segments) == (narrowest, False, None)
    check(make_call(100, 1, 2, 32, 64, B=1), sm_count=10 ** 6)


@pytest.mark.parametrize("fuse", ["always", "never"])
def test_context_parallel_fixed_length(fuse):
    # segments of one chunk: every chunk boundary is a segment boundary (the forward's [E | P] pass,
    # segment scan and per-segment pass, and the backward's reverse scan with P^T)
    check(make_call(200, 1, 2, 32, 32, B=2), fuse=fuse, segment_chunks=1)


def test_context_parallel_varlen_v_first():
    check(make_call(300, 2, 4, 32, 64, lengths=[37, 0, 200, 63], state_v_first=True), segment_chunks=2)


def test_bf16_through_the_patched_interpreter(bf16_interpreter):
    # the GPU's dtype on the CPU (conftest.bf16_interpreter): the GPU tests' bars, on bf16-rounded inputs so
    # the error is the kernels' own. The patched interpreter gives the H200's dq / dk / dv errors to three
    # digits on test_gpu_quick_heads_gradients_bf16[8-32]'s input, but dg 2.7e-3 where the H200 gave 1.06e-2
    # before the backward's recompute split U' (docs/performance.md): that loss is the GPU build's, not the algebra's.
    call = _bf16_rounded(make_call(200, 1, 2, 32, 32, lengths=[1, 64, 135]))
    o_ref, ht_ref, g_ref, do, dht = reference(call)
    o, ht, grads = run_backend(call, torch.bfloat16, do, dht)
    errs = {"o": rel(o, o_ref), "ht": rel(ht, ht_ref), **{f"d{n}": rel(grads[n], g_ref[n]) for n in g_ref}}
    assert errs["o"] > 1e-4, errs  # bf16 really ran: exact products would leave only fp32 rounding
    _assert_bounds(errs)

def test_fp16():
    check(make_call(130, 1, 2, 32, 32), dtype=torch.float16)


def test_all_sequences_empty():
    call = make_call(5, 1, 2, 32, 32, lengths=[0, 0])
    o_ref, ht_ref, _, do, dht = reference(call)
    o, ht, grads = run_backend(call, torch.float32, do, dht)
    assert o.abs().max() == 0 and rel(ht, ht_ref) < 1e-6  # h0 passed through, rounded to fp32
    assert torch.equal(grads["initial_state"].cpu(), dht.float())


class _Bounds:
    """Interpreter hooks: every active (unmasked) load/store address of a launch must lie inside the one
    tensor argument that holds its first active address (an overrun into a neighbouring tensor counts);
    also records each launch's keyword arguments."""

    def __init__(self, monkeypatch):
        from triton.runtime import interpreter as interp
        self.launches, self.errors, self.ranges, self.name = [], [], [], None
        call, load, store = (interp.GridExecutor.__call__, interp.InterpreterBuilder.create_masked_load,
                             interp.InterpreterBuilder.create_masked_store)
        itemsize = lambda ptrs: np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize  # noqa: E731

        def run(executor, *args, **kwargs):
            self.name = executor.fn.__name__
            self.launches.append((self.name, kwargs))
            self.ranges = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                           for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            return call(executor, *args, **kwargs)

        def check(ptrs, mask, kind):
            a = ptrs.data.astype(np.uint64).ravel()[np.broadcast_to(mask.data, ptrs.data.shape).ravel()]
            if a.size:
                size, first = itemsize(ptrs), int(a[0])
                inside = [((a >= lo) & (a + size <= hi)).all() for lo, hi in self.ranges
                          if lo <= first and first + size <= hi]
                if not any(inside) and len(self.errors) < 10:
                    self.errors.append(f"{self.name}: {kind} out of bounds")

        monkeypatch.setattr(interp.GridExecutor, "__call__", run)
        monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_load",
                            lambda b, ptrs, mask, other, *a: (check(ptrs, mask, "load"),
                                                              load(b, ptrs, mask, other, *a))[1])
        monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_store",
                            lambda b, ptrs, value, mask, *a: (check(ptrs, mask, "store"),
                                                              store(b, ptrs, value, mask, *a))[1])


@pytest.mark.skipif(DEVICE != "cpu", reason="checks addresses inside the Triton interpreter")
def test_backward_as_at_the_h200_bench_point(monkeypatch):
    """The call that raised an illegal memory access on the H200 with 32-wide dot tiles: one packed sequence with int64
    cu_seqlens, K = V = 128, no initial state, no final state, dht=None, context parallel (16 segments of 8
    chunks at H=4 HV=8 x 8192 on 132 SMs), output fused forward, unfused V-64 state pass backward. Scaled
    to 640 tokens and 8 SMs: the same plan with 2 segments. Every address stays in its own tensor (the
    exact bench shape does too: checked once, ~8 min), the gradients are right, and the per-chunk gradient
    kernels run the 64-wide tiles the H200 workaround asks for (32-wide ones are the suspect there)."""
    from gdnkit.backends.triton_generic import chunked
    bounds = _Bounds(monkeypatch)
    call = make_call(640, 1, 2, 128, 128, lengths=[640], initial_state=False)
    call.update(output_final_state=False, cu_seqlens=call["cu_seqlens"].long())
    leaves = {n: call[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    o_ref, _ = gdnkit.chunk_gated_delta_rule(**{**call, **leaves}, backend="reference")
    do = torch.randn(o_ref.shape, generator=torch.Generator().manual_seed(99), dtype=o_ref.dtype)
    g_ref = dict(zip(leaves, torch.autograd.grad(o_ref, list(leaves.values()), do)))

    cast = {n: (t.to(torch.float16 if n in ("q", "k", "v") else torch.float32).requires_grad_()
                if n in leaves else t) for n, t in call.items()}
    problem, inputs = validate_inputs(CHUNK_MODE, **cast)
    monkeypatch.setattr(chunked, "SM_COUNT", 8)
    monkeypatch.setattr(chunked, "CP_MAX_SM_SHARE", 0.5)  # the rule of that day
    p = chunked.plan(problem, inputs.cu_seqlens, inputs.q.device)
    assert p.fuse_output and p.block_v == 64 and p.segments.n_seg == 2
    assert chunked.plan(problem, inputs.cu_seqlens, inputs.q.device, fusable=False).block_v == 64
    o, ht, saved = BACKEND.chunk_forward(problem, inputs)
    grads = BACKEND.chunk_backward(problem, saved, do.to(o.dtype), None)
    assert ht is None and not bounds.errors, bounds.errors
    errs = {"o": rel(o, o_ref), **{f"d{n}": rel(getattr(grads, f"d{n}"), g_ref[n]) for n in leaves}}
    assert all(e < 3e-3 for e in errs.values()), errs
    widths = [(name, kw[b]) for name, kw in bounds.launches if name in ("backward_chunk_kernel", "backward_wy_kernel")
              for b in ("BK", "BV")]
    assert widths and all(w >= 64 for _, w in widths), widths


# ---------------------------------------------------------------- what dispatch sees

def _problem(device_type="cuda", dtype=torch.bfloat16, K=128, V=128, **kw):
    base = dict(mode=CHUNK_MODE, B=1, T=64, H=2, HV=4, K=K, V=V, N=1, dtype=dtype, gate_dtype=torch.float32,
                device_type=device_type, device_index=0, scale=K ** -0.5, varlen=False, has_initial_state=False,
                state_dtype=None, output_final_state=False)
    base.update(kw)
    from gdnkit.problem import Problem
    return Problem(**base)


def _machine(capability=(8, 6), triton=True):
    gpu = dispatch.GPU(index=0, name="Some GPU", capability=capability, sm_count=80, total_memory_bytes=1 << 34)
    packages = {"triton": "3.6.0" if triton else None}
    errors = {} if triton else {"triton": "ModuleNotFoundError: No module named 'triton'"}
    return dispatch.Machine(gpus=(gpu,), packages=packages, import_errors=errors)


def test_auto_dispatch_picks_triton_generic_on_a_cuda_gpu():
    backend, decision = dispatch.select(_problem(), machine=_machine())
    assert decision.chosen in ("triton_generic",) or backend.priority > BACKEND.priority
    _, decision = dispatch.select(_problem(needs_grad=True), machine=_machine())
    assert decision.chosen == "triton_generic"


def test_reasons():
    m = _machine()
    assert BACKEND.reasons(_problem(), m) == []
    assert any("CUDA" in r for r in BACKEND.reasons(_problem(device_type="cpu"), m))
    assert any("float64 runs on the reference" in r for r in BACKEND.reasons(_problem(dtype=torch.float64), m))
    assert any("K=96" in r for r in BACKEND.reasons(_problem(K=96), m))
    assert any("V=32" in r for r in BACKEND.reasons(_problem(V=32), m))
    assert any("capability" in r for r in BACKEND.reasons(_problem(), _machine(capability=(7, 5))))
    assert any("triton" in r for r in BACKEND.reasons(_problem(), _machine(triton=False)))
    assert any("GPU" in r for r in BACKEND.unavailable_reasons(dispatch.Machine(packages={"triton": "3.9"})))



def test_host_sizes_match_triton():
    """The plain-Python grid helpers (sizes.py: triton's own cost ~2 us a call on the host) give triton's values."""
    import triton

    from gdnkit.backends.triton_shared.sizes import cdiv, next_power_of_2
    for n in range(0, 600):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 16, 32, 64, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)


def test_launch_settings_table_and_override(monkeypatch):
    from gdnkit.backends.triton_shared import launch
    monkeypatch.delenv("GDNKIT_TRITON_LAUNCH", raising=False)
    assert launch.settings("fused", torch.bfloat16) == {"num_warps": 4, "num_stages": 3}
    assert launch.settings("fused", torch.float32) == {"num_warps": 8, "num_stages": 1}  # Ada's shared memory
    monkeypatch.setenv("GDNKIT_TRITON_LAUNCH", "output=4x2, fused=2x1")
    assert launch.settings("output", torch.float16) == {"num_warps": 4, "num_stages": 2}
    assert launch.settings("fused", torch.float32) == {"num_warps": 2, "num_stages": 1}
    assert launch.settings("kkt", torch.bfloat16) == {"num_warps": 4, "num_stages": 2}
    for bad in ("outptu=4x2", "output=4", "output=ax2"):
        monkeypatch.setenv("GDNKIT_TRITON_LAUNCH", bad)
        with pytest.raises(ValueError, match="GDNKIT_TRITON_LAUNCH"):
            launch.settings("output", torch.bfloat16)


def test_launch_retries_at_fewer_stages_where_shared_memory_is_short(monkeypatch):
    # a GPU with less shared memory than the H200 (sm86/89: 99 KB): Triton raises OutOfResources before the
    # kernel runs; launch() steps the stages down until a build fits, and keeps that for the next calls
    from triton.runtime.errors import OutOfResources
    from gdnkit.backends.triton_shared import launch
    monkeypatch.delenv("GDNKIT_TRITON_LAUNCH", raising=False)
    monkeypatch.setattr(launch, "_FITTED", {})
    tried = []

    class Kernel:  # needs one stage at most, like a 128 KB fp32 build on a 99 KB GPU
        def __getitem__(self, grid):
            def run(*args, num_warps, num_stages, **kwargs):
                tried.append(num_stages)
                if num_stages > 1:
                    raise OutOfResources(128 * 1024, 99 * 1024, "shared memory")
                return args, kwargs, grid
            return run

    assert launch.launch("backward_chunk", torch.bfloat16, Kernel(), (2,), 7, X=1) == ((7,), {"X": 1}, (2,))
    assert tried == [3, 2, 1]
    launch.launch("backward_chunk", torch.bfloat16, Kernel(), (2,), 7, X=1)
    assert tried == [3, 2, 1, 1]  # remembered
    launch.launch("backward_chunk", torch.bfloat16, Kernel(), (2,), 7, X=2)
    assert tried == [3, 2, 1, 1, 3, 2, 1]  # another build (compile-time arguments) is fitted on its own

    class Never:
        def __getitem__(self, grid):
            def run(*args, num_warps, num_stages, **kwargs):
                raise OutOfResources(1 << 30, 99 * 1024, "shared memory")
            return run
    with pytest.raises(OutOfResources):
        launch.launch("output", torch.bfloat16, Never(), (1,))

# ---------------------------------------------------------------- on a GPU, through the public API

QUICK_HEADS = [(2, 8), (4, 16), (8, 32), (16, 64)]


def _bf16_rounded(call):
    """q, k, v rounded to bfloat16 first, so the float64 reference sees exactly the values the kernels get and
    the errors below are the kernels' own, not the inputs' quantisation."""
    return {n: (t.to(torch.bfloat16).double() if n in ("q", "k", "v") else t) for n, t in call.items()}


def _public_forward_errors(call):
    """Forward through the public API."""
    call = _bf16_rounded(call)
    o_ref, ht_ref, _, _, _ = reference(call)
    dev = {n: (t.to("cuda") if isinstance(t, torch.Tensor) else t) for n, t in call.items()}
    dev.update({n: dev[n].to(torch.bfloat16) for n in ("q", "k", "v")})
    dev.update({n: dev[n].float() for n in ("g", "beta", "initial_state", "A_log", "dt_bias") if n in dev})
    with torch.no_grad():
        o, ht = gdnkit.chunk_gated_delta_rule(**dev, backend="triton_generic")
    return {"o": rel(o.cpu(), o_ref), "ht": rel(ht.cpu(), ht_ref)}


def _gradient_errors(call):
    """Gradients through the backend's entry points."""
    call = _bf16_rounded(call)
    _, _, g_ref, do, dht = reference(call)
    _, _, grads = run_backend(call, torch.bfloat16, do, dht, device="cuda")
    return {f"d{n}": rel(g.cpu(), g_ref[n]) for n, g in grads.items()}


# dA_log and ddt_bias are per-head sums of dg over every token: HV numbers, whose relative error is that of
# a few long sums. Measured on the H200 (K=256, all options): 2.2e-2 and 3.0e-2, with dg itself
# at 9.9e-3. They get their own bound until dg's precision improves (docs/performance.md, triton_generic).
GRAD_BOUNDS = {"dA_log": 5e-2, "ddt_bias": 5e-2}


def _assert_bounds(errs):
    fwd = {n: e for n, e in errs.items() if n in ("o", "ht") and not e <= 5e-3}
    grad = {n: e for n, e in errs.items() if n not in ("o", "ht") and not e <= GRAD_BOUNDS.get(n, 1e-2)}
    assert not fwd and not grad, errs


@pytest.mark.gpu
@pytest.mark.parametrize("H,HV", QUICK_HEADS)
def test_gpu_quick_heads_bf16(H, HV):
    _assert_bounds(_public_forward_errors(make_call(520, H, HV, 128, 128, B=2)))


@pytest.mark.gpu
@pytest.mark.parametrize("H,HV", QUICK_HEADS)
def test_gpu_quick_heads_varlen_bf16(H, HV):
    _assert_bounds(_public_forward_errors(make_call(sum([0, 1, 300, 64, 517]), H, HV, 128, 128,
                                                    lengths=[0, 1, 300, 64, 517])))


@pytest.mark.gpu
@pytest.mark.parametrize("H,HV", QUICK_HEADS)
def test_gpu_quick_heads_gradients_bf16(H, HV):
    _assert_bounds(_gradient_errors(make_call(520, H, HV, 128, 128, B=2)))


@pytest.mark.gpu
@pytest.mark.parametrize("K", [64, 256])
def test_gpu_options_bf16(K):
    _assert_bounds(_public_forward_errors(make_call(700, 2, 4, K, K, raw=True, gate=True,
                                                    use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                                    state_v_first=True)))


@pytest.mark.gpu
@pytest.mark.parametrize("K", [64, 256])
def test_gpu_options_gradients_bf16(K):
    _assert_bounds(_gradient_errors(make_call(700, 2, 4, K, K, raw=True, gate=True, use_qk_l2norm_in_kernel=True,
                                              use_beta_sigmoid_in_kernel=True, state_v_first=True)))


def _reverse_pass_emulated(q, k, w, gcum, do, du_local, dht, scale, H, HV):
    """backward_state_kernel's arithmetic in PyTorch, rounding where it rounds (16-bit product operands, the
    16-bit dU and dS_end it stores) and accumulating in fp32: (dh, dU, dh0) for dense sequences [B, T]."""
    B, T = q.shape[:2]
    bf = q.dtype
    r16 = lambda x: x.to(bf).float()  # noqa: E731
    n_chunks = -(-T // 64)
    dh = torch.empty(B * n_chunks, HV, q.shape[-1], do.shape[-1], dtype=bf, device=q.device)
    du = du_local.clone()
    dh0 = torch.empty(B, HV, q.shape[-1], do.shape[-1], dtype=torch.float32, device=q.device)
    for b in range(B):
        for h in range(HV):
            hk = h // (HV // H)
            dS = dht[b, h].float().clone()
            for c in reversed(range(n_chunks)):
                rows = slice(c * 64, min(c * 64 + 64, T))
                dh[b * n_chunks + c, h] = dS.to(bf)
                gg = gcum[b, rows, h]
                g_last = gg[-1]
                kt = r16(k[b, rows, hk].float() * torch.exp2(g_last - gg)[:, None])
                dU = kt @ r16(dS) + du[b, rows, h].float()
                du[b, rows, h] = dU.to(du.dtype)
                dd_g = r16(do[b, rows, h].float() * (torch.exp2(gg) * scale)[:, None])
                dS = dS * torch.exp2(g_last) + q[b, rows, hk].float().T @ dd_g - w[b, rows, h].float().T @ r16(dU)
            dh0[b, h] = dS
    return dh, du, dh0


@pytest.mark.parametrize("BV", [32, 64])
def test_reverse_pass_build_matches_its_arithmetic(bf16_interpreter, BV):
    """The reverse pass against a PyTorch replay of its own roundings, to 3e-4 rather than the 1e-2 the
    end-to-end gradients allow: Triton 3.6 builds of this kernel have run wrong on the H200 (an illegal memory
    access; gradients 2-3x further from float64 than the bf16 arithmetic explains; pipelined builds 8e-3 away
    from the unpipelined one), and only a check this tight tells a wrong build from rounding. It checks the
    launch table's build; GDNKIT_TRITON_LAUNCH=reverse=WxS checks a candidate before the table takes it."""
    from gdnkit.backends.triton_generic.backward_state import backward_state
    H, HV, B, T, K, V = 2, 4, 2, 333 if DEVICE == "cuda" else 150, 128, 128
    gen = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = F.normalize(r(B, T, H, K), dim=-1).to(DEVICE, torch.bfloat16)
    k = F.normalize(r(B, T, H, K), dim=-1).to(DEVICE, torch.bfloat16)
    w = (r(B, T, HV, K) * 0.1).to(DEVICE, torch.bfloat16)
    do = r(B, T, HV, V).to(DEVICE, torch.bfloat16)
    du_local = r(B, T, HV, V).to(DEVICE, torch.bfloat16)
    g = -torch.rand(B, T, HV, generator=gen) * 0.2
    gcum = torch.cat([g[:, c:c + 64].cumsum(1) for c in range(0, T, 64)], 1).to(DEVICE) * 1.4426950408889634
    dht = (r(B, HV, K, V) * 0.1).to(DEVICE)
    scale = K ** -0.5
    n_chunks = -(-T // 64)
    dh, du, dh0 = backward_state(q, k, w, gcum, do, du_local.clone(), dht, scale, T, B, None, None, B * n_chunks,
                                 False, True, BV=BV)
    want = _reverse_pass_emulated(q, k, w, gcum, do, du_local, dht, scale, H, HV)
    errs = {n: rel(a.float().cpu(), b.float().cpu()) for n, a, b in zip(("dh", "du", "dh0"), (dh, du, dh0), want)}
    # a GPU's own roundings (fp32 sums in another order, exp2.approx) flip a bf16 rounding of dU or dS_end now
    # and then: ~5e-5 estimated; placing the roundings elsewhere (an earlier kernel form) moves these by 4e-4 to 1e-3
    assert all(e <= 3e-4 for e in errs.values()), errs
