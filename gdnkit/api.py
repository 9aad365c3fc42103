"""The public calls: thin, documented, FLA 0.6.0-compatible.

Every call validates its arguments (gdnkit.problem), lets dispatch choose a backend, and runs it
through one autograd Function. Arguments after `output_final_state` are keyword-only: FLA orders
them differently between its own functions, so a positional call that meant one thing there fails
loudly here instead of silently meaning another.
"""
from __future__ import annotations

import dataclasses

import torch

from gdnkit import autograd, dispatch
from gdnkit.problem import CHUNK_MODE, RECURRENT_MODE, validate_inputs

_ARGS_DOC = """
    Args:
        q, k: [B, T, H, K] queries and keys.
        v: [B, T, HV, V] values; HV must be a multiple of H (value head j reads q/k head j // (HV // H)).
        g: [B, T, HV] log-space decay (<= 0), or the raw gate input with use_gate_in_kernel.
        beta: [B, T, HV] write strength, or logits with use_beta_sigmoid_in_kernel.
        scale: output scale, default K ** -0.5.
        initial_state: [N, HV, K, V] float32 ([N, HV, V, K] with state_v_first); N = B, or the number of
            sequences with cu_seqlens.
        output_final_state: also return the final state (float32; float64 for float64 inputs).
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first.
        use_gate_in_kernel: g := -exp(A_log) * softplus(g + dt_bias); A_log [HV] required, dt_bias [HV] optional.
        use_beta_sigmoid_in_kernel: beta := sigmoid(beta), times 2 with allow_neg_eigval.
        state_v_first: states are [.., V, K] instead of [.., K, V].
        cu_seqlens: [N+1] int offsets packing N sequences along T (B must be 1). Tokens past cu_seqlens[-1]
            belong to no sequence: their output is zero and they get zero gradient.
        backend: force a backend by name ("reference", ...); default: GDNKIT_BACKEND, else auto.

    Returns:
        (o, final_state): o [B, T, HV, V] in v's dtype; final_state or None.
"""

_SERVING_DOC = """
    Serving (vLLM-style; inference only, no autograd):
        ssm_state_indices: [N] or [N, C] int32/int64. Makes initial_state a state pool [num_slots, HV, K, V]
            (float32, bfloat16 or float16 storage, fp32 math; any slot stride, each slot contiguous) that is
            read and written in place. [N]: sequence n starts from slot idx[n] and its final state is
            written back there. [N, C] (multi-token verify): sequence n starts from slot
            idx[n, num_accepted_tokens[n] - 1] (idx[n, 0] without num_accepted_tokens) and the state after
            its token t is written to slot idx[n, t], so the engine can roll back to any accepted prefix;
            C must cover every sequence's token count. A read slot of -1 marks a padding sequence: no state
            memory is touched and its outputs are zero. A write slot of -1 skips that write.
        num_accepted_tokens: [N] int32/int64 in [1, C], with 2-D ssm_state_indices: how many tokens of the
            previous verify step were accepted, i.e. which kept state to start from.
        inplace_final_state: default True with ssm_state_indices; the second return value is then the pool
            itself. False (1-D indices only): the pool is only read, and the final states are returned as a
            new float32 [N, ...] tensor when output_final_state (zero rows for padding sequences).
        Index values are checked (one host sync on GPU tensors) except while a CUDA graph is being captured;
        no two sequences may write one slot, nor may one read a slot another writes, in the same call.
"""


# Under torch.compile the call is opaque (a graph break), as FLA's is: Dynamo would otherwise trace into dispatch's
# machine probe and the backends' host-side planning (cu_seqlens reads, cached layouts), which it cannot keep
# correct across calls, and TileLang launches it cannot trace at all.
@torch.compiler.disable
def _call(mode, q, k, v, g, beta, scale, initial_state, output_final_state, backend, **options):
    problem, inputs = validate_inputs(mode, q, k, v, g, beta, scale, initial_state, output_final_state,
                                      **options)
    chosen, _ = dispatch.select(problem, backend)
    # Kernels index raw memory; the reference does not care. One place makes layouts plain. A serving
    # pool is written in place, so it is never copied (validation checked its slots are contiguous).
    keep = ("initial_state",) if problem.serving else ()
    inputs = inputs._replace(**{name: t.contiguous() for name, t in inputs._asdict().items()
                                if t is not None and name not in keep})
    return autograd.run(chosen, problem, inputs)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: float | None = None,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False, *,
                           use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                           A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                           use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                           state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
                           backend: str | None = None):
    """The gated delta rule over whole sequences (prefill and training), chunked."""
    return _call(CHUNK_MODE, q, k, v, g, beta, scale, initial_state, output_final_state, backend,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                 allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None,
                                     output_final_state: bool = False, *,
                                     use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                                     A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                                     use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                                     state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
                                     ssm_state_indices: torch.Tensor | None = None,
                                     num_accepted_tokens: torch.Tensor | None = None,
                                     inplace_final_state: bool | None = None,
                                     backend: str | None = None):
    """The gated delta rule token by token (decode and short inputs); same semantics as the chunked call."""
    return _call(RECURRENT_MODE, q, k, v, g, beta, scale, initial_state, output_final_state, backend,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                 allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                 ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                 inplace_final_state=inplace_final_state)


# A string expression after the signature is no docstring: the shared argument text is appended here.
chunk_gated_delta_rule.__doc__ += _ARGS_DOC
fused_recurrent_gated_delta_rule.__doc__ += _ARGS_DOC + _SERVING_DOC


def explain(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
            mode: str = CHUNK_MODE, backend: str | None = None, **options) -> dispatch.Decision:
    """Which backend the same call would run, every other backend's reasons, and where the chosen backend says
    how it would run the call, its plan (runs no kernel).

    `mode="recurrent"` explains fused_recurrent_gated_delta_rule instead. `str(decision)` reads well.
    """
    if mode not in (CHUNK_MODE, RECURRENT_MODE):
        raise ValueError(f"mode must be {CHUNK_MODE!r} or {RECURRENT_MODE!r}, got {mode!r}")
    problem, inputs = validate_inputs(mode, q, k, v, g, beta, scale, initial_state, output_final_state, **options)
    chosen, decision = dispatch.select(problem, backend)
    plan = chosen.plan(problem, inputs, dispatch.machine())
    return dataclasses.replace(decision, plan=plan) if plan else decision


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine (each still checks every problem)."""
    machine = dispatch.machine()
    return [b.name for b in dispatch.backends() if not b.unavailable_reasons(machine)]
