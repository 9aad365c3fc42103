"""The API options the kernels do not fuse yet, as a PyTorch prologue (gdnkit.prep's math) and its
hand-written backward, so chunk_backward returns gradients w.r.t. the raw user inputs without autograd."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gdnkit import prep
from gdnkit.problem import GDNGrads, Problem


def forward(problem: Problem, q, k, g, beta, A_log, dt_bias):
    """Returns the kernel inputs (q, k in their dtype, g and beta fp32) and what the backward needs."""
    stash = {}
    if problem.use_qk_l2norm_in_kernel:
        qf, kf = q.float(), k.float()
        q_rstd = torch.rsqrt((qf * qf).sum(-1, keepdim=True) + prep.L2NORM_EPS)
        k_rstd = torch.rsqrt((kf * kf).sum(-1, keepdim=True) + prep.L2NORM_EPS)
        stash.update(q_raw=q, k_raw=k, q_rstd=q_rstd, k_rstd=k_rstd)
        q, k = (qf * q_rstd).to(q.dtype), (kf * k_rstd).to(k.dtype)
    if problem.use_gate_in_kernel:
        stash.update(g_raw=g)
        g = prep.gate(g.float(), A_log.float(), None if dt_bias is None else dt_bias.float())
    else:
        g = g.float()
    if problem.use_beta_sigmoid_in_kernel:
        stash.update(beta_raw=beta)
        beta = prep.beta_activation(beta.float(), problem.allow_neg_eigval)
    else:
        beta = beta.float()
    return q, k, g, beta, stash


def _l2norm_backward(x, rstd, dy):
    # y = x * rstd: dx = rstd * (dy - y (y . dy))
    y = x.float() * rstd
    return rstd * (dy - y * (y * dy).sum(-1, keepdim=True))


def backward(problem: Problem, stash, dq, dk, dg, dbeta, A_log, dt_bias):
    """dq/dk/dg/dbeta: fp32 gradients w.r.t. the kernel inputs.
    Returns (dq, dk, dg, dbeta, dA_log, ddt_bias) w.r.t. the raw inputs, fp32."""
    dA_log = ddt_bias = None
    if problem.use_qk_l2norm_in_kernel:
        dq = _l2norm_backward(stash["q_raw"], stash["q_rstd"], dq)
        dk = _l2norm_backward(stash["k_raw"], stash["k_rstd"], dk)
    if problem.use_gate_in_kernel:
        x = stash["g_raw"].float()
        if dt_bias is not None:
            x = x + dt_bias.float()
        a = torch.exp(A_log.float())
        sp = F.softplus(x)
        dA_log = (dg * (-a * sp)).sum(dim=(0, 1))
        dg = dg * (-a) * torch.sigmoid(x)
        if dt_bias is not None:
            ddt_bias = dg.sum(dim=(0, 1))
    if problem.use_beta_sigmoid_in_kernel:
        s = torch.sigmoid(stash["beta_raw"].float())
        dbeta = dbeta * s * (1 - s) * (2.0 if problem.allow_neg_eigval else 1.0)
    return dq, dk, dg, dbeta, dA_log, ddt_bias


def sum_head_groups(x: torch.Tensor, H: int) -> torch.Tensor:
    """[B, T, HV, K] -> [B, T, H, K]: the gradient of GVA's broadcast of q/k head h to its HV / H adjacent value
    heads (hv // (HV / H) == h), summed in a fixed order. Slice adds, not .sum over the group dimension: that
    reduction ran at ~110 GB/s on the H200 (0.585 ms for dq and dk at 16/32 1x32768, bf16, fp32 grads)."""
    B, T, HV, K = x.shape
    if HV == H:
        return x
    x = x.view(B, T, H, HV // H, K)
    out = x[:, :, :, 0] + x[:, :, :, 1]
    for i in range(2, HV // H):
        out += x[:, :, :, i]
    return out


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
