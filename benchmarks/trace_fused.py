"""A clock64 timeline of the fused backward's four roles (backends/tilelang_sm90/backward_fused.py), per chunk-step.

    python -m gdnkit.benchmarks.trace_fused --heads 16x32 --seqlens 32768 [--chunks 16] [--out DIR]

The kernel is not edited for this: its source is copied with a clock64 stamp after each line that EVENTS names (a
pattern found exactly once in that role's block; a kernel edit that moves one fails here, loudly), plus a `stamps`
argument [programs, HV, 4 roles, chunks, events] int64; thread 0 of each role writes its stamps for the first
--chunks chunks of every program. One training call (gdnkit.chunk_gated_delta_rule with the bench's inputs, the
fused backward on) then runs with the stamped kernel in place of backward.backward_fused_kernel. Printed: per
role and event, the median over programs and chunks (past each program's first) of the clocks since the owner's
`landed` of the same chunk, and the median step (owner's landed to the next chunk's). The clocks of one program's
roles are one SM's, so the offsets compare across roles.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import json
import statistics
import tempfile
from pathlib import Path

ROLES = ("owner", "x", "p", "g")
# role -> [(event, a line pattern unique in the role's block: the stamp goes after that line; or a tuple of
# patterns, the first found exactly once taken)]
EVENTS = {
    "owner": [("landed", "landed(loaded,"), ("ds_handed", "T.barrier_arrive(ds_ready)"),
              ("do_read", "T.barrier_wait(do_read, ph)"), ("gx_in", "T.barrier_wait(gx_ready, ph)"),
              ("tb_in", "T.barrier_wait(tb_free, ph)"),
              # the last load the owner issues for the next chunk: K alone since session 18's second form, Q and
              # K in its first, Q, K, T and the gates before (kept so --source traces the older forms too)
              ("end", ("load_k(k, k_s, k_loaded, bos, n_chunks, hk, i + 1)",
                       "load_k(k, k_s, loaded, bos, n_chunks, hk, i + 1)",
                       "load_qk(q, k, q_s, k_s, loaded, bos, n_chunks, hk, i + 1)", "hk, hv, i + 1)"))],
    "x": [("landed", "landed(loaded,"), ("u_ready", "T.barrier_arrive(u_ready)"),
          ("ds_in", "T.barrier_wait(ds_ready, ph)"), ("p_in", "T.barrier_wait(p_ready, ph)"),
          ("gx_ready", "T.barrier_arrive(gx_ready)"), ("m_ready", "T.barrier_arrive(m_ready)"),
          ("h_ready", "T.barrier_arrive(h_ready)"), ("tb_free", "T.barrier_arrive(tb_free)"),
          ("end", "store_rows(acc_x, du_s, dv")],
    "p": [("landed", "landed(loaded,"), ("p_ready", "T.barrier_arrive(p_ready)"),
          ("u_in", "T.barrier_wait(u_ready, ph)"), ("pd_ready", "T.barrier_arrive(pd_ready)"),
          ("du_in", "T.barrier_wait(du_ready, ph)"),
          # its A terms' start: x's H (session 18), or x's M for its own H^T (before)
          ("late_in", ("T.barrier_wait(h_ready, ph)", "T.barrier_wait(m_ready, ph)")),
          # dq's store: p's since session 25 (g's before: p's do_read arrival, after its column-term products)
          ("dq_out", ("store_slot(acc_p, dqk, c, hv, 0)", "T.barrier_arrive(do_read)")),
          ("gp_ready", "T.barrier_arrive(gp_ready)")],
    "g": [("landed", "landed(loaded,"), ("dk_first", "T.barrier_arrive(u_free)"),
          ("pd_in", "T.barrier_wait(pd_ready, ph)"), ("ds_in", "T.barrier_wait(ds_ready, ph)"),
          ("gx_in", "T.barrier_wait(gx_ready, ph)"), ("h_in", "T.barrier_wait(h_ready, ph)"),
          ("pd_free", "T.barrier_arrive(pd_free)"), ("gp_in", "T.barrier_wait(gp_ready, ph)"),
          # dk's store: by g's threads in its accumulator's order since session 24, into its slot of S0's buffer
          # through dX's tile by TMA since session 20, through store_rows before
          ("dk_out", ("store_slot(acc_g, dqk, c, hv, 1)", "T.copy(gx_s, dqk[c, hv, 1, 0:C, 0:K])",
                      "store_rows(acc_g, gx_s, dk, t0, hv, n_valid)")),
          ("end", "T.barrier_arrive(h_free)")],
}
N_EVENTS = max(len(v) for v in EVENTS.values())
# the role branches as backward_fused.py opens them (at this indentation)
ROLE_OPENERS = ("            if tx < 128:", "            elif tx < 256:", "            elif tx < 384:", "            else:")
SIGNATURE_END = "        scale: T.float32,"


def stamped_source(source: str, chunks: int) -> str:
    """backward_fused.py's source with the stamps argument and one stamp after each EVENTS line."""
    lines = source.split("\n")
    starts = [lines.index(opener) for opener in ROLE_OPENERS]
    bounds = list(zip(starts, starts[1:] + [len(lines)]))
    inserts = []   # (line index to insert after, text)
    for role, (lo, hi) in enumerate(bounds):
        for event, (name, pattern) in enumerate(EVENTS[ROLES[role]]):
            for candidate in (pattern if isinstance(pattern, tuple) else (pattern,)):
                hits = [j for j in range(lo, hi) if candidate in lines[j]]
                if len(hits) == 1:
                    break
            else:
                raise ValueError(f"{ROLES[role]}.{name}: {pattern!r} not found exactly once in the role's block")
            j = hits[0]
            pad = " " * (len(lines[j]) - len(lines[j].lstrip()))
            inserts.append((j, [f"{pad}if tx % 128 == 0:",
                                f"{pad}    if i < {chunks}:",
                                f"{pad}        stamps[n, hv, {role}, i, {event}] = T.call_extern(\"int64\", \"clock64\")"]))
    sig = lines.index(SIGNATURE_END)
    inserts.append((sig, [f"        stamps: T.Tensor((num_seqs, HV, {len(ROLES)}, {chunks}, {N_EVENTS}), \"int64\"),"]))
    for j, text in sorted(inserts, key=lambda t: -t[0]):
        lines[j + 1:j + 1] = text
    return "\n".join(lines)


