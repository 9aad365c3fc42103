"""Session 31: branch wip/sums-queue's A/B, gdnkit alone, graph-timed as the bench times the backward
((fwd+bwd) - fwd, the bench's input sets): the sums after the kernel against beside it with the plain and the
overlapped front, interleaved rounds at the quick backward points. Prints the winner as the last line."""
import json, os, statistics, sys
import torch
from benchmarks import timing
from benchmarks.grids import Point
from benchmarks.impls import resolve
from benchmarks.inputs import make_point_inputs, requires_grad_
from benchmarks.runner import _closures, _n_input_sets
from gdnkit.backends.tilelang_sm90 import group_sum

MODES = {"after": (False, "plain"), "plain": (True, "plain"), "overlapped": (True, "overlapped")}
ROUNDS = int(os.environ.get("AB_ROUNDS", "3"))
dev = torch.device("cuda")
impl = resolve("gdnkit:tilelang_sm90", dev)[0]
res = {}
for H, HV, T in ((4, 8, 8192), (4, 8, 32768), (16, 32, 8192), (16, 32, 32768)):
    pt = Point("bwd", H, HV, (T,), K=128, V=128)
    sets, cu = [], None
    for i in range(_n_input_sets(pt, dev)):
        s = make_point_inputs(pt, dev, i, cu_seqlens=cu); cu = s.cu_seqlens; sets.append(requires_grad_(s))
    fns = _closures(impl, pt, sets)
    fwd = timing.time_cuda_graph(fns["fwd_train"], dev, verify=False).median_ms
    rows = {m: [] for m in MODES}
    for r in range(ROUNDS):
        for m in (MODES if r % 2 == 0 else list(MODES)[::-1]):
            group_sum.SUMS_BESIDE, group_sum._FRONT = MODES[m]
            rows[m].append(timing.time_cuda_graph(fns["main"], dev, verify=False).median_ms - fwd)
    key = f"{H}/{HV} 1x{T}"
    res[key] = {m: statistics.median(v) for m, v in rows.items()} | {"fwd_ms": fwd, "all": rows}
    print(f"[ab] {key}: " + "  ".join(f"{m} {statistics.median(v):.4f}" for m, v in rows.items())
          + f"  (fwd {fwd:.4f}; rounds {ROUNDS})", flush=True)
    del fns, sets
    torch.cuda.empty_cache()
geo = {m: statistics.geometric_mean([res[k][m] for k in res]) for m in MODES}
res["geomean_ms"] = geo
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "ab.json"), "w"), indent=1)
print("[ab] geomean ms: " + "  ".join(f"{m} {v:.4f}" for m, v in geo.items()))
print(min(geo, key=geo.get))
