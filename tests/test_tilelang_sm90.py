"""backends/tilelang_sm90: the sm90 TileLang forward kernels and the backend around them.

CPU (CI): every kernel compiles for sm_90a with nvcc (no GPU needed), and the generated CUDA shows the
Hopper paths: wgmma for the tensor-core products, TMA bulk tensor loads on mbarriers for the tiles. A
regression to mma.sync or to plain loads fails here. Also the backend's supports() reasons and dispatch
choice, a float64 check of the solve's algebra, and a float64 model of both kernels' tile dataflow.

GPU (`-m gpu`, an sm90 device): forward() against the reference backend's chunked form in float64.
"""
import dataclasses
import functools
import inspect
import re
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gdnkit
from gdnkit.prologue import triton_reads

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


# What one block may use on sm90 (cudaDevAttrMaxSharedMemoryPerBlockOptin, H100 / H200: 227 KB), and what a kernel
# with static mbarriers takes besides its dynamic buffer: the barriers padded to that buffer's 1 KB alignment, plus
# the 1 KB the driver reserves per block (cuobjdump -res-usage reads SHARED:2048 for chunk_grads). A kernel past the
# sum compiles, then fails at launch ("Failed to set the allowed dynamic shared memory size"): 232704 and
# 232448 bytes failed that way on the H200.
SM90_BLOCK_SHARED = 232448
STATIC_SHARED = 2048
SM90_SM_SHARED = 233472   # what the blocks resident on one SM share (228 KB)


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


@pytest.mark.parametrize("H,HV,dtype", [(2, 8, "bfloat16"), (16, 64, "float16")])
def test_intra_chunk_compiles_to_wgmma_and_tma(H, HV, dtype):
    _tilelang()
    src = _source("intra_chunk", H, HV, dtype)
    _assert_hopper_paths(src)
    # the 64x64 solve products stay fp32 operands (tf32 tensor cores), not bf16
    assert "kTensorFloat32" in src
    # full chunks of Tb leave by a TMA store from shared memory, not per-thread global stores
    assert "tma_store(a_desc" in src, "Tb stores did not lower to TMA"
    # the walks' chunk sums (emit_bound) cost no barrier: a shared store inside the mask's loop put one in each
    # of its 32 steps
    with_bound = _source("intra_chunk", H, HV, dtype, emit_bound=True)
    assert "bound[" in with_bound and "bound[" not in src
    assert with_bound.count("__syncthreads") == src.count("__syncthreads")


# every V tile the forward can pick: 32 and 64 run the three-warpgroup kernel, 128 the pipelined one
@pytest.mark.parametrize("H,HV,dtype,h0,ht,bv", [(2, 8, "bfloat16", True, True, 64),
                                                 (16, 64, "float16", False, False, 128),
                                                 (4, 16, "bfloat16", True, False, 32)])
def test_state_output_compiles_to_wgmma_and_tma(H, HV, dtype, h0, ht, bv):
    _tilelang()
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    options = dict(has_initial_state=h0, store_final_state=ht, block_v=bv)
    if bv in fwd.NARROW_BLOCK_V:
        src = _source("state_output_narrow", H, HV, dtype, **options)
        # the roles' register budgets: the TMA producer gives registers back, the two consumers take them
        assert "reg_dealloc<40>" in src and src.count("reg_alloc<232>") == 2, "setmaxnreg roles are missing"
        assert "wgmma_rs" in src, "P U does not take P from registers"
        # full chunks of O leave through shared memory and a TMA store
        assert "tma_store(o_desc" in src, "O stores did not lower to TMA"
    else:
        src = _source("state_output_pipelined", H, HV, dtype, **options, num_stages=fwd.NUM_STAGES,
                      threads=fwd.PIPELINED_THREADS)
    _assert_hopper_paths(src)


@pytest.mark.parametrize("H,HV,dtype,bv,chained", [(16, 32, "bfloat16", 64, True), (4, 8, "float16", 32, False)])
def test_recompute_with_x_compiles_to_wgmma_and_tma(H, HV, dtype, bv, chained):
    """The fused backward's recompute (S0 per chunk without output, X beside it): S0 and full chunks of X leave
    through TMA stores from the hand-over tiles (a tail's X rows by threads), the state role's U = Tb X reads X's
    hand-over tile (no extra copy on its chain), and without store_x nothing of it is built."""
    _tilelang()
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    options = dict(has_initial_state=True, store_final_state=False, block_v=bv, stages=fwd.NARROW_STAGES[bv],
                   store_states=True, emit_output=False, chained=chained)
    src = _source("state_output_narrow", H, HV, dtype, **options, store_x=True)
    _assert_hopper_paths(src)
    assert "tma_store(hs_desc" in src and "tma_store(o_desc" in src
    assert src.count("wgmma_ss<") == 3     # K S, Tb X, K^T U_d: X's store adds no product
    without = _source("state_output_narrow", H, HV, dtype, **options)
    assert "tma_store(hs_desc" in without and "o_desc" not in without


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


@pytest.mark.parametrize("H,HV,dtype,chained", [(16, 32, "bfloat16", True), (4, 8, "float16", False)])
def test_recompute_two_an_sm_fits_an_sm_twice(H, HV, dtype, chained):
    """The fused backward's recompute at two programs an SM (per_sm=2, 64 columns): launched for two
    blocks an SM, so ptxas holds it to 80 registers at launch without spills; two blocks' shared memory fits one
    SM; X is made in V's stage tile and leaves from there by TMA (no X hand-over tile), beside S0 from its slot, the
    two stores waited for once; the chain's three products as at one program an SM."""
    _tilelang()
    options = dict(has_initial_state=True, store_final_state=False, block_v=64, stages=2, store_states=True,
                   emit_output=False, chained=chained, store_x=True, per_sm=2)
    kernel = _kernel("state_output_narrow", H, HV, dtype, **options)
    src = kernel.get_kernel_source()
    _assert_hopper_paths(src)
    assert "__launch_bounds__(384, 2)" in src
    assert re.search(r"tma_store\(o_desc, \(&\(\(\(\w+\*\)v_s\)", src) and "xh_s" not in src
    assert "tma_store(hs_desc" in src and src.count("tma_store_wait") == 1
    assert src.count("wgmma_ss<") == 3
    assert 2 * (_dynamic_shared_bytes(kernel) + STATIC_SHARED) <= SM90_SM_SHARED
    with tempfile.TemporaryDirectory() as tmp:
        report = _ptxas_report(src, Path(tmp))
    used = re.search(r"Used (\d+) registers", report)
    assert used and int(used.group(1)) <= 80 and "0 bytes spill stores" in report, report


@pytest.mark.parametrize("H,HV,dtype,chained", [(2, 8, "bfloat16", True), (16, 64, "float16", False)])
def test_state_output_wide_compiles_to_wgmma_and_tma(H, HV, dtype, chained):
    """The 128-column three-role state pass (inference with enough programs, and the wide route's chained build):
    Hopper paths, its shared memory within what a block may take, no barrier under a thread subset."""
    _tilelang()
    kernel = _kernel("state_output_wide", H, HV, dtype, has_initial_state=True, store_final_state=True,
                     chained=chained)
    src = kernel.get_kernel_source()
    _assert_hopper_paths(src)
    assert _dynamic_shared_bytes(kernel) + STATIC_SHARED <= SM90_BLOCK_SHARED


@pytest.mark.parametrize("H,HV,dtype", [(2, 8, "bfloat16"), (4, 16, "float16")])
def test_propagator_compiles_to_wgmma_and_tma(H, HV, dtype):
    _tilelang()
    src = _source("propagator", H, HV, dtype, block_v=64)
    _assert_hopper_paths(src)
    # V is loaded only by the column tiles of E (P's tiles start from the identity with V = 0)
    assert src.count("tma_load(v_desc") == 1 and "blockIdx.x) < 2" in src


@pytest.mark.parametrize("block_v,stages", [(32, 3), (64, 2)])
def test_state_output_narrow_keeps_p_in_registers_and_stores_o_by_tma(block_v, stages):
    """The three-warpgroup kernel's output role: P U takes P from registers (no P tile in shared memory), and
    full chunks of O leave by one TMA store; the roles get their register budgets (40 / 232 / 232)."""
    _tilelang()
    src = _source("state_output_narrow", 16, 64, "bfloat16", block_v=block_v, stages=stages)
    _assert_hopper_paths(src)
    assert "wgmma_rs" in src and "tma_store" in src
    assert "reg_dealloc<40>" in src and src.count("reg_alloc<232>") == 2


@pytest.mark.parametrize("block_v,stages", [(32, 3), (64, 2)])
def test_state_output_narrow_without_output_stores_only_the_states(block_v, stages):
    """The backward's recompute of S0: no Q loads, no output products or O stores; the third warpgroup stores
    each chunk's hand-over tile to hs by TMA."""
    _tilelang()
    src = _source("state_output_narrow", 16, 64, "bfloat16", block_v=block_v, stages=stages, store_states=True,
                  emit_output=False, has_initial_state=True)
    _assert_hopper_paths(src)
    assert "tma_load(q_desc" not in src and "o_desc" not in src and "tma_store(hs_desc" in src
    assert src.count("wgmma_ss<") == 3 and "wgmma_rs" not in src   # the chain's K S, Tb X and K^T U only


@pytest.mark.parametrize("block_v,stages,emit_output", [(64, 2, True), (32, 3, False)])
def test_state_output_narrow_chained_reads_its_walks(block_v, stages, emit_output):
    """The chained build (context parallelism's chained route): the Hopper paths as in the plain build, the
    walk reads `walk` and `before`, and no barrier waits under a thread subset (the walk's chunks skip the
    hand-over barriers on a condition every thread of the role evaluates alike)."""
    _tilelang()
    src = _source("state_output_narrow", 8, 32, "bfloat16", block_v=block_v, stages=stages, has_initial_state=True,
                  store_final_state=True, chained=True, emit_output=emit_output, store_states=not emit_output)
    _assert_hopper_paths(src)
    assert "walk[" in src and "before[" in src
    plain = _source("state_output_narrow", 8, 32, "bfloat16", block_v=block_v, stages=stages, has_initial_state=True,
                    store_final_state=True, emit_output=emit_output, store_states=not emit_output)
    assert "walk[" not in plain


@pytest.mark.parametrize("H,HV,dtype,dht,dh0,bv,chained", [(16, 32, "bfloat16", True, True, 64, False),
                                                        (4, 8, "float16", False, False, 32, False),
                                                        (8, 32, "bfloat16", True, True, 64, True)])
def test_backward_state_compiles_to_wgmma_and_tma(H, HV, dtype, dht, dh0, bv, chained):
    """The reverse pass; its chained build (context parallelism's chained route) also reads `walk`."""
    _tilelang()
    src = _source("backward_state", H, HV, dtype, has_dht=dht, store_dh0=dh0, block_v=bv, chained=chained)
    _assert_hopper_paths(src)
    assert ("walk[" in src) == chained
    assert src.count("wgmma_ss") == 6, "the six products (three on the chain, one on the side) are not all wgmma"
    assert "tma_store(dh_desc" in src and "tma_store(du_desc" in src, "dS_end / dU stores did not lower to TMA"
    assert "reg_dealloc<40>" in src and src.count("reg_alloc<232>") == 2, "setmaxnreg roles are missing"


@pytest.mark.parametrize("wide,chained", [(False, False), (False, True), (True, True)])
def test_backward_state_ds_only_stores_only_dh0(wide, chained):
    """The gated route's passes (ds_only): the same chain on wgmma, nothing stored but dh0 (du, dv, dh never
    referenced); chained, the run starts at the segment's end (chunk_offsets[n + 1]) and reads its walk; the
    full-width build also drops dX, which only dV needs."""
    _tilelang()
    module, extra = ("backward_state_wide", {}) if wide else ("backward_state", {"block_v": 64})
    src = _source(module, 16, 32, "bfloat16", has_dht=chained, store_dh0=True, chained=chained, ds_only=True,
                  **extra)
    _assert_hopper_paths(src)
    assert not any(re.search(rf"\b{d}(_desc)?\b", src) for d in ("du", "dv", "dh")), "a ds_only pass stores"
    assert "(dh0 + " in src and ("walk[" in src) == chained
    assert src.count("wgmma_ss") == 6   # the full-width build: its seven less dX


@pytest.mark.parametrize("H,HV,dtype,chained", [(16, 32, "bfloat16", False), (4, 8, "float16", True)])
def test_backward_state_wide_compiles_to_wgmma_and_tma(H, HV, dtype, chained):
    """The full-width reverse pass (the backward's where its programs fill the SMs, its wide route included): its
    seven products on wgmma, the dh / dU / dV stores by TMA, its shared memory within a block's."""
    _tilelang()
    kernel = _kernel("backward_state_wide", H, HV, dtype, has_dht=True, store_dh0=True, chained=chained)
    src = kernel.get_kernel_source()
    _assert_hopper_paths(src)
    assert ("walk[" in src) == chained
    assert src.count("wgmma_ss") == 7
    assert all(f"tma_store({d}_desc" in src for d in ("dh", "du", "dv"))
    assert _dynamic_shared_bytes(kernel) + STATIC_SHARED <= SM90_BLOCK_SHARED


@pytest.mark.parametrize("H,HV,dtype,dinit", [(16, 32, "bfloat16", True), (4, 8, "float16", False)])
def test_backward_fused_compiles_to_wgmma_and_tma(H, HV, dtype, dinit):
    """The fused backward (the reverse pass with the per-chunk gradients): its eight tiles a chunk by TMA, every
    product on wgmma, dv and dk by TMA stores, four roles each with its register budget (setmaxnreg summing to 512
    a thread), no barrier under a thread subset, its shared memory within a block's."""
    _tilelang()
    from gdnkit.backends.tilelang_sm90 import backward_fused as bf
    kernel = _kernel("backward_fused", H, HV, dtype, has_dinit=dinit, store_dh0=True)
    src = kernel.get_kernel_source()
    _assert_hopper_paths(src)
    assert "mma_sync" not in src
    # owner 2, x 8 (dX twice; X comes from the recompute), p 5 (K K^T again; dq's dPD K; no
    # column-term products), g 6 (dq's dO S0^T; H K, and H^T K from the same tile, transposed)
    assert src.count("wgmma_ss<") == 21
    # K lands on a barrier of its own, each role waiting for it once before its first product with K
    assert src.count("k_loaded[0].wait(") == 4 and src.count("k_loaded[0].arrive()") == 2
    # one TMA store, a full chunk's dv; it and the tiles each program reads once carry L2's evict-first hint, Q and
    # K (both value heads of a key head read them) none (each tile loaded before the loop and in it)
    assert src.count("tma_store(") == 0 and src.count("tma_store<tl::CacheHintSm90::EVICT_FIRST>(dv_desc") == 1
    for d in ("do", "hs", "xv", "a", "tm"):
        assert src.count(f"tma_load<tl::CacheHintSm90::EVICT_FIRST>({d}_desc") == 2, d
    assert src.count("tma_load(q_desc") == src.count("tma_load(k_desc") == 2
    # dq's and dk's by the threads into their slots of S0's buffer, 16 bytes a store (group_sum.slot_offset): g's
    # dq term and dk, p's read of that term and its dq
    assert src.count("*(uint4*)(dqk + ") == 4 and "*(uint1*)(dqk + " not in src
    # a barrier in every step only of the owner's in-place scaling of dO (x's and p's passes compute in their
    # fragments and write their tiles by stmatrix: 64 such barriers a chunk would sit on x's chain)
    assert _element_loops_with_barriers(src) == 1 and src.count("stmatrix") >= 10
    for n in (bf.OWNER_REGS, bf.X_REGS, bf.P_REGS, bf.G_REGS):   # raised above the launch's 128 a thread, or lowered
        assert f"reg_{'alloc' if n > 128 else 'dealloc'}<{n}>" in src
    assert ("(dinit + " in src) == dinit
    # the two reductions across a warpgroup's rows (the owner's <S0, dS_end>, g's state-decay sum) both run on
    # hardware barriers 1 and 2 of 128 threads: g's waits for tot_ready, which the owner arrives after its own
    reductions = re.findall(r"AllReduce<tl::SumOp, 128, (\d+), (\d+), tl::NamedBarrier<128>>", src)
    assert sorted(reductions) == [("1", "0"), ("32", "384")], reductions
    # p's column sums (dgamma's column term) stay off those barriers: shuffles across a column's 8 lanes, 3 steps
    assert src.count("__shfl_xor_sync(") == 3
    assert src.count("tot_ready[0].wait") == 1
    assert src.index("tot_ready[0].wait") < src.index("AllReduce<tl::SumOp, 128, 32, 384")
    assert _dynamic_shared_bytes(kernel) + STATIC_SHARED <= SM90_BLOCK_SHARED


