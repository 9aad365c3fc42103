"""How long a user waits for the first call at a new head configuration: import, first call, second call.

    python -m gdnkit.benchmarks.first_call OUT_DIR [--heads 16x32] [--tokens 8192] [--workers N ...]
                                           [--stand-in 1,0]

Each measurement runs in a fresh process with empty TileLang and Triton caches (a new machine, or a head
configuration never run there): import gdnkit, make bf16 inputs of one sequence, then an inference call
(torch.no_grad forward) or a training step (forward and backward), then a second one; then it waits for the
kernels the first call started building (kernel_build.wait_for_builds) and makes two more calls, the first of
which loads them. With the stand-in on (default) the first calls run on triton_generic while tilelang_sm90's
kernels build; with GDNKIT_STAND_IN=0 (`--stand-in 0`) the first call waits for them. With
GDNKIT_BUILD_WORKERS=1 the call compiles its kernels one after another (the path before parallel builds).
`kernel_build.counts` says what happened: kernels built by workers (and their compile seconds summed, which is
what one process compiling them in turn would spend), and kernels the call compiled itself (0 when the dry run
found every kernel).

Writes OUT_DIR/first_call.json and OUT_DIR/first_call.md.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
start = time.monotonic()
import torch, torch.nn.functional as F
import gdnkit
imported = time.monotonic()
H, HV, T, training = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "training"
dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(0)
r = lambda *s: torch.randn(*s, device=dev, generator=gen)
inputs = dict(q=r(1, T, H, 128).bfloat16(), k=F.normalize(r(1, T, H, 128), dim=-1).bfloat16(),
              v=r(1, T, HV, 128).bfloat16(), g=F.logsigmoid(r(1, T, HV)), beta=torch.rand(1, T, HV, device=dev))
chosen = gdnkit.explain(**inputs).chosen

def call():
    if training:
        leaves = {n: t.detach().requires_grad_() for n, t in inputs.items()}
        o, _ = gdnkit.chunk_gated_delta_rule(**leaves)
        o.float().sum().backward()
    else:
        with torch.no_grad():
            gdnkit.chunk_gated_delta_rule(**inputs)
    torch.cuda.synchronize()

def timed():
    begun = time.monotonic(); call(); return time.monotonic() - begun

torch.cuda.synchronize()
from gdnkit.backends.tilelang_sm90 import kernel_build
t0 = time.monotonic()
first_s, second_s = timed(), timed()
kernel_build.wait_for_builds()
ready_s = time.monotonic() - t0
after_s, steady_s = timed(), timed()
print(json.dumps(dict(backend=chosen, import_s=imported - start, first_s=first_s, second_ms=1e3 * second_s,
                      ready_s=ready_s, after_build_ms=1e3 * after_s, steady_ms=1e3 * steady_s,
                      **kernel_build.counts)))
"""


def measure(H: int, HV: int, tokens: int, training: bool, workers: int | None, stand_in: bool = True) -> dict:
    """One fresh process, empty caches; returns its figures (and its stderr's progress lines)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TILELANG_CACHE_DIR=f"{cache}/tilelang", TRITON_CACHE_DIR=f"{cache}/triton",
                   GDNKIT_STAND_IN="1" if stand_in else "0")
        env.pop("GDNKIT_BACKEND", None)   # auto dispatch: a named backend never runs on a stand-in
        if workers is not None:
            env["GDNKIT_BUILD_WORKERS"] = str(workers)
        out = subprocess.run([sys.executable, "-c", _CHILD, str(H), str(HV), str(tokens),
                              "training" if training else "inference"], capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"the measurement failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    lines = out.stderr.splitlines()
    stand_ins = [line.split(" run on ")[1].split()[0] for line in lines if line.startswith("gdnkit: until ")]
    row.update(heads=f"{H}/{HV}", tokens=tokens, call="training step" if training else "inference",
               workers=workers or "all cores", stand_in=stand_ins[0] if stand_ins else "none",
               progress=[line for line in lines if line.startswith(("gdnkit: building", "gdnkit: until"))][-2:])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--heads", default="16x32", help="H x HV pairs, comma-separated")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--workers", default="", help="GDNKIT_BUILD_WORKERS values to measure, comma-separated "
                                                      "(default: all cores only; 1: compiling in the call)")
    parser.add_argument("--stand-in", default="1", help="GDNKIT_STAND_IN values to measure, comma-separated "
                                                        "(1: the first calls run on triton_generic; 0: they wait)")
    args = parser.parse_args(argv)
    import torch

    from .grids import parse_heads
    from .report import measure_each, write_study
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    rows = measure_each([(H, HV, args.tokens, training, workers, stand_in == "1")
                         for H, HV in parse_heads(args.heads)
                         for workers in [int(w) for w in args.workers.split(",") if w] or [None]
                         for stand_in in args.stand_in.split(",") for training in (False, True)], measure)
    lines = [f"First call at a new head configuration, empty caches ({gpu}, {os.cpu_count()} CPUs)", "",
             "| heads | tokens | call | build workers | backend | first calls ran on | import s | first call s | "
             "second ms | kernels built s | of it: dry run s | build s | load wait s | next call ms | then ms | "
             "built by workers | their compile s (summed) | compiled in the call |",
             "|" + "---|" * 18]
    lines += [f"| {r['heads']} | {r['tokens']} | {r['call']} | {r['workers']} | {r['backend']} | "
              f"{r['stand_in'] if r['stand_in'] != 'none' else r['backend']} | {r['import_s']:.1f} | "
              f"{r['first_s']:.1f} | {r['second_ms']:.1f} | {r['ready_s']:.1f} | {r.get('dry_run_seconds', 0):.1f} | "
              f"{r.get('build_seconds', 0):.1f} | {r.get('load_wait_seconds', 0):.1f} | {r['after_build_ms']:.1f} | "
              f"{r['steady_ms']:.1f} | {r['built_by_workers']} | {r['worker_seconds']:.0f} | {r['compiled_in_call']} |"
              for r in rows]
    write_study(args.out, "first_call", rows, "\n".join(lines) + "\n", gpu=gpu, cpus=os.cpu_count())
    return 0


if __name__ == "__main__":
    sys.exit(main())
