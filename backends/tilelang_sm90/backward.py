"""The sm90 chunked backward (issue 6, docs/sm90-design.md): three TileLang launches after a training forward.

    state_output_narrow.py every chunk's entering state S0: the forward's state pass again, built without output
                       (forward.entering_states; kept from the forward instead with config.keep_states)
    backward_state.py  per (sequence, value head, V tile), chunks right to left: dS on chip; stores every
                       chunk's dS_end (dh), dU, dX (= dV) and dh0
    chunk_grads.py     per (chunk, key head), in parallel, its value heads in turn: dq, dk (summed over the
                       value heads), dg, dbeta from S0, dS_end, dU and dX

then the options' prologue undone (gdnkit.prologue). GVA's sums of dq / dk happen in chunk_grads, in value
head order (bitwise repeatable; no float atomics anywhere). backends/reference/chunked_backward.py
is the definition every stage is checked against.

The fused path (_fused_grads): the reverse pass and the per-chunk gradients in one kernel, backward_fused.py,
after the S0 recompute: dS_end, dU and dX never leave the chip; dq / dk leave it per chunk and value head, in S0's
buffer as the kernel frees it, and are summed over each key head's group here. Where it runs in segments the
recompute goes to a side stream beside the gated route's dS_ends. fused_pays picks it where the work
is large and evenly spread over the programs (faster there: benchmarks/results/h200/backward-paths.md), the staged
path above elsewhere;
GDNKIT_SM90_FUSED_BACKWARD=1 / 0 forces one.

Context parallelism (few long sequences): the forward's segments and routes (_segments). Gated: each segment's
dS_end from a lead-in over at most a window of the chunks after it (lead_in.py, the same norm bound as the
forward's; the reverse pass walking them in place, storing only the dS_ends), checked on the device per (segment,
head), and exactly where it left a pair unsettled (the forward's propagator gives each segment's transition, and
the transitions of flagged neighbours carry the dS_ends: _gated_ds_ends); then the reverse pass per segment.
Chained: the reverse pass per segment walks forward first, as far as the bound needs per head. Where both fit the
SMs, the S0 recompute runs on a side stream beside the reverse pass.
"""
from __future__ import annotations

import functools

import torch

from gdnkit import prologue, seqlayout
from gdnkit.problem import GDNGrads, Problem

from . import context_parallel, forward, lead_in
from .group_sum import chunk_group_sums
from .kernel_build import jitted, kernel_factory
from .forward import TORCH_TO_TL, Saved, entering_states, no_walks, open_gate, propagator_kernel, untouched

# the reverse pass's TMA ring depth (backward_state.py fits 2 stages at 64 columns)
STAGES = 2


def fused_pays(s: Saved) -> bool:
    """Whether this call's backward runs the fused kernel (backward_fused.py: the reverse pass with the per-chunk
    gradients, one launch after the S0 recompute) or the staged one (backward_state + chunk_grads): the plan's
    (plan.fused_pays; config.fused_backward, GDNKIT_SM90_FUSED_BACKWARD=1 / 0, forces one)."""
    return s.plan.fused_backward


@kernel_factory
def backward_state_kernel(H: int, HV: int, dtype: str, has_dht: bool, store_dh0: bool, block_v: int,
                          chained: bool = False, ds_only: bool = False):
    """The reverse pass: backward_state.py at 32 / 64 columns; at 128 backward_state_wide.py, with the same
    arguments. ds_only: only dh0 is stored (the gated route's lead-in and exact passes)."""
    if block_v == 128:
        return jitted("backward_state_wide")(H, HV, dtype, has_dht=has_dht, store_dh0=store_dh0, chained=chained,
                                           ds_only=ds_only)
    return jitted("backward_state")(H, HV, dtype, has_dht=has_dht, store_dh0=store_dh0, block_v=block_v, stages=STAGES,
                     chained=chained, ds_only=ds_only)


@kernel_factory
def chunk_grads_kernel(H: int, HV: int, dtype: str, grads_dtype: str):
    return jitted("chunk_grads")(H, HV, dtype, grads_dtype=grads_dtype)


@kernel_factory
def backward_fused_kernel(H: int, HV: int, dtype: str, has_dinit: bool, store_dh0: bool):
    return jitted("backward_fused")(H, HV, dtype, has_dinit=has_dinit, store_dh0=store_dh0)


