"""What the sm90 tests share: building a kernel for sm_90a without a GPU (skipped without tilelang and nvcc) and
reading its generated CUDA, a stand-in Hopper machine and problem, and the GPU tests' error measure."""
import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch


SM90 = {"kind": "cuda", "arch": "sm_90a"}


def _nvcc() -> bool:
    import os
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


def _tilelang():
    try:
        import tilelang
    except Exception as exc:  # noqa: BLE001 - any import failure means: cannot compile here
        pytest.skip(f"tilelang is not importable ({exc})")
    if not _nvcc():
        pytest.skip("nvcc is not installed")
    return tilelang


def _source(kind: str, H: int, HV: int, dtype: str, **options) -> str:
    return _kernel(kind, H, HV, dtype, **options).get_kernel_source()


@functools.lru_cache(maxsize=None)
def _kernel(kind: str, H: int, HV: int, dtype: str, **options):
    import tilelang

    from gdnkit.backends.tilelang_sm90 import (backward_fused, backward_state, backward_state_wide, chunk_grads,
                                               intra_chunk, propagator, state_output_pipelined, state_output_wide,
                                               state_output_narrow)
    module, program = {"intra_chunk": (intra_chunk, intra_chunk.intra_chunk_program),
                       "backward_state": (backward_state, backward_state.backward_state_program),
                       "chunk_grads": (chunk_grads, chunk_grads.chunk_grads_program),
                       "state_output_pipelined": (state_output_pipelined, state_output_pipelined.state_output_pipelined_program),
                       "state_output_narrow": (state_output_narrow, state_output_narrow.state_output_narrow_program),
                       "state_output_wide": (state_output_wide, state_output_wide.state_output_wide_program),
                       "backward_state_wide": (backward_state_wide, backward_state_wide.backward_state_wide_program),
                       "backward_fused": (backward_fused, backward_fused.backward_fused_program),
                       "propagator": (propagator, propagator.propagator_program)}[kind]
    return tilelang.compile(program(H, HV, dtype, **options), target=SM90, pass_configs=module.PASS_CONFIGS)


STATIC_SHARED = 2048


def _dynamic_shared_bytes(kernel) -> int:
    """The dynamic shared memory the host code asks for at launch: TileLang's host stub passes it as the last
    integer before the launch call's trailing empty slot."""
    host = kernel.get_host_source()
    sizes = re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\);\s*\(\(\(TVMFFIAny\*\)stack_ffi_any\)\[\d+\]\.type_index\) = 0;",
                       host)
    assert sizes, "no dynamic shared memory size found in the host stub (TileLang's host code changed?)"
    return int(sizes[-1])


def _assert_hopper_paths(src: str):
    assert "wgmma" in src, "tensor-core products did not lower to wgmma"
    assert "tma_load" in src, "tile loads did not lower to TMA (cp.async.bulk.tensor)"
    # TMA loads complete on an mbarrier (tl::Barrier) that is told the bytes to expect
    assert "Barrier*" in src and ("arrive_and_expect_tx" in src or "expect_transaction" in src), \
        "TMA loads are not tracked by mbarriers"
    assert not _barriers_under_thread_subsets(src), _barriers_under_thread_subsets(src)


_ELEMENT_LOOP = re.compile(r"^\s*for \(int i_\d+ = 0; i_\d+ < \d+; \+\+i_\d+\) \{$")


def _element_loops_with_barriers(src: str) -> int:
    """How many of the generated CUDA's element loops (TileLang's unrolled `for (int i_N ...)`) hold a barrier in
    their body: TileLang puts one in every step of a loop that reads and writes the same shared tile."""
    lines, found = src.split("\n"), 0
    for i, line in enumerate(lines):
        if _ELEMENT_LOOP.match(line):
            depth = 0
            for body in lines[i:]:
                depth += body.count("{") - body.count("}")
                if "__sync_thread_partial" in body or "__syncthreads" in body:
                    found += 1
                    break
                if depth == 0:
                    break
    return found


# a warpgroup role's branch (threads below a multiple of 128); any other thread condition picks a subset
_ROLE_BRANCH = re.compile(r"^if \(\(\(int\)threadIdx\.x\) < ([1-9][0-9]*)\) \{$")


def _barriers_under_thread_subsets(src: str) -> list[str]:
    """Lines of the generated CUDA where a barrier waits for threads that never come: a named barrier
    (__sync_thread_partial, a role's own) inside a branch only some of the role's threads take (a thread-index
    test, an elected thread), or a block barrier (__syncthreads) inside any thread branch, roles' included. The
    backward state pass hung on the H200 the first way (a (C,) fragment made a (C, K) loop run on one
    64-thread replica around a 128-thread barrier)."""
    # per open brace: 0 no thread condition, 1 a role's branch, 2 a subset of a role
    stack, bad = [], []
    for n, line in enumerate(src.splitlines(), 1):
        code = line.strip()
        level = max(stack, default=0)
        if ("__sync_thread_partial" in code and level == 2) or ("__syncthreads" in code and level >= 1):
            bad.append(f"line {n}: {code}")
        if code.startswith("} else"):
            flag = stack.pop() if stack else 0
            stack.append(flag)
            continue
        for _ in range(code.count("}")):
            if stack:
                stack.pop()
        for _ in range(code.count("{")):
            threads = code.startswith("if (") and ("threadIdx" in code or "shuffle_elect" in code)
            role = _ROLE_BRANCH.match(code)
            stack.append(0 if not threads else 1 if role and int(role.group(1)) % 128 == 0 else 2)
    return bad


def _ptxas_report(source: str, workdir: Path) -> str:
    """ptxas' -v report (registers, spills) of a TileLang kernel source compiled for sm_90a with TileLang's own
    nvcc flags and --use_fast_math, as TileLang compiles a kernel with TL_ENABLE_FAST_MATH."""
    from tilelang.contrib.nvcc import default_compile_options, find_cuda_path
    nvcc = shutil.which("nvcc") or str(Path(find_cuda_path()) / "bin" / "nvcc")
    cu = workdir / "kernel.cu"
    cu.write_text(source)
    done = subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-Xptxas", "-v", *default_compile_options(),
                           "--use_fast_math", "-o", str(workdir / "kernel.cubin"), str(cu)],
                          capture_output=True, text=True, check=True)
    return done.stderr


def _hopper(capability=(9, 0), tilelang="0.1.15"):
    from gdnkit import dispatch
    gpu = dispatch.GPU(index=0, name="NVIDIA H200", capability=capability, sm_count=132, total_memory_bytes=1 << 37)
    errors = {} if tilelang else {"tilelang": "ModuleNotFoundError: No module named 'tilelang'"}
    return dispatch.Machine(gpus=(gpu,), packages={"triton": "3.6.0", "tilelang": tilelang}, import_errors=errors)


def _problem(**over):
    from gdnkit.problem import CHUNK_MODE, Problem
    fields = dict(mode=CHUNK_MODE, B=1, T=4096, H=4, HV=16, K=128, V=128, N=1, dtype=torch.bfloat16,
                  gate_dtype=torch.float32, device_type="cuda", device_index=0, scale=128 ** -0.5, varlen=False,
                  has_initial_state=False, state_dtype=None, output_final_state=False)
    fields.update(over)
    return Problem(**fields)


K = V = 128


CU_SEQLENS = [0, 1, 65, 200, 333]  # lengths 1, 64, 135, 133: a 1-token sequence, a full chunk, chunk tails


BF16_FWD_BAR = 5e-3


def _rel(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    err = float((x - ref).norm() / ref.norm().clamp_min(1e-300))
    return err if err == err else float("inf")