def test_fused_backward_rule_and_its_switch():
    """Which backward a training call runs on an H200 (132 SMs): the fused kernel where the work reaches
    fused_min_work chunks x value heads and no program (sequence, or segment of the wide route's cut) is much
    longer than the SMs' even share; the staged one elsewhere (points of benchmarks/results/h200/backward-paths.md,
    each on the side that measured faster), and the staged one where the forward kept S0.
    GDNKIT_SM90_FUSED_BACKWARD=1 / 0
    forces one (config.Config.fused_backward); any other value is refused with the variable named."""
    import itertools
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import plan
    from gdnkit.backends.tilelang_sm90.config import Config

    def pays(HV, *lengths, kept=False, cfg=Config()):
        layout = seqlayout.sequence_layout(torch.tensor([0, *itertools.accumulate(lengths)]))
        return plan.fused_pays(layout, HV, 132, cfg, stores_states=kept)
    assert pays(32, 8192)                                                   # 16/32: 1.18x the staged path
    # S0 kept by the forward (keep_states): the staged path reads it; the fused one would recompute it for X
    assert not pays(32, 8192, kept=True)
    assert pays(8, 820, 2829, 3666, 710, 988, 11940, 3347, 8468)            # 4/8: 1.02x
    assert pays(8, 8192)                                                    # 4/8: 1.09x
    assert pays(4, 32768)                                                   # 2/4: 1.18x
    assert not pays(4, 5239, 2953)                                          # 2/4: too little work (0.94x)
    assert not pays(8, 205, 708, 916, 178, 247, 2985, 836, 2117)            # 4/8: one long (0.62x)
    assert not pays(32, 205, 708, 4326, 2953)                               # 16/32: one long program (0.91x)
    assert not pays(16, 820, 2829, 3666, 710, 988, 11940, 3347, 8468)       # 8/16: 0.81x
    for forced in (True, False):
        cfg = Config(fused_backward=forced)
        assert pays(32, 8192, cfg=cfg) == forced and pays(1, 64, cfg=cfg) == forced
    for value, want in (("1", True), ("0", False), ("auto", None), ("", None)):
        assert Config.from_environment({"GDNKIT_SM90_FUSED_BACKWARD": value}).fused_backward is want
    with pytest.raises(ValueError, match="GDNKIT_SM90_FUSED_BACKWARD"):
        Config.from_environment({"GDNKIT_SM90_FUSED_BACKWARD": "yes"})


def test_recompute_programs_an_sm_and_their_switch():
    """Two programs an SM only for the fused path's recompute at 64 columns (the build that stores X and fits
    twice), GDNKIT_SM90_RECOMPUTE_PER_SM=1 for one, anything else refused by name."""
    from gdnkit.backends.tilelang_sm90.config import Config
    from gdnkit.backends.tilelang_sm90.plan import recompute_per_sm
    cfg = Config(recompute_per_sm=2)
    assert recompute_per_sm(64, True, cfg) == 2
    assert recompute_per_sm(32, True, cfg) == recompute_per_sm(64, False, cfg) == recompute_per_sm(128, False, cfg) == 1
    assert recompute_per_sm(64, True, Config(recompute_per_sm=1)) == 1
    for value in ("1", "2"):
        assert Config.from_environment({"GDNKIT_SM90_RECOMPUTE_PER_SM": value}).recompute_per_sm == int(value)
    with pytest.raises(ValueError, match="GDNKIT_SM90_RECOMPUTE_PER_SM"):
        Config.from_environment({"GDNKIT_SM90_RECOMPUTE_PER_SM": "3"})


@pytest.mark.parametrize("lengths,H,HV,dtype", [((77, 0, 130), 2, 8, torch.bfloat16), ((40,), 4, 4, torch.float16),
                                                 ((0,), 2, 4, torch.bfloat16), ((33, 64), 1, 3, torch.float32)])
