# session 34, device run 1: the A/B of the two branches (scratch/s34/M, H: ab.py, two processes a tree, alternating),
# then the quick backward bench with both anchors live of the tree decide.py picks, into $OUT/h200, with the fused
# GPU tests of that tree beside the bench's warm-up; the kernel caches' new entries (the anchors' compiles) come back
set -o pipefail
t0=$SECONDS
s=scratch/s34
tar -xJf .device/kcache.tar.xz -C /tmp/kcache && echo "cache: $(find /tmp/kcache/tilelang -name kernel.cubin | wc -l) kernels"
touch /tmp/kcache/.marker
for r in 1 2; do for t in M H; do
  PYTHONPATH=$s/$t:$PYTHONPATH timeout 70 python $s/ab.py $t $r 2>&1 | tee -a $OUT/ab.log | grep "^\[ab\]\|^\[ker\]\|Error\|error" | cut -c1-330
  echo "ab $t$r done at $((SECONDS - t0)) s"
done; done
pick=$(python $s/decide.py); echo "decide: $pick"; tree=${pick%% *}
export PYTHONPATH=$s/$tree:$PYTHONPATH
python -c "import gdnkit; print('bench tree', gdnkit.__file__)"
mkdir -p $OUT/h200 && cp benchmarks/results/h200/latest.json benchmarks/results/h200/details.json benchmarks/results/h200/command.txt $OUT/h200/
timeout 290 python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --anchors live --warm-jobs 12 --budget-s 120 --no-progress --out $OUT/h200 > $OUT/bench.log 2>&1 &
bench=$!
timeout -s INT 120 python -m pytest -m gpu tests/test_tilelang_sm90.py -q -rf -p no:cacheprovider -k "backward_fused_matches_float64 and (16x32 or no-states)" 2>&1 | tee $OUT/tests.log | tail -6 | cut -c1-400
echo "tests done at $((SECONDS - t0)) s"
wait $bench; echo "bench rc=$?"
grep "^|\|warm-up done" $OUT/bench.log | cut -c1-170
cd /tmp/kcache && find . -type f -newer .marker | grep -v "^./.marker" > /tmp/new.txt; echo "new cache files: $(wc -l < /tmp/new.txt)"
XZ_OPT=-T0 tar -cJf $OUT/kc_new.tar.xz -T /tmp/new.txt && ls -la $OUT/kc_new.tar.xz
echo "total $((SECONDS - t0)) s"
