"""FLA 0.6's call surface: every argument its two functions take, by name and by position, means the same here;
the hints FLA tolerates are accepted, and what gdnkit does not implement raises a ValueError naming it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gdnkit
from gdnkit import seqlayout

# FLA 0.6's signatures (fla/ops/gated_delta_rule/chunk.py and fused_recurrent.py), positional order.
FLA_CHUNK = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
             "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
             "chunk_indices", "cp_context")
FLA_CHUNK_KWARGS = ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size", "transpose_state_layout")
FLA_RECURRENT = ("q", "k", "v", "g", "gk", "gv", "beta", "scale", "initial_state", "output_final_state",
                 "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
                 "allow_neg_eigval", "state_v_first", "cu_seqlens")


def _x(T=19, H=1, HV=2, K=8, V=4, seed=0, raw=False):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, v = r(1, T, H, K), F.normalize(r(1, T, H, K), dim=-1), r(1, T, HV, V)
    g = r(1, T, HV) if raw else F.logsigmoid(r(1, T, HV))
    beta = r(1, T, HV) if raw else torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, r(2, HV, K, V)


def _same(a, b):
    assert torch.equal(a[0], b[0]) and ((a[1] is None and b[1] is None) or torch.equal(a[1], b[1]))


def _fla_values(raw_h0, cu):
    """One value per FLA argument past beta, all non-default where gdnkit implements it."""
    return dict(scale=0.3, initial_state=raw_h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, A_log=torch.linspace(-1, 0.5, 2, dtype=torch.float64),
                dt_bias=torch.linspace(0.1, -0.2, 2, dtype=torch.float64), use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=True, state_v_first=True, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(),
                chunk_indices=None, cp_context=None, gk=None, gv=None)


def test_chunk_takes_fla_positional_order():
    q, k, v, g, beta, h0 = _x(raw=True)
    cu = torch.tensor([0, 7, 19])
    vals = _fla_values(h0.transpose(-1, -2).contiguous(), cu)
    gate = {n: vals[n] for n in ("use_gate_in_kernel", "A_log", "dt_bias")}
    by_name = gdnkit.chunk_gated_delta_rule(q, k, v, g, beta, **{n: vals[n] for n in FLA_CHUNK[5:]}, **gate)
    by_position = gdnkit.chunk_gated_delta_rule(q, k, v, g, beta, *[vals[n] for n in FLA_CHUNK[5:]], **gate)
    _same(by_position, by_name)
    plain = gdnkit.chunk_gated_delta_rule(q, k, v, g, beta, 0.3, vals["initial_state"], True,
                                          use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                          allow_neg_eigval=True, state_v_first=True, cu_seqlens=cu, **gate)
    _same(by_name, plain)


def test_recurrent_takes_fla_06_positional_order_and_its_own():
    q, k, v, g, beta, h0 = _x(raw=True)
    cu = torch.tensor([0, 7, 19])
    vals = dict(_fla_values(h0.transpose(-1, -2).contiguous(), cu), beta=beta)
    want = gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, **{n: vals[n] for n in FLA_RECURRENT[4:]})
    fla_06 = gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, *[vals[n] for n in FLA_RECURRENT[4:]])
    _same(fla_06, want)
    rest = {n: vals[n] for n in FLA_RECURRENT[10:]}
    own = gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, beta, 0.3, vals["initial_state"], True, **rest)
    _same(own, want)
    fla_keywords = gdnkit.fused_recurrent_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta, scale=0.3,
                                                           initial_state=vals["initial_state"],
                                                           output_final_state=True, **rest)
    _same(fla_keywords, want)


def test_recurrent_positional_errors():
    q, k, v, g, beta, h0 = _x()
    with pytest.raises(TypeError, match="at most 8 positional arguments.*keyword-only"):
        gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, beta, None, h0, True, True)
    with pytest.raises(TypeError, match="multiple values for argument 'beta'"):
        gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, beta, beta=beta)
    with pytest.raises(TypeError, match="multiple values for argument 'beta'"):
        gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, None, None, beta, beta=beta)
    with pytest.raises(ValueError, match="gk .*per-key decay"):  # FLA 0.6's fifth argument is gk
        gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, torch.randn(1, 19, 2, 8, dtype=torch.float64))


def test_recurrent_defaults_for_missing_g_and_beta():
    q, k, v, g, beta, h0 = _x()
    h0 = h0[:1]
    ones, zeros = torch.ones_like(beta), torch.zeros_like(g)
    _same(gdnkit.fused_recurrent_gated_delta_rule(q, k, v, None, beta=beta, initial_state=h0, output_final_state=True),
          gdnkit.fused_recurrent_gated_delta_rule(q, k, v, zeros, beta, initial_state=h0, output_final_state=True))
    _same(gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, initial_state=h0),
          gdnkit.fused_recurrent_gated_delta_rule(q, k, v, g, ones, initial_state=h0))
    with pytest.raises(ValueError, match="use_gate_in_kernel=True .* got g=None"):
        gdnkit.fused_recurrent_gated_delta_rule(q, k, v, None, beta, use_gate_in_kernel=True, A_log=g[0, 0])


@pytest.mark.parametrize("fn", [gdnkit.chunk_gated_delta_rule, gdnkit.fused_recurrent_gated_delta_rule])
def test_hints_are_accepted(fn):
    q, k, v, g, beta, h0 = _x()
    cu = torch.tensor([0, 4, 19])
    want = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    # what FLA reads as hints, and what transformers' layers pass along to it
    got = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu,
             chunk_indices=torch.zeros(2, 2, dtype=torch.long), chunk_size=32, head_first=False, cp_context=None,
             use_cache=True, position_ids=torch.arange(19)[None], output_attentions=False, max_length_q=15)
    _same(got, want)


@pytest.mark.parametrize("fn", [gdnkit.chunk_gated_delta_rule, gdnkit.fused_recurrent_gated_delta_rule])
def test_transpose_state_layout_is_state_v_first(fn):
    q, k, v, g, beta, h0 = _x()
    h0t = h0[:1].transpose(-1, -2).contiguous()
    _same(fn(q, k, v, g, beta, initial_state=h0t, output_final_state=True, transpose_state_layout=True),
          fn(q, k, v, g, beta, initial_state=h0t, output_final_state=True, state_v_first=True))
    with pytest.raises(ValueError, match="state_v_first or its deprecated FLA name transpose_state_layout"):
        fn(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)


@pytest.mark.parametrize("fn", [gdnkit.chunk_gated_delta_rule, gdnkit.fused_recurrent_gated_delta_rule])
@pytest.mark.parametrize("name, value", [("head_first", True), ("cp_context", object()),
                                         ("gk", torch.zeros(1, 19, 2, 8)), ("gv", torch.zeros(1, 19, 2, 4))])
def test_unimplemented_fla_options_raise_naming_them(fn, name, value):
    q, k, v, g, beta, _ = _x()
    with pytest.raises(ValueError, match=name):
        fn(q, k, v, g, beta, **{name: value})


def test_host_offsets_from_cu_seqlens_cpu():
    """A host copy of a CPU cu_seqlens changes nothing (the tensor itself is read every call, free on a CPU: its
    content is the truth); one of the wrong length is refused, naming cu_seqlens_cpu."""
    cu = torch.tensor([0, 3, 9], dtype=torch.int32)
    seqlayout.remember_host_offsets(cu, torch.tensor([0, 3, 9]))
    assert seqlayout.host_offsets(cu) == (0, 3, 9)
    other = torch.tensor([0, 5, 9], dtype=torch.int32)
    seqlayout.remember_host_offsets(other, [0, 4, 9])
    assert seqlayout.host_offsets(other) == (0, 5, 9)
    with pytest.raises(ValueError, match="cu_seqlens_cpu must hold the 3 offsets"):
        seqlayout.remember_host_offsets(torch.tensor([0, 1, 2], dtype=torch.int32), [0, 2])
