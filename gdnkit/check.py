"""`python -m gdnkit check`: every backend this machine can run, against an independent float64 recurrence.

The main job on a new machine. A sweep of small problems covers what a user relies on: fixed-length and
packed (varlen) batches with empty and one-token sequences and tokens past the last offset, grouped value
heads, initial and final states, every option, the decode form and the serving state pool (1-D slot
indices with -1 padding; 2-D per-token slots with num_accepted_tokens), gradients of the chunked call, in
float32, bfloat16 and float16 where a backend takes them. Every row is compared with a plain token-by-token
loop in float64 written in this file (it shares no code with the backends or gdnkit.prep) on the same
rounded inputs, against a tolerance per dtype, and the run ends with one verdict line: PASS, or
FAIL (n of m rows) and exit code 1.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import time

import torch
import torch.nn.functional as F

import gdnkit
from gdnkit import dispatch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Relative L2 error bars per dtype: (forward outputs and states, gradients). bf16 output alone rounds to ~1.5e-3
# and fast kernels land at 2.5e-3..3.5e-3 at K = V = 128; fp16 has 3 more mantissa bits; fp32 inputs meet fp32
# (or tf32x3) arithmetic end to end. Gradients pass through more roundings (dO, recomputed intermediates).
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (5e-3, 1e-2)}
L2NORM_EPS = 1e-6  # use_qk_l2norm_in_kernel: x / sqrt(sum(x^2) + eps), FLA's definition

OPTION_NAMES = {"use_qk_l2norm_in_kernel": "qk-l2norm", "use_gate_in_kernel": "gate", "dt_bias": "dt_bias",
                "use_beta_sigmoid_in_kernel": "beta-sigmoid", "allow_neg_eigval": "neg-eigval",
                "state_v_first": "v-first"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem of the sweep. lengths: one entry per sequence; with packed=True they are packed along T of
    one batch row by cu_seqlens (pad tokens after the last one), else each is a batch row (all equal)."""

    name: str
    mode: str  # "chunk" or "recurrent"
    H: int
    HV: int
    K: int
    lengths: tuple[int, ...]
    packed: bool = False
    pad: int = 0
    initial_state: bool = True
    final_state: bool = True
    options: tuple[str, ...] = ()  # names of OPTION_NAMES set True (dt_bias: passed with the gate)
    pool: str = ""  # "", "slots" (1-D ssm_state_indices) or "per-token" (2-D with num_accepted_tokens)
    dtypes: tuple[torch.dtype, ...] = DTYPES

    @property
    def grads(self) -> bool:
        return self.mode == "chunk"

    def describe(self) -> str:
        if self.packed:
            seqs = "varlen " + "+".join(map(str, self.lengths)) + (f" (+{self.pad} past the end)" if self.pad else "")
        else:
            seqs = f"B={len(self.lengths)} T={self.lengths[0]}"
        state = {(True, True): "h0+ht", (True, False): "h0", (False, True): "ht", (False, False): "no state"}[
            (self.initial_state, self.final_state)]
        pool = {"slots": "pool, 1-D slots with -1", "per-token": "pool, 2-D slots + num_accepted_tokens"}
        parts = [self.mode, seqs, f"H={self.H} HV={self.HV} K=V={self.K}", pool.get(self.pool, state)]
        parts += [OPTION_NAMES[o] for o in self.options]
        return ", ".join(parts)


