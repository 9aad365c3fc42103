# session 34, device run 3: probe.py (the bench's rows against the A/B's: inputs or timing method)
set -o pipefail
t0=$SECONDS
for f in kcache kc_new kc_new2; do tar -xJf .device/$f.tar.xz -C /tmp/kcache; done
timeout 300 python scratch/s34r/probe.py 2>&1 | tee $OUT/probe.log | grep "^\[probe\]\|^\[ker\]\|Error\|error" | cut -c1-900
echo "total $((SECONDS - t0)) s"
