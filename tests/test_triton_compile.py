"""Every triton_generic chunked kernel compiles for real GPUs (sm80, sm90) on this CPU machine.

The interpreter tests run the kernels' logic but never Triton's GPU lowering (layouts, mma/wgmma selection,
ptxas), where a kernel can fail on a GPU while passing in the interpreter. Compiling needs no GPU: ptxas
ships with triton. It runs in a subprocess because the test session's kernels are interpreter objects
(conftest sets TRITON_INTERPRET=1 on machines without CUDA before they are defined)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CAPABILITIES = (80, 90)
FP32_ARGS = {"a", "gcum", "h", "h0", "ht", "dht", "dh", "dh0", "du", "dq", "dk", "dkp", "dgp", "dw", "dbeta", "dg", "beta",
             "g", "aug", "f", "s0"}
INDEX_ARGS = {"cu_seqlens", "chunk_offsets", "chunk_indices", "seg_offsets"}
HEADS = dict(H=2, HV=4, K=128, V=128, IS_VARLEN=True, PREC="tf32")
# kernel -> (module, function, constexprs): settings the backend launches at K = V = 128
KERNELS = {
    "state_pass": ("state_pass", "state_pass_kernel",
                   dict(HEADS, BV=32, HAS_H0=True, STORE_HT=True, STATE_V_FIRST=False, STORE_H=True, STORE_VNEW=True,
                        FUSE_OUTPUT=True, PROPAGATOR=False)),
    "backward_state": ("backward_state", "backward_state_kernel",
                       dict(HEADS, BV=32, HAS_DHT=True, STORE_DH0=True, STATE_V_FIRST=True, STORE_DH=True)),
    "output": ("output", "output_kernel", dict(HEADS, BK=64, BV=64)),
    "backward_chunk": ("backward_chunk", "backward_chunk_kernel", dict(HEADS, BK=64, BV=64, ACCUMULATE=True)),
    "backward_wy": ("backward_wy", "backward_wy_kernel", dict(HEADS, BK=64, BV=64, NK=2)),
    "kkt": ("intra_chunk", "kkt_kernel", dict(H=2, HV=4, K=128, IS_VARLEN=True, PREC="tf32", BK=64, CUMSUM=True)),
    "diag_inverse": ("intra_chunk", "diag_inverse_kernel", dict(HV=4, IS_VARLEN=True)),
    "solve": ("intra_chunk", "solve_kernel", dict(HV=4, IS_VARLEN=True)),
    "w_u": ("intra_chunk", "w_u_kernel", dict(HEADS, BK=64, BV=64)),
    "segment_scan": ("context_parallel", "segment_scan_kernel",
                     dict(PREC="tf32", HV=4, K=128, V=128, BV=16, HAS_H0=True, STORE_HT=True, STATE_V_FIRST=False,
                          REVERSE=False)),
}


def _signature(fn, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in ("T", "J"):
            sig[name] = "i32"
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "*i32" if name in INDEX_ARGS else "*fp32" if name in FP32_ARGS else "*bf16"
    return sig


def _compile_all() -> dict[str, str]:
    """In the subprocess: "ok" or the error, per "kernel|capability"."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for name, (module, function, constexprs) in KERNELS.items():
        fn = getattr(importlib.import_module(f"gdnkit.backends.triton_generic.{module}"), function)
        for cc in CAPABILITIES:
            try:
                compiled = triton.compile(ASTSource(fn=fn, signature=_signature(fn, constexprs), constexprs=constexprs),
                                          target=GPUTarget("cuda", cc, 32), options={"num_warps": 8})
                results[f"{name}|{cc}"] = "ok" if compiled.asm.get("cubin") else "no cubin"
            except Exception as exc:  # reported per kernel by the test
                results[f"{name}|{cc}"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    return results


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("cc", CAPABILITIES, ids=lambda cc: f"sm{cc}")
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_compiles_for_gpu(compiled, name, cc):
    assert compiled[f"{name}|{cc}"] == "ok", compiled[f"{name}|{cc}"]


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
