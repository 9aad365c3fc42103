"""Where the token-by-token form overtakes the chunked one: a prefill batch of many equal short sequences.

    python -m gdnkit.benchmarks.short_sequences OUT_DIR [--heads 16x64,32x32] [--tokens 32768]
                                                        [--lengths 4,8,16,32,64,128,256]

Per head configuration and sequence length L (tokens / L sequences of L tokens, bf16, K = V = 128, random fp32
states in and final states out, inference): kernel time (harness timing: CUDA graph, else profiler) of
- `chunked`: the chunked form on the backend auto dispatch takes for long sequences (`backend=` the GPU backend);
- `recurrent`: the token-by-token form (`fused_recurrent_gated_delta_rule` with the same cu_seqlens);
- `auto`: `chunk_gated_delta_rule` as a caller makes it (dispatch.short_sequences picks the form);
- `flashinfer`: its prefill, where the bench's FlashInfer adapter can run.
The crossover (the longest L at which `recurrent` is faster) is what dispatch.SHORT_SEQUENCE should be.

Writes OUT_DIR/short_sequences.json and OUT_DIR/short_sequences.md.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from .grids import parse_heads
from .report import measure_each, write_study


def _inputs(H: int, HV: int, tokens: int, length: int, device: str):
    from .inputs import make_chunk_inputs
    N = tokens // length
    return make_chunk_inputs(H, HV, [length] * N, 128, 128, device, seed=length, initial_state=True)


def measure(H: int, HV: int, tokens: int, length: int, chunked_backend: str) -> dict:
    import gdnkit

    from . import impls, timing
    inp = _inputs(H, HV, tokens, length, "cuda")
    args = (inp.q, inp.k, inp.v, inp.g, inp.beta)
    common = dict(initial_state=inp.initial_state, output_final_state=True, cu_seqlens=inp.cu_seqlens)
    forms = {
        "chunked": lambda: gdnkit.chunk_gated_delta_rule(*args, **common, backend=chunked_backend),
        "recurrent": lambda: gdnkit.fused_recurrent_gated_delta_rule(*args, **common),
        "auto": lambda: gdnkit.chunk_gated_delta_rule(*args, **common),
    }
    fi = impls.FlashInferImpl()
    if fi.unavailable("cuda") is None:
        forms["flashinfer"] = lambda: fi.chunk(inp, output_final_state=True)
    row = dict(heads=f"{H}/{HV}", tokens=tokens, length=length, sequences=tokens // length,
               chunked_backend=chunked_backend,
               auto_form=gdnkit.explain(*args, **common).problem.mode)
    with torch.no_grad():
        for name, fn in forms.items():
            try:
                row[f"{name}_ms"] = timing.time_kernel([fn], "cuda").median_ms
            except Exception as exc:  # noqa: BLE001 - one form failing leaves the others' figures
                row[f"{name}_ms"] = None
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def markdown(rows: list[dict], gpu: str) -> str:
    forms = [f for f in ("chunked", "recurrent", "auto", "flashinfer") if any(f"{f}_ms" in r for r in rows)]
    lines = [f"# Many short sequences: chunked against token-by-token ({gpu})", "",
             "Kernel ms per call, inference, fp32 states in and final states out, bf16, K = V = 128. `auto` is "
             "the call as a user makes it; its form is what dispatch picked.", "",
             "| heads | L | sequences | " + " | ".join(f"{f} ms" for f in forms) + " | auto's form | faster form |",
             "|" + "---|" * (len(forms) + 5)]
    for r in rows:
        ms = {f: r.get(f"{f}_ms") for f in forms}
        pair = {f: ms[f] for f in ("chunked", "recurrent") if ms.get(f) is not None}
        faster = min(pair, key=pair.get) if pair else "—"
        lines.append(f"| {r['heads']} | {r['length']} | {r['sequences']} | "
                     + " | ".join("—" if v is None else f"{v:.4f}" for v in ms.values())
                     + f" | {r['auto_form']} | {faster} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--heads", default="16x64,32x32", help="H x HV pairs, comma-separated")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--lengths", default="4,8,16,32,64,128,256")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("short_sequences needs a CUDA GPU", file=sys.stderr)
        return 2
    import gdnkit
    gpu_backends = [b for b in gdnkit.available_backends() if b != "reference"]
    chunked_backend = "tilelang_sm90" if "tilelang_sm90" in gpu_backends else gpu_backends[0]
    rows = measure_each([(H, HV, args.tokens, int(length), chunked_backend) for H, HV in parse_heads(args.heads)
                         for length in args.lengths.split(",")], measure)
    gpu = torch.cuda.get_device_name()
    write_study(args.out, "short_sequences", rows, markdown(rows, gpu), gpu=gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