def cases(K: int, hopper_rows: bool) -> list[Case]:
    """The sweep at head dim K; hopper_rows adds the K = V = 128 rows tilelang_sm90 takes (bf16, few kernels)."""
    sweep = [
        Case("gva", "chunk", H=2, HV=4, K=K, lengths=(70, 70)),
        Case("varlen", "chunk", H=2, HV=4, K=K, lengths=(0, 1, 40, 0, 70), packed=True, pad=3),
        Case("options", "chunk", H=1, HV=2, K=K, lengths=(1, 66), packed=True,
             options=("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "dt_bias", "use_beta_sigmoid_in_kernel",
                      "allow_neg_eigval", "state_v_first")),
        Case("gate-no-bias", "chunk", H=2, HV=2, K=K, lengths=(67,), initial_state=False, final_state=False,
             options=("use_gate_in_kernel", "use_beta_sigmoid_in_kernel")),
        Case("decode", "recurrent", H=2, HV=4, K=K, lengths=(1, 1, 1, 1)),
        Case("recurrent-varlen", "recurrent", H=1, HV=2, K=K, lengths=(3, 0, 5), packed=True,
             options=("use_qk_l2norm_in_kernel", "state_v_first")),
        Case("pool", "recurrent", H=2, HV=4, K=K, lengths=(1, 1, 1, 1), pool="slots",
             options=("use_qk_l2norm_in_kernel", "use_gate_in_kernel", "dt_bias", "use_beta_sigmoid_in_kernel")),
        Case("pool-verify", "recurrent", H=2, HV=4, K=K, lengths=(4, 2, 3, 1), packed=True, pool="per-token",
             options=("use_gate_in_kernel", "dt_bias", "use_beta_sigmoid_in_kernel")),
    ]
    if hopper_rows:
        sweep.append(Case("varlen-128", "chunk", H=2, HV=4, K=128, lengths=(0, 1, 64, 135), packed=True,
                          dtypes=(torch.bfloat16,)))
    return sweep


# --- inputs ----------------------------------------------------------------------------------------------------

POOL_SLOTS = 12
# slot indices of the pool cases: 1-D, sequence 1 is padding; 2-D [N, C=4], sequence 3 is padding (its read slot,
# column num_accepted_tokens - 1, is -1) and two writes are skipped (-1)
SLOTS_1D = [3, -1, 0, 7]
SLOTS_2D = [[2, 4, -1, 5], [1, 8, 9, 10], [11, 6, 0, -1], [-1, 3, -1, -1]]
ACCEPTED = [2, 1, 3, 1]


def make_call(case: Case, dtype: torch.dtype, device: str, seed: int) -> dict:
    """The keyword arguments of one call (tensors on `device`); g and beta float32, as models pass them."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    opts = set(case.options)
    N = len(case.lengths)
    B, T = (1, sum(case.lengths) + case.pad) if case.packed else (N, case.lengths[0])
    q, k = rnd(B, T, case.H, case.K), rnd(B, T, case.H, case.K)
    if "use_qk_l2norm_in_kernel" not in opts:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = rnd(B, T, case.HV) if "use_gate_in_kernel" in opts else F.logsigmoid(rnd(B, T, case.HV))
    beta = rnd(B, T, case.HV) if "use_beta_sigmoid_in_kernel" in opts else torch.sigmoid(rnd(B, T, case.HV))
    call = dict(q=q.to(dtype), k=k.to(dtype), v=rnd(B, T, case.HV, case.K).to(dtype), g=g.float(),
                beta=beta.float(), output_final_state=case.final_state)
    call.update({o: True for o in opts if o != "dt_bias"})
    if "use_gate_in_kernel" in opts:
        call["A_log"] = (rnd(case.HV) * 0.5).float()
        if "dt_bias" in opts:
            call["dt_bias"] = rnd(case.HV).float()
    if case.packed:
        call["cu_seqlens"] = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32)
    if case.pool:
        call["initial_state"] = (rnd(POOL_SLOTS, case.HV, case.K, case.K) * 0.1).to(dtype)
        call["ssm_state_indices"] = torch.tensor(SLOTS_1D if case.pool == "slots" else SLOTS_2D, dtype=torch.int32)
        if case.pool == "per-token":
            call["num_accepted_tokens"] = torch.tensor(ACCEPTED, dtype=torch.int32)
    elif case.initial_state:
        call["initial_state"] = (rnd(N, case.HV, case.K, case.K) * 0.1).float()
    return {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in call.items()}


GRAD_LEAVES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


def _grad_seeds(v: torch.Tensor, ht: torch.Tensor | None, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """dO in o's dtype (v's) and d(final state) in float32, as a training step passes them."""
    gen = torch.Generator().manual_seed(seed + 7)
    do = torch.randn(v.shape, generator=gen).to(v)
    return do, None if ht is None else torch.randn(ht.shape, generator=gen).to(device=v.device, dtype=torch.float32)


# --- the independent float64 recurrence ------------------------------------------------------------------------

def recurrence(call: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, final state or the state pool after the call) of `call` in float64, token by token: per sequence and
    token t, S = exp(g_t) S; u = beta_t (v_t - S^T k_t); S = S + k_t u^T; o_t = scale S^T q_t, each value head
    reading q/k head j // (HV / H). Differentiable in every floating input."""
    f64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in call.items()}
    q, k, v, g, beta = (f64[n] for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if f64.get("use_qk_l2norm_in_kernel"):
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    if f64.get("use_gate_in_kernel"):
        x = g + f64["dt_bias"] if f64.get("dt_bias") is not None else g
        g = -torch.exp(f64["A_log"]) * torch.log1p(torch.exp(x))   # softplus, written out
    if f64.get("use_beta_sigmoid_in_kernel"):
        beta = (2.0 if f64.get("allow_neg_eigval") else 1.0) / (1 + torch.exp(-beta))
    q, k = (x.repeat_interleave(HV // H, dim=2) for x in (q, k))
    scale = f64.get("scale") or K ** -0.5
    v_first = bool(f64.get("state_v_first"))
    cu = f64.get("cu_seqlens")
    seqs = ([(0, int(s), int(e)) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())] if cu is not None
            else [(b, 0, T) for b in range(B)])
    h0, idx, accepted = f64.get("initial_state"), f64.get("ssm_state_indices"), f64.get("num_accepted_tokens")
    pool = None if idx is None else list(h0.unbind(0))  # slots, replaced as they are written
    out = [[torch.zeros(HV, V, dtype=torch.float64, device=q.device)] * T for _ in range(B)]
    finals = []
    for n, (b, start, end) in enumerate(seqs):
        if idx is None:
            S = h0[n] if h0 is not None else torch.zeros(HV, K, V, dtype=torch.float64, device=q.device)
            S = S.transpose(-1, -2) if v_first and h0 is not None else S
        else:
            read = int(idx[n]) if idx.dim() == 1 else int(idx[n, int(accepted[n]) - 1 if accepted is not None else 0])
            if read < 0:
                continue  # padding: no state read or written, outputs zero
            S = pool[read].transpose(-1, -2) if v_first else pool[read]
        for t in range(start, end):
            S = torch.exp(g[b, t])[:, None, None] * S
            u = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t]))
            S = S + k[b, t][:, :, None] * u[:, None, :]
            out[b][t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t])
            if idx is not None and idx.dim() == 2 and int(idx[n, t - start]) >= 0:
                pool[int(idx[n, t - start])] = S.transpose(-1, -2) if v_first else S
        if idx is not None and idx.dim() == 1:
            pool[read] = S.transpose(-1, -2) if v_first else S
        finals.append(S.transpose(-1, -2) if v_first else S)
    o = torch.stack([torch.stack(row) for row in out])
    if idx is not None:
        return o, torch.stack(pool)
    return o, (torch.stack(finals) if f64.get("output_final_state") else None)


