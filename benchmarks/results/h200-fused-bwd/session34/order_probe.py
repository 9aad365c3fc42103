"""For the next session (not run yet): does the bench's order cost gdnkit's rows? The bench times each point's
anchors first (FLA, then FlashQLA) and gdnkit last. Session 34's run 3 found the bench process's gdnkit rows 2-6%
above a fresh process's on the same inputs, and FlashQLA's 0-3%. Here, in one process, at each point: gdnkit, FLA,
gdnkit, FlashQLA, gdnkit. Each is timed as the bench times it (runner._closures; timing.time_eager, then
time_cuda_graph of fwd+bwd and of the training forward). nvidia-smi's SM clock, temperature and power are read
after each. If gdnkit's second and third rows sit above its first by more than its rounds' spread, and the clock
or temperature moved with them, the order costs the last implementation. The bench would then have to interleave
implementations, not time them one after another. Usage, after `source .device/boot.sh`: python order_probe.py
(writes $OUT/order_probe.json)."""
import json, os, subprocess
import torch
from gdnkit.benchmarks import timing
from gdnkit.benchmarks.grids import Point
from gdnkit.benchmarks.impls import resolve
from gdnkit.benchmarks.inputs import make_point_inputs, requires_grad_
from gdnkit.benchmarks.runner import _closures

dev = torch.device("cuda")
impls = {i.name: i for i in resolve("gdnkit:tilelang_sm90,flashqla,fla", dev)}
ORDER = ["gdnkit:tilelang_sm90", "fla", "gdnkit:tilelang_sm90", "flashqla", "gdnkit:tilelang_sm90"]


def gpu_state():
    q = "clocks.sm,temperature.gpu,power.draw"
    run = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"], capture_output=True,
                         text=True)
    return run.stdout.strip()


def bench_like(impl, point, inp):
    fns = _closures(impl, point, [inp])
    fns["main"][0]()
    timing.time_eager(fns["main"], dev)
    both = timing.time_cuda_graph(fns["main"], dev, timing.MIN_REPS)
    fwd = timing.time_cuda_graph(fns["fwd_train"], dev, timing.MIN_REPS)
    return dict(bwd=both.median_ms - fwd.median_ms, fwdbwd=both.median_ms, fwd_train=fwd.median_ms,
                spread=both.spread, gpu=gpu_state())


res = {}
for H, HV, T in ((4, 8, 8192), (16, 32, 32768)):
    point = Point("bwd", H, HV, (T,))
    inp = requires_grad_(make_point_inputs(point, dev))
    rows = []
    for name in ORDER:
        rows.append(dict(impl=name, **bench_like(impls[name], point, inp)))
        print(f"[order-probe] {H}/{HV} 1x{T} {name}: bwd {rows[-1]['bwd']:.4f} ms, spread {rows[-1]['spread']:.3f}, "
              f"sm MHz / C / W {rows[-1]['gpu']}", flush=True)
    res[f"{H}/{HV} 1x{T}"] = rows
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "order_probe.json"), "w"), indent=1)
    del inp
    torch.cuda.empty_cache()
