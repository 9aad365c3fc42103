"""gdnkit inside transformers: tiny random Qwen3.5 and Qwen3-Next models (several GDN layers, grouped value heads,
float32) give the same logits, parameter gradients and greedy generations with `enable()` as with transformers'
own PyTorch functions, and every GDN call of theirs goes to gdnkit.

The reference is transformers' PyTorch fallback itself (the function under its kernel decorators), bound into the
modeling module for the reference run: on CPU that is what transformers runs without gdnkit.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gdnkit  # noqa: E402
from gdnkit.integrations import transformers as gdn_transformers  # noqa: E402

CHUNK, RECURRENT = "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"
LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
GDN_LAYERS = LAYER_TYPES.count("linear_attention")
VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=len(LAYER_TYPES),
             layer_types=LAYER_TYPES, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, pad_token_id=0, eos_token_id=None, bos_token_id=None,
             tie_word_embeddings=False)


def _qwen3_5():
    from transformers.models.qwen3_5 import configuration_qwen3_5, modeling_qwen3_5
    config = configuration_qwen3_5.Qwen3_5TextConfig(**SMALL)
    return modeling_qwen3_5, modeling_qwen3_5.Qwen3_5ForCausalLM(config)


def _qwen3_next():
    from transformers.models.qwen3_next import configuration_qwen3_next, modeling_qwen3_next
    config = configuration_qwen3_next.Qwen3NextConfig(**SMALL, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return modeling_qwen3_next, modeling_qwen3_next.Qwen3NextForCausalLM(config)


MODELS = {"qwen3_5": _qwen3_5, "qwen3_next": _qwen3_next}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    torch.manual_seed(1)
    module, m = MODELS[request.param]()
    m = m.float().eval()
    with torch.no_grad():  # a random init far from zero, so every GDN term matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return module, m


def _fallback(obj):
    """transformers' PyTorch function under its decorators: a functools wrapper, inside a kernels Func module
    where the kernels package is installed (which keeps the wrapper in its forward's closure)."""
    if isinstance(obj, torch.nn.Module):
        cells = [c.cell_contents for c in type(obj).forward.__closure__ or ()]
        obj = next(c for c in cells if inspect.isfunction(c) and hasattr(c, "__wrapped__"))
    fn = inspect.unwrap(obj)
    assert fn.__name__.startswith("torch_"), fn
    return fn


@contextlib.contextmanager
def torch_fallback(module):
    """The reference run: transformers' own PyTorch GDN functions bound in the modeling module."""
    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    saved = {n: getattr(module, n) for n in names}
    originals = dict(saved)
    for (mod, attr), fn in gdn_transformers._originals.items():
        if mod == module.__name__:
            originals[attr] = fn
    try:
        for n in names:
            setattr(module, n, _fallback(originals[n]))
        yield
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


def _close(got, want, rtol=1e-5):
    err = (got - want).norm() / want.norm().clamp_min(1e-30)
    assert err <= rtol, f"relative error {float(err):.2e} > {rtol}"


def _ids(B, T, seed):
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_modules_found_cover_the_qwen_models():
    found = gdn_transformers.gdn_modules()
    for name in ("qwen3_5.modeling_qwen3_5", "qwen3_5_moe.modeling_qwen3_5_moe", "qwen3_next.modeling_qwen3_next"):
        assert f"transformers.models.{name}" in found, found


def test_logits_and_parameter_gradients(model):
    module, m = model
    ids = _ids(2, 24, seed=2)

    def run():
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    with torch_fallback(module):
        want_logits, want_grads = run()
    gdn_transformers.calls.clear()
    with gdn_transformers.enabled():
        got_logits, got_grads = run()
    assert gdn_transformers.calls == {CHUNK: GDN_LAYERS}
    _close(got_logits, want_logits)
    assert set(got_grads) == set(want_grads)
    names = sorted(want_grads)
    want_all = torch.cat([want_grads[n].flatten() for n in names])
    _close(torch.cat([got_grads[n].flatten() for n in names]), want_all)
    # Each parameter's error on the gradient's scale: a parameter with a tiny gradient (A_log, dt_bias) carries the
    # float32 rounding of both sides (each is ~1e-3 of its own size from a float64 run of the same model).
    for name in names:
        assert want_grads[name].abs().max() > 0, name
        err = (got_grads[name] - want_grads[name]).norm() / want_all.norm()
        assert err <= 1e-5, f"{name}: error {float(err):.2e} of the gradient's norm"
    assert not gdn_transformers.is_enabled()


@pytest.mark.parametrize("left_padding", [False, True])
def test_greedy_generate_uses_the_recurrent_path(model, left_padding):
    module, m = model
    ids = _ids(2, 8, seed=3)
    mask = torch.ones_like(ids)
    if left_padding:
        ids[0, :3], mask[0, :3] = 0, 0
    new = 4
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
              pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    with torch_fallback(module), torch.no_grad():
        want = m.generate(**kw)
    gdn_transformers.calls.clear()
    with gdn_transformers.enabled(), torch.no_grad():
        got = m.generate(**kw)
    # The prompt is one chunked call per GDN layer, every later token one recurrent call per layer.
    assert gdn_transformers.calls == {CHUNK: GDN_LAYERS, RECURRENT: GDN_LAYERS * (new - 1)}
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        _close(a, b)


def _per_sequence(fallback):
    """A packed call as transformers' PyTorch function computes it one sequence at a time (it refuses packing)."""
    def call(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **kw):
        if cu_seqlens is None:
            return fallback(q, k, v, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state, **kw)
        outs, states = [], []
        for n, (s, e) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            h0 = None if initial_state is None else initial_state[n:n + 1]
            o, ht = fallback(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e], initial_state=h0,
                             output_final_state=output_final_state, **kw)
            outs.append(o)
            states.append(ht)
        return torch.cat(outs, 1), (torch.cat(states) if output_final_state else None)
    return call


