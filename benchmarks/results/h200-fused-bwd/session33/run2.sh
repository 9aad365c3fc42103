# session 33, device run 2: form B of the recompute at two programs an SM (X made in V's stage tile), one more point
# (model-like gates), a bench only if the A/B's geomean is under 0.975
AB_POINTS=4x8x8192,4x8x32768,16x32x8192,16x32x32768,16x32x32768m AB_THRESHOLD=0.975 AB_S=200 BENCH_S=380 \
  bash benchmarks/results/h200-fused-bwd/session33/run1.sh
