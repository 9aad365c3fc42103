# For the next session's first device run (written in session 34, not run): the GPU checks of session 34's
# CPU-built qk l2norm passes, then their bench against the anchors, then order_probe.py. Run from the repo root as
#   mkdir -p /tmp/kcache && tar -xJf .device/kcache.tar.xz -C /tmp/kcache && source .device/boot.sh &&
#   bash benchmarks/results/h200-fused-bwd/session34/next_session.sh
# (the Triton kernels it adds compile on the GPU in seconds; FlashQLA's backward compiles take ~2-4 minutes a head
# config cold, so carry the anchors' cache entries of session 34's runs where they are still at hand).
set -o pipefail
t0=$SECONDS
here=benchmarks/results/h200-fused-bwd/session34
timeout -s INT 200 python -m pytest -q -rf -p no:cacheprovider tests/test_l2norm.py \
  tests/test_tilelang_sm90.py tests/test_triton_generic.py -k "l2norm or options or repeat_bitwise or group_sums" \
  2>&1 | tee $OUT/tests.log | tail -6 | cut -c1-400
echo "tests done at $((SECONDS - t0)) s"
mkdir -p $OUT/h200-qk-l2norm
timeout 330 python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --qk-l2norm \
  --impls gdnkit:tilelang_sm90,flashqla,fla --anchors live --warm-jobs 12 --budget-s 150 --no-progress \
  --out $OUT/h200-qk-l2norm > $OUT/bench-qk-l2norm.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"
grep "^|" $OUT/bench-qk-l2norm.log | cut -c1-170
timeout 120 python $here/order_probe.py 2>&1 | tee $OUT/order_probe.log | grep "^\[order-probe\]" | cut -c1-200
echo "total $((SECONDS - t0)) s"
