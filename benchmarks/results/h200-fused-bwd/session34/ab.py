"""Session 34 run 1: in one process of a tree (PYTHONPATH's gdnkit: scratch/s34/M = main + the gated route's
exact launches beside the warm-up, scratch/s34/H = that + S0 in halves), the exact launches beside ("beside")
against in series ("serial": the second side stream replaced by the current one), CUDA graphs, three
interleaved rounds, bitwise gradients between the forms, and a digest of each gradient for the trees' comparison.
Usage: python ab.py TAG ROUND (writes $OUT/ab-TAG-ROUND.json)."""
import json, os, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ab_common import OUT, points, print_row, profile_forms, timed_rounds   # noqa: E402
import gdnkit
from gdnkit.backends.tilelang_sm90 import backward as bwd

tag, rnd = sys.argv[1], sys.argv[2]
print(f"[ab] tree {tag} round {rnd}: gdnkit from {gdnkit.__file__}", flush=True)
real = bwd._fork


def serial(dev, which=0):
    return torch.cuda.current_stream(dev) if which == 1 else real(dev, which)


FORMS = {"beside": real, "serial": serial}
use = lambda form: setattr(bwd, "_fork", FORMS[form])  # noqa: E731


def digest(t):
    """Bitwise digest: the sum of the raw words weighted by position (int64, wraps)."""
    w = t.detach().contiguous().view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32).long()
    return [int(w.sum()), int((w * torch.arange(w.numel(), device=w.device) % 1000003).sum())]


res = {}
for key, x, do in points():
    row, grads = timed_rounds(x, do, FORMS, use)
    row["bitwise_equal"] = {n: bool(torch.equal(a, b)) for n, a, b in zip(x, grads["beside"], grads["serial"])}
    row["digest"] = {n: digest(a) for n, a in zip(x, grads["beside"])}
    if rnd == "1":
        profile_forms(x, do, FORMS, use, row, calls=1, width=48)
    else:
        for f in FORMS:
            row[f]["bwd_kernels_us"] = {}
    res[key] = row
    print_row(key, row, FORMS, f"{tag}{rnd} bwd beside/serial", f"  bitwise {all(row['bitwise_equal'].values())}")
    json.dump(res, open(os.path.join(OUT, f"ab-{tag}-{rnd}.json"), "w"), indent=1)
    del x, do, grads
    torch.cuda.empty_cache()
bwd._fork = real
