"""The sm90 chunked backward (issue 6, BACKWARD.md): two TileLang launches after a training forward.

    backward_state.py  per (sequence, value head, V tile), chunks right to left: dS on chip; stores every
                       chunk's dS_end (dh), dU, dX (= dV) and dh0
    chunk_grads.py     per (chunk, value head), in parallel: dq, dk (per value head), dg, dbeta from S0 (the
                       forward's, forward.Saved.hs), dS_end, dU and dX

then GVA's sum of dq / dk over the value heads of each q/k head (a fixed order: bitwise repeatable; no float
atomics anywhere), and the options' prologue undone (gdnkit.prologue). backends/reference/chunked_backward.py
is the definition every stage is checked against.

Not yet: context parallelism (a training forward runs without it, so the backward walks whole sequences).
"""
from __future__ import annotations

import functools

import torch

from gdnkit import prologue, seqlayout
from gdnkit.problem import GDNGrads, Problem

from .forward import CHUNK, TARGET, TORCH_TO_TL, Saved, _plan_block_v

# the reverse pass's TMA ring depth (backward_state.py fits 2 stages at 64 columns)
STAGES = 2


@functools.lru_cache(maxsize=None)
def _jit():
    import tilelang

    from . import backward_state, chunk_grads

    def jit(module, program):
        return tilelang.jit(program, target=TARGET, pass_configs=module.PASS_CONFIGS)

    return jit(backward_state, backward_state.backward_state_program), jit(chunk_grads, chunk_grads.chunk_grads_program)


@functools.lru_cache(maxsize=None)
def backward_state_kernel(H: int, HV: int, dtype: str, has_dht: bool, store_dh0: bool, block_v: int):
    return _jit()[0](H, HV, dtype, has_dht=has_dht, store_dh0=store_dh0, block_v=block_v, stages=STAGES)


@functools.lru_cache(maxsize=None)
def chunk_grads_kernel(H: int, HV: int, dtype: str):
    return _jit()[1](H, HV, dtype)


def backward(problem: Problem, saved: Saved, do: torch.Tensor, dht: torch.Tensor | None) -> GDNGrads:
    """Gradients w.r.t. the user's inputs (in their dtypes) for the output gradient do [B, T, HV, V] and the
    final-state gradient dht (None: zero)."""
    s = saved
    layout = s.layout
    B, T = do.shape[:2]
    total, H, K = s.q.shape[1], s.q.shape[2], s.q.shape[3]
    HV, V, N = problem.HV, problem.V, problem.N
    dev = do.device
    dt = TORCH_TO_TL[problem.dtype]
    do = do.reshape(1, total, HV, V).to(s.v.dtype).contiguous()
    if dht is not None:
        dht = dht.float()
        dht = (dht.transpose(-1, -2) if problem.state_v_first else dht).contiguous()
    placeholder = torch.empty(1, HV, K, V, device=dev, dtype=torch.float32)  # an argument never read
    store_dh0 = s.h0 is not None

    # the reverse pass: rows the kernels leave unwritten (past cu_seqlens[-1]) are zero, since the per-chunk
    # kernel's TMA boxes read them
    du = seqlayout.packed_output((1, total, HV, V), layout.cu_seqlens, device=dev, dtype=s.v.dtype)
    dv = seqlayout.packed_output((1, total, HV, V), layout.cu_seqlens, device=dev, dtype=s.v.dtype)
    dh = torch.empty(layout.n_chunks, HV, K, V, device=dev, dtype=s.v.dtype)
    dh0 = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if store_dh0 else None
    kernel = backward_state_kernel(H, HV, dt, dht is not None, store_dh0, _plan_block_v(N, HV, dev))
    kernel(s.q, s.k, s.a, do, s.gamma, layout.cu_seqlens, layout.chunk_offsets,
           placeholder if dht is None else dht, du, dv, dh, placeholder if dh0 is None else dh0,
           float(problem.scale))

    # the parallel part, per value head
    dq = seqlayout.packed_output((1, total, HV, K), layout.cu_seqlens, device=dev, dtype=torch.float32)
    dk = seqlayout.packed_output((1, total, HV, K), layout.cu_seqlens, device=dev, dtype=torch.float32)
    dg = seqlayout.packed_output((1, total, HV), layout.cu_seqlens, device=dev, dtype=torch.float32)
    dbeta = seqlayout.packed_output((1, total, HV), layout.cu_seqlens, device=dev, dtype=torch.float32)
    chunk_grads_kernel(H, HV, dt)(s.q, s.k, s.v, do, du, dv, s.a, s.tm, s.gamma, s.beta, s.hs, dh,
                                  layout.cu_seqlens, layout.chunk_indices, dq, dk, dg, dbeta, float(problem.scale))
    # GVA: the value heads of one q/k head are adjacent (hv // (HV / H)); summed in a fixed order
    dq = dq.view(B, T, H, HV // H, K).sum(3)
    dk = dk.view(B, T, H, HV // H, K).sum(3)
    dg, dbeta, dv = dg.view(B, T, HV), dbeta.view(B, T, HV), dv.view(B, T, HV, V)
    dq, dk, dg, dbeta, dA_log, ddt_bias = prologue.backward(problem, s.stash, dq, dk, dg, dbeta, s.A_log,
                                                           s.dt_bias)
    if dh0 is not None and problem.state_v_first:
        dh0 = dh0.transpose(-1, -2)
    return prologue.grads_in_input_dtypes(s.dtypes, dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias)
