"""Session 32 A/B on the H200: the training forward on the one-wave wide route ("wide", the working tree: run 1
with the backward's S0/X recompute at 128 columns, run 2 at 64 columns over the same segments) against the previous training route (_segment_chunks'
segments, 32/64-column recompute: "main", by patching forward._segments), interleaved in one process.
Per quick point and form: CUDA-graph time of the training forward and of forward+backward (median of 3 rounds
x 30 replays each); then one profiled eager backward per form at each point, kernel names and device us."""
import json, os, sys
from gdnkit.backends.tilelang_sm90 import forward as fwd
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ab_common import OUT, points, print_row, profile_forms, timed_rounds   # noqa: E402

real_segments = fwd._segments


def main_segments(layout, HV, device, train):
    return (fwd._segment_chunks(layout, HV, device), 0) if train else real_segments(layout, HV, device, train)


FORMS = {"wide": real_segments, "main": main_segments}
use = lambda form: setattr(fwd, "_segments", FORMS[form])  # noqa: E731
res = {}
for key, x, do in points():
    row, grads = timed_rounds(x, do, FORMS, use)
    rel = {n: ((a.float() - b.float()).norm() / b.float().norm()).item()
           for n, a, b in zip(x, grads["wide"], grads["main"])}
    row["grad_rel_wide_vs_main"] = rel
    profile_forms(x, do, FORMS, use, row)   # per kernel: one profiled eager backward each form
    res[key] = row
    print_row(key, row, FORMS, "bwd ratio wide/main", f"  max grad rel {max(rel.values()):.1e}")
    json.dump(res, open(os.path.join(OUT, "ab.json"), "w"), indent=1)
fwd._segments = real_segments
