"""Session 35 run 3: the fused path's gated route with its flags' window sums read from the training forward's
per-row bounds ("rows", main: forward.Saved.row_bounds, the wide route's intra kernel writes them) against summing
the window's tokens again ("tokens": warmup_bound._chunk_bounds_kernel, the form before), in one process, CUDA
graphs, three interleaved rounds (ab_common), with a profile of each form's backward and bitwise gradients.
Usage: python ab.py (writes $OUT/ab.json)."""
import json, os, sys
import torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ab_common import OUT, geomean, points, print_row, profile_forms, timed_rounds   # noqa: E402
from gdnkit.backends.tilelang_sm90 import backward as bwd

real = bwd.warmup.reverse_warmup
FORMS = {"rows": real, "tokens": lambda t, g, k, beta, window, row_sums=None: real(t, g, k, beta, window)}
use = lambda form: setattr(bwd.warmup, "reverse_warmup", FORMS[form])  # noqa: E731

res = {}
for key, x, do in points():
    row, grads = timed_rounds(x, do, FORMS, use)
    row["bitwise_equal"] = {n: bool(torch.equal(a, b)) for n, a, b in zip(x, grads["rows"], grads["tokens"])}
    profile_forms(x, do, FORMS, use, row, calls=3, width=40)
    res[key] = row
    print_row(key, row, FORMS, "bwd rows/tokens", f"  bitwise {all(row['bitwise_equal'].values())}")
    json.dump(res, open(os.path.join(OUT, "ab.json"), "w"), indent=1)
    del x, do, grads
    torch.cuda.empty_cache()
use("rows")
print(f"[ab] geomean bwd rows/tokens {geomean(r['rows']['bwd'] / r['tokens']['bwd'] for r in res.values()):.4f}")