def test_packed_sequences_go_through_gdnkit(model):
    """cu_seq_lens_q reaches the GDN layers as cu_seqlens: gdnkit keeps the sequences apart (the PyTorch
    fallback cannot, so the reference runs it per sequence)."""
    module, m = model
    lengths = [13, 1, 20]
    ids = _ids(1, sum(lengths), seed=4)
    cu = torch.tensor([0, 13, 14, 34], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    kw = dict(input_ids=ids, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=20,
              max_length_k=20)
    chunk_name = "torch_chunk_gated_delta_rule"
    original = gdn_transformers._originals.get((module.__name__, chunk_name), getattr(module, chunk_name))
    with torch.no_grad():
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch_fallback(module))
            setattr(module, chunk_name, _per_sequence(_fallback(original)))
            want = m(**kw).logits
        gdn_transformers.calls.clear()
        with gdn_transformers.enabled():
            got = m(**kw).logits
    assert gdn_transformers.calls == {CHUNK: GDN_LAYERS}
    _close(got, want)


def test_disable_restores_and_enable_is_idempotent():
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    before = module.torch_chunk_gated_delta_rule
    gdn_transformers.enable()
    gdn_transformers.enable()
    assert module.torch_chunk_gated_delta_rule is gdn_transformers.chunk_gated_delta_rule
    gdn_transformers.disable()
    assert module.torch_chunk_gated_delta_rule is before
    with gdn_transformers.enabled():
        with gdn_transformers.enabled():
            pass
        assert gdn_transformers.is_enabled()  # an inner block leaves the outer one's state
    assert module.torch_chunk_gated_delta_rule is before


def test_plain_swap_of_the_functions(model):
    """A user who binds gdnkit's public functions in place of transformers' changes nothing else: the extra
    keywords transformers passes (use_cache, position_ids, ...) are taken as FLA takes them."""
    module, m = model
    ids = _ids(2, 9, seed=5)
    with torch_fallback(module), torch.no_grad():
        want = m(input_ids=ids, use_cache=False).logits
    saved = (module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule)
    try:
        module.torch_chunk_gated_delta_rule = gdnkit.chunk_gated_delta_rule
        module.torch_recurrent_gated_delta_rule = gdnkit.fused_recurrent_gated_delta_rule
        with torch.no_grad():
            got = m(input_ids=ids, use_cache=False, output_attentions=False).logits
            steps = m.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    finally:
        module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule = saved
    _close(got, want)
    assert steps.shape == (2, 12)



def test_compiled_model_has_no_graph_break():
    """With enable(), a whole Qwen3.5 forward compiles as one graph: each GDN call is one gdnkit op in it."""
    module, m = _qwen3_5()
    m = m.float().eval()
    ids = _ids(2, 16, seed=6)
    with gdn_transformers.enabled(), torch.no_grad():
        want = m(input_ids=ids, use_cache=False).logits
        got = torch.compile(lambda x: m(input_ids=x, use_cache=False).logits, backend="eager", fullgraph=True)(ids)
    _close(got, want, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 32), (16, 64)])
def test_qwen3_5_shaped_stack_matches_fla_on_gpu(heads):
    """Real head configurations (K = V = 128, bf16) under enable(): logits and every parameter's gradient against the
    same model on FLA's kernels (transformers' own choice there), and greedy tokens; the speed side is
    benchmarks/transformers_e2e.py."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla")
    from gdnkit.benchmarks.transformers_e2e import measure

    row = measure(*heads, prompt=512, new=8, batch=2, repeats=1, train_tokens=512)
    assert row["fla_is_baseline"], "transformers does not pick FLA's kernels here: nothing to compare against"
    assert row["fla_run_gdnkit_calls"] == {}
    assert row["gdnkit_calls"]["chunk_gated_delta_rule"] >= 3 and row["gdnkit_calls"][RECURRENT] >= 3
    assert row["logits_rel_err"] < 2e-2, row
    assert row["grad_rel_err_max"] < 5e-2, row
