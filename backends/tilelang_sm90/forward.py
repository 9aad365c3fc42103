"""The sm90 chunked forward: two TileLang launches, intra_chunk.py then the state pass fused with the output.

    forward(problem, inputs) -> (o [B, T, HV, V] in v's dtype, final state or None, Saved or None)

Every call runs on the packed (varlen) form: a dense batch [B, T] is viewed as B sequences of T tokens
packed into [1, B*T], so one build serves both. Kernels are compiled once per (H, HV, dtype, options) --
options being initial/final state and the state pass's V tile (32 / 64 / 128, picked from N * HV against the
SM count: at most three builds per key). Token count, sequence count and chunk count are symbolic
(T.dynamic) in every kernel, and `scale` is a runtime argument.

The intra kernel writes Tb = T diag(beta) (64 values per token and value head) and gamma; the state pass
makes the chunk's new values U = Tb (V - diag(Gamma) K S) on chip (H200, docs/performance.md: 16/64 1x32768 2.38 ->
2.16 ms against writing W and U' and reading them back). Its kernels, picked by the V tile:
- BV = 32 / 64: state_output_narrow.py, three warpgroups (TMA producer, state chain, output), so chunk i's
  output overlaps chunk i + 1's state update. Passes that store S0 (training) always run here.
- BV = 128 for an inference pass with one program per (sequence, head) filling >= 70% of the SMs:
  state_output_wide.py, split by product (owner of S, x making U = U' - W S, output + loads), which reads
  Q, K and Tb once per head and keeps two products on the chain (H200, docs/performance.md, state pass ms, wide / BV 64:
  16/64 4096x8 0.723 / 1.045, 8/32 0.365 / 0.524, 4/16 0.185 / 0.264; with 64 programs it loses: 2/8 4096x8
  0.179 / 0.135 at BV 32, 16/64 1x32768 1.393 / 1.035).
- BV = 128 forced (config.block_v) for training: state_output_pipelined.py, one consumer pair on TileLang's
  pipeliner.
Few long sequences also get context parallelism (context_parallel.py): segments whose initial states come
from a short lead-in through the same state kernel where the gates decay (lead_in.py), else from the TileLang
propagator and a segment scan (the gated route), or from the state pass itself, each program walking back over
the chunks before its segment as far as the decay bound needs (the chained route).

The API options not fused into the kernels yet (qk l2norm, in-kernel gate, beta sigmoid, state_v_first)
run as a small PyTorch prologue/epilogue (gdnkit/prologue.py, whose backward backward.py uses).
"""
import dataclasses
import functools

import torch

from gdnkit import prologue, seqlayout
from gdnkit.problem import GDNInputs, Problem

from . import config, context_parallel, lead_in, plan as planner
from .kernel_build import jitted, kernel_factory
from .plan import NARROW_BLOCK_V, Plan

CHUNK = 64
# wgmma and TMA need the arch-specific sm_90a target (plain sm_90 has neither).
TARGET = {"kind": "cuda", "arch": "sm_90a"}
TORCH_TO_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

# Launch settings of the state pass (the planning knobs are config.Config's, the V tiles plan.py's)
# its TMA ring depth per V tile (H200, docs/performance.md, state kernel ms at 3 / 2 stages): 4/16 1x32768
# (BV = 32) 0.784 / 0.874; 16/64 1x32768 (BV = 64) 1.399 / 1.342
NARROW_STAGES = {32: 3, 64: 2}
# the pipelined kernel at BV = 128: S [128, 128] fp32 needs two consumer warpgroups to stay spill-free
# (ptxas: 168 registers, no spills at 256 threads)
PIPELINED_THREADS = 256
NUM_STAGES = 2    # its TMA pipeline depth


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count_of(device: torch.device) -> int:
    """The device's SM count (0 off CUDA: no context parallelism there)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 0


def plan_of(problem: Problem, layout, device: torch.device) -> Plan:
    """The call's Plan (plan.py) under the current Config (config.current())."""
    resources = planner.Resources(_sm_count_of(device), context_parallel.available())
    return planner.plan(problem, layout, resources, config.current())


