"""Session 36: build the fused kernel's two forms (prefetch_l2 True / False) for the quick grid's head configs on the
CPU host, by the same call backward.backward_fused_kernel makes (the same cache key), so a device run loads them.
Usage: TILELANG_CACHE_DIR=... python build_forms.py HxHV[,HxHV] [dinit 0|1]"""
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from gdnkit.backends.tilelang_sm90 import backward as bwd

heads = [tuple(map(int, h.split("x"))) for h in sys.argv[1].split(",")]
dinit = bool(int(sys.argv[2])) if len(sys.argv) > 2 else True


def build(job):
    (H, HV), flag = job
    t = time.time()
    bwd._jit()[3](H, HV, "bfloat16", has_dinit=dinit, store_dh0=False, prefetch_l2=flag)
    return f"{H}/{HV} prefetch_l2={flag} dinit={dinit}: {time.time() - t:.0f} s"


with ThreadPoolExecutor(2) as pool:
    for line in pool.map(build, [(h, f) for h in heads for f in (True, False)]):
        print(line, flush=True)
