"""Session 34 run 3: why the bench's backward rows sit above the A/B's (16/32 1x32768: 1.850 against ~1.80 ms).
Per quick point, gdnkit's training forward and forward+backward timed two ways (ab_common.graph_ms: 30 replays
back to back, their mean; benchmarks.timing.time_cuda_graph: the bench's, each replay synchronized, the median of
20) on three input forms (ab: ab_common.inputs, no cu_seqlens; bench: make_point_inputs as the bench's, with
cu_seqlens; bench_nocu: the same tensors without cu_seqlens), FlashQLA on the bench's inputs both ways, and the
backward's kernels (eager profile) for ab and bench."""
import json, os, statistics, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ab_common import OUT, inputs, graph_ms   # noqa: E402
import gdnkit
from gdnkit.benchmarks import timing
from gdnkit.benchmarks.grids import Point
from gdnkit.benchmarks.impls import resolve
from gdnkit.benchmarks.inputs import make_point_inputs, requires_grad_

dev = torch.device("cuda")
fqla = resolve("flashqla", dev)[0]


def closures(call, leaves, do):
    fwd = lambda: call()[0]  # noqa: E731
    both = lambda: torch.autograd.grad(call()[0], leaves, do)  # noqa: E731
    return fwd, both


def kernels(both, calls=2):
    per = {}
    for _ in range(calls):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            both(); torch.cuda.synchronize()
        ker = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                ker[e.name[:40]] = ker.get(e.name[:40], 0) + e.device_time_total
        for n, us in ker.items():
            per.setdefault(n, []).append(us)
    return dict(sorted(((n, round(statistics.median(v), 1)) for n, v in per.items()), key=lambda kv: -kv[1]))


res = {}
for H, HV, T in ((4, 8, 8192), (16, 32, 32768), (4, 8, 32768), (16, 32, 8192)):
    key = f"{H}/{HV} 1x{T}"
    x, do = inputs(H, HV, T, "random")
    b = requires_grad_(make_point_inputs(Point("bwd", H, HV, (T,)), dev))
    gd = lambda inp, cu: (lambda: gdnkit.chunk_gated_delta_rule(inp.q, inp.k, inp.v, inp.g, inp.beta, cu_seqlens=cu,  # noqa: E731
                                                               backend="tilelang_sm90"))
    forms = {"ab": closures(lambda: gdnkit.chunk_gated_delta_rule(**x, backend="tilelang_sm90"), list(x.values()), do),
             "bench": closures(gd(b, b.cu_seqlens), b.leaves(), b.do),
             "bench_nocu": closures(gd(b, None), b.leaves(), b.do),
             "flashqla": closures(lambda: fqla.chunk(b), b.leaves(), b.do)}
    row = {}
    for rnd in range(2):
        for name, (fwd, both) in forms.items():
            r = row.setdefault(name, {"graph_ms": [], "bench_method": [], "bench_spread": []})
            gf, gb = graph_ms(fwd), graph_ms(both)
            tf, tb = timing.time_cuda_graph([fwd], dev, 20, verify=False), timing.time_cuda_graph([both], dev, 20, verify=False)
            r["graph_ms"].append(gb - gf)
            r["bench_method"].append(tb.median_ms - tf.median_ms)
            r["bench_spread"].append([round(min(tb.samples_ms), 4), round(max(tb.samples_ms), 4), tf.median_ms, tb.median_ms])
    for name in ("ab", "bench"):
        row[name]["kernels_us"] = kernels(forms[name][1])
    res[key] = row
    print(f"[probe] {key}: " + "  ".join(f"{n} graph {statistics.median(r['graph_ms']):.4f} bench-method "
                                          f"{statistics.median(r['bench_method']):.4f}" for n, r in row.items()), flush=True)
    for name in ("ab", "bench"):
        print(f"[ker] {key} {name}: " + ", ".join(f"{n} {us}" for n, us in list(row[name]["kernels_us"].items())[:12]), flush=True)
    json.dump(res, open(os.path.join(OUT, "probe.json"), "w"), indent=1)
    del x, do, b, forms
    torch.cuda.empty_cache()
