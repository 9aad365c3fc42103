# session 35, device run 1 (cold machine, no kernel caches): warm both bench kinds' compiles (plain and
# --qk-l2norm; `--budget-s 0` times nothing) beside the GPU tests of session 34's qk l2norm passes, then
# order_probe.py, then the caches for the next run.
set -o pipefail
t0=$SECONDS
here=benchmarks/results/h200-fused-bwd
common="--grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --budget-s 0 --no-progress"
python -m gdnkit bench $common --warm-jobs 7 --out $OUT/warm-plain > $OUT/warm-plain.log 2>&1 &
p1=$!
python -m gdnkit bench $common --qk-l2norm --warm-jobs 7 --out $OUT/warm-qk > $OUT/warm-qk.log 2>&1 &
p2=$!
timeout -s INT 230 python -m pytest -q -rf -p no:cacheprovider tests/test_l2norm.py \
  tests/test_tilelang_sm90.py tests/test_triton_generic.py -k "l2norm or options or repeat_bitwise or group_sums" \
  2>&1 | tee $OUT/tests.log | tail -8 | cut -c1-400
echo "tests done at $((SECONDS - t0)) s"
while { kill -0 $p1 || kill -0 $p2; } 2>/dev/null && [ $((SECONDS - t0)) -lt 400 ]; do sleep 2; done
grep -h "warm " $OUT/warm-plain.log $OUT/warm-qk.log | cut -c1-200
echo "warm-ups done (or cut) at $((SECONDS - t0)) s"
kill $p1 $p2 2>/dev/null
timeout 120 python $here/session34/order_probe.py 2>&1 | tee $OUT/order_probe.log | grep "^\[order-probe\]" | cut -c1-200
save_caches
echo "total $((SECONDS - t0)) s"
