"""What the session A/B scripts here share (session32/ab.py, session33/ab.py): the quick backward points (AB_POINTS
overrides them), their inputs, a CUDA-graph timing, the interleaved rounds of forms, a per-kernel profile of the backward and the rows' printout. Factored out of session 32's script after session 33's runs,
the bodies unchanged; each script puts this folder on sys.path."""
import os
import statistics

import torch
import torch.nn.functional as F

import gdnkit
from gdnkit.benchmarks.inputs import _gates

POINTS = [(4, 8, 8192, "random"), (4, 8, 32768, "random"), (16, 32, 8192, "random"), (16, 32, 32768, "random")]
if os.environ.get("AB_POINTS"):   # e.g. 2x8x32768,16x32x32768m (m: model-like gates, benchmarks/inputs.py's)
    POINTS = [(*map(int, p.rstrip("m").split("x")), "model" if p.endswith("m") else "random")
              for p in os.environ["AB_POINTS"].split(",")]
OUT = os.environ.get("OUT", ".")


def inputs(H, HV, T, gates):
    gen = torch.Generator(device="cuda").manual_seed(T + H)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    x = dict(q=F.normalize(r(1, T, H, 128), dim=-1).bfloat16(), k=F.normalize(r(1, T, H, 128), dim=-1).bfloat16(),
             v=r(1, T, HV, 128).bfloat16(), g=F.logsigmoid(r(1, T, HV)), beta=torch.sigmoid(r(1, T, HV)))
    if gates == "model":
        os.environ["GDNKIT_BENCH_GATES"] = "model"
        x["g"] = _gates((1, T, HV), gen, torch.device("cuda"))
    return {n: t.requires_grad_() for n, t in x.items()}, r(1, T, HV, 128).bfloat16()


def graph_ms(fn, reps=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def timed_rounds(x, do, forms, use, rounds=3):
    """(row, grads): per form, the training forward's and forward+backward's CUDA-graph times (medians over `rounds`
    rounds, the forms interleaved; use(form) switches to a form), and the gradients of its first call."""
    fwd_only = lambda: gdnkit.chunk_gated_delta_rule(**x, backend="tilelang_sm90")[0]
    both = lambda: torch.autograd.grad(gdnkit.chunk_gated_delta_rule(**x, backend="tilelang_sm90")[0],
                                       list(x.values()), do)
    times = {f: {"fwd_train": [], "fwd_bwd": []} for f in forms}
    grads = {}
    for rnd in range(rounds):
        for form in forms:
            use(form)
            if rnd == 0:
                grads[form] = [t.clone() for t in both()]
            times[form]["fwd_train"].append(graph_ms(fwd_only))
            times[form]["fwd_bwd"].append(graph_ms(both))
    row = {}
    for form in forms:
        f_ms, fb_ms = (statistics.median(times[form][k]) for k in ("fwd_train", "fwd_bwd"))
        row[form] = dict(fwd_train=f_ms, fwd_bwd=fb_ms, bwd=fb_ms - f_ms, rounds=times[form])
    return row, grads


def bwd_kernels_us(x, do, calls=1, width=60):
    """The 8 longest kernels of an eager backward (after one training forward a call) by device time in us, the
    median over `calls` profiled calls of each kernel's summed time (names cut to `width` characters)."""
    per = {}
    for _ in range(calls):
        o = gdnkit.chunk_gated_delta_rule(**x, backend="tilelang_sm90")[0]
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.autograd.grad(o, list(x.values()), do)
            torch.cuda.synchronize()
        ker = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                ker[e.name[:width]] = ker.get(e.name[:width], 0) + e.device_time_total
        for n, us in ker.items():
            per.setdefault(n, []).append(us)
    return dict(sorted(((n, statistics.median(v)) for n, v in per.items()), key=lambda kv: -kv[1])[:8])


def print_row(key, row, forms, label, extra=""):
    """One [ab] line (each form's times, then `label` and the first form's backward over the second's, then extra)
    and one [ker] line a form (its bwd_kernels_us)."""
    first, second = list(forms)[:2]
    print(f"[ab] {key}: " + "  ".join(
        f"{f} fwd_train {row[f]['fwd_train']:.4f} fwd+bwd {row[f]['fwd_bwd']:.4f} bwd {row[f]['bwd']:.4f}"
        for f in forms) + f"  {label} {row[first]['bwd'] / row[second]['bwd']:.3f}" + extra, flush=True)
    for f in forms:
        print(f"[ker] {key} {f}: " + ", ".join(f"{n} {us:.0f}" for n, us in row[f]["bwd_kernels_us"].items()),
              flush=True)


def points():
    """(row key, inputs, dO) for each of POINTS."""
    for H, HV, T, gates in POINTS:
        x, do = inputs(H, HV, T, gates)
        yield f"{H}/{HV} 1x{T}" + (" model gates" if gates == "model" else ""), x, do


def profile_forms(x, do, forms, use, row, calls=1, width=60):
    """row[form]["bwd_kernels_us"] for each form (use(form) switches to it)."""
    for form in forms:
        use(form)
        row[form]["bwd_kernels_us"] = bwd_kernels_us(x, do, calls, width)


def geomean(values):
    values = list(values)
    g = 1.0
    for v in values:
        g *= v
    return g ** (1 / len(values))
