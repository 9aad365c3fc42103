"""Decode kernel time of the fused recurrent Triton kernel, by CUDA graph replay, as state bandwidth.

    python -m gdnkit.benchmarks.decode_bench           # the decode grid, fp32/bf16 pools, FLA alongside, T=4 verify
    python -m gdnkit.benchmarks.decode_bench --sweep   # also every (BV, num_warps) per shape, fp32 pool

Each timed graph holds several back-to-back calls that rotate over disjoint slot sets of one pool (at
least 256 MiB of pool in all), so small batches read from HBM, not from the 60 MB L2 a single repeated
call would sit in. Kernel time = median over >= 20 replays / calls per graph. TB/s counts state bytes
only (read + written, in the pool's dtype), against the H200's measured 4.24 TB/s copy ceiling.
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch
import torch.nn.functional as F

from gdnkit.backends.triton_generic.fused_recurrent import fused_recurrent_forward, launch_config
from gdnkit.problem import RECURRENT_MODE, validate_inputs

SHAPES = [(1, 16, 64), (64, 16, 64), (256, 2, 8), (256, 16, 32)]  # (B, H, HV)
K = V = 128
COPY_CEILING = 4.24e12
FOOTPRINT = 512 << 20


def inputs(B, T, H, HV, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    return dict(q=rnd(B, T, H, K).bfloat16(), k=rnd(B, T, H, K).bfloat16(), v=rnd(B, T, HV, V).bfloat16(),
                g=rnd(B, T, HV), beta=rnd(B, T, HV), use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                A_log=rnd(HV) * 0.5, dt_bias=rnd(HV), use_beta_sigmoid_in_kernel=True)


def graph_time(calls, reps=30) -> float:
    """Median seconds of one call: `calls` is a list of thunks captured back to back in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(calls))
    return statistics.median(times)


def serving_calls(B, H, HV, T, pool_dtype, per_token, **launch):
    """Thunks of T-token calls over rotating slot sets; returns (thunks, state bytes moved per call)."""
    writes = T if per_token else 1
    state = HV * K * V * torch.tensor([], dtype=pool_dtype).element_size()
    per_call = B * state * (1 + writes)
    sets = max(1, min(64, math.ceil(FOOTPRINT / per_call)))
    slots_per_set = B * writes
    pool = torch.randn(sets * slots_per_set, HV, K, V, device="cuda").mul_(0.1).to(pool_dtype)
    call = inputs(B, T, H, HV)
    thunks = []
    for s in range(sets):
        idx = torch.arange(s * slots_per_set, (s + 1) * slots_per_set, device="cuda", dtype=torch.int32)
        idx = idx.view(B, T) if per_token else idx
        problem, inp = validate_inputs(RECURRENT_MODE, **call, initial_state=pool, ssm_state_indices=idx)
        thunks.append(lambda p=problem, i=inp: fused_recurrent_forward(p, i, **launch))
    return thunks * max(1, math.ceil(8 / sets)), per_call


def fla_calls(B, H, HV):
    """FLA 0.6.0's fused_recurrent, dense initial state in, new fp32 final state out (if importable)."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla
    except Exception as e:  # noqa: BLE001
        return None, f"fla not importable ({type(e).__name__})"
    per_call = B * HV * K * V * 4 * 2
    sets = max(1, min(64, math.ceil(FOOTPRINT / per_call)))
    call = inputs(B, 1, H, HV)
    call.pop("use_gate_in_kernel"), call.pop("A_log"), call.pop("dt_bias"), call.pop("use_beta_sigmoid_in_kernel")
    call["g"] = F.logsigmoid(call["g"])
    call["beta"] = call["beta"].sigmoid()
    states = [torch.randn(B, HV, K, V, device="cuda") * 0.1 for _ in range(sets)]
    thunks = [lambda h=h: fla(**call, initial_state=h, output_final_state=True) for h in states]
    return thunks * max(1, math.ceil(8 / sets)), per_call


def row(label, seconds, nbytes):
    tbs = nbytes / seconds / 1e12
    print(f"{label:<52} {seconds * 1e6:9.2f} us {tbs:6.2f} TB/s {100 * tbs * 1e12 / COPY_CEILING:5.1f}% of copy")
    return tbs


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time every (BV, num_warps) per shape")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"{torch.cuda.get_device_name()}  K=V={K}, bf16 q/k/v, gate+l2norm+sigmoid fused, T=1 unless said")
    with torch.no_grad():
        for B, H, HV in SHAPES:
            print(f"-- B={B} H={H} HV={HV}  launch {launch_config(K, V, B * HV)} (BV, num_warps)")
            for dtype in (torch.float32, torch.bfloat16):
                thunks, nbytes = serving_calls(B, H, HV, 1, dtype, per_token=False)
                row(f"gdnkit pool {str(dtype)[6:]}", graph_time(thunks), nbytes)
            thunks, nbytes = fla_calls(B, H, HV)
            if thunks is None:
                print(f"FLA: {nbytes}")
            else:
                row("FLA 0.6.0 fused_recurrent fp32 (dense h0 -> new ht)", graph_time(thunks), nbytes)

        B, H, HV = 64, 16, 64
        print(f"-- multi-token verify, B={B} H={H} HV={HV}, fp32 pool")
        one, nb1 = serving_calls(B, H, HV, 1, torch.float32, per_token=False)
        t1 = graph_time(one)
        row("1 token", t1, nb1)
        for per_token in (True, False):
            thunks, nb = serving_calls(B, H, HV, 4, torch.float32, per_token=per_token)
            t4 = graph_time(thunks)
            what = ("T=4, every intermediate state kept ([N, 4] slots)" if per_token
                    else "T=4, final state only ([N] slots)")
            row(what, t4, nb)
            print(f"   4 single steps / one T=4 call = {4 * t1 / t4:.2f}x")

        if args.sweep:
            for B, H, HV in SHAPES:
                print(f"-- sweep B={B} H={H} HV={HV}, fp32 pool")
                best = None
                for bv in (8, 16, 32, 64, 128):
                    for warps in (1, 2, 4, 8):
                        if bv * K // (32 * warps) > 256:  # more than 256 state registers a thread: spills
                            continue
                        thunks, nbytes = serving_calls(B, H, HV, 1, torch.float32, per_token=False,
                                                       block_v=bv, num_warps=warps)
                        tbs = row(f"BV={bv} num_warps={warps}", graph_time(thunks), nbytes)
                        best = max(best or (0,), (tbs, bv, warps))
                print(f"   best: BV={best[1]} num_warps={best[2]} ({best[0]:.2f} TB/s)")


if __name__ == "__main__":
    main()
