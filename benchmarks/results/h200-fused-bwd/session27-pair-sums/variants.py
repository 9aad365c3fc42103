"""python scratch/s27/variants.py FORM [slot]: the fused backward's kernel time (and the backward's device-time
stages) at 4/8 1x8192, 16/32 1x8192 and 16/32 1x32768 with backward_fused_program taken from FORM (a copy of
backward_fused.py under scratch/s27, or 'main' for the tree's); 'slot': main's per-value-head form (group sums).
One JSON line per point. --build: only compile the kernels (on the CPU host, into TILELANG_CACHE_DIR)."""
import importlib.util
import json
import sys

import torch
import torch.nn.functional as F

from gdnkit.backends.tilelang_sm90 import backward as bwd
from gdnkit.backends.tilelang_sm90 import backward_fused as bf

form = sys.argv[1]
if form != "main":
    spec = importlib.util.spec_from_file_location("gdnkit.backends.tilelang_sm90._form", form)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "gdnkit.backends.tilelang_sm90"
    spec.loader.exec_module(mod)
    bf.backward_fused_program = mod.backward_fused_program
if "slot" in sys.argv[2:]:
    bwd.sums_in_kernel = lambda *a: False
bwd.FUSED = True
POINTS = [(4, 8, 8192), (16, 32, 8192), (16, 32, 32768)] if form == "main" else [(16, 32, 8192), (16, 32, 32768)]
if "--build" in sys.argv:
    bwd.backward_fused_kernel(16, 32, "bfloat16", True, False, "slot" not in sys.argv[2:])
    sys.exit(0)

import gdnkit
from gdnkit.benchmarks import timing

for H, HV, T in POINTS:
    gen = torch.Generator(device="cuda").manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    x = dict(q=F.normalize(r(1, T, H, 128), dim=-1).bfloat16(), k=F.normalize(r(1, T, H, 128), dim=-1).bfloat16(),
             v=r(1, T, HV, 128).bfloat16(), g=F.logsigmoid(r(1, T, HV)), beta=torch.sigmoid(r(1, T, HV)))
    leaves = {n: t.requires_grad_() for n, t in x.items()}
    cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
    o = gdnkit.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, backend="tilelang_sm90")[0]
    do = torch.randn_like(o)

    def call():
        o = gdnkit.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, backend="tilelang_sm90")[0]
        torch.autograd.grad(o, list(leaves.values()), do)
    for _ in range(3):
        call()
    st = timing.stage_times([call], "cuda", reps=30)
    fused = sum(v for k, v in st.items() if "backward_fused" in k)
    print(json.dumps({"form": form.split("/")[-1] + ("+slot" if "slot" in sys.argv[2:] else ""), "H": H, "HV": HV,
                      "T": T, "fused_ms": round(fused, 4), "device_ms": round(sum(st.values()), 4),
                      "stages": {k[:40]: round(v, 4) for k, v in st.items()}}), flush=True)
