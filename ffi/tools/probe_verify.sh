#!/usr/bin/env bash
# One device call of profiling (writes under $OUT): build with the resource report, then Nsight Compute on the
# kernels of one timed program per shape: (1) every kernel's duration and SM clock (is anything besides the
# verify kernel and the merge in a call? how long is each?), (2) the verify/merge kernels' stall reasons,
# throughput and memory sections, (3) per-SASS-instruction stall samples of the verify kernel (CSV).
#   bash ffi/tools/probe_verify.sh "1 16 8 65536" "1 1 8 65536" ...
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ -z "${SKIP_BUILD:-}" ]; then
  t0=$(date +%s)
  KDTREE_JAX_PTXAS_VERBOSE=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} \
    python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
  grep -E "ptxas info.*(Compiling|Used)|spill" "$OUT/build.log" | grep -A2 -E "verify|merge" | sed 's/_ZN[0-9A-Za-z_]*verify_attention_cu_[0-9a-f]*//' | head -30
fi
NCU="ncu --clock-control none --profile-from-start off --replay-mode kernel"
# (1) timeline: every kernel of one program of 3 calls, duration + clocks
timeout 150 $NCU --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__bytes_read.sum,lts__t_sector_hit_rate.pct \
  python3 ffi/tools/probe_verify.py --time --hlo "$OUT/hlo.txt" "$@" > "$OUT/ncu_timeline.txt" 2>&1
grep -E "wall|profiled|^\s+[a-zA-Z_].*\(|gpu__time|cycles_elapsed|dram__bytes|hit_rate" "$OUT/ncu_timeline.txt" | sed -E 's/_ZN[0-9A-Za-z_]*verify_attention_cu_[0-9a-f]*//; s/\(([0-9]+, [0-9]+, [0-9]+)\)x\(([0-9]+, [0-9]+, [0-9]+)\).*/(\1)x(\2)/' | cut -c1-150 | head -90
grep -c -i "conditional" "$OUT/hlo.txt" | sed 's/^/conditionals in HLO: /'
# (2) sections + (3) source-level stall samples, verify kernel and merge, first call of each shape
timeout 240 $NCU -k regex:"verify_attention(_wide|_ws)?_kernel|merge_splits" --launch-count $(( 2 * $# )) \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis --section SourceCounters --import-source no -o "$OUT/prof" \
  python3 ffi/tools/probe_verify.py --calls 1 "$@" > "$OUT/ncu_run.txt" 2>&1
ncu --import "$OUT/prof.ncu-rep" --print-units base > "$OUT/ncu_details.txt" 2>&1
grep -E "verify_attention(_wide|_ws)?_kernel|merge_splits|SM Frequency|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|L2 Hit|L1/TEX Hit|Achieved Occ|Theoretical Occ|Registers Per|Issued Warp|No Eligible|Eligible Warps|Active Warps Per|Warp Cycles Per Issued|Stall" "$OUT/ncu_details.txt" | sed -E 's/_ZN[0-9A-Za-z_]*verify_attention_cu_[0-9a-f]*//' | cut -c1-140 | head -120
ncu --import "$OUT/prof.ncu-rep" --page raw --csv --metrics regex:smsp__pcsamp_warps_issue_stalled_.* > "$OUT/ncu_stalls.csv" 2>&1
ncu --import "$OUT/prof.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source.csv" 2>&1
ls -la "$OUT"
