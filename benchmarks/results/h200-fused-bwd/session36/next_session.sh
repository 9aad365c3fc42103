# For the next session's first device run (written in session 35, not run): the GPU tests of the walks' early exit
# (session 35, CPU-built), walks_probe.py (its kernel and the forwards), clock_probe.py (is the fused kernel's
# spread the clock?), then the quick backward bench with both anchors live. Run from the repo root, after
# ../shared/tools/device-prep, as: source .device/boot.sh && bash benchmarks/results/h200-fused-bwd/session36/next_session.sh
# Cold (no kernel cache), the bench's warm-up takes ~235 s: give the run its full 600 s, or split the bench off.
set -o pipefail
t0=$SECONDS
here=benchmarks/results/h200-fused-bwd/session36
R=$OUT/r; mkdir -p $R/h200
cp benchmarks/results/h200/{latest.json,details.json,command.txt} $R/h200/
[ -f .device/kc.tar.xz ] && mkdir -p /tmp/kcache && tar -xJf .device/kc.tar.xz -C /tmp/kcache
common="--grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --no-progress"
python -m gdnkit bench $common --budget-s 0 --warm-jobs 12 --out $R/warm > $R/warm.log 2>&1 &
pw=$!
timeout -s INT 200 python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_tilelang_sm90.py \
  -k "context_parallel_on_gpu and (chained-long-walks or wide-8-32 or auto-64k)" 2>&1 | tee $R/tests.log | tail -3 | cut -c1-300
while kill -0 $pw 2>/dev/null && [ $((SECONDS - t0)) -lt 300 ]; do sleep 2; done; kill $pw 2>/dev/null
OUT=$R timeout 60 python $here/walks_probe.py 2>&1 | tee $R/walks.log | grep "^\[walks\]" | cut -c1-200
OUT=$R timeout 40 python $here/clock_probe.py 2>&1 | tee $R/clock.log | grep "^\[clock\]" | cut -c1-300
timeout $((570 - (SECONDS - t0))) python -m gdnkit bench $common --anchors live --warm-jobs 12 --budget-s 150 \
  --out $R/h200 > $R/bench.log 2>&1; echo "bench rc=$? at $((SECONDS - t0)) s"
grep "^|" $R/bench.log | cut -c1-170
tar -cf $OUT/r.tar -C $OUT r
echo "total $((SECONDS - t0)) s"