def _segments(s: Saved):
    """(segment plan, route) where the reverse pass runs in segments, else None: the forward's segments and route
    (the plan's backward_route), run right to left. The wide route's segments take the chained route; elsewhere
    the gated route where the exact route pays, else the chained one; the exact route alone where the lead-in is
    off (config.lead_in_route)."""
    p = s.plan
    if p.backward_route in (None, "plain"):
        return None
    return context_parallel.plan_segments(s.layout, p.segment_chunks, p.window), p.backward_route


def _exact_ds_ends(problem: Problem, s: Saved, plan, do, dht, need=None, lead_in_states=None):
    """(dS_end of every segment, the sequences' dh0 or None), exactly: each segment's transition P (the
    forward's propagator), its dS at the start from a zero dS_end (F: the reverse pass per segment storing
    nothing else, ds_only), then the reverse segment scan dS_end_{j-1} = P_j^T dS_end_j + F_j. need ([n_seg, HV]
    int32) and lead_in_states (the gated route): only the pairs need marks get P and F, the scan takes
    lead_in_states' dS_end elsewhere, writing the others over lead_in_states (in place: where nothing is flagged
    the launch moves no state), and dh0 is left to the caller."""
    H, HV, K, V = s.k.shape[2], problem.HV, problem.K, problem.V
    dev, dt, n_seg = do.device, TORCH_TO_TL[problem.dtype], plan.segments.n_seg
    gate = open_gate(dev, HV) if need is None else need
    aug = torch.empty(n_seg, HV, K, V + K, device=dev, dtype=torch.float32)
    propagator_kernel(H, HV, dt)(s.k, s.a, s.v, s.gamma, plan.segments.cu_seqlens, plan.chunk_offsets, aug, gate)
    f = torch.empty(n_seg, HV, K, V, device=dev, dtype=torch.float32)
    backward_state_kernel(H, HV, dt, False, True, s.plan.ds_only_block_v, False, True)(
        s.q, s.k, s.a, do, s.gamma, plan.segments.cu_seqlens, plan.chunk_offsets, _placeholder(dev, HV, K, V),
        *_untouched(dev, s.v.dtype), f, float(problem.scale), gate, *_no_walks(dev, HV))
    return context_parallel.segment_states(plan, aug, dht, problem.N, s.h0 is not None and need is None, s.k.dtype,
                                           f=f, need=need, lead_in_states=lead_in_states,
                                           in_place=lead_in_states is not None)


def _placeholder(dev: torch.device, HV: int, K: int, V: int) -> torch.Tensor:
    """A state argument never read nor written."""
    return untouched(dev, torch.float32, 1, HV, K, V)


