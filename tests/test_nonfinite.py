"""Non-finite inputs and gate resets (docs/semantics.md, "Non-finite inputs and gate resets"), and the chunked
form's precision under large gates ("Precision of the chunked form").

Every backend that runs here is compared with a float64 token-by-token recurrence written in this file (no
gdnkit code): the reference's chunked and recurrent forms through the public API, triton_generic's chunked
kernels and its token-by-token kernel under the Triton interpreter (fp32). What each must show:
  - g = -inf (also fp16 g past -65504, and use_gate_in_kernel with a raw g of +inf) resets the state: outputs,
    final states and (where finite) gradients as the recurrence gives them;
  - a NaN / Inf in q, k, v, g or beta at token t leaves every output of the sequence before t, every other
    sequence and their final states as the recurrence gives them (the chunked GPU kernels by their causal repair,
    which the poisoned chunk's earlier tokens need: a bad value at a chunk's first, middle and last token).
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined

import gdnkit  # noqa: E402
from gdnkit.problem import CHUNK_MODE, RECURRENT_MODE, validate_inputs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHUNK = 64
NAN, INF = float("nan"), float("inf")


# ---- the oracle --------------------------------------------------------------------------------------------

def recurrence(q, k, v, g, beta, scale, h0, offsets):
    """o [1, T, HV, V] and final states [N, HV, K, V], float64, token by token per packed sequence:
    S = exp(g_t) S; u = beta_t (v_t - S^T k_t); S = S + k_t u^T; o_t = scale S^T q_t (value head j reads q/k head
    j // (HV / H)). Differentiable."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    HV, H = v.shape[2], q.shape[2]
    rep = lambda x: x.repeat_interleave(HV // H, dim=0)  # noqa: E731
    outs, finals = [], []
    for n in range(len(offsets) - 1):
        S = h0[n].double()
        for t in range(offsets[n], offsets[n + 1]):
            kt, qt = rep(k[0, t]), rep(q[0, t])
            S = S * torch.exp(g[0, t])[:, None, None]
            u = beta[0, t][:, None] * (v[0, t] - torch.einsum("hk,hkv->hv", kt, S))
            S = S + kt[:, :, None] * u[:, None, :]
            outs.append(scale * torch.einsum("hk,hkv->hv", qt, S))
        finals.append(S)
    return torch.stack(outs)[None], torch.stack(finals)


def gate_formula(g_raw, A_log, dt_bias):
    """use_gate_in_kernel's log-gate, as FLA defines it: -exp(A_log) * softplus(g + dt_bias)."""
    return -torch.exp(A_log.double()) * F.softplus(g_raw.double() + dt_bias.double())


# ---- the calls ---------------------------------------------------------------------------------------------

def make_inputs(lengths, H=2, HV=4, K=16, V=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(q=F.normalize(rnd(1, T, H, K), dim=-1), k=F.normalize(rnd(1, T, H, K), dim=-1), v=rnd(1, T, HV, V),
                g=F.logsigmoid(rnd(1, T, HV) + 2), beta=torch.sigmoid(rnd(1, T, HV)),
                initial_state=rnd(len(lengths), HV, K, V) * 0.3,
                cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32))


def offsets_of(call):
    return call["cu_seqlens"].tolist()


def run(form, call, grad_out=None):
    """(o, final state, grads or None) of `call` through `form`: reference-chunk, reference-recurrent (the public
    API, float64), triton-chunk, triton-recurrent (the backend's entry points, fp32 inputs, interpreter on CPU).
    grad_out: (do, dht) to also return the gradients w.r.t. every floating input."""
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias") if call.get(n) is not None]
    backend, mode = form.split("-")
    if backend == "triton":
        from gdnkit.backends.triton_generic import BACKEND
        cast = {n: (t.to(DEVICE, torch.float32) if n in ("q", "k", "v", "initial_state") or
                    (n in ("g", "beta", "A_log", "dt_bias") and t.dtype == torch.float64) else t.to(DEVICE))
                if isinstance(t, torch.Tensor) else t for n, t in call.items()}
    else:
        cast = dict(call)
    cast = {n: (t.detach().clone().requires_grad_(grad_out is not None) if n in names else t)
            for n, t in cast.items()}
    if backend == "triton":
        problem, inputs = validate_inputs(CHUNK_MODE if mode == "chunk" else RECURRENT_MODE, **cast,
                                          output_final_state=True)
        if mode == "chunk":
            o, ht, saved = BACKEND.chunk_forward(problem, inputs)
        else:
            o, ht, saved = BACKEND.recurrent_forward(problem, inputs)
        grads = None
        if grad_out is not None:
            do, dht = (x.to(DEVICE, torch.float32) for x in grad_out)
            grads = dict(zip(("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"),
                             BACKEND.chunk_backward(problem, saved, do.to(o.dtype), dht)))
            grads = {n: grads[n] for n in names}
        return o.detach().double().cpu(), ht.detach().double().cpu(), grads
    fn = gdnkit.chunk_gated_delta_rule if mode == "chunk" else gdnkit.fused_recurrent_gated_delta_rule
    o, ht = fn(**cast, output_final_state=True, backend="reference")
    grads = None
    if grad_out is not None:
        grads = dict(zip(names, torch.autograd.grad([o, ht], [cast[n] for n in names], list(grad_out))))
    return o.detach().double(), ht.detach().double(), grads


def oracle(call, grad_out=None):
    """The recurrence on `call` (options applied here), with its autograd gradients when grad_out is given."""
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias") if call.get(n) is not None]
    leaves = {n: call[n].detach().double().requires_grad_(grad_out is not None) for n in names}
    g = leaves["g"]
    if call.get("use_gate_in_kernel"):
        g = gate_formula(g, leaves["A_log"], leaves["dt_bias"])
    K = call["q"].shape[-1]
    o, ht = recurrence(leaves["q"], leaves["k"], leaves["v"], g, leaves["beta"], call.get("scale") or K ** -0.5,
                       leaves["initial_state"], offsets_of(call))
    grads = None
    if grad_out is not None:
        grads = dict(zip(names, torch.autograd.grad([o, ht], list(leaves.values()), list(grad_out),
                                                    allow_unused=True)))
    return o.detach(), ht.detach(), grads


FORMS = ["reference-chunk", "reference-recurrent", "triton-chunk", "triton-recurrent"]
TRAINABLE = ["reference-chunk", "triton-chunk"]


def tolerance(form):
    # float64 throughout, except exp(GATE_FLOOR) ~ 9e-14 of a reset state left in the chunked form; triton: fp32
    return 1e-9 if form.startswith("reference") else 3e-5


def needs_triton(form):
    if form.startswith("triton"):
        pytest.importorskip("triton")


def close(x, ref, tol):
    """Finite, and within tol of ref relative to ref's scale (max abs)."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(x).all(), "non-finite values where the recurrence is finite"
    err = float((x - ref).abs().max())
    scale = max(float(ref.abs().max()), 1e-30)
    assert err <= tol * scale, f"max error {err:.3g} over {tol:.1g} x {scale:.3g}"


def forward_matches_the_recurrence(form, call):
    needs_triton(form)
    o_ref, ht_ref, _ = oracle(call)
    o, ht, _ = run(form, call)
    close(o, o_ref, tolerance(form))
    close(ht, ht_ref, tolerance(form))


def gradients_of(form, call, seed):
    """(the backend's gradients, the recurrence's autograd ones) for random output and final-state gradients."""
    needs_triton(form)
    gen = torch.Generator().manual_seed(seed)
    o_ref, ht_ref, _ = oracle(call)
    grad_out = (torch.randn(o_ref.shape, generator=gen, dtype=torch.float64),
                torch.randn(ht_ref.shape, generator=gen, dtype=torch.float64))
    return run(form, call, grad_out)[2], oracle(call, grad_out)[2]


def gradient_tolerance(form):
    return tolerance(form) * (30 if form.startswith("triton") else 1)


# ---- gate resets ---------------------------------------------------------------------------------------------

RESETS = [(0, 0, 0),      # (sequence, token within it, value head): the first token
          (0, 37, 1),     # mid-chunk
          (0, 64, 2),     # the first token of the second chunk
          (0, 63, 3),     # the last token of the first chunk
          (1, 5, 0), (2, 0, 3)]


def reset_call(lengths=(150, 70, 9), every_token_head=True, seed=1):
    call = make_inputs(list(lengths), seed=seed)
    starts = call["cu_seqlens"].tolist()
    for n, t, h in RESETS:
        call["g"][0, starts[n] + t, h] = -INF
    if every_token_head:  # every token of sequence 1, value head 2
        call["g"][0, starts[1]:starts[2], 2] = -INF
    return call


@pytest.mark.parametrize("form", FORMS)
def test_minus_inf_gates_reset_the_state(form):
    forward_matches_the_recurrence(form, reset_call())


@pytest.mark.parametrize("form", TRAINABLE)
def test_minus_inf_gates_have_the_recurrences_gradients(form):
    call = reset_call(lengths=(130, 9, 3), every_token_head=False, seed=2)
    grads, g_ref = gradients_of(form, call, seed=5)
    assert all(torch.isfinite(g_ref[n]).all() for n in g_ref), "the oracle's gradients are finite here"
    for n in g_ref:
        close(grads[n], g_ref[n], gradient_tolerance(form))
    # below the floor the gate's gradient is zero, as d exp(g) / dg = exp(g) = 0 at -inf
    assert (grads["g"][torch.isinf(call["g"])] == 0).all()


@pytest.mark.parametrize("form", FORMS)
def test_fp16_gates_past_their_range_reset(form):
    """fp16 has no value below -65504: -70000 is stored as -inf, a reset; -65504 and -60000 (finite) are resets too,
    in effect (exp(g) = 0 in float64), and their in-chunk cumulative sums must not overflow either."""
    call = make_inputs([100, 40], seed=3)
    g = call["g"].to(torch.float16)
    g[0, 10, 1] = -70000.0
    g[0, 64, 0] = -60000.0
    g[0, 120, 3] = -65504.0
    g[0, 121, 3] = -65504.0
    assert torch.isinf(g[0, 10, 1]) and not torch.isinf(g[0, 120:122, 3]).any()
    call["g"] = g
    forward_matches_the_recurrence(form, call)


def gate_in_kernel_call(seed=4):
    call = make_inputs([130, 20], seed=seed)
    gen = torch.Generator().manual_seed(seed)
    HV = call["v"].shape[2]
    call.update(use_gate_in_kernel=True, A_log=torch.randn(HV, generator=gen, dtype=torch.float64) * 0.5,
                dt_bias=torch.randn(HV, generator=gen, dtype=torch.float64))
    call["g"] = torch.randn(call["g"].shape, generator=gen, dtype=torch.float64)
    call["g"][0, 3, 0] = INF
    call["g"][0, 64, 2] = INF
    call["g"][0, 140, 1] = INF
    return call


@pytest.mark.parametrize("form", FORMS)
def test_gate_in_kernel_with_raw_plus_inf_resets(form):
    """use_gate_in_kernel: a raw g of +inf gives -exp(A_log) * softplus(+inf) = -inf, a reset."""
    forward_matches_the_recurrence(form, gate_in_kernel_call())


@pytest.mark.parametrize("form", TRAINABLE)
def test_gate_in_kernel_with_raw_plus_inf_gradients(form):
    """Every gradient the recurrence's autograd gives finite is matched; dA_log as docs/semantics.md states."""
    grads, g_ref = gradients_of(form, gate_in_kernel_call(seed=6), seed=7)
    finite = [n for n in g_ref if torch.isfinite(g_ref[n]).all()]
    assert set(finite) >= {"q", "k", "v", "g", "beta", "initial_state", "dt_bias"}
    for n in finite:
        close(grads[n], g_ref[n], gradient_tolerance(form))
    # the recurrence's autograd gives NaN (softplus(+inf) times a zero gradient), as does the reference's; the
    # kernels' hand-written backward keeps a zero gradient zero: the decay there, exp(-inf) = 0, ignores A_log
    assert torch.isnan(g_ref["A_log"]).any()
    if form == "reference-chunk":
        assert torch.isnan(grads["A_log"]).any()
    else:
        assert torch.isfinite(grads["A_log"]).all()


# ---- NaN and Inf stay causal -----------------------------------------------------------------------------------

# (input, sequence, token within it, value): one bad value per sequence; the last sequence stays clean
POISON = [("q", 0, 70, NAN), ("k", 1, 40, NAN), ("v", 2, 64, NAN), ("g", 3, 10, NAN), ("beta", 4, 100, INF),
          ("v", 5, 63, -INF), ("g", 6, 90, INF)]
LENGTHS = [130, 64, 100, 20, 128, 64, 150, 77]


def poisoned_call(seed=8):
    call = make_inputs(LENGTHS, seed=seed)
    starts = call["cu_seqlens"].tolist()
    HV = call["v"].shape[2]
    for j, (name, n, t, value) in enumerate(POISON):
        x = call[name]
        head = j % (x.shape[2])  # a q/k head reads into its group's value heads; v, g, beta: one value head
        if x.dim() == 4:
            x[0, starts[n] + t, head, j % x.shape[3]] = value
        else:
            x[0, starts[n] + t, j % HV] = value
    return call




@pytest.mark.filterwarnings("ignore:invalid value encountered")   # NaN arithmetic in the interpreter's numpy
@pytest.mark.parametrize("form", FORMS)
def test_non_finite_inputs_poison_only_what_follows(form):
    needs_triton(form)
    call = poisoned_call()
    o_ref, ht_ref, _ = oracle(call)
    o, ht, _ = run(form, call)
    starts = call["cu_seqlens"].tolist()
    tol = tolerance(form)
    bad = {n: t for _, n, t, _ in POISON}
    for n in range(len(LENGTHS)):
        s, e = starts[n], starts[n + 1]
        end = s + bad[n] if n in bad else e   # every form: nothing before the bad token is reached
        if end > s:
            close(o[:, s:end], o_ref[:, s:end], tol)
        if n not in bad:
            close(ht[n], ht_ref[n], tol)
        else:
            # the bad value itself does reach its token's output (the recurrence's does)
            assert not torch.isfinite(o[0, s + bad[n]]).all()
    # the clean sequences' outputs in full, and the first bad one's state: q does not enter the state
    assert 0 in bad and POISON[0][0] == "q"
    if form.startswith("reference") or form == "triton-recurrent":
        close(ht[0], ht_ref[0], tol)


def test_reference_chunked_form_poisons_exactly_what_the_recurrence_does():
    """The reference's chunked form, token for token: NaN where the recurrence is not finite, its values elsewhere
    (the chunked GPU kernels may poison more: the rest of the chunk)."""
    call = poisoned_call(seed=9)
    o_ref, ht_ref, _ = oracle(call)
    o, ht, _ = run("reference-chunk", call)
    for x, ref in ((o, o_ref), (ht, ht_ref)):
        fin = torch.isfinite(x)
        # non-finite wherever the recurrence is; more so only in columns the recurrence keeps apart (a bad v
        # element poisons its own state column there, the token's whole row here)
        assert (fin <= torch.isfinite(ref)).all()
        assert fin.any() and (x[fin] - ref[fin]).abs().max() <= 1e-9 * ref[fin].abs().max()


# ---- precision under large gates -------------------------------------------------------------------------------

def fp32_error(form, call):
    o_ref, _, _ = oracle(call)
    if form == "reference-chunk-fp32":
        from gdnkit.backends.reference.chunked import chunked_gdn
        HV, H = call["v"].shape[2], call["q"].shape[2]
        f = lambda x: x.float()  # noqa: E731
        rep = lambda x: f(x).repeat_interleave(HV // H, dim=2)  # noqa: E731
        o, _, _ = chunked_gdn(rep(call["q"]), rep(call["k"]), f(call["v"]), f(call["g"]), f(call["beta"]),
                              call["q"].shape[-1] ** -0.5, f(call["initial_state"]))
    elif form == "reference-recurrent-fp32":
        from gdnkit.backends.reference.recurrent import recurrent_gdn
        HV, H = call["v"].shape[2], call["q"].shape[2]
        f = lambda x: x.float()  # noqa: E731
        rep = lambda x: f(x).repeat_interleave(HV // H, dim=2)  # noqa: E731
        o, _ = recurrent_gdn(rep(call["q"]), rep(call["k"]), f(call["v"]), f(call["g"]), f(call["beta"]),
                             call["q"].shape[-1] ** -0.5, f(call["initial_state"]))
    else:
        o, _, _ = run(form, call)
    o = o.double().cpu()
    return float((o - o_ref).norm() / o_ref.norm())


def spike_call(spikes, seed=10):
    """One sequence of 128 tokens, ordinary gates, and the given (token, head, g) spikes."""
    call = make_inputs([128], seed=seed)
    for t, h, value in spikes:
        call["g"][0, t, h] = value
    return call


@pytest.mark.parametrize("form", ["reference-chunk-fp32", "triton-chunk"])
def test_a_large_gate_spike_costs_the_chunked_form_no_precision(form):
    """g = -1e4 at one token mid-chunk: unfloored, the chunk's cumulative gate carried ~1e4 * eps_fp32 of rounding
    into every decay after it (1.7e-4 against float64); floored at -30, the error stays at the recurrent form's
    level."""
    if form == "triton-chunk":
        needs_triton(form)
    base = fp32_error("reference-recurrent-fp32", spike_call([]))
    call = spike_call([(20, h, -1e4) for h in range(4)])
    recurrent = fp32_error("reference-recurrent-fp32", call)
    err = fp32_error(form, call)
    assert err < 1e-5, f"{form}: {err:.3g} (the recurrent form in fp32: {recurrent:.3g}, no spike {base:.3g})"


def test_gate_mass_bound_of_the_fp32_chunked_form():
    """The worst case the floor leaves: gates at the floor at every other token of a chunk, the others small,
    so the in-chunk cumulative gate reaches ~32 x 30 while pairs of tokens close together still weigh ~1. The
    documented bound: relative error within ~C * |GATE_FLOOR| * eps_fp32 (C = 64); measured well below it."""
    from gdnkit.prep import GATE_FLOOR
    call = spike_call([(t, h, -1e4) for t in range(1, 128, 2) for h in range(4)], seed=11)
    err = fp32_error("reference-chunk-fp32", call)
    bound = CHUNK * abs(GATE_FLOOR) * torch.finfo(torch.float32).eps
    assert err < bound, f"{err:.3g} over the documented bound {bound:.3g}"


# ---- GPU (the lead runs these on the device) -------------------------------------------------------------------

def _gpu_call(lengths, H, HV, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return dict(q=F.normalize(rnd(1, T, H, 128), dim=-1).to(dtype), k=F.normalize(rnd(1, T, H, 128), dim=-1).to(dtype),
                v=rnd(1, T, HV, 128).to(dtype), g=F.logsigmoid(rnd(1, T, HV) + 2), beta=torch.sigmoid(rnd(1, T, HV)),
                cu_seqlens=cu)


@pytest.mark.parametrize("options", [{}, {"use_qk_l2norm_in_kernel": True, "use_gate_in_kernel": True}])
def test_causal_repair_leaves_finite_calls_bitwise_alone(options):
    """With finite inputs the causal repair only reads: triton_generic's chunked forward gives the bits of its
    kernels without the repair (outputs and final states), with or without the options it re-applies when it
    does walk a sequence."""
    pytest.importorskip("triton")
    from gdnkit.backends.triton_generic import BACKEND, chunked
    call = make_inputs(LENGTHS, seed=12)
    if options.get("use_gate_in_kernel"):
        gen = torch.Generator().manual_seed(13)
        call.update(A_log=torch.randn(4, generator=gen, dtype=torch.float64) * 0.5,
                    dt_bias=torch.randn(4, generator=gen, dtype=torch.float64))
    call = {n: (t.to(DEVICE, torch.float32) if t.is_floating_point() else t.to(DEVICE)) for n, t in call.items()}
    problem, inputs = validate_inputs(CHUNK_MODE, **call, **options, output_final_state=True)
    o_kernels, ht_kernels, _ = chunked.forward(problem, inputs)
    o, ht, _ = BACKEND.chunk_forward(problem, inputs)
    assert torch.equal(o, o_kernels) and torch.equal(ht, ht_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["tilelang_sm90", "triton_generic"])
def test_gpu_resets_and_causal_nan(backend):
    """Long and short sequences (context parallelism on the long one where the backend takes it), bf16: -inf gates
    reset (outputs as the float64 reference's, to bf16 accuracy), and a NaN v mid-sequence leaves every chunk
    before its own and every other sequence (outputs and final states) as the reference has them."""
    if backend == "tilelang_sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("tilelang_sm90 needs Hopper")
    lengths = [8192, 300, 64, 1000]
    call = _gpu_call(lengths, 4, 8, torch.bfloat16)
    starts = call["cu_seqlens"].tolist()
    call["g"][0, starts[0] + 100: starts[0] + 110, 3] = -INF
    call["g"][0, starts[1] + 64, 0] = -INF
    call["g"][0, starts[2]:starts[3], 5] = -INF
    bad = starts[0] + 5000  # sequence 0, chunk 78
    call["v"][0, bad, 2, 7] = NAN
    o, ht = gdnkit.chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)
    ref = {n: (t.double() if t.is_floating_point() else t) for n, t in call.items()}
    o_ref, ht_ref = gdnkit.chunk_gated_delta_rule(**ref, output_final_state=True, backend="reference")
    clean = torch.ones(o.shape[1], dtype=torch.bool, device="cuda")
    clean[bad: starts[1]] = False   # the tokens of bad's chunk before it too (the causal repair)
    assert torch.isfinite(o[:, clean]).all()
    err = (o[:, clean].double() - o_ref[:, clean]).norm() / o_ref[:, clean].norm()
    assert err < 1e-2, f"{backend}: {float(err):.3g}"
    assert not torch.isfinite(o[0, bad]).all()   # the bad value reaches its own token's output
    # (sequence 0's final state may come out finite: under context parallelism a later segment's state may be
    # led in from after the bad chunk, which the rule allows)
    assert torch.isfinite(ht[1:]).all()
    assert (ht[1:].double() - ht_ref[1:]).norm() / ht_ref[1:].norm() < 1e-2


def test_the_repair_compiles_without_launching_in_a_dry_run(monkeypatch):
    """A first call's dry run builds the repair's kernel without running it (Triton's warmup): the same grid and
    arguments as the launch after the call, so the launch finds that build; off a GPU nothing is asked at all."""
    pytest.importorskip("triton")
    from gdnkit.backends.triton_shared import recurrence

    class Kernel:
        def __init__(self):
            self.launched, self.warmed = [], []

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))

        def warmup(self, *args, grid, **kwargs):
            self.warmed.append((grid, args, kwargs))

    kernel = Kernel()
    monkeypatch.setattr(recurrence, "recurrent_kernel", kernel)
    call = make_inputs([5, 70], H=1, HV=2, K=16, V=16)
    problem, inputs = validate_inputs(CHUNK_MODE, call["q"], call["k"], call["v"], call["g"], call["beta"],
                                      cu_seqlens=call["cu_seqlens"])
    o = torch.zeros_like(call["v"])
    recurrence.repair_nonfinite_chunks(problem, inputs, o, compile_only=True)
    assert kernel.warmed == kernel.launched == []        # CPU tensors: nothing compiles here
    monkeypatch.setattr(recurrence, "_compiles_here", lambda o: True)
    recurrence.repair_nonfinite_chunks(problem, inputs, o, compile_only=True)
    assert len(kernel.warmed) == 1 and kernel.launched == []
    recurrence.repair_nonfinite_chunks(problem, inputs, o)
    assert len(kernel.launched) == 1
    (wgrid, wargs, wkw), (lgrid, largs, lkw) = kernel.warmed[0], kernel.launched[0]
    assert wgrid == lgrid and wkw == lkw and len(wargs) == len(largs)
    assert all(a is b for a, b in zip(wargs, largs)) and wkw["REPAIR"] is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_floor_gate_backward_zeroes_below_the_floor_and_at_nan(dtype):
    """The gate floor's backward passes dg where g >= GATE_FLOOR, gives 0 below it and at a NaN g (dg NaN there
    too), in dg's dtype; its shared zero stays zero after a call whose result is written in place."""
    from gdnkit.prep import GATE_FLOOR, floor_gate_backward
    g = torch.tensor([0.0, -1.0, GATE_FLOOR, GATE_FLOOR - 1e-3, -float("inf"), float("nan"), -1e4], dtype=dtype)
    dg = torch.tensor([1.5, -2.0, 3.0, 4.0, 5.0, float("nan"), float("nan")], dtype=dtype)
    out = floor_gate_backward(g, dg)
    assert out.dtype == dtype
    assert out.tolist() == [1.5, -2.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    out.fill_(7.0)
    assert floor_gate_backward(g, dg).tolist() == [1.5, -2.0, 3.0, 0.0, 0.0, 0.0, 0.0]
