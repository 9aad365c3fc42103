"""For the next session (written in session 35, not run): is gdnkit's replay-to-replay spread the GPU's clock?
Session 35's spread probe found the fused kernel at 1203-1310 us over 40 calls at 16/32 1x32768, and 60
back-to-back fwd+bwd replays drifting from ~2.43 to ~2.5-2.7 ms. Here, at that point, 300 synchronized graph
replays of fwd+bwd for gdnkit and then FlashQLA (the control: its replays spread 1.2%), each followed by NVML's SM
clock, power and clock-event reasons, read through ctypes (libnvidia-ml ships with the driver; pynvml may not be
installed). If the slow replays are the low-clock ones, the spread is power management, not the kernel.
Usage, after `source .device/boot.sh`: python clock_probe.py (writes $OUT/clock_probe.json)."""
import ctypes, json, os, statistics
import torch
from gdnkit.benchmarks import timing
from gdnkit.benchmarks.grids import Point
from gdnkit.benchmarks.impls import resolve
from gdnkit.benchmarks.inputs import make_point_inputs, requires_grad_
from gdnkit.benchmarks.runner import _closures

nvml = ctypes.CDLL("libnvidia-ml.so.1")
assert nvml.nvmlInit_v2() == 0
handle = ctypes.c_void_p()
assert nvml.nvmlDeviceGetHandleByIndex_v2(torch.cuda.current_device(), ctypes.byref(handle)) == 0
reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons


def gpu_now():
    clock, power, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
    nvml.nvmlDeviceGetClockInfo(handle, 1, ctypes.byref(clock))        # NVML_CLOCK_SM
    nvml.nvmlDeviceGetPowerUsage(handle, ctypes.byref(power))          # mW
    reasons_fn(handle, ctypes.byref(reasons))
    return clock.value, power.value / 1000, reasons.value


dev = torch.device("cuda")
point = Point("bwd", 16, 32, (32768,))
inp = requires_grad_(make_point_inputs(point, dev))
res = {}
for name in ("gdnkit:tilelang_sm90", "flashqla"):
    (impl,) = resolve(name, dev)
    main = _closures(impl, point, [inp])["main"][0]
    for _ in range(3):
        main()
    torch.cuda.synchronize()
    graph = timing._capture([main], 1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rows = []
    for _ in range(300):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        rows.append((start.elapsed_time(end), *gpu_now()))
    del graph
    ms = [r[0] for r in rows]
    clocks = sorted({r[1] for r in rows})
    by_clock = {c: statistics.median(r[0] for r in rows if r[1] == c) for c in clocks}
    fast = sorted(rows)[:60]
    slow = sorted(rows)[-60:]
    res[name] = dict(rows=rows, by_clock_median_ms=by_clock)
    print(f"[clock] {name}: replay ms min {min(ms):.4f} median {statistics.median(ms):.4f} max {max(ms):.4f}; "
          f"SM MHz seen {clocks}; fastest fifth at {statistics.mean(r[1] for r in fast):.0f} MHz "
          f"{statistics.mean(r[2] for r in fast):.0f} W, slowest fifth at {statistics.mean(r[1] for r in slow):.0f} MHz "
          f"{statistics.mean(r[2] for r in slow):.0f} W; reasons {sorted({hex(r[3]) for r in rows})}", flush=True)
    print(f"[clock] {name}: median ms by SM MHz {by_clock}", flush=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "clock_probe.json"), "w"), indent=1)
