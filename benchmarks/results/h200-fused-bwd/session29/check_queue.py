"""Branch wip/sums-queue: the fused backward's dq / dk / dv with the sums beside the kernel against the sums after
it (the same bits expected: a stale read of a slot would differ), five calls each way at three quick-grid points,
and the share of the (chunk, key head) pairs the programs beside took from the queue's front."""
import json, os
import torch
import torch.nn.functional as F
import gdnkit
from gdnkit.backends.tilelang_sm90 import group_sum

PART = os.environ.get("CHECK_PART", "all")   # bitwise | rates | all
res = {}
for H, HV, T in (() if PART == "rates" else ((4, 8, 8192), (16, 32, 8192), (16, 32, 32768))):
    gen = torch.Generator(device="cuda").manual_seed(T + H)
    r = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    x = dict(q=F.normalize(r(1, T, H, 128), dim=-1).bfloat16(), k=F.normalize(r(1, T, H, 128), dim=-1).bfloat16(),
             v=r(1, T, HV, 128).bfloat16(), g=F.logsigmoid(r(1, T, HV)) * 0.1, beta=torch.sigmoid(r(1, T, HV)))
    do = r(1, T, HV, 128).bfloat16()
    def grads():
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, _ = gdnkit.chunk_gated_delta_rule(**leaves, backend="tilelang_sm90")
        return torch.autograd.grad(o, [leaves["q"], leaves["k"], leaves["v"]], do)
    shares = []
    real_run = group_sum.GroupSums.run
    def spy(self, dqk, runs):
        out = real_run(self, dqk, runs)
        if self.taken is not None:   # blocks taken by the fronts over all blocks (the back's programs, one each)
            t = self.taken.tolist()
            shares.append(round(sum(v & 0xFFFFFFFF for v in t) / max(sum(v >> 32 for v in t), 1), 3))
        return out
    group_sum.GroupSums.run = spy
    group_sum.SUMS_BESIDE = False
    want = grads()
    group_sum.SUMS_BESIDE = True
    bad = sum(not torch.equal(a, b) for _ in range(5) for a, b in zip(grads(), want))
    group_sum.GroupSums.run = real_run
    res[f"{H}/{HV} 1x{T}"] = dict(mismatches=bad, front_shares=shares)
    print(f"[check] {H}/{HV} 1x{T}: beside vs after, 5 calls: {bad} mismatching tensors; front's share {shares}", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"check_{PART}.json"), "w"))
if PART == "bitwise":
    raise SystemExit

# the front alone, every flag set, at 16/32 1x32768's slots (8192 pairs): its rate in pairs a us by program count
# and block size, with nothing beside it (its ceiling beside the kernel)
from gdnkit import seqlayout
H, HV, T = 16, 32, 32768
cu = torch.tensor([0, T], device="cuda", dtype=torch.int32)
layout = seqlayout.sequence_layout(cu)
n = layout.n_chunks
dqk = torch.randn(n, HV, 2, 64, 128, device="cuda").bfloat16()
ready = torch.ones(n, HV, device="cuda", dtype=torch.int32)
dq, dk = (torch.empty(1, T, H, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
pairs = n * H
rates = {}
for kernel, blocks in (("_sums_front_kernel", (1, 2, 4)), ("_sums_front_overlapped_kernel", (1, 2))):
  for programs in (1, 4, 8):
    for block in blocks:
        taken = torch.zeros(programs, device="cuda", dtype=torch.int64)
        launch = lambda: getattr(group_sum, kernel)[(programs,)](
            dqk, ready, taken, cu, layout.chunk_offsets, dq, dk, 1, pairs, 1 << 16, H=H, G=2, GP=2, C=64, K=128,
            B=block, num_warps=16)
        taken.zero_(); launch(); torch.cuda.synchronize()
        times = []
        for _ in range(5):
            taken.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); launch(); b.record(); torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        ms = sorted(times)[2]
        rates[f"{kernel} {programs}x{block}"] = round(pairs / (ms * 1000), 3)
        print(f"[front] {kernel} {programs} programs, blocks of {block}: {ms:.3f} ms for {pairs} pairs, "
              f"{pairs / (ms * 1000):.2f} pairs/us, {pairs * 96 * 1024 / (ms * 1e-3) / 1e12:.3f} TB/s", flush=True)
res["front_alone_pairs_per_us"] = rates
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), f"check_{PART}.json"), "w"))
