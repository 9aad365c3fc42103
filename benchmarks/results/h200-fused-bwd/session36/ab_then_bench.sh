# session 36, device runs 3-6: restore the kernel caches (.device/kc.tar.xz, run 2's builds, and the named archive of
# CPU-built forms), run ab.py over the forms given, and where the first form beats the second (backward geomean
# < 0.985) run the quick backward bench with both anchors live into h200/ and the fused float64 tests with the
# tree's form. Usage, from the repo root after source .device/boot.sh:
#   bash ab_then_bench.sh ARCHIVE FIRST SECOND FORM=OPTION:0|1 ...   (e.g. run 6: kc_s36e evict normal
#   evict=evict_first:1 normal=evict_first:0; runs 3-5 ran copies of this script with ab.py's earlier forms)
set -o pipefail
t0=$SECONDS
here=benchmarks/results/h200-fused-bwd/session36
archive=$1 first=$2 second=$3; shift 3
mkdir -p /tmp/kcache && for a in kc kc_s36a kc_s36w $archive; do tar -xJf .device/$a.tar.xz -C /tmp/kcache; done
R=$OUT/r; mkdir -p $R/h200
OUT=$R timeout 150 python $here/ab.py "$@" 2>&1 | tee $R/ab.log | grep "^\[ab\]" | cut -c1-420
echo "ab done at $((SECONDS - t0)) s"
if python -c "import json, math, sys; r = json.load(open('$R/ab.json'))
g = math.exp(sum(math.log(v['$first']['bwd'] / v['$second']['bwd']) for v in r.values()) / len(r)); sys.exit(g >= 0.985)"; then
  cp benchmarks/results/h200/{latest.json,details.json,command.txt} $R/h200/
  python -m gdnkit warm --heads 2x8,4x16 --dtypes bfloat16 --backward fused --jobs 6 > $R/warm.log 2>&1 &
  common="--grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90,flashqla,fla --no-progress"
  timeout 280 python -m gdnkit bench $common --anchors live --warm-jobs 12 --budget-s 150 --out $R/h200 > $R/bench.log 2>&1
  echo "bench rc=$? at $((SECONDS - t0)) s"; grep "^|" $R/bench.log | cut -c1-170
  timeout -s INT $((560 - (SECONDS - t0))) python -m pytest -m gpu -q -rf -p no:cacheprovider tests/test_tilelang_sm90.py \
    -k "(backward_fused_matches_float64 and (16x32 or no-states or segments)) or (repeat_bitwise and fused)" 2>&1 | tee $R/tests.log | tail -3 | cut -c1-300
  echo "tests done at $((SECONDS - t0)) s"
fi
tar -cf $OUT/r.tar -C $OUT r
echo "total $((SECONDS - t0)) s"
