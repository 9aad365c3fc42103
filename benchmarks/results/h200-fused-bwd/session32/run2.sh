# session 32, device run 2: the wide training forward with the 64-column recompute over its segments. The quick
# backward with both anchors live starts first (its warm-up compiles FlashQLA on the host's cores for minutes);
# meanwhile the GPU tests the change touches and the A/B against main's training route run on the GPU, before the
# bench's timing starts
set -o pipefail
t0=$SECONDS
tar -xJf .device/kcache.tar.xz -C /tmp/kcache && echo "cache: $(find /tmp/kcache/tilelang -name kernel.cubin | wc -l) kernels"
mkdir -p $OUT/h200 && cp benchmarks/results/h200/latest.json benchmarks/results/h200/details.json benchmarks/results/h200/command.txt $OUT/h200/
timeout 530 python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --anchors live --warm-jobs 12 --budget-s 150 --no-progress --out $OUT/h200 > $OUT/bench.log 2>&1 &
bench=$!
timeout -s INT 120 python -m pytest -m gpu tests/test_tilelang_sm90.py -q -p no:cacheprovider -k "(backward_fused_matches_float64 and not one) or wide-mixed-gates or (repeat_bitwise and fused) or (cuda_graph and fused)" 2>&1 | tee $OUT/tests.log | tail -6 | cut -c1-600
echo "tests done at $((SECONDS - t0)) s"
grep -q "warm-up done" $OUT/bench.log && echo "WARNING: the bench's warm-up ended before the tests did"
timeout 100 python scratch/s32/ab.py 2>&1 | tee $OUT/ab.log | grep "^\[ab\]\|^\[ker\]\|Error\|error" | cut -c1-600
echo "ab done at $((SECONDS - t0)) s"
grep -q "warm-up done" $OUT/bench.log && echo "WARNING: the bench's warm-up ended before the A/B did"
wait $bench; echo "bench rc=$?"
grep "^|\|warm-up done" $OUT/bench.log | cut -c1-170
echo "total $((SECONDS - t0)) s"
