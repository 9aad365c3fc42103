"""One torch.autograd.Function over any backend's forward/backward entry points."""
from __future__ import annotations

import torch

from gdnkit.problem import CHUNK_MODE, GDNInputs, Problem


DOUBLE_BACKWARD = ("gdnkit does not support double backward: a backward with create_graph=True reached "
                   "chunk_gated_delta_rule / fused_recurrent_gated_delta_rule, whose gradients are not differentiable "
                   "(a second-order term through gdnkit would be silently missing). Take first-order gradients "
                   "without create_graph=True, or keep gdnkit's outputs out of the differentiated graph (detach).")


def _is_tensor_tuple(saved) -> bool:
    return isinstance(saved, tuple) and all(t is None or isinstance(t, torch.Tensor) for t in saved)


class GDNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, problem: Problem, *tensors):
        inputs = GDNInputs(*tensors)
        forward = backend.chunk_forward if problem.mode == CHUNK_MODE else backend.recurrent_forward
        o, ht, saved = forward(problem, inputs)
        ctx.backend, ctx.problem = backend, problem
        # Tensor tuples go through save_for_backward (version checks catch in-place edits of inputs);
        # anything else a backend keeps is held as it is.
        ctx.tensor_saved = _is_tensor_tuple(saved)
        if ctx.tensor_saved:
            ctx.saved_type = type(saved)
            ctx.save_for_backward(*saved)
        else:
            ctx.saved = saved
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        # Grad mode is on inside a backward only under create_graph=True. The backends' backward builds no
        # differentiable graph, and any gradient made of it would either drop gdnkit's second-order term silently
        # (torch.autograd.grad prunes what does not reach its inputs) or raise later far from the cause: so it
        # raises here, at the first backward that asks for a graph.
        if torch.is_grad_enabled():
            raise RuntimeError(DOUBLE_BACKWARD)
        return GDNFunction._gradients(ctx, do, dht)

    @staticmethod
    def _gradients(ctx, do, dht):
        problem: Problem = ctx.problem
        if ctx.tensor_saved:
            saved = ctx.saved_tensors
            saved = ctx.saved_type(*saved) if ctx.saved_type is not tuple else saved
        else:
            saved = ctx.saved
        backward = ctx.backend.chunk_backward if problem.mode == CHUNK_MODE else ctx.backend.recurrent_backward
        grads = backward(problem, saved, do.contiguous(), None if dht is None else dht.contiguous())
        # One gradient per forward argument: backend, problem, then GDNInputs (cu_seqlens has none).
        return (None, None, *grads, None)


def run(backend, problem: Problem, inputs: GDNInputs):
    """Forward through `backend`, recording the graph only when a gradient is needed."""
    if problem.needs_grad:
        return GDNFunction.apply(backend, problem, *inputs)
    forward = backend.chunk_forward if problem.mode == CHUNK_MODE else backend.recurrent_forward
    o, ht, _ = forward(problem, inputs)
    return o, ht