# --- one row ---------------------------------------------------------------------------------------------------

def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x.shape != ref.shape:
        return math.inf
    err = float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    return err if math.isfinite(err) else math.inf


def _run(mode: str, call: dict, backend: str, grad_leaves: tuple[str, ...]):
    """Calls the backend; returns (leaves, o, second output), the leaves requiring grad."""
    leaves = {n: call[n].detach().clone().requires_grad_(True) for n in grad_leaves}
    fn = gdnkit.chunk_gated_delta_rule if mode == "chunk" else gdnkit.fused_recurrent_gated_delta_rule
    with torch.set_grad_enabled(bool(grad_leaves)):
        o, second = fn(**{**call, **leaves}, backend=backend)
    return leaves, o, second


@dataclasses.dataclass
class Truth:
    """The float64 recurrence's outputs for one (case, dtype), and its gradients for the chunked cases."""

    o: torch.Tensor
    second: torch.Tensor | None
    grads: dict[str, torch.Tensor] | None
    do: torch.Tensor | None
    dht: torch.Tensor | None


def truth(case: Case, call: dict, seed: int) -> Truth:
    leaves = {n: call[n].detach().double().requires_grad_(case.grads) for n in GRAD_LEAVES
              if call.get(n) is not None}
    with torch.set_grad_enabled(case.grads):
        o, second = recurrence({**call, **leaves})
    if not case.grads:
        return Truth(o.detach(), None if second is None else second.detach(), None, None, None)
    do, dht = _grad_seeds(call["v"], second, seed)
    outs, seeds = [o] + ([second] if second is not None else []), [do.double()] + ([dht.double()] if dht is not None else [])
    grads = dict(zip(leaves, torch.autograd.grad(outs, list(leaves.values()), seeds)))
    return Truth(o.detach(), None if second is None else second.detach(), grads, do, dht)


