"""One torch.autograd.Function over any backend's forward/backward entry points."""
from __future__ import annotations

import torch

from gdnkit.problem import CHUNK_MODE, GDNInputs, Problem


DOUBLE_BACKWARD = ("gdnkit does not support double backward: the gradients of chunk_gated_delta_rule / "
                   "fused_recurrent_gated_delta_rule were computed with create_graph=True but are not differentiable "
                   "(a second-order term through gdnkit would be silently wrong, so it raises instead)")


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
        with torch.no_grad():
            grads = GDNFunction._gradients(ctx, do, dht)
        if not torch.is_grad_enabled():
            return grads
        # create_graph=True: the backends' backward is no differentiable graph, so the gradients carry one that
        # raises when differentiated (a gradient penalty would otherwise silently lose gdnkit's term); gradients
        # used only as values keep working.
        tensors = [(i, g) for i, g in enumerate(grads) if g is not None]
        raising = torch._C._functions.DelayedError(DOUBLE_BACKWARD, len(tensors))(
            *[g.detach().requires_grad_() for _, g in tensors])
        raising = raising if isinstance(raising, tuple) else (raising,)
        out = list(grads)
        for (i, _), g in zip(tensors, raising):
            out[i] = g
        return tuple(out)

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
