"""triton_generic: the chunked gated delta rule (chunk 64) in Triton, forward and backward, for any CUDA GPU
of compute capability 8.0 or newer. Imports without triton: kernels are imported inside the entry points.
"""
from __future__ import annotations

import torch

from gdnkit.dispatch import Backend, Machine, register
from gdnkit.dispatch.requirements import cuda_tensor_reasons, gpu_reasons, package_reasons
from gdnkit.problem import GDNGrads, GDNInputs, Problem

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NEEDS = "compute capability >= 8.0"


def _accepts(capability: tuple[int, int]) -> bool:
    return capability >= (8, 0)


class TritonGenericBackend(Backend):
    name = "triton_generic"
    priority = 50
    description = ("Triton kernels for any CUDA GPU (sm80+): chunked WY form (chunk 64) forward and backward, "
                   "fused recurrent decode with the serving state pool")
    serves_state_pool = True

    def unavailable_reasons(self, machine: Machine) -> list[str]:
        return package_reasons(machine, "triton") + gpu_reasons(machine, _accepts, NEEDS)

    def supports(self, problem: Problem, machine: Machine) -> list[str]:
        reasons = cuda_tensor_reasons(problem, machine, _accepts, NEEDS)
        if problem.dtype == torch.float64:
            reasons.append("float64 runs on the reference")
        elif problem.dtype not in DTYPES:
            reasons.append(f"dtype {problem.dtype} is not one of bfloat16, float16, float32")
        if problem.K not in HEAD_DIMS:
            reasons.append(f"key head dim K={problem.K} is not one of {HEAD_DIMS}")
        if problem.V not in HEAD_DIMS:
            reasons.append(f"value head dim V={problem.V} is not one of {HEAD_DIMS}")
        # A serving pool may store bf16/fp16 states (the decode kernel computes in fp32); dense states are fp32.
        state_dtypes = (torch.float32, torch.bfloat16, torch.float16) if problem.serving else (torch.float32,)
        if problem.state_dtype is not None and problem.state_dtype not in state_dtypes:
            reasons.append(f"initial_state must be {' or '.join(str(d)[6:] for d in state_dtypes)} here, "
                           f"got {problem.state_dtype}")
        return reasons

    def chunk_forward(self, problem: Problem, inputs: GDNInputs):
        from . import chunked
        return chunked.forward(problem, inputs)

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
