# session 34, device run 5: main's GPU tests of training after session 33's in-place segment states (the gated
# route, both backward paths), after building the heads they use
set -o pipefail
t0=$SECONDS
tar -xJf .device/kcache.tar.xz -C /tmp/kcache
timeout 170 python -m gdnkit warm --heads 2x8,4x16,8x32,16x64,2x4,4x4 --dtypes bfloat16 --backward both --jobs 16 > $OUT/warm.log 2>&1; grep "built,\|FAILED" $OUT/warm.log | cut -c1-300
echo "warm done at $((SECONDS - t0)) s"
left=$((455 - (SECONDS - t0)))
timeout -s INT $left python -m pytest -m gpu -q -rf -p no:cacheprovider --tb=short tests/test_tilelang_sm90.py tests/test_gpu.py -k "training or backward_fused or repeat or (test_gpu and gradients)" 2>&1 | tee $OUT/tests.log | tail -15 | cut -c1-500
echo "tests done at $((SECONDS - t0)) s"
