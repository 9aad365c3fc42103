"""The two calls as torch.library custom ops, so torch.compile sees one node per call instead of a graph break.

The public functions route here only while Dynamo traces (torch.compiler.is_compiling()); eager calls go
straight to gdnkit.api._call, which keeps the eager path free of the op dispatcher's overhead. The op's kernel runs
what an eager call runs (validation, dispatch, the chosen backend's forward for the same needs_grad), so a compiled
model computes exactly what eager computes. Shapes come from the fake impl without
reading any tensor (cu_seqlens gives N by its length), so varying T or cu_seqlens does not recompile.

Backward: the backends keep arbitrary Python objects between forward and backward (host-side plans), which a
graph cannot carry, so the backward op runs the chosen backend's forward again and then its backward. A compiled
training step therefore pays one extra forward per call. The backward op has no derivative of its own: a
second-order gradient through it raises, as the eager Function does.

The serving interface (ssm_state_indices: in-place writes into a state pool, index values checked on the host)
is not an op: it stays a graph break, as in eager engines that wrap their whole decode step in their own op.
"""
# No `from __future__ import annotations` here: torch.library reads the ops' schemas from real annotation objects
# (torch before 2.5 rejects string annotations).
from typing import Optional

import torch

from gdnkit import api as _api
from gdnkit import autograd as _autograd
from gdnkit.problem import CHUNK_MODE, RECURRENT_MODE

# Order of the tensor arguments, and of the gradients the backward op returns.
_TENSORS = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _options(use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
             allow_neg_eigval, state_v_first, cu_seqlens):
    return dict(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens)


def _no_state(v: torch.Tensor) -> torch.Tensor:
    # An op returns tensors only: "no final state" is an empty one, turned back into None by `call`.
    return v.new_empty(0, dtype=torch.float32)


def _define(mode: str):
    name = "chunk_gated_delta_rule" if mode == CHUNK_MODE else "fused_recurrent_gated_delta_rule"

    @torch.library.custom_op(f"gdnkit::{name}", mutates_args=())
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: Optional[torch.Tensor], A_log: Optional[torch.Tensor],
                dt_bias: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: Optional[float],
                output_final_state: bool, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
                use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, state_v_first: bool,
                backend: Optional[str], needs_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        # Autograd is off inside an op, so whether gradients will be wanted comes as an argument: a backend may
        # take another forward path for training (triton_generic's recurrent call runs the chunked kernels).
        chosen, problem, inputs = _api._prepare(
            mode, q, k, v, g, beta, scale, initial_state, output_final_state, backend, needs_grad=needs_grad,
            **_options(use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                       allow_neg_eigval, state_v_first, cu_seqlens))
        # (the problem's form: a short-sequence chunked call may run token by token, dispatch.short_sequences)
        _, o, ht, _ = _autograd.forward(chosen, problem, inputs, backend)
        return o, (_no_state(v) if ht is None else ht)

    @forward.register_fake
    def _(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, scale, output_final_state,
          use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
          backend, needs_grad):
        if not output_final_state:
            return torch.empty_like(v), _no_state(v)
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        HV, K, V = v.shape[2], q.shape[3], v.shape[3]
        shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        state_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        return torch.empty_like(v), q.new_empty(shape, dtype=state_dtype)

    @torch.library.custom_op(f"gdnkit::{name}_backward", mutates_args=())
    def backward(do: torch.Tensor, dht: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: Optional[torch.Tensor],
                 A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor],
                 scale: Optional[float], output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                 use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
                 state_v_first: bool, backend: Optional[str]) -> list[torch.Tensor]:
        # The backend's own entry points, as gdnkit.autograd.GDNFunction runs them.
        chosen, problem, inputs = _api._prepare(
            mode, q, k, v, g, beta, scale, initial_state, output_final_state, backend, needs_grad=True,
            **_options(use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
                       allow_neg_eigval, state_v_first, cu_seqlens))
        dht = dht if output_final_state and dht is not None and dht.numel() else None
        with _autograd_inside_op():
            # the backward of the backend that ran the forward (a stand-in while the chosen one builds kernels)
            ran, _, _, saved = _autograd.forward(chosen, problem, inputs, backend)
            run_backward = ran.chunk_backward if problem.mode == CHUNK_MODE else ran.recurrent_backward
            grads = run_backward(problem, saved, do.contiguous(), None if dht is None else dht.contiguous())
        # Every argument gets a tensor back (an op cannot return None): zeros where the backend had none.
        return [torch.zeros_like(t) if d is None else d for t, d in _present(inputs, grads)]

    @backward.register_fake
    def _(do, dht, q, k, v, g, beta, initial_state, A_log, dt_bias, *rest):
        return [torch.empty_like(t) for t in (q, k, v, g, beta, initial_state, A_log, dt_bias) if t is not None]

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:9])
        ctx.options = inputs[9:-1]  # (needs_grad, last, is not the backward op's)

    def derivative(ctx, do, dht):
        saved = ctx.saved_tensors
        grads = iter(backward(do, dht, *saved, *ctx.options))
        present = [next(grads) if t is not None else None for t in saved[:8]]
        # One gradient per forward argument: the eight tensors, then none for cu_seqlens, the options, needs_grad.
        return (*present, None, *(None,) * len(ctx.options), None)

    forward.register_autograd(derivative, setup_context=setup_context)
    return forward


_AUTOGRAD_KEYS = None


def _autograd_inside_op():
    """Autograd back on inside an op's kernel, where the dispatcher has turned it off: the reference backend
    computes its backward by autograd through a recomputed forward, which would otherwise see no graph."""
    global _AUTOGRAD_KEYS
    if _AUTOGRAD_KEYS is None:
        keys = torch._C.DispatchKey
        _AUTOGRAD_KEYS = torch._C.DispatchKeySet(keys.AutogradFunctionality)
        for key in (keys.ADInplaceOrView, keys.AutogradOther, keys.AutogradNestedTensor):
            _AUTOGRAD_KEYS = _AUTOGRAD_KEYS | torch._C.DispatchKeySet(key)
    included, excluded = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    return torch._C._ForceDispatchKeyGuard(included, excluded - _AUTOGRAD_KEYS)


def _present(inputs, grads):
    return [(t, d) for t, d in zip(inputs[:8], grads) if t is not None]


_OPS = {CHUNK_MODE: _define(CHUNK_MODE), RECURRENT_MODE: _define(RECURRENT_MODE)}


def call(mode, q, k, v, g, beta, scale, initial_state, output_final_state, backend, use_qk_l2norm_in_kernel,
         use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
         cu_seqlens):
    """The public functions' path under torch.compile: (o, final_state or None), as eager returns."""
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state, A_log, dt_bias))
    o, ht = _OPS[mode](q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
                       None if scale is None else float(scale), bool(output_final_state),
                       bool(use_qk_l2norm_in_kernel), bool(use_gate_in_kernel), bool(use_beta_sigmoid_in_kernel),
                       bool(allow_neg_eigval), bool(state_v_first), backend, needs_grad)
    return o, (ht if output_final_state else None)
