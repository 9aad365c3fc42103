"""Accuracy: every implementation against the float64 reference, and against each other.

The ground truth is gdnkit's reference backend run token by token (the recurrent definition) in
float64 on the very inputs the implementation got (bf16 values, upcast), so the error measured is
the implementation's own and not the rounding of its inputs. Errors are relative L2,
||x - ref|| / ||ref||, and the largest over the compared tensors.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .inputs import ChunkInputs, call_options


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; NaN/inf anywhere gives inf (never passes a bound)."""
    x, ref = x.detach().double(), ref.detach().double().to(x.device)
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs {tuple(ref.shape)}")
    err = float((x - ref).norm() / ref.norm().clamp_min(1e-300))
    return err if math.isfinite(err) else math.inf


def max_rel_l2(xs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    return max(rel_l2(x, r) for x, r in zip(xs, refs))


def _f64(inp: ChunkInputs, requires_grad: bool) -> ChunkInputs:
    def up(t):
        if t is None:
            return None
        t = t.detach().double()
        return t.requires_grad_(requires_grad) if requires_grad else t
    return ChunkInputs(up(inp.q), up(inp.k), up(inp.v), up(inp.g), up(inp.beta), inp.cu_seqlens,
                       up(inp.initial_state) if inp.initial_state is not None else None,
                       None if inp.do is None else inp.do.detach().double())


def reference_outputs(inp: ChunkInputs, kind: str) -> list[torch.Tensor]:
    """The float64 truth for one problem. kind: "fwd" -> [o]; "bwd" -> [dq, dk, dv, dg, dbeta];
    "decode" -> [o, final_state]; "mtp" -> [o, every token's state [B, T, HV, K, V]]."""
    import gdnkit

    x = _f64(inp, requires_grad=kind == "bwd")
    if kind == "mtp":   # token by token, keeping each state
        outs, states, h = [], [], x.initial_state
        with torch.no_grad():
            for t in range(x.q.shape[1]):
                o, h = gdnkit.fused_recurrent_gated_delta_rule(
                    x.q[:, t:t + 1], x.k[:, t:t + 1], x.v[:, t:t + 1], x.g[:, t:t + 1], x.beta[:, t:t + 1],
                    initial_state=h, output_final_state=True, backend="reference", **call_options())
                outs.append(o)
                states.append(h)
        return [torch.cat(outs, dim=1), torch.stack(states, dim=1)]
    with torch.enable_grad() if kind == "bwd" else torch.no_grad():
        o, ht = gdnkit.fused_recurrent_gated_delta_rule(
            x.q, x.k, x.v, x.g, x.beta, initial_state=x.initial_state,
            output_final_state=kind == "decode", cu_seqlens=x.cu_seqlens, backend="reference", **call_options())
        if kind == "fwd":
            return [o]
        if kind == "decode":
            return [o, ht]
        grads = torch.autograd.grad(o, x.leaves(), x.do)
        return [g.detach() for g in grads]
