# session 30 run 1 (branch wip/sums-queue): the anchors' kernels compiled in the background while the GPU tests and
# the bitwise check run; then (nothing compiling) the fronts alone and the A/B of gdnkit alone: sums beside the
# kernel (overlapped / plain front) against after it; then the caches (gdnkit's, FlashQLA's, FLA's) saved as xz
set -o pipefail
t0=$SECONDS
python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls flashqla,fla --anchors live --warm-jobs 12 \
  --budget-s 0 --no-progress --out /tmp/warmout > $OUT/anchor_warm.log 2>&1 &
wpid=$!
timeout 170 python -m pytest -m gpu tests/test_tilelang_sm90.py -q -p no:cacheprovider -k "backward_fused_matches_float64 and (segments or 16x32 or varlen) or backward_fused_with_options or (repeat_bitwise and fused) or (cuda_graph and fused-segments)" > $OUT/tests.log 2>&1
echo "[tests] $(tail -1 $OUT/tests.log) at $((SECONDS - t0)) s"
CHECK_PART=bitwise timeout 100 python scratch/s30/check_queue.py > /tmp/check_bitwise.log 2>&1
grep "^\[check\]" /tmp/check_bitwise.log; echo "[check] done at $((SECONDS - t0)) s"
left=$((380 - (SECONDS - t0))); [ $left -lt 1 ] && left=1
timeout $left tail --pid=$wpid -f /dev/null; kill $wpid 2>/dev/null
echo "[warm] $(grep -c . $OUT/anchor_warm.log) lines, done at $((SECONDS - t0)) s"; grep -i "warm-up done\|error" $OUT/anchor_warm.log | head -5
CHECK_PART=rates timeout 60 python scratch/s30/check_queue.py > /tmp/check_rates.log 2>&1; grep "^\[front\]" /tmp/check_rates.log | cut -c1-120
k=0
for mode in overlapped plain after overlapped after plain; do
  [ $((SECONDS - t0)) -gt 500 ] && { echo "[ab] stopped before $mode at $((SECONDS - t0)) s"; break; }
  k=$((k + 1)); beside=1; [ $mode = after ] && beside=0
  GDNKIT_SM90_SUMS_FRONT=$mode GDNKIT_SM90_SUMS_BESIDE=$beside timeout 60 python -m gdnkit bench --grid quick --passes bwd --heads 4x8,16x32 --impls gdnkit:tilelang_sm90 --no-progress --out /tmp/ab$k > /tmp/ab$k.log 2>&1
  python -c "import json; print('[ab $mode]', ' '.join(f\"{r['H']}/{r['HV']} {r['seqlens']} {r['kernel_ms']:.4f} {r['peak_mem_bytes'] / 2**20:.0f}MiB\" for r in json.load(open('/tmp/ab$k/latest.json')) if r['pass'] == 'bwd'))" | tee -a $OUT/ab.log
done
tar -cf - -C /tmp/kcache tilelang triton | xz -6 -T16 > $OUT/kcache.tar.xz; ls -la $OUT/kcache.tar.xz
cat /tmp/check_bitwise.log /tmp/check_rates.log /tmp/ab*.log > $OUT/logs.txt 2>/dev/null
echo "total $((SECONDS - t0)) s"
