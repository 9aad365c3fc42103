# session 33, device run 4 (the budget's last ~300 s): the gated route's segment states in place. The A/B first,
# then the fused float64 cases with segments that the cached 4/8 and 16/32 kernels cover
set -o pipefail
t0=$SECONDS
tar -xJf .device/kcache.tar.xz -C /tmp/kcache && echo "cache: $(find /tmp/kcache/tilelang -name kernel.cubin | wc -l) kernels"
# (the run used scratch/s33's copy of ab4.py)
timeout 75 python benchmarks/results/h200-fused-bwd/session33/ab4.py 2>&1 | tee $OUT/ab.log | grep "^\[ab\]\|Error\|error" | cut -c1-330
echo "ab done at $((SECONDS - t0)) s"
timeout -s INT 60 python -m pytest -m gpu tests/test_tilelang_sm90.py -q -p no:cacheprovider -k "backward_fused_matches_float64 and (16x32 or no-states)" 2>&1 | tee $OUT/tests.log | tail -3 | cut -c1-300
echo "total $((SECONDS - t0)) s"
