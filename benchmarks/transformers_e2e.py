"""A Qwen3.5-shaped transformers model on the GPU: gdnkit (integrations.transformers.enable()) against FLA's kernels.

    python -m gdnkit.benchmarks.transformers_e2e OUT_DIR [--heads 16x32,16x64] [--prompt 4096] [--new 64]

Per GDN head configuration (H key heads x HV value heads, K = V = 128, bf16): a random model of a few decoder
layers (three GDN layers, one full-attention layer, Qwen3.5's layout and hidden size) runs once on the path
transformers picks without gdnkit (FLA's kernels, which must be installed) and once under `enable()`:

- accuracy: logits of a prompt and the gradients of every parameter of a next-token loss, gdnkit against FLA
  (relative L2 error, both in bf16, so neither is exact: the float64 checks live in tests/);
- speed: a prefill of `--prompt` tokens (tokens/s) and a greedy generate of `--new` tokens after it (tokens/s of the
  whole generate call, and of its decode part: generate minus prefill).

Writes OUT_DIR/transformers_e2e.json and OUT_DIR/transformers_e2e.md. The conv1d and full-attention layers use
whatever transformers has on the machine, the same in both runs.
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import platform
import time

import torch

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def build(H: int, HV: int, seed: int = 0, hidden: int = 2048, vocab: int = 32000):
    from transformers.models.qwen3_5 import configuration_qwen3_5, modeling_qwen3_5

    config = configuration_qwen3_5.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=H, linear_num_value_heads=HV, linear_key_head_dim=128, linear_value_head_dim=128,
        pad_token_id=0, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    model = modeling_qwen3_5.Qwen3_5ForCausalLM(config).to("cuda", torch.bfloat16)
    return modeling_qwen3_5, model


def fla_is_transformers_choice(module) -> bool:
    """Whether the modeling module's chunked GDN function resolves to FLA (transformers decides once, at import)."""
    import inspect

    fn = module.torch_chunk_gated_delta_rule
    if isinstance(fn, torch.nn.Module):  # the kernels package wraps it in a module; its forward's closure holds it
        fn = next(c.cell_contents for c in type(fn).forward.__closure__ or ()
                  if inspect.isfunction(c.cell_contents) and hasattr(c.cell_contents, "__wrapped__"))
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    impl = cells.get("implementation")
    return impl is not None and (getattr(impl, "__module__", "") or "").startswith("fla")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(H: int, HV: int, prompt: int, new: int, batch: int, repeats: int, train_tokens: int) -> dict:
    from gdnkit.integrations import transformers as gdn_transformers

    module, model = build(H, HV)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), device="cuda", generator=gen)
    train_ids = ids[:1, :train_tokens]
    row = dict(heads=f"{H}x{HV}", K=128, V=128, dtype="bfloat16", batch=batch, prompt=prompt, new_tokens=new,
               fla_is_baseline=fla_is_transformers_choice(module))

    def prefill():
        with torch.no_grad():
            model(input_ids=ids, use_cache=True)

    def generate():
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                  pad_token_id=0)

    results = {}
    for name, scope in (("fla", contextlib.nullcontext), ("gdnkit", gdn_transformers.enabled)):
        with scope():
            gdn_transformers.calls.clear()
            logits, grads = forward_backward(model, train_ids)
            tokens = generate()
            t_prefill, t_generate = timed(prefill, repeats), timed(generate, repeats)
            results[name] = dict(logits=logits, grads=grads, tokens=tokens, calls=dict(gdn_transformers.calls))
            row[f"{name}_prefill_tok_s"] = batch * prompt / t_prefill
            row[f"{name}_generate_tok_s"] = batch * new / t_generate
            row[f"{name}_decode_tok_s"] = batch * max(new - 1, 1) / max(t_generate - t_prefill, 1e-9)
    fla, ours = results["fla"], results["gdnkit"]
    row["gdnkit_calls"] = ours["calls"]
    row["fla_run_gdnkit_calls"] = fla["calls"]
    row["logits_rel_err"] = rel(ours["logits"], fla["logits"])
    errs = {n: rel(ours["grads"][n], g) for n, g in fla["grads"].items()}
    row["grad_rel_err_max"] = max(errs.values())
    row["grad_rel_err_worst"] = max(errs, key=errs.get)
    row["tokens_equal_fraction"] = float((ours["tokens"] == fla["tokens"]).float().mean())
    for what in ("prefill", "generate", "decode"):
        row[f"speedup_{what}"] = row[f"gdnkit_{what}_tok_s"] / row[f"fla_{what}_tok_s"]
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# transformers end to end: gdnkit vs FLA ({meta['device']})", "",
             f"transformers {meta['transformers']}, torch {meta['torch']}, fla {meta['fla']}; Qwen3.5 layout "
             f"{'/'.join(LAYER_TYPES)}, hidden 2048, bf16, K = V = 128.", "",
             "| heads | B x prompt | prefill tok/s FLA | gdnkit | x | generate +N tok/s FLA | gdnkit | x "
             "| decode tok/s FLA | gdnkit | x | logits err | worst grad err | tokens equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['heads']} | {r['batch']}x{r['prompt']} | {r['fla_prefill_tok_s']:.0f} | "
            f"{r['gdnkit_prefill_tok_s']:.0f} | {r['speedup_prefill']:.2f} | {r['fla_generate_tok_s']:.1f} | "
            f"{r['gdnkit_generate_tok_s']:.1f} | {r['speedup_generate']:.2f} | {r['fla_decode_tok_s']:.1f} | "
            f"{r['gdnkit_decode_tok_s']:.1f} | {r['speedup_decode']:.2f} | {r['logits_rel_err']:.1e} | "
            f"{r['grad_rel_err_max']:.1e} ({r['grad_rel_err_worst']}) | {r['tokens_equal_fraction']:.2f} |")
    lines += ["", f"generate: +{rows[0]['new_tokens']} greedy tokens after the prompt, tokens/s of the whole call; "
              "decode: the same minus one prefill. Errors: relative L2, gdnkit against FLA, both bf16."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="folder for transformers_e2e.json and .md")
    parser.add_argument("--heads", default="16x32,16x64", help="HxHV list, comma-separated")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-tokens", type=int, default=2048, help="tokens of the logits/gradients check")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (FLA's kernels are the baseline)")
    import fla
    import transformers

    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, transformers=transformers.__version__,
                fla=getattr(fla, "__version__", "?"), python=platform.python_version())
    from .grids import parse_heads
    from .report import measure_each, write_study
    rows = measure_each([(H, HV, args.prompt, args.new, args.batch, args.repeats, args.train_tokens)
                         for H, HV in parse_heads(args.heads)], measure)
    write_study(args.out, "transformers_e2e", rows, markdown(rows, meta), meta=meta)


if __name__ == "__main__":
    main()
