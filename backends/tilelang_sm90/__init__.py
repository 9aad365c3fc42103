"""tilelang_sm90: the chunked GDN forward and backward as TileLang kernels for Hopper (sm_90a), K = V = 128,
bf16/fp16.

    intra_chunk.py       per (chunk, value head): gamma, Tb = T diag(beta) (and T for training)   (launch 1)
    state_output_*.py    per (sequence, value head, V tile): the state pass fused with the output  (launch 2)
    forward.py           forward(problem, inputs) -> (o, final state, Saved): prologue, kernel cache, launches
    backward_state.py    the backward's reverse dS pass                                           (launch 3)
    chunk_grads.py       the backward's per-chunk gradients                                       (launch 4)
    backward.py          backward(problem, saved, do, dht) -> GDNGrads

Decode (the recurrent form) stays on triton_generic, whose token-by-token kernel runs at ~90% of the H200's
copy bandwidth.

Importing this package needs neither tilelang nor a GPU; forward() imports tilelang on first use.
"""
from __future__ import annotations

import torch

from gdnkit.dispatch import Backend, Machine, register
from gdnkit.dispatch.support import Support
from gdnkit.problem import CHUNK_MODE, GDNGrads, GDNInputs, Problem

# The state passes launch one program per (V tile, value head, sequence) with the sequences on the grid's second
# or third axis, which CUDA stops at 65535 (the backward's likewise): more sequences go to triton_generic,
# whose launches take any count (one grid axis).
SUPPORT = Support(
    devices=("cuda",), packages=("tilelang",), capabilities=((9, 0),),
    dtypes=(torch.bfloat16, torch.float16), head_dims=(128,), modes=(CHUNK_MODE,),
    state_dtypes=(torch.float32,), pool_state_dtypes=(), max_sequences=65535,
    why={"capability": "Hopper: wgmma and TMA",
         "mode": "decode runs on triton_generic's token-by-token kernel",
         "head_dim": "the Qwen3.5/3.6 shape",
         "serving": "prefill on a state pool runs on triton_generic, whose state pass reads and writes the slots in "
                    "the kernel (here a gather and a scatter would add two passes over the pool)",
         "sequences": "the state passes' sequences lie on a CUDA grid axis; triton_generic takes any count"})


class TileLangSM90Backend(Backend):
    name = "tilelang_sm90"
    priority = 70  # above triton_generic: on Hopper this is the fast path
    description = ("TileLang kernels for Hopper (sm_90a): TMA loads on mbarriers, wgmma products, the state "
                   "pass fused with the output; chunked forward and backward, K = V = 128, bf16/fp16")
    support = SUPPORT
    serves_state_pool = SUPPORT.serving

    def plan(self, problem: Problem, inputs: GDNInputs, machine: Machine) -> str | None:
        """The call's Plan (plan.py) under the current Config, in a few lines."""
        from gdnkit import seqlayout

        from . import config, plan
        cu = inputs.cu_seqlens
        layout = seqlayout.dense_layout(problem.B, problem.T, cu.device if cu is not None else inputs.q.device) \
            if cu is None else seqlayout.sequence_layout(cu)
        if layout.n_chunks == 0:
            return "no tokens: nothing to launch"
        from .kernel_build import building
        gpu = machine.gpu(problem.device_index)
        resources = plan.Resources(gpu.sm_count if gpu else 0, machine.has_package("triton"))
        described = plan.plan(problem, layout, resources, config.current()).describe()
        under_way = building()
        if under_way:
            names = ", ".join(sorted(set(under_way)))
            described += (f"\nkernels: {len(under_way)} building in the background ({names}); until they are "
                          f"built, calls that need them run on a stand-in (GDNKIT_STAND_IN)")
        return described

    def chunk_forward_unless_building(self, problem: Problem, inputs: GDNInputs):
        """The forward, or KernelsBuilding while the kernels it needs (for training, its backward's too) build in
        worker processes (kernel_build.first_call)."""
        return self.chunk_forward(problem, inputs, defer=True)

    def chunk_forward(self, problem: Problem, inputs: GDNInputs, *, defer: bool = False):
        """defer: raise KernelsBuilding rather than wait for kernels being built (chunk_forward_unless_building)."""
        from ..triton_shared.recurrence import repair_nonfinite_chunks
        from .forward import forward
        from .kernel_build import first_call
        o, ht, saved = first_call(lambda: forward(problem, inputs), lambda: _every_launch(problem, inputs),
                                  lambda: _what(problem), defer=defer)
        repair_nonfinite_chunks(problem, inputs, o)   # a non-finite input reaches no earlier token (semantics.md)
        return o, ht, saved

    def chunk_backward(self, problem: Problem, saved, do: torch.Tensor, dht: torch.Tensor | None) -> GDNGrads:
        from .backward import backward
        from .kernel_build import first_call
        return first_call(lambda: backward(problem, saved, do, dht), lambda: backward(problem, saved, do, dht),
                          lambda: _what(problem))

    def recurrent_forward(self, problem: Problem, inputs: GDNInputs):
        raise NotImplementedError("tilelang_sm90 has no recurrent form; supports() declines it")

    def recurrent_backward(self, problem: Problem, saved, do: torch.Tensor, dht: torch.Tensor | None) -> GDNGrads:
        raise NotImplementedError("tilelang_sm90 has no recurrent form; supports() declines it")


def _every_launch(problem: Problem, inputs: GDNInputs) -> None:
    """The call's launches (kernel_build's dry run): the forward, and where the call trains, the backward it will
    run, with and without a final-state gradient, so one build serves the whole step; and the causal repair's
    Triton kernel, compiled without a launch (its compile then overlaps the builds rather than following them)."""
    from ..triton_shared.recurrence import repair_nonfinite_chunks
    from .backward import backward
    from .forward import forward
    o, ht, saved = forward(problem, inputs)
    if saved is not None:
        for dht in (None,) if ht is None else (None, torch.empty_like(ht)):
            backward(problem, saved, torch.empty_like(o), dht)
    repair_nonfinite_chunks(problem, inputs, o, compile_only=True)


def _what(problem: Problem) -> str:
    dtype = str(problem.dtype).removeprefix("torch.")
    return f"H={problem.H}, HV={problem.HV}, {dtype}{', training' if problem.needs_grad else ''}"


BACKEND = register(TileLangSM90Backend())

__all__ = ["BACKEND", "TileLangSM90Backend"]
