"""The API options the kernels do not fuse yet, as a prologue before them (gdnkit.prep's math) and its
hand-written backward, so chunk_backward returns gradients w.r.t. the raw user inputs without autograd. The qk
l2norm runs as one Triton pass each way where Triton can read the tensors (backends/triton_shared/l2norm.py), else in
torch; the gate and beta activations, on [B, T, HV] only, in torch."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from gdnkit import prep
from gdnkit.problem import GDNGrads, Problem


def triton_reads(x: torch.Tensor) -> bool:
    """Whether a Triton kernel takes x: Triton is installed and x is a CUDA tensor, or a CPU one under the Triton
    interpreter (the CPU tests). The l2norm passes here and tilelang_sm90's group sums ask it."""
    if x.device.type != "cuda" and not (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _l2norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / sqrt(sum(x^2) + eps) in x's dtype, rstd [..., 1] fp32) over the last dim."""
    if triton_reads(x):
        from gdnkit.backends.triton_shared.l2norm import l2norm_forward
        return l2norm_forward(x)
    xf = x.float()
    rstd = torch.rsqrt((xf * xf).sum(-1, keepdim=True) + prep.L2NORM_EPS)
    return (xf * rstd).to(x.dtype), rstd


def forward(problem: Problem, q, k, g, beta, A_log, dt_bias):
    """Returns the kernel inputs (q, k in their dtype, g and beta fp32) and what the backward needs."""
    stash = {}
    if problem.use_qk_l2norm_in_kernel:
        (q_n, q_rstd), (k_n, k_rstd) = _l2norm(q), _l2norm(k)
        stash.update(q_raw=q, k_raw=k, q_rstd=q_rstd, k_rstd=k_rstd)
        q, k = q_n, k_n
    if problem.use_gate_in_kernel:
        stash.update(g_raw=g)
        g = prep.gate(g.float(), A_log.float(), None if dt_bias is None else dt_bias.float())
    else:
        g = g.float()
    # the chunked kernels' floor on the log-gate (-inf resets would give NaN in their cumulative sums); the
    # backward zeroes dg below it, from the unclamped gate (the user's tensor itself where it is fp32)
    stash.update(g_unfloored=g)
    g = prep.floor_gate(g)
    if problem.use_beta_sigmoid_in_kernel:
        stash.update(beta_raw=beta)
        beta = prep.beta_activation(beta.float(), problem.allow_neg_eigval)
    else:
        beta = beta.float()
    return q, k, g, beta, stash


def l2norm_backward_fp32(x, rstd, dy):
    """The l2norm's backward in torch, fp32: rstd * (dy - y (y . dy)) with y = x * rstd, over the last dim (also
    tilelang_sm90's group sums' torch form)."""
    y = x.float() * rstd
    return rstd * (dy - y * (y * dy).sum(-1, keepdim=True))


def _l2norm_backward(x, rstd, dy):
    """dx in x's dtype for y = x * rstd, in fp32 before the one rounding."""
    if triton_reads(x):
        from gdnkit.backends.triton_shared.l2norm import l2norm_backward
        return l2norm_backward(x, rstd, dy)
    return l2norm_backward_fp32(x, rstd, dy).to(x.dtype)


def backward(problem: Problem, stash, dq, dk, dg, dbeta, A_log, dt_bias, qk_normed: bool = False,
             gate_floored: bool = False):
    """dq/dk/dg/dbeta: gradients w.r.t. the kernel inputs, fp32 (dq / dk may come in their output dtype where
    no l2norm backward follows: sum_qk_head_groups). Returns (dq, dk, dg, dbeta, dA_log, ddt_bias) w.r.t. the
    raw inputs, fp32 except dq / dk passed through in another dtype or made by the l2norm backward in q's and
    k's. qk_normed: dq / dk are w.r.t. the raw q / k already (a backend ran the l2norm backward fused);
    gate_floored: dg is w.r.t. the gate before its floor already (a backend ran prep.floor_gate_backward fused)."""
    dA_log = ddt_bias = None
    if problem.use_qk_l2norm_in_kernel and not qk_normed:
        dq = _l2norm_backward(stash["q_raw"], stash["q_rstd"], dq)
        dk = _l2norm_backward(stash["k_raw"], stash["k_rstd"], dk)
    if not gate_floored:
        dg = prep.floor_gate_backward(stash["g_unfloored"], dg)
    if problem.use_gate_in_kernel:
        x = stash["g_raw"].float()
        if dt_bias is not None:
            x = x + dt_bias.float()
        a = torch.exp(A_log.float())
        sp = F.softplus(x)
        dA_log = _chain(dg, -a * sp).sum(dim=(0, 1))
        dg = _chain(dg, -a * torch.sigmoid(x))
        if dt_bias is not None:
            ddt_bias = dg.sum(dim=(0, 1))
    if problem.use_beta_sigmoid_in_kernel:
        s = torch.sigmoid(stash["beta_raw"].float())
        dbeta = _chain(dbeta, s * (1 - s) * (2.0 if problem.allow_neg_eigval else 1.0))
    return dq, dk, dg, dbeta, dA_log, ddt_bias


def _chain(upstream: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """upstream * local, where a zero upstream gradient stays zero whatever the local derivative: tokens past
    cu_seqlens[-1] get zero gradient from the kernels and may hold anything (NaN * 0 would be NaN, and summed into
    dA_log / ddt_bias it would spoil the whole call's)."""
    return torch.where(upstream == 0, torch.zeros((), dtype=upstream.dtype, device=upstream.device), upstream * local)


def sum_head_groups(x: torch.Tensor, H: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, T, HV, K] -> [B, T, H, K]: the gradient of GVA's broadcast of q/k head h to its HV / H adjacent value
    heads (hv // (HV / H) == h), summed in a fixed order. Slice adds, not .sum over the group dimension: that
    reduction ran at ~110 GB/s on the H200 (0.585 ms for dq and dk at 16/32 1x32768, bf16, fp32 grads).
    dtype: the result's, where nothing after the sum needs fp32 (the last add writes it: the same fp32 sum
    rounded once, as a cast afterwards would give, without that cast's extra pass over the fp32 sums)."""
    B, T, HV, K = x.shape
    if HV == H:
        return x if dtype is None else x.to(dtype)
    G = HV // H
    x = x.view(B, T, H, G, K)
    acc = x[:, :, :, 0]
    for i in range(1, G - 1):  # the first add makes a new tensor (x is the caller's); later adds go into it
        acc = acc + x[:, :, :, i] if i == 1 else acc.add_(x[:, :, :, i])
    if x.requires_grad:  # out= does not differentiate: the same sum and rounding, in two passes
        return (acc + x[:, :, :, G - 1]).to(dtype or x.dtype)
    out = torch.empty(B, T, H, K, device=x.device, dtype=dtype or x.dtype)
    return torch.add(acc, x[:, :, :, G - 1], out=out)


def sum_qk_head_groups(problem: Problem, dtypes: dict, dq: torch.Tensor, dk: torch.Tensor, H: int):
    """Both backends' GVA sums of dq, dk [B, T, HV, K] over each q/k head's value heads (a cast alone where
    the kernels already summed them, HV == H: triton_generic): written in their inputs' dtypes
    (input_dtypes), unless the l2norm backward still has to run on them (then fp32)."""
    if problem.use_qk_l2norm_in_kernel:
        return sum_head_groups(dq, H), sum_head_groups(dk, H)
    return sum_head_groups(dq, H, dtypes["q"]), sum_head_groups(dk, H, dtypes["k"])


def input_dtypes(inputs) -> dict:
    """The dtypes of the user's tensors (GDNInputs), which the backward's gradients are returned in."""
    q, k, v, g, beta, h0, A_log, dt_bias, _ = inputs
    of = lambda t: None if t is None else t.dtype  # noqa: E731
    return dict(q=q.dtype, k=k.dtype, v=v.dtype, g=g.dtype, beta=beta.dtype, h0=of(h0), A_log=of(A_log),
                dt_bias=of(dt_bias))


def grads_in_input_dtypes(dtypes: dict, dq, dk, dv, dg, dbeta, dh0, dA_log, ddt_bias):
    """GDNGrads with every gradient in its input's dtype (input_dtypes); None stays None."""
    cast = lambda x, name: None if x is None else x.to(dtypes[name])  # noqa: E731
    return GDNGrads(dq=cast(dq, "q"), dk=cast(dk, "k"), dv=cast(dv, "v"), dg=cast(dg, "g"), dbeta=cast(dbeta, "beta"),
                    dinitial_state=cast(dh0, "h0"), dA_log=cast(dA_log, "A_log"), ddt_bias=cast(ddt_bias, "dt_bias"))
