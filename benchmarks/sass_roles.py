"""What each warp-specialized role of the fused backward executes per chunk, read from its SASS on the CPU host.

    python -m gdnkit.benchmarks.sass_roles [--heads 16x32] [--budgets 160,112,128,112] [--out DIR]

The four roles of backends/tilelang_sm90/backward_fused.py share the SM's four schedulers (one warp of each role
on each), so the instructions a role issues per chunk bound the step from below beside the products' time; the
clock64 trace (trace_fused.py) says which role paces the step, this says how much code it runs to get there, and
costs no device time. The kernel is compiled for sm_90a (TileLang, then nvcc -cubin with `-Xptxas -v`; --budgets
rewrites the roles' setmaxnreg values in the source first, to compare splits), disassembled with cuobjdump (the
one on PATH, else the copy Triton ships), and cut at its USETMAXREG instructions: each role's code starts with
its own. Printed per role: its budget, instructions, spill stores / loads, tensor-core (HGMMA), exponent (MUFU),
shared (LDS / STS / STSM) and global (STG) instructions, and divergent regions (BSSY: per-element conditionals).
Counts are static: a role's chunk loop body is straight-line code (its element loops unrolled), so they are per
chunk, plus the role's prologue and a tail chunk's branches.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ROLES = ("owner", "x", "p", "g")  # in the kernel's source order
COUNTED = {"instructions": None, "STL": "STL", "LDL": "LDL", "HGMMA": "HGMMA", "MUFU": "MUFU", "LDS": "LDS",
           "STS": "STS", "STSM": "STSM", "STG": "STG", "BSSY": "BSSY"}
_OP = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
_BUDGET = re.compile(r"warpgroup_reg_(alloc|dealloc)<(\d+)>")


def with_budgets(source: str, budgets: list[int]) -> str:
    """The kernel source with its four setmaxnreg calls (in source order) set to budgets."""
    calls = list(_BUDGET.finditer(source))
    if len(calls) != len(budgets):
        raise ValueError(f"{len(calls)} setmaxnreg calls in the source, {len(budgets)} budgets given")
    for m, n in reversed(list(zip(calls, budgets))):
        source = source[:m.start()] + f"warpgroup_reg_{'alloc' if n > 128 else 'dealloc'}<{n}>" + source[m.end():]
    return source


def cubin(source: str, workdir: Path, fast_math: bool) -> tuple[Path, str]:
    """(the cubin, ptxas' -v report) of a TileLang kernel source for sm_90a, with TileLang's own nvcc flags
    (its templates, CUTLASS, the C++ standard they need) and, as TileLang adds it for a kernel compiled with
    TL_ENABLE_FAST_MATH, --use_fast_math (without it each exp is a longer, exact sequence)."""
    from tilelang.contrib.nvcc import default_compile_options, find_cuda_path
    nvcc = shutil.which("nvcc") or str(Path(find_cuda_path()) / "bin" / "nvcc")
    cu, out = workdir / "kernel.cu", workdir / "kernel.cubin"
    cu.write_text(source)
    flags = [*default_compile_options(), *(["--use_fast_math"] if fast_math else [])]
    done = subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-Xptxas", "-v", *flags, "-o", str(out), str(cu)],
                          capture_output=True, text=True, check=True)
    return out, done.stderr


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not bundled.exists():
        raise FileNotFoundError("no cuobjdump on PATH or in the Triton package")
    return str(bundled)


def role_counts(sass: str, budgets: list[int]) -> list[dict]:
    """Per USETMAXREG region of the SASS, in source role order: its counts. The compiler lays the roles out in
    reverse source order (sm_90a builds of sessions 15-16); each region's budget is checked against the role's."""
    lines = sass.split("\n")
    starts = [i for i, line in enumerate(lines) if "USETMAXREG" in line]
    if len(starts) != len(ROLES):
        raise ValueError(f"{len(starts)} USETMAXREG regions in the SASS, expected {len(ROLES)}")
    regions = []
    for a, b in zip(starts, starts[1:] + [len(lines)]):
        budget = int(re.search(r"0x([0-9a-f]+)\s*;", lines[a]).group(1), 16)
        ops = [m.group(1) for m in map(_OP.search, lines[a + 1:b]) if m]
        counts = {"budget": budget, "instructions": len(ops)}
        counts.update({name: sum(op == prefix or op.startswith(prefix + "_") for op in ops)
                       for name, prefix in COUNTED.items() if prefix})
        regions.append(counts)
    regions.reverse()
    for role, counts, want in zip(ROLES, regions, budgets):
        if counts["budget"] != want:
            raise ValueError(f"the region taken for {role} has budget {counts['budget']}, the source says {want}")
        counts["role"] = role
    return regions


def measure(H: int, HV: int, budgets: list[int] | None = None, dtype: str = "bfloat16") -> dict:
    import tilelang

    from gdnkit.backends.tilelang_sm90 import backward_fused as bf
    from gdnkit.backends.tilelang_sm90.forward import TARGET
    program = bf.backward_fused_program(H, HV, dtype, has_dinit=True, store_dh0=True)
    source = tilelang.compile(program, target=TARGET, pass_configs=bf.PASS_CONFIGS).get_kernel_source()
    budgets = budgets or [bf.OWNER_REGS, bf.X_REGS, bf.P_REGS, bf.G_REGS]
    with tempfile.TemporaryDirectory() as tmp:
        binary, report = cubin(with_budgets(source, budgets), Path(tmp),
                               bf.PASS_CONFIGS.get(tilelang.PassConfigKey.TL_ENABLE_FAST_MATH, False))
        sass = subprocess.run([cuobjdump(), "-sass", str(binary)], capture_output=True, text=True,
                              check=True).stdout
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return {"heads": f"{H}x{HV}", "budgets": budgets, "roles": role_counts(sass, budgets),
            "spill_bytes": [int(spills.group(1)), int(spills.group(2))] if spills else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gdnkit.benchmarks.sass_roles")
    ap.add_argument("--heads", default="16x32", help="H x HV")
    ap.add_argument("--budgets", default=None, help="owner,x,p,g registers (summing to 512): another split")
    ap.add_argument("--out", default=None, help="folder for sass_roles.json")
    args = ap.parse_args(argv)
    H, HV = map(int, args.heads.split("x"))
    budgets = [int(n) for n in args.budgets.split(",")] if args.budgets else None
    if budgets and sum(budgets) != 512:
        ap.error("--budgets must sum to 512")
    result = measure(H, HV, budgets)
    columns = ["role", "budget", *COUNTED]
    print(f"fused backward H={H} HV={HV}, SASS per role (static), spill bytes stored/loaded "
          f"{result['spill_bytes']}")
    print("  " + " ".join(f"{c:>12}" for c in columns))
    for counts in result["roles"]:
        print("  " + " ".join(f"{counts[c]:>12}" for c in columns))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "sass_roles.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