def _untouched(dev: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """du, dv and dh for a ds_only pass, which declares them (1, 1, 1, 1) and never touches them."""
    stub = untouched(dev, dtype, 1, 1, 1, 1)
    return stub, stub, stub


def _no_walks(device: torch.device, HV: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reverse pass's walk arguments where it does not walk (never read)."""
    walk, bound = no_walks(device, HV)
    return walk, bound, bound


def _gated_ds_ends(problem: Problem, s: Saved, plan, do, dht) -> torch.Tensor:
    """dS_end of every segment, graph-safe: the reverse lead-in over the fewest of min(window, available) chunks
    after each segment that settle each head (lead_in.reverse_lead_in), read in place by the reverse pass walking
    from each segment's end (ds_only, chained: no gather, nothing stored but the dS_ends), and the exact route
    behind it, run only for the (segment, head) pairs whose predecessor the window left outside the bound (the
    same search's flags)."""
    H, HV, K, V = s.k.shape[2], problem.HV, problem.K, problem.V
    dev, n_seg, w = do.device, plan.segments.n_seg, plan.walks
    walk, need = lead_in.reverse_lead_in(plan.lead_in, s.g, s.k, s.beta, plan.window, s.row_bounds,
                                       log_bound=s.plan.config.log_bound)
    lead_in_states = torch.empty(n_seg, HV, K, V, device=dev, dtype=torch.float32)
    kernel = backward_state_kernel(H, HV, TORCH_TO_TL[problem.dtype], dht is not None, True,
                                   s.plan.ds_only_block_v, True, True)
    kernel(s.q, s.k, s.a, do, s.gamma, plan.segments.cu_seqlens, plan.chunk_offsets,
           _placeholder(dev, HV, K, V) if dht is None else dht.index_select(0, w.seq_of),
           *_untouched(dev, s.v.dtype), lead_in_states, float(problem.scale), open_gate(dev, HV), walk, w.after,
           w.seq_end)
    return _exact_ds_ends(problem, s, plan, do, dht, need, lead_in_states)[0]


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


def _fork(dev: torch.device) -> torch.cuda.Stream:
    """The side stream of dev, ordered behind the work queued so far on the current one (the caller joins it with
    torch.cuda.current_stream(dev).wait_stream before reading what it wrote)."""
    side = _side_stream(dev.index if dev.index is not None else torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream(dev))
    return side


def _recompute_beside(problem: Problem, s: Saved, dev: torch.device):
    """(every chunk's S0, the stream it is being made on) where the recompute runs beside the reverse pass, else
    None. The recompute of S0 (the forward's state pass again, forward.entering_states) does not feed the reverse
    pass, and both are chains of few programs: where both fit the SMs together at 64-wide V tiles (16/32 1x32768
    without segments: 64 + 64 CTAs on 132 SMs, one per SM each), the recompute goes to a side stream and
    chunk_grads, the first to read S0, waits for it (H200: backward 3.66 -> 3.49 ms there). Elsewhere
    the planned 32-wide tiles already fill the SMs, and the recompute runs just before chunk_grads, which then
    finds S0 in L2 where it fits (4/8 1x8192: 33 MB; running it first cost ~0.03 ms). hs is allocated on the
    calling stream before the fork and every use after the join is ordered behind the side stream's work, so its
    memory is never handed out while the side stream writes it (also under CUDA graph capture)."""
    # the plan's recompute_beside counts every launch, also the one of a wide-route forward's pair that the device
    # left over empty sequences (which one it picked is not known here without a read back)
    if s.hs is not None or dev.type != "cuda" or not s.plan.recompute_beside:
        return None
    hs = torch.empty(s.layout.n_chunks, problem.HV, problem.K, problem.V, device=dev, dtype=s.k.dtype)
    side = _fork(dev)
    with torch.cuda.stream(side):
        entering_states(problem, s, out=hs, block_v=64)
    return hs, side


def no_chunk_grads(problem: Problem, do: torch.Tensor, dht: torch.Tensor | None) -> GDNGrads:
    """The gradients of a training call with no chunk at all (T = 0, or every sequence empty: the forward keeps
    nothing): no token reaches an output, and each final state is its initial state, so dh0 = dht."""
    B, T, HV, V = problem.B, problem.T, problem.HV, problem.V
    zeros = lambda *shape, dtype=torch.float32: torch.zeros(*shape, device=do.device, dtype=dtype)  # noqa: E731
    dh0 = None
    if problem.has_initial_state:
        dh0 = zeros(*problem.state_shape) if dht is None else dht.float().clone()
    per_head = lambda flag: zeros(HV) if flag else None  # noqa: E731
    return GDNGrads(dq=zeros(B, T, problem.H, problem.K, dtype=problem.dtype),
                    dk=zeros(B, T, problem.H, problem.K, dtype=problem.dtype), dv=zeros(B, T, HV, V, dtype=problem.dtype),
                    dg=zeros(B, T, HV), dbeta=zeros(B, T, HV), dinitial_state=dh0,
                    dA_log=per_head(problem.use_gate_in_kernel), ddt_bias=per_head(problem.has_dt_bias))


def backward(problem: Problem, saved: Saved, do: torch.Tensor, dht: torch.Tensor | None) -> GDNGrads:
    """Gradients w.r.t. the user's inputs (in their dtypes) for the output gradient do [B, T, HV, V] and the
    final-state gradient dht (None: zero)."""
    if saved is None:
        return no_chunk_grads(problem, do, dht)
    s = saved
    B, T = do.shape[:2]
    total, H, K = s.q.shape[1], s.q.shape[2], s.q.shape[3]
    HV, V = problem.HV, problem.V
    do = do.reshape(1, total, HV, V).to(s.v.dtype).contiguous()
    if dht is not None:
        dht = dht.float()
        dht = (dht.transpose(-1, -2) if problem.state_v_first else dht).contiguous()
    fused = fused_pays(s)
    dq, dk, dv, dg, dbeta, dh0 = (_fused_grads if fused else _staged_grads)(problem, s, do, dht)
    dq, dk = dq.view(B, T, H, K), dk.view(B, T, H, K)
    dg, dbeta, dv = dg.view(B, T, HV), dbeta.view(B, T, HV), dv.view(B, T, HV, V)
    normed = fused and _sums_take_l2norm(problem, s)   # the group sums ran the qk l2norm's backward
    # the fused path's group sums ran the gate floor's backward too (_fused_grads)
    dq, dk, dg, dbeta, dA_log, ddt_bias = prologue.backward(problem, s.stash, dq, dk, dg, dbeta, s.A_log,
                                                           s.dt_bias, qk_normed=normed, gate_floored=fused)
    if dh0 is not None and problem.state_v_first:
        dh0 = dh0.transpose(-1, -2)
    return prologue.grads_in_input_dtypes(s.dtypes, dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)


def _first_segments(dh0_seg: torch.Tensor, plan, layout, dht: torch.Tensor | None) -> torch.Tensor:
    """The sequences' dh0 from a pass over segments' dS at each segment's start: each sequence's first segment's;
    a sequence without tokens passes dht through."""
    dh0 = dh0_seg[plan.segments.seg_offsets[:-1].long().clamp_max(plan.segments.n_seg - 1)]
    empty = [n for n, length in enumerate(layout.lengths) if length == 0]
    if empty:
        dh0[empty] = 0.0 if dht is None else dht[empty]
    return dh0


def _grads_dtype(problem: Problem, s: Saved) -> tuple[torch.dtype, str]:
    """What dq / dk are returned in by the kernels: the inputs' dtype where nothing follows but the cast to it
    (rounded once, after their fp32 sums), fp32 where the l2norm backward still runs on them."""
    qk = s.dtypes["q"] if s.dtypes["q"] == s.dtypes["k"] and not problem.use_qk_l2norm_in_kernel else torch.float32
    return (qk, TORCH_TO_TL[qk]) if qk in TORCH_TO_TL else (torch.float32, "float32")


def _sums_take_l2norm(problem: Problem, s: Saved) -> bool:
    """Whether the fused path's group sums also run the qk l2norm's backward (group_sum.chunk_group_sums' l2norm),
    writing dq / dk w.r.t. the raw q / k in their dtype: where the option is on and q and k share a dtype the
    sums can write."""
    return problem.use_qk_l2norm_in_kernel and s.dtypes["q"] == s.dtypes["k"] and s.dtypes["q"] in TORCH_TO_TL


def _staged_grads(problem: Problem, s: Saved, do: torch.Tensor, dht: torch.Tensor | None):
    """(dq, dk, dv, dg, dbeta, dh0) packed, by backward_state (or its wide form) and chunk_grads."""
    layout = s.layout
    total, H, K = s.q.shape[1], s.q.shape[2], s.q.shape[3]
    HV, V, N = problem.HV, problem.V, problem.N
    dev = do.device
    dt = TORCH_TO_TL[problem.dtype]
    placeholder = _placeholder(dev, HV, K, V)
    store_dh0 = s.h0 is not None

    # the reverse pass: rows the kernels leave unwritten (past cu_seqlens[-1]) are zero, since the per-chunk
    # kernel's TMA boxes read them
    du = seqlayout.packed_output((1, total, HV, V), layout.cu_seqlens, device=dev, dtype=s.v.dtype)
    dv = seqlayout.packed_output((1, total, HV, V), layout.cu_seqlens, device=dev, dtype=s.v.dtype)
    dh = torch.empty(layout.n_chunks, HV, K, V, device=dev, dtype=s.v.dtype)
    plan = _segments(s)
    beside = _recompute_beside(problem, s, dev)
    block_v = 64 if beside else s.plan.reverse_block_v
    if plan is None:
        dh0 = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if store_dh0 else None
        kernel = backward_state_kernel(H, HV, dt, dht is not None, store_dh0, block_v)
        kernel(s.q, s.k, s.a, do, s.gamma, layout.cu_seqlens, layout.chunk_offsets,
               placeholder if dht is None else dht, du, dv, dh, placeholder if dh0 is None else dh0,
               float(problem.scale), open_gate(dev, HV), *_no_walks(dev, HV))
    else:
        # context parallelism: every segment's dS_end (by a lead-in over the chunks after it, exactly, or the
        # gated pair of both), then the reverse pass per segment from those; chained: the pass over segments
        # walks forward as far as each (segment, head) needs (lead_in.walk_lengths), from the sequence's dht where
        # it reaches the sequence's end
        plan, route = plan
        n_seg = plan.segments.n_seg
        walks = None
        if route == "chained":
            w = plan.walks
            walks = (lead_in.walk_lengths(plan.lead_in, s.g, s.k, s.beta, reverse=True, row_sums=s.row_bounds,
                                         log_bound=s.plan.config.log_bound), w.after, w.seq_end)
            ds_end, dh0 = None if dht is None else dht.index_select(0, w.seq_of), None
        elif route == "gated":
            ds_end, dh0 = _gated_ds_ends(problem, s, plan, do, dht), None
        else:
            ds_end, dh0 = _exact_ds_ends(problem, s, plan, do, dht)
        # dh0 from the pass over segments (each sequence's first segment) where the route gave none
        dh0_seg = torch.empty(n_seg, HV, K, V, device=dev, dtype=torch.float32) \
            if store_dh0 and dh0 is None else None
        kernel = backward_state_kernel(H, HV, dt, ds_end is not None, dh0_seg is not None, block_v,
                                       walks is not None)
        kernel(s.q, s.k, s.a, do, s.gamma, plan.segments.cu_seqlens, plan.chunk_offsets,
               placeholder if ds_end is None else ds_end, du, dv, dh,
               placeholder if dh0_seg is None else dh0_seg, float(problem.scale), open_gate(dev, HV),
               *(walks or _no_walks(dev, HV)))
        if dh0_seg is not None:
            dh0 = _first_segments(dh0_seg, plan, layout, dht)

    # the parallel part, per key head; GVA's sums of dq / dk happen there, in value head order
    qk, qk_tl = _grads_dtype(problem, s)
    dq = seqlayout.packed_output((1, total, H, K), layout.cu_seqlens, device=dev, dtype=qk)
    dk = seqlayout.packed_output((1, total, H, K), layout.cu_seqlens, device=dev, dtype=qk)
    dg = seqlayout.packed_output((1, total, HV), layout.cu_seqlens, device=dev, dtype=torch.float32)
    dbeta = seqlayout.packed_output((1, total, HV), layout.cu_seqlens, device=dev, dtype=torch.float32)
    if beside:
        hs, side = beside
        torch.cuda.current_stream(dev).wait_stream(side)
    else:
        hs = entering_states(problem, s)  # recomputed here unless the forward kept them (config.keep_states)
    chunk_grads_kernel(H, HV, dt, qk_tl)(s.q, s.k, s.v, do, du, dv, s.a, s.tm, s.gamma, s.beta, hs, dh,
                                         layout.cu_seqlens, layout.chunk_indices, dq, dk, dg, dbeta,
                                         float(problem.scale))
    return dq, dk, dv, dg, dbeta, dh0


def _fused_grads(problem: Problem, s: Saved, do: torch.Tensor, dht: torch.Tensor | None):
    """(dq, dk, dv, dg, dbeta, dh0) packed, by backward_fused.py after the S0 recompute. dq and dk leave the kernel
    per chunk and value head in S0's buffer (backward_fused.py's docstring); each key head's group is summed here,
    in value head order, while that buffer holds them: the per-value-head gradients add nothing to the backward's
    peak (tensors of their own would be 2 x 128 MB at 16/32 1x32768)."""
    dqk, dv, dg, dbeta, dh0, runs = _fused_kernel_outputs(problem, s, do, dht)
    st = s.stash
    # the sums' launch also takes the gate floor's backward on dg (backward() tells the prologue it ran)
    floor = (st["g_unfloored"], dg)
    if _sums_take_l2norm(problem, s):
        dq, dk = chunk_group_sums(dqk, s.layout, s.q.shape[2], s.q.shape[1], s.dtypes["q"], runs,
                                  (st["q_raw"], st["q_rstd"], st["k_raw"], st["k_rstd"]), gate_floor=floor)
    else:
        qk, _ = _grads_dtype(problem, s)
        dq, dk = chunk_group_sums(dqk, s.layout, s.q.shape[2], s.q.shape[1], qk, runs, gate_floor=floor)
    return dq, dk, dv, dg, dbeta, dh0


def _fused_kernel_outputs(problem: Problem, s: Saved, do: torch.Tensor, dht: torch.Tensor | None):
    """(dqk: dq, dk per chunk and value head; dv, dg, dbeta, dh0 packed; the kernel's runs as
    group_sum.chunk_group_sums takes them) from the fused kernel. Where one program
    per (sequence, head) leaves SMs idle, the sequences run in the wide route's segments
    (the plan's wide route), each from its dS_end by the gated route (_gated_ds_ends: a reverse lead-in,
    exact where it does not settle)."""
    layout = s.layout
    total, H, K = s.q.shape[1], s.q.shape[2], s.q.shape[3]
    HV, V, N = problem.HV, problem.V, problem.N
    dev = do.device
    dt = TORCH_TO_TL[problem.dtype]
    cu = layout.cu_seqlens
    dv = seqlayout.packed_output((1, total, HV, V), cu, device=dev, dtype=s.v.dtype)
    dg = seqlayout.packed_output((1, total, HV), cu, device=dev, dtype=torch.float32)
    dbeta = seqlayout.packed_output((1, total, HV), cu, device=dev, dtype=torch.float32)
    # S0's buffer: S0 from the recompute, then the kernel's dq / dk as it frees each slot. The recompute runs even
    # where the forward kept S0 (keep_states), for X, which it leaves in dv's buffer: the kernel reads each chunk's
    # X before it stores that chunk's dV (backward_fused.py), so X costs no memory of its own
    buf = torch.empty(layout.n_chunks, HV, K, V, device=dev, dtype=s.k.dtype)
    seg = s.plan.fused_segment_chunks
    placeholder = _placeholder(dev, HV, K, V)
    # in segments, the segments' dS_ends (the gated route: its search, lead-in and exact kernels, ~0.03 ms of mostly
    # latency-bound launches) need nothing the recompute makes: on CUDA the recompute runs on a side stream beside
    # them, its outputs allocated here before the fork and read after the join (as _recompute_beside). At one
    # program an SM the recompute held 128 SMs' registers and the route's small launches took the rest and the gaps
    # (H200, bench's (fwd+bwd) - fwd: -5% / -2% / -3% / -1% at 4/8 1x8192, 4/8 1x32768, 16/32 1x8192,
    # 16/32 1x32768; eager profiles then count the route's kernels over their stretched spans); at two an SM
    # its programs leave no SM whole for the route's 128-column pass until they end, and the backward is still
    # 2.5-4% faster than at one
    side = _fork(dev) if seg and dev.type == "cuda" else None
    with torch.cuda.stream(side):   # None: the current stream
        forward.entering_states_and_x(problem, s, buf, dv)
    if seg:
        plan = context_parallel.plan_segments(layout, seg, s.plan.window)
        dinit = _gated_ds_ends(problem, s, plan, do, dht)
        cu_run, offsets, n_run, longest = plan.segments.cu_seqlens, plan.chunk_offsets, plan.segments.n_seg, seg
    else:
        plan, dinit, cu_run, offsets, n_run = None, dht, cu, layout.chunk_offsets, N
        longest = max(layout.chunk_counts)
    if side is not None:
        torch.cuda.current_stream(dev).wait_stream(side)
    # a slot of S0 [K, V] is dq's and dk's [64, K] rows (K = V = 128)
    dqk = buf.view(layout.n_chunks, HV, 2, seqlayout.CHUNK, K)
    store_dh0 = s.h0 is not None
    dh0 = torch.empty(n_run, HV, K, V, device=dev, dtype=torch.float32) if store_dh0 else None
    backward_fused_kernel(H, HV, dt, dinit is not None, store_dh0)(
        s.q, s.k, dv, do, s.a, s.tm, buf, s.gamma, s.beta, cu_run, offsets,
        placeholder if dinit is None else dinit, dqk, dv, dg, dbeta,
        placeholder if dh0 is None else dh0, float(problem.scale))
    if plan is not None and dh0 is not None:
        dh0 = _first_segments(dh0, plan, layout, dht)
    return dqk, dv, dg, dbeta, dh0, (cu_run, offsets, longest)

