"""For the next session (written in session 35, not run): the walks' search with its early exit
(warmup_bound._walks_kernel reads its blocks of 64 chunk sums only until every head has its count). Before it,
the kernel took 4.3 / 12.4 / 13.7 us at 4/8 1x8192, 4/8 1x32768, 16/32 1x32768 (session 34's probe, eager) and
12.3 / 13.8 us at the two 1x32768 points (session 35's spread probe). Here, per point: the kernel's median device
time over 20 eager training forwards (the profiler), and the inference and training forwards' CUDA-graph times
(ab_common.graph_ms). Usage, after `source .device/boot.sh`: python walks_probe.py (writes $OUT/walks_probe.json)."""
import json, os, statistics, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ab_common import OUT, graph_ms, inputs   # noqa: E402
import gdnkit

res = {}
for H, HV, T in ((4, 8, 8192), (4, 8, 32768), (16, 32, 8192), (16, 32, 32768), (16, 64, 32768)):
    x, _ = inputs(H, HV, T, "random")
    train = lambda: gdnkit.chunk_gated_delta_rule(**x, backend="tilelang_sm90")[0]  # noqa: E731
    plain = {n: t.detach() for n, t in x.items()}
    infer = lambda: gdnkit.chunk_gated_delta_rule(**plain, backend="tilelang_sm90")[0]  # noqa: E731
    for fn in (train, infer):
        fn()
    torch.cuda.synchronize()
    walks = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            train()
            torch.cuda.synchronize()
    walks = [e.device_time_total for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("_walks_kernel")]
    key = f"{H}/{HV} 1x{T}"
    res[key] = dict(walks_us=statistics.median(walks) if walks else None, n=len(walks),
                    train_fwd_ms=graph_ms(train), infer_fwd_ms=graph_ms(infer))
    r = res[key]
    print(f"[walks] {key}: _walks_kernel {r['walks_us']} us (n {r['n']}), training forward {r['train_fwd_ms']:.4f} ms, "
          f"inference forward {r['infer_fwd_ms']:.4f} ms", flush=True)
    json.dump(res, open(os.path.join(OUT, "walks_probe.json"), "w"), indent=1)
    del x, plain
    torch.cuda.empty_cache()