def check_row(backend: str, case: Case, dtype: torch.dtype, run: str, call: dict, want: Truth) -> dict:
    """One row: the backend's forward (o and the final state or pool) or gradients against the recurrence."""
    row = {"backend": backend, "case": case.name, "dtype": str(dtype).removeprefix("torch."), "run": run}
    tol = TOLERANCES[dtype][run == "gradients"]
    row["tol"] = tol
    if case.pool:  # the call writes it
        call = {**call, "initial_state": call["initial_state"].clone()}
    leaves_names = tuple(n for n in GRAD_LEAVES if call.get(n) is not None) if run == "gradients" else ()
    try:
        with torch.set_grad_enabled(bool(leaves_names)):
            decision = gdnkit.explain(**{**call, **{n: call[n].detach().requires_grad_(True) for n in leaves_names}},
                                      mode=case.mode, backend=backend)
        if not decision.runs:
            row["skipped"] = "; ".join(decision.reasons[backend])
            return row
        before = call["initial_state"].clone() if case.pool else None
        leaves, o, second = _run(case.mode, call, backend, leaves_names)
        if run == "forward":
            errs = {"o": _rel(o, want.o)}
            if case.pool:
                errs["pool"] = _rel(call["initial_state"], want.second)
                untouched = _untouched_slots(call)
                if not torch.equal(call["initial_state"][untouched], before[untouched]):
                    errs["pool"] = math.inf
                    row["note"] = "changed pool slots the call does not own"
            elif case.final_state:
                errs["state"] = _rel(second, want.second)
        else:
            outs, seeds = [o], [want.do]
            if second is not None:
                outs.append(second)
                seeds.append(want.dht)
            got = torch.autograd.grad(outs, list(leaves.values()), seeds)
            errs = {"d" + n: _rel(x, want.grads[n]) for n, x in zip(leaves, got)}
    except Exception as exc:  # one broken backend must not hide the others' results
        row.update(error=math.inf, worst="raised", ok=False, failure=f"{type(exc).__name__}: {exc}")
        return row
    worst = max(errs, key=errs.get)
    row.update(error=errs[worst], worst=worst, errors=errs, ok=errs[worst] <= tol)
    return row


def _untouched_slots(call: dict) -> torch.Tensor:
    """Pool slots the call may not write: those no live sequence names as a write slot."""
    idx = call["ssm_state_indices"].long().cpu()
    mine = torch.zeros(call["initial_state"].shape[0], dtype=torch.bool)
    if idx.dim() == 1:
        mine[idx[idx >= 0]] = True
    else:
        accepted = call["num_accepted_tokens"].long().cpu()
        live = idx.gather(1, (accepted - 1)[:, None])[:, 0] >= 0
        lengths = call["cu_seqlens"].long().cpu().diff()
        C = idx.shape[1]
        used = live[:, None] & (torch.arange(C)[None, :] < lengths[:, None]) & (idx >= 0)
        mine[idx[used]] = True
    return (~mine).to(call["initial_state"].device)


# --- the sweep, the table, the verdict -------------------------------------------------------------------------

def run_check(backends: list[str] | None = None, seed: int = 0) -> dict:
    machine = dispatch.probe_machine()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = backends or gdnkit.available_backends()
    unknown = [n for n in names if n not in dispatch.valid_names()]
    if unknown:
        raise ValueError(f"unknown backend {unknown[0]!r}; valid names: {', '.join(dispatch.valid_names()[1:])}")
    # On a GPU K = V = 64 (triton_generic's smallest), plus the K = V = 128 rows tilelang_sm90 takes.
    sweep = cases(64, hopper_rows=True) if device == "cuda" else cases(16, hopper_rows=False)
    rows = []
    start = time.monotonic()
    # These problems are far too small for intra-op threads: on a busy CPU their spinning costs ~10x the work.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i, case in enumerate(sweep):
            for dtype in case.dtypes:
                call = make_call(case, dtype, device, seed + 100 * i)
                want = truth(case, call, seed + 100 * i)
                for name in names:
                    for run in ("forward", "gradients") if case.grads else ("forward",):
                        rows.append(check_row(name, case, dtype, run, call, want))
    finally:
        torch.set_num_threads(threads)
    elapsed = time.monotonic() - start
    ran = [r for r in rows if "skipped" not in r]
    failed = [r for r in ran if not r["ok"]]
    gpu = machine.gpus[0].name if device == "cuda" and machine.gpus else None
    return {"date": datetime.date.today().isoformat(), "gdnkit": gdnkit.__version__, "device": device, "gpu": gpu,
            "machine": machine.to_dict(), "cases": {c.name: c.describe() for c in sweep}, "rows": rows,
            "seconds": round(elapsed, 1), "verdict": {"pass": bool(ran) and not failed, "failed": len(failed),
                                                      "rows": len(ran)}}


