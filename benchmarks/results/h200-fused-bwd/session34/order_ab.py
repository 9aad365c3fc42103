"""Session 34 run 4: the fused path's order of the S0 / X recompute and the gated route (tree scratch/s34r/O, its
backward.ORDER): beside (main: the recompute on a side stream, the route on the current one), serial (recompute,
then route), route_all_first (route, then recompute), route_first (the route's search and warm-up, then the
recompute on the side stream beside the route's exact launches and segment states). Per quick point and form, two
interleaved rounds: the backward by ab_common.graph_ms (30 replays back to back) and by the bench's method
(benchmarks.timing.time_cuda_graph: each replay synchronized, median; 40 samples with their 10th / 90th
percentiles), gradients bitwise against beside's. Writes $OUT/order.json."""
import json, os, statistics, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ab_common import OUT, inputs, graph_ms   # noqa: E402
import gdnkit
from gdnkit.benchmarks import timing
from gdnkit.backends.tilelang_sm90 import backward as bwd

FORMS = ("beside", "serial", "route_all_first", "route_first")
dev = torch.device("cuda")
print("[order] tree", gdnkit.__file__, flush=True)
pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
res = {}
for H, HV, T in ((4, 8, 8192), (4, 8, 32768), (16, 32, 8192), (16, 32, 32768)):
    key = f"{H}/{HV} 1x{T}"
    x, do = inputs(H, HV, T, "random")
    fwd = lambda: gdnkit.chunk_gated_delta_rule(**x, backend="tilelang_sm90")[0]  # noqa: E731
    both = lambda: torch.autograd.grad(fwd(), list(x.values()), do)  # noqa: E731
    row, grads = {f: {"graph": [], "bench": [], "p10": [], "p90": []} for f in FORMS}, {}
    for rnd in range(2):
        for form in FORMS:
            bwd.ORDER = form
            if rnd == 0:
                grads[form] = [t.clone() for t in both()]
            gf, gb = graph_ms(fwd), graph_ms(both)
            tf = timing.time_cuda_graph([fwd], dev, 20, verify=False)
            tb = timing.time_cuda_graph([both], dev, 40, verify=False)
            r = row[form]
            r["graph"].append(gb - gf)
            r["bench"].append(tb.median_ms - tf.median_ms)
            r["p10"].append(pct(tb.samples_ms, 0.1) - tf.median_ms)
            r["p90"].append(pct(tb.samples_ms, 0.9) - tf.median_ms)
    for form in FORMS:
        row[form]["bitwise"] = all(torch.equal(a, b) for a, b in zip(grads["beside"], grads[form]))
    res[key] = row
    print(f"[order] {key}: " + "  ".join(
        f"{f} graph {statistics.median(r['graph']):.4f} bench {statistics.median(r['bench']):.4f} "
        f"(p10 {min(r['p10']):.4f} p90 {max(r['p90']):.4f}){'' if r['bitwise'] else ' NOT BITWISE'}"
        for f, r in row.items()), flush=True)
    json.dump(res, open(os.path.join(OUT, "order.json"), "w"), indent=1)
    del x, do, grads
    torch.cuda.empty_cache()
bwd.ORDER = "beside"
gm = lambda v: statistics.geometric_mean(list(v))  # noqa: E731
for f in FORMS:
    b = gm(statistics.median(res[k][f]["bench"]) / statistics.median(res[k]["beside"]["bench"]) for k in res)
    g = gm(statistics.median(res[k][f]["graph"]) / statistics.median(res[k]["beside"]["graph"]) for k in res)
    ok = all(res[k][f]["bitwise"] for k in res)
    print(f"[order] geomean {f}/beside: bench-method {b:.4f} graph {g:.4f} bitwise {ok}", flush=True)
