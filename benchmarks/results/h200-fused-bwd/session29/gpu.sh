# session 29 run 3: the sums beside the fused kernel. GPU tests, bitwise check, the quick backward with both
# anchors live into a copy of results/h200, then gdnkit alone with the sums after the kernel (A/B)
set -o pipefail
t0=$SECONDS
timeout 150 python -m pytest -m gpu tests/test_tilelang_sm90.py -q -p no:cacheprovider -k "backward_fused_matches_float64 and (segments or 16x32 or varlen) or backward_fused_with_options or (repeat_bitwise and fused) or (cuda_graph and fused-segments)" 2>&1 | tee $OUT/tests.log | tail -4
grep -q " passed" $OUT/tests.log && ! grep -q "failed\|error" $OUT/tests.log || { echo "TESTS NOT CLEAN"; exit 3; }
timeout 70 python scratch/s29/check.py 2>&1 | tee $OUT/check.log | grep "^\[check\]"
echo "elapsed $((SECONDS - t0)) s"
left=$((${BUDGET:-400} - 30 - (SECONDS - t0)))
mkdir -p $OUT/h200 && cp benchmarks/results/h200/latest.json benchmarks/results/h200/details.json benchmarks/results/h200/command.txt $OUT/h200/
timeout $left python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --anchors live --warm-jobs 12 --budget-s 150 --no-progress --out $OUT/h200 2>&1 | tee $OUT/bench.log | grep -v "^\[stages\]" | grep "^\[ok\]\|^|\|warm" | cut -c1-150
left=$((${BUDGET:-400} - (SECONDS - t0)))
[ "$left" -gt 25 ] && GDNKIT_SM90_SUMS_BESIDE=0 timeout $left python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90 --no-progress --out $OUT/ab0 2>&1 | grep "^\[ok\]" | sed "s/^/[beside=0] /" | cut -c1-90 | tee -a $OUT/ab.log
echo "total $((SECONDS - t0)) s"
