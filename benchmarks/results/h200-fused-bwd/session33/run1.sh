# session 33, device runs 1 and 2: the recompute at two programs an SM. First the A/B alone on the GPU (bandwidth
# mixes, both forms at the quick points, AB_POINTS to change them), then, if two an SM pays (geomean bwd two/one
# under AB_THRESHOLD), the quick backward bench with both anchors live into $OUT/h200 with the GPU tests beside its
# warm-up (tests only: their timings don't matter). Run 1: as below; run 2: run2.sh.
set -o pipefail
t0=$SECONDS
here=benchmarks/results/h200-fused-bwd/session33   # (the runs used a copy in scratch/s33)
tar -xJf .device/kcache.tar.xz -C /tmp/kcache && echo "cache: $(find /tmp/kcache/tilelang -name kernel.cubin | wc -l) kernels"
timeout ${AB_S:-170} python $here/ab.py 2>&1 | tee $OUT/ab.log | grep "^\[ab\]\|^\[ker\]\|^\[bw\]\|Error\|error" | cut -c1-400
echo "ab done at $((SECONDS - t0)) s"
g=$(grep "geomean bwd two/one" $OUT/ab.log | awk '{print $NF}')
if [ -n "$g" ] && python -c "import sys; sys.exit(0 if float('$g') < ${AB_THRESHOLD:-0.99} else 1)"; then
  mkdir -p $OUT/h200 && cp benchmarks/results/h200/latest.json benchmarks/results/h200/details.json benchmarks/results/h200/command.txt $OUT/h200/
  timeout ${BENCH_S:-400} python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --anchors live --warm-jobs 12 --budget-s 150 --no-progress --out $OUT/h200 > $OUT/bench.log 2>&1 &
  bench=$!
  timeout -s INT 110 python -m pytest -m gpu tests/test_tilelang_sm90.py -q -p no:cacheprovider -k "(backward_fused_matches_float64 and not one) or wide-mixed-gates or (repeat_bitwise and fused) or (cuda_graph and fused)" 2>&1 | tee $OUT/tests.log | tail -4 | cut -c1-400
  echo "tests done at $((SECONDS - t0)) s"
  wait $bench; echo "bench rc=$?"
  grep "^|\|warm-up done" $OUT/bench.log | cut -c1-170
else
  echo "two an SM does not pay (geomean $g): no bench"
  timeout -s INT 90 python -m pytest -m gpu tests/test_tilelang_sm90.py -q -p no:cacheprovider -k "(backward_fused_matches_float64 and not one) or (repeat_bitwise and fused)" 2>&1 | tee $OUT/tests.log | tail -4 | cut -c1-400
fi
echo "total $((SECONDS - t0)) s"
