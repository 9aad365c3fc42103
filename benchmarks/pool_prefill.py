"""Prefill on a state pool against the same prefill without one, and against gather + prefill + scatter.

    python -m gdnkit.benchmarks.pool_prefill OUT_DIR [--heads 16x32] [--mixes 4096x8,512x64,128x256]
                                                     [--pool-dtype bfloat16]

Per head configuration and mix (L tokens x N sequences, bf16, K = V = 128, inference), kernel time (harness timing)
of three ways an engine can run a prefill whose sequences continue from states in a pool of 4N slots:
- `plain`: `chunk_gated_delta_rule` with dense initial states and final states out (no pool: the floor);
- `pool`: the same call on the pool (`initial_state=pool, ssm_state_indices=slots`), final states written back
  into the slots in place;
- `gather_scatter`: the slots gathered into a dense batch, `plain`, and the final states scattered back.
Each as auto dispatch runs it (the backend is recorded). The serving bars: `pool` within 3% of `plain` and
faster than `gather_scatter`.

Writes OUT_DIR/pool_prefill.json and OUT_DIR/pool_prefill.md.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from .grids import parse_heads
from .report import measure_each, write_study


def _parse_mix(label: str) -> tuple[int, int]:
    """"4096x8" -> (4096 tokens, 8 sequences)."""
    length, count = (int(x) for x in label.lower().split("x"))
    return length, count


def measure(H: int, HV: int, length: int, count: int, pool_dtype: torch.dtype, device: str = "cuda") -> dict:
    import gdnkit

    from . import timing
    from .inputs import make_chunk_inputs
    inp = make_chunk_inputs(H, HV, [length] * count, 128, 128, device, seed=length * count, initial_state=True)
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta)
    h0 = inp.initial_state                                        # [N, HV, K, V] fp32
    gen = torch.Generator(device=device).manual_seed(count)
    pool = torch.randn(4 * count, *h0.shape[1:], device=device, generator=gen).to(pool_dtype)
    slots = torch.randperm(4 * count, device=device, generator=gen)[:count].to(torch.int32)
    slot_rows = slots.long()   # the gather's and scatter's index (index_copy_ takes int64)
    pool[slot_rows] = h0.to(pool_dtype)
    dense = pool[slot_rows].float()

    def plain():
        return gdnkit.chunk_gated_delta_rule(*args, initial_state=dense, output_final_state=True,
                                             cu_seqlens=inp.cu_seqlens)

    def on_pool():
        return gdnkit.chunk_gated_delta_rule(*args, initial_state=pool, ssm_state_indices=slots,
                                             cu_seqlens=inp.cu_seqlens)

    def gather_scatter():
        o, ht = gdnkit.chunk_gated_delta_rule(*args, initial_state=pool.index_select(0, slot_rows).float(),
                                              output_final_state=True, cu_seqlens=inp.cu_seqlens)
        pool.index_copy_(0, slot_rows, ht.to(pool.dtype))
        return o

    row = dict(heads=f"{H}/{HV}", length=length, sequences=count, pool_dtype=str(pool_dtype).removeprefix("torch."),
               plain_backend=gdnkit.explain(*args, initial_state=dense, output_final_state=True,
                                            cu_seqlens=inp.cu_seqlens).chosen,
               pool_backend=gdnkit.explain(*args, initial_state=pool, ssm_state_indices=slots,
                                           cu_seqlens=inp.cu_seqlens).chosen)
    with torch.no_grad():
        for name, fn in (("plain", plain), ("pool", on_pool), ("gather_scatter", gather_scatter)):
            try:
                row[f"{name}_ms"] = timing.time_kernel([fn], device).median_ms
            except Exception as exc:  # noqa: BLE001 - one way failing leaves the others' figures
                row[f"{name}_ms"] = None
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def markdown(rows: list[dict], gpu: str) -> str:
    lines = [f"# Prefill on a state pool ({gpu})", "",
             "Kernel ms per call, inference, bf16, K = V = 128, each way as auto dispatch runs it. Bars: the pool "
             "within 3% of plain, and faster than gather + plain + scatter.", "",
             "| heads | L x N | pool dtype | plain ms (backend) | pool ms (backend) | gather + scatter ms | "
             "pool / plain | pool / gather + scatter |", "|" + "---|" * 8]
    for r in rows:
        plain, pool, gs = r.get("plain_ms"), r.get("pool_ms"), r.get("gather_scatter_ms")
        ratio = lambda a, b: "—" if a is None or b is None else f"{a / b:.2f}"  # noqa: E731
        fmt = lambda x: "—" if x is None else f"{x:.4f}"  # noqa: E731
        lines.append(f"| {r['heads']} | {r['length']}x{r['sequences']} | {r['pool_dtype']} | "
                     f"{fmt(plain)} ({r['plain_backend']}) | {fmt(pool)} ({r['pool_backend']}) | {fmt(gs)} | "
                     f"{ratio(pool, plain)} | {ratio(pool, gs)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--heads", default="16x32", help="H x HV pairs, comma-separated")
    parser.add_argument("--mixes", default="4096x8,512x64,128x256", help="L x N mixes, comma-separated")
    parser.add_argument("--pool-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pool_prefill needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = measure_each([(H, HV, *_parse_mix(mix), getattr(torch, args.pool_dtype))
                         for H, HV in parse_heads(args.heads) for mix in args.mixes.split(",")], measure)
    gpu = torch.cuda.get_device_name()
    write_study(args.out, "pool_prefill", rows, markdown(rows, gpu), gpu=gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
