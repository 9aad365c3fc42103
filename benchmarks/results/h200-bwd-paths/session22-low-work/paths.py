"""Session 22: staged vs fused backward, device time per backward call (profiler sum over N calls of
torch.autograd.grad after one training forward), at the full grid's backward points whose work (chunks x value
heads) is under backward.FUSED_MIN_WORK, plus a few above it. Usage: paths.py OUT.json"""
import json, sys, time
import torch
from torch.profiler import profile, ProfilerActivity
from gdnkit.benchmarks import grids
from gdnkit.benchmarks.grids import Point
from gdnkit.benchmarks.inputs import make_point_inputs, requires_grad_
from gdnkit.benchmarks import impls as I
from gdnkit.backends.tilelang_sm90 import backward as bwd

N = 10
dev = torch.device("cuda")
impl = I.resolve("gdnkit:tilelang_sm90", dev)[0]
mixes = grids.FULL_BWD_MIXES
points = [(4, 8, m) for m in mixes[:4]] + [(8, 16, m) for m in mixes[:4]] + [(2, 4, m) for m in mixes] + \
    [(4, 8, mixes[4]), (16, 32, mixes[0])]
res = {}
for H, HV, mix in points:
    inp = requires_grad_(make_point_inputs(Point("bwd", H, HV, tuple(mix)), dev))
    row = {}
    for name, fused in (("staged", False), ("fused", True)):
        bwd.FUSED = fused
        t0 = time.time()
        for _ in range(2):
            with torch.enable_grad():
                o = impl.chunk(inp)[0]
            torch.autograd.grad(o, inp.leaves(), inp.do)
        with torch.enable_grad():
            o = impl.chunk(inp)[0]
        for _ in range(2):
            torch.autograd.grad(o, inp.leaves(), inp.do, retain_graph=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(N):
                torch.autograd.grad(o, inp.leaves(), inp.do, retain_graph=True)
            torch.cuda.synchronize()
        tot = 0.0
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None)
            if t is None:
                t = ev.cuda_time_total
            if t > 0 and ev.key and not ev.key.startswith("cuda"):
                tot += t / N / 1000.0
        row[name] = tot
        del o
        print(f"  {H}/{HV} {grids.seqlens_label(tuple(mix))} {name}: {tot:.4f} ms ({time.time() - t0:.0f} s)", flush=True)
    row["ratio"] = row["staged"] / row["fused"]
    row["work"] = sum(-(-x // 64) for x in mix) * HV
    res[f"{H}/{HV} {grids.seqlens_label(tuple(mix))}"] = row
    del inp
    torch.cuda.empty_cache()
    json.dump(res, open(sys.argv[1], "w"), indent=1)
bwd.FUSED = None
print("point | work | staged | fused | staged/fused")
for k, r in res.items():
    print(f"{k} | {r['work']} | {r['staged']:.4f} | {r['fused']:.4f} | {r['ratio']:.2f}")
