"""The public calls: thin, documented, FLA 0.6.0-compatible.

Every call validates its arguments (gdnkit.problem), lets dispatch choose a backend, and runs it
through one autograd Function. Each function takes its FLA 0.6 namesake's arguments by the same names
and positions, plus the hints FLA tolerates; where FLA's two functions order their arguments
differently (fused_recurrent's gk, gv before beta), the fifth argument's shape says which order a
positional call was written in, so no call means something else here than there.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

from gdnkit import autograd, dispatch, seqlayout
from gdnkit.dynamo_boundary import compile_ops, outside_dynamo
from gdnkit.problem import CHUNK_MODE, RECURRENT_MODE, validate_inputs, warn_positive_gates

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
        FLA's other arguments are taken as FLA takes them: cu_seqlens_cpu (a host copy of cu_seqlens, read
            instead of the device tensor), chunk_indices, chunk_size, head_first=False, transpose_state_layout
            (state_v_first's old name) and keywords FLA ignores (use_cache, ...); gk, gv, cp_context and
            head_first=True raise ValueError (not implemented).

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
        parent_indices: [N, C] int32/int64 with 2-D ssm_state_indices (tree verify, SGLang's
            retrieve_parent_token): token t continues from the state after token parent[n, t] (an earlier
            token, read back from its slot idx[n, parent[n, t]], so in the pool's dtype), or from the
            sequence's starting state where it is -1. A chain of drafts is parent[n, t] = t - 1.
        inplace_final_state: default True with ssm_state_indices; the second return value is then the pool
            itself. False (1-D indices only): the pool is only read, and the final states are returned as a
            new float32 [N, ...] tensor when output_final_state (zero rows for padding sequences).
        Index values are checked (one host sync on GPU tensors) except while a CUDA graph is being captured;
        no two sequences may write one slot, nor may one read a slot another writes, in the same call.
"""

_POOL_PREFILL_DOC = """
    Prefill on a state pool (vLLM-style; inference only, no autograd):
        ssm_state_indices: [N] int32/int64. Makes initial_state a state pool [num_slots, HV, K, V] (float32,
            bfloat16 or float16 storage, fp32 math; any slot stride, each slot contiguous): sequence n starts
            from slot idx[n] and its final state is written back there in place; the second return value is
            the pool itself. -1 marks a padding sequence: no state memory is touched and its outputs are zero.
        has_initial_state: [N] bool, optional: False marks a new sequence, which starts from a zero state
            (its slot is only written).
        checkpoint_indices: [N, C] int32/int64 with checkpoint_every (a positive multiple of 64): the state
            after (j + 1) * checkpoint_every tokens of sequence n is also written to slot
            checkpoint_indices[n, j] (prefix caching); -1 skips that write, and checkpoints past a sequence's
            length are not written.
        No slot may be written twice in one call, nor read by one sequence and written by another.
"""


def _prepare(mode, q, k, v, g, beta, scale, initial_state, output_final_state, backend, needs_grad=None,
             **options):
    """Validate, pick a backend and make layouts plain: everything before a kernel runs.

    needs_grad overrides what validation reads from requires_grad (gdnkit.integrations.torch_compile's backward
    op runs where autograd is off but needs a backend that has a backward)."""
    problem, inputs = validate_inputs(mode, q, k, v, g, beta, scale, initial_state, output_final_state,
                                      **options)
    if needs_grad is not None:
        problem = dataclasses.replace(problem, needs_grad=needs_grad)
    chosen, decision = dispatch.select(problem, backend, short=dispatch.short_sequences(problem, inputs.cu_seqlens))
    problem = decision.problem   # the form it runs in (a short-sequence chunked call: the recurrent one)
    warn_positive_gates(problem, g)
    # Kernels index raw memory; the reference does not care. One place makes layouts plain. A serving
    # pool is written in place, so it is never copied (validation checked its slots are contiguous).
    keep = ("initial_state",) if problem.serving else ()
    inputs = inputs._replace(**{name: t.contiguous() for name, t in inputs._asdict().items()
                                if t is not None and name not in keep})
    return chosen, problem, inputs


