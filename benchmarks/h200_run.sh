#!/usr/bin/env bash
# One device call on the lent H200 that measures the quick grid and runs the GPU tests (README.md here).
# The TileLang/Triton compiles are CPU work: the GPU tests run beside the parallel warm-up, and are
# over (timeout) before the timing phase starts, so they never share the GPU with a measurement.
# $OUT gets at most 8 files: h200/ (latest.json, details.json, results.md, command.txt, speedup.png,
# the run log), bench.txt and gpu_tests.txt.
# usage, after `source .device/boot.sh &&`: bash benchmarks/h200_run.sh [PASSES] [TIMING_BUDGET_S]
set -u
passes=${1:-fwd,bwd,decode}
budget=${2:-290}
mkdir -p "$OUT/h200"
cp benchmarks/results/h200/*.json "$OUT/h200/" 2>/dev/null
# SIGINT, not SIGTERM, at the limit: pytest then still prints the failures it has met (a test killed by
# SIGTERM takes every earlier failure's message with it; session 9 lost two that way)
timeout -s INT -k 30 190 python -m pytest -q -rf -p no:cacheprovider --tb=short --durations=8 -m gpu \
    tests/test_tilelang_sm90.py tests/test_triton_generic.py tests/test_decode.py tests/test_gpu.py \
    tests/test_cross_backend.py \
    > "$OUT/gpu_tests.txt" 2>&1 &
tests=$!
timeout $((budget + 250)) python -m gdnkit bench --grid quick --passes "$passes" --warm-jobs 15 --stages \
    --budget-s "$budget" --no-progress --out "$OUT/h200" > "$OUT/bench.txt" 2>&1
echo "bench rc=$?"
wait $tests
echo "tests rc=$? (124: interrupted at 190 s, the failures so far listed)"
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.txt" | tail -25
grep -vE "TileLang|Warning|^ *(\[|-->|Initialize)" "$OUT/bench.txt" | tail -70
