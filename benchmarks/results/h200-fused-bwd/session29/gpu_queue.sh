# branch wip/sums-queue on the H200: GPU tests, the bitwise check and the front's share, gdnkit alone with the sums
# beside (the overlapped and the plain front) and after (A/B, twice), then the quick backward with both anchors live into a copy of results/h200
set -o pipefail
t0=$SECONDS
timeout 150 python -m pytest -m gpu tests/test_tilelang_sm90.py -q -p no:cacheprovider -k "backward_fused_matches_float64 and (segments or 16x32 or varlen) or backward_fused_with_options or (repeat_bitwise and fused) or (cuda_graph and fused-segments)" 2>&1 | tee $OUT/tests.log | tail -4
grep -q " passed" $OUT/tests.log && ! grep -q "failed\|error" $OUT/tests.log || { echo "TESTS NOT CLEAN"; exit 3; }
timeout 100 python scratch/s29/check_queue.py 2>&1 | tee $OUT/check.log | grep "^\[check\]\|^\[front\]"
k=0
for mode in 1 plain 0 1 plain 0; do
  k=$((k + 1))
  front=overlapped; [ "$mode" = plain ] && front=plain
  GDNKIT_SM90_SUMS_FRONT=$front GDNKIT_SM90_SUMS_BESIDE=${mode/plain/1} timeout 60 python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90 --no-progress --out $OUT/ab$k > $OUT/ab$k.log 2>&1
  python -c "import json,sys; print('[beside=$mode]', ' '.join(f\"{r['H']}/{r['HV']} {r['seqlens']} {r['kernel_ms']:.4f}\" for r in json.load(open('$OUT/ab$k/latest.json')) if r['pass'] == 'bwd'))" | tee -a $OUT/ab.log
done
left=$((${BUDGET:-400} - (SECONDS - t0)))
mkdir -p $OUT/h200 && cp benchmarks/results/h200/latest.json benchmarks/results/h200/details.json benchmarks/results/h200/command.txt $OUT/h200/
[ "$left" -gt 200 ] && timeout $left python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --anchors live --warm-jobs 12 --budget-s 150 --no-progress --out $OUT/h200 2>&1 | tee $OUT/bench.log | grep "^|\|warm-up done" | cut -c1-150
echo "total $((SECONDS - t0)) s"
