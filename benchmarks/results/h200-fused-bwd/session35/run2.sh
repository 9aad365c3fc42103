# session 35, device run 2 (caches of run 1 in .device/kc.tar.xz): the rest of run 1's test selection (the fused
# path's options and repeat tests at 4x16 after building that head config, the triton options tests, the host test
# fixed for a GPU machine), the quick backward bench with --qk-l2norm against both anchors, spread_probe.py, caches.
set -o pipefail
t0=$SECONDS
here=benchmarks/results/h200-fused-bwd/session35
mkdir -p /tmp/kcache && tar -xJf .device/kc.tar.xz -C /tmp/kcache
python -m gdnkit warm --heads 4x16 --dtypes bfloat16 --jobs 14 > $OUT/warm-4x16.log 2>&1 &
pw=$!
timeout -s INT 150 python -m pytest -q -rf -p no:cacheprovider tests/test_tilelang_sm90.py tests/test_triton_generic.py \
  -k "host_side_with_kernel_stand_ins and options or test_all_options or gpu_options" 2>&1 | tee $OUT/tests-a.log | tail -4 | cut -c1-300
while kill -0 $pw 2>/dev/null && [ $((SECONDS - t0)) -lt 230 ]; do sleep 2; done
grep "built,\|FAILED" $OUT/warm-4x16.log | cut -c1-200; echo "warm 4x16 done (or cut) at $((SECONDS - t0)) s"
kill $pw 2>/dev/null
timeout -s INT $((300 - (SECONDS - t0))) python -m pytest -q -rf -p no:cacheprovider tests/test_tilelang_sm90.py \
  -k "backward_fused_with_options or repeat_bitwise" 2>&1 | tee $OUT/tests-b.log | tail -4 | cut -c1-300
echo "tests done at $((SECONDS - t0)) s"
mkdir -p $OUT/h200-qk-l2norm
timeout 200 python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --qk-l2norm \
  --impls gdnkit:tilelang_sm90,flashqla,fla --anchors live --warm-jobs 12 --budget-s 150 --no-progress \
  --out $OUT/h200-qk-l2norm > $OUT/bench-qk-l2norm.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"
XZ_OPT=-T0 tar -cJf $OUT/kc.tar.xz -C /tmp/kcache tilelang triton
timeout $((575 - (SECONDS - t0))) python $here/spread_probe.py 2>&1 | tee $OUT/spread_probe.log | grep "^\[spread\]" | cut -c1-180
grep "^|" $OUT/bench-qk-l2norm.log | cut -c1-170
echo "total $((SECONDS - t0)) s"
