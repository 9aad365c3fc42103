"""Command line: `python -m gdnkit info | check | bench`."""
from __future__ import annotations

import argparse
import sys

import gdnkit
from gdnkit import dispatch


def _info(args) -> int:
    m = dispatch.machine()
    print(f"gdnkit {gdnkit.__version__}  python {m.python_version}  torch {m.torch_version} "
          f"(CUDA build {m.torch_cuda_version or 'none'})")
    print(f"CUDA driver: {m.cuda_driver_version or 'none (' + str(m.cuda_driver_error) + ')'}")
    for gpu in m.gpus:
        print(f"GPU {gpu.index}: {gpu.name}, sm{gpu.sm}, {gpu.sm_count} SMs, {gpu.total_memory_bytes / 2**30:.0f} GiB")
    if not m.gpus:
        print("GPU: none visible")
    for name, version in m.packages.items():
        print(f"{name}: {version or 'not importable (' + m.import_errors.get(name, '?') + ')'}")
    print("\nbackends (highest priority first):")
    for b in dispatch.backends():
        why = b.unavailable_reasons(m)
        state = "available" if not why else "unavailable: " + "; ".join(why)
        print(f"  {b.name:<16} priority {b.priority:<4} {state}\n  {'':<16} {b.description}")
    return 0


def _check(args) -> int:
    from gdnkit.check import format_table, run_check, write_json
    report = run_check(args.backends.split(",") if args.backends else None, seed=args.seed)
    print(f"gdnkit check on {report['device']} ({report['date']})")
    print(format_table(report))
    if args.json:
        write_json(report, args.json)
        print(f"report written to {args.json}")
    return 1 if any("error" in r for r in report["rows"]) else 0


def _bench(argv: list[str]) -> int:
    from gdnkit.benchmarks.cli import main as bench_main
    return bench_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the harness owns its own options
        return _bench(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m gdnkit", description=gdnkit.__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="the machine probe and each backend's availability with reasons")
    check = sub.add_parser("check", help="every available backend against the float64 reference")
    check.add_argument("--json", metavar="PATH", help="also write the report (machine probe included) as JSON")
    check.add_argument("--backends", help="comma-separated backend names (default: all available)")
    check.add_argument("--seed", type=int, default=0)
    sub.add_parser("bench", help="the benchmark harness (python -m gdnkit bench --help)")
    args = parser.parse_args(argv)
    return {"info": _info, "check": _check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