def test_group_sums_add_each_key_heads_value_heads(lengths, H, HV, dtype):
    """The fused backward's GVA sums (group_sum.py; Triton, interpreted on a CPU) from dq / dk per chunk and value
    head: each token's rows from its chunk's slots (in the kernel's accumulator order, slot_offset: a permutation
    of the slot that rows_from_slot undoes), each key head's value heads added in fp32 and written in the
    gradients' dtype, within one unit in its last place of the float64 sum (the interpreter's casts truncate); a
    group of one is a copy; a tail chunk's rows past its sequence, whatever they hold, stay out of the output; the
    tokens past the last sequence are zero; no chunks, no launch; the same bits from finer runs (segments)."""
    pytest.importorskip("triton")
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90.group_sum import chunk_group_sums, rows_from_slot, slot_offset
    rr, jj = torch.meshgrid(torch.arange(64), torch.arange(K), indexing="ij")
    offsets = slot_offset(rr, jj)
    assert sorted(offsets.flatten().tolist()) == list(range(64 * K))
    assert torch.equal(rows_from_slot(torch.zeros(64 * K, dtype=torch.long).index_put_((offsets.flatten(),),
                                                                                      torch.arange(64 * K))),
                       torch.arange(64 * K).view(64, K))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    layout, total = seqlayout.sequence_layout(cu), int(cu[-1]) + 5
    dqk = torch.randn(layout.n_chunks, HV, 2, 64, K, generator=torch.Generator().manual_seed(len(lengths)))
    dqk = dqk.to(torch.bfloat16)
    dq, dk = chunk_group_sums(dqk, layout, H, total, dtype)
    rows = rows_from_slot(dqk.double().reshape(layout.n_chunks, HV, 2, 64 * K))
    want = torch.zeros(2, total, H, K, dtype=torch.float64)
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for t in range(bos, eos):
            c, row = int(layout.chunk_offsets[n]) + (t - bos) // 64, (t - bos) % 64
            want[:, t] = rows[c, :, :, row].view(H, HV // H, 2, K).sum(1).transpose(0, 1)
    assert dq.shape == dk.shape == (1, total, H, K) and dq.dtype == dk.dtype == dtype
    tol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-6}[dtype]
    for got, w in zip((dq, dk), want):
        assert torch.allclose(got[0].double(), w, rtol=tol, atol=tol)
    # the same from the fused kernel's runs cut finer (one chunk each, as segments): the same bits
    starts = [bos + 64 * w for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()) for w in range(-(-(eos - bos) // 64))]
    runs = (torch.tensor([*starts, int(cu[-1])], dtype=torch.int32),
            torch.arange(len(starts) + 1, dtype=torch.int32), 1)
    if starts:
        for got, again in zip((dq, dk), chunk_group_sums(dqk, layout, H, total, dtype, runs)):
            assert torch.equal(got, again)



@pytest.mark.parametrize("form", ["triton", "torch"])
@pytest.mark.parametrize("lengths,H,HV,dtype", [((77, 0, 130), 2, 8, torch.bfloat16), ((40,), 4, 4, torch.float16),
                                                 ((33, 64), 1, 3, torch.float32)])
def test_group_sums_take_the_qk_l2norm_backward(lengths, H, HV, dtype, form, bf16_interpreter, monkeypatch):
    """With the prologue's qk l2norm (use_qk_l2norm_in_kernel), the fused path's group sums leave dq / dk w.r.t.
    the raw q / k in their dtype: rstd (S - y (y . S)) of each token's summed slots S, y = x rstd made again
    from the raw rows, against the float64 sum and formula, in the Triton kernel (interpreted on a CPU) and its
    torch form; the tokens past the last sequence stay zero."""
    pytest.importorskip("triton")
    from gdnkit import prep, seqlayout
    from gdnkit.backends.tilelang_sm90 import group_sum
    if form == "torch":
        monkeypatch.setattr(group_sum, "triton_reads", lambda t: False)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    layout, total = seqlayout.sequence_layout(cu), int(cu[-1]) + 5
    gen = torch.Generator().manual_seed(len(lengths) + H)
    dqk = torch.randn(layout.n_chunks, HV, 2, 64, K, generator=gen).to(torch.bfloat16)
    raws = [torch.randn(1, total, H, K, generator=gen).to(dtype) for _ in range(2)]
    rstds = [torch.rsqrt((x.float() ** 2).sum(-1, keepdim=True) + prep.L2NORM_EPS) for x in raws]
    got = group_sum.chunk_group_sums(dqk, layout, H, total, dtype, None, (raws[0], rstds[0], raws[1], rstds[1]))
    rows = group_sum.rows_from_slot(dqk.double().reshape(layout.n_chunks, HV, 2, 64 * K))
    sums = torch.zeros(2, total, H, K, dtype=torch.float64)
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for t in range(bos, eos):
            c, row = int(layout.chunk_offsets[n]) + (t - bos) // 64, (t - bos) % 64
            sums[:, t] = rows[c, :, :, row].view(H, HV // H, 2, K).sum(1).transpose(0, 1)
    bound = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    for out, x, rstd, S in zip(got, raws, rstds, sums):
        assert out.shape == (1, total, H, K) and out.dtype == dtype
        y = x[0].double() * rstd[0].double()
        want = rstd[0].double() * (S - y * (y * S).sum(-1, keepdim=True))
        valid = int(cu[-1])
        err = float((out[0, :valid].double() - want[:valid]).norm() / want[:valid].norm().clamp_min(1e-300))
        assert err <= bound, err
        assert not out[0, valid:].any()

@pytest.mark.parametrize("H,HV,dtype", [(4, 8, "float16")])
def test_chunk_grads_compiles_to_wgmma_and_tma(H, HV, dtype):
    """The backward's per-chunk kernel: its ten tiles by TMA, every product on wgmma (21 call sites: 16
    products, the 64 x 128 ones split between the two warpgroups), no barrier under a thread subset; dq and dk
    in the inputs' dtype leave by TMA stores (fp32 ones, for the l2norm backward, by the threads)."""
    _tilelang()
    src = _source("chunk_grads", H, HV, dtype)
    _assert_hopper_paths(src)
    assert src.count("tma_load(") == 10
    assert src.count("wgmma_ss<") == 21 and "mma_sync" not in src
    assert "tma_store(" not in src
    assert _source("chunk_grads", H, HV, dtype, grads_dtype=dtype).count("tma_store(") == 2



# the largest build of each kernel the backends launch (K = V = 128; the wide V tiles and most stages)
@pytest.mark.parametrize("kind,H,HV,options", [
    ("chunk_grads", 4, 8, {}),
    ("backward_state", 16, 32, dict(has_dht=True, store_dh0=True, block_v=64)),
    ("intra_chunk", 2, 8, {}),
    ("state_output_narrow", 16, 64, dict(block_v=32, stages=3)),
    ("state_output_narrow", 16, 64, dict(block_v=64, stages=2)),
])
def test_kernels_fit_a_hopper_block_of_shared_memory(kind, H, HV, options):
    """Shared memory is checked where it is decided, at compile time on the CPU: a kernel over the per-block
    limit compiles and passes every source check here, then cannot launch on the GPU."""
    _tilelang()
    dtype = "float16" if kind == "chunk_grads" else "bfloat16"
    dynamic = _dynamic_shared_bytes(_kernel(kind, H, HV, dtype, **options))
    assert 4096 < dynamic, f"{kind}: implausible dynamic shared memory size {dynamic} (parsed wrongly?)"
    assert dynamic + STATIC_SHARED <= SM90_BLOCK_SHARED, \
        f"{kind} {options}: {dynamic} B dynamic + {STATIC_SHARED} B static > {SM90_BLOCK_SHARED} B per block"


@pytest.mark.parametrize("kind,options,desc", [
    ("intra_chunk", dict(emit_t=True), "tm_desc"),
    ("state_output_narrow", dict(block_v=64, stages=2, store_states=True), "hs_desc"),
    ("state_output_pipelined", dict(block_v=128, threads=256, store_states=True), "hs_desc"),
])
def test_training_forward_stores_t_and_states_by_tma(kind, options, desc):
    """A training forward also writes T (intra) and every chunk's entering state (both state kernels), each
    by TMA store; the inference builds leave both placeholders untouched."""
    _tilelang()
    src = _source(kind, 2, 8, "bfloat16", **options)
    _assert_hopper_paths(src)
    assert f"tma_store({desc}" in src
    plain = {n: v for n, v in options.items() if n not in ("emit_t", "store_states")}
    assert desc not in _source(kind, 2, 8, "bfloat16", **plain)


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


def test_supports_says_why_not():
    """CPU: what the backend takes (Hopper, K = V = 128, bf16/fp16 chunked, inference and training) and the
    reason it gives for everything else; auto dispatch prefers it on Hopper."""
    from gdnkit import dispatch
    from gdnkit.backends.tilelang_sm90 import BACKEND
    from gdnkit.problem import RECURRENT_MODE
    m = _hopper()
    assert BACKEND.reasons(_problem(), m) == []
    assert BACKEND.reasons(_problem(dtype=torch.float16, varlen=True, N=3), m) == []
    cases = {"needs a Hopper": BACKEND.reasons(_problem(), _hopper(capability=(10, 0))),
             "tilelang is not importable": BACKEND.reasons(_problem(), _hopper(tilelang=None)),
             "K = V = 128": BACKEND.reasons(_problem(K=64, V=64), m),
             "not bfloat16 or float16": BACKEND.reasons(_problem(dtype=torch.float32), m),
             "recurrent": BACKEND.reasons(_problem(mode=RECURRENT_MODE), m),
             "float32": BACKEND.reasons(_problem(has_initial_state=True, state_dtype=torch.bfloat16), m),
             "CUDA tensors": BACKEND.reasons(_problem(device_type="cpu", device_index=None), m)}
    for needle, reasons in cases.items():
        assert any(needle in r for r in reasons), (needle, reasons)
    assert dispatch.select(_problem(), machine=m)[1].chosen == "tilelang_sm90"
    assert BACKEND.reasons(_problem(needs_grad=True), m) == []
    assert dispatch.select(_problem(needs_grad=True), machine=m)[1].chosen == "tilelang_sm90"


def test_solve_algebra_float64():
    """T = (I + A)^-1 as the kernel forms it: Dinv from 16x16 forward substitutions, N = Dinv Aoff,
    T = (I - N)(I + N N) Dinv (exact: N is strictly block-lower with 4 blocks, so N^4 = 0)."""
    gen = torch.Generator().manual_seed(0)
    C, BLK = 64, 16
    k = F.normalize(torch.randn(C, 128, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(C, generator=gen, dtype=torch.float64)
    gamma = F.logsigmoid(torch.randn(C, generator=gen, dtype=torch.float64)).cumsum(0)
    i = torch.arange(C)
    strict = i[:, None] > i[None, :]
    D = torch.exp((gamma[:, None] - gamma[None, :]).masked_fill(~strict, float("-inf")))
    A = (beta[:, None] * (k @ k.T) * D).masked_fill(~strict, 0)

    same_block = (i[:, None] // BLK) == (i[None, :] // BLK)
    Dinv = torch.zeros(C, C, dtype=torch.float64)
    for b in range(C // BLK):  # one "thread" per column c: solve (I + A_bb) x = e_c
        blk = A[b * BLK:(b + 1) * BLK, b * BLK:(b + 1) * BLK]
        for c in range(BLK):
            col = torch.zeros(BLK, dtype=torch.float64)
            for r in range(BLK):
                col[r] = (1.0 if r == c else 0.0) - sum(blk[r, m] * col[m] for m in range(r))
            Dinv[b * BLK:(b + 1) * BLK, b * BLK + c] = col
    Aoff = A.masked_fill(same_block, 0)
    N = Dinv @ Aoff
    eye = torch.eye(C, dtype=torch.float64)
    Tm = (eye - N) @ (eye + N @ N) @ Dinv
    expected = torch.linalg.inv(eye + A)
    assert torch.allclose(Tm, expected, atol=1e-12, rtol=1e-10)


def _emulate(q, k, v, g, beta, h0, cu, scale):
    """The two kernels' dataflow in float64, tile by tile, including what the TMA boxes of a tail chunk
    read (the next sequence's rows, zeros past the tensor's end) and every select the kernels use."""
    C = 64
    _, T, H, Kd = k.shape
    HV, Vd = v.shape[2], v.shape[3]
    grp = HV // H

    def box(x, t0):  # a TMA box of 64 rows from row t0 of [1, T, ...]: zeros past the end
        out = x.new_zeros((C,) + tuple(x.shape[2:]))
        n = max(0, min(C, T - t0))
        out[:n] = x[0, t0:t0 + n]
        return out

    from gdnkit.seqlayout import sequence_layout
    layout = sequence_layout(cu)
    table, offsets = layout.chunk_indices.tolist(), layout.chunk_offsets.tolist()
    w = torch.full((1, T, HV, Kd), float("nan"), dtype=torch.float64)  # never-written rows are garbage
    u = torch.full((1, T, HV, Vd), float("nan"), dtype=torch.float64)
    gamma = torch.full((HV, len(table), C), float("nan"), dtype=torch.float64)  # one row per table entry
    i = torch.arange(C)
    for row, (seq, ic) in enumerate(table):
        bos, eos = int(cu[seq]), int(cu[seq + 1])
        t0 = bos + ic * C
        n_valid = min(eos - t0, C)
        valid = i < n_valid
        for hv in range(HV):
            kk, vv = box(k[:, :, hv // grp], t0), box(v[:, :, hv], t0)
            gs = torch.where(valid, box(g[:, :, hv], t0), 0.0).cumsum(0)
            bs = torch.where(valid, box(beta[:, :, hv], t0), 0.0)
            A = torch.where(i[:, None] > i[None, :], (kk @ kk.T) * bs[:, None] * torch.exp(gs[:, None] - gs[None, :]), 0.0)
            Tm = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)
            W = Tm @ (kk * (bs * gs.exp())[:, None])
            U = Tm @ (vv * bs[:, None])
            n = n_valid
            w[0, t0:t0 + n, hv], u[0, t0:t0 + n, hv], gamma[hv, row] = W[:n], U[:n], gs
    o = torch.zeros(1, T, HV, Vd, dtype=torch.float64)
    ht = torch.zeros(len(cu) - 1, HV, Kd, Vd, dtype=torch.float64)
    for seq in range(len(cu) - 1):
        bos, eos = int(cu[seq]), int(cu[seq + 1])
        for hv in range(HV):
            S = h0[seq, hv].clone()
            for ic in range(-(-(eos - bos) // C)):
                t0 = bos + ic * C
                n_valid = min(eos - t0, C)
                valid = i < n_valid
                qq, kk = box(q[:, :, hv // grp], t0), box(k[:, :, hv // grp], t0)
                ww, up = box(w[:, :, hv], t0), box(u[:, :, hv], t0)
                gs = gamma[hv, offsets[seq] + ic]
                Sb = S  # (the kernel rounds this to bf16)
                Un = torch.where(valid[:, None], up - ww @ Sb, 0.0)
                P = torch.where((i[:, None] >= i[None, :]) & valid[:, None], (qq @ kk.T) * torch.exp(gs[:, None] - gs[None, :]), 0.0)
                O = (qq @ Sb) * gs.exp()[:, None] + P @ Un
                o[0, t0:t0 + n_valid, hv] = (O * scale)[:n_valid]
                gl = gs[n_valid - 1]
                Ud = torch.where(valid[:, None], Un * torch.exp(gl - gs)[:, None], 0.0)
                S = S * gl.exp() + kk.T @ Ud
            ht[seq, hv] = S
    return o, ht


def test_kernel_dataflow_float64():
    """The kernels' tile dataflow (tail boxes reading the next sequence, selects, gamma rows per chunk, decay folded
    into U) reproduces the reference in float64: the masking argument of the kernels, checked on CPU."""
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.problem import CHUNK_MODE, validate_inputs

    H, HV, Kd, Vd = 1, 2, 16, 8
    cu = torch.tensor([0, 1, 65, 200, 200, 260])  # lengths 1, 64, 135, 0, 60; 3 tokens after the last
    T, N = 263, 5
    gen = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(1, T, H, Kd), dim=-1), F.normalize(r(1, T, H, Kd), dim=-1)
    v, g, beta = r(1, T, HV, Vd), F.logsigmoid(r(1, T, HV)) * 3, torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    h0 = r(N, HV, Kd, Vd)
    o, ht = _emulate(q, k, v, g, beta, h0, cu, Kd ** -0.5)
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu)
    ref_o, ref_ht = reference_forward(problem, inputs, chunked_gdn)
    assert torch.allclose(o[:, :260], ref_o[:, :260], atol=1e-10, rtol=1e-8)
    assert torch.allclose(ht, ref_ht, atol=1e-10, rtol=1e-8)


# ---------------------------------------------------------------------------------------------- GPU
K = V = 128
CU_SEQLENS = [0, 1, 65, 200, 333]  # lengths 1, 64, 135, 133: a 1-token sequence, a full chunk, chunk tails
BF16_FWD_BAR = 5e-3


def _rel(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    err = float((x - ref).norm() / ref.norm().clamp_min(1e-300))
    return err if err == err else float("inf")


@pytest.mark.gpu
@pytest.mark.parametrize("block_v", [None, 32, 64, 128], ids=["auto", "bv32", "bv64", "bv128"])
@pytest.mark.parametrize("H,HV", [(2, 8), (16, 64)])
def test_forward_matches_float64_reference(H, HV, block_v, monkeypatch, sm90_config):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    sm90_config(block_v=block_v)
    forward = fwd.forward

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(H * 100 + HV)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    T = CU_SEQLENS[-1]
    N = len(CU_SEQLENS) - 1
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    g = F.logsigmoid(r(1, T, HV))
    beta = torch.sigmoid(r(1, T, HV))
    if HV == 64:  # contiguous views starting one element into a buffer: the kernels' TMA boxes need aligned bases
        q, v = (torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape) for x in (q, v))
        assert q.data_ptr() % 16 and v.data_ptr() % 16
    h0 = r(N, HV, K, V) * 0.1
    cu = torch.tensor(CU_SEQLENS, device=dev, dtype=torch.long)

    with torch.no_grad():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0,
                                          output_final_state=True, cu_seqlens=cu)
        o, ht, _ = forward(problem, inputs)
        torch.cuda.synchronize()
        d = lambda t: t.double()  # noqa: E731 - float64 truth on the same (bf16-rounded) values
        problem64, inputs64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                                              output_final_state=True, cu_seqlens=cu)
        ref_o, ref_ht = reference_forward(problem64, inputs64, chunked_gdn)

    assert o.shape == v.shape and o.dtype == v.dtype
    assert ht.shape == h0.shape and ht.dtype == torch.float32
    assert _rel(o, ref_o) <= BF16_FWD_BAR, f"o: {_rel(o, ref_o):.2e}"
    assert _rel(ht, ref_ht) <= BF16_FWD_BAR, f"final state: {_rel(ht, ref_ht):.2e}"
    # per sequence too: a wrong tail chunk or a lost initial state hides in the global norm
    for n in range(N):
        s, e = CU_SEQLENS[n], CU_SEQLENS[n + 1]
        assert _rel(o[:, s:e], ref_o[:, s:e]) <= BF16_FWD_BAR, f"o of sequence {n}: {_rel(o[:, s:e], ref_o[:, s:e]):.2e}"
        assert _rel(ht[n], ref_ht[n]) <= BF16_FWD_BAR, f"final state {n}: {_rel(ht[n], ref_ht[n]):.2e}"
    # deterministic: a second call gives identical bits
    o2, ht2, _ = forward(problem, inputs)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


@pytest.mark.gpu
def test_forward_wide_route_in_waves_matches_float64_reference():
    """The wide route in several waves (context_parallel.wide_waves_segment_chunks): 4/48 with one long and one
    short sequence (96 pairs fill the SMs, the long one bounds the plain pass) in 64-chunk segments, two waves of
    the H200's SMs; with initial states, a tail chunk, gates that settle (the device picks the segments); every
    sequence's output and final state against float64, and the call twice bitwise."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    pytest.importorskip("triton")
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    H, HV, lengths, dev = 4, 48, (16384, 1000), "cuda"
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    p = fwd.plan_of(types.SimpleNamespace(HV=HV, needs_grad=False), fwd.seqlayout.sequence_layout(cu),
                    torch.device(dev))
    seg, waves = p.segment_chunks, p.waves
    if waves < 2:
        pytest.skip(f"this GPU's SM count gives {waves} wave(s) here (the H200's 132 give 2)")
    T, N = int(cu[-1]), len(lengths)
    gen = torch.Generator(device=dev).manual_seed(48)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    v, g, beta = r(1, T, HV, V).to(torch.bfloat16), F.logsigmoid(r(1, T, HV)), torch.sigmoid(r(1, T, HV))
    h0 = r(N, HV, K, V) * 0.1
    with torch.no_grad():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu)
        got = {}
        o, ht, _ = fwd.forward(problem, inputs, intermediates=got)
        o2, ht2, _ = fwd.forward(problem, inputs)
        d = lambda t: t.double()  # noqa: E731
        p64, i64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                                   output_final_state=True, cu_seqlens=cu)
        ref_o, ref_ht = reference_forward(p64, i64, chunked_gdn)
    assert got["wide_segments"] and bool(got["wide_choice"])
    for n in range(N):
        s, e = int(cu[n]), int(cu[n + 1])
        assert _rel(o[:, s:e], ref_o[:, s:e]) <= BF16_FWD_BAR, f"o of sequence {n}: {_rel(o[:, s:e], ref_o[:, s:e]):.2e}"
        assert _rel(ht[n], ref_ht[n]) <= BF16_FWD_BAR, f"final state {n}: {_rel(ht[n], ref_ht[n]):.2e}"
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


@pytest.mark.gpu
def test_intra_chunk_stage_matches_reference_trace(monkeypatch, sm90_config):
    """The intra-chunk kernel alone (gamma, Tb = T diag(beta)) against the reference's ChunkTrace, one dense
    sequence of 135 tokens (a chunk tail of 7): tells an intra-chunk bug from a state-pass bug. The
    context-parallel path runs the same kernel."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit.backends.reference.chunked import to_chunks, chunked_gdn
    from gdnkit.backends.tilelang_sm90 import context_parallel
    from gdnkit.backends.tilelang_sm90.forward import forward
    from gdnkit.problem import CHUNK_MODE, validate_inputs

    H, HV, T = 2, 8, 135
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    g = F.logsigmoid(r(1, T, HV))
    beta = torch.sigmoid(r(1, T, HV))
    with torch.no_grad():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta)
        got, got_cp = {}, {}
        forward(problem, inputs, intermediates=got)
        sm90_config(segment_chunks=1)
        forward(problem, inputs, intermediates=got_cp)
        torch.cuda.synchronize()
        rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
        _, _, trace = chunked_gdn(rep(q), rep(k), v.double(), g.double(), beta.double(), problem.scale)
    per_token = lambda x: x.movedim(1, 3).reshape(1, -1, HV, x.shape[-1])[:, :T]  # noqa: E731
    gamma_ref = trace.gamma.reshape(1, HV, -1)[0, :, :T]
    assert _rel(got["gamma"][:, :T], gamma_ref) <= 1e-5, f"gamma: {_rel(got['gamma'][:, :T], gamma_ref):.2e}"
    tb_ref = per_token(trace.T * to_chunks(beta.double(), trace.T.shape[2], 64).unsqueeze(-2))
    assert _rel(got["a"], tb_ref) <= 1e-2, f"Tb: {_rel(got['a'], tb_ref):.2e}"
    assert torch.equal(got["a"], got_cp["a"]) and torch.equal(got["gamma"], got_cp["gamma"])


@pytest.mark.gpu
def test_public_api_fp16_options_and_trailing_tokens():
    """Through gdnkit.chunk_gated_delta_rule with backend="tilelang_sm90": fp16, the options run as the
    PyTorch prologue (qk l2norm, gate from A_log/dt_bias, beta sigmoid), state_v_first, and tokens past
    cu_seqlens[-1], whose output must be exactly zero."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    import gdnkit

    dev, H, HV, T = "cuda", 4, 16, 300
    cu = torch.tensor([0, 7, 150, 290], device=dev, dtype=torch.int32)  # 10 trailing tokens
    gen = torch.Generator(device=dev).manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    call = dict(q=r(1, T, H, K).half(), k=r(1, T, H, K).half(), v=r(1, T, HV, V).half(), g=r(1, T, HV),
                beta=r(1, T, HV), initial_state=r(3, HV, V, K) * 0.1, output_final_state=True, cu_seqlens=cu,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=r(HV) * 0.5, dt_bias=r(HV),
                use_beta_sigmoid_in_kernel=True, state_v_first=True)
    with torch.no_grad():
        o, ht = gdnkit.chunk_gated_delta_rule(**call, backend="tilelang_sm90")
        d = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in call.items()}
        ref_o, ref_ht = gdnkit.chunk_gated_delta_rule(**d, backend="reference")
    assert o.dtype == torch.float16 and ht.shape == (3, HV, V, K)
    assert _rel(o[:, :290], ref_o[:, :290]) <= BF16_FWD_BAR, f"o: {_rel(o[:, :290], ref_o[:, :290]):.2e}"
    assert _rel(ht, ref_ht) <= BF16_FWD_BAR, f"final state: {_rel(ht, ref_ht):.2e}"
    assert o[:, 290:].abs().max() == 0


# ------------------------------------------- forward()'s host side on a CPU, the kernels replaced by stand-ins
@pytest.mark.gpu
def test_intra_chunk_bound_matches_the_walks_search():
    """The intra kernel's emit_bound (the walks' chunk sums, lead_in.py's bound per chunk-table row and value head)
    against the search's own sums (lead_in_bound._row_bounds_kernel, float64) on a varlen batch with chunk tails,
    GVA and beta up to 2 (so |1 - beta ||k||^2| > 1 on some tokens); Tb and gamma as without it."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    pytest.importorskip("triton")
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import lead_in_bound
    from gdnkit.backends.tilelang_sm90.forward import intra_chunk_kernel

    H, HV, dev = 2, 8, "cuda"
    cu_host = [0, 1, 65, 200, 333, 1000]
    T = cu_host[-1]
    gen = torch.Generator(device=dev).manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    k = (F.normalize(r(1, T, H, K), dim=-1) * 1.3).to(torch.bfloat16)
    g = F.logsigmoid(r(1, T, HV)) * 0.2
    beta = 2 * torch.rand(1, T, HV, generator=gen, device=dev)
    layout = seqlayout.sequence_layout(torch.tensor(cu_host, device=dev))
    n = layout.n_chunks
    outs = []
    for emit in (False, True):
        a = torch.full((1, T, HV, 64), float("nan"), device=dev, dtype=torch.bfloat16)
        gamma = torch.full((HV, n, 64), float("nan"), device=dev)
        bound = torch.full((n, HV), float("nan"), device=dev) if emit else torch.empty(1, 1, device=dev)
        tm = torch.empty(1, 1, 1, 1, device=dev, dtype=torch.bfloat16)
        intra_chunk_kernel(H, HV, "bfloat16", False, emit)(k, g, beta, layout.cu_seqlens, layout.chunk_indices, a,
                                                          gamma, tm, bound)
        outs.append((a, gamma, bound))
    torch.cuda.synchronize()
    (a0, g0, _), (a1, g1, got) = outs
    assert torch.equal(a0[:, :T], a1[:, :T]) and torch.equal(g0, g1)   # the bound changes nothing else
    want = torch.empty(n, HV, dtype=torch.float64, device=dev)
    starts = torch.tensor([s for a_, b_ in zip(cu_host[:-1], cu_host[1:]) for s in range(a_, b_, 64)], device=dev)
    ends = torch.tensor([min(s + 64, b_) for a_, b_ in zip(cu_host[:-1], cu_host[1:]) for s in range(a_, b_, 64)],
                        device=dev)
    walked = torch.ones(n, dtype=torch.int8, device=dev)
    lead_in_bound._row_bounds_kernel[(n, H)](g, k, beta, starts, ends, walked, want, T, H=H, HV=HV, K=K, GP=4, KP=K,
                                            num_warps=4)
    assert not got.isnan().any()
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-4), (got.double() - want).abs().max()


def _intra_stand_in(k, g, beta, cu, table, a, gamma, tm, bound):
    """What the intra-chunk kernel writes (its contract, in float64): gamma per chunk row, Tb = T diag(beta)
    rows, T's rows into tm and the walks' chunk sums into bound unless each is the 1-element placeholder."""
    grp = g.shape[2] // k.shape[2]
    for row, (seq, ic) in enumerate(table.tolist()):
        t0 = int(cu[seq]) + ic * 64
        n = min(int(cu[seq + 1]) - t0, 64)
        for hv in range(g.shape[2]):
            kk = k[0, t0:t0 + n, hv // grp].double()
            gs, bs = g[0, t0:t0 + n, hv].double().cumsum(0), beta[0, t0:t0 + n, hv].double()
            i = torch.arange(n)
            A = torch.where(i[:, None] > i[None, :], (kk @ kk.T) * bs[:, None] * torch.exp(gs[:, None] - gs[None, :]), 0.0)
            Tm = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + A)
            a[0, t0:t0 + n, hv] = torch.nn.functional.pad(Tm * bs[None, :], (0, 64 - n)).to(a.dtype)
            if tm.numel() > 1:
                tm[0, t0:t0 + n, hv] = torch.nn.functional.pad(Tm, (0, 64 - n)).to(tm.dtype)
            gamma[hv, row, :n] = gs.float()
            gamma[hv, row, n:] = gs[-1].float()
            if bound.numel() > 1:   # lead_in.py's bound: g_t + log max(1, |1 - beta_t ||k_t||^2|) summed
                kn = (kk * kk).sum(1)
                bound[row, hv] = (gs[-1] + torch.log(torch.clamp((1 - bs * kn).abs(), min=1.0)).sum()).float()


def test_wide_route_picked_by_the_longest_walk():
    """16/64 1x32768 cut in two: a walk of a chunk keeps the wide route (257 wide steps against 512 64-column
    ones), a slow head's 175-chunk walk sends it to the pass without segments (431 x 1.45 > 512); each pass gets
    its cu_seqlens (and the wide one its walks) as they are where it is picked, zeros where not."""
    pytest.importorskip("triton")
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import context_parallel
    layout = seqlayout.sequence_layout(torch.tensor([0, 32768]))
    plan = context_parallel.plan_segments(layout, 256)
    assert plan.own.tolist() == [256, 256]
    settle = torch.tensor([[0] * 64, [1] * 64], dtype=torch.int32)
    slow = settle.clone()
    slow[1, 5] = 175
    for walk, wide in ((settle, True), (slow, False)):
        wide_cu, wide_walk, plain_cu, choice = context_parallel.pick(plan, walk, layout)
        assert bool(choice) == wide and choice.dtype == torch.bool and choice.dim() == 0
        assert torch.equal(wide_cu, plan.segments.cu_seqlens if wide else torch.zeros_like(wide_cu))
        assert torch.equal(wide_walk, walk if wide else torch.zeros_like(walk))
        assert torch.equal(plain_cu, torch.zeros_like(plain_cu) if wide else layout.cu_seqlens)


def test_wide_route_in_waves_picked_by_the_longest_walk():
    """16/48 with 28672 + 4096 tokens in 64-chunk segments: 8 x 48 programs in three waves of the SMs, each wave
    as long as its longest program, against the plain pass at 128 columns (one wide step for one): a walk of a
    chunk keeps the segments (3 x 65 steps against 448), a slow head's 100-chunk walk does not (3 x 164)."""
    pytest.importorskip("triton")
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import context_parallel
    layout = seqlayout.sequence_layout(torch.tensor([0, 28672, 32768]))
    plan = context_parallel.plan_segments(layout, 64)
    assert plan.own.tolist() == [64] * 8
    settle = torch.ones(8, 48, dtype=torch.int32)
    slow = settle.clone()
    slow[3, 7] = 100
    for walk, wide in ((settle, True), (slow, False)):
        *_, choice = context_parallel.pick(plan, walk, layout, waves=3)
        assert bool(choice) == wide
    # in one wave (against the 64-column pass) the same segments are cheaper than its 448 steps even slow
    assert bool(context_parallel.pick(plan, slow, layout, waves=1)[-1])


@pytest.mark.parametrize("waves", [1, 3])
@pytest.mark.parametrize("picked", ["wide", "plain"])
@pytest.mark.parametrize("lengths,state", [([700], False), ([130, 0, 451, 3], True)], ids=["one-long", "varlen-state"])
def test_wide_route_choice_host_side(lengths, state, picked, waves, monkeypatch, sm90_config):
    """With the wide route the forward launches both its pass over segments and the pass without segments (at 64
    columns beside one wave of segments, at 128 beside several), and the device picks one (context_parallel.pick):
    the other runs over empty sequences. Either pick gives the plain path's output and final states (float64
    stand-ins of the kernels)."""
    pytest.importorskip("triton")
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import context_parallel
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    sm90_config(block_v=None)
    calls = []
    _stand_in_forward_kernels(monkeypatch, fwd, calls)
    sm90_config(segment_chunks=None)
    # the wide route, on a CPU: 2-chunk segments in one wave or in several
    sm90_config(wide_segment_chunks=2 if waves == 1 else 0, wide_waves_segment_chunks=(2, waves))
    ratio = "wide_step_ratio" if waves == 1 else "waves_step_ratio"
    sm90_config(**{ratio: 0.0 if picked == "wide" else 1e9})
    launched = []   # per state-pass launch: (chained, whether any of its sequences has a token)
    block_vs = []   # the unchained (plain) pass's V tile
    factory = fwd.state_output_kernel

    def recording(*args):
        kernel, chained = factory(*args), args[8]
        if not chained:
            block_vs.append(args[5])
        return lambda *a: launched.append((chained, bool(a[5].diff().any()))) or kernel(*a)
    monkeypatch.setattr(fwd, "state_output_kernel", recording)

    gen = torch.Generator().manual_seed(3)
    H, HV, T, N = 1, 2, sum(lengths) + 5, len(lengths)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).half()
    k = F.normalize(r(1, T, H, K), dim=-1).half()
    v, g = r(1, T, HV, V).half(), F.logsigmoid(r(1, T, HV)) * torch.tensor((3.0, 1e-3))   # one head barely decays
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = r(N, HV, K, V) * 0.1 if state else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu)
    got = {}
    o, ht, _ = fwd.forward(problem, inputs, intermediates=got)
    assert got["context_parallel"] == "chained" and got["wide_segments"]
    assert bool(got["wide_choice"]) == (picked == "wide")
    assert sorted(launched) == sorted([(True, picked == "wide"), (False, picked == "plain")]), launched
    assert block_vs == [64 if waves == 1 else 128]
    d = lambda t: None if t is None else t.double()  # noqa: E731
    p64, i64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                               output_final_state=True, cu_seqlens=cu)
    ref_o, ref_ht = reference_forward(p64, i64, chunked_gdn)
    assert _rel(o, ref_o) < 2e-3 and _rel(ht, ref_ht) < 1e-3
    assert o[:, sum(lengths):].abs().max() == 0
    _assert_in_family(calls, H, HV, "float16", training=False)


def _state_stand_in(has_h0, store_ht, store_states=False, emit_output=True, chained=False, store_x=False):
    """What the state/output kernel writes: O rows of every sequence (of cu) if emit_output, final states if
    asked, every chunk's entering state (bf16) if store_states, and with store_x each chunk's X = V - diag(Gamma)
    K S0 into o's argument (the rows of its sequences). chained: each program first walks walk[n, hv]
    chunks before its segment from zero, or from its h0 row where that reaches the sequence's start
    (walk == before[n]), writing only its own chunks."""
    def run(q, k, a, v, gamma, cu, chunk_offsets, h0, o, ht, scale, hs, walk=None, before=None):
        assert not chained or walk.shape[0] == cu.numel() - 1   # else placeholders the kernel never reads
        grp = v.shape[2] // k.shape[2]
        for n in range(cu.numel() - 1):
            bos, eos, c0 = int(cu[n]), int(cu[n + 1]), int(chunk_offsets[n])
            for hv in range(v.shape[2]):
                pre = int(walk[n, hv]) if chained else 0
                exact = not chained or pre == int(before[n])
                run_bos, run_c0 = bos - 64 * pre, c0 - pre
                S = h0[n, hv].double() if has_h0 and exact else torch.zeros(k.shape[-1], v.shape[-1], dtype=torch.float64)
                for ic in range(pre + -(-(eos - bos) // 64)):
                    t0 = run_bos + ic * 64
                    m = min(eos - t0, 64)
                    qq, kk = q[0, t0:t0 + m, hv // grp].double(), k[0, t0:t0 + m, hv // grp].double()
                    tb, vv = a[0, t0:t0 + m, hv, :m].double(), v[0, t0:t0 + m, hv].double()
                    gs = gamma[hv, run_c0 + ic, :m].double()
                    own = ic >= pre
                    if store_states and own:
                        hs[run_c0 + ic, hv] = S.to(hs.dtype)
                        S = S.to(hs.dtype).double()  # the kernels' S0 operands are bf16 too
                    i = torch.arange(m)
                    X = vv - gs.exp()[:, None] * (kk @ S)
                    if store_x and own:
                        o[0, t0:t0 + m, hv] = X.to(o.dtype)
                    U = tb @ X
                    P = torch.where(i[:, None] >= i[None, :], (qq @ kk.T) * torch.exp(gs[:, None] - gs[None, :]), 0.0)
                    if emit_output and own:
                        o[0, t0:t0 + m, hv] = (scale * ((qq @ S) * gs.exp()[:, None] + P @ U)).to(o.dtype)
                    S = S * gs[-1].exp() + kk.T @ (U * torch.exp(gs[-1] - gs)[:, None])
                if store_ht:
                    ht[n, hv] = S.float()
    return run


def _propagator_stand_in(k, a, v, gamma, cu, chunk_offsets, aug, gate):
    """What the propagator writes per segment (of cu): [E | P], the chain S -> Gamma_C S + K^T diag(Gamma_C /
    Gamma) Tb (V - diag(Gamma) K S) run from zeros with V (E), and from the identity with V = 0 (P); nothing
    for a (segment, head) whose gate holds 0 (gate [rows, HV]: row n, or its last row)."""
    grp = a.shape[2] // k.shape[2]
    Kd, Vd = k.shape[-1], v.shape[-1]
    for n in range(cu.numel() - 1):
        bos, eos, c0 = int(cu[n]), int(cu[n + 1]), int(chunk_offsets[n])
        for hv in range(a.shape[2]):
            if int(gate[min(n, gate.shape[0] - 1), hv]) == 0:
                continue
            S = torch.cat([torch.zeros(Kd, Vd, dtype=torch.float64), torch.eye(Kd, dtype=torch.float64)], dim=1)
            for ic in range(-(-(eos - bos) // 64)):
                t0 = bos + ic * 64
                m = min(eos - t0, 64)
                kk, vv = k[0, t0:t0 + m, hv // grp].double(), v[0, t0:t0 + m, hv].double()
                tb = a[0, t0:t0 + m, hv, :m].double()
                gs = gamma[hv, c0 + ic, :m].double()
                rhs = torch.cat([vv, torch.zeros(m, Kd, dtype=torch.float64)], dim=1)
                U = tb @ (rhs - gs.exp()[:, None] * (kk @ S))
                S = S * gs[-1].exp() + kk.T @ (U * torch.exp(gs[-1] - gs)[:, None])
            aug[n, hv] = S.float()


def _backward_state_stand_in(has_dht, store_dh0, chained=False, ds_only=False):
    """What the backward's reverse pass writes: per chunk its dS_end (bf16, also the operand the chain uses),
    dU and dX rows, and dh0; nothing for a (segment, head) whose gate holds 0 (as the propagator's). chained: each
    program first walks walk[n, hv] chunks after its segment, last first, from zero, or from its dht row where
    that reaches the sequence's end (walk == after[n]; the walk then ends at seq_end[n]), writing only its own
    chunks. ds_only: dh0 alone is written (du, dv and dh are (1, 1, 1, 1) stubs); chained, the run is the walk
    alone, from the segment's end."""
    def run(q, k, a, do, gamma, cu, chunk_offsets, dht, du, dv, dh, dh0, scale, gate, walk, after, seq_end):
        n_prog = cu.numel() - 1
        assert not chained or walk.shape[0] == n_prog   # else placeholders the kernel never reads
        assert not ds_only or du.shape == dv.shape == dh.shape == (1, 1, 1, 1)
        grp = a.shape[2] // k.shape[2]
        for n in range(n_prog):
            bos, c0, own_end = int(cu[n]), int(chunk_offsets[n]), int(chunk_offsets[n + 1])
            if chained and ds_only:
                bos, c0 = int(cu[n + 1]), own_end
            for hv in range(a.shape[2]):
                if int(gate[min(n, gate.shape[0] - 1), hv]) == 0:
                    continue
                post = int(walk[n, hv]) if chained else 0
                exact = not chained or post == int(after[n])
                eos = int(seq_end[n]) if chained and exact else int(cu[n + 1]) + 64 * post
                end = own_end + post
                dS = dht[n, hv].double() if has_dht and exact else torch.zeros(k.shape[-1], do.shape[-1], dtype=torch.float64)
                for ic in reversed(range(end - c0)):
                    own = c0 + ic < own_end and not ds_only
                    t0 = bos + ic * 64
                    m = min(eos - t0, 64)
                    qq, kk = q[0, t0:t0 + m, hv // grp].double(), k[0, t0:t0 + m, hv // grp].double()
                    tb, dO = a[0, t0:t0 + m, hv, :m].double(), do[0, t0:t0 + m, hv].double()
                    gs = gamma[hv, c0 + ic, :m].double()
                    if own:
                        dh[c0 + ic, hv] = dS.to(dh.dtype)
                    i = torch.arange(m)
                    P = torch.where(i[:, None] >= i[None, :], (qq @ kk.T) * torch.exp(gs[:, None] - gs[None, :]), 0.0)
                    dU = scale * P.T @ dO + torch.exp(gs[-1] - gs)[:, None] * (kk @ dS.to(q.dtype).double())
                    dX = tb.T @ dU
                    if own:
                        du[0, t0:t0 + m, hv], dv[0, t0:t0 + m, hv] = dU.to(du.dtype), dX.to(dv.dtype)
                    dS = (scale * qq.T @ (gs.exp()[:, None] * dO) + gs[-1].exp() * dS
                          - kk.T @ (gs.exp()[:, None] * dX))
                if store_dh0:
                    dh0[n, hv] = dS.float()
    return run


def _grads_in(grads_dt: str):
    """The stand-in for a chunk_grads build that writes dq / dk in grads_dt: the buffers handed to it must be
    of that dtype (the inputs' without l2norm in the kernel, fp32 with it)."""
    def kernel(*args):
        dq, dk = args[14], args[15]
        assert str(dq.dtype) == f"torch.{grads_dt}" and dk.dtype == dq.dtype, (dq.dtype, grads_dt)
        return _chunk_grads_stand_in(*args)
    return kernel


def _chunk_grads_stand_in(q, k, v, do, du, dx, tb, tm, gamma, beta, h, dh, cu, table, dq, dk, dg, dbeta, scale):
    """What the per-chunk gradient kernel writes: the reference's chunk_local_grads on each chunk's rows, dq and
    dk summed over each key head's value heads in value head order."""
    from gdnkit.backends.reference.chunked_backward import chunk_local_grads
    grp = v.shape[2] // k.shape[2]
    for row, (seq, ic) in enumerate(table.tolist()):
        t0 = int(cu[seq]) + ic * 64
        m = min(int(cu[seq + 1]) - t0, 64)
        for hk in range(k.shape[2]):
            sums = [0.0, 0.0]
            for hv in range(hk * grp, (hk + 1) * grp):
                rows = lambda x: x[0, t0:t0 + m, hv].double()  # noqa: E731
                qq, kk = q[0, t0:t0 + m, hk].double(), k[0, t0:t0 + m, hk].double()
                got = chunk_local_grads(qq, kk, rows(v), rows(do), rows(beta), gamma[hv, row, :m].double(),
                                        tm[0, t0:t0 + m, hv, :m].double(), h[row, hv].double(), rows(du), rows(dx),
                                        dh[row, hv].double(), scale)
                sums = [sums[0] + got[0], sums[1] + got[1]]
                dg[0, t0:t0 + m, hv], dbeta[0, t0:t0 + m, hv] = got[2].float(), got[3].float()
            dq[0, t0:t0 + m, hk], dk[0, t0:t0 + m, hk] = sums[0].float(), sums[1].float()


def _backward_fused_stand_in(has_dinit, store_dh0):
    """What the fused backward writes per (sequence or segment, value head), chunks last to first from its dinit
    row (or zero): the reverse pass's chain (dS_end rounded to bf16 as the kernel hands it over) and each chunk's
    chunk_local_grads, dq and dk per chunk and value head into dqk (S0's buffer: a chunk's slot written after its
    S0 is read; all 64 rows of each in group_sum.slot_offset's order), dh0 at the run's start. It reads each
    chunk's X (xv: dv's buffer, from the recompute) before it writes that chunk's dV there."""
    from gdnkit.backends.reference.chunked_backward import chunk_local_grads
    from gdnkit.backends.tilelang_sm90.group_sum import slot_offset

    def run(q, k, xv, do, a, tm, hs, gamma, beta, cu, chunk_offsets, dinit, dqk, dv, dg, dbeta, dh0, scale):
        assert xv.data_ptr() == dv.data_ptr()   # X costs no memory of its own
        rr, jj = torch.meshgrid(torch.arange(64), torch.arange(k.shape[-1]), indexing="ij")
        slot = slot_offset(rr, jj).flatten()
        grp = xv.shape[2] // k.shape[2]
        for n in range(cu.numel() - 1):
            bos, eos, c0 = int(cu[n]), int(cu[n + 1]), int(chunk_offsets[n])
            for hv in range(xv.shape[2]):
                dS = dinit[n, hv].double() if has_dinit else torch.zeros(k.shape[-1], xv.shape[-1], dtype=torch.float64)
                for ic in reversed(range(-(-(eos - bos) // 64))):
                    t0 = bos + ic * 64
                    m = min(eos - t0, 64)
                    rows = lambda x: x[0, t0:t0 + m, hv].double()  # noqa: E731
                    qq, kk = q[0, t0:t0 + m, hv // grp].double(), k[0, t0:t0 + m, hv // grp].double()
                    gs, dO = gamma[hv, c0 + ic, :m].double(), rows(do)
                    dse = dS.to(xv.dtype).double()
                    i = torch.arange(m)
                    P = torch.where(i[:, None] >= i[None, :], (qq @ kk.T) * torch.exp(gs[:, None] - gs[None, :]), 0.0)
                    dU = scale * P.T @ dO + torch.exp(gs[-1] - gs)[:, None] * (kk @ dse)
                    dX = a[0, t0:t0 + m, hv, :m].double().T @ dU
                    # chunk_local_grads makes X from V: V is given as X + diag(Gamma) K S0 (float64)
                    s0 = hs[c0 + ic, hv].double()
                    vv = rows(xv) + gs.exp()[:, None] * (kk @ s0)
                    got = chunk_local_grads(qq, kk, vv, dO, rows(beta), gs, tm[0, t0:t0 + m, hv, :m].double(),
                                            s0, dU, dX, dse, scale)
                    dqdk = torch.zeros(2, 64, k.shape[-1], dtype=torch.float64)   # all 64 rows, the kernel's order
                    dqdk[:, :m] = torch.stack(got[:2])
                    dqk[c0 + ic, hv].view(2, -1)[:, slot] = dqdk.flatten(1).to(dqk.dtype)
                    dg[0, t0:t0 + m, hv], dbeta[0, t0:t0 + m, hv] = got[2].float(), got[3].float()
                    dv[0, t0:t0 + m, hv] = dX.to(dv.dtype)
                    dS = (scale * qq.T @ (gs.exp()[:, None] * dO) + gs[-1].exp() * dS
                          - kk.T @ (gs.exp()[:, None] * dX))
                if store_dh0:
                    dh0[n, hv] = dS.float()
    return run


def _recorded(calls: list, name: str, factory):
    """A kernel factory stand-in that records (name, its arguments): checked against precompile.family."""
    def record(*args):
        bound = inspect.signature(factory).bind(*args)
        bound.apply_defaults()   # the lru cache's key: a defaulted flag spelt out is the same kernel
        calls.append((name, tuple(bound.arguments.values())))
        return factory(*args)
    return record


def _stand_in_forward_kernels(monkeypatch, fwd, calls: list) -> None:
    monkeypatch.setattr(fwd, "intra_chunk_kernel", _recorded(calls, "intra_chunk_kernel",
                                                             lambda H, HV, dt, emit_t=False, emit_bound=False: _intra_stand_in))
    monkeypatch.setattr(fwd, "state_output_kernel", _recorded(
        calls, "state_output_kernel",
        lambda H, HV, dt, has_h0, store_ht, bv, store_states=False, emit_output=True, chained=False, store_x=False,
        per_sm=1: _state_stand_in(has_h0, store_ht, store_states, emit_output, chained, store_x)))


def _assert_in_family(calls: list, H: int, HV: int, dtype: str, training: bool) -> None:
    """Every kernel the call asked for is one `python -m gdnkit warm` builds ahead (precompile.family)."""
    from gdnkit.backends.tilelang_sm90 import precompile
    family = {(job.factory, job.args) for job in precompile.family(H, HV, dtype, training)}
    assert calls and set(calls) <= family, set(calls) - family


@pytest.mark.parametrize("case", ["dense", "varlen-gva-options", "segments", "segments-weak-gates", "segments-mixed-gates",
                                  "segments-chained", "segments-chained-mixed-gates", "segments-exact",
                                  "fused-dense", "fused-varlen-gva-options", "fused-segments",
                                  "fused-segments-weak-gates", "fused-segments-mixed-gates",
                                  "segments-wide-mixed-gates", "fused-segments-wide-mixed-gates",
                                  "fused-segments-wide-plain-mixed-gates"])
def test_backward_host_side_with_kernel_stand_ins(case, monkeypatch, sm90_config, poisoned_empty):
    """The sm90 training path around its four launches, on a CPU: the forward keeps T (every chunk's state only
    with keep_states; the backward recomputes them), the backward hands them with dS_end, dU and dX from the
    reverse pass to the per-chunk kernel, sums dq/dk over GVA's value heads and undoes the options' prologue.
    With segments (context parallelism) each segment's dS_end comes from: the gated route (a fixed lead-in over
    the chunks after it, the exact route behind it, run for the pairs the device flags: gates that settle,
    gates that barely decay, and one head of each), the chained route (where the exact route does not pay: the
    same lead-in, the reverse pass walking forward where it left a pair unsettled), or the exact route alone.
    fused-*: the same through the fused kernel (GDNKIT_SM90_FUSED_BACKWARD), its segments the wide route's, each
    from its dS_end by the gated route; dq / dk per chunk and value head summed here. *-wide-*: the forward takes
    the wide route too (its pass over segments picked, or with -plain- the pass over sequences), and the recompute
    replays both launches at 64 columns, the wide one walking as the forward did. The kernels are float64
    stand-ins of their contracts; every gradient is checked against autograd through the float64 reference."""
    from gdnkit.backends.tilelang_sm90 import config
    pytest.importorskip("triton")
    from gdnkit.backends.tilelang_sm90 import BACKEND, context_parallel
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    fused = case.startswith("fused-")
    sm90_config(fused_backward=fused)
    case = case.removeprefix("fused-")
    wide = "-wide-" in case
    picked = "plain" if "-plain-" in case else "wide"
    case = case.replace("-wide", "").replace("-plain", "")
    segments = case.startswith("segments")
    sm90_config(block_v=None if wide else 64)
    if wide:   # the wide route in the forward and the backward (2-chunk segments), the device's pick forced
        sm90_config(wide_segment_chunks=2)
        sm90_config(wide_step_ratio=0.0 if picked == "wide" else 1e9)
    sm90_config(segment_chunks=2 if segments else 0)
    sm90_config(lead_in_route=case != "segments-exact")
    chained = case.startswith("segments-chained")
    if chained:
        sm90_config(exact_route_pays=False)
    flags = []   # the gated routes' device flags: (reverse, transitions needed per segment and head)
    real_needed = bwd.lead_in.transitions_needed
    monkeypatch.setattr(bwd.lead_in, "transitions_needed", lambda *a, reverse=False, **kw: flags.append(
        (reverse, real_needed(*a, reverse=reverse, **kw).tolist())) or real_needed(*a, reverse=reverse, **kw))
    real_reverse = bwd.lead_in.reverse_lead_in   # the backward's: its walks and the same flags
    monkeypatch.setattr(bwd.lead_in, "reverse_lead_in", lambda *a, **kw: (
        lambda walk_need: flags.append((True, walk_need[1].tolist())) or walk_need)(real_reverse(*a, **kw)))
    walks = []   # the chained routes' walks: (chunks per segment and head, reverse)
    real_walks = bwd.lead_in.walk_lengths
    monkeypatch.setattr(bwd.lead_in, "walk_lengths", lambda *a, reverse=False, **kw: walks.append(
        (real_walks(*a, reverse=reverse, **kw).tolist(), reverse)) or real_walks(*a, reverse=reverse, **kw))
    calls = []
    for module in (fwd, bwd):
        monkeypatch.setattr(module, "propagator_kernel", _recorded(calls, "propagator_kernel",
                                                                   lambda H, HV, dt: _propagator_stand_in))
    _stand_in_forward_kernels(monkeypatch, fwd, calls)
    monkeypatch.setattr(bwd, "backward_state_kernel", _recorded(
        calls, "backward_state_kernel",
        lambda H, HV, dt, has_dht, store_dh0, bv, chained=False, ds_only=False:
        _backward_state_stand_in(has_dht, store_dh0, chained, ds_only)))
    monkeypatch.setattr(bwd, "chunk_grads_kernel", _recorded(calls, "chunk_grads_kernel",
                                                             lambda H, HV, dt, grads_dt: _grads_in(grads_dt)))
    monkeypatch.setattr(bwd, "backward_fused_kernel", _recorded(
        calls, "backward_fused_kernel",
        lambda H, HV, dt, has_dinit, store_dh0: _backward_fused_stand_in(has_dinit, store_dh0)))
    # the fused path's dq / dk per value head are written into S0's buffer (recomputed, not the forward's)
    s0_buffers, sums_in_s0 = [], []
    real_entering, real_sums = fwd.entering_states_and_x, bwd.chunk_group_sums
    monkeypatch.setattr(fwd, "entering_states_and_x", lambda problem, s, hs, xs: (
        s0_buffers.append(hs.data_ptr()) or real_entering(problem, s, hs, xs)))
    monkeypatch.setattr(bwd, "chunk_group_sums", lambda dqk, *a: sums_in_s0.append(
        dqk.data_ptr() in s0_buffers) or real_sums(dqk, *a))
    # the qk l2norm's backward: in the fused path's group sums, else the prologue's Triton pass (q's and k's)
    from gdnkit.backends.triton_shared import l2norm
    l2norm_passes, real_pass = [], l2norm.l2norm_backward
    monkeypatch.setattr(l2norm, "l2norm_backward", lambda *a: l2norm_passes.append(1) or real_pass(*a))

    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    varlen = case == "varlen-gva-options"
    H, HV = (1, 2) if varlen or case.endswith("mixed-gates") else (1, 1)
    B, T, lengths = {"dense": (2, 100, None), "varlen-gva-options": (1, 300, [130, 0, 167])}.get(
        case, (1, 400, [333, 0, 60]))
    N = B if lengths is None else len(lengths)
    q, k = r(B, T, H, K).half(), r(B, T, H, K).half()
    if not varlen:
        q, k = F.normalize(q.float(), dim=-1).half(), F.normalize(k.float(), dim=-1).half()
    v, g, beta = r(B, T, HV, V).half(), r(B, T, HV), r(B, T, HV)
    if not varlen:
        scale = torch.tensor([0.3, 1e-3]) if case.endswith("mixed-gates") else 1e-3 if case == "segments-weak-gates" \
            else 0.3
        g, beta = F.logsigmoid(g) * scale, torch.sigmoid(beta)
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=r(HV) * 0.5, dt_bias=r(HV),
                use_beta_sigmoid_in_kernel=True) if varlen else {}
    h0 = r(N, HV, K, V) * 0.1
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    leaves = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, **{n: opts[n] for n in ("A_log", "dt_bias") if n in opts})
    leaves = {n: t.detach().requires_grad_() for n, t in leaves.items()}
    problem, inputs = validate_inputs(CHUNK_MODE, **leaves, output_final_state=True, cu_seqlens=cu,
                                      **{n: x for n, x in opts.items() if n not in ("A_log", "dt_bias")})
    assert problem.needs_grad
    o, ht, saved = BACKEND.chunk_forward(problem, inputs)
    # S0 per chunk: by default the backward runs the forward's state pass again; the same bits as keeping them
    assert saved.hs is None
    with config.configured(keep_states=True):
        kept = BACKEND.chunk_forward(problem, inputs)[2].hs
    assert kept is not None and torch.equal(fwd.entering_states(problem, saved), kept)
    do, dht = r(*o.shape).half(), r(*ht.shape)
    from gdnkit.backends.tilelang_sm90 import lead_in_bound
    token_sums, real_token_sums = [], lead_in_bound._chunk_sums   # the flags' window sums over tokens
    monkeypatch.setattr(lead_in_bound, "_chunk_sums", lambda *a: token_sums.append(1) or real_token_sums(*a))
    if fused and segments and not wide:
        # the fused path in the wide route's segments (2 chunks) behind a forward without them, which the rules give
        # nowhere (a forward that leaves them to its backward takes them itself): the backward follows its plan
        saved.plan = dataclasses.replace(saved.plan, fused_segment_chunks=2)
    grads = BACKEND.chunk_backward(problem, saved, do, dht)
    assert sums_in_s0 == ([True] if fused else []), sums_in_s0
    # the fused path's gated route reads its flags' sums from the training forward's per-row bounds where its
    # intra kernel wrote them (the wide route's), else it sums the window's tokens
    assert (saved.row_bounds is not None) == (wide or chained), saved.row_bounds
    if fused and segments:
        assert bool(token_sums) == (saved.row_bounds is None), token_sums
    # the unfused path's prologue takes the Triton pass only where Triton reads these CPU tensors (the CPU
    # suite's interpreter; on a GPU machine this host test's tensors take the torch form)
    assert len(l2norm_passes) == (2 if varlen and not fused and triton_reads(q) else 0), l2norm_passes

    d64 = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    p64, i64 = validate_inputs(CHUNK_MODE, **d64, output_final_state=True, cu_seqlens=cu,
                               **{n: x for n, x in opts.items() if n not in ("A_log", "dt_bias")})
    ref_o, ref_ht = gdnkit.chunk_gated_delta_rule(**d64, output_final_state=True, cu_seqlens=cu,
                                                 backend="reference",
                                                 **{n: x for n, x in opts.items() if n not in ("A_log", "dt_bias")})
    ref = dict(zip(d64, torch.autograd.grad([ref_o, ref_ht], list(d64.values()), [do.double(), dht.double()])))
    got = dict(q=grads.dq, k=grads.dk, v=grads.dv, g=grads.dg, beta=grads.dbeta, initial_state=grads.dinitial_state,
               A_log=grads.dA_log, dt_bias=grads.ddt_bias)
    assert _rel(o, ref_o) < 2e-3 and _rel(ht, ref_ht) < 2e-3
    errs = {n: _rel(got[n], ref[n]) for n in ref}
    assert all(e < 2e-3 for e in errs.values()), errs  # fp16 inputs, bf16 S0 / dS_end: ~3e-4 measured
    if lengths is not None:
        assert grads.dq[:, sum(lengths):].abs().max() == 0 and grads.dv[:, sum(lengths):].abs().max() == 0
    # the backward's flags: 4 segments (3 of the first sequence, one of the third; the second is empty); the gates
    # decay by ~15 a chunk, so the 1-chunk lead-in (2-chunk segments) settles; weak gates leave segments 0 and 1
    # unsettled, which need the transitions of segments 1 and 2
    # (the staged path's backward after a wide-route forward takes the chained route, the fused path the gated one)
    reverse_chained = chained or (wide and not fused)
    backward_flags = [f for reverse, f in flags if reverse]
    assert backward_flags == ([] if reverse_chained else {
        "segments": [[[0], [0], [0], [0]]], "segments-weak-gates": [[[0], [1], [1], [0]]],
        "segments-mixed-gates": [[[0, 0], [0, 1], [0, 1], [0, 0]]]}.get(case, [])), flags
    # chained (and the wide route's forward): the walks instead, forward (chunks before each segment; two forward
    # calls above) and reverse (after it): one chunk for the decaying head where there is one, all of them to the
    # sequence's boundary for the barely decaying one
    fwd_walk, bwd_walk = {"segments-chained": ([[0], [1], [1], [0]], [[1], [1], [0], [0]]),
                          "segments-chained-mixed-gates": ([[0, 0], [1, 2], [1, 4], [0, 0]],
                                                           [[1, 4], [1, 2], [0, 0], [0, 0]])}.get(
        "segments-chained-mixed-gates" if wide else case, (None, None))
    assert walks == ([] if fwd_walk is None else [(fwd_walk, False)] * 2 + [(bwd_walk, True)] * reverse_chained), \
        walks
    # (the reverse pass's arguments end (..., chained, ds_only); ds_only chained builds are the gated lead-ins)
    walked = {name for name, args in calls if name == "state_output_kernel" and args[8]
              or name == "backward_state_kernel" and args[-2] and not args[-1]}
    want_walked = {"state_output_kernel"} if chained or wide else set()
    assert walked == (want_walked | {"backward_state_kernel"} if reverse_chained else want_walked), walked
    led_in = any(name == "backward_state_kernel" and args[-2] and args[-1] for name, args in calls)
    assert led_in == (segments and not reverse_chained and case != "segments-exact"), calls
    # the recompute (state_output_kernel's arguments 5-10: block_v, store_states, emit_output, chained, store_x,
    # per_sm) runs the three-warpgroup kernel, also for a wide-route forward's 128-column pass over segments,
    # which it replays walking as the forward did: S0 only (the check of entering_states above, and the staged
    # path's) or S0 and X (the fused path's, two programs an SM at 64 columns)
    recomputes = {args[5:10] for name, args in calls if name == "state_output_kernel" and args[6] and not args[7]}
    assert all(per_sm == fwd.recompute_per_sm(args[5], args[9]) for name, (*args, per_sm) in calls
               if name == "state_output_kernel"), calls
    assert {bv for bv, *_ in recomputes} <= set(fwd.NARROW_BLOCK_V), recomputes
    assert not wide or {(64, True, False, True, x) for x in {False, fused}} <= recomputes, recomputes
    launched = {name for name, _ in calls}
    assert ("backward_fused_kernel" in launched) == fused and ("chunk_grads_kernel" in launched) != fused, launched
    _assert_in_family(calls, H, HV, "float16", training=True)


@pytest.mark.parametrize("case", ["dense", "varlen-trailing-state-v-first", "no-tokens"])
def test_forward_host_side_with_kernel_stand_ins(case, monkeypatch, sm90_config, poisoned_empty):
    """Everything forward() does around its two launches, checked on a CPU: the packed view of dense and
    varlen batches, the cached layout's tables, outputs allocated empty (poisoned here) with only the
    tokens past cu_seqlens[-1] zeroed, initial/final states in both layouts, no-token batches. The
    TileLang kernels are replaced by float64 stand-ins of what they write."""
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    sm90_config(block_v=64)
    calls = []
    _stand_in_forward_kernels(monkeypatch, fwd, calls)

    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    H, HV = 1, 2
    svf = case == "varlen-trailing-state-v-first"
    B, T, lengths = {"dense": (2, 100, None), "varlen-trailing-state-v-first": (1, 589, [130, 0, 451, 3]),
                     "no-tokens": (1, 6, [0, 0])}[case]
    N = B if lengths is None else len(lengths)
    q = F.normalize(r(B, T, H, K), dim=-1).half()
    k = F.normalize(r(B, T, H, K), dim=-1).half()
    v, g, beta = r(B, T, HV, V).half(), F.logsigmoid(r(B, T, HV)) * 0.2, torch.rand(B, T, HV, generator=gen)
    h0 = r(N, HV, K, V) * 0.1
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu, state_v_first=svf)
    o, ht, _ = fwd.forward(problem, inputs)
    d = lambda t: t.double()  # noqa: E731
    p64, i64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                               output_final_state=True, cu_seqlens=cu, state_v_first=svf)
    ref_o, ref_ht = reference_forward(p64, i64, chunked_gdn)
    assert o.shape == v.shape and o.dtype == v.dtype and ht.shape == h0.shape and ht.dtype == torch.float32
    assert not o.isnan().any() and not ht.isnan().any()
    if case == "no-tokens":
        assert o.abs().max() == 0 and torch.equal(ht, h0) and not calls   # nothing launched
    else:
        assert _rel(o, ref_o) < 2e-3 and _rel(ht, ref_ht) < 1e-3
        _assert_in_family(calls, H, HV, "float16", training=False)
    if lengths is not None:
        assert o[:, sum(lengths):].abs().max() == 0


@pytest.mark.parametrize("route,gate_scale,settled", [("exact", 0.3, None), ("gated", 3.0, True),
                                                    ("gated", 1e-3, False), ("gated", (3.0, 1e-3), "mixed"),
                                                    ("chained", 3.0, True), ("chained", 1e-3, False),
                                                    ("chained", (3.0, 1e-3), "mixed")],
                         ids=["exact", "gated-settled", "gated-unsettled", "gated-mixed", "chained-settled",
                              "chained-unsettled", "chained-mixed"])
@pytest.mark.parametrize("lengths,state", [([700], False), ([130, 0, 451, 3], True)], ids=["one-long", "varlen-state"])
def test_context_parallel_host_side_matches_the_plain_path(lengths, state, route, gate_scale, settled, monkeypatch,
                                                           sm90_config):
    """The context-parallel forward's glue: segment plan, the segments' initial states (exact: the
    propagator's [E | P] handed to triton_generic's segment scan, interpreted here; gated: a fixed lead-in and
    the exact route behind it, run or skipped per (segment, head) by the device's flags; chained: the same
    lead-in, and the state pass over segments walking back where the flags say a start is unsettled; each for
    gates that settle in a chunk, gates that barely decay, and one head of each), then the state pass over
    segments from those states, which also gives the final states. The three TileLang kernels are replaced by float64 stand-ins of their contracts, so this checks
    everything around them against the plain path and float64."""
    pytest.importorskip("triton")
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import context_parallel
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    sm90_config(block_v=64)
    calls = []
    _stand_in_forward_kernels(monkeypatch, fwd, calls)
    monkeypatch.setattr(fwd, "propagator_kernel", _recorded(calls, "propagator_kernel",
                                                            lambda H, HV, dt: _propagator_stand_in))

    gen = torch.Generator().manual_seed(1)
    H, HV, T, N = 1, 2, sum(lengths) + 5, len(lengths)  # 5 tokens past the last sequence
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).half()
    k = F.normalize(r(1, T, H, K), dim=-1).half()
    v, g = r(1, T, HV, V).half(), F.logsigmoid(r(1, T, HV)) * torch.tensor(gate_scale)
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = r(N, HV, V, K) * 0.1 if state else None  # state_v_first layout
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu, state_v_first=True)
    sm90_config(lead_in_route=route != "exact")
    if route == "chained":   # the route where the exact one does not pay
        sm90_config(exact_route_pays=False)
    results = {}
    for segs in (0, 2):
        sm90_config(segment_chunks=segs)
        if segs:
            layout = fwd.seqlayout.sequence_layout(cu)
            assert fwd.plan_of(problem, layout, torch.device("cpu")).segment_chunks == 2
        got = {}
        results[segs] = fwd.forward(problem, inputs, intermediates=got)[:2]
        assert got["context_parallel"] == (route if segs else None)
        if segs and route == "gated":
            need = got["transitions_needed"]
            if settled == "mixed":   # head 0 decays, head 1 barely: only head 1's transitions run
                assert need[:, 0].sum() == 0 and need[:, 1].sum() > 0
            else:
                assert (int(need.sum()) == 0) == settled
        if segs and route == "chained":   # one chunk settles a decaying head; a barely decaying one walks it all
            walk, before = got["walk_lengths"], context_parallel.plan_segments(layout, 2).walks.before
            short, whole = before.clamp_max(1), before
            want = {True: (short, short), False: (whole, whole), "mixed": (short, whole)}[settled]
            assert all(torch.equal(walk[:, hv], want[hv]) for hv in range(HV)), (walk, before)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    p64, i64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                               output_final_state=True, cu_seqlens=cu, state_v_first=True)
    ref_o, ref_ht = reference_forward(p64, i64, chunked_gdn)
    (o_plain, ht_plain), (o_cp, ht_cp) = results[0], results[2]
    assert _rel(o_cp, o_plain) < 2e-3 and _rel(ht_cp, ht_plain) < 1e-3
    assert _rel(o_cp, ref_o) < 2e-3 and _rel(ht_cp, ref_ht) < 1e-3
    assert o_cp[:, sum(lengths):].abs().max() == 0
    _assert_in_family(calls, H, HV, "float16", training=False)


@pytest.mark.gpu
@pytest.mark.parametrize("H,HV,T,segment_chunks,gate_scale,lead_in_on,route,settled", [
    (2, 8, 8200, None, 1.0, True, "gated", True),
    (2, 8, 8200, None, 1.0, False, "exact", None),
    (2, 8, 8200, 3, 1.0, True, "gated", True),
    (2, 8, 8200, None, 1e-3, True, "gated", False),   # gates barely decay: the exact route behind the lead-in runs
    (2, 8, 65536 + 37, None, 1.0, True, "gated", True),
    (8, 32, 32768, None, 1.0, True, "chained", True),   # the exact route does not pay: the chained route
    (8, 32, 32768, None, 1e-3, True, "chained", False),  # ... where every unsettled program walks back
    # 16-chunk segments, the exact route made not to pay: half the heads barely decay, so their programs walk
    # back to the sequence's start (up to 8 segments), the others start from their lead-in
    (2, 8, 8200, 16, "mixed", True, "chained", "mixed"),
    # inference's wide route: the chained route with one 128-column program per (segment, head), 4 and 16
    # segments filling the SMs
    (8, 32, 32768, None, 1.0, True, "wide", True),
    (8, 32, 32768, None, 1e-3, True, "wide", False),
    (2, 8, 65536 + 37, None, "mixed", True, "wide", "mixed"),
    # short sequences: 2/8 2000 tokens in 2-chunk segments (a tail chunk of 16): the wide pass where every head
    # settles, the plain one picked with mixed gates
    (2, 8, 2000, None, 1.0, True, "wide", True),
    (2, 8, 2000, None, "mixed", True, "wide", "mixed"),
    # where the 64-column pass without segments fills the SMs too, the device picks: the wide route where every
    # head settles at once, the pass without segments where half the heads walk far
    (16, 64, 32768, None, 1.0, True, "wide", True),
    (16, 64, 32768, None, "mixed", True, "wide", "mixed"),
], ids=["auto", "exact", "seg3", "weak-gates", "auto-64k", "8-32", "8-32-weak-gates", "chained-long-walks",
        "wide-8-32", "wide-8-32-weak-gates", "wide-64k-mixed-gates", "wide-short", "wide-short-mixed-gates",
        "wide-16-64-picked", "wide-16-64-plain"])
def test_context_parallel_on_gpu(H, HV, T, segment_chunks, gate_scale, lead_in_on, route, settled, monkeypatch,
                                 sm90_config):
    """The forward with context parallelism (one long sequence: auto dispatch cuts it into segments on an
    H200) against float64, with an initial and a final state, by each route to the segments' initial states
    (gated and chained: whether the fixed lead-in settled every segment, as the device flagged; wide: the chained
    route in the 128-column state pass); a second call gives the same bits."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    pytest.importorskip("triton")
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import context_parallel
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    sm90_config(segment_chunks=segment_chunks)
    sm90_config(lead_in_route=lead_in_on)
    sm90_config(wide_route=route == "wide")
    if route == "wide" and settled is False:   # the wide pass's long walks: made to be picked over the plain pass
        sm90_config(wide_step_ratio=0.0)
    if route == "chained" and segment_chunks:
        sm90_config(exact_route_pays=False)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    if gate_scale == "mixed":
        gate_scale = torch.tensor([1.0, 1e-3], device=dev).repeat(HV // 2)
    v, g = r(1, T, HV, V).to(torch.bfloat16), F.logsigmoid(r(1, T, HV)) * gate_scale
    beta = torch.sigmoid(r(1, T, HV))
    h0 = r(1, HV, K, V) * 0.1
    cu = torch.tensor([0, T], device=dev)
    with torch.no_grad():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu)
        layout = fwd.seqlayout.sequence_layout(cu)
        p = fwd.plan_of(problem, layout, q.device)
        seg, wide = p.segment_chunks, p.wide
        assert seg and wide == (route == "wide")  # segments are cut
        got = {}
        o, ht, _ = fwd.forward(problem, inputs, intermediates=got)
        o2, ht2, _ = fwd.forward(problem, inputs)
        assert got["context_parallel"] == ("chained" if wide else route) and got["wide_segments"] == wide
        if route == "gated":
            assert (int(got["transitions_needed"].sum()) == 0) == settled
        if wide:   # the device's pick (context_parallel.pick): the pass without segments where half the heads
            # walk far enough that the longest program, in wide steps, outlasts the longest sequence
            walk, own = got["walk_lengths"], context_parallel.plan_segments(layout, seg).own
            longest_program = float((walk + own.to(walk.device)[:, None]).max()) * context_parallel.WIDE_STEP_RATIO
            assert bool(got["wide_choice"]) == (longest_program < -(-T // 64))
            if T < 4096:   # short sequences: the slow heads walk to the start, so the pick follows the gates
                assert bool(got["wide_choice"]) == (settled != "mixed")
        if route in ("chained", "wide"):   # decaying heads walk one chunk, barely decaying ones far (e^-12 takes ~240 chunks)
            walk, before = got["walk_lengths"], context_parallel.plan_segments(layout, seg).walks.before[:, None]
            short, far = walk == before.clamp_max(1), (walk > 1) | (before <= 1)
            if settled == "mixed":
                assert short[:, 0::2].all() and far[:, 1::2].all()
            else:
                assert (short if settled else far).all()
        d = lambda t: t.double()  # noqa: E731
        p64, i64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                                   output_final_state=True, cu_seqlens=cu)
        ref_o, ref_ht = reference_forward(p64, i64, chunked_gdn)
    assert _rel(o, ref_o) <= BF16_FWD_BAR, f"o: {_rel(o, ref_o):.2e}"
    assert _rel(ht, ref_ht) <= BF16_FWD_BAR, f"final state: {_rel(ht, ref_ht):.2e}"
    assert torch.equal(o, o2) and torch.equal(ht, ht2)


@pytest.mark.parametrize("H,HV,lengths,expected", [
    (2, 8, [32768], 64),        # 8 segments: 64 (segment, head) pairs, 128 output programs for 132 SMs
    (2, 8, [8192], 32),         # the shortest segment allowed: 4 segments
    (2, 8, [2048], None),       # 32 chunks: one segment would be the whole sequence
    (2, 8, [512], None),        # one segment would be the whole sequence
    (4, 16, [32768], 128),      # 64 narrowest programs: 4 segments (0.905 -> 0.757 ms)
    (8, 32, [32768], 256),      # 128 narrowest programs: 2 segments, by lead-in only
    (16, 64, [32768], None),    # 4 V tiles x 64 heads > 132: enough programs already
    (2, 8, [4096] * 8, None),
])
def test_context_parallel_segment_rule(H, HV, lengths, expected):
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import plan
    from gdnkit.backends.tilelang_sm90.config import Config
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = seqlayout.sequence_layout(cu)
    assert plan.segment_chunks(layout, HV, 132, Config()) == expected
    # the exact route (propagator + scan) pays only from 2 SMs per narrowest program (8/32: 1.51 vs 1.03 ms)
    assert plan.exact_route_pays(layout, HV, 132, Config()) == (4 * len(lengths) * HV * 2 <= 132)



def test_plan_in_explain():
    """The backend's plan as explain() shows it, from the layout, the heads and the SM count alone (a machine
    given as data; no GPU, no kernel): 2/8 with one sequence of 32768 tokens on 132 SMs takes the wide route in
    16 segments of 32 chunks, its backward the fused kernel in those segments (4096 chunks x heads, each program
    32 chunks, within 1.6x the SMs' even share of 31), the staged path where the Config says so."""
    from gdnkit.backends.tilelang_sm90 import BACKEND, config
    from gdnkit.dispatch import Decision
    from gdnkit.dispatch.machine import GPU, Machine
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    machine = Machine(gpus=(GPU(0, "H200", (9, 0), 132, 0),), packages={"triton": "3", "tilelang": "0"})
    T, H, HV = 32768, 2, 8
    q, k = torch.randn(1, T, H, K, dtype=torch.bfloat16), torch.randn(1, T, H, K, dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, V, dtype=torch.bfloat16)
    g, beta = F.logsigmoid(torch.randn(1, T, HV)), torch.rand(1, T, HV)
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta)
    text = BACKEND.plan(problem, inputs, machine)
    assert text.splitlines()[0] == "route: wide, 16 segments of 32 chunks (132 SMs)", text
    assert "backward" not in text   # inference
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v.requires_grad_(), g, beta)
    assert "backward: fused (backward_fused.py), in the wide route's 16 segments" in BACKEND.plan(problem, inputs,
                                                                                                 machine)
    with config.configured(fused_backward=False):
        text = BACKEND.plan(problem, inputs, machine)
    assert "backward: staged, reverse pass chained" in text, text
    shown = str(Decision(problem, "tilelang_sm90", "auto", {}, plan=text))
    assert shown.endswith("plan:\n" + "\n".join("  " + line for line in text.splitlines())), shown


@pytest.mark.parametrize("H,HV,lengths,expected", [
    (2, 8, [32768], 32),        # 16 segments x 8 heads: 128 programs of 128 columns for 132 SMs
    (4, 16, [32768], 64),
    (8, 32, [32768], 128),
    (16, 64, [32768], 256),     # 2 segments
    (2, 8, [4096] * 8, 32),     # 64 sequence-head pairs: each sequence in 2
    (2, 8, [8192], 8),          # 16 segments of 8 chunks
    (2, 8, [2048], 2),          # short sequences too, down to 2-chunk segments (wide_min_segment_chunks)
    (4, 16, [2048], 4),
    (8, 32, [2048], 8),
    (16, 64, [2048], None),     # 128 programs of the 64-column pass fill the SMs already: long segments only
    (16, 64, [4096], 32),
    (2, 8, [128], None),        # 2 chunks: one segment would be the whole sequence
    (2, 8, [2048] * 4, 8),      # 32 pairs: 4 segments each
    (4, 16, [4096] * 8, None),  # 128 pairs already fill 70% of the SMs: the wide pass without segments
    (16, 64, [4096] * 8, None),
    # unequal sequences cut at one length: each program as long as an equal split's
    (2, 8, [28672, 4096], 32),  # 14 + 2 segments x 8 heads, as 1x32768's 16
    (8, 24, [28672, 4096], 112),  # 4 + 1 segments x 24 heads: 120 programs
    (2, 8, [1024, 7168], 8),    # 2 + 14 segments
    (4, 16, [12288, 4096], 32),
])
def test_wide_segment_rule(H, HV, lengths, expected):
    """Inference's wide route cuts segments so one 128-column program per (segment, head) fills the SMs."""
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import plan
    from gdnkit.backends.tilelang_sm90.config import Config
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    layout = seqlayout.sequence_layout(cu)
    assert plan.wide_segment_chunks(layout, HV, 132, Config()) == expected
    assert plan.wide_segment_chunks(layout, HV, 0, Config()) is None   # off CUDA
    # forced segments keep the other routes
    assert plan.wide_segment_chunks(layout, HV, 132, Config(segment_chunks=16)) is None


@pytest.mark.parametrize("H,HV,lengths,expected", [
    (16, 48, [28672, 4096], (64, 3)),   # 96 pairs fill the SMs, the long sequence dominates: 384 programs
    (16, 48, [4096, 28672], (64, 3)),
    (16, 64, [28672, 4096], (64, 4)),
    (16, 64, [24576, 8192], (128, 2)),  # 2 x 130 steps against 384
    (16, 48, [16384] * 2, (64, 3)),     # 198 steps against 256
    (16, 64, [16384] * 2, None),        # 264 against 256: the plain pass
    (16, 64, [4096] * 8, None),         # the total work, not one sequence, bounds the plain pass
    (2, 8, [32768], None),              # 8 pairs: the one-wave rule's (wide_segment_chunks)
    (16, 64, [2048, 128], None),        # no cut of at least 32 chunks pays
])
def test_wide_waves_segment_rule(H, HV, lengths, expected):
    """Where one program per (sequence, head) fills the SMs already, the wide route still cuts segments, in
    several waves, when the longest sequence bounds the plain pass and the waves cost at most waves_margin of
    it; the forward takes it only where the one-wave rule declines."""
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import plan
    from gdnkit.backends.tilelang_sm90.config import Config
    layout = seqlayout.sequence_layout(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
    assert plan.wide_waves_segment_chunks(layout, HV, 132, Config()) == expected
    if expected:
        assert plan.wide_segment_chunks(layout, HV, 132, Config()) is None
    assert plan.wide_waves_segment_chunks(layout, HV, 0, Config()) is None   # off CUDA
    # forced segments keep the other routes
    assert plan.wide_waves_segment_chunks(layout, HV, 132, Config(segment_chunks=16)) is None


@pytest.mark.gpu
@pytest.mark.parametrize("wide", [False, True], ids=["bv64", "wide"])
def test_backward_state_matches_reference_chunked_backward(wide):
    """The sm90 backward's sequential pass alone (backward_state.py, or its full-width form
    backward_state_wide.py), fed by the forward's intra kernel (Tb, gamma), against
    backends/reference/chunked_backward.py: dU and dS_end of every chunk, dV and dh0, one sequence of 200
    tokens (a chunk tail of 8) with a final-state gradient."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    tl = _tilelang()
    from gdnkit.backends.reference.chunked_backward import chunked_gdn_backward
    from gdnkit.backends.tilelang_sm90 import backward_state, backward_state_wide
    from gdnkit.backends.tilelang_sm90.backward import _no_walks
    from gdnkit.backends.tilelang_sm90.forward import TARGET, forward, open_gate
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    from gdnkit import seqlayout

    H, HV, T, dev = 2, 4, 200, "cuda"
    gen = torch.Generator(device=dev).manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    g, beta, do, dht = F.logsigmoid(r(1, T, HV)), torch.sigmoid(r(1, T, HV)), r(1, T, HV, V).to(torch.bfloat16), r(1, HV, K, V)
    with torch.no_grad():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta)
        got = {}
        forward(problem, inputs, intermediates=got)
        layout = seqlayout.sequence_layout(torch.tensor([0, T], device=dev, dtype=torch.int32))
        module, program = (backward_state_wide, backward_state_wide.backward_state_wide_program) if wide else \
            (backward_state, backward_state.backward_state_program)
        kernel = tl.compile(program(H, HV, "bfloat16", True, True), target=TARGET, pass_configs=module.PASS_CONFIGS)
        nc = layout.n_chunks
        du, dv = (torch.full((1, T, HV, V), float("nan"), device=dev, dtype=torch.bfloat16) for _ in range(2))
        dh = torch.full((nc, HV, K, V), float("nan"), device=dev, dtype=torch.bfloat16)
        dh0 = torch.full((1, HV, K, V), float("nan"), device=dev)
        kernel(q, k, got["a"], do, got["gamma"].reshape(HV, nc, 64), layout.cu_seqlens, layout.chunk_offsets, dht,
               du, dv, dh, dh0, float(problem.scale), open_gate(q.device, HV), *_no_walks(q.device, HV))
        torch.cuda.synchronize()
        rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
        ref = chunked_gdn_backward(rep(q), rep(k), v.double(), g.double(), beta.double(), problem.scale,
                                   do.double(), dht=dht.double())
    per_token = lambda x: x.movedim(1, 3).reshape(1, -1, HV, x.shape[-1])[:, :T]  # noqa: E731
    checks = {"dU": (du, per_token(ref.dU)), "dV": (dv, ref.dv), "dh0": (dh0, ref.dh0),
              "dS_end": (dh, ref.dh[0].movedim(1, 0))}
    for name, (out, want) in checks.items():
        assert not out.isnan().any(), name
        assert _rel(out, want) <= 1e-2, f"{name}: {_rel(out, want):.2e}"


@pytest.mark.gpu
def test_chunk_grads_matches_reference_chunked_backward():
    """The backward's per-chunk kernel alone, fed by the training forward (Tb, T, gamma, S0 per chunk) and the
    reverse pass (dS_end, dU, dX), against chunk_local_grads in float64 via chunked_gdn_backward: dq, dk summed
    over each key head's value heads, dg, dbeta; one sequence of 200 tokens (a chunk tail of 8), GVA 2 -> 4."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit import seqlayout
    from gdnkit.backends.reference.chunked_backward import chunked_gdn_backward
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    from gdnkit.backends.tilelang_sm90.forward import entering_states, forward
    from gdnkit.problem import CHUNK_MODE, validate_inputs

    H, HV, T, dev = 2, 4, 200, "cuda"
    gen = torch.Generator(device=dev).manual_seed(6)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16).requires_grad_()
    k = F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    g, beta, dht = F.logsigmoid(r(1, T, HV)), torch.sigmoid(r(1, T, HV)), r(1, HV, K, V)
    do = r(1, T, HV, V).to(torch.bfloat16)
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, output_final_state=True)
    assert problem.needs_grad
    got = {}
    with torch.no_grad():
        saved = forward(problem, inputs, intermediates=got)[2]
        hs = entering_states(problem, saved)  # the backward's S0 per chunk: the state pass run again
        layout = seqlayout.sequence_layout(torch.tensor([0, T], device=dev, dtype=torch.int32))
        nc, dt = layout.n_chunks, "bfloat16"
        gamma = got["gamma"].reshape(HV, nc, 64)
        du, dv = (torch.zeros(1, T, HV, V, device=dev, dtype=torch.bfloat16) for _ in range(2))
        dh = torch.empty(nc, HV, K, V, device=dev, dtype=torch.bfloat16)
        stub = torch.empty(1, HV, K, V, device=dev)
        bwd.backward_state_kernel(H, HV, dt, True, False, 64)(q, k, got["a"], do, gamma, layout.cu_seqlens,
                                                               layout.chunk_offsets, dht, du, dv, dh, stub,
                                                               float(problem.scale), bwd.open_gate(q.device, HV),
                                                               *bwd._no_walks(q.device, HV))
        outs = [torch.full((1, T, H, K), float("nan"), device=dev) for _ in range(2)]
        outs += [torch.full((1, T, HV), float("nan"), device=dev) for _ in range(2)]
        bwd.chunk_grads_kernel(H, HV, dt, "float32")(q, k, v, do, du, dv, got["a"], got["tm"], gamma, beta, hs, dh,
                                          layout.cu_seqlens, layout.chunk_indices, *outs, float(problem.scale))
        torch.cuda.synchronize()
        rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
        ref = chunked_gdn_backward(rep(q), rep(k), v.double(), g.double(), beta.double(), problem.scale,
                                   do.double(), dht=dht.double())
    group_sum = lambda x: x.view(1, T, H, HV // H, K).sum(3)  # noqa: E731
    for name, out, want in zip(("dq", "dk", "dg", "dbeta"), outs, (group_sum(ref.dq), group_sum(ref.dk), ref.dg,
                                                                   ref.dbeta)):
        assert not out.isnan().any(), name
        assert _rel(out, want) <= 1e-2, f"{name}: {_rel(out, want):.2e}"


def _fused_backward_forced(monkeypatch, sm90_config) -> list:
    """On an sm90 GPU (else the test skips): tilelang_sm90's fused backward switched on for this test; returns the
    list its kernel factory's calls are recorded in (a test asserts the kernel ran)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    sm90_config(fused_backward=True)
    launched = []
    real = bwd.backward_fused_kernel
    monkeypatch.setattr(bwd, "backward_fused_kernel", lambda *a: launched.append(a) or real(*a))
    return launched


@pytest.mark.gpu
@pytest.mark.parametrize("H,HV,lengths,state,final", [(2, 4, (200,), True, True),
                                                      (4, 16, (77, 0, 1000, 1333), True, True),
                                                      (2, 8, (8200,), True, True), (16, 32, (4096,), False, True),
                                                      (4, 8, (1000, 333), False, False),
                                                      (4, 4, (1000, 0, 333), True, True)],
                         ids=["one", "varlen", "segments", "16x32", "no-states", "one-per-key-head"])
def test_backward_fused_matches_float64(H, HV, lengths, state, final, monkeypatch, sm90_config):
    """The fused backward (backward_fused.py, one launch after the S0 recompute) through the public API: every
    gradient against the float64 chunked backward, with GVA; a chunk tail of 8 (one), sequences of odd and zero
    length with initial states (varlen), one long sequence in the wide route's segments, each from its dS_end by
    the gated route (segments), 16/32 without an initial state, and a training call with neither state (the
    kernel's dS from zero, no dh0: the usual training call), one value
    head a key head with an empty sequence (one-per-key-head: groups of one); and the
    same call six times, bitwise: dg's chunk-end term (the owner's and g's warpgroup reductions) is where forms that
    moved the roles' timing went wrong from call to call, in a segment's first chunk (K and Q in alternating
    slots; ordered pairs of value heads; docs/performance.md)."""
    launched = _fused_backward_forced(monkeypatch, sm90_config)
    from gdnkit.backends.reference.chunked_backward import chunked_gdn_backward
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit import seqlayout
    states = []   # the state passes' builds: (block_v, store_states, emit_output, chained, store_x)
    real_state = fwd.state_output_kernel
    monkeypatch.setattr(fwd, "state_output_kernel", lambda *a: states.append(a[5:10]) or real_state(*a))
    dev, N = "cuda", len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    T = int(cu[-1])
    gen = torch.Generator(device=dev).manual_seed(21)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = dict(q=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16), k=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16),
             v=r(1, T, HV, V).to(torch.bfloat16), g=F.logsigmoid(r(1, T, HV)), beta=torch.sigmoid(r(1, T, HV)))
    if state:
        x["initial_state"] = r(N, HV, K, V) * 0.1
    do, dht = r(1, T, HV, V).to(torch.bfloat16), r(N, HV, K, V) * 0.1
    runs = []
    for _ in range(6):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, ht = gdnkit.chunk_gated_delta_rule(**leaves, output_final_state=final, cu_seqlens=cu,
                                              backend="tilelang_sm90")
        outs, grads = ([o, ht], [do, dht]) if final else ([o], [do])
        runs.append(dict(zip(leaves, torch.autograd.grad(outs, list(leaves.values()), grads))))
    assert launched, "the fused kernel did not run"
    # where the training forward took the wide route (one program per segment and head at 128 columns), the
    # recompute of S0 and X replays its segments' walks at 32 / 64 columns, as it replays every other pass
    wide = fwd.plan_of(types.SimpleNamespace(HV=HV, needs_grad=True), seqlayout.sequence_layout(cu.to(torch.int32)),
                       torch.device(dev)).route == "wide"
    recomputes = {(bv, chained) for bv, keep, emit, chained, store_x in states if keep and not emit and store_x}
    assert recomputes and all(bv in fwd.NARROW_BLOCK_V for bv, _ in recomputes), states
    assert any(chained for _, chained in recomputes) == wide, (wide, states)
    rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
    want = {n: [] for n in ("q", "k", "v", "g", "beta", "initial_state")}
    with torch.no_grad():
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            if a == b:   # no tokens: dh0 is dht (zero without a final state)
                want["initial_state"].append(dht[n:n + 1].double() * final)
                continue
            h0 = x["initial_state"][n:n + 1].double() if state else None
            ref = chunked_gdn_backward(rep(x["q"][:, a:b]), rep(x["k"][:, a:b]), x["v"][:, a:b].double(),
                                       x["g"][:, a:b].double(), x["beta"][:, a:b].double(), K ** -0.5,
                                       do[:, a:b].double(), h0=h0, dht=dht[n:n + 1].double() if final else None)
            for name, t in (("q", _fold_group(ref.dq, H)), ("k", _fold_group(ref.dk, H)), ("v", ref.dv),
                            ("g", ref.dg), ("beta", ref.dbeta), ("initial_state", ref.dh0)):
                want[name].append(t)
    want = {n: torch.cat(ts, dim=0 if n == "initial_state" else 1) for n, ts in want.items() if n in runs[0]}
    errs = {n: _rel(runs[0][n], want[n]) for n in want}
    assert all(e <= 1e-2 for e in errs.values()), errs
    for n in runs[0]:
        assert all(torch.equal(runs[0][n], run[n]) for run in runs[1:]), n


@pytest.mark.gpu
def test_backward_fused_with_options(monkeypatch, sm90_config):
    """The fused backward under the options' prologue (qk l2norm, whose backward runs inside the group sums;
    the gate from A_log / dt_bias; beta's sigmoid), varlen with a chunk tail and an empty sequence,
    both states: every gradient, dA_log and ddt_bias included, against autograd through the float64 reference, and
    the call twice bitwise."""
    launched = _fused_backward_forced(monkeypatch, sm90_config)
    H, HV, dev = 4, 16, "cuda"
    cu = torch.tensor([0, 77, 77, 1000, 1333], device=dev)
    T, N = int(cu[-1]), cu.numel() - 1
    gen = torch.Generator(device=dev).manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = dict(q=r(1, T, H, K).to(torch.bfloat16), k=r(1, T, H, K).to(torch.bfloat16),
             v=r(1, T, HV, V).to(torch.bfloat16), g=r(1, T, HV), beta=r(1, T, HV), initial_state=r(N, HV, K, V) * 0.1,
             A_log=r(HV) * 0.5, dt_bias=r(HV))
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                output_final_state=True, cu_seqlens=cu)
    do, dht = r(1, T, HV, V).to(torch.bfloat16), r(N, HV, K, V) * 0.1
    runs = []
    for _ in range(2):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, ht = gdnkit.chunk_gated_delta_rule(**leaves, **opts, backend="tilelang_sm90")
        runs.append(dict(zip(leaves, torch.autograd.grad([o, ht], list(leaves.values()), [do, dht]))))
    assert launched, "the fused kernel did not run"
    d64 = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    o, ht = gdnkit.chunk_gated_delta_rule(**d64, **opts, backend="reference")
    want = dict(zip(d64, torch.autograd.grad([o, ht], list(d64.values()), [do.double(), dht.double()])))
    errs = {n: _rel(runs[0][n], want[n]) for n in want}
    assert all(e <= 1e-2 for e in errs.values()), errs
    for n in runs[0]:
        assert torch.equal(runs[0][n], runs[1][n]), n


def _fold_group(t, H):
    """dq / dk of one sequence from the reference's per-value-head [1, L, HV, K], summed over each key head's group."""
    return t.view(1, t.shape[1], H, -1, t.shape[-1]).sum(3)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["staged", "fused"])
def test_training_gradients_repeat_bitwise(fused, monkeypatch, sm90_config):
    """Two backward passes of the same training call give bitwise-identical gradients (no float atomics),
    through the public API with GVA, varlen and an initial state; the default backward and the fused one."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    sm90_config(fused_backward=fused)
    H, HV, dev = 4, 16, "cuda"
    cu = torch.tensor([0, 77, 1000, 1333], device=dev)
    T = int(cu[-1])
    gen = torch.Generator(device=dev).manual_seed(8)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = dict(q=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16), k=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16),
             v=r(1, T, HV, V).to(torch.bfloat16), g=F.logsigmoid(r(1, T, HV)), beta=torch.sigmoid(r(1, T, HV)),
             initial_state=r(3, HV, K, V) * 0.1)
    do = r(1, T, HV, V).to(torch.bfloat16)
    runs = []
    for _ in range(2):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        o, ht = gdnkit.chunk_gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=cu, backend="tilelang_sm90")
        runs.append(torch.autograd.grad([o, ht], list(leaves.values()), [do, torch.ones_like(ht)]))
    for name, a, b in zip(x, *runs):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("H,HV,T", [(2, 8, 1000), (4, 16, 4160)], ids=["side-stream", "segments"])
@pytest.mark.parametrize("fused", [False, True], ids=["staged", "fused"])
def test_training_call_in_a_cuda_graph_matches_eager(H, HV, T, fused, monkeypatch, sm90_config):
    """A training call (forward and backward) captured in a CUDA graph and replayed gives the eager call's
    gradients, its outputs poisoned before the replay. side-stream: no segments, so the backward's S0 recompute
    runs on a side stream beside the reverse pass (backward._recompute_beside), forked and joined inside the
    capture; the first replay reads S0 from graph-pool memory no earlier call wrote, so a read before the join
    shows. segments: the forward's gated lead-in route (nothing read back) and the backward's exact route under
    capture, where eager may take the backward's lead-in route (dS_end within e^-12 of each other): gradients
    compared to 2e-3, not bitwise. fused: the same calls through the fused backward (its S0 recompute in series,
    then one kernel)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    sm90_config(fused_backward=fused)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(12)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    x = dict(q=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16), k=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16),
             v=r(1, T, HV, V).to(torch.bfloat16), g=F.logsigmoid(r(1, T, HV)), beta=torch.sigmoid(r(1, T, HV)))
    do = r(1, T, HV, V).to(torch.bfloat16)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}

    def call():
        o = gdnkit.chunk_gated_delta_rule(**leaves, backend="tilelang_sm90")[0]
        return torch.autograd.grad(o, list(leaves.values()), do)

    want = [t.clone() for t in call()]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    for t in got:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for name, a, b in zip(x, want, got):
        assert torch.isfinite(b).all(), name
        assert _rel(b, a) <= 2e-3, f"{name}: {_rel(b, a):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("route,gate_scale", [("gated", 1.0), ("gated", 1e-3), ("chained", (1.0, 1e-3)),
                                              ("wide", (1.0, 1e-3))],
                         ids=["lead_in", "weak-gates", "chained-mixed-gates", "wide-mixed-gates"])
def test_training_with_context_parallelism(route, gate_scale, monkeypatch, sm90_config):
    """One long sequence at 2/8 (segments on an H200): forward and backward in segments, by lead-ins with
    decaying gates, by the exact routes (propagator and segment scans) with gates that barely decay, by the
    chained routes (16-chunk segments, the exact route made not to pay) with half the heads barely decaying, so
    their programs walk up to 8 segments both ways; by the backward's wide route (at 65573 tokens: 16 segments,
    one 128-column reverse-pass program per segment and head, half the heads walking far); every gradient
    against the float64 chunked backward."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs an sm90 GPU")
    _tilelang()
    pytest.importorskip("triton")
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.reference.chunked_backward import chunked_gdn_backward
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    from gdnkit.backends.tilelang_sm90 import context_parallel
    H, HV, T, dev = 2, 8, 65536 + 37 if route == "wide" else 8200, "cuda"
    # the staged path's routes (fused_pays would give 2/8 at 65573 tokens to the fused kernel, whose segments
    # test_backward_fused_matches_float64[segments] checks)
    sm90_config(fused_backward=False)
    sm90_config(wide_route=route == "wide")
    if route == "chained":
        sm90_config(segment_chunks=16)
        sm90_config(exact_route_pays=False)
    routes = []
    real_segments = bwd._segments
    monkeypatch.setattr(bwd, "_segments", lambda *a: routes.append(real_segments(*a)[1]) or real_segments(*a))
    tiles = []   # the reverse pass's V tiles
    real_kernel = bwd.backward_state_kernel
    monkeypatch.setattr(bwd, "backward_state_kernel", lambda *a: tiles.append(a[5]) or real_kernel(*a))
    gen = torch.Generator(device=dev).manual_seed(9)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    rates = torch.tensor(gate_scale, device=dev).repeat(HV // 2) if isinstance(gate_scale, tuple) else gate_scale
    x = dict(q=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16), k=F.normalize(r(1, T, H, K), dim=-1).to(torch.bfloat16),
             v=r(1, T, HV, V).to(torch.bfloat16), g=F.logsigmoid(r(1, T, HV)) * rates,
             beta=torch.sigmoid(r(1, T, HV)), initial_state=r(1, HV, K, V) * 0.1)
    do, dht = r(1, T, HV, V).to(torch.bfloat16), r(1, HV, K, V) * 0.1
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    cu = torch.tensor([0, T], device=dev)
    o, ht = gdnkit.chunk_gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=cu, backend="tilelang_sm90")
    got = dict(zip(leaves, torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])))
    rep = lambda t: t.double().repeat_interleave(HV // H, dim=2)  # noqa: E731
    scale = K ** -0.5
    with torch.no_grad():
        ref = chunked_gdn_backward(rep(x["q"]), rep(x["k"]), x["v"].double(), x["g"].double(), x["beta"].double(),
                                   scale, do.double(), h0=x["initial_state"].double(), dht=dht.double())
        ref_o, _, _ = chunked_gdn(rep(x["q"]), rep(x["k"]), x["v"].double(), x["g"].double(), x["beta"].double(),
                                  scale, x["initial_state"].double())
    fold = lambda t: t.view(1, T, H, HV // H, K).sum(3)  # noqa: E731
    want = dict(q=fold(ref.dq), k=fold(ref.dk), v=ref.dv, g=ref.dg, beta=ref.dbeta, initial_state=ref.dh0)
    assert _rel(o, ref_o) <= BF16_FWD_BAR
    errs = {n: _rel(got[n], want[n]) for n in want}
    assert all(e <= 1e-2 for e in errs.values()), errs
    assert routes == ["chained" if route == "wide" else route]
    assert (128 in tiles) == (route == "wide"), tiles   # the wide route's reverse pass runs all 128 columns


def test_forward_copies_inputs_whose_base_tma_cannot_take():
    """A TMA descriptor needs a 16-byte aligned base: a contiguous view one element into a buffer is copied,
    an aligned tensor passes through as it is (no copy)."""
    from gdnkit.backends.tilelang_sm90.forward import _tma_aligned
    buf = torch.randn(1 + 4 * 128, dtype=torch.bfloat16)
    view = buf[1:].view(1, 4, 1, 128)
    assert view.data_ptr() % 16 != 0
    out = _tma_aligned(view)
    assert out.data_ptr() % 16 == 0 and torch.equal(out, view)
    aligned = torch.randn(1, 4, 1, 128, dtype=torch.bfloat16)
    assert _tma_aligned(aligned) is aligned
