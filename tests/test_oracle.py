"""Every backend this machine can run, every option and both public functions, against tests/oracle.py: the
README's recurrence token by token in float64, written without gdnkit's code (the default scale, the gate and
beta formulas, GVA's head mapping, varlen and the serving pool included).

On a CPU: the reference backend through the public API, and triton_generic's kernels in the Triton interpreter
through its entry points (dispatch rightly declines CPU tensors; a few small calls, ~5 s each). With a GPU the
same tests run on CUDA through the public API, tilelang_sm90 (K = V = 128, bf16) in the `gpu` ones.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined

import gdnkit  # noqa: E402

import oracle  # noqa: E402  (tests/ is on sys.path: pytest's rootdir-relative import)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GRADS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
# relative L2 error bars by input dtype: float64 is the reference's own arithmetic; float32 the compute dtype of
# every other call (tf32 dots on a GPU); 16-bit inputs round o once more
BARS = {torch.float64: 1e-10, torch.float32: 2e-5 if not CUDA else 2e-3, torch.float16: 5e-3, torch.bfloat16: 1e-2}

OPTIONS = {
    "plain": {},
    "scale": dict(scale=0.37),
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "gate": dict(gate=True),
    "gate-no-dt-bias": dict(gate=True, dt_bias=False),
    "beta-sigmoid": dict(use_beta_sigmoid_in_kernel=True),
    "neg-eigval": dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
    "v-first": dict(state_v_first=True),
    "all": dict(use_qk_l2norm_in_kernel=True, gate=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                state_v_first=True),
}


def rel(x, ref) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def make_call(*, B=1, T=37, H=1, HV=2, K=8, V=4, lengths=None, tail=0, h0=True, gate=False, dt_bias=True, seed=0,
              garbage_tail=True, **options):
    """Fresh random raw inputs (never zeros) in float64 on the CPU: g is log-space (<= 0) unless the in-kernel gate
    takes raw values, beta in (0, 1) unless the sigmoid takes logits, q/k unnormalised under the l2norm option.
    lengths: packed sequences (B = 1), with `tail` tokens past cu_seqlens[-1], holding NaN (their outputs must be
    zeros) unless not garbage_tail (the gradient tests: the options' backward still reads those tokens)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    if lengths is not None:
        B, T = 1, sum(lengths) + tail
    q, k = rnd(B, T, H, K), rnd(B, T, H, K)
    if not options.get("use_qk_l2norm_in_kernel"):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    call = dict(q=q, k=k, v=rnd(B, T, HV, V), output_final_state=True, **options)
    call["g"] = rnd(B, T, HV) if gate else F.logsigmoid(rnd(B, T, HV))
    call["beta"] = rnd(B, T, HV) if options.get("use_beta_sigmoid_in_kernel") else torch.rand(B, T, HV, generator=gen,
                                                                                              dtype=torch.float64)
    N = B if lengths is None else len(lengths)
    if h0:
        call["initial_state"] = rnd(N, HV, *((V, K) if options.get("state_v_first") else (K, V))) * 0.5
    if gate:
        call.update(use_gate_in_kernel=True, A_log=rnd(HV) * 0.5)
        if dt_bias:
            call["dt_bias"] = rnd(HV)
    if lengths is not None:
        call["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for n in ("q", "k", "v", "g", "beta") if tail and garbage_tail else ():  # no sequence reads these: garbage must give zeros
        call[n][:, T - tail:] = float("nan")
    return call


def cast(call, dtype, device=DEVICE):
    """q/k/v in `dtype`, the other floating tensors fp32 (float64 with float64 inputs), all on `device`."""
    other = torch.float64 if dtype == torch.float64 else torch.float32
    out = {}
    for n, t in call.items():
        if isinstance(t, torch.Tensor):
            t = t.to(device=device, dtype=(dtype if n in ("q", "k", "v") else other) if t.is_floating_point()
                     else t.dtype)
        out[n] = t
    return out


def oracle_of(call):
    """The oracle on exactly the values a backend receives (rounded inputs included), in float64 on the CPU."""
    plain = {n: (t.cpu() if isinstance(t, torch.Tensor) else t) for n, t in call.items()}
    return oracle.run(**plain)


def backend_call(backend, fn, call):
    """(o, final state) of `call` on `backend`: the public API, or on a CPU triton_generic's entry points."""
    if backend == "triton_generic" and not CUDA:
        from gdnkit.backends.triton_generic import BACKEND
        from gdnkit.problem import CHUNK_MODE, RECURRENT_MODE, validate_inputs
        mode = CHUNK_MODE if fn is gdnkit.chunk_gated_delta_rule else RECURRENT_MODE
        problem, inputs = validate_inputs(mode, **call)
        forward = BACKEND.chunk_forward if mode == CHUNK_MODE else BACKEND.recurrent_forward
        return forward(problem, inputs)[:2]
    return fn(**call, backend=backend)


def check_forward(backend, fn, call, dtype, bar=None):
    call = cast(call, dtype)
    o_ref, ht_ref, _ = oracle_of(call)
    o, ht = backend_call(backend, fn, call)
    bar = bar or BARS[dtype]
    assert o.dtype == call["v"].dtype and o.shape == call["v"].shape
    errs = {"o": rel(o, o_ref), "ht": rel(ht, ht_ref)}
    assert all(e < bar for e in errs.values()), (errs, bar)


FUNCTIONS = {"chunk": gdnkit.chunk_gated_delta_rule, "recurrent": gdnkit.fused_recurrent_gated_delta_rule}


# --- the reference backend (every machine) ---------------------------------------------------------------------

@pytest.mark.parametrize("fn", FUNCTIONS.values(), ids=FUNCTIONS.keys())
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_reference_matches_the_oracle(fn, options, dtype):
    # GVA (two value heads per key head), packed sequences of lengths 0, 1, 5 and 30, two tokens past the end
    call = make_call(H=2, HV=4, lengths=[5, 0, 1, 30], tail=2, **options)
    check_forward("reference", fn, call, dtype)


@pytest.mark.parametrize("fn", FUNCTIONS.values(), ids=FUNCTIONS.keys())
def test_reference_dense_batch_no_state_16_bit(fn):
    check_forward("reference", fn, make_call(B=3, T=70, h0=False), torch.bfloat16)
    check_forward("reference", fn, make_call(B=2, T=9, h0=False, seed=1), torch.float16)


def test_default_scale_is_k_to_the_minus_half():
    """scale=None means K ** -0.5: a wrong default would differ from the oracle by a constant factor."""
    call = make_call(K=16)
    o_default, _ = gdnkit.chunk_gated_delta_rule(**call)
    o_explicit, _ = gdnkit.chunk_gated_delta_rule(**call, scale=0.25)
    assert torch.allclose(o_default, o_explicit, rtol=1e-12, atol=0)
    assert rel(o_default, oracle_of(call)[0]) < 1e-10


@pytest.mark.parametrize("fn", FUNCTIONS.values(), ids=FUNCTIONS.keys())
def test_reference_gradients_match_the_oracle(fn):
    """Every gradient (options, initial state and GVA included) against autograd through the oracle, float64."""
    call = make_call(H=2, HV=4, lengths=[3, 0, 1, 20], tail=1, use_qk_l2norm_in_kernel=True, gate=True,
                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True, garbage_tail=False)
    assert_gradients_match("reference", fn, call, torch.float64, 1e-9)


def assert_gradients_match(backend, fn, call, dtype, bar, forward_bar=None):
    """Every gradient (and with forward_bar, o and the final state too) against autograd through the oracle."""
    call = cast(call, dtype)
    gen = torch.Generator().manual_seed(7)
    leaves = {n: call[n].detach().clone().requires_grad_() for n in GRADS if call.get(n) is not None}
    o_ref, ht_ref, _ = oracle_of({**call, **leaves})
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad([o_ref, ht_ref], list(leaves.values()), [do, dht])
    mine = {n: t.detach().clone().requires_grad_() for n, t in leaves.items()}
    o, ht = backend_call(backend, fn, {**call, **mine}) if CUDA or backend != "triton_generic" else (None, None)
    if o is None:  # triton_generic on a CPU: the entry points' backward (the autograd glue needs dispatch)
        from gdnkit.backends.triton_generic import BACKEND
        from gdnkit.problem import CHUNK_MODE, validate_inputs
        problem, inputs = validate_inputs(CHUNK_MODE, **{**call, **mine})
        o, ht, saved = BACKEND.chunk_forward(problem, inputs)
        got = BACKEND.chunk_backward(problem, saved, do.to(o.dtype), dht.float())
        got = dict(zip(GRADS, got))
    else:
        got = dict(zip(mine, torch.autograd.grad([o, ht], list(mine.values()),
                                                 [do.to(device=o.device, dtype=o.dtype),
                                                  dht.to(device=ht.device, dtype=ht.dtype)])))
    errs = {n: rel(got[n], w) for n, w in zip(leaves, want)}
    assert all(e < bar for e in errs.values()), (errs, bar)
    if forward_bar is not None:
        errs = {"o": rel(o, o_ref), "ht": rel(ht, ht_ref)}
        assert all(e < forward_bar for e in errs.values()), (errs, forward_bar)


# --- the serving pool ------------------------------------------------------------------------------------------

def serving_call(*, slots=9, idx=(4, -1, 0, 7), lengths=None, T=1, pool_dtype=torch.float32, v_first=False,
                 accepted=None, inplace=None, output_final_state=False, seed=3, K=8, V=4, H=1, HV=2,
                 garbage_padding=True):
    """A decode (T tokens per row) or packed serving call with raw gates, as vLLM passes them. Padding rows
    (read slot -1) get NaN/Inf inputs: their outputs must be exact zeros anyway."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    idx = torch.tensor(idx, dtype=torch.int32)
    N = idx.shape[0]
    B, Tn = (N, T) if lengths is None else (1, sum(lengths))
    call = dict(q=rnd(B, Tn, H, K), k=rnd(B, Tn, H, K), v=rnd(B, Tn, HV, V), g=rnd(B, Tn, HV), beta=rnd(B, Tn, HV),
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=rnd(HV) * 0.5, dt_bias=rnd(HV),
                use_beta_sigmoid_in_kernel=True, state_v_first=v_first, ssm_state_indices=idx,
                output_final_state=output_final_state)
    pool = (rnd(slots, HV, *((V, K) if v_first else (K, V))) * 0.5).to(pool_dtype)
    call["initial_state"] = pool
    if lengths is not None:
        call["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    if accepted is not None:
        call["num_accepted_tokens"] = torch.tensor(accepted, dtype=torch.int32)
    if inplace is not None:
        call["inplace_final_state"] = inplace
    if garbage_padding:
        read = idx if idx.dim() == 1 else idx.gather(1, (call["num_accepted_tokens"].long() - 1 if accepted
                                                         else torch.zeros(N, dtype=torch.long))[:, None])[:, 0]
        bounds = ([(n, 0, T) for n in range(N)] if lengths is None else
                  [(0, int(s), int(e)) for s, e in zip(call["cu_seqlens"][:-1], call["cu_seqlens"][1:])])
        for n in (read < 0).nonzero()[:, 0].tolist():
            b, s, e = bounds[n]
            for name, bad in (("q", float("nan")), ("k", float("inf")), ("v", float("nan")), ("g", float("nan")),
                              ("beta", float("-inf"))):
                call[name][b, s:e] = bad
    return call


SERVING = {
    "decode": dict(),
    "decode-v-first-bf16-pool": dict(v_first=True, pool_dtype=torch.bfloat16),
    "packed": dict(lengths=[2, 0, 3, 1]),
    "verify-2d": dict(idx=[[4, 5, 6], [-1, -1, -1], [0, 1, 2]], T=3, accepted=[2, 1, 3]),
    "not-inplace": dict(inplace=False, output_final_state=True),
}


def serving_backends():
    names = ["reference"]
    if CUDA or _triton_importable():
        names.append("triton_generic")
    return names


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_serving(backend, call, dtype):
    call = cast(call, dtype)
    call["initial_state"] = call["initial_state"].to(call["initial_state"].dtype if dtype != torch.float64
                                                     else torch.float64)
    before = call["initial_state"].clone()
    o_ref, ht_ref, pool_ref = oracle_of({**call, "initial_state": before})
    if backend == "triton_generic" and not CUDA:
        from gdnkit.backends.triton_generic.fused_recurrent import fused_recurrent_forward
        from gdnkit.problem import RECURRENT_MODE, validate_inputs
        problem, inputs = validate_inputs(RECURRENT_MODE, **call)
        o, ht = fused_recurrent_forward(problem, inputs)
    else:
        o, ht = gdnkit.fused_recurrent_gated_delta_rule(**call, backend=backend)
    live = (o_ref != 0).any(-1).any(-1)  # rows/tokens the oracle computes; the rest must be exact zeros
    assert torch.isfinite(o).all()
    assert (o.cpu()[~live] == 0).all()
    assert rel(o, o_ref) < BARS[dtype]
    pool_bar = 1e-2 if call["initial_state"].dtype == torch.bfloat16 else BARS[dtype]
    assert rel(call["initial_state"], pool_ref) < pool_bar
    if ht_ref is not None:
        assert torch.isfinite(ht).all() and rel(ht, ht_ref) < BARS[dtype]


@pytest.mark.parametrize("case", SERVING.values(), ids=SERVING.keys())
def test_reference_serving_matches_the_oracle(case):
    check_serving("reference", serving_call(**case), torch.float32)


# --- triton_generic (the interpreter on a CPU: a few small calls) -----------------------------------------------

triton_only = pytest.mark.skipif(not _triton_importable(), reason="needs triton")


@triton_only
@pytest.mark.parametrize("fn", FUNCTIONS.values(), ids=FUNCTIONS.keys())
@pytest.mark.parametrize("options", [OPTIONS["plain"], OPTIONS["all"]], ids=["plain", "all"])
def test_triton_generic_matches_the_oracle(fn, options):
    call = make_call(H=1, HV=2, K=16, V=16, lengths=[5, 0, 1, 40], tail=2, **options)
    check_forward("triton_generic", fn, call, torch.float32)


@triton_only
def test_triton_generic_gradients_match_the_oracle():
    call = make_call(H=1, HV=2, K=16, V=16, lengths=[3, 1, 20], tail=1, use_qk_l2norm_in_kernel=True, gate=True,
                     use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, garbage_tail=False)
    assert_gradients_match("triton_generic", gdnkit.chunk_gated_delta_rule, call, torch.float32,
                           1e-4 if not CUDA else 5e-3)


@triton_only
@pytest.mark.parametrize("case", [SERVING["packed"], SERVING["verify-2d"]], ids=["packed", "verify-2d"])
def test_triton_generic_serving_matches_the_oracle(case):
    check_serving("triton_generic", serving_call(K=16, V=16, **case), torch.float32)


# --- on a GPU --------------------------------------------------------------------------------------------------

def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(test))


def _gpu_backends(mode):
    if not CUDA:
        return ["triton_generic", "tilelang_sm90"]
    names = [b for b in gdnkit.available_backends() if b != "reference"]
    return [b for b in names if mode == "chunk" or b != "tilelang_sm90"]


@pytest.mark.parametrize("backend", _gpu_backends("chunk"))
@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("fn", FUNCTIONS.values(), ids=FUNCTIONS.keys())
@gpu
def test_gpu_backends_match_the_oracle(backend, options, fn):
    if backend == "tilelang_sm90" and fn is gdnkit.fused_recurrent_gated_delta_rule:
        pytest.skip("tilelang_sm90 has no recurrent form (decode runs on triton_generic)")
    call = make_call(H=2, HV=4, K=128, V=128, lengths=[1, 64, 0, 135, 7], tail=3, **options)
    check_forward(backend, fn, call, torch.bfloat16)
    check_forward(backend, fn, make_call(B=2, T=130, H=1, HV=2, K=128, V=128, seed=4, **options), torch.float16)


@pytest.mark.parametrize("backend", _gpu_backends("chunk"))
@gpu
def test_gpu_gradients_match_the_oracle(backend):
    call = make_call(H=1, HV=2, K=128, V=128, lengths=[1, 70, 0, 20], tail=2, use_qk_l2norm_in_kernel=True,
                     gate=True, use_beta_sigmoid_in_kernel=True, garbage_tail=False)
    assert_gradients_match(backend, gdnkit.chunk_gated_delta_rule, call, torch.bfloat16, 2e-2)


@pytest.mark.parametrize("case", SERVING.values(), ids=SERVING.keys())
@gpu
def test_gpu_triton_serving_matches_the_oracle(case):
    check_serving("triton_generic", serving_call(K=128, V=128, **case), torch.bfloat16)
