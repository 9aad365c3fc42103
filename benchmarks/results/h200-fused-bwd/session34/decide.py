"""Which tree the bench takes after run 1's A/B: prints the tree's folder name (Z, M, Hs or H) and why.
Beside is kept where its in-process geomean beside/serial (both trees, both rounds) is under 0.995 with bitwise
gradients; halves where H's backward over M's (the beside form; each tree's two processes' medians) is under 0.995
with every gradient's digest equal."""
import glob, json, os, statistics, sys
out = os.environ["OUT"]
runs = {os.path.basename(p)[3:-5]: json.load(open(p)) for p in glob.glob(os.path.join(out, "ab-*.json"))}
gm = lambda v: statistics.geometric_mean(list(v))
keys = sorted(set.intersection(*(set(r) for r in runs.values()))) if runs else []
if len(runs) < 4 or len(keys) < 4:
    print("Z incomplete A/B:", {k: len(r) for k, r in runs.items()}); sys.exit()
bs = gm(r[k]["beside"]["bwd"] / r[k]["serial"]["bwd"] for r in runs.values() for k in keys)
bit = all(all(r[k]["bitwise_equal"].values()) for r in runs.values() for k in keys)
med = lambda tag, k, f: statistics.median(runs[f"{tag}-{i}"][k][f]["bwd"] for i in (1, 2))
hm = gm(med("H", k, "beside") / med("M", k, "beside") for k in keys)
hm_serial = gm(med("H", k, "serial") / med("M", k, "serial") for k in keys)
same = all(runs[f"H-{i}"][k]["digest"] == runs[f"M-{j}"][k]["digest"] for k in keys for i in (1, 2) for j in (1, 2))
beside, halves = bs < 0.995 and bit, min(hm, hm_serial) < 0.995 and same
tree = {(False, False): "Z", (True, False): "M", (False, True): "Hs", (True, True): "H"}[(beside, halves)]
print(tree, f"beside/serial {bs:.4f} bitwise {bit}; H/M beside {hm:.4f} serial {hm_serial:.4f} digests equal {same}; "
      + " ".join(f"{k}: M {med('M', k, 'beside'):.4f} H {med('H', k, 'beside'):.4f}" for k in keys))
