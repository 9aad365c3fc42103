# session 36, device run 8: run 7's bench again on a fresh start (is 1.772 ms at 16/32 1x32768 typical?), into its
# own folder, then the wider GPU tests of the fused path (context parallelism, CUDA graphs, training) in what is left.
set -o pipefail
t0=$SECONDS
mkdir -p /tmp/kcache && for a in kc kc_s36a kc_s36w kc_s36f; do tar -xJf .device/$a.tar.xz -C /tmp/kcache; done
R=$OUT/r; mkdir -p $R/h200-repeat
common="--grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --no-progress"
timeout 150 python -m gdnkit bench $common --anchors live --warm-jobs 12 --budget-s 100 --out $R/h200-repeat > $R/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"; grep "^|" $R/bench.log | cut -c1-170
timeout -s INT $((215 - (SECONDS - t0))) python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_tilelang_sm90.py \
  -k "context_parallel_on_gpu or (cuda_graph and segments) or training_with_context_parallelism" 2>&1 | tee $R/tests.log | tail -3 | cut -c1-300
echo "tests done at $((SECONDS - t0)) s"
rm -f $R/h200-repeat/speedup.png
tar -cf $OUT/r.tar -C $OUT r
echo "total $((SECONDS - t0)) s"
