"""Command line: `python -m gdnkit info | check | warm | bench`."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time

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
        print(f"{name}: {version or m.import_errors.get(name, 'not installed')}")
    print("\nbackends (highest priority first):")
    for b in dispatch.backends():
        why = b.unavailable_reasons(m)
        state = "available" if not why else "unavailable: " + "; ".join(why)
        print(f"  {b.name:<16} priority {b.priority:<4} {state}\n  {'':<16} {b.description}")
    return 0


def _check(args) -> int:
    from gdnkit import check
    if args.compare:
        reports = []
        for path in args.compare:
            with open(path) as f:
                reports.append(json.load(f))
        print(check.format_comparison(*reports))
        return 0
    try:
        report = check.run_check(args.backends.split(",") if args.backends else None, seed=args.seed)
    except ValueError as exc:  # an unknown --backends name
        print(f"--backends: {exc}", file=sys.stderr)
        return 2
    print(check.format_report(report))
    if args.json:
        check.write_json(report, args.json)
        print(f"report written to {args.json}", file=sys.stderr)
    return 0 if report["verdict"]["pass"] else 1


def _warm(args) -> int:
    builds = [str(d).removeprefix("torch.") for d in dispatch.get("tilelang_sm90").support.dtypes]
    if (args.heads is None) == (args.model is None):
        raise SystemExit("warm: give --heads or --model (one of them)")
    if args.model is not None:
        heads, model_dtype = _model_heads(args.model)
        dtypes = args.dtypes.split(",") if args.dtypes else [model_dtype]
    else:
        heads = [_head_pair(text) for text in args.heads.split(",")]
        dtypes = (args.dtypes or "bfloat16").split(",")
    for dtype in dtypes:
        if dtype not in builds:
            raise SystemExit(f"--dtypes: tilelang_sm90 builds {', '.join(builds)}, got {dtype!r}")
    try:
        import tilelang  # noqa: F401 - what builds the kernels
    except Exception as exc:  # noqa: BLE001 - any import failure means: cannot build here
        print(f"tilelang is not importable: {exc}", file=sys.stderr)
        return 2
    if shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"):
        print("nvcc is not installed: tilelang cannot build kernels here", file=sys.stderr)
        return 2
    from gdnkit.backends.tilelang_sm90 import precompile
    jobs = [job for H, HV in heads for dtype in dtypes
            for job in precompile.family(H, HV, dtype, training=not args.inference, backward=args.backward)]
    print(f"building {len(jobs)} tilelang_sm90 kernels on {args.jobs} processes "
          f"(cache: {os.environ.get('TILELANG_CACHE_DIR', '~/.tilelang/cache')})")
    start = time.monotonic()
    results = precompile.build(jobs, args.jobs)
    failed = [job for job, _, error in results if error]
    print(f"{len(results) - len(failed)} built, {len(failed)} failed, {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


def _model_heads(path: str) -> tuple[list[tuple[int, int]], str]:
    """([(H, HV)], dtype) of a transformers model's GDN layers, from its config.json (or the folder holding it):
    Qwen3.5 / Qwen3-Next style keys, at the top level or under text_config (multimodal configs)."""
    file = pathlib.Path(path)
    file = file / "config.json" if file.is_dir() else file
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--model: cannot read a config.json at {str(file)!r} ({exc})") from None
    for scope in (config, config.get("text_config") or {}):
        if "linear_num_value_heads" in scope:
            break
    else:
        raise SystemExit(f"--model: {str(file)!r} has no GDN layers (no linear_num_value_heads, also not under "
                         "text_config)")
    H, HV = scope.get("linear_num_key_heads"), scope["linear_num_value_heads"]
    K, V = scope.get("linear_key_head_dim", 128), scope.get("linear_value_head_dim", 128)
    if (K, V) != (128, 128):
        raise SystemExit(f"--model: tilelang_sm90 builds K = V = 128, the model has K = {K}, V = {V}")
    dtype = scope.get("dtype") or scope.get("torch_dtype") or config.get("dtype") or config.get("torch_dtype")
    if not isinstance(H, int) or not isinstance(HV, int) or H <= 0 or HV % H:
        raise SystemExit(f"--model: HV must be a positive multiple of H, the model has H = {H}, HV = {HV}")
    return [(H, HV)], dtype if dtype in ("bfloat16", "float16") else "bfloat16"


def _head_pair(text: str) -> tuple[int, int]:
    try:
        H, HV = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--heads: expected HxHV pairs like 4x8,16x32, got {text!r}") from None
    if H <= 0 or HV % H:
        raise SystemExit(f"--heads: HV must be a positive multiple of H, got {text!r}")
    return H, HV


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
    check = sub.add_parser("check", help="every available backend against a float64 recurrence, with a verdict "
                                         "(PASS, or FAIL and exit code 1)")
    check.add_argument("--json", metavar="PATH", help="also write the report (machine probe, rows, verdict) as JSON")
    check.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                       help="print two --json reports side by side (e.g. two GPU generations) instead of checking")
    check.add_argument("--backends", help="comma-separated backend names (default: all available)")
    check.add_argument("--seed", type=int, default=0)
    warm = sub.add_parser("warm", help="build the tilelang_sm90 kernels of head configs before their first call "
                                       "(into TileLang's disk cache; needs nvcc, not a GPU)")
    warm.add_argument("--heads", help="H x HV pairs, comma-separated, e.g. 4x8,16x32")
    warm.add_argument("--model", help="or a transformers model's config.json (or its folder): its GDN layers' heads "
                                      "and dtype")
    warm.add_argument("--dtypes", default=None, help="bfloat16, float16 or both, comma-separated (default: "
                                                      "bfloat16, or the --model's dtype)")
    warm.add_argument("--inference", action="store_true", help="the forward's kernels only (no training)")
    from gdnkit.backends.tilelang_sm90.precompile import BACKWARDS
    warm.add_argument("--backward", choices=BACKWARDS, default="both",
                      help="training: the staged backward's kernels, the fused one's, or both (the default: "
                           "each call takes one by size, GDNKIT_SM90_FUSED_BACKWARD=1 / 0 forces one)")
    warm.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel build processes")
    sub.add_parser("bench", help="the benchmark harness (python -m gdnkit bench --help)")
    args = parser.parse_args(argv)
    return {"info": _info, "check": _check, "warm": _warm}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
