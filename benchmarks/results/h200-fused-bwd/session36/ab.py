"""Session 36: forms of the fused backward kernel, as build options of backward_fused.backward_fused_program, against
each other in one process: CUDA graphs, three interleaved rounds (ab_common), a profile of each form's backward, and
each form's gradients against the last form's (relative L2; a form that moves a load or a cache hint only must be
bitwise equal). Options tried (each a parameter of the kernel's program while it was measured, none kept):
    prefetch_l2   runs 2-4: the next chunk's tiles into L2 (run 2: every line by prefetch.global.L2 at the owner's
                  chunk start; run 3: bulk prefetches by the TMA unit; run 4: K and Tb only, once K has landed)
    early_slot    run 5: p loads g's dq term from its slot before X dU^T, dPD K accumulated onto it
    early_beta    run 5: x loads the next chunk's beta a chunk ahead
    evict_first   run 6: the tiles a program reads once (dO, S0, X, Tb, T) and dV's store with L2's evict-first hint
Usage: python ab.py FORM=OPTION:0|1[,OPTION:0|1] ... (the last form is the base; writes $OUT/ab.json)."""
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ab_common import OUT, geomean, points, print_row, profile_forms, timed_rounds   # noqa: E402
from gdnkit.backends.tilelang_sm90 import backward as bwd

FORMS = {}
for arg in sys.argv[1:]:
    name, options = arg.split("=")
    FORMS[name] = tuple((o.split(":")[0], bool(int(o.split(":")[1]))) for o in options.split(","))
BASE = list(FORMS)[-1]


@functools.lru_cache(maxsize=None)
def _kernel(options, H, HV, dtype, has_dinit, store_dh0):
    return bwd._jit()[3](H, HV, dtype, has_dinit=has_dinit, store_dh0=store_dh0, **dict(options))


use = lambda form: setattr(bwd, "backward_fused_kernel", functools.partial(_kernel, FORMS[form]))  # noqa: E731
rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))  # noqa: E731

res = {}
for key, x, do in points():
    row, grads = timed_rounds(x, do, FORMS, use)
    row["rel_vs_base"] = {f: {n: rel(a, b) for n, a, b in zip(x, grads[f], grads[BASE])} for f in FORMS}
    row["bitwise_vs_base"] = {f: all(torch.equal(a, b) for a, b in zip(grads[f], grads[BASE])) for f in FORMS}
    profile_forms(x, do, FORMS, use, row, calls=3, width=40)
    res[key] = row
    ratios = "  ".join(f"{f}/{BASE} {row[f]['bwd'] / row[BASE]['bwd']:.3f}" for f in FORMS if f != BASE)
    print_row(key, row, FORMS, f"bwd {list(FORMS)[0]}/{list(FORMS)[1]}", f"  {ratios}  bitwise {row['bitwise_vs_base']}")
    json.dump(res, open(os.path.join(OUT, "ab.json"), "w"), indent=1)
    del x, do, grads
    torch.cuda.empty_cache()
for f in FORMS:
    if f != BASE:
        print(f"[ab] geomean bwd {f}/{BASE} {geomean(r[f]['bwd'] / r[BASE]['bwd'] for r in res.values()):.4f}")
