"""Session 33 run 4: the gated route's segment states written over the warm-up's states (in place: where nothing
is flagged the launch moves no state) against the copy into a tensor of their own, by forcing
context_parallel.segment_states' in_place off; CUDA graphs, three interleaved rounds, bitwise gradients. Ran from scratch/s33 (run4.sh)."""
import json, os, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ab_common import OUT, geomean, points, print_row, profile_forms, timed_rounds   # noqa: E402
from gdnkit.backends.tilelang_sm90 import context_parallel as cp

real = cp.segment_states


def copying(*a, **kw):
    kw["in_place"] = False
    return real(*a, **kw)


FORMS = {"inplace": real, "copy": copying}
use = lambda form: setattr(cp, "segment_states", FORMS[form])  # noqa: E731
res = {}
for key, x, do in points():
    row, grads = timed_rounds(x, do, FORMS, use)
    row["bitwise_equal"] = {n: bool(torch.equal(a, b)) for n, a, b in zip(x, grads["inplace"], grads["copy"])}
    profile_forms(x, do, FORMS, use, row, calls=2, width=48)
    res[key] = row
    print_row(key, row, FORMS, "bwd inplace/copy", f"  bitwise {all(row['bitwise_equal'].values())}")
    json.dump(res, open(os.path.join(OUT, "ab.json"), "w"), indent=1)
cp.segment_states = real
print(f"[ab] geomean bwd inplace/copy {geomean(res[k]['inplace']['bwd'] / res[k]['copy']['bwd'] for k in res):.4f}",
      flush=True)
