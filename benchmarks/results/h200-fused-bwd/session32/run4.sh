# session 32, device run 4: the GPU tests of training (every route, both backward paths), test_gpu.py and the
# cross-backend check, after building the heads they use on the host's 16 cores
set -o pipefail
t0=$SECONDS
[ -f /tmp/kcache/.s32 ] || { tar -xJf .device/kcache.tar.xz -C /tmp/kcache && touch /tmp/kcache/.s32; }
timeout 290 python -m gdnkit warm --heads 4x16,8x32,16x64,2x4,4x4 --backward both --jobs 16 > $OUT/warm.log 2>&1; grep "built,\|FAILED" $OUT/warm.log | cut -c1-300
echo "warm done at $((SECONDS - t0)) s"
left=$((560 - (SECONDS - t0)))
timeout -s INT $left python -m pytest -m gpu -q -rf -p no:cacheprovider --tb=short tests/test_tilelang_sm90.py tests/test_gpu.py tests/test_cross_backend.py -k "training or backward or cuda_graph or repeat or gradients or test_gpu or cross_backend or context_parallel" 2>&1 | tee $OUT/tests.log | tail -25 | cut -c1-500
echo "tests done at $((SECONDS - t0)) s"
