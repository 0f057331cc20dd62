#!/usr/bin/env bash
# Nsight Compute on the verify kernel (third call of each shape; clocks left alone), one report per shape:
#   bash ffi/tools/ncu_verify.sh "1 1 8 65536" "1 16 8 65536"      (writes $OUT/ncu_*.txt)
OUT=${OUT:-/tmp/out}
# JAX preallocates 75% of the device by default; ncu's kernel replay then backs all of it up to host memory and
# failed (2026-11-29). Allocate on demand and replay the whole application instead.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
for shape in "$@"; do
  tag=$(echo "$shape" | tr ' ' '_')
  timeout 90 ncu --clock-control none --replay-mode application -k regex:"verify_attention" --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 ffi/tools/ncu_verify.py $shape > "$OUT/ncu_$tag.txt" 2>&1
  grep -E "Frequency|Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occ|Stall|Issued Warp|No Eligible|Active Warps|Eligible Warps|Hit Rate|Block Limit|Warp Cycles" "$OUT/ncu_$tag.txt" | head -60
  grep -E "^\s+(OPT|WRN|INF)" -A3 "$OUT/ncu_$tag.txt" | head -40
done