# Eager calls run here, outside Dynamo: dispatch's machine probe and the backends' host-side planning
# (cu_seqlens reads, cached layouts, TileLang launches) are not traceable. Under torch.compile the public
# functions call the gdnkit:: custom ops instead (gdnkit.integrations.torch_compile), whose kernels run _prepare
# and the chosen backend as this does; only a serving call (in-place pool writes) still reaches here as a graph
# break. (outside_dynamo: opaque to Dynamo without importing it for callers who never compile.)
@outside_dynamo
def _call(mode, q, k, v, g, beta, scale, initial_state, output_final_state, backend, **options):
    chosen, problem, inputs = _prepare(mode, q, k, v, g, beta, scale, initial_state, output_final_state, backend,
                                       **options)
    return autograd.run(chosen, problem, inputs, backend)


# FLA's functions take keywords they only read as hints, and ignore any they do not know (transformers passes
# its own, such as use_cache); the same call must work here. These are the ones that mean something.
_UNIMPLEMENTED_HINTS = {
    "head_first": "head_first=True ([B, H, T, ...] inputs) was removed from FLA and is not implemented; "
                  "pass [B, T, H, ...] tensors",
    "gk": "gk (a per-key decay [B, T, HV, K]) is not implemented by gdnkit; only the scalar decay g [B, T, HV]",
    "gv": "gv (a per-value decay [B, T, HV, V]) is not implemented by gdnkit; only the scalar decay g [B, T, HV]",
    "cp_context": "cp_context (FLA's multi-device context parallelism) is not implemented by gdnkit; "
                  "pass cp_context=None (gdnkit splits long sequences on one device itself)",
}


def _fla_hints(state_v_first, cu_seqlens, hints):
    """The FLA keywords gdnkit only reads as hints: the state_v_first they imply (FLA's deprecated
    transpose_state_layout), after rejecting those that would change the result."""
    for name, reason in _UNIMPLEMENTED_HINTS.items():
        value = hints.get(name)
        if value is not None and value is not False:
            raise ValueError(reason)
    if "transpose_state_layout" in hints:
        if state_v_first:
            raise ValueError("pass state_v_first or its deprecated FLA name transpose_state_layout, not both")
        state_v_first = bool(hints["transpose_state_layout"])
    host = hints.get("cu_seqlens_cpu")
    # (under torch.compile the op's eager kernel reads cu_seqlens itself: host-side caching is not traceable)
    if host is not None and cu_seqlens is not None and cu_seqlens.device.type != "cpu" \
            and not torch.compiler.is_compiling():
        seqlayout.remember_host_offsets(cu_seqlens, host)
    return state_v_first


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: float | None = None,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                           allow_neg_eigval: bool = False, state_v_first: bool = False,
                           cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
                           chunk_indices: torch.Tensor | None = None, cp_context=None, *,
                           use_gate_in_kernel: bool = False, A_log: torch.Tensor | None = None,
                           dt_bias: torch.Tensor | None = None, ssm_state_indices: torch.Tensor | None = None,
                           has_initial_state: torch.Tensor | None = None,
                           checkpoint_indices: torch.Tensor | None = None, checkpoint_every: int | None = None,
                           backend: str | None = None, **hints):
    """The gated delta rule over whole sequences (prefill and training), chunked.

    Positional arguments follow FLA 0.6's chunk_gated_delta_rule exactly.
    """
    if cu_seqlens_cpu is not None or cp_context is not None or hints:
        state_v_first = _fla_hints(state_v_first, cu_seqlens,
                                   dict(hints, cu_seqlens_cpu=cu_seqlens_cpu, cp_context=cp_context))
    if torch.compiler.is_compiling() and ssm_state_indices is None:
        return compile_ops().call(CHUNK_MODE, q, k, v, g, beta, scale, initial_state, output_final_state, backend,
                                  use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                                  use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens)
    return _call(CHUNK_MODE, q, k, v, g, beta, scale, initial_state, output_final_state, backend,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                 allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                 ssm_state_indices=ssm_state_indices, has_initial_state=has_initial_state,
                 checkpoint_indices=checkpoint_indices, checkpoint_every=checkpoint_every)