def _initial_states(p: Plan, plan, k, a, v, gamma, g, beta, h0, problem: Problem, intermediates,
                    row_bounds: torch.Tensor | None = None):
    """(the segments' initial states, the route, the chained route's walks or None), or (None, None, None) for
    no segments; nothing is read back, so CUDA graphs capture every route. Where the exact route pays
    (plan.exact_route_pays): the gated route, a lead-in of fixed length for every segment, the
    device's flags of the (segment, head) pairs it left outside the bound, and the exact route's kernels launched
    behind it and run only for those (the segment scan takes each lead-in state or the transition's); the initial
    states are [n_seg, HV, K, V] fp32. Elsewhere the chained route: the walks (lead_in.walk_lengths) go to the
    pass over segments, whose programs walk their lead-in inline (state_output_narrow.py); the initial states are
    each segment's sequence's h0 (None without one), for walks that reach the sequence's start. The route is the
    plan's. row_bounds: the walks' chunk sums as the intra kernel wrote them (emit_bound), else the search sums them."""
    dev, H, HV, K, V, N = k.device, k.shape[2], problem.HV, problem.K, problem.V, problem.N
    dt = TORCH_TO_TL[problem.dtype]
    log_bound = p.config.log_bound
    if p.initial_states == "chained":
        walk = lead_in.walk_lengths(plan.lead_in, g, k, beta, row_sums=row_bounds, log_bound=log_bound)
        if intermediates is not None:
            intermediates.update(walk_lengths=walk)
        init = None if h0 is None else h0.index_select(0, plan.walks.seq_of)
        return init, "chained", (walk, plan.walks.before)
    if p.initial_states == "gated":
        lead_in_states = lead_in.run_states(plan.gated, h0, (HV, K, V), dev,
                                            _lead_in_runner(p, problem, k, a, v, gamma))
        need = lead_in.transitions_needed(plan.lead_in, g, k, beta, plan.window, log_bound=log_bound)
        if intermediates is not None:
            intermediates.update(transitions_needed=need)
        gate, route = need, "gated"
    else:
        lead_in_states, need, gate, route = None, None, open_gate(dev, HV), "exact"
    aug = torch.empty(plan.segments.n_seg, HV, K, V + K, device=dev, dtype=torch.float32)
    propagator_kernel(H, HV, dt)(k, a, v, gamma, plan.segments.cu_seqlens, plan.chunk_offsets, aug, gate)
    s0, _ = context_parallel.segment_states(plan, aug, h0, N, False, k.dtype, need=need,
                                            lead_in_states=lead_in_states)
    return s0, route, None


# Arguments no kernel writes are made once per (device, shape) and shared by every launch: an eager call's host time
# goes largely to small operators (docs/performance.md, "Host time of an eager call"), and a tensor nobody writes
# can be shared across calls, streams and CUDA graphs. One made while a graph is captured holds its block of the
# graph's pool for as long as it is kept, so it stays valid after the capture too.
@functools.lru_cache(maxsize=16)
def open_gate(device: torch.device, HV: int) -> torch.Tensor:
    """The gate of the propagator and the reverse pass where no lead-in decides: one row of ones, every CTA runs
    (never written)."""
    return torch.ones(1, HV, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=16)
