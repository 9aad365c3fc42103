"""The serving interface's semantics in plain PyTorch: a state pool read and written through slot indices.

What a call means (gdnkit/api.py documents it for users; the Triton kernel is tested against this):
  - 1-D ssm_state_indices [N]: sequence n starts from pool[idx[n]]; with inplace_final_state its final
    state is written back to pool[idx[n]].
  - 2-D [N, C]: sequence n starts from pool[idx[n, num_accepted_tokens[n] - 1]] (column 0 without it);
    the state after its token t goes to pool[idx[n, t]].
  - A read slot of -1: padding; the sequence touches no state and its outputs (and returned final state)
    are exact zeros whatever its inputs hold. A write slot of -1: that write is skipped.
  - Math in the compute dtype; a state is rounded to the pool's dtype only when stored, never between
    the tokens of one call (as a kernel holding it in registers does).
Every read happens before any write: validation guarantees no sequence reads a slot another writes.
"""
from __future__ import annotations

import torch

from gdnkit.seqlayout import seq_bounds
from gdnkit.problem import GDNServingInputs, Problem

from .backend import _pack, _unpack, apply_options
from .recurrent import recurrent_gdn


def _prepared(problem: Problem, inputs: GDNServingInputs):
    """q, k, v, g, beta with the options applied, q/k on the value heads, one row per sequence."""
    q, k, v, g, beta = apply_options(problem, inputs)
    if not problem.varlen:
        return (q, k, v, g, beta), [problem.T] * problem.N, None
    bounds = seq_bounds(inputs.cu_seqlens)
    pad_to = max((e - s for s, e in bounds), default=0)
    # zero-padded tokens have g = 0 and beta = 0 after the options: they leave the state unchanged
    rows = tuple(_pack(x, bounds, pad_to) for x in (q, k, v, g, beta))
    return rows, [e - s for s, e in bounds], bounds


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

    def to_kv(state):  # pool layout -> [.., K, V]
        return state.transpose(-1, -2) if problem.state_v_first else state

    S = torch.zeros(N, problem.HV, problem.K, problem.V, dtype=dt, device=q.device)
    S[live_rows] = to_kv(pool[read[live_rows]]).to(dt)
    lengths_t = torch.tensor(lengths, device=q.device, dtype=torch.long)

    outputs = []
    for t in range(q.shape[1]):
        o_t, S = recurrent_gdn(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], beta[:, t:t + 1],
                               problem.scale, S)
        outputs.append(o_t)
        if problem.per_token_slots and t < idx.shape[1]:
            slot = idx[:, t]
            write = (live & (lengths_t > t) & (slot >= 0)).nonzero()[:, 0]
            pool[slot[write]] = to_kv(S[write]).to(pool.dtype)
    o = torch.cat(outputs, 1) if outputs else v.new_zeros(v.shape)
    # where, never a multiply by the mask: a padding row's inputs may hold anything (NaN * 0 is NaN)
    o = torch.where(live[:, None, None, None], o, 0)
    if problem.varlen:
        o = _unpack(o, bounds, problem.T)
    o = o.to(inputs.v.dtype)

    if problem.inplace_final_state:
        if not problem.per_token_slots:
            pool[read[live_rows]] = to_kv(S[live_rows]).to(pool.dtype)
        return o, pool
    if not problem.output_final_state:
        return o, None
    S = torch.where(live[:, None, None, None], S, 0)
    return o, to_kv(S).contiguous()
