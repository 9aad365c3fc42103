"""Session 35: where gdnkit's replay-to-replay spread comes from. Session 34 found gdnkit's fwd+bwd replays spread
widely (2.41-2.64 ms at 16/32 1x32768, p10-p90 of the backward 1.76-1.86 ms) in every order of its streams. Here,
in one process, at 16/32 1x32768 and 4/8 1x32768: (1) 60 CUDA-graph replays of fwd+bwd, each synchronized (the
bench's timing), their distribution; (2) 40 eager fwd+bwd calls under the profiler, every kernel's duration per
call: which kernel's duration varies, and by how much. Usage, after `source .device/boot.sh`:
python spread_probe.py (writes $OUT/spread_probe.json)."""
import json, os, statistics
import torch
from torch.profiler import ProfilerActivity, profile
from gdnkit.benchmarks import timing
from gdnkit.benchmarks.grids import Point
from gdnkit.benchmarks.impls import resolve
from gdnkit.benchmarks.inputs import make_point_inputs, requires_grad_
from gdnkit.benchmarks.runner import _closures

dev = torch.device("cuda")
(impl,) = resolve("gdnkit:tilelang_sm90", dev)


def q(xs, f):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(f * len(xs)))]


def summary(xs):
    return dict(n=len(xs), min=min(xs), p10=q(xs, 0.1), median=statistics.median(xs), p90=q(xs, 0.9), max=max(xs))


res = {}
for H, HV, T in ((16, 32, 32768), (4, 8, 32768)):
    point = Point("bwd", H, HV, (T,))
    inp = requires_grad_(make_point_inputs(point, dev))
    fns = _closures(impl, point, [inp])
    main = fns["main"][0]
    for _ in range(3):
        main()
    torch.cuda.synchronize()
    graph = timing._capture([main], 1)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    replays = timing._replay_samples(graph, 60)
    del graph
    per_kernel = {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(40):
            main()
            torch.cuda.synchronize()
    for ev in timing._device_events(prof):
        per_kernel.setdefault(ev.name[:60], []).append(ev.time_range.elapsed_us())
    key = f"{H}/{HV} 1x{T}"
    res[key] = dict(replays_ms=summary(replays), replays_raw=replays,
                    kernels_us={k: summary(v) for k, v in per_kernel.items() if len(v) >= 20})
    r = res[key]["replays_ms"]
    print(f"[spread] {key} fwd+bwd replays ms: min {r['min']:.4f} p10 {r['p10']:.4f} med {r['median']:.4f} "
          f"p90 {r['p90']:.4f} max {r['max']:.4f}", flush=True)
    for k, s in sorted(res[key]["kernels_us"].items(), key=lambda kv: -kv[1]["median"])[:8]:
        print(f"[spread] {key} {k[:36]:36s} us: min {s['min']:.1f} p10 {s['p10']:.1f} med {s['median']:.1f} "
              f"p90 {s['p90']:.1f} max {s['max']:.1f} (n {s['n']})", flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "spread_probe.json"), "w"), indent=1)
    del inp, fns, main
    torch.cuda.empty_cache()
