# session 35, device run 4 (run 1's caches): the GPU training tests around the change of run 3 (the backward's
# flags from the forward's row bounds; the staged path's reverse walks from them too), after building the heads
# they use: bitwise repeats, CUDA-graph training calls, the fused float64 cases, test_gpu's varlen gradients.
set -o pipefail
t0=$SECONDS
mkdir -p /tmp/kcache && tar -xJf .device/kc.tar.xz -C /tmp/kcache
R=$OUT/r; mkdir -p $R
timeout 210 python -m gdnkit warm --heads 2x8,4x16,4x8,16x32,4x4,2x4 --dtypes bfloat16 --jobs 16 > $R/warm.log 2>&1
grep "built,\|FAILED" $R/warm.log | cut -c1-200; echo "warm done at $((SECONDS - t0)) s"
timeout -s INT $((420 - (SECONDS - t0))) python -m pytest -m gpu -q -rf -p no:cacheprovider --tb=short \
  tests/test_tilelang_sm90.py tests/test_gpu.py -k "repeat_bitwise or cuda_graph_matches_eager or \
backward_fused_matches_float64 or (gradients_varlen and tilelang)" 2>&1 | tee $R/tests.log | tail -12 | cut -c1-300
echo "tests done at $((SECONDS - t0)) s"
tar -cf $OUT/r.tar -C $OUT r
