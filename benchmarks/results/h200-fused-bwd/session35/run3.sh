# session 35, device run 3 (run 1's caches in .device/kc.tar.xz): ab.py (the gated route's flags from the forward's
# row bounds against the token sums) beside a build of 2x8's fused family, the fused float64 tests (segments,
# 16x32, no-states), the quick backward bench of main into h200/ and again with --qk-l2norm (run 2's rows did not
# all come back), everything under $OUT in one tarball (a run returns at most 8 files).
set -o pipefail
t0=$SECONDS
here=benchmarks/results/h200-fused-bwd/session35
mkdir -p /tmp/kcache && tar -xJf .device/kc.tar.xz -C /tmp/kcache
R=$OUT/r; mkdir -p $R/h200 $R/h200-qk-l2norm
cp benchmarks/results/h200/{latest.json,details.json,command.txt} $R/h200/
python -m gdnkit warm --heads 2x8 --dtypes bfloat16 --backward fused --jobs 14 > $R/warm-2x8.log 2>&1 &
pw=$!
OUT=$R timeout 150 python $here/ab.py 2>&1 | tee $R/ab.log | grep "^\[ab\]" | cut -c1-260
echo "ab done at $((SECONDS - t0)) s"
while kill -0 $pw 2>/dev/null && [ $((SECONDS - t0)) -lt 200 ]; do sleep 2; done
grep "built,\|FAILED" $R/warm-2x8.log | cut -c1-200; kill $pw 2>/dev/null
timeout -s INT 90 python -m pytest -q -rf -p no:cacheprovider tests/test_tilelang_sm90.py \
  -k "backward_fused_matches_float64 and (segments or 16x32 or no-states)" 2>&1 | tee $R/tests.log | tail -3 | cut -c1-300
echo "tests done at $((SECONDS - t0)) s"
common="--grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --anchors live --warm-jobs 12 --budget-s 150 --no-progress"
timeout 200 python -m gdnkit bench $common --out $R/h200 > $R/bench.log 2>&1; echo "bench rc=$? at $((SECONDS - t0)) s"
grep "^|" $R/bench.log | cut -c1-170
timeout $((560 - (SECONDS - t0))) python -m gdnkit bench $common --qk-l2norm --out $R/h200-qk-l2norm > $R/bench-qk.log 2>&1
echo "bench qk rc=$? at $((SECONDS - t0)) s"
grep "^|" $R/bench-qk.log | cut -c1-170
tar -cf $OUT/r.tar -C $OUT r && ls -la $OUT/r.tar
echo "total $((SECONDS - t0)) s"
