"""One test per validation rule: the error type, and a message naming the argument and the values."""
from __future__ import annotations

import re

import pytest
import torch

import gdnkit

from conftest import make_inputs


def base(**over):
    x = make_inputs(1, 10, 2, 4, 8, 8, dtype=torch.float32, seed=0)
    x.update(over)
    return x


def expect(exc, pattern, **kw):
    args = base(**{k: v for k, v in kw.items() if k in ("q", "k", "v", "g", "beta", "initial_state")})
    opts = {k: v for k, v in kw.items() if k not in args}
    for fn in (gdnkit.chunk_gated_delta_rule, gdnkit.fused_recurrent_gated_delta_rule):
        with pytest.raises(exc, match=pattern):
            fn(**args, **opts)


def test_rank():
    expect(ValueError, r"q must have rank 4 \(\[B, T, H, K\]\), got shape \[10, 2, 8\]", q=torch.randn(10, 2, 8))
    expect(ValueError, r"v must have rank 4", v=torch.randn(1, 10, 32))


def test_qk_shape_mismatch():
    expect(ValueError, re.escape("k must have the same shape as q [B, T, H, K] = [1, 10, 2, 8], got [1, 10, 2, 4]"),
           k=torch.randn(1, 10, 2, 4))


def test_v_batch_or_time_mismatch():
    expect(ValueError, r"v must have shape \[B, T, HV, V\] with B=1, T=10", v=torch.randn(1, 9, 4, 8))


def test_head_ratio():
    expect(ValueError, r"multiple of the q/k heads: v has HV=3, q/k have H=2 \(HV % H = 1\)",
           v=torch.randn(1, 10, 3, 8), g=torch.randn(1, 10, 3), beta=torch.rand(1, 10, 3))


def test_g_and_beta_shapes():
    expect(ValueError, re.escape("g must have shape [B, T, HV] = [1, 10, 4], got [1, 10, 2]"), g=torch.randn(1, 10, 2))
    expect(ValueError, re.escape("beta must have shape [B, T, HV] = [1, 10, 4], got [1, 10, 4, 1]"),
           beta=torch.rand(1, 10, 4, 1))


def test_dtypes():
    expect(TypeError, r"q, k and v must share one floating dtype: q is torch.float32, v is torch.float16",
           v=torch.randn(1, 10, 4, 8, dtype=torch.float16))
    expect(TypeError, r"q must be a floating tensor .* got torch.int64", q=torch.ones(1, 10, 2, 8, dtype=torch.long),
           k=torch.ones(1, 10, 2, 8, dtype=torch.long), v=torch.ones(1, 10, 4, 8, dtype=torch.long))
    expect(TypeError, r"g must be a floating tensor, got torch.int32", g=torch.ones(1, 10, 4, dtype=torch.int32))
    expect(TypeError, r"q must be a torch.Tensor, got list", q=[1.0])


def test_devices():
    expect(ValueError, r"all tensors must be on one device: q is on cpu, beta is on meta",
           beta=torch.rand(1, 10, 4, device="meta"))


def test_cu_seqlens_rules():
    expect(ValueError, r"cu_seqlens must be 1-D", cu_seqlens=torch.tensor([[0, 10]]))
    expect(TypeError, r"cu_seqlens must be an int32 or int64 tensor, got torch.float32",
           cu_seqlens=torch.tensor([0.0, 10.0]))
    expect(ValueError, r"cu_seqlens must start at 0, got cu_seqlens\[0\]=2", cu_seqlens=torch.tensor([2, 10]))
    expect(ValueError, r"non-decreasing, got cu_seqlens\[1\]=6 > cu_seqlens\[2\]=4",
           cu_seqlens=torch.tensor([0, 6, 4, 10]))
    expect(ValueError, r"cu_seqlens ends at 11, past the 10 tokens", cu_seqlens=torch.tensor([0, 5, 11]))
    expect(ValueError, r"at least 2 offsets", cu_seqlens=torch.tensor([0]))


def test_batch_with_cu_seqlens():
    x = make_inputs(2, 10, 2, 4, 8, 8, dtype=torch.float32, initial_state=False)
    with pytest.raises(ValueError, match=r"batch size must be 1, got B=2"):
        gdnkit.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 10]))


def test_initial_state_shape_and_count():
    expect(ValueError, r"one state per sequence: N=2 \(len\(cu_seqlens\) - 1\), got 1",
           cu_seqlens=torch.tensor([0, 4, 10]))
    expect(ValueError, re.escape("initial_state must have shape [N, HV, K, V] = [1, 4, 8, 8], got [1, 4, 8, 4]"),
           initial_state=torch.randn(1, 4, 8, 4))
    expect(ValueError, re.escape("[N, HV, V, K] (state_v_first) = [1, 4, 8, 8], got [1, 4, 4, 8]"),
           initial_state=torch.randn(1, 4, 4, 8), state_v_first=True)
    expect(TypeError, r"initial_state must be a floating tensor .* got torch.int32",
           initial_state=torch.zeros(1, 4, 8, 8, dtype=torch.int32))


def test_half_initial_state_is_taken_as_float32():
    """FLA takes a bf16 / fp16 initial state (a model's cache in its dtype): the same call as with its float32
    value, and the gradient comes back in the caller's dtype."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 20, 2, 8, generator=gen), torch.randn(1, 20, 2, 8, generator=gen)
    v, g, beta = torch.randn(1, 20, 4, 8, generator=gen), -torch.rand(1, 20, 4, generator=gen), torch.rand(1, 20, 4)
    h0 = torch.randn(1, 4, 8, 8, generator=gen).bfloat16().requires_grad_()
    o, ht = gdnkit.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o32, ht32 = gdnkit.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0.detach().float(), output_final_state=True)
    assert ht.dtype == torch.float32
    torch.testing.assert_close((o, ht), (o32, ht32), rtol=0, atol=0)
    ht.sum().backward()
    assert h0.grad is not None and h0.grad.dtype == torch.bfloat16 and h0.grad.abs().sum() > 0


def test_gate_parameters():
    expect(ValueError, r"use_gate_in_kernel=True needs A_log of shape \[HV\]", use_gate_in_kernel=True)
    expect(ValueError, re.escape("A_log must have shape [HV] = [4], got [2]"), use_gate_in_kernel=True,
           A_log=torch.randn(2))
    expect(ValueError, re.escape("dt_bias must have shape [HV] = [4], got [4, 1]"), use_gate_in_kernel=True,
           A_log=torch.randn(4), dt_bias=torch.randn(4, 1))
    expect(ValueError, r"only used with use_gate_in_kernel=True", A_log=torch.randn(4))


def test_allow_neg_eigval_needs_sigmoid():
    expect(ValueError, r"allow_neg_eigval=True .* needs use_beta_sigmoid_in_kernel=True", allow_neg_eigval=True)


def test_scale_type_and_positional_options():
    expect(TypeError, r"scale must be a float or None, got str", scale="0.1")
    x = base()
    with pytest.raises(TypeError):  # options after output_final_state are keyword-only
        gdnkit.chunk_gated_delta_rule(*x.values(), None, False, True)


def test_nothing_runs_before_validation(monkeypatch):
    """A bad call fails in validation: the backend's entry point is never reached."""
    from gdnkit.backends.reference import BACKEND

    def boom(*a, **k):
        raise AssertionError("kernel ran")
    monkeypatch.setattr(BACKEND, "chunk_forward", boom)
    expect_args = base(g=torch.randn(1, 10, 3))
    with pytest.raises(ValueError, match="g must have shape"):
        gdnkit.chunk_gated_delta_rule(**expect_args)
