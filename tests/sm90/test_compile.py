"""tilelang_sm90's kernels build for sm_90a with nvcc (no GPU needed) and the generated CUDA shows the Hopper paths:
wgmma for the tensor-core products, TMA bulk tensor loads on mbarriers for the tiles, barriers only where every
thread of a role arrives, and shared memory within a Hopper block. A regression to mma.sync or to plain loads fails
here."""
import re
import tempfile
from pathlib import Path

import pytest

from .helpers import SM90, STATIC_SHARED, _assert_hopper_paths, _dynamic_shared_bytes, _element_loops_with_barriers, _kernel, _ptxas_report, _source, _tilelang


# What one block may use on sm90 (cudaDevAttrMaxSharedMemoryPerBlockOptin, H100 / H200: 227 KB), and what a kernel
# with static mbarriers takes besides its dynamic buffer: the barriers padded to that buffer's 1 KB alignment, plus
# the 1 KB the driver reserves per block (cuobjdump -res-usage reads SHARED:2048 for chunk_grads). A kernel past the
# sum compiles, then fails at launch ("Failed to set the allowed dynamic shared memory size"): 232704 and
# 232448 bytes failed that way on the H200.
SM90_BLOCK_SHARED = 232448


SM90_SM_SHARED = 233472   # what the blocks resident on one SM share (228 KB)


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


def _copy_program():
    import tilelang.language as T

    @T.prim_func
    def copy_rows(src: T.Tensor((64, 64), "bfloat16"), dst: T.Tensor((64, 64), "bfloat16"), scale: T.float32):
        with T.Kernel(1, threads=128):
            for r, c in T.Parallel(64, 64):
                dst[r, c] = src[r, c] * scale

    return copy_rows


def test_a_launch_calls_the_kernels_executable_with_the_same_arguments():
    """kernel_build.launcher: a launch skips TileLang's torch wrapper and calls the kernel's TVM-FFI executable with
    the arguments the wrapper would have passed it (the executable stubbed here: no GPU), for a kernel with no
    outputs to allocate; a kernel with outputs (out_idx), or anything not a TileLang kernel, is launched as it is."""
    import torch
    tilelang = _tilelang()
    from gdnkit.backends.tilelang_sm90 import kernel_build
    kernel = tilelang.compile(_copy_program(), target=SM90)
    seen = []
    kernel.adapter.executable = lambda *args: seen.append(args)
    launch = kernel_build.launcher(kernel)
    assert launch is not kernel
    src, dst = torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16)
    kernel(src, dst, 0.5)
    launch(src, dst, 0.5)
    assert len(seen) == 2 and len(seen[0]) == len(seen[1]) == 3
    assert all(a is b or a == b for a, b in zip(*seen)), seen
    with_output = tilelang.compile(_copy_program(), out_idx=[1], target=SM90)
    assert kernel_build.launcher(with_output) is with_output
    stand_in = lambda *args: None  # noqa: E731
    assert kernel_build.launcher(stand_in) is stand_in