def no_walks(device: torch.device, HV: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk arguments of a pass that does not walk (never read): one row of [HV] and one of [1], int32."""
    return torch.zeros(1, HV, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=64)
def untouched(device: torch.device, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """A tensor argument the launch neither reads nor writes (the flag that would use it is off): the 1-element
    stand-ins of optional outputs, and [1, HV, K, V] for an absent state (a shape the kernel's declaration
    takes)."""
    return torch.empty(shape, device=device, dtype=dtype)


def _lead_in_runner(p: Plan, problem: Problem, k, a, v, gamma):
    """run(launch, init) for lead_in.run_states: the state pass over the gathered lead-in chunks; their O is not
    used (k stands in for q), their final states are the segments' S0."""
    def run(w, init):
        kw, aw, vw = k[:, w.tokens], a[:, w.tokens], v[:, w.tokens]
        states = torch.empty_like(init)
        _state_pass(p, StateLaunch(w.cu_seqlens, w.chunk_offsets, init, len(w.segments)), problem, kw, kw, aw, vw,
                    gamma[:, w.chunk_rows].contiguous(), torch.empty_like(vw), states, None)
        return states
    return run


@kernel_factory
def intra_chunk_kernel(H: int, HV: int, dtype: str, emit_t: bool = False, emit_bound: bool = False):
    """Compiled once per key; tilelang.jit also keeps its own disk cache across processes."""
    return jitted("intra_chunk")(H, HV, dtype, emit_t=emit_t, emit_bound=emit_bound)


def _zero_past(x: torch.Tensor, end: int) -> torch.Tensor:
    """A copy of packed x [1, tokens, ...] whose tokens from `end` on (past the last sequence) are zero. No
    sequence reads them, but the kernels load whole 64-token chunks, so the last sequence's last chunk reaches
    into them, and a masked-out NaN still turns a product into NaN: whatever a padded buffer holds there must
    not enter (the copy is paid only by calls with such tokens)."""
    out = x.clone()
    out[:, end:] = 0
    return out


def _tma_aligned(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy where its first element is not 16-byte aligned: a TMA descriptor needs an aligned base (a
    contiguous view into a larger buffer can start anywhere, and reshape / contiguous keep it)."""
    return x if x.data_ptr() % 16 == 0 else x.clone()


def _pipelined(block_v: int, store_states: bool) -> bool:
    """Whether a pass runs state_output_pipelined.py (the only state kernel without the chained route's walk
    arguments)."""
    return block_v not in NARROW_BLOCK_V and store_states


@kernel_factory
def state_output_kernel(H: int, HV: int, dtype: str, has_initial_state: bool, store_final_state: bool,
                        block_v: int, store_states: bool = False, emit_output: bool = True, chained: bool = False,
                        store_x: bool = False, per_sm: int = 1):
    """The state pass for a V tile: three warpgroups below 128 columns; at 128 the wide kernel where no S0 is
    stored, else the pipelined one (both always write O; the pipelined one walks nothing: no chained runs).
    store_x: the recompute that also leaves X for the fused backward (three warpgroups only); per_sm: its
    programs an SM (recompute_per_sm)."""
    flags = dict(has_initial_state=has_initial_state, store_final_state=store_final_state)
    if block_v in NARROW_BLOCK_V:
        return jitted("state_output_narrow")(H, HV, dtype, **flags, block_v=block_v, stages=NARROW_STAGES[block_v],
                                           store_states=store_states, emit_output=emit_output, chained=chained,
                                           store_x=store_x, per_sm=per_sm)
    assert emit_output and not store_x and per_sm == 1, "the 128-column state passes always write O, never X"
    if not _pipelined(block_v, store_states):
        return jitted("state_output_wide")(H, HV, dtype, **flags, chained=chained)
    assert not chained, "the pipelined state pass never walks back"
    return jitted("state_output_pipelined")(H, HV, dtype, **flags, block_v=block_v, num_stages=NUM_STAGES,
                                          threads=PIPELINED_THREADS, store_states=store_states)


def recompute_per_sm(block_v: int, store_x: bool, cfg: config.Config | None = None) -> int:
    """The programs an SM of a state pass's build (plan.recompute_per_sm) under cfg, else the current Config."""
    return planner.recompute_per_sm(block_v, store_x, cfg or config.current())


@kernel_factory
def propagator_kernel(H: int, HV: int, dtype: str):
    """Context parallelism's segment transitions [E | P], in 64-wide column tiles."""
    return jitted("propagator")(H, HV, dtype, block_v=64)


@dataclasses.dataclass(frozen=True)
class StateLaunch:
    """The state pass as the forward launched it: over the sequences from h0, or over context-parallel segments
    from their initial states. The backward launches it again to recompute S0 per chunk."""
    cu_seqlens: torch.Tensor
    chunk_offsets: torch.Tensor
    init: torch.Tensor | None     # [n, HV, K, V] fp32: h0, the segments' initial states (chained: their
                                  # sequences' h0, for walks that reach the start), or None (zero)
    n: int                        # sequences or segments
    # the chained route's walks: (chunks each (segment, head) walks back [n, HV], chunks before each segment [n])
    walk: tuple[torch.Tensor, torch.Tensor] | None = None


def _state_pass(p: Plan, launch: StateLaunch, problem: Problem, q, k, a, v, gamma, o, ht, hs,
                block_v: int | None = None, xs=None) -> None:
    """One state pass: writes O into o, the final states into ht, S0 per chunk into hs, each if given. Without
    o (the backward's recompute of S0) the three-warpgroup kernel skips the output's loads and products, and
    writes each chunk's X into xs where given (a [1, tokens, HV, V] buffer in v's dtype).
    block_v: the V tile, else the plan's rule for the pass's program count (plan.state_block_v)."""
    H, HV, K, V = k.shape[2], v.shape[2], k.shape[3], v.shape[3]
    dev = k.device
    placeholder = untouched(dev, torch.float32, 1, HV, K, V)   # an absent initial or final state
    stub = untouched(dev, k.dtype, 1, 1, 1, 1)                 # an absent output
    block_v = block_v or planner.state_block_v(launch.n, HV, p.sms, p.config, wide=o is not None and hs is None)
    emit = o is not None or block_v not in NARROW_BLOCK_V
    if o is None and emit:
        o = torch.empty_like(v)
    store_x = xs is not None   # (state_output_kernel and the program assert the build it needs)
    chained = launch.walk is not None
    kernel = state_output_kernel(H, HV, TORCH_TO_TL[problem.dtype], launch.init is not None, ht is not None,
                                 block_v, hs is not None, emit, chained, store_x,
                                 recompute_per_sm(block_v, store_x, p.config))
    args = (q, k, a, v, gamma, launch.cu_seqlens, launch.chunk_offsets,
            placeholder if launch.init is None else launch.init, o if emit else xs if store_x else stub,
            placeholder if ht is None else ht, float(problem.scale), stub if hs is None else hs)
    if not _pipelined(block_v, hs is not None):
        args += launch.walk if chained else no_walks(dev, HV)
    kernel(*args)


@dataclasses.dataclass
class Saved:
    """What the backward (backward.py) reads from a training forward, packed as [1, B*T, ...]."""
    q: torch.Tensor               # after the prologue
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor               # fp32, natural log (the backward's lead-in bound)
    beta: torch.Tensor            # fp32
    h0: torch.Tensor | None       # fp32, [N, HV, K, V]
    a: torch.Tensor               # Tb
    tm: torch.Tensor              # T
    gamma: torch.Tensor           # [HV, num_chunks, 64]
    hs: torch.Tensor | None       # S0 of every chunk, [num_chunks, HV, K, V] in the inputs' dtype (keep_states)
    # how the forward ran its state pass, to recompute hs: one launch, or the wide route's two (the pass over
    # segments and the plain pass over sequences, each over empty sequences where the device did not pick it)
    states: tuple[StateLaunch, ...]
    layout: object                # gdnkit.seqlayout.SequenceLayout
    stash: dict                   # the prologue's (gdnkit.prep) inputs for its backward
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    dtypes: dict
    # the decay bound's log per chunk-table row and value head, [num_chunks, HV] fp32, where the forward's route had
    # the intra kernel write it (emit_bound): the backward's lead-in search reads it instead of summing K again
    row_bounds: torch.Tensor | None = None
    plan: Plan | None = None      # the call's Plan: the backward follows its backward fields


def forward(problem: Problem, inputs: GDNInputs, intermediates: dict | None = None):
    """(o, final state, Saved or None). Pass a dict as `intermediates` to get the intra-chunk kernel's outputs
    back in it (packed: a = T diag(beta) [1, B*T, HV, 64], gamma [HV, num_chunks * 64], one row of 64 per
    chunk) for stage-by-stage checks. Problems that need gradients also keep T, the state pass's launch and,
    with config.keep_states, every chunk's entering state (else entering_states recomputes them)."""
    q, k, v, g, beta, h0, A_log, dt_bias, cu = inputs
    if problem.dtype not in TORCH_TO_TL:
        raise TypeError(f"tilelang_sm90 takes bfloat16/float16 inputs, got {problem.dtype}")
    if problem.K != 128 or problem.V != 128:
        raise ValueError(f"tilelang_sm90 is built for K = V = 128, got K={problem.K}, V={problem.V}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = problem.N
    dev = q.device
    train = problem.needs_grad
    dtypes = prologue.input_dtypes(inputs)
    p = None
    # packed form [1, B*T]; the chunk tables come from the layout cache (no host read after the first call
    # with a given cu_seqlens tensor, none at all for a dense batch)
    layout = seqlayout.dense_layout(B, T, dev) if cu is None else seqlayout.sequence_layout(cu)
    if layout.offsets[-1] < B * T:
        q, k, v, g, beta = (_zero_past(x, layout.offsets[-1]) for x in (q, k, v, g, beta))
    q, k, g, beta, stash = prologue.forward(problem, q, k, g, beta, A_log, dt_bias)
    cu = None if cu is None else layout.cu_seqlens  # the offsets the tables were built from (seqlayout's doc)
    total = B * T
    if B != 1:   # (a batch of one is packed already: a view per tensor costs host time an eager call feels)
        q, k = q.reshape(1, total, H, K), k.reshape(1, total, H, K)
        v = v.reshape(1, total, HV, V)
        g, beta = g.reshape(1, total, HV), beta.reshape(1, total, HV)
    q, k, v, g, beta = q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous()
    q, k, v = (_tma_aligned(x) for x in (q, k, v))
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
        p = plan_of(problem, layout, dev)
        dt = TORCH_TO_TL[problem.dtype]
        a = torch.empty(1, total, HV, CHUNK, device=dev, dtype=k.dtype)
        # gamma: one row of 64 per chunk-table entry (intra_chunk.py says why not token-contiguous)
        gamma = torch.empty(HV, layout.n_chunks, CHUNK, device=dev, dtype=torch.float32)
        tm = untouched(dev, k.dtype, 1, 1, 1, 1)  # T's placeholder outside training
        hs = None
        if train:
            # the backward's TMA boxes read rows past cu_seqlens[-1]: zeros there, never stale NaNs
            tm = seqlayout.packed_output((1, total, HV, CHUNK), cu, device=dev, dtype=k.dtype)
            if layout.offsets[-1] < total:
                a[:, layout.offsets[-1]:] = 0
            if p.stores_states:
                hs = torch.empty(layout.n_chunks, HV, K, V, device=dev, dtype=k.dtype)
        seg, waves, wide = p.segment_chunks, p.waves, p.wide
        # the chained and wide routes take the walks' chunk sums from the intra kernel (emit_bound)
        row_bounds = torch.empty(layout.n_chunks, HV, device=dev, dtype=torch.float32) if p.emit_bound else None
        bound = untouched(dev, torch.float32, 1, 1) if row_bounds is None else row_bounds
        intra_chunk_kernel(H, HV, dt, train, row_bounds is not None)(k, g, beta, layout.cu_seqlens, chunk_table, a,
                                                                    gamma, tm, bound)
        route = None
        if seg:
            # context parallelism: every segment's initial state (_initial_states), then the output pass over
            # segments, which also leaves each sequence's final state in its last segment
            plan = context_parallel.plan_segments(layout, seg, p.window)
            s0, route, walk = _initial_states(p, plan, k, a, v, gamma, g, beta, h0, problem, intermediates, row_bounds)
        if route:
            n_seg = plan.segments.n_seg
            ht_seg = torch.empty(n_seg, HV, K, V, device=dev, dtype=torch.float32) \
                if problem.output_final_state else None
            seg_cu, choice = plan.segments.cu_seqlens, None
            if wide:
                # the device picks the wide route or the 64-column pass without segments (context_parallel.pick):
                # both are launched, the one not picked over empty sequences (its programs exit at once)
                seg_cu, wide_walk, plain_cu, choice = context_parallel.pick(plan, walk[0], layout, waves, p.config)
                walk = (wide_walk, walk[1])
            states = (StateLaunch(seg_cu, plan.chunk_offsets, s0, n_seg, walk),)
            _state_pass(p, states[0], problem, q, k, a, v, gamma, o, ht_seg, hs, block_v=p.block_v)
            ht = None
            if ht_seg is not None:  # each sequence's last segment; a sequence without tokens keeps its h0
                ht = ht_seg[plan.segments.seg_offsets[1:].long() - 1]
                empty = [n for n, length in enumerate(layout.lengths) if length == 0]
                if empty:
                    ht[empty] = 0.0 if h0 is None else h0[empty]
            if choice is not None:
                ht_plain = None if ht is None else torch.empty_like(ht)
                plain = StateLaunch(plain_cu, layout.chunk_offsets, h0, N)
                states += (plain,)
                # in one wave (few pairs) the 64- or 32-column pass, in several the 128-column one
                _state_pass(p, plain, problem, q, k, a, v, gamma, o, ht_plain, hs, block_v=p.plain_block_v)
                ht = None if ht is None else torch.where(choice, ht, ht_plain)
                if intermediates is not None:
                    intermediates.update(wide_choice=choice)
        else:
            ht = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if problem.output_final_state else None
            states = (StateLaunch(layout.cu_seqlens, layout.chunk_offsets, h0, N),)
            _state_pass(p, states[0], problem, q, k, a, v, gamma, o, ht, hs, block_v=p.block_v)
        if intermediates is not None:
            intermediates.update(a=a, gamma=gamma.reshape(HV, -1), context_parallel=route,
                                 wide_segments=bool(route) and wide)
            if train:
                intermediates.update(tm=tm)

    saved = None
    if train and layout.n_chunks:
        saved = Saved(q, k, v, g, beta, h0, a, tm, gamma, hs, states, layout, stash, A_log, dt_bias, dtypes,
                      row_bounds, p)
    if B != 1:
        o = o.reshape(B, T, HV, V)
    if ht is not None and problem.state_v_first:
        ht = ht.transpose(-1, -2).contiguous()
    return o, ht, saved


def entering_states(problem: Problem, s: Saved, out: torch.Tensor | None = None,
                    block_v: int | None = None) -> torch.Tensor:
    """Every chunk's entering state S0 [num_chunks, HV, K, V] in the inputs' dtype: the forward's if it kept them
    (config.keep_states), else from the forward's state passes run again (its launches, no output, at the plan's
    recompute tiles; block_v: another V tile for the same column-separable chain, backward._recompute_beside), into
    `out` where given."""
    if s.hs is not None:
        return s.hs
    HV, K, V = problem.HV, problem.K, problem.V
    hs = out if out is not None else torch.empty(s.layout.n_chunks, HV, K, V, device=s.k.device, dtype=s.k.dtype)
    for launch, planned in zip(s.states, s.plan.recompute_block_v):
        _state_pass(s.plan, launch, problem, s.q, s.k, s.a, s.v, s.gamma, None, None, hs, block_v or planned)
    return hs


def entering_states_and_x(problem: Problem, s: Saved, hs: torch.Tensor, xs: torch.Tensor) -> None:
    """The state passes run again (as entering_states, even where the forward kept S0) writing every chunk's S0
    into hs [num_chunks, HV, K, V] and its X = V - diag(Gamma) K S0 into xs [1, tokens, HV, V] (the rows of its
    sequences; both in the inputs' dtype), for the fused backward. Always the three-warpgroup kernel (a 32- or
    64-column tile: the plan's recompute_x), the only one that stores X; also for the wide
    route's launch, whose forward ran 128 columns: a 128-column recompute (one program per segment and head) was
    26% slower than the 64-column one at 16/32 1x32768 (0.523 against 0.416 ms, H200, docs/performance.md: each
    program's chain, not the bytes, bounds it). At 64 columns two programs share an SM (recompute_per_sm: 0.424 ->
    0.372 ms there, H200)."""
    for launch, (block_v, _) in zip(s.states, s.plan.recompute_x):
        _state_pass(s.plan, launch, problem, s.q, s.k, s.a, s.v, s.gamma, None, None, hs, block_v, xs=xs)
