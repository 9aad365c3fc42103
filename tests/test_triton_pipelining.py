"""triton_generic's software-pipelined loops, built for sm90 on the CPU (Triton compiles for a target without a
GPU), must not let an asynchronous wgmma read a shared-memory slot that the loop's own prefetch refills while
the product is still in flight.

Triton 3.6 built backward_wy that way (session 9): K K^T was issued asynchronously after the loop's last wait,
over a two-slot ring that the loop's prefetch (predicated off, but a predicated-off cp.async still zero-fills its
slot) wrote in the same iteration. On the H200 dbeta and dg, its only consumers, then differed between identical
calls. No test of results could see it on a CPU; the TTGIR shows it, so this test reads the TTGIR."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

# One child process builds every kernel: on a CPU the test session runs Triton's interpreter
# (TRITON_INTERPRET=1, conftest.py), whose kernels cannot be compiled, and that choice is made at import.
BUILD = r"""
import json, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from gdnkit.backends.triton_generic import backward_chunk, backward_state, backward_wy, launch, state_pass

FP32 = {"beta", "gcum", "dkp", "dgp", "dk", "dbeta", "dg", "dq", "dht", "dh0", "h0", "ht"}  # else 16-bit
INT32 = {"cu_seqlens", "chunk_indices", "chunk_offsets"}
SHAPE = dict(H=16, HV=32, K=128, V=128, PREC="tf32", IS_VARLEN=True)   # the quick grid's 16/32, packed


def state(fused):
    return dict(BV=32, HAS_H0=True, STORE_HT=True, STATE_V_FIRST=False, STORE_H=not fused, STORE_VNEW=not fused,
                FUSE_OUTPUT=fused, PROPAGATOR=False)


KERNELS = {   # the launch table's name: (kernel, its compile-time arguments)
    "backward_wy": (backward_wy.backward_wy_kernel, dict(BK=64, BV=64, NK=2)),
    "backward_chunk": (backward_chunk.backward_chunk_kernel, dict(BK=64, BV=64, ACCUMULATE=True)),
    "reverse": (backward_state.backward_state_kernel, dict(BV=32, HAS_DHT=True, STORE_DH0=True,
                                                           STATE_V_FIRST=False, STORE_DH=True)),
    "state": (state_pass.state_pass_kernel, state(False)),
    "fused": (state_pass.state_pass_kernel, state(True)),
}
out = {}
for name in sys.argv[1:]:
    kernel, consts = KERNELS[name]
    consts = {**SHAPE, **consts}
    sig = {n: "constexpr" if n in consts else "i32" if n in ("T", "J") else "fp32" if n == "scale"
           else "*i32" if n in INT32 else "*fp32" if n in FP32 else "*bf16" for n in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n].startswith("*")}
    options = launch.settings(name, torch.bfloat16)
    build = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)
    out[name] = (build.asm["ttgir"], options["num_stages"])
print(json.dumps(out))
"""
KERNELS = ["backward_wy", "backward_chunk", "reverse", "state", "fused"]


@pytest.fixture(scope="module")
def builds() -> dict:
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", BUILD, *KERNELS], capture_output=True, text=True, env=env,
                          timeout=900)
    if done.returncode:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no message"
        # triton.compile's arguments are internal API (written against 3.6 and 3.9): another version's may differ
        if last.startswith(("TypeError", "AttributeError", "ImportError", "ModuleNotFoundError")):
            pytest.skip(f"this Triton ({triton.__version__}) does not take these build arguments: {last}")
        raise AssertionError(f"sm90 builds failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


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


def test_the_check_finds_the_session_9_race():
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


# the kernels with a software-pipelined loop (the others' loops are static_range: unrolled, not pipelined)
@pytest.mark.parametrize("name", KERNELS)
def test_no_wgmma_reads_a_slot_its_loop_refills(name, builds):
    ttgir, stages = builds[name]
    assert stages > 1 and _loop_bodies(ttgir), "no pipelined loop to check: the table or the TTGIR format changed"
    assert not races(ttgir, stages), f"{name}: {races(ttgir, stages)}"
