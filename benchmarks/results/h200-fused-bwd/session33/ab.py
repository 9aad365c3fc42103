"""Session 33 A/B on the H200: the fused backward's S0 / X recompute at two programs an SM (state_output_ws.py's
per_sm=2 build; run 1: form A, one hand-over slot and diag(Gamma_C / Gamma) U in V's stage tile; run 2: form B, the
kept one, X made in V's stage tile, two S0 slots, the store role freeing the stage) against one (main's build),
interleaved in one process by forward.RECOMPUTE_PER_SM. Per point and form: CUDA-graph time of the training forward
and of forward+backward (median of 3 rounds x 30 replays); the gradients of the two forms compared bit for bit;
then three profiled eager backwards per form, each kernel's median device time. First three HBM rates (a pure
write, a copy, reads : writes 2 : 3). Ran from scratch/s33 (run*.sh)."""
import json, os, sys
import torch
import triton
import triton.language as tl
from gdnkit.backends.tilelang_sm90 import forward as fwd
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ab_common import OUT, geomean, graph_ms, points, print_row, profile_forms, timed_rounds   # noqa: E402

FORMS = {"two": 2, "one": 1}


@triton.jit
def _mix_kernel(a, b, o0, o1, o2, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(a + offs)
    y = tl.load(b + offs)
    tl.store(o0 + offs, x)
    tl.store(o1 + offs, y)
    tl.store(o2 + offs, x + y)


def bandwidth():
    """HBM rates of three mixes (TB/s, CUDA graphs): a pure write, a copy (1:1), and reads : writes of 2 : 3 (the
    recompute's at 16/32 1x32768: 0.54 GB read, 0.81 GB written)."""
    n = 1 << 27   # 256 MB of bf16 a tensor
    a, b = (torch.randn(n, device="cuda").bfloat16() for _ in range(2))
    o = [torch.empty_like(a) for _ in range(3)]
    w = torch.empty(3 * n, device="cuda", dtype=torch.bfloat16)
    out = {"write": 3 * n * 2 / graph_ms(lambda: w.fill_(1.0), 20) / 1e9,
           "copy": 2 * n * 2 / graph_ms(lambda: o[0].copy_(a), 20) / 1e9,
           "read2_write3": 5 * n * 2 / graph_ms(lambda: _mix_kernel[(n // 4096,)](a, b, *o, BLOCK=4096), 20) / 1e9}
    return out


res = {"bandwidth_TBps": bandwidth()}
print("[bw]", {k: round(v, 2) for k, v in res["bandwidth_TBps"].items()}, flush=True)
use = lambda form: setattr(fwd, "RECOMPUTE_PER_SM", FORMS[form])  # noqa: E731
for key, x, do in points():
    row, grads = timed_rounds(x, do, FORMS, use)
    row["bitwise_equal"] = {n: bool(torch.equal(a, b)) for n, a, b in zip(x, grads["two"], grads["one"])}
    row["grad_rel_two_vs_one"] = {n: ((a.float() - b.float()).norm() / b.float().norm()).item()
                                  for n, a, b in zip(x, grads["two"], grads["one"])}
    profile_forms(x, do, FORMS, use, row, calls=3, width=48)
    res[key] = row
    print_row(key, row, FORMS, "bwd two/one", f"  bitwise {all(row['bitwise_equal'].values())}")
    json.dump(res, open(os.path.join(OUT, "ab.json"), "w"), indent=1)
fwd.RECOMPUTE_PER_SM = 2
print(f"[ab] geomean bwd two/one {geomean(res[k]['two']['bwd'] / res[k]['one']['bwd'] for k in res if k != 'bandwidth_TBps'):.4f}",
      flush=True)
