"""Every triton_generic chunked kernel and the prologue's qk l2norm, and tilelang_sm90's Triton lead-in flags and
group sums, compile for real GPUs (sm80, sm90) on this CPU machine.

The interpreter tests run the kernels' logic but never Triton's GPU lowering (layouts, mma/wgmma selection,
ptxas), where a kernel can fail on a GPU while passing in the interpreter. Compiling needs no GPU: ptxas
ships with triton. It runs in a subprocess because the test process's kernels are interpreter objects
(conftest sets TRITON_INTERPRET=1 on machines without CUDA before they are defined).

The kernels with software-pipelined loops are also built for sm90 at the launch table's settings, and their
TTGIR is read for an asynchronous wgmma still reading a shared-memory slot that its loop's own prefetch
refills. Triton 3.6 built backward_wy that way: K K^T was issued asynchronously after the loop's
last wait, over a two-slot ring that the loop's prefetch (predicated off, but a predicated-off cp.async still
zero-fills its slot) wrote in the same iteration; on the H200 dbeta and dg, its only consumers, differed
between identical calls. No test of results can see that on a CPU; the TTGIR shows it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

CAPABILITIES = (80, 90)
# The buffers the backend allocates in fp32 whatever the inputs' dtype; every other pointer is a 16-bit input
# or output (h, dh, dU, dW are stored in the inputs' dtype)
FP32_ARGS = {"A_log", "dt_bias", "a", "gcum", "h0", "ht", "dht", "dh0", "dq", "dk", "dkp", "dgp", "dbeta", "dg", "beta", "g", "g_raw", "aug", "f",
             "s0", "lead_in_states", "rstd", "dy", "q_rstd", "k_rstd"}
INDEX_ARGS = {"slots", "num_accepted", "parents", "ckpt", "cu_seqlens", "chunk_offsets", "chunk_indices", "seg_offsets", "need", "walk",
              # the wide route's pick (lead_in_bound._pick_kernel): int32 segment tables and cu_seqlens
              "own", "seg_cu", "cu", "wide_cu", "wide_walk", "plain_cu"}
# tilelang_sm90's lead-in flags (lead_in_bound.py) and the gated scan's seq_of: int64 segment and row tables, int8
# row flags, float64 sums, int scalars
INT64_ARGS = {"starts", "ends", "seq_ends", "before", "after", "out", "row_starts", "row_ends", "base", "seq_of"}
INT_SCALARS = {"slot_stride", "n_ckpt", "every", "T", "J", "limit", "n_tok", "window", "stride", "n_seg", "n_cu",
               "w0", "n_rows", "N0", "N1", "B", "n",   # the flat grids' logical sizes (jit_helpers.grid_2d / grid_3d) and the batch size
               # head counts: run-time arguments of the Triton kernels (one build serves every head configuration
               # of a dtype and flag set), compiled here as a launch passes them
               "H", "HV", "T_total", "N", "stride_h0_slot", "stride_ht_slot", "stride_slots_seq", "SLOT_COLS"}
FP32_SCALARS = {"scale", "longest", "ratio"}
HEADS = dict(K=128, V=128, IS_VARLEN=True, PREC="tf32")
RECURRENT = dict(K=128, V=128, BK=128, BV=32, IS_VARLEN=True, HAS_ACCEPTED=False, QK_L2NORM=True, GATE_IN_KERNEL=True,
                 HAS_DT_BIAS=True, BETA_SIGMOID=False, NEG_EIGVAL=False, V_FIRST=False, TREE=False, REPAIR=False,
                 CHUNK=64, SCAN=64)
# kernel -> (module, function, constexprs): settings the backend launches at K = V = 128
KERNELS = {
    "state_pass": ("state_pass", "state_pass_kernel",
                   dict(HEADS, BV=32, HAS_H0=True, STORE_HT=True, STATE_V_FIRST=False, STORE_H=True, STORE_VNEW=True,
                        FUSE_OUTPUT=True, PROPAGATOR=False, U_ON_CHIP=True, POOL=False, HAS_STARTS=False,
                        CHECKPOINTS=False)),
    # prefill on a state pool (fp32 slots) with start flags and prefix-cache checkpoints
    "state_pass_pool": ("state_pass", "state_pass_kernel",
                        dict(HEADS, BV=32, HAS_H0=False, STORE_HT=False, STATE_V_FIRST=False, STORE_H=False,
                             STORE_VNEW=False, FUSE_OUTPUT=True, PROPAGATOR=False, U_ON_CHIP=True, POOL=True,
                             HAS_STARTS=True, CHECKPOINTS=True)),
    "backward_state": ("backward_state", "backward_state_kernel",
                       dict(HEADS, BV=32, HAS_DHT=True, STORE_DH0=True, STATE_V_FIRST=True, STORE_DH=True)),
    "output": ("output", "output_kernel", dict(HEADS, BK=64, BV=64)),
    "backward_chunk": ("backward_chunk", "backward_chunk_kernel", dict(HEADS, BK=64, BV=64, ACCUMULATE=True)),
    "backward_wy": ("backward_wy", "backward_wy_kernel", dict(HEADS, BK=64, BV=64, NK=2)),
    "kkt": ("intra_chunk", "kkt_kernel", dict(K=128, IS_VARLEN=True, PREC="tf32", BK=64, CUMSUM=True)),
    "diag_inverse": ("intra_chunk", "diag_inverse_kernel", dict(IS_VARLEN=True)),
    "solve": ("intra_chunk", "solve_kernel", dict(IS_VARLEN=True)),
    "w_u": ("intra_chunk", "w_u_kernel", dict(HEADS, BK=64, BV=64)),
    "segment_scan": ("gdnkit.backends.triton_shared.segments", "segment_scan_kernel",
                     dict(PREC="tf32", K=128, V=128, BV=16, HAS_H0=True, STORE_HT=True, STATE_V_FIRST=False,
                          REVERSE=False, f=None)),  # None: as launched
    "segment_states_gated": ("gdnkit.backends.triton_shared.segments", "gated_segment_states_kernel",
                             dict(PREC="tf32", K=128, V=128, BV=16, HAS_H0=True, REVERSE=True, IN_PLACE=True)),
    # the token-by-token kernel (triton_shared/recurrence.py): decode from and to dense states, and the causal repair
    "recurrent": ("gdnkit.backends.triton_shared.recurrence", "recurrent_kernel", dict(RECURRENT, READ=1, WRITE=1)),
    "causal_repair": ("gdnkit.backends.triton_shared.recurrence", "recurrent_kernel",
                      dict(RECURRENT, READ=1, WRITE=0, REPAIR=True)),
    # tilelang_sm90's lead-in flags run in Triton too (lead_in_bound.py), at a grouped head count
    "lead_in_chunk_bounds": ("gdnkit.backends.tilelang_sm90.lead_in_bound", "_chunk_bounds_kernel",
                            dict(H=4, HV=8, K=128, GP=2, KP=128, REVERSE=False)),
    "lead_in_row_bounds": ("gdnkit.backends.tilelang_sm90.lead_in_bound", "_row_bounds_kernel",
                          dict(H=4, HV=8, K=128, GP=2, KP=128)),
    "lead_in_walks": ("gdnkit.backends.tilelang_sm90.lead_in_bound", "_walks_kernel",
                     dict(HV=8, HVP=8, BM=64, REVERSE=True, LOG_BOUND=-12.0)),
    "lead_in_needs": ("gdnkit.backends.tilelang_sm90.lead_in_bound", "_needs_kernel",
                     dict(HV=8, HVP=8, REVERSE=True, LOG_BOUND=-12.0, WALK=True, ROWS=False)),
    # ... reading the training forward's per-row bounds (the backward's flags; forward rows, nearest first)
    "lead_in_needs_rows": ("gdnkit.backends.tilelang_sm90.lead_in_bound", "_needs_kernel",
                          dict(HV=8, HVP=8, REVERSE=False, LOG_BOUND=-12.0, WALK=False, ROWS=True)),
    "wide_pick": ("gdnkit.backends.tilelang_sm90.lead_in_bound", "_pick_kernel", dict(HV=8, HVP=8, BS=64)),
    # and the fused backward's GVA sums (group_sum.py)
    "group_sums": ("gdnkit.backends.tilelang_sm90.group_sum", "_chunk_group_sums_kernel",
                   dict(H=4, G=2, C=64, K=128, L2NORM=False, FLOOR=False, GATE_FLOOR=-30.0)),
    "group_sums_l2norm": ("gdnkit.backends.tilelang_sm90.group_sum", "_chunk_group_sums_kernel",
                          dict(H=4, G=2, C=64, K=128, L2NORM=True, FLOOR=True, GATE_FLOOR=-30.0)),
    # ... with the gate floor's backward on dg (what the fused path launches)
    "group_sums_floor": ("gdnkit.backends.tilelang_sm90.group_sum", "_chunk_group_sums_kernel",
                         dict(H=4, G=2, C=64, K=128, L2NORM=False, FLOOR=True, GATE_FLOOR=-30.0)),
    # the device-side check of a caller's cu_seqlens (triton_shared/offsets_check.py), built with its assert
    "offsets_check": ("gdnkit.backends.triton_shared.offsets_check", "_offsets_agree_kernel", dict(BLOCK=1024)),
    # the qk l2norm of both backends' prologue (dy: the summed dq / dk, fp32)
    "l2norm_forward": ("gdnkit.backends.triton_shared.l2norm", "l2norm_forward_kernel", dict(K=128, BK=128, ROWS=32, EPS=1e-6)),
    "l2norm_backward": ("gdnkit.backends.triton_shared.l2norm", "l2norm_backward_kernel", dict(K=128, BK=128, ROWS=32)),
}
# the kernels with software-pipelined loops (the others' loops are static_range: unrolled): check name -> (its
# launch-table name, its KERNELS entry, compile-time arguments that differ from that entry)
PIPELINED = {
    "backward_wy": ("backward_wy", "backward_wy", {}),
    "backward_chunk": ("backward_chunk", "backward_chunk", {}),
    "reverse": ("reverse", "backward_state", {}),
    "fused": ("fused", "state_pass", {}),
    "state": ("state", "state_pass", dict(FUSE_OUTPUT=False)),
    "state-from-wu": ("state", "state_pass", dict(FUSE_OUTPUT=False, U_ON_CHIP=False)),   # the backward's recompute
}


def _signature(fn, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in INT_SCALARS:
            sig[name] = "i32"
        elif name in INT64_ARGS or name == "sums":
            sig[name] = "*i64" if name in INT64_ARGS else "*fp64"
        elif name in ("walked", "start_flags"):
            sig[name] = "*i8"
        elif name == "choice":
            sig[name] = "*i1"
        elif name in FP32_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "*i32" if name in INDEX_ARGS else "*fp32" if name in FP32_ARGS else "*bf16"
    return sig


def _compile_all() -> dict:
    """In the subprocess: "ok" or the error, per "kernel|capability"; and per PIPELINED name the sm90 build's
    TTGIR at the launch table's settings with its stage count (or the error)."""
    import importlib

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gdnkit.backends.triton_shared import launch

    def build(module, function, constexprs, cc, options):
        path = module if "." in module else f"gdnkit.backends.triton_generic.{module}"
        fn = getattr(importlib.import_module(path), function)
        sig = _signature(fn, constexprs)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if sig[n].startswith("*")}
        if fn.debug:   # a kernel built with debug=True (its device asserts kept), as its launches build it
            options = {**options, "debug": True}
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", cc, 32), options=options)

    results, ttgir, asserts = {}, {}, {}
    for name, (module, function, constexprs) in KERNELS.items():
        for cc in CAPABILITIES:
            try:
                compiled = build(module, function, constexprs, cc, {"num_warps": 8})
                results[f"{name}|{cc}"] = "ok" if compiled.asm.get("cubin") else "no cubin"
                asserts[f"{name}|{cc}"] = "__assertfail" in compiled.asm.get("ptx", "")
            except Exception as exc:  # reported per kernel by the test
                results[f"{name}|{cc}"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    for name, (table_name, kernel, changes) in PIPELINED.items():
        module, function, constexprs = KERNELS[kernel]
        options = launch.settings(table_name, torch.bfloat16)
        try:
            ttgir[name] = [build(module, function, {**constexprs, **changes}, 90, options).asm["ttgir"],
                           options["num_stages"]]
        except Exception as exc:
            ttgir[name] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    return {"compiled": results, "ttgir": ttgir, "asserts": asserts}


@pytest.fixture(scope="module")
def builds() -> dict:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cc", CAPABILITIES, ids=lambda cc: f"sm{cc}")
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_gpu(builds, name, cc):
    assert builds["compiled"][f"{name}|{cc}"] == "ok", builds["compiled"][f"{name}|{cc}"]


@pytest.mark.parametrize("cc", CAPABILITIES, ids=lambda cc: f"sm{cc}")
def test_offsets_check_keeps_its_assert(builds, cc):
    """The cu_seqlens check is nothing but its device assert, which Triton drops from a build without debug."""
    assert builds["asserts"][f"offsets_check|{cc}"]
    assert not builds["asserts"][f"wide_pick|{cc}"]   # a kernel built without debug has none: the probe can fail


def _loop_bodies(ttgir: str) -> list[list[str]]:
    lines = ttgir.splitlines()
    bodies = []
    for i, line in enumerate(lines):
        if re.search(r"= scf\.for ", line):
            indent = len(line) - len(line.lstrip())
            body = []
            for inner in lines[i + 1:]:
                if inner.strip().startswith("}") and len(inner) - len(inner.lstrip()) == indent:
                    break
                body.append(inner)
            bodies.append(body)
    return bodies


def races(ttgir: str, stages: int) -> list[str]:
    """Asynchronous wgmmas in flight when their loop's prefetch writes the ring slot they read: a prefetch runs
    stages - 1 iterations ahead, so in a ring of R slots it hits the slot read this iteration where R divides
    stages - 1, and the slot read the iteration before where R divides stages."""
    rings = {m.group(1): int(m.group(2)) for m in
             re.finditer(r"(%[\w.#]+) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)}
    base = dict.fromkeys(rings)
    for m in re.finditer(r"(%[\w.#]+) = ttg\.memdesc_index (%[\w.#]+)\[", ttgir):
        base[m.group(1)] = m.group(2) if m.group(2) in rings else base.get(m.group(2))
    for m in re.finditer(r"(%[\w.#]+) = ttg\.memdesc_trans (%[\w.#]+) ", ttgir):
        base[m.group(1)] = base.get(m.group(2))
    found = []
    for body in _loop_bodies(ttgir):
        in_flight = []  # (iteration it was issued in, ring it reads, the instruction)
        for iteration in (0, 1):  # the body twice: products carried into the next iteration count too
            for line in body:
                dot = re.search(r"= ttng\.warp_group_dot (%[\w.#]+), (%[\w.#]+),", line)
                wait = re.search(r"ttng\.warp_group_dot_wait .*pendings = (\d+)", line)
                copy = re.search(r"ttg\.async_copy_global_to_local %[\w.#]+, (%[\w.#]+) ", line)
                if dot and "isAsync = true" in line:
                    for operand in dot.groups():
                        if base.get(operand):
                            in_flight.append((iteration, base[operand], line.strip()[:100]))
                elif wait:
                    keep = int(wait.group(1))
                    in_flight = in_flight[len(in_flight) - keep:] if keep else []
                elif copy and base.get(copy.group(1)):
                    ring = base[copy.group(1)]
                    for issued, read, what in in_flight:
                        ahead = stages - 1 + (iteration - issued)
                        if read == ring and ahead % rings[ring] == 0:
                            found.append(f"{what} (ring of {rings[ring]}, prefetch {ahead} ahead)")
    return sorted(set(found))


def test_the_race_check_finds_the_backward_wy_race():
    """The check against the TTGIR pattern it exists for (the shape of Triton 3.6's old backward_wy loop), and
    against the pipeliner's own scheme (two products kept in flight over three-slot rings), which is safe."""
    racy = """
    %kk = ttg.local_alloc : () -> !ttg.memdesc<2x64x64xbf16, #shared, #smem, mutable>
    %x:3 = scf.for %i = %c0 to %c128 step %c64 iter_args(%a = %z) {
      %s = ttg.memdesc_index %kk[%r] : !ttg.memdesc<2x64x64xbf16>
      %t = ttg.memdesc_trans %s {order = array<i32: 1, 0>} : !ttg.memdesc<64x64xbf16>
      %d = ttng.warp_group_dot %s, %t, %a {inputPrecision = 0 : i32, isAsync = true} : x
      %w = ttg.memdesc_index %kk[%q] : !ttg.memdesc<2x64x64xbf16>
      %c = ttg.async_copy_global_to_local %p, %w mask %m other %o : x
    }
    """
    assert races(racy, 3)
    keep_one = racy.replace("      %w = ", "      %y:3 = ttng.warp_group_dot_wait %d {pendings = 1 : i32} : x\n      %w = ")
    assert races(keep_one, 3)                                                   # still the slot it reads
    assert not races(keep_one.replace("<2x64x64xbf16, #shared", "<3x64x64xbf16, #shared"), 3)
    assert not races(keep_one.replace("pendings = 1", "pendings = 0"), 3)


@pytest.mark.parametrize("name", sorted(PIPELINED))
def test_no_wgmma_reads_a_slot_its_loop_refills(builds, name):
    built = builds["ttgir"][name]
    assert isinstance(built, list), built
    ttgir, stages = built
    assert stages > 1 and _loop_bodies(ttgir), "no pipelined loop to check: the table or the TTGIR format changed"
    assert not races(ttgir, stages), f"{name}: {races(ttgir, stages)}"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
