# session 32, device run 1: A/B of the training forward's wide route + 128-column recompute (ab.py) while the
# kernels the CPU did not build are built on the host's cores, then the GPU tests the change touches; the kernel
# cache back to $OUT as xz (a returned file is at most 16 MiB)
set -o pipefail
t0=$SECONDS
[ -f .device/kcache.tar.xz ] && tar -xJf .device/kcache.tar.xz -C /tmp/kcache && echo "cache: $(ls /tmp/kcache/tilelang | wc -l) entries"
(python -m gdnkit warm --heads 2x8,4x8,16x32 --backward both --jobs 16 && python -m gdnkit warm --heads 4x16 --backward fused --jobs 16) > $OUT/warm.log 2>&1 &
warm=$!
timeout 240 python scratch/s32/ab.py 2>&1 | tee $OUT/ab.log | grep "^\[ab\]\|^\[ker\]\|Error\|error" | cut -c1-600
echo "ab done at $((SECONDS - t0)) s"
wait $warm; grep "built,\|FAILED" $OUT/warm.log | cut -c1-300
echo "warm done at $((SECONDS - t0)) s"
left=$((540 - (SECONDS - t0)))
timeout -s INT $left python -m pytest -m gpu tests/test_tilelang_sm90.py -q -p no:cacheprovider -k "(backward_fused_matches_float64 and not one) or backward_fused_with_options or wide-mixed-gates or (repeat_bitwise and fused) or (cuda_graph and fused) or (context_parallel_on_gpu and wide and not 8-32 and not 16-64)" 2>&1 | tee $OUT/tests.log | tail -15 | cut -c1-600
echo "tests done at $((SECONDS - t0)) s"
tar -cf - -C /tmp/kcache tilelang | xz -6 -T8 > $OUT/kcache.tar.xz; ls -la $OUT/kcache.tar.xz
