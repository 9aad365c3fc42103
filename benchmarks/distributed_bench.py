"""Context parallelism across GPUs: time of gdnkit.distributed.chunk_gated_delta_rule per rank, against the same
rank's shard run alone (its pieces as independent sequences, no communication, no transition pass).

    torchrun --nproc_per_node=8 -m gdnkit.benchmarks.distributed_bench --heads 16x64 --tokens 1048576
    torchrun --nproc_per_node=8 -m gdnkit.benchmarks.distributed_bench --heads 16x32 --doc 8192 --backward

--doc 0 (default): one sequence of all the tokens (every rank but the first continues it: the worst case, a
transition pass over the whole shard); --doc L: documents of L tokens packed end to end (a rank continues one
document only). Shards are even unless --first-share gives rank 0 a larger part (ranks that continue a sequence
do up to twice the work of rank 0, so rank 0 can take more). bf16 q/k/v, K = V = 128, L2-normalised k,
g = logsigmoid, beta in (0, 1). Times: CUDA events around each call (eager, not graphs: the call reads the shard
layout on the host), median over --iters after --warmup calls; each row is the slowest rank's median.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gdnkit
import gdnkit.distributed

K = V = 128


def shard_bounds(T, world, first_share):
    if first_share is None:
        return [T * r // world for r in range(world + 1)]
    first = int(T * first_share)
    return [0] + [first + (T - first) * r // (world - 1) for r in range(world)]


def offsets_of(T, doc):
    if not doc:
        return [0, T]
    return list(range(0, T, doc)) + [T]


def shard_inputs(T_r, H, HV, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q = rnd(1, T_r, H, K).bfloat16()
    k = F.normalize(rnd(1, T_r, H, K), dim=-1).bfloat16()
    v = rnd(1, T_r, HV, V).bfloat16()
    g = F.logsigmoid(rnd(1, T_r, HV))
    beta = torch.rand(1, T_r, HV, generator=gen, device=device)
    return q, k, v, g, beta


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", default="16x64", help="HxHV")
    parser.add_argument("--tokens", type=int, default=1 << 20, help="packed tokens over all ranks")
    parser.add_argument("--doc", type=int, default=0, help="document length (0: one sequence)")
    parser.add_argument("--first-share", type=float, default=None, help="rank 0's fraction of the tokens")
    parser.add_argument("--backward", action="store_true", help="time forward+backward")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    H, HV = map(int, args.heads.split("x"))

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    T = args.tokens
    bounds = shard_bounds(T, world, args.first_share)
    offsets = offsets_of(T, args.doc)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    lo, hi = bounds[rank], bounds[rank + 1]
    # this rank's pieces as independent sequences: the compute without context parallelism
    local = sorted({0, hi - lo, *(o - lo for o in offsets if lo < o < hi)})
    local_cu = torch.tensor(local, dtype=torch.int32, device=device)
    inputs = shard_inputs(hi - lo, H, HV, device, seed=rank)
    if args.backward:
        inputs = tuple(t.requires_grad_() for t in inputs)

    def run(fn, **kw):
        def step():
            o, _ = fn(*inputs, **kw)
            if args.backward:
                o.backward(torch.ones_like(o))
        return step

    t_cp = timed(run(gdnkit.distributed.chunk_gated_delta_rule, cu_seqlens=cu), args.warmup, args.iters)
    t_alone = timed(run(gdnkit.chunk_gated_delta_rule, cu_seqlens=local_cu), args.warmup, args.iters)
    times = torch.tensor([t_cp, t_alone], device=device)
    every = [torch.empty_like(times) for _ in range(world)]
    dist.all_gather(every, times)
    if rank == 0:
        every = torch.stack(every).cpu()
        gathered_mib = world * HV * K * (K + V) * 4 / 2 ** 20  # upper bound without final states
        print(f"| {H}/{HV} | {T} | {args.doc or 'one'} | {world} | {'fwd+bwd' if args.backward else 'fwd'} | "
              f"{every[:, 0].max():.3f} | {every[:, 1].max():.3f} | {every[:, 0].max() / every[:, 1].max():.2f}x | "
              f"{gathered_mib:.1f} |")
        print("per rank (cp ms, alone ms):", [(round(a, 3), round(b, 3)) for a, b in every.tolist()])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
