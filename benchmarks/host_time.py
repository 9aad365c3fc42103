"""Where an eager call's host time goes: gdnkit beside the anchors, per call kind, and gdnkit's own Python by function.

    python -m gdnkit.benchmarks.host_time OUT_DIR [--heads 4x8,16x32] [--tokens 2048] [--calls fwd,step,decode]
                                                  [--impls all] [--repeats 50]

An eager call (no CUDA graph) costs its host work, then its kernels; where the kernels are short, as at small
shapes and in decode, the host work is the call's time. Per (heads, call kind, implementation):

- enqueue ms: host time of one call with the GPU's queue never waited on (`repeats` calls back to back, then one
  synchronize, which is not counted): what the call costs the CPU;
- wall ms: the same calls' wall time to the end of the GPU's work, per call;
- launches, host syncs and PyTorch operators per call (torch.profiler: the CUDA runtime and driver events of
  kernel launches, device-to-host copies and synchronizations a call waits on; the operators a call ran itself).
For gdnkit, cProfile over `repeats` calls: the functions with the most own time, in microseconds per call, and the
cumulative time of its layers (the public call, validation, dispatch, the backend's forward/backward, launches).

Call kinds: fwd (chunked forward, no grad, one sequence of --tokens), step (forward with grad and backward),
decode (one token for --batch sequences on an fp32 state). Writes OUT_DIR/host_time.json and OUT_DIR/host_time.md.
Runs on a CPU too (the reference backend: the layers above the backend are the same code).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import pathlib
import platform
import pstats
import time

import torch

CALLS = ("fwd", "step", "decode")
# the layers of a gdnkit call: (a fragment of the file's path, the function's name) as cProfile reports them
LAYERS = {
    "public call": ("api.py", "chunk_gated_delta_rule"),
    "public call (decode)": ("api.py", "fused_recurrent_gated_delta_rule"),
    "validation": ("problem.py", "validate_inputs"),
    "dispatch": ("select.py", "select"),
    "autograd forward": ("autograd.py", "run"),
    "backend chunk forward": ("backends", "chunk_forward"),
    "backend chunk backward": ("backends", "chunk_backward"),
    "backend recurrent forward": ("backends", "recurrent_forward"),
    "causal repair": ("recurrence.py", "repair_nonfinite_chunks"),
    "first_call wrapper": ("kernel_build.py", "first_call"),
}
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
               "cuCtxSynchronize", "cuEventSynchronize")
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def call_of(impl, kind: str, H: int, HV: int, tokens: int, batch: int, device: torch.device):
    """A zero-argument function making one call of `kind` through the bench adapter `impl` (inputs made once)."""
    from .inputs import make_chunk_inputs, make_decode_inputs, requires_grad_
    if kind == "decode":
        inp = make_decode_inputs(batch, H, HV, 128, 128, device, seed=3)
        return lambda: impl.decode(inp)
    inp = make_chunk_inputs(H, HV, (tokens,), 128, 128, device, seed=3, with_do=kind == "step")
    if kind == "fwd":
        def fwd():
            with torch.no_grad():
                return impl.chunk(inp)
        return fwd
    requires_grad_(inp)
    leaves = inp.leaves()

    def step():
        o = impl.chunk(inp)[0]
        return torch.autograd.grad(o, leaves, inp.do)
    return step


def _timed(fn, repeats: int, device: torch.device) -> tuple[float, float]:
    """(enqueue ms, wall ms) per call over `repeats` back-to-back calls."""
    _synchronize(device)
    begun = time.perf_counter()
    for _ in range(repeats):
        fn()
    enqueued = time.perf_counter()
    _synchronize(device)
    done = time.perf_counter()
    return (enqueued - begun) / repeats * 1e3, (done - begun) / repeats * 1e3


def _runtime_events(fn, repeats: int, device: torch.device) -> dict:
    """Kernel launches and host syncs per call, from torch.profiler's CPU-side CUDA API events."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile
    _synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        _synchronize(device)
    events = prof.events()
    names = [e.name for e in events]
    count = lambda wanted: sum(n in wanted for n in names) / repeats  # noqa: E731
    d2h = sum(n in ("cudaMemcpy", "cudaMemcpyAsync") for n in names) / repeats
    # PyTorch operators the calls ran themselves (not those inside another operator), by name
    ops = collections.Counter(e.name for e in events if e.name.startswith("aten::") and not (
        e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
    # the final synchronize of the loop is the profiler's, not the calls': one over all of them
    return {"launches": count(LAUNCH_EVENTS), "syncs": max(count(SYNC_EVENTS) - 1 / repeats, 0.0),
            "memcpys": d2h, "torch_ops": sum(ops.values()) / repeats,
            "top_torch_ops": {name: n / repeats for name, n in ops.most_common(12)}}


def _profile(fn, repeats: int, top: int = 25) -> tuple[list[dict], dict]:
    """cProfile over `repeats` calls: the `top` functions by own time, and LAYERS' cumulative times (us a call).
    The autograd engine runs a CUDA backward on its own device thread, where cProfile sees nothing (its whole time
    would show as run_backward's own): here it runs in the calling thread."""
    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        profiler.enable()
        for _ in range(repeats):
            fn()
        profiler.disable()
    stats = pstats.Stats(profiler).stats
    functions = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
        functions.append(dict(function=f"{pathlib.Path(path).name}:{line}({name})", calls=calls / repeats,
                              own_us=own / repeats * 1e6, cumulative_us=cumulative / repeats * 1e6))
    functions.sort(key=lambda f: -f["own_us"])
    layers = {"whole call": sum(own for (_, _, own, _, _) in stats.values()) / repeats * 1e6}
    for label, (fragment, name) in LAYERS.items():
        # a recursive entry (the public decode's fast path calling its general one) counts once: the outermost
        total = max((cum for (path, _, fn_name), (_, _, _, cum, _) in stats.items()
                     if fn_name == name and fragment in path), default=0.0)
        if total:
            layers[label] = total / repeats * 1e6
    return functions[:top], layers


def measure(impl, kind: str, H: int, HV: int, tokens: int, batch: int, repeats: int, device: torch.device) -> dict:
    row = dict(impl=impl.name, call=kind, heads=f"{H}/{HV}", tokens=tokens if kind != "decode" else batch,
               batch=batch if kind == "decode" else 1)
    try:
        fn = call_of(impl, kind, H, HV, tokens, batch, device)
        for _ in range(3):   # compiles, caches, the first call's builds
            fn()
        row["enqueue_ms"], row["wall_ms"] = _timed(fn, repeats, device)
        row.update(_runtime_events(fn, min(repeats, 20), device))
        if impl.name.startswith("gdnkit"):
            row["top_functions"], row["layers_us"] = _profile(fn, repeats)
    except Exception as exc:  # noqa: BLE001 - an anchor without this call kind, or a failure: said in the row
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Host time of eager calls ({meta['device']})", "",
             f"torch {meta['torch']}, python {meta['python']}; {meta['repeats']} calls a row, back to back. enqueue: host "
             "time a call (the GPU never waited on); wall: to the end of its GPU work; launches and syncs a call "
             "from torch.profiler.", "",
             "| heads | call | tokens / batch | impl | enqueue ms | wall ms | launches | syncs | torch ops |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['heads']} | {r['call']} | {r['tokens']} | {r['impl']} | {r['error']} | | | | |")
            continue
        fmt = lambda key: "" if key not in r else (f"{r[key]:.3f}" if key.endswith("ms") else f"{r[key]:.1f}")  # noqa: E731
        lines.append(f"| {r['heads']} | {r['call']} | {r['tokens']} | {r['impl']} | {fmt('enqueue_ms')} | "
                     f"{fmt('wall_ms')} | {fmt('launches')} | {fmt('syncs')} | {fmt('torch_ops')} |")
    for r in rows:
        if "layers_us" not in r:
            continue
        lines += ["", f"## {r['impl']} {r['call']} {r['heads']} ({r['tokens']}): us a call (cProfile)", "",
                  "| layer | cumulative us |", "|---|---|"]
        lines += [f"| {label} | {us:.1f} |" for label, us in r["layers_us"].items()]
        lines += ["", "| function | calls | own us | cumulative us |", "|---|---|---|---|"]
        lines += [f"| {f['function']} | {f['calls']:.1f} | {f['own_us']:.1f} | {f['cumulative_us']:.1f} |"
                  for f in r["top_functions"][:15]]
        if r.get("top_torch_ops"):
            lines += ["", "PyTorch operators a call: " + ", ".join(f"{name} x{n:g}" for name, n in r["top_torch_ops"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="folder for host_time.json and .md")
    parser.add_argument("--heads", default="4x8,16x32", help="HxHV list, comma-separated")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the fwd and step calls (one sequence)")
    parser.add_argument("--batch", type=int, default=64, help="sequences of the decode call")
    parser.add_argument("--calls", default=",".join(CALLS), help=f"comma list of {', '.join(CALLS)}")
    parser.add_argument("--impls", default="all", help="as the bench's --impls")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    kinds = [c.strip() for c in args.calls.split(",") if c.strip()]
    unknown = set(kinds) - set(CALLS)
    if unknown:
        parser.error(f"--calls: unknown {sorted(unknown)}; choose from {', '.join(CALLS)}")
    device = torch.device(args.device)
    from .grids import parse_heads
    from .impls import resolve
    from .report import measure_each, write_study
    impls = [i for i in resolve(args.impls, device) if i.unavailable(device) is None]
    meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                torch=torch.__version__, python=platform.python_version(), repeats=args.repeats)
    cases = [(impl, kind, H, HV, args.tokens, args.batch, args.repeats, device)
             for H, HV in parse_heads(args.heads) for kind in kinds for impl in impls]
    rows = measure_each(cases, measure)
    write_study(args.out, "host_time", rows, markdown(rows, meta), meta=meta)


if __name__ == "__main__":
    main()
