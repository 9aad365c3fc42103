"""triton_generic: the chunked gated delta rule (chunk 64) in Triton, forward and backward, for any CUDA GPU
of compute capability 8.0 or newer. Imports without triton: kernels are imported inside the entry points.
"""
from __future__ import annotations

import torch

from gdnkit.dispatch import Backend, register
from gdnkit.dispatch.support import Support
from gdnkit.problem import CHUNK_MODE, RECURRENT_MODE, GDNGrads, GDNInputs, Problem

SUPPORT = Support(
    devices=("cuda",), packages=("triton",), min_capability=(8, 0),
    dtypes=(torch.bfloat16, torch.float16, torch.float32), head_dims=(64, 128, 256), modes=(CHUNK_MODE, RECURRENT_MODE),
    # a serving pool may store bf16 / fp16 states (the kernels compute in fp32); dense states are fp32
    state_dtypes=(torch.float32,), pool_state_dtypes=(torch.float32, torch.bfloat16, torch.float16),
    why={"dtype": "float64 runs on the reference"})


class TritonGenericBackend(Backend):
    name = "triton_generic"
    priority = 50
    description = ("Triton kernels for any CUDA GPU (sm80+): chunked WY form (chunk 64) forward and backward, "
                   "fused recurrent decode with the serving state pool")
    support = SUPPORT
    serves_state_pool = SUPPORT.serving

    def chunk_forward(self, problem: Problem, inputs: GDNInputs):
        from ..triton_shared.recurrence import repair_nonfinite_chunks
        from . import chunked
        o, ht, saved = chunked.forward(problem, inputs)
        repair_nonfinite_chunks(problem, inputs, o)   # a non-finite input reaches no earlier token (semantics.md)
        return o, ht, saved

    def chunk_backward(self, problem: Problem, saved, do: torch.Tensor, dht: torch.Tensor | None) -> GDNGrads:
        from . import chunked
        return chunked.backward(problem, saved, do, dht)

    # Decode and serving run the token-by-token kernel (fused_recurrent.py): one pass over the state.
    # It has no backward, so a recurrent call that needs gradients takes the chunked kernels, which
    # compute the same function.
    def recurrent_forward(self, problem: Problem, inputs: GDNInputs):
        if problem.needs_grad:
            return self.chunk_forward(problem, inputs)
        from .fused_recurrent import fused_recurrent_forward
        o, ht = fused_recurrent_forward(problem, inputs)
        return o, ht, None

    def recurrent_backward(self, problem: Problem, saved, do: torch.Tensor, dht: torch.Tensor | None) -> GDNGrads:
        return self.chunk_backward(problem, saved, do, dht)


BACKEND = register(TritonGenericBackend())

__all__ = ["BACKEND", "TritonGenericBackend"]
