"""Context parallelism across processes: one packed batch split along its token axis over a torch.distributed group.

    o_shard, final_states = gdnkit.distributed.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu_global)

Rank r of the group holds tokens [s_r, s_{r+1}) of the packed batch; cu_seqlens, initial_state and the returned
final states are global and the same on every rank. The result equals the single-process call on the whole batch.

How (no new kernels): given q, k, g and beta, the recurrence is jointly linear in (state, v), so a rank's piece of
a sequence maps the state that enters it affinely, S_out = A S_in + B, and its outputs are those from a zero state
plus a term linear in S_in:
  1. every rank runs its shard with the single-process call, each piece that starts here from its true initial
     state and the piece that continues a sequence from an earlier rank (the first local piece) from zero: o0 and
     the end states B;
  2. for that continuing piece only, one more call with v = 0 and the identity as a K x K initial state
     (V' = K columns) gives A (its final state) and o_I with o_I[t] = scale A_t^T q_t, so the outputs the true
     entering state adds are o_I[t] @ S_in (a small batched matmul, no third pass);
  3. one all_gather of every rank's boundary data (A, B of its continuing piece and the end states of pieces that
     start here), padded to one row length; every rank composes the maps in rank order (deterministic) for the
     entering state of its continuing piece and, with output_final_state, every sequence's final state.
The backward is autograd through the same single-process calls, with the gather's gradient all-reduced (summed)
over the group: one collective per direction (plus one of a few integers ahead of the forward, which checks the
shards and the arguments agree across ranks and tells every rank where the others' shards lie).
"""
from __future__ import annotations

import dataclasses
import hashlib
import sys

import torch

from gdnkit import api, seqlayout
from gdnkit.dynamo_boundary import outside_dynamo
from gdnkit.problem import CHUNK_MODE, check_cu_seqlens, validate_inputs

# The single-process call's keyword options (its signature after output_final_state), taken as they are.
OPTIONS = ("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
           "allow_neg_eigval", "state_v_first", "backend")


