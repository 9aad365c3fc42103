# session 36, device run 7: the tree with the evict-first hints (run 6's form, now unconditional; CPU-built into
# .device/kc_s36f.tar.xz): the quick backward bench with both anchors live into h200/, then the fused float64 tests
# and the fused bitwise repeat (4x16 warmed beside the bench), everything in one tarball.
set -o pipefail
t0=$SECONDS
mkdir -p /tmp/kcache && for a in kc kc_s36a kc_s36w kc_s36f; do tar -xJf .device/$a.tar.xz -C /tmp/kcache; done
R=$OUT/r; mkdir -p $R/h200
cp benchmarks/results/h200/{latest.json,details.json,command.txt} $R/h200/
python -m gdnkit warm --heads 4x16 --dtypes bfloat16 --backward fused --jobs 4 > $R/warm.log 2>&1 &
common="--grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --no-progress"
timeout 260 python -m gdnkit bench $common --anchors live --warm-jobs 12 --budget-s 150 --out $R/h200 > $R/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep "^|" $R/bench.log | cut -c1-170
timeout -s INT $((440 - (SECONDS - t0))) python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_tilelang_sm90.py \
  -k "(backward_fused_matches_float64 and (16x32 or no-states or segments)) or (repeat_bitwise and fused)" 2>&1 | tee $R/tests.log | tail -3 | cut -c1-300
echo "tests done at $((SECONDS - t0)) s"
kill %1 2>/dev/null
tar -cf $OUT/r.tar -C $OUT r
echo "total $((SECONDS - t0)) s"
