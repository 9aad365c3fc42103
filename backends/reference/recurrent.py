"""The gated delta rule token by token: the definition every other form is checked against.

Works on "prepared" tensors (options applied, q/k expanded to the value heads, compute dtype):
q, k [B, T, HV, K], v [B, T, HV, V], g, beta [B, T, HV], state [B, HV, K, V].
Differentiable by autograd; float64 in, float64 out.
"""
from __future__ import annotations

import torch


def recurrent_gdn(q, k, v, g, beta, scale: float, h0: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns o [B, T, HV, V] and the final state [B, HV, K, V]."""
    B, T, HV, K = k.shape
    V = v.shape[-1]
    S = h0 if h0 is not None else k.new_zeros(B, HV, K, V)
    outputs = []
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None, None]
        k_t = k[:, t]
        # u_t = beta_t (v_t - S^T k_t): the error the delta rule corrects.
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + k_t[..., :, None] * u[..., None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outputs, 1) if outputs else v.new_zeros(B, 0, HV, V)
    return o, S