# Opaque to torch.compile, as the single-process call is: Dynamo cannot trace the host-side planning or keep it
# correct across calls.
@outside_dynamo
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, *, cu_seqlens: torch.Tensor | None = None,
                           group=None, **options):
    """The chunked gated delta rule over a packed batch whose token axis is split across the ranks of `group`.

    Args:
        q, k: [1, T_r, H, K]; v: [1, T_r, HV, V]; g, beta: [1, T_r, HV]: this rank's contiguous shard of the packed
            token axis. The shards of ranks 0..P-1 (ranks within `group`), in order, make the whole batch; any
            lengths, 0 included.
        scale, options (use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, state_v_first, backend): as gdnkit.chunk_gated_delta_rule, the same on every rank.
        initial_state: [N, HV, K, V] (global, the same on every rank) or None.
        output_final_state: every rank returns the N final states.
        cu_seqlens: [N+1] global offsets, the same on every rank (None: one sequence of all the shards' tokens);
            they must end at the shards' total length. A sequence may start, end or lie on any rank and span
            several.
        group: a torch.distributed process group (default: the world). A group of one process runs the
            single-process call.

    Returns:
        (o, final_state): o [1, T_r, HV, V], this rank's shard of the output; final_state [N, HV, K, V] or None.

    Gradients: autograd gives the gradient of the sum of every rank's loss. Each rank gets those of its own shard of
    q, k, v, g, beta; initial_state, A_log and dt_bias, which every rank holds, get one part per rank, and the parts
    sum to the full gradient (all-reduce them over the group like any replicated parameter); a final state used in
    several ranks' losses receives the sum of their gradients. Every rank of the group must run the backward
    through this call (its backward holds a collective), as with any collective under autograd.
    Exact (no decay truncation across ranks) and deterministic; each rank runs whatever backend dispatch picks for
    its shard.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"gdnkit.distributed.chunk_gated_delta_rule got unexpected keyword argument(s) {unknown}; "
                        f"it takes {list(OPTIONS)}")
    import torch.distributed as dist  # torch builds without distributed support still import gdnkit

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("gdnkit.distributed.chunk_gated_delta_rule needs torch.distributed initialised "
                           "(dist.init_process_group); for one process call gdnkit.chunk_gated_delta_rule")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the process group it was given")
    if world == 1:
        return api.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                          cu_seqlens=cu_seqlens, **options)
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("gdnkit.distributed.chunk_gated_delta_rule reads the shard layout on the host and "
                           "cannot run while a CUDA graph is being captured")

    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad
        for t in (q, k, v, g, beta, initial_state, options.get("A_log"), options.get("dt_bias")))
    try:
        call = _check_local(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, options)
        error = None
    except (ValueError, TypeError) as exc:
        call, error = None, exc
    plan = _agree(dist, group, world, rank, q, call, error, needs_grad)
    if initial_state is not None and initial_state.dtype in (torch.bfloat16, torch.float16):
        # taken as float32, as the single-process call takes it; a torch op, so the gradient reaches the caller's
        # tensor in its own dtype
        initial_state = initial_state.float()
    tensors = (q, k, v, g, beta, initial_state, options.get("A_log"), options.get("dt_bias"))

    if not needs_grad:
        with torch.no_grad():
            o, ht, _ = _forward(plan, call, tensors, dist, group)
        return o, ht
    return _ContextParallel.apply(plan, call, dist, group, *tensors)


@dataclasses.dataclass(frozen=True)
class _Call:
    """One rank's validated arguments: what must agree across ranks, and this rank's shard length."""

    T: int
    HV: int
    K: int
    V: int
    offsets: tuple[int, ...] | None  # global cu_seqlens on the host (None: one sequence of every token)
    scale: float
    output_final_state: bool
    state_v_first: bool
    state_dtype: torch.dtype  # of the composed states and the gathered buffer
    options: dict  # passed to every single-process call (state_v_first False: states are handled [.., K, V] here)
    signature: str  # everything but T and the offsets, compared across ranks


def _check_local(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, options) -> _Call:
    """This rank's arguments, checked as the single-process call checks them, before any collective runs."""
    single = {name: options[name] for name in OPTIONS if name in options and name != "backend"}
    problem, _ = validate_inputs(CHUNK_MODE, q, k, v, g, beta, scale, None, False, **single)
    if problem.B != 1:
        raise ValueError(f"q must hold this rank's shard of the packed token axis, shape [1, T_r, H, K], "
                         f"got batch size {problem.B} (pack sequences along T with cu_seqlens)")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")
    if cu_seqlens is None:
        offsets = None  # one sequence of every shard's tokens: its end is known after the shard lengths meet
    else:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        check_cu_seqlens(cu_seqlens, sys.maxsize)  # the end is checked against the shards' total later
        offsets = seqlayout.host_offsets(cu_seqlens)
    HV, K, V = problem.HV, problem.K, problem.V
    N = 1 if offsets is None else len(offsets) - 1
    v_first = problem.state_v_first
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
        want = (N, HV, V, K) if v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            layout = "[N, HV, V, K] (state_v_first)" if v_first else "[N, HV, K, V]"
            raise ValueError(f"initial_state must be the global initial states, shape {layout} = {list(want)} "
                             f"with N={N} sequences, got {list(initial_state.shape)}")
        if initial_state.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise TypeError(f"initial_state must be a floating tensor (float32; bfloat16 / float16 are taken as "
                            f"float32, as the single-process call takes them), got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"all tensors must be on one device: q is on {q.device}, initial_state is on "
                             f"{initial_state.device}")
    inner = {name: options[name] for name in OPTIONS if name in options}
    inner["state_v_first"] = False
    flags = {name: value for name, value in sorted(inner.items()) if not isinstance(value, torch.Tensor)}
    signature = repr((problem.H, HV, K, V, problem.dtype, problem.gate_dtype, beta.dtype, problem.scale, v_first,
                      output_final_state, None if initial_state is None else initial_state.dtype,
                      [name for name in ("A_log", "dt_bias") if inner.get(name) is not None], flags,
                      q.device.type))
    return _Call(problem.T, HV, K, V, offsets, problem.scale, output_final_state, v_first,
                 problem.compute_dtype, inner, signature)


def _fingerprint(value) -> int:
    """A 62-bit digest, the same in every process (Python's hash() of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2


@dataclasses.dataclass(frozen=True)
class _Piece:
    seq: int
    start: int  # global token offsets
    end: int


@dataclasses.dataclass
class _Plan:
    """Where every rank's shard lies and what each rank sends; the same on every rank."""

    rank: int
    world: int
    offsets: tuple[int, ...]
    bounds: list[int]  # shard r holds tokens [bounds[r], bounds[r + 1])
    pieces: list[list[_Piece]]  # per rank: its pieces of sequences, in order
    continues: list[bool]  # per rank: its first piece continues a sequence from an earlier rank
    slots: list[dict]  # per rank: ("map" | "end", seq) -> offset of that item in the rank's gathered row
    row: int  # gathered row length (elements)
    HV: int
    K: int
    V: int

    chains: dict  # seq -> the ranks holding its tokens, in order


def _agree(dist, group, world, rank, q, call: _Call | None, error, needs_grad) -> _Plan:
    """One small all_gather: every rank's shard length and a digest of its arguments. Rejected input raises on
    every rank (the rejecting rank its own error), so no rank waits forever in a later collective."""
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    mine = [0, 0, 0, 0, int(needs_grad)] if call is None else [
        call.T, 1, _fingerprint(call.offsets), _fingerprint(call.signature), int(needs_grad)]
    meta = [torch.zeros(5, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(meta, torch.tensor(mine, dtype=torch.int64, device=device), group=group)
    meta = torch.stack(meta).cpu().tolist()
    rejected = [r for r in range(world) if meta[r][1] == 0]
    if error is not None:
        raise error
    if rejected:
        raise ValueError(f"rank(s) {rejected} of the group rejected their inputs (the error is raised there)")
    if len({m[3] for m in meta}) > 1:
        raise ValueError("every rank must pass the same head shapes, dtypes, scale, options, initial_state "
                         "presence and dtype, and output_final_state; the group's ranks differ")
    if len({m[4] for m in meta}) > 1:
        raise ValueError("every rank must agree on whether gradients are needed (grad mode and requires_grad of "
                         f"the inputs): ranks {[r for r in range(world) if meta[r][4]]} need them, others do not")
    bounds = [0]
    for m in meta:
        bounds.append(bounds[-1] + m[0])
    offsets = call.offsets if call.offsets is not None else (0, bounds[-1])
    if len({m[2] for m in meta}) > 1:
        raise ValueError("cu_seqlens must be the same global offsets on every rank of the group; the ranks' "
                         "cu_seqlens differ")
    if offsets[-1] != bounds[-1]:
        raise ValueError(f"the shards' token counts {[m[0] for m in meta]} (ranks 0..{world - 1}) sum to "
                         f"{bounds[-1]}, but cu_seqlens[-1] = {offsets[-1]}: the shards must make the whole "
                         f"packed batch")
    return _make_plan(rank, world, offsets, bounds, call)


def _make_plan(rank, world, offsets, bounds, call: _Call) -> _Plan:
    pieces, continues = [], []
    for r in range(world):
        lo, hi = bounds[r], bounds[r + 1]
        mine = [_Piece(n, max(a, lo), min(b, hi)) for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))
                if max(a, lo) < min(b, hi)]
        pieces.append(mine)
        continues.append(bool(mine) and offsets[mine[0].seq] < lo)
    HV, K, V = call.HV, call.K, call.V
    slots, row = [], 0
    for r in range(world):
        lo, hi = bounds[r], bounds[r + 1]
        items, size = {}, 0
        for i, p in enumerate(pieces[r]):
            leaves = offsets[p.seq + 1] > hi  # the sequence goes on to a later rank
            if i == 0 and continues[r]:
                if leaves or call.output_final_state:
                    items[("map", p.seq)] = size
                    size += HV * K * (K + V)
            elif leaves or call.output_final_state:
                items[("end", p.seq)] = size
                size += HV * K * V
        slots.append(items)
        row = max(row, size)
    chains = {}
    for r in range(world):
        for p in pieces[r]:
            chains.setdefault(p.seq, []).append(r)
    return _Plan(rank, world, offsets, bounds, pieces, continues, slots, row, HV, K, V, chains)


def _forward(plan: _Plan, call: _Call, tensors, dist, group, leaves=None):
    """o, the final states, and (with leaves: the graph's ends for the backward) a record of the two graphs.

    With `leaves` (detached inputs requiring grad where the originals do) it runs under grad mode and records
    the local graph (single-process calls up to the gathered buffer) and the graph after the gather separately,
    so the backward can all-reduce the gathered buffer's gradient between them.
    """
    q, k, v, g, beta, h0, A_log, dt_bias = tensors if leaves is None else leaves
    HV, K, V = plan.HV, plan.K, plan.V
    sdt, device = call.state_dtype, q.device
    # The gate's parameters as this graph's leaves (they get gradients); every other option as the caller gave it.
    opts = dict(call.options)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if name in opts:
            opts[name] = t
    record = leaves is not None

    with torch.enable_grad() if record else torch.no_grad():
        h0k = None if h0 is None else (h0.transpose(-1, -2) if call.state_v_first else h0)
        try:
            o0, o_I, sent = _local_calls(plan, call, q, k, v, g, beta, h0k, opts)
            failed = None
        except Exception as exc:  # re-raised after the gather, which every other rank is waiting in
            # NaNs, not zeros: a rank that composes this row gets visibly wrong results, never silently wrong ones.
            o0 = o_I = None
            sent, failed = torch.full((plan.row,), float("nan"), dtype=sdt, device=device), exc
    pieces = plan.pieces[plan.rank]
    continuing = plan.continues[plan.rank]
    n_in = pieces[0].end - pieces[0].start if continuing else 0

    gathered = None
    if plan.row:
        gathered = _gather_rows(dist, group, sent.detach().contiguous(), plan.world)
    if failed is not None:
        raise failed

    # After the gather: leaves of their own, so its graph ends where the local one begins.
    G = None if gathered is None else gathered.requires_grad_(record)
    o_I_in = None if o_I is None else o_I.detach().requires_grad_(record and o_I.requires_grad)
    h0_in = None if h0k is None else h0k.detach().requires_grad_(record and h0k.requires_grad)
    with torch.enable_grad() if record else torch.no_grad():
        correction = None
        if continuing:
            s_in = _run_chain(plan, G, pieces[0].seq, until=plan.rank)
            # o_I arrives in v's dtype: at 16 bits the product runs on tensor cores with S_in rounded to 16 bits,
            # as the kernels round a chunk's entering state where it meets q (fp32 here would cost about as much
            # as the pass itself); at 32 and 64 bits in the state dtype.
            cdt = o_I_in.dtype if o_I_in.dtype in (torch.bfloat16, torch.float16) else sdt
            correction = torch.matmul(o_I_in[0].to(cdt).transpose(0, 1), s_in.to(cdt)).transpose(0, 1)
        ht = None
        if call.output_final_state:
            ht = torch.stack([_final_state(plan, G, n, h0_in, sdt, device) for n in range(len(plan.offsets) - 1)])
    # The correction goes in place into the local call's output, so the shard is not copied: no backend keeps its
    # o for the backward (the local graph needs only o0's gradient function), and .data (unlike .detach()) leaves
    # the version counter alone, which autograd would otherwise read as an edit of a view it returned.
    o = o0.data if o0 is not None else v.new_zeros(1, 0, HV, V)
    if correction is not None:
        # add_ computes a 16-bit sum in fp32 and rounds it once: the bits of a round trip through fp32 copies, with
        # 3 instead of 17 bf16-output-sizes of memory traffic (at 16/64 a 131072-token shard's o is 2.1 GB)
        o[0, :n_in].add_(correction.detach())
    ht_out = None if ht is None else (ht.detach().transpose(-1, -2).contiguous() if call.state_v_first
                                      else ht.detach())
    graphs = None
    if record:
        graphs = dict(local=[o0, o_I, sent, h0k], after=[correction, ht], after_leaves=[G, o_I_in, h0_in],
                      n_in=n_in)
    return o, ht_out, graphs


def _local_calls(plan: _Plan, call: _Call, q, k, v, g, beta, h0k, opts):
    """This rank's single-process calls: o0 (its shard from the true initial state where a sequence starts here, from
    zero for the continuing piece), o_I of the continuing piece (its outputs from the identity, v = 0), and the row
    it sends: the maps and end states its slots name, padded to the row length."""
    HV, K = plan.HV, plan.K
    sdt, device = call.state_dtype, q.device
    pieces = plan.pieces[plan.rank]
    continuing = plan.continues[plan.rank]
    o0 = o_I = ends = A = None
    if pieces:
        lengths = [p.end - p.start for p in pieces]
        local_cu = torch.tensor([0] + _cumsum(lengths), dtype=torch.int32, device=device)
        states = None
        if h0k is not None:
            rows = h0k[[p.seq for p in pieces]]
            states = torch.cat([torch.zeros_like(rows[:1]), rows[1:]]) if continuing else rows
        o0, ends = api.chunk_gated_delta_rule(q, k, v, g, beta, call.scale, states, bool(plan.slots[plan.rank]),
                                              cu_seqlens=local_cu, **opts)
    if continuing:
        n_in = lengths[0]
        eye = torch.eye(K, dtype=sdt, device=device).expand(1, HV, K, K).contiguous()
        zeros = v.new_zeros(1, n_in, HV, K)
        o_I, A = api.chunk_gated_delta_rule(q[:, :n_in], k[:, :n_in], zeros, g[:, :n_in], beta[:, :n_in],
                                            call.scale, eye, True, **opts)
    parts = []
    index = {p.seq: i for i, p in enumerate(pieces)}
    for (kind, seq), _ in sorted(plan.slots[plan.rank].items(), key=lambda item: item[1]):
        i = index[seq]
        if kind == "map":
            parts += [A[0].to(sdt).reshape(-1), ends[i].to(sdt).reshape(-1)]
        else:
            parts.append(ends[i].to(sdt).reshape(-1))
    sent = torch.cat(parts) if parts else torch.zeros(0, dtype=sdt, device=device)
    sent = torch.cat([sent, sent.new_zeros(plan.row - sent.numel())]) if plan.row else sent
    return o0, o_I, sent


def _gather_rows(dist, group, row, world):
    """[P, row]: every rank's row, in rank order (into one buffer on NCCL; gloo takes a list)."""
    if row.is_cuda and dist.get_backend(group) == "nccl":
        out = row.new_empty(world, row.numel())
        dist.all_gather_into_tensor(out, row, group=group)
        return out
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    return torch.stack(rows)


def _sum_over_ranks(dist, group, dG, rank):
    """Row `rank` of the sum over the group of every rank's [P, row] gradient of the gathered buffer: a
    reduce_scatter on NCCL (each rank receives its row only), an all_reduce elsewhere (gloo has no reduce_scatter)."""
    if dG.is_cuda and dist.get_backend(group) == "nccl":
        mine = torch.empty_like(dG[rank])
        dist.reduce_scatter_tensor(mine, dG, group=group)
        return mine
    dist.all_reduce(dG, group=group)
    return dG[rank]


def _cumsum(xs):
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


def _map(plan: _Plan, G, r, seq):
    HV, K, V = plan.HV, plan.K, plan.V
    at = plan.slots[r][("map", seq)]
    A = G[r, at:at + HV * K * K].view(HV, K, K)
    B = G[r, at + HV * K * K:at + HV * K * (K + V)].view(HV, K, V)
    return A, B


