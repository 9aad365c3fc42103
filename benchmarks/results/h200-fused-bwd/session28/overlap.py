"""Backward time as the bench takes it ((fwd+bwd) - fwd, CUDA graphs) at the quick grid's backward points, with the
fused path's recompute beside the gated route (the tree) and in series (side stream = current stream), alternated."""
import json
import torch
from gdnkit.backends.tilelang_sm90 import backward as bwd
from gdnkit.benchmarks.grids import get_grid
from gdnkit.benchmarks.impls import resolve
from gdnkit.benchmarks.inputs import make_point_inputs, requires_grad_
from gdnkit.benchmarks import timing

dev = torch.device("cuda")
real_side = bwd._side_stream
(impl,) = resolve("gdnkit:tilelang_sm90", dev)
for p in [p for p in get_grid("quick").points if p.pass_ == "bwd"]:
    sets = [requires_grad_(make_point_inputs(p, dev, i)) for i in range(2)]
    def fwdbwd(inp):
        def fn():
            o = impl.chunk(inp)[0]
            return torch.autograd.grad(o, inp.leaves(), inp.do)
        return fn
    def fwd(inp):
        return lambda: impl.chunk(inp)[0]
    for rnd in range(2):
        for mode in ("beside", "serial"):
            bwd._side_stream = real_side if mode == "beside" else (lambda i: torch.cuda.current_stream())
            with torch.enable_grad():
                a = timing.time_kernel([fwdbwd(s) for s in sets], dev, reps=30, method="graph")
                b = timing.time_kernel([fwd(s) for s in sets], dev, reps=30, method="graph")
            print(json.dumps(dict(point=p.describe(), mode=mode, rnd=rnd, fwdbwd=round(a.median_ms, 4),
                                  fwd=round(b.median_ms, 4), bwd=round(a.median_ms - b.median_ms, 4))), flush=True)
bwd._side_stream = real_side
