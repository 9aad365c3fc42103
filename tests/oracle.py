"""The gated delta rule as the README defines it, token by token in float64: the oracle the tests hold every
backend to. Written from the stated semantics alone; it imports nothing from gdnkit, so a wrong default, gate or
beta formula, head mapping or varlen convention in the library cannot also be wrong here.

Per value head j (reading q/k head j // (HV / H)) and token t, with the state S [K, V]:
    S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S = S + k_t u^T;  o_t = scale S^T q_t
Options: use_qk_l2norm_in_kernel (x / sqrt(sum x^2 + 1e-6) over K), use_gate_in_kernel
(g = -exp(A_log) softplus(g + dt_bias)), use_beta_sigmoid_in_kernel (sigmoid(beta), times 2 with
allow_neg_eigval), state_v_first (states [.., V, K]), cu_seqlens (packed sequences; tokens past the last offset
give 0), and the serving pool (ssm_state_indices, num_accepted_tokens, inplace_final_state; -1 = padding).
Differentiable by autograd (every op is a plain torch op on float64 tensors).
"""
from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def _f64(t):
    return None if t is None else t.to(torch.float64)


def _softplus(x):
    return torch.logaddexp(x, torch.zeros_like(x))  # log(1 + e^x), exact for any x


def _sequences(B, T, cu_seqlens):
    """(batch row, start, end) of every sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    offsets = [int(x) for x in cu_seqlens.tolist()]
    return [(0, s, e) for s, e in zip(offsets[:-1], offsets[1:])]


def _token_inputs(q, k, v, g, beta, b, t, G, A_log, dt_bias, opts):
    """q_t, k_t [HV, K], v_t [HV, V], decay g_t and write strength beta_t [HV] of every value head j at token t
    of batch row b (head j reads q/k head j // G)."""
    heads = torch.arange(v.shape[2]) // G
    qt, kt, vt = q[b, t, heads], k[b, t, heads], v[b, t]
    if opts.get("use_qk_l2norm_in_kernel"):
        qt = qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + L2NORM_EPS)
        kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + L2NORM_EPS)
    gt, bt = g[b, t], beta[b, t]
    if opts.get("use_gate_in_kernel"):
        x = gt + (dt_bias if dt_bias is not None else 0.0)
        gt = -torch.exp(A_log) * _softplus(x)
    if opts.get("use_beta_sigmoid_in_kernel"):
        bt = torch.sigmoid(bt) * (2.0 if opts.get("allow_neg_eigval") else 1.0)
    return qt, kt, vt, gt, bt


def _step(S, qt, kt, vt, gt, bt, scale):
    """One token for every head: S [HV, K, V]."""
    S = torch.exp(gt)[:, None, None] * S
    u = bt[:, None] * (vt - torch.einsum("jkv,jk->jv", S, kt))
    S = S + kt[:, :, None] * u[:, None, :]
    return S, scale * torch.einsum("jkv,jk->jv", S, qt)


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *, cu_seqlens=None,
        A_log=None, dt_bias=None, state_v_first=False, ssm_state_indices=None, num_accepted_tokens=None,
        inplace_final_state=None, **opts):
    """(o [B, T, HV, V] float64, final states or None, pool after the call or None).

    Plain call: final states [N, HV, K, V] ([.., V, K] with state_v_first), float64. Serving call
    (ssm_state_indices): the pool after the call (a float64 copy, states rounded to the pool's dtype where stored),
    and the final states of an inplace_final_state=False call."""
    q, k, v, g, beta, A_log, dt_bias = map(_f64, (q, k, v, g, beta, A_log, dt_bias))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    seqs = _sequences(B, T, cu_seqlens)
    N = len(seqs)

    def to_kv(s):
        return s.transpose(-1, -2) if state_v_first else s

    pool = None
    o = torch.zeros(B, T, HV, V, dtype=torch.float64)
    outputs = []  # (b, s, e, [e - s, HV, V]): written into o at the end (out of place: autograd)
    if ssm_state_indices is not None:
        pool = initial_state.to(torch.float64).clone()
        pool_dtype = initial_state.dtype
        idx = ssm_state_indices.long()
        inplace = True if inplace_final_state is None else inplace_final_state
        finals = torch.zeros(N, HV, K, V, dtype=torch.float64)
    else:
        finals = []
    for n, (b, s, e) in enumerate(seqs):
        if ssm_state_indices is not None:
            col = int(num_accepted_tokens[n]) - 1 if num_accepted_tokens is not None else 0
            read = int(idx[n]) if idx.dim() == 1 else int(idx[n, col])
            if read < 0:
                continue  # padding: no state touched, outputs zero
            S = to_kv(initial_state[read].to(torch.float64))
        elif initial_state is not None:
            S = to_kv(_f64(initial_state[n]))
        else:
            S = torch.zeros(HV, K, V, dtype=torch.float64)
        outs = []
        for t in range(s, e):
            S, o_t = _step(S, *_token_inputs(q, k, v, g, beta, b, t, G, A_log, dt_bias, opts), scale)
            outs.append(o_t)
            if ssm_state_indices is not None and idx.dim() == 2 and int(idx[n, t - s]) >= 0:
                pool[int(idx[n, t - s])] = to_kv(S.detach()).to(pool_dtype).double()
        if outs:
            outputs.append((b, s, e, torch.stack(outs)))
        if ssm_state_indices is None:
            finals.append(to_kv(S))
        elif idx.dim() == 1 and inplace:
            pool[read] = to_kv(S.detach()).to(pool_dtype).double()
        elif not inplace:
            finals[n] = S.detach()
    if outputs:
        rows, cols, values = [], [], []
        for b, s, e, x in outputs:
            rows += [b] * (e - s)
            cols += list(range(s, e))
            values.append(x)
        o = o.index_put((torch.tensor(rows), torch.tensor(cols)), torch.cat(values))
    if ssm_state_indices is not None:
        return o, (to_kv(finals) if not inplace and output_final_state else None), pool
    if not output_final_state:
        return o, None, None
    if finals:
        return o, torch.stack(finals), None
    return o, torch.zeros(0, HV, *((V, K) if state_v_first else (K, V)), dtype=torch.float64), None