# FLA 0.6 puts gk and gv before beta; gdnkit (as FLA before 0.6, vLLM and the chunked call) puts beta fifth.
# The fifth positional argument tells the two apart: beta is [B, T, HV], gk is None or [B, T, HV, K].
_RECURRENT_FLA_ORDER = ("gk", "gv", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
                        "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                        "state_v_first", "cu_seqlens")
_RECURRENT_ORDER = ("beta", "scale", "initial_state", "output_final_state")


def _recurrent_positional(args, named):
    """Bind positional arguments past g in whichever order they were written; `named` holds the keywords."""
    fla_order = not (isinstance(args[0], torch.Tensor) and args[0].dim() == 3)
    order = _RECURRENT_FLA_ORDER if fla_order else _RECURRENT_ORDER
    if len(args) > len(order):
        form = ("FLA 0.6's (q, k, v, g, gk, gv, beta, ...)" if fla_order else
                "(q, k, v, g, beta, scale, initial_state, output_final_state), after which arguments are "
                "keyword-only")
        raise TypeError(f"fused_recurrent_gated_delta_rule takes at most {4 + len(order)} positional arguments in "
                        f"the order {form}; got {4 + len(args)}")
    for name, value in zip(order, args):
        if named[name] is not _DEFAULTS[name]:
            raise TypeError(f"fused_recurrent_gated_delta_rule got multiple values for argument {name!r}")
        named[name] = value
    return named


_DEFAULTS = dict(gk=None, gv=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                 use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     g: torch.Tensor | None = None, *args,
                                     beta: torch.Tensor | None = None, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None,
                                     output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False, use_gate_in_kernel: bool = False,
                                     A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                                     use_beta_sigmoid_in_kernel: bool = False, allow_neg_eigval: bool = False,
                                     state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
                                     ssm_state_indices: torch.Tensor | None = None,
                                     num_accepted_tokens: torch.Tensor | None = None,
                                     inplace_final_state: bool | None = None,
                                     parent_indices: torch.Tensor | None = None,
                                     backend: str | None = None, **hints):
    """The gated delta rule token by token (decode and short inputs); same semantics as the chunked call.

    Positional: (q, k, v, g, beta, scale, initial_state, output_final_state), or FLA 0.6's order
    (q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, ...),
    recognised by its fifth argument (None or a [B, T, HV, K] gk, where beta is [B, T, HV]).
    g=None means no decay and beta=None a write strength of 1, as in FLA.
    """
    if args and len(args) <= 4 and isinstance(args[0], torch.Tensor) and args[0].dim() == 3:
        given = (beta, scale, initial_state, output_final_state)
        if all(x is d for x, d in zip(given, (None, None, None, False)[:len(args)])):
            # (q, k, v, g, beta, ...) written positionally, the common form (the rest by keyword or not at all),
            # bound without the general path's dicts; a value given twice is left to it, which names it
            beta, scale, initial_state, output_final_state = args + given[len(args):]
            args = ()
    if args:
        named = _recurrent_positional(args, dict(
            gk=hints.pop("gk", None), gv=hints.pop("gv", None), beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
            state_v_first=state_v_first, cu_seqlens=cu_seqlens))
        hints.update(gk=named.pop("gk"), gv=named.pop("gv"))
        return fused_recurrent_gated_delta_rule(q, k, v, g, **named, ssm_state_indices=ssm_state_indices,
                                                num_accepted_tokens=num_accepted_tokens,
                                                inplace_final_state=inplace_final_state,
                                                parent_indices=parent_indices, backend=backend, **hints)
    if hints:
        state_v_first = _fla_hints(state_v_first, cu_seqlens, hints)
    if g is None or beta is None:
        g, beta = _fla_defaults(q, v, g, beta, use_gate_in_kernel, use_beta_sigmoid_in_kernel)
    if torch.compiler.is_compiling() and ssm_state_indices is None:
        return compile_ops().call(RECURRENT_MODE, q, k, v, g, beta, scale, initial_state, output_final_state,
                                  backend, use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                                  use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, cu_seqlens)
    return _call(RECURRENT_MODE, q, k, v, g, beta, scale, initial_state, output_final_state, backend,
                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
                 A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                 allow_neg_eigval=allow_neg_eigval, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                 ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                 inplace_final_state=inplace_final_state, parent_indices=parent_indices)


def _fla_defaults(q, v, g, beta, use_gate_in_kernel, use_beta_sigmoid_in_kernel):
    """FLA's fused_recurrent without g (no decay) or beta (write strength 1), as the tensors meaning that."""
    if not isinstance(q, torch.Tensor) or not isinstance(v, torch.Tensor) or v.dim() != 4:
        return g, beta  # validation names the bad argument
    if g is None:
        if use_gate_in_kernel:
            raise ValueError("use_gate_in_kernel=True computes the decay from the raw gate g; got g=None")
        g = v.new_zeros(v.shape[:3], dtype=torch.float32)
    if beta is None:
        if use_beta_sigmoid_in_kernel:
            raise ValueError("use_beta_sigmoid_in_kernel=True takes beta as logits; got beta=None")
        beta = v.new_ones(v.shape[:3])
    return g, beta


# A string expression after the signature is no docstring: the shared argument text is appended here.
chunk_gated_delta_rule.__doc__ += _ARGS_DOC + _POOL_PREFILL_DOC
fused_recurrent_gated_delta_rule.__doc__ += _ARGS_DOC + _SERVING_DOC


# explain's own leading arguments, shared with both calls
_EXPLAIN_LEADING = ("mode", "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state")


def explain(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, *,
            mode: str = CHUNK_MODE, backend: str | None = None, **options) -> dispatch.Decision:
    """Which backend the same call would run, every other backend's reasons, and where the chosen backend says
    how it would run the call, its plan (runs no kernel).

    `mode="recurrent"` explains fused_recurrent_gated_delta_rule instead. `str(decision)` reads well.
    A forced `backend=` that cannot take the call is explained too (`decision.runs` is False, its reasons
    listed) where the call itself would raise BackendNotSupportedError.
    """
    if mode not in (CHUNK_MODE, RECURRENT_MODE):
        raise ValueError(f"mode must be {CHUNK_MODE!r} or {RECURRENT_MODE!r}, got {mode!r}")
    call = chunk_gated_delta_rule if mode == CHUNK_MODE else fused_recurrent_gated_delta_rule
    # the options the call takes that mean something (FLA's hints and `backend` aside), by name
    meaningful = inspect.signature(validate_inputs).parameters
    taken = [name for name in inspect.signature(call).parameters
             if name in meaningful and name not in _EXPLAIN_LEADING]
    unknown = [name for name in options if name not in taken]
    if unknown:
        raise TypeError(f"explain() got an unexpected keyword argument {unknown[0]!r}; with mode={mode!r} it takes "
                        f"{call.__name__}'s: {', '.join(taken)}")
    problem, inputs = validate_inputs(mode, q, k, v, g, beta, scale, initial_state, output_final_state, **options)
    decision = dispatch.decide(problem, backend, short=dispatch.short_sequences(problem, inputs.cu_seqlens))
    if decision.runs:
        plan = dispatch.get(decision.chosen).plan(decision.problem, inputs, dispatch.machine())
        if plan:
            decision = dataclasses.replace(decision, plan=plan)
    return decision


def available_backends() -> list[str]:
    """Names of the backends that can run on this machine (each still checks every problem)."""
    machine = dispatch.machine()
    return [b.name for b in dispatch.backends() if not b.unavailable_reasons(machine)]

