"""The public calls: thin, documented, FLA 0.6.0-compatible.

Every call validates its arguments (gdnkit.problem), lets dispatch choose a backend, and runs it
through one autograd Function. Arguments after `output_final_state` are keyword-only: FLA orders
them differently between its own functions, so a positional call that meant one thing there fails
loudly here instead of silently meaning another.
"""
from __future__ import annotations

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


def _call(mode, q, k, v, g, beta, scale, initial_state, output_final_state, backend, **options):
    problem, inputs = validate_inputs(mode, q, k, v, g, beta, scale, initial_state, output_final_state,
                                      **options)
    chosen, _ = dispatch.select(problem, backend)
    # Kernels index raw memory; the reference does not care. One place makes layouts plain.
    inputs = inputs._replace(**{name: t.contiguous() for name, t in inputs._asdict().items() if t is not None})
    return autograd.run(chosen, problem, inputs)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: float | None = None,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False, *,
                           use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                           A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                           use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                           state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
                           backend: str | None = None):
    """The gated delta rule over whole sequences (prefill and training), chunked.""" + _ARGS_DOC
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
                                     backend: str | None = None):
    """The gated delta rule token by token (decode and short inputs); same semantics as the chunked call.
    """ + _ARGS_DOC
    return _call(RECURRENT_MODE, q, k, v, g, beta, scale, initial_state, output_final_state, backend,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                 allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens)


def explain(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
            mode: str = CHUNK_MODE, backend: str | None = None, **options) -> dispatch.Decision:
    """Which backend the same call would run, and every other backend's reasons (runs no kernel).

    `mode="recurrent"` explains fused_recurrent_gated_delta_rule instead. `str(decision)` reads well.
    """
    if mode not in (CHUNK_MODE, RECURRENT_MODE):
        raise ValueError(f"mode must be {CHUNK_MODE!r} or {RECURRENT_MODE!r}, got {mode!r}")
    problem, _ = validate_inputs(mode, q, k, v, g, beta, scale, initial_state, output_final_state, **options)
    return dispatch.select(problem, backend)[1]


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine (each still checks every problem)."""
    machine = dispatch.machine()
    return [b.name for b in dispatch.backends() if not b.unavailable_reasons(machine)]