def stamped_module(chunks: int, source: Path | None = None):
    """The stamped copy imported as a module of the package (its relative imports resolve; TileLang reads the
    prim_func's source from the file). source: another form of backward_fused.py to stamp instead (two forms
    traced in one device run)."""
    from gdnkit.backends.tilelang_sm90 import backward_fused
    path = Path(tempfile.mkdtemp(prefix="gdnkit_trace_")) / "backward_fused_stamped.py"
    text = source.read_text() if source else inspect.getsource(backward_fused)
    path.write_text(stamped_source(text, chunks))
    name = f"{backward_fused.__package__}.backward_fused_stamped"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = backward_fused.__package__
    spec.loader.exec_module(module)
    return module


def compile_stamped(H: int, HV: int, dtype: str, has_dinit: bool, store_dh0: bool, chunks: int,
                    source: Path | None = None):
    import tilelang

    from gdnkit.backends.tilelang_sm90.forward import TARGET
    module = stamped_module(chunks, source)
    program = module.backward_fused_program(H, HV, dtype, has_dinit=has_dinit, store_dh0=store_dh0)
    return tilelang.compile(program, target=TARGET, pass_configs=module.PASS_CONFIGS)


def summarize(stamps) -> dict:
    """Medians over programs and chunks 1.. of each event's clocks since the owner's landed of the same chunk, and
    of the owner's step. stamps: [programs, HV, roles, chunks, events] int64, -1 where not written."""
    s = stamps.reshape(-1, *stamps.shape[2:]).tolist()
    out = {"step": None, "events": {}}
    steps = [p[0][i + 1][0] - p[0][i][0] for p in s for i in range(1, len(p[0]) - 1)
             if p[0][i][0] >= 0 and p[0][i + 1][0] >= 0]
    out["step"] = statistics.median(steps) if steps else None
    for r, role in enumerate(ROLES):
        for e, (name, _) in enumerate(EVENTS[role]):
            d = [p[r][i][e] - p[0][i][0] for p in s for i in range(1, len(p[0]))
                 if p[r][i][e] >= 0 and p[0][i][0] >= 0]
            out["events"][f"{role}.{name}"] = statistics.median(d) if d else None
    return out


def main(argv=None) -> int:
    import torch

    import gdnkit
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    from gdnkit.benchmarks.grids import Point
    from gdnkit.benchmarks.inputs import make_point_inputs

    ap = argparse.ArgumentParser(prog="python -m gdnkit.benchmarks.trace_fused")
    ap.add_argument("--heads", default="16x32", help="H x HV")
    ap.add_argument("--seqlens", default="32768", help="comma list of sequence lengths")
    ap.add_argument("--chunks", type=int, default=16, help="chunks stamped per program")
    ap.add_argument("--out", default=None, help="folder for trace.json (the summary and the raw stamps)")
    ap.add_argument("--source", type=Path, default=None,
                    help="another form of backward_fused.py to stamp and trace instead of the installed one")
    args = ap.parse_args(argv)
    H, HV = map(int, args.heads.split("x"))
    seqlens = tuple(int(x) for x in args.seqlens.split(","))
    kept = {}

    @functools.lru_cache(maxsize=None)
    def stamped_kernel(H_, HV_, dt, has_dinit, store_dh0):
        kernel = compile_stamped(H_, HV_, dt, has_dinit, store_dh0, args.chunks, args.source)

        def run(*call_args):
            cu_run = call_args[9]
            stamps = torch.full((cu_run.numel() - 1, HV_, len(ROLES), args.chunks, N_EVENTS), -1,
                                dtype=torch.int64, device=cu_run.device)
            kernel(*call_args, stamps)
            kept["stamps"] = stamps
        return run

    bwd.FUSED = True
    bwd.backward_fused_kernel = stamped_kernel
    inp = make_point_inputs(Point("bwd", H, HV, seqlens), "cuda")
    leaves = [t.detach().clone().requires_grad_() for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)]
    for _ in range(2):   # the second call's stamps: everything built and warm
        o, _ = gdnkit.chunk_gated_delta_rule(*leaves, cu_seqlens=inp.cu_seqlens, backend="tilelang_sm90")
        torch.autograd.grad(o, leaves, inp.do)
        torch.cuda.synchronize()
    summary = summarize(kept["stamps"].cpu())
    print(f"fused backward H={H} HV={HV} seqlens={args.seqlens}: median step {summary['step']} clocks")
    for name, clocks in summary["events"].items():
        print(f"  {name:<16} {clocks}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "trace.json").write_text(json.dumps({"summary": summary,
                                                            "stamps": kept["stamps"].cpu().tolist()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
