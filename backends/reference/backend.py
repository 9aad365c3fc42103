"""The reference backend: the public call's semantics in plain, differentiable PyTorch.

From user tensors to the prepared form (options applied, compute dtype, q/k expanded to the value
heads, sequences as rows of a padded batch), through recurrent.py or chunked.py, and back. Backward
recomputes the forward under autograd: slow, obviously right, and the oracle for every kernel.
"""
from __future__ import annotations

from typing import Callable

import torch

from gdnkit.dispatch import Backend
from gdnkit.dispatch.support import Support
from gdnkit.prep import CHUNK, beta_activation, gate, l2norm
from gdnkit.problem import CHUNK_MODE, FLOAT_DTYPES, POOL_DTYPES, RECURRENT_MODE, GDNGrads, GDNInputs, Problem
from gdnkit.seqlayout import seq_bounds

from .chunked import chunked_gdn
from .recurrent import recurrent_gdn


def _row_index(bounds: list[tuple[int, int]], pad_to: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows of `pad_to` tokens: each slot's position in the packed sequence, and whether it is real."""
    t = torch.arange(pad_to, device=device)
    starts = torch.tensor([s for s, _ in bounds], device=device, dtype=torch.long)
    lengths = torch.tensor([e - s for s, e in bounds], device=device, dtype=torch.long)
    return starts[:, None] + t[None, :], t[None, :] < lengths[:, None]


def pack_rows(x: torch.Tensor, bounds: list[tuple[int, int]], pad_to: int) -> torch.Tensor:
    """[1, T, ...] packed sequences -> [N, pad_to, ...] zero-padded rows (differentiable)."""
    position, valid = _row_index(bounds, pad_to, x.device)
    rows = x.new_zeros(len(bounds), pad_to, *x.shape[2:])
    return rows.index_put((valid,), x[0, position[valid]])


def unpack_rows(rows: torch.Tensor, bounds: list[tuple[int, int]], T: int) -> torch.Tensor:
    """Inverse of pack_rows: [N, L, ...] -> [1, T, ...]; tokens past the last offset are left zero."""
    position, valid = _row_index(bounds, rows.shape[1], rows.device)
    out = rows.new_zeros(T, *rows.shape[2:])
    return out.index_put((position[valid],), rows[valid])[None]


def apply_options(problem: Problem, inputs) -> tuple[torch.Tensor, ...]:
    """q, k, v, g, beta in the compute dtype with the in-kernel options applied and q/k repeated onto
    the value heads (value head j reads q/k head j // (HV / H)): what the recurrence consumes."""
    dt = problem.compute_dtype
    q, k, v, g, beta = (x.to(dt) for x in inputs[:5])
    if problem.use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if problem.use_gate_in_kernel:
        g = gate(g, inputs.A_log.to(dt), None if inputs.dt_bias is None else inputs.dt_bias.to(dt))
    if problem.use_beta_sigmoid_in_kernel:
        beta = beta_activation(beta, problem.allow_neg_eigval)
    group = problem.HV // problem.H
    return q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2), v, g, beta


def reference_forward(problem: Problem, inputs: GDNInputs,
                      form: Callable = chunked_gdn) -> tuple[torch.Tensor, torch.Tensor | None]:
    """o (v's dtype) and the final state (compute dtype, or None) of a call, through `form`."""
    dt = problem.compute_dtype
    if problem.varlen:
        # tokens past cu_seqlens[-1] belong to no sequence and may hold anything: zeroed by where (not a multiply)
        # before the options, so neither their outputs nor the gradients (dA_log / ddt_bias sum over every
        # token) see them
        bounds = seq_bounds(inputs.cu_seqlens)
        live = (torch.arange(problem.T, device=inputs.q.device) < bounds[-1][1])[None, :, None]
        inputs = inputs._replace(**{name: torch.where(live if x.dim() == 3 else live[..., None], x, 0)
                                    for name, x in zip(("q", "k", "v", "g", "beta"), inputs[:5])})
    q, k, v, g, beta = apply_options(problem, inputs)
    h0 = inputs.initial_state
    if h0 is not None:
        h0 = h0.to(dt)
        if problem.state_v_first:
            h0 = h0.transpose(-1, -2)

    if problem.varlen:
        longest = max((e - s for s, e in bounds), default=0)
        pad_to = -(-longest // CHUNK) * CHUNK
        q, k, v, g, beta = (pack_rows(x, bounds, pad_to) for x in (q, k, v, g, beta))
    result = form(q, k, v, g, beta, problem.scale, h0)
    o, ht = result[0], result[1]
    if problem.varlen:
        o = unpack_rows(o, bounds, problem.T)
    if problem.state_v_first:
        ht = ht.transpose(-1, -2)
    return o.to(inputs.v.dtype), (ht.contiguous() if problem.output_final_state else None)


_DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def reference_backward(problem: Problem, inputs: GDNInputs, do: torch.Tensor, dht: torch.Tensor | None,
                       form: Callable) -> GDNGrads:
    """Gradients by autograd through a recomputed forward."""
    with torch.enable_grad():
        leaves = {name: getattr(inputs, name) for name in _DIFFERENTIABLE}
        leaves = {n: (None if t is None else t.detach().requires_grad_()) for n, t in leaves.items()}
        o, ht = reference_forward(problem, inputs._replace(**leaves), form)
        pairs = [(o, do), (ht, dht)]
        # An output with no graph (T == 0 gives an empty o) contributes no gradient.
        pairs = [(out, d) for out, d in pairs if out is not None and d is not None and out.requires_grad]
        wrt = [t for t in leaves.values() if t is not None]
        grads = torch.autograd.grad([p[0] for p in pairs], wrt, [p[1] for p in pairs],
                                    allow_unused=True) if pairs else [None] * len(wrt)
        grads = iter(grads)
    result = []
    for t in leaves.values():
        if t is None:
            result.append(None)
            continue
        grad = next(grads)
        result.append(torch.zeros_like(t) if grad is None else grad)
    return GDNGrads(*result)


# Every call validate_inputs lets through: any device, every float dtype, any head dims, both forms, the pool.
SUPPORT = Support(devices=None, dtypes=FLOAT_DTYPES, head_dims=None, modes=(CHUNK_MODE, RECURRENT_MODE),
                  state_dtypes=FLOAT_DTYPES, pool_state_dtypes=POOL_DTYPES + (torch.float64,))


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0
    description = "pure PyTorch (any device, float64-capable): the definition of correct"
    support = SUPPORT
    serves_state_pool = SUPPORT.serving

    def chunk_forward(self, problem, inputs):
        if problem.serving:
            from .serving import serving_chunk_forward  # imports this module: kept out of its import time
            o, ht = serving_chunk_forward(problem, inputs)
            return o, ht, None
        o, ht = reference_forward(problem, inputs, chunked_gdn)
        return o, ht, inputs

    def chunk_backward(self, problem, saved, do, dht):
        return reference_backward(problem, saved, do, dht, chunked_gdn)

    def recurrent_forward(self, problem, inputs):
        if problem.serving:
            from .serving import serving_forward  # imports this module: kept out of its import time
            o, ht = serving_forward(problem, inputs)
            return o, ht, None
        o, ht = reference_forward(problem, inputs, recurrent_gdn)
        return o, ht, inputs

    def recurrent_backward(self, problem, saved, do, dht):
        return reference_backward(problem, saved, do, dht, recurrent_gdn)
