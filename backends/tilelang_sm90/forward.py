"""The sm90 chunked forward: two TileLang launches, intra_chunk.py then the state pass fused with the output.

    forward(problem, inputs) -> (o [B, T, HV, V] in v's dtype, final state or None)

Every call runs on the packed (varlen) form: a dense batch [B, T] is viewed as B sequences of T tokens
packed into [1, B*T], so one build serves both. Kernels are compiled once per (H, HV, dtype, options) --
options being initial/final state and the state pass's V tile (32/64, picked from N * HV against the
SM count: at most two builds per key). Token count, sequence count and chunk count are symbolic
(T.dynamic) in every kernel, and `scale` is a runtime argument.

The intra kernel writes Tb = T diag(beta) (64 values per token and value head) and gamma; the state pass
makes the chunk's new values U = Tb (V - diag(Gamma) K S) on chip (H200, session 4: 16/64 1x32768 2.38 ->
2.16 ms against writing W and U' and reading them back). It has two kernels, picked by the V tile:
- BV = 32 / 64, the plan's: state_output_ws.py, three warpgroups (TMA producer, state chain, output), so
  chunk i's output overlaps chunk i + 1's state update.
- BV = 128, forced only (BLOCK_V): state_output.py, one consumer pair on TileLang's pipeliner; its 128-wide
  tile reads Q, K and Tb once per head. The plan took it for N * HV >= 70% of the SMs until the per-row
  decays made the three-warpgroup kernel faster there too (H200, 2026-11-29, forward ms, BV 128 / 64):
  16/64 4096x8 1.673 / 1.536, 4x8192 1.666 / 1.542; 8/32 4096x8 0.842 / 0.775; 4/16 4096x8 0.424 / 0.389.
Few long sequences also get context parallelism (context_parallel.py), whose TileLang propagator reads the
same K, Tb, V and gamma.

The API options not fused into the kernels yet (qk l2norm, in-kernel gate, beta sigmoid, state_v_first)
run as a small PyTorch prologue/epilogue using gdnkit.prep's math.
"""
import functools

import torch

from gdnkit import prep, seqlayout
from gdnkit.problem import GDNInputs, Problem

from . import context_parallel

CHUNK = 64
# wgmma and TMA need the arch-specific sm_90a target (plain sm_90 has neither).
TARGET = {"kind": "cuda", "arch": "sm_90a"}
TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Launch settings of the state pass, for tuning from benchmarks.
# V tile per program: None = plan from the SM count (_plan_block_v), or force 32 / 64 / 128 (tests).
BLOCK_V = None
WS_BLOCK_V = (32, 64)  # V tiles run by the three-warpgroup kernel (state_output_ws.py)
# its TMA ring depth per V tile (H200, run 3 of session 4, state kernel ms at 3 / 2 stages): 4/16 1x32768
# (BV = 32) 0.784 / 0.874; 16/64 1x32768 (BV = 64) 1.399 / 1.342
WS_STAGES = {32: 3, 64: 2}
# the pipelined kernel at BV = 128: S [128, 128] fp32 needs two consumer warpgroups to stay spill-free
# (ptxas: 168 registers, no spills at 256 threads)
PIPELINED_THREADS = 256
NUM_STAGES = 2    # its TMA pipeline depth
# the state pass has N * HV * (V / BV) programs, each walking a whole sequence: narrower V tiles buy
# parallelism when (sequences x heads) leave SMs idle (FlashQLA's rule: aim at ~70% of the SMs)
TARGET_SM_FRACTION = 0.7


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count_of(device: torch.device) -> int:
    """The device's SM count (0 off CUDA: no context parallelism there)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 0


def _segment_chunks(layout, HV: int, device: torch.device) -> int | None:
    if not context_parallel.available():
        return None
    return context_parallel.segment_chunks(layout, HV, _sm_count_of(device))


def _plan_block_v(N: int, HV: int, device: torch.device) -> int:
    if BLOCK_V is not None:
        return BLOCK_V
    target = TARGET_SM_FRACTION * _sm_count_of(device)
    return 64 if 2 * N * HV >= target else 32


@functools.lru_cache(maxsize=None)
def _jit():
    """The tilelang.jit wrappers, built on first use (importing this module needs no tilelang)."""
    import tilelang

    from . import intra_chunk, propagator, state_output, state_output_ws

    def jit(module, program):
        return tilelang.jit(program, target=TARGET, pass_configs=module.PASS_CONFIGS)

    return (jit(intra_chunk, intra_chunk.intra_chunk_program),
            jit(state_output, state_output.state_output_program),
            jit(state_output_ws, state_output_ws.state_output_program),
            jit(propagator, propagator.propagator_program))


@functools.lru_cache(maxsize=None)
def intra_chunk_kernel(H: int, HV: int, dtype: str):
    """Compiled once per key; tilelang.jit also keeps its own disk cache across processes."""
    return _jit()[0](H, HV, dtype)


@functools.lru_cache(maxsize=None)
def state_output_kernel(H: int, HV: int, dtype: str, has_initial_state: bool, store_final_state: bool,
                        block_v: int):
    """The state pass for a V tile: three warpgroups below 128 columns, the pipelined kernel at 128."""
    if block_v in WS_BLOCK_V:
        return _jit()[2](H, HV, dtype, has_initial_state=has_initial_state, store_final_state=store_final_state,
                         block_v=block_v, stages=WS_STAGES[block_v])
    return _jit()[1](H, HV, dtype, has_initial_state=has_initial_state, store_final_state=store_final_state,
                     block_v=block_v, num_stages=NUM_STAGES, threads=PIPELINED_THREADS)


@functools.lru_cache(maxsize=None)
def propagator_kernel(H: int, HV: int, dtype: str):
    """Context parallelism's segment transitions [E | P], in 64-wide column tiles."""
    return _jit()[3](H, HV, dtype, block_v=64)


