# session 34, device run 2: the quick backward bench of main with both anchors live into $OUT/h200, alone on the
# machine (run 1's bench ran out of time in the anchors' compiles beside the tests: their cache entries come back
# in .device/kc_new.tar.xz); then the new cache entries again
set -o pipefail
t0=$SECONDS
tar -xJf .device/kcache.tar.xz -C /tmp/kcache && tar -xJf .device/kc_new.tar.xz -C /tmp/kcache && echo "cache: $(ls /tmp/kcache/tilelang/*/*/kernels | wc -l) tilelang entries, $(find /tmp/kcache/triton -type f | wc -l) triton files"
touch /tmp/kcache/.marker
python -c "import gdnkit; print('bench tree', gdnkit.__file__)"
mkdir -p $OUT/h200 && cp benchmarks/results/h200/latest.json benchmarks/results/h200/details.json benchmarks/results/h200/command.txt $OUT/h200/
timeout 520 python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --anchors live --warm-jobs 12 --budget-s 150 --no-progress --out $OUT/h200 > $OUT/bench.log 2>&1
echo "bench rc=$? at $((SECONDS - t0)) s"
grep "^|\|warm-up done\|  warm " $OUT/bench.log | cut -c1-170
cd /tmp/kcache && find . -type f -newer .marker | grep -v "^./.marker" > /tmp/new.txt; echo "new cache files: $(wc -l < /tmp/new.txt)"
XZ_OPT=-T0 tar -cJf $OUT/kc_new2.tar.xz -T /tmp/new.txt && ls -la $OUT/kc_new2.tar.xz
echo "total $((SECONDS - t0)) s"
