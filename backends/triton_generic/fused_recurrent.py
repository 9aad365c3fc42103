"""triton_generic's decode, multi-token verify and serving state pool: the token-by-token kernel
(triton_shared/recurrence.py, where the states' sources and destinations per call are described) over a
validated recurrent call."""
from __future__ import annotations

import torch

from gdnkit.problem import GDNInputs, Problem

from ..triton_shared.launch import enqueue
from ..triton_shared.recurrence import (READ_DENSE, READ_NONE, READ_SLOT, WRITE_DENSE, WRITE_NONE,
                                        WRITE_SLOT_FINAL, WRITE_SLOT_PER_TOKEN, launch_config, option_flags,
                                        recurrent_kernel)
from ..triton_shared.sizes import cdiv, flat_grid, next_power_of_2


def fused_recurrent_forward(problem: Problem, inputs: GDNInputs, *, block_v: int | None = None,
                            num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, final_state) of a validated recurrent call, plain or serving.

    `inputs` is the GDNInputs of a plain call or the GDNServingInputs of a serving one (ssm_state_indices,
    num_accepted_tokens); `problem` says which. Returns o in v's dtype and: the pool itself (updated in
    place) when problem.inplace_final_state, else a new fp32 [N, ...] final state when
    problem.output_final_state, else None. block_v / num_warps override the launch settings (benchmarks).
    """
    q, k, v, g, beta = (t.contiguous() for t in inputs[:5])
    h0, A_log, dt_bias, cu = inputs.initial_state, inputs.A_log, inputs.dt_bias, inputs.cu_seqlens
    slots = getattr(inputs, "ssm_state_indices", None)
    accepted = getattr(inputs, "num_accepted_tokens", None)
    parents = getattr(inputs, "parent_indices", None)
    if parents is not None:  # read with the indices' row stride (both contiguous)
        parents = parents.contiguous()
    N, HV, K, V = problem.N, problem.HV, problem.K, problem.V
    B, T = q.shape[0], q.shape[1]

    o = torch.empty_like(v)
    ht = None
    if problem.serving:
        read = READ_SLOT
        slots = slots.contiguous()
        if problem.inplace_final_state:
            write = WRITE_SLOT_PER_TOKEN if problem.per_token_slots else WRITE_SLOT_FINAL
            ht = h0
        elif problem.output_final_state:
            write = WRITE_DENSE
            ht = torch.empty(problem.state_shape, device=v.device, dtype=torch.float32)
        else:
            write = WRITE_NONE
    else:
        if h0 is not None:
            h0 = h0.float().contiguous()
        read = READ_DENSE if h0 is not None else READ_NONE
        write = WRITE_DENSE if problem.output_final_state else WRITE_NONE
        if write:
            ht = torch.empty(problem.state_shape, device=v.device, dtype=torch.float32)

    state_bytes = h0.element_size() if problem.serving else 4   # a pool keeps its own dtype; a dense state runs in fp32
    BV, warps = launch_config(K, V, N * HV, state_bytes, problem.state_v_first, write == WRITE_SLOT_PER_TOKEN)
    BV = block_v or BV
    warps = num_warps or warps
    if N * HV == 0:
        return o, ht
    grid = flat_grid(cdiv(V, BV), N * HV)  # V tiles fastest, as the kernel takes its program id apart
    dummy = o  # never dereferenced: the constexpr flags compile its uses away
    enqueue(
        recurrent_kernel, grid,
        q, k, v, g, beta,
        A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
        o, h0 if h0 is not None else dummy, ht if ht is not None else dummy,
        cu if cu is not None else dummy, slots if slots is not None else dummy,
        accepted.contiguous() if accepted is not None else dummy, parents if parents is not None else dummy,
        problem.scale, T, B * T, N,
        h0.stride(0) if problem.serving else 0, ht.stride(0) if write in (2, 3) else 0,
        slots.stride(0) if slots is not None else 0, slots.shape[1] if slots is not None and slots.dim() == 2 else 1,
        H=problem.H, HV=HV, K=K, V=V, BK=next_power_of_2(K), BV=BV,
        IS_VARLEN=cu is not None, READ=read, WRITE=write, HAS_ACCEPTED=accepted is not None,
        **option_flags(problem), TREE=parents is not None,
        num_warps=warps, num_stages=1,
    )
    return o, ht