def _prologue(problem: Problem, q, k, g, beta, A_log, dt_bias):
    """The in-kernel options as PyTorch (not fused yet): q, k in their dtype, g and beta fp32."""
    if problem.use_qk_l2norm_in_kernel:
        q, k = prep.l2norm(q.float()).to(q.dtype), prep.l2norm(k.float()).to(k.dtype)
    g = g.float()
    if problem.use_gate_in_kernel:
        g = prep.gate(g, A_log.float(), None if dt_bias is None else dt_bias.float())
    beta = beta.float()
    if problem.use_beta_sigmoid_in_kernel:
        beta = prep.beta_activation(beta, problem.allow_neg_eigval)
    return q, k, g, beta


def forward(problem: Problem, inputs: GDNInputs, intermediates: dict | None = None):
    """(o, final state). Pass a dict as `intermediates` to get the intra-chunk kernel's outputs back in it
    (packed: a = T diag(beta) [1, B*T, HV, 64], gamma [HV, num_chunks * 64], one row of 64 per chunk) for
    stage-by-stage checks."""
    q, k, v, g, beta, h0, A_log, dt_bias, cu = inputs
    if problem.dtype not in TORCH_TO_TL:
        raise TypeError(f"tilelang_sm90 takes bfloat16/float16 inputs, got {problem.dtype}")
    if problem.K != 128 or problem.V != 128:
        raise ValueError(f"tilelang_sm90 is built for K = V = 128, got K={problem.K}, V={problem.V}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = problem.N
    dev = q.device
    q, k, g, beta = _prologue(problem, q, k, g, beta, A_log, dt_bias)

    # packed form [1, B*T]; the chunk tables come from the layout cache (no host read after the first call
    # with a given cu_seqlens tensor, none at all for a dense batch)
    layout = seqlayout.dense_layout(B, T, dev) if cu is None else seqlayout.sequence_layout(cu)
    total = B * T
    q, k = (x.reshape(1, total, H, K).contiguous() for x in (q, k))
    v = v.reshape(1, total, HV, V).contiguous()
    g, beta = (x.reshape(1, total, HV).contiguous() for x in (g, beta))
    if h0 is not None:
        h0 = h0.float()
        h0 = (h0.transpose(-1, -2) if problem.state_v_first else h0).contiguous()

    # the kernels write every token of every sequence; tokens past cu_seqlens[-1] get 0, as the reference's
    o = seqlayout.packed_output((1, total, HV, V), cu, device=dev, dtype=v.dtype)
    chunk_table = layout.chunk_indices
    if layout.n_chunks == 0:  # no tokens in any sequence: nothing to launch
        ht = None
        if problem.output_final_state:
            ht = h0.clone() if h0 is not None else torch.zeros(N, HV, K, V, device=dev, dtype=torch.float32)
    else:
        dt = TORCH_TO_TL[problem.dtype]
        a = torch.empty(1, total, HV, CHUNK, device=dev, dtype=k.dtype)
        # gamma: one row of 64 per chunk-table entry (intra_chunk.py says why not token-contiguous)
        gamma = torch.empty(HV, layout.n_chunks, CHUNK, device=dev, dtype=torch.float32)
        intra_chunk_kernel(H, HV, dt)(k, g, beta, layout.cu_seqlens, chunk_table, a, gamma)
        placeholder = torch.empty(1, HV, K, V, device=dev, dtype=torch.float32)  # an argument never read
        seg = _segment_chunks(layout, HV, dev)
        if seg:
            # context parallelism: the segments' transitions [E | P] (TileLang propagator), their initial
            # states by the segment scan, then the output pass over segments
            plan = context_parallel.plan_segments(layout, seg)
            aug = torch.empty(plan.segments.n_seg, HV, K, V + K, device=dev, dtype=torch.float32)
            propagator_kernel(H, HV, dt)(k, a, v, gamma, plan.segments.cu_seqlens, plan.chunk_offsets, aug)
            s0, ht = context_parallel.segment_states(plan, aug, h0, N, problem.output_final_state, k.dtype)
            n_seg = plan.segments.n_seg
            kernel = state_output_kernel(H, HV, dt, True, False, _plan_block_v(n_seg, HV, dev))
            kernel(q, k, a, v, gamma, plan.segments.cu_seqlens, plan.chunk_offsets, s0, o, placeholder,
                   float(problem.scale))
        else:
            ht = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if problem.output_final_state else None
            kernel = state_output_kernel(H, HV, dt, h0 is not None, problem.output_final_state,
                                         _plan_block_v(N, HV, dev))
            kernel(q, k, a, v, gamma, layout.cu_seqlens, layout.chunk_offsets, placeholder if h0 is None else h0, o,
                   placeholder if ht is None else ht, float(problem.scale))
        if intermediates is not None:
            intermediates.update(a=a, gamma=gamma.reshape(HV, -1))

    o = o.reshape(B, T, HV, V)
    if ht is not None and problem.state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht
