"""The serving interface's semantics in plain PyTorch: a state pool read and written through slot indices.

What a call means (gdnkit/api.py documents it for users; the Triton kernel is tested against this):
  - 1-D ssm_state_indices [N]: sequence n starts from pool[idx[n]]; with inplace_final_state its final
    state is written back to pool[idx[n]].
  - 2-D [N, C]: sequence n starts from pool[idx[n, num_accepted_tokens[n] - 1]] (column 0 without it);
    the state after its token t goes to pool[idx[n, t]]. With parent_indices (tree verify), token t
    continues from the stored state of token parent[n, t] when that is not t - 1, or from the starting
    state when it is -1.
  - A read slot of -1: padding; the sequence touches no state and its outputs (and returned final state)
    are exact zeros whatever its inputs hold. A write slot of -1: that write is skipped.
  - Math in the compute dtype; a state is rounded to the pool's dtype only when stored, never between
    the tokens of one call (as a kernel holding it in registers does).
Chunked prefill on the pool (chunk_gated_delta_rule with 1-D indices) means the same as the 1-D case above,
always in place, plus: has_initial_state[n] False starts sequence n from zero (its slot is only written), and
with checkpoint_indices the state after (j + 1) * checkpoint_every tokens goes to slot checkpoint_indices[n, j]
(-1 skips it; checkpoints past the sequence's length are not written).
Every read happens before any write: validation guarantees no sequence reads a slot another writes.
"""
from __future__ import annotations

import torch

from gdnkit.prep import CHUNK
from gdnkit.seqlayout import seq_bounds
from gdnkit.problem import GDNServingInputs, Problem

from .backend import apply_options, pack_rows, unpack_rows
from .chunked import chunked_gdn
from .recurrent import recurrent_gdn


def _prepared(problem: Problem, inputs: GDNServingInputs):
    """q, k, v, g, beta with the options applied, q/k on the value heads, one row per sequence."""
    q, k, v, g, beta = apply_options(problem, inputs)
    if not problem.varlen:
        return (q, k, v, g, beta), [problem.T] * problem.N, None
    bounds = seq_bounds(inputs.cu_seqlens)
    pad_to = max((e - s for s, e in bounds), default=0)
    # zero-padded tokens have g = 0 and beta = 0 after the options: they leave the state unchanged
    rows = tuple(pack_rows(x, bounds, pad_to) for x in (q, k, v, g, beta))
    return rows, [e - s for s, e in bounds], bounds


def _to_kv(problem: Problem, state: torch.Tensor) -> torch.Tensor:
    """Pool layout -> [.., K, V] (and back: the transpose is its own inverse)."""
    return state.transpose(-1, -2) if problem.state_v_first else state


def _start_states(problem: Problem, pool, read, live_rows, dt, device) -> torch.Tensor:
    """[N, HV, K, V] in the compute dtype: each live sequence's read slot, zero for padding rows."""
    S = torch.zeros(problem.N, problem.HV, problem.K, problem.V, dtype=dt, device=device)
    S[live_rows] = _to_kv(problem, pool[read[live_rows]]).to(dt)
    return S


@torch.no_grad()
def serving_chunk_forward(problem: Problem, inputs: GDNServingInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, the pool): chunked prefill from and to pool slots, with optional prefix-cache checkpoints."""
    dt = problem.compute_dtype
    (q, k, v, g, beta), lengths, bounds = _prepared(problem, inputs)
    pool = inputs.initial_state
    read = inputs.ssm_state_indices.long()
    live = read >= 0
    if inputs.has_initial_state is not None:
        live_rows = (live & inputs.has_initial_state).nonzero()[:, 0]
    else:
        live_rows = live.nonzero()[:, 0]
    S0 = _start_states(problem, pool, read, live_rows, dt, q.device)
    o, S, trace = chunked_gdn(q, k, v, g, beta, problem.scale, S0)
    o = o * live.to(o.dtype)[:, None, None, None]
    if problem.varlen:
        o = unpack_rows(o, bounds, problem.T)
    writers = live.nonzero()[:, 0]
    if problem.checkpoint_every:
        # trace.h[:, :, m] is the state after m chunks; padding past a row's length leaves it unchanged
        after = torch.cat([trace.h, S[:, :, None]], 2)
        per = problem.checkpoint_every // CHUNK
        ck = inputs.checkpoint_indices.long()
        for j in range(ck.shape[1]):
            m = (j + 1) * per
            rows = [n for n in writers.tolist() if m * CHUNK <= lengths[n] and ck[n, j] >= 0]
            if rows:
                pool[ck[rows, j]] = _to_kv(problem, after[rows, :, m]).to(pool.dtype)
    pool[read[writers]] = _to_kv(problem, S[writers]).to(pool.dtype)
    return o.to(inputs.v.dtype), pool


@torch.no_grad()
def serving_forward(problem: Problem, inputs: GDNServingInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, final states): the pool itself when inplace_final_state, else a new [N, ...] tensor or None."""
    dt = problem.compute_dtype
    (q, k, v, g, beta), lengths, bounds = _prepared(problem, inputs)
    pool = inputs.initial_state
    idx = inputs.ssm_state_indices.long()
    N = problem.N
    if idx.dim() == 1:
        read = idx
    else:
        col = (inputs.num_accepted_tokens.long() - 1 if problem.has_num_accepted_tokens
               else torch.zeros(N, dtype=torch.long, device=idx.device))
        read = idx.gather(1, col[:, None])[:, 0]
    live = read >= 0
    live_rows = live.nonzero()[:, 0]

    to_kv = lambda state: _to_kv(problem, state)  # noqa: E731
    S = _start_states(problem, pool, read, live_rows, dt, q.device)
    lengths_t = torch.tensor(lengths, device=q.device, dtype=torch.long)

    S_start, kept = S, []
    outputs = []
    for t in range(q.shape[1]):
        if problem.has_parents and t < idx.shape[1]:
            # tree verify: a token whose parent is not the previous token continues from the parent's kept
            # state (as stored, in the pool's dtype) or, for parent -1, from the starting state
            par = inputs.parent_indices[:, t].long()
            S = torch.where((par == -1)[:, None, None, None], S_start, S)
            for n in ((par >= 0) & (par != t - 1) & live).nonzero()[:, 0].tolist():
                S[n] = kept[int(par[n])][n]
        o_t, S = recurrent_gdn(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                               problem.scale, S)
        outputs.append(o_t)
        if problem.per_token_slots and t < idx.shape[1]:
            slot = idx[:, t]
            write = (live & (lengths_t > t) & (slot >= 0)).nonzero()[:, 0]
            pool[slot[write]] = to_kv(S[write]).to(pool.dtype)
            if problem.has_parents:
                kept.append(S.to(pool.dtype).to(dt))
    o = torch.cat(outputs, 1) if outputs else v.new_zeros(v.shape)
    # where, never a multiply by the mask: a padding row's inputs may hold anything (NaN * 0 is NaN)
    o = torch.where(live[:, None, None, None], o, 0)
    if problem.varlen:
        o = unpack_rows(o, bounds, problem.T)
    o = o.to(inputs.v.dtype)

    if problem.inplace_final_state:
        if not problem.per_token_slots:
            pool[read[live_rows]] = to_kv(S[live_rows]).to(pool.dtype)
        return o, pool
    if not problem.output_final_state:
        return o, None
    S = torch.where(live[:, None, None, None], S, 0)
    return o, to_kv(S).contiguous()
