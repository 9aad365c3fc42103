# session 34, device run 4: order_ab.py (tree scratch/s34r/O), then, where a form beats beside by the bench's method
# (geomean under 0.99, bitwise), the quick backward bench with both anchors live in that form into $OUT/h200 and
# the fused float64 tests of the cached heads in it
set -o pipefail
t0=$SECONDS
for f in kcache kc_new kc_new2; do tar -xJf .device/$f.tar.xz -C /tmp/kcache; done
export PYTHONPATH=scratch/s34r/O:$PYTHONPATH
timeout 200 python scratch/s34r/order_ab.py 2>&1 | tee $OUT/order.log | grep "^\[order\]\|Error\|error" | cut -c1-700
echo "order_ab done at $((SECONDS - t0)) s"
best=$(grep "^\[order\] geomean" $OUT/order.log | grep "bitwise True" | awk '{print $5+0, $3}' | sort -n | head -1)
echo "best: $best"
form=$(echo $best | awk '{print $2}' | cut -d/ -f1); val=$(echo $best | awk '{print $1}')
if [ -n "$form" ] && [ "$form" != "beside" ] && python -c "import sys; sys.exit(0 if $val < 0.99 else 1)"; then
  export GDNKIT_S34_ORDER=$form
  mkdir -p $OUT/h200 && cp benchmarks/results/h200/latest.json benchmarks/results/h200/details.json benchmarks/results/h200/command.txt $OUT/h200/
  timeout 300 python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --anchors live --warm-jobs 12 --budget-s 150 --no-progress --out $OUT/h200 > $OUT/bench.log 2>&1
  echo "bench ($form) rc=$? at $((SECONDS - t0)) s"
  grep "^|" $OUT/bench.log | cut -c1-170
  timeout -s INT 60 python -m pytest -m gpu tests/test_tilelang_sm90.py -q -rf -p no:cacheprovider -k "backward_fused_matches_float64 and (16x32 or no-states)" 2>&1 | tee $OUT/tests.log | tail -3 | cut -c1-300
else
  echo "no form beats beside: no bench"
fi
echo "total $((SECONDS - t0)) s"
