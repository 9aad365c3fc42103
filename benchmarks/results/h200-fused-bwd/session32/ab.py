"""Session 32 A/B on the H200: the training forward on the one-wave wide route ("wide", the working tree: run 1
with the backward's S0/X recompute at 128 columns, run 2 at 64 columns over the same segments) against the previous training route (_segment_chunks'
segments, 32/64-column recompute: "main", by patching forward._segments), interleaved in one process.
Per quick point and form: CUDA-graph time of the training forward and of forward+backward (median of 3 rounds
x 30 replays each); then one profiled eager backward per form at each point, kernel names and device us."""
import json, os, statistics
import torch
import torch.nn.functional as F
import gdnkit
from gdnkit.backends.tilelang_sm90 import forward as fwd
from gdnkit.benchmarks.inputs import _gates

real_segments = fwd._segments


def main_segments(layout, HV, device, train):
    return (fwd._segment_chunks(layout, HV, device), 0) if train else real_segments(layout, HV, device, train)


FORMS = {"wide": real_segments, "main": main_segments}
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


res = {}
for H, HV, T, gates in POINTS:
    x, do = inputs(H, HV, T, gates)
    key = f"{H}/{HV} 1x{T}" + (" model gates" if gates == "model" else "")
    fwd_only = lambda: gdnkit.chunk_gated_delta_rule(**x, backend="tilelang_sm90")[0]
    both = lambda: torch.autograd.grad(gdnkit.chunk_gated_delta_rule(**x, backend="tilelang_sm90")[0],
                                       list(x.values()), do)
    times = {f: {"fwd_train": [], "fwd_bwd": []} for f in FORMS}
    grads = {}
    for rnd in range(3):
        for form, seg in FORMS.items():
            fwd._segments = seg
            if rnd == 0:
                grads[form] = [t.clone() for t in both()]
            times[form]["fwd_train"].append(graph_ms(fwd_only))
            times[form]["fwd_bwd"].append(graph_ms(both))
    row = {}
    for form in FORMS:
        f_ms, fb_ms = (statistics.median(times[form][k]) for k in ("fwd_train", "fwd_bwd"))
        row[form] = dict(fwd_train=f_ms, fwd_bwd=fb_ms, bwd=fb_ms - f_ms, rounds=times[form])
    rel = {n: ((a.float() - b.float()).norm() / b.float().norm()).item()
           for n, a, b in zip(x, grads["wide"], grads["main"])}
    row["grad_rel_wide_vs_main"] = rel
    # per kernel: one profiled eager backward each form
    for form, seg in FORMS.items():
        fwd._segments = seg
        o = gdnkit.chunk_gated_delta_rule(**x, backend="tilelang_sm90")[0]
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.autograd.grad(o, list(x.values()), do)
            torch.cuda.synchronize()
        ker = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                ker[e.name[:60]] = ker.get(e.name[:60], 0) + e.device_time_total
        row[form]["bwd_kernels_us"] = dict(sorted(ker.items(), key=lambda kv: -kv[1])[:8])
    res[key] = row
    print(f"[ab] {key}: " + "  ".join(
        f"{f} fwd_train {row[f]['fwd_train']:.4f} fwd+bwd {row[f]['fwd_bwd']:.4f} bwd {row[f]['bwd']:.4f}"
        for f in FORMS) + f"  bwd ratio wide/main {row['wide']['bwd'] / row['main']['bwd']:.3f}"
        + f"  max grad rel {max(rel.values()):.1e}", flush=True)
    for f in FORMS:
        print(f"[ker] {key} {f}: " + ", ".join(f"{n} {us:.0f}" for n, us in row[f]["bwd_kernels_us"].items()),
              flush=True)
    json.dump(res, open(os.path.join(OUT, "ab.json"), "w"), indent=1)
fwd._segments = real_segments
