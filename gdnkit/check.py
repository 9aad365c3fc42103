"""`python -m gdnkit check`: every backend this machine has, against the float64 reference.

The main job on a new machine: draws random problems (varlen, grouped heads, state, options), runs
each available backend forward and backward, and reports relative L2 errors against autograd through
the float64 recurrence, plus a rough wall time. `--json` keeps the machine probe with the rows so
reports from several GPU generations can be compared.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import time

import torch
import torch.nn.functional as F

import gdnkit
from gdnkit import dispatch
from gdnkit.problem import CHUNK_MODE

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@dataclasses.dataclass(frozen=True)
class CheckProblem:
    name: str
    B: int
    H: int
    HV: int
    K: int
    lengths: tuple[int, ...]  # one entry per sequence; more than one means varlen packing
    options: tuple[tuple[str, bool], ...] = ()

    def describe(self) -> str:
        seqs = "+".join(map(str, self.lengths)) if len(self.lengths) > 1 else str(self.lengths[0])
        opts = ",".join(n.replace("use_", "").replace("_in_kernel", "") for n, on in self.options if on)
        return f"B={self.B} T={seqs} H={self.H} HV={self.HV} K=V={self.K}" + (f" {opts}" if opts else "")


def problems(K: int) -> list[CheckProblem]:
    return [
        CheckProblem("fixed", B=2, H=2, HV=4, K=K, lengths=(200,)),
        CheckProblem("varlen", B=1, H=2, HV=8, K=K, lengths=(0, 1, 64, 135, 133)),
        CheckProblem("options", B=1, H=1, HV=2, K=K, lengths=(97,),
                     options=(("use_qk_l2norm_in_kernel", True), ("use_gate_in_kernel", True),
                              ("use_beta_sigmoid_in_kernel", True), ("state_v_first", True))),
    ]


def make_call(p: CheckProblem, dtype: torch.dtype, device: str, seed: int) -> dict:
    """Keyword arguments of one call; g/beta follow the benchmarks (logsigmoid, sigmoid of noise)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(p.lengths)
    N = len(p.lengths) if len(p.lengths) > 1 else p.B
    B = 1 if len(p.lengths) > 1 else p.B
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    opts = dict(p.options)
    q, k = rnd(B, T, p.H, p.K), rnd(B, T, p.H, p.K)
    if not opts.get("use_qk_l2norm_in_kernel"):
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = rnd(B, T, p.HV) if opts.get("use_gate_in_kernel") else F.logsigmoid(rnd(B, T, p.HV))
    beta = rnd(B, T, p.HV) if opts.get("use_beta_sigmoid_in_kernel") else torch.sigmoid(rnd(B, T, p.HV))
    state = rnd(N, p.HV, p.K, p.K) * 0.1
    call = dict(q=q.to(dtype), k=k.to(dtype), v=rnd(B, T, p.HV, p.K).to(dtype), g=g.float(), beta=beta.float(),
                initial_state=state.float(), output_final_state=True, **opts)
    if opts.get("use_gate_in_kernel"):
        call.update(A_log=(rnd(p.HV) * 0.5).float(), dt_bias=rnd(p.HV).float())
    if len(p.lengths) > 1:
        call["cu_seqlens"] = torch.tensor([0, *torch.tensor(p.lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in call.items()}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def _forward_backward(call: dict, backend: str, seed: int, grad: bool):
    leaves = {n: call[n].detach().clone().requires_grad_(grad) for n in GRAD_NAMES}
    o, s = gdnkit.chunk_gated_delta_rule(**{**call, **leaves}, backend=backend)
    grads = None
    if grad:
        gen = torch.Generator().manual_seed(seed + 7)
        do = torch.randn(o.shape, generator=gen).to(o)
        dht = torch.randn(s.shape, generator=gen).to(s)
        grads = dict(zip(GRAD_NAMES, torch.autograd.grad([o, s], list(leaves.values()), [do, dht])))
    return o.detach(), s.detach(), grads


def check_backend(backend: str, p: CheckProblem, device: str, dtype: torch.dtype, seed: int) -> dict:
    call = make_call(p, dtype, device, seed)
    row = {"backend": backend, "problem": p.describe(), "dtype": str(dtype).removeprefix("torch."), "device": device}
    exact = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in call.items()}
    o_ref, s_ref, g_ref = _forward_backward(exact, "reference", seed, grad=True)

    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            req = {n: call[n].detach().requires_grad_(grad) for n in GRAD_NAMES}
            decision = gdnkit.explain(**{**call, **req}, mode=CHUNK_MODE, backend=None)
            reasons = decision.reasons.get(backend, [])
        if reasons:
            row["grad_err" if grad else "fwd_err"] = None
            row.setdefault("skipped", []).append(("backward: " if grad else "forward: ") + "; ".join(reasons))
            continue
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        o, s, grads = _forward_backward(call, backend, seed, grad)
        if device == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3
        if grad:
            errs = {n: _rel(grads[n], g_ref[n]) for n in GRAD_NAMES}
            worst = max(errs, key=errs.get)
            row.update(grad_err=errs[worst], grad_worst=worst, grad_errs=errs, fwd_bwd_ms=elapsed)
        else:
            row.update(fwd_err=_rel(o, o_ref), state_err=_rel(s, s_ref), fwd_ms=elapsed)
    return row


def run_check(backends: list[str] | None = None, seed: int = 0) -> dict:
    machine = dispatch.machine()
    device = "cuda" if machine.gpus else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    K = 128 if device == "cuda" else 32
    names = backends or gdnkit.available_backends()
    rows = []
    for name in names:
        for i, p in enumerate(problems(K)):
            try:
                rows.append(check_backend(name, p, device, dtype, seed + i))
            except Exception as exc:  # one broken backend must not hide the others' results
                rows.append({"backend": name, "problem": p.describe(), "error": f"{type(exc).__name__}: {exc}"})
    return {"date": datetime.date.today().isoformat(), "gdnkit": gdnkit.__version__,
            "machine": machine.to_dict(), "device": device, "rows": rows}


def format_table(report: dict) -> str:
    def num(x, fmt="{:.2e}"):
        return "-" if x is None else fmt.format(x)
    header = f"{'backend':<16} {'problem':<60} {'dtype':<9} {'fwd err':>9} {'grad err':>9} {'worst':>14} {'fwd ms':>8}"
    lines = [header, "-" * len(header)]
    for r in report["rows"]:
        if "error" in r:
            lines.append(f"{r['backend']:<16} {r['problem']:<60} ERROR {r['error']}")
            continue
        lines.append(f"{r['backend']:<16} {r['problem']:<60} {r['dtype']:<9} {num(r.get('fwd_err')):>9} "
                     f"{num(r.get('grad_err')):>9} {r.get('grad_worst', '-'):>14} "
                     f"{num(r.get('fwd_ms'), '{:.1f}'):>8}")
        for why in r.get("skipped", []):
            lines.append(f"{'':<16}   not run: {why}")
    return "\n".join(lines)


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
