"""One torch.autograd.Function over any backend's forward/backward entry points."""
from __future__ import annotations

import sys

import torch

from gdnkit.dispatch import KernelsBuilding, stand_in
from gdnkit.problem import CHUNK_MODE, GDNInputs, Problem


DOUBLE_BACKWARD = ("gdnkit does not support double backward: a backward with create_graph=True reached "
                   "chunk_gated_delta_rule / fused_recurrent_gated_delta_rule, whose gradients are not differentiable "
                   "(a second-order term through gdnkit would be silently missing). Take first-order gradients "
                   "without create_graph=True, or keep gdnkit's outputs out of the differentiated graph (detach).")


def _is_tensor_tuple(saved) -> bool:
    return isinstance(saved, tuple) and all(t is None or isinstance(t, torch.Tensor) for t in saved)


def forward(backend, problem: Problem, inputs: GDNInputs, requested: str | None = None):
    """(the backend that ran, o, final state, saved): `backend`'s forward, or, while its kernels for the call are
    being built (its first call at a new configuration), the stand-in's (dispatch.stand_in: the next backend
    under auto dispatch), whose backward then runs too; where there is none (a named backend, GDNKIT_STAND_IN=0),
    the call waits for the kernels. requested: the backend= the call named (None: auto or GDNKIT_BACKEND)."""
    if problem.mode != CHUNK_MODE:
        return backend, *backend.recurrent_forward(problem, inputs)
    try:
        return backend, *backend.chunk_forward_unless_building(problem, inputs)
    except KernelsBuilding as building:
        other = stand_in(problem, backend.name, requested)
        if other is None:
            return backend, *building.resume()
        if building.first:
            print(f"gdnkit: until {backend.name}'s kernels for {building.what} are built, its calls run on "
                  f"{other.name} (GDNKIT_STAND_IN=0 waits for them instead)", file=sys.stderr, flush=True)
        return other, *other.chunk_forward(problem, inputs)


class GDNFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, backend, problem: Problem, requested, *tensors):
        inputs = GDNInputs(*tensors)
        backend, o, ht, saved = forward(backend, problem, inputs, requested)
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
        # One gradient per forward argument: backend, problem, requested, then GDNInputs (cu_seqlens has none).
        return (None, None, None, *grads, None)


def run(backend, problem: Problem, inputs: GDNInputs, requested: str | None = None):
    """Forward through `backend` (or its stand-in: `forward`), recording the graph only when a gradient is
    needed."""
    if problem.needs_grad:
        return GDNFunction.apply(backend, problem, requested, *inputs)
    _, o, ht, _ = forward(backend, problem, inputs, requested)
    return o, ht
