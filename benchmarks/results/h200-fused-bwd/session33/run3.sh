# session 33, device run 3: the GPU tests of training (every route, both backward paths, the fused path's recompute
# now at two programs an SM), test_gpu.py's and the cross-backend check, after building the heads they use
set -o pipefail
t0=$SECONDS
tar -xJf .device/kcache.tar.xz -C /tmp/kcache && echo "cache: $(find /tmp/kcache/tilelang -name kernel.cubin | wc -l) kernels"
timeout 200 python -m gdnkit warm --heads 2x8,4x16,8x32,16x64,2x4,4x4,4x8,16x32 --backward both --jobs 16 > $OUT/warm.log 2>&1; grep "built,\|FAILED" $OUT/warm.log | cut -c1-300
echo "warm done at $((SECONDS - t0)) s"
left=$((540 - (SECONDS - t0)))
timeout -s INT $left python -m pytest -m gpu -q -rf -p no:cacheprovider --tb=short tests/test_tilelang_sm90.py tests/test_gpu.py tests/test_cross_backend.py -k "fused or training or context_parallel or (test_gpu and gradients) or cross_backend or repeat or cuda_graph" 2>&1 | tee $OUT/tests.log | tail -25 | cut -c1-500
echo "tests done at $((SECONDS - t0)) s"
