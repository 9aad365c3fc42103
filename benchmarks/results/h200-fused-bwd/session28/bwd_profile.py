"""Backward-only device time per kernel at the quick grid's backward points (session 28).
One training forward per point, then the profiler over reps of torch.autograd.grad(retain_graph=True).
usage: python scratch/s28/bwd_profile.py OUT.json [impls]"""
import json, sys, time
import torch
from gdnkit.benchmarks.grids import get_grid
from gdnkit.benchmarks.impls import resolve
from gdnkit.benchmarks.inputs import make_point_inputs, requires_grad_
from gdnkit.benchmarks import timing

out_path = sys.argv[1]
impls = sys.argv[2] if len(sys.argv) > 2 else "gdnkit:tilelang_sm90"
dev = torch.device("cuda")
grid = get_grid("quick")
pts = [p for p in grid.points if p.pass_ == "bwd"]
res = {}
for impl in resolve(impls, dev):
    for p in pts:
        inp = requires_grad_(make_point_inputs(p, dev))
        with torch.enable_grad():
            o = impl.chunk(inp)[0]
        fn = lambda: torch.autograd.grad(o, inp.leaves(), inp.do, retain_graph=True)
        for _ in range(3):
            fn()
        st = timing.stage_times([fn], dev, reps=20)
        key = f"{impl.name} {p.describe()}"
        res[key] = st
        tot = sum(st.values())
        print(f"[prof] {key}: total {tot:.4f} | " + ", ".join(f"{k} {v:.4f}" for k, v in
              sorted(st.items(), key=lambda kv: -kv[1])), flush=True)
json.dump(res, open(out_path, "w"), indent=1)