def _run_chain(plan: _Plan, G, seq, until=None):
    """The state of `seq` entering rank `until` (None: after its last rank), composed in rank order."""
    HV, K, V = plan.HV, plan.K, plan.V
    chain = plan.chains[seq]
    first = chain[0]
    at = plan.slots[first][("end", seq)]
    state = G[first, at:at + HV * K * V].view(HV, K, V)
    for r in chain[1:]:
        if r == until:
            return state
        A, B = _map(plan, G, r, seq)
        state = torch.matmul(A, state) + B
    return state


def _final_state(plan: _Plan, G, seq, h0, sdt, device):
    if plan.offsets[seq] == plan.offsets[seq + 1]:  # an empty sequence ends in its initial state
        return h0[seq].to(sdt) if h0 is not None else torch.zeros(plan.HV, plan.K, plan.V, dtype=sdt, device=device)
    return _run_chain(plan, G, seq)


class _ContextParallel(torch.autograd.Function):
    """The whole distributed call as one node: its backward runs on every rank whose loss reaches o or the final
    states, so every rank joins the sum of the gathered buffer's gradient, whatever its own loss uses."""

    @staticmethod
    def forward(ctx, plan, call, dist, group, *tensors):
        leaves = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip(tensors, ctx.needs_input_grad[4:])]
        o, ht, graphs = _forward(plan, call, tensors, dist, group, leaves)
        ctx.plan, ctx.call, ctx.dist, ctx.group = plan, call, dist, group
        ctx.graphs, ctx.leaves = graphs, leaves
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        plan, call, graphs = ctx.plan, ctx.call, ctx.graphs
        if graphs is None:
            raise RuntimeError("gdnkit.distributed.chunk_gated_delta_rule: a second backward through one call "
                               "(retain_graph=True) is not supported; its recorded graphs go with the first")
        correction, ht = graphs["after"]
        G, o_I_in, h0_in = graphs["after_leaves"]
        n_in = graphs["n_in"]
        ends, grads = [], []
        if correction is not None and correction.requires_grad:
            ends.append(correction)
            grads.append(do[0, :n_in].to(correction.dtype))
        if ht is not None and ht.requires_grad and dht is not None:
            ends.append(ht)
            grads.append(dht.transpose(-1, -2) if call.state_v_first else dht)
        wrt = [t for t in (G, o_I_in, h0_in) if t is not None and t.requires_grad]
        got = dict(zip(map(id, wrt), torch.autograd.grad(ends, wrt, grads, allow_unused=True))) if ends and wrt \
            else {}
        d_sent = None
        if G is not None:  # every rank reduces, even where its own part is zero
            dG = got.get(id(G))
            dG = torch.zeros_like(G) if dG is None else dG.contiguous()
            d_sent = _sum_over_ranks(ctx.dist, ctx.group, dG, plan.rank)
        o0, o_I, sent, h0k = graphs["local"]
        pairs = [(o0, do), (o_I, got.get(id(o_I_in))), (sent, d_sent),
                 (h0k, got.get(id(h0_in)))]
        pairs = [(t, d) for t, d in pairs if t is not None and d is not None and t.requires_grad and t.numel()]
        leaves = ctx.leaves
        needed = [t for t in leaves if t is not None and t.requires_grad]
        result = dict(zip(map(id, needed), torch.autograd.grad([t for t, _ in pairs], needed,
                                                               [d.to(t.dtype) for t, d in pairs],
                                                               allow_unused=True))) if pairs and needed else {}
        ctx.graphs = ctx.leaves = None  # the recorded graphs go with the first backward
        # Zeros rather than None where an input needs a gradient and this rank's part is zero (an empty shard, an
        # initial state no sequence starts here with): every rank then holds a gradient to all-reduce.
        return (None, None, None, None, *[None if t is None or not t.requires_grad
                                          else result.get(id(t), None) if id(t) in result and result[id(t)] is not None
                                          else torch.zeros_like(t) for t in leaves])