def verdict_line(report: dict) -> str:
    v = report["verdict"]
    if v["pass"]:
        return "PASS"
    return f"FAIL ({v['failed']} of {v['rows']} rows)" if v["rows"] else "FAIL (no row ran)"


def _table(header: list[str], lines: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(header, *lines)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i in right else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [fmt(header), "-" * len(fmt(header))] + [fmt(c) for c in lines]


def _num(x) -> str:
    return "-" if x is None else ("inf" if x == math.inf else f"{x:.1e}")


def _where(report: dict) -> str:
    m = report["machine"]
    where = report.get("gpu") or "CPU"
    return f"{where}, torch {m['torch_version']}, gdnkit {report['gdnkit']}"


def format_report(report: dict) -> str:
    out = [f"gdnkit check on {_where(report)} ({report['date']}): every available backend against a float64 "
           f"token-by-token recurrence"]
    ran = [r for r in report["rows"] if "skipped" not in r]
    lines = [[r["backend"], r["case"], r["dtype"], r["run"], _num(r["error"]), r["worst"], _num(r["tol"]),
              "ok" if r["ok"] else "FAIL"] for r in ran]
    out += _table(["backend", "case", "dtype", "run", "error", "worst", "tol", "result"], lines, {4, 6})
    for r in ran:
        if "failure" in r or "note" in r:
            text = r.get("failure") or r["note"]
            out.append(f"  {r['backend']} {r['case']} {r['dtype']} {r['run']}: "
                       + (text if len(text) < 300 else text[:300] + " ..."))
    declined: dict[str, dict[str, int]] = {}
    for r in report["rows"]:
        if "skipped" in r:
            by = declined.setdefault(r["backend"], {})
            by[r["skipped"]] = by.get(r["skipped"], 0) + 1
    for backend, reasons in declined.items():
        total = sum(reasons.values())
        out.append(f"{backend} declined {total} row{'s' * (total > 1)} (as dispatch would): "
                   + "; ".join(f"{why} ({n})" for why, n in reasons.items()))
    out.append("\ncases:")
    width = max(map(len, report["cases"]))
    out += [f"  {name.ljust(width)}  {text}" for name, text in report["cases"].items()]
    out.append("error: relative L2 error ||x - x64|| / ||x64|| against the float64 recurrence on the same rounded "
               "inputs, worst over the row's tensors\n  (worst: o = output, state = final state, pool = the state "
               "pool after the call, dq, dk, ... = gradients); tol: the bar for the row's dtype.")
    out.append(f"{len(ran)} rows in {report['seconds']:.1f} s (kernel builds included; no timing is measured)")
    out.append(verdict_line(report))
    return "\n".join(out)


def write_json(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)


def format_comparison(a: dict, b: dict) -> str:
    """Two reports side by side, row by row (a row either lacks is shown as '-')."""
    key = lambda r: (r["backend"], r["case"], r["dtype"], r["run"])  # noqa: E731
    rows_a, rows_b = ({key(r): r for r in rep["rows"] if "skipped" not in r} for rep in (a, b))
    keys = list(rows_a) + [k for k in rows_b if k not in rows_a]

    def cell(r):
        return ("-", "-") if r is None else (_num(r["error"]) + f" ({r['worst']})", "ok" if r["ok"] else "FAIL")
    lines = [[*k, *cell(rows_a.get(k)), *cell(rows_b.get(k))] for k in keys]
    out = [f"A: {_where(a)} ({a['date']})", f"B: {_where(b)} ({b['date']})"]
    out += _table(["backend", "case", "dtype", "run", "A error", "A", "B error", "B"], lines, {4, 6})
    out.append(f"A: {verdict_line(a)}   B: {verdict_line(b)}")
    return "\n".join(out)
