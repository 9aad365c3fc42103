# session 36, device run 2: ab.py (the fused kernel with the next chunk's tiles prefetched into L2 against without;
# both forms CPU-built into .device/kc_s36a.tar.xz) beside a warm of the fused float64 tests' head configs, then those
# tests and the fused bitwise repeats with the prefetch (main's form), everything in one tarball.
set -o pipefail
t0=$SECONDS
here=benchmarks/results/h200-fused-bwd/session36
mkdir -p /tmp/kcache && for a in kc kc_s36a; do tar -xJf .device/$a.tar.xz -C /tmp/kcache; done; touch /tmp/kcache/.restored_s36
R=$OUT/r; mkdir -p $R
python -m gdnkit warm --heads 2x4,4x16,2x8,4x4,16x32,4x8 --dtypes bfloat16 --backward fused --jobs 12 > $R/warm.log 2>&1 &
pw=$!
OUT=$R timeout 200 python $here/ab.py 2>&1 | tee $R/ab.log | grep "^\[ab\]" | cut -c1-300
echo "ab done at $((SECONDS - t0)) s"
while kill -0 $pw 2>/dev/null && [ $((SECONDS - t0)) -lt 330 ]; do sleep 2; done
grep "built,\|FAILED" $R/warm.log | cut -c1-200; kill $pw 2>/dev/null
timeout -s INT $((540 - (SECONDS - t0))) python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_tilelang_sm90.py \
  -k "backward_fused_matches_float64 or backward_fused_with_options or repeat_bitwise" 2>&1 | tee $R/tests.log | tail -3 | cut -c1-300
echo "tests done at $((SECONDS - t0)) s"
cd /tmp/kcache && find tilelang triton -newer /tmp/kcache/.restored_s36 -type f 2>/dev/null | XZ_OPT=-T0 tar -cJf $OUT/kc_new.tar.xz -T - ; cd - >/dev/null
tar -cf $OUT/r.tar -C $OUT r
echo "total $((SECONDS - t0)) s"
