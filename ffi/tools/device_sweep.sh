#!/usr/bin/env bash
# One device call for issue 3's whole sweep, which takes longer than one call: build (sm_90), optionally
# profile the per-call gap (GAP_SHAPES, ffi/tools/gap_profile.py), then benchmarks/verify_kernel.py --plan full
# --resume (SWEEP_EXTRA: more arguments) until BUDGET_S seconds after the start. RESUME_FROM (a path without .json in the
# checkout) seeds the sweep with the rows of an earlier call; the results are $OUT/verify_kernel_h200.{json,md}.
# TESTS=1 runs the GPU kernel tests first (tests/test_verify_attention_gpu.py, -n 16, TESTS_S seconds at most).
# SHARDS=N (a machine of N GPUs) runs the sweep as N processes, one per GPU (--shard i/N), and merges their tables;
# with TESTS=1 each GPU then runs its share of the tests (TESTS_RESERVE_S: seconds the sweep leaves them).
# SKEW_SHAPES="B T H L [splits];..." first runs ffi/tools/block_skew.py on a diagnostic build (block start/end
# stamps), then rebuilds without them; PLAN=none stops before the sweep.
#   KDTREE_COMMIT=<h> BUDGET_S=540 GAP_SHAPES='1 1 8 4096;1 16 8 65536' bash ffi/tools/device_sweep.sh
#   KDTREE_COMMIT=<h> BUDGET_S=540 RESUME_FROM=benchmarks/results/verify_kernel_h200_full bash ffi/tools/device_sweep.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
BUDGET_S=${BUDGET_S:-540}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
at_least_20() { [ "$1" -lt 20 ] && echo 20 || echo "$1"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ -n "${SKEW_SHAPES:-}" ]; then  # block timelines first, on a diagnostic build (ffi/tools/block_skew.py)
  KDTREE_JAX_BLOCK_CLOCK=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} \
    python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build_block_clock.log" 2>&1 || { tail -40 "$OUT/build_block_clock.log"; exit 1; }
  IFS=';' read -ra shapes <<< "$SKEW_SHAPES"
  timeout "${SKEW_S:-120}" python3 ffi/tools/block_skew.py --out "$OUT" "${shapes[@]}" 2>&1 | tail -40
  echo "block timelines done at $(( $(date +%s) - T0 )) s; rebuilding without the stamps"
fi
KDTREE_JAX_PTXAS_VERBOSE=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} \
  python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build done at $(( $(date +%s) - T0 )) s"
SHARDS=${SHARDS:-1}
if [ "${TESTS:-0}" = 1 ] && [ "$SHARDS" -gt 1 ]; then  # the tests follow each GPU's shard of the sweep (below)
  python3 -m pytest -q --collect-only -p no:cacheprovider tests/test_verify_attention_gpu.py 2>/dev/null | grep "::" > /tmp/gpu_test_ids
  echo "$(wc -l < /tmp/gpu_test_ids) GPU tests, dealt over $SHARDS GPUs"
elif [ "${TESTS:-0}" = 1 ]; then  # the CUDA kernels against the reference, compute-sanitizer included
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TESTS_S:-320}" python3 -m pytest -q -n 16 --durations=5 -p no:cacheprovider \
    tests/test_verify_attention_gpu.py > "$OUT/gpu_tests.log" 2>&1
  echo "GPU tests rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -12
fi
if [ -n "${GAP_SHAPES:-}" ]; then
  IFS=';' read -ra shapes <<< "$GAP_SHAPES"
  mkdir -p /tmp/gap
  timeout "${GAP_S:-150}" python3 ffi/tools/gap_profile.py --out /tmp/gap "${shapes[@]}" > /tmp/gap/gap.txt 2>&1
  echo "gap profile rc=$? at $(( $(date +%s) - T0 )) s"
  grep -E "^===|^wall|^device lines|Error|Traceback" /tmp/gap/gap.txt
  tar -czf "$OUT/gap.tgz" -C /tmp/gap .
fi
if [ -n "${RESUME_FROM:-}" ]; then
  cp "$RESUME_FROM.json" "$OUT/verify_kernel_h200.json" && echo "resuming from $RESUME_FROM.json"
fi
[ "${PLAN:-full}" = none ] && { ls -la "$OUT"; exit 0; }
L=$(( $(left) - 15 )); [ $L -lt 20 ] && L=20
if [ "$SHARDS" -gt 1 ]; then  # one process per GPU, each on its (B, L) groups, then its share of the tests
  shard_then_tests() {
    local i=$1
    mkdir -p "/tmp/shard$i"
    [ -f "$OUT/verify_kernel_h200.json" ] && cp "$OUT/verify_kernel_h200.json" "/tmp/shard$i/verify_kernel_h200.json"
    CUDA_VISIBLE_DEVICES=$i timeout "$(at_least_20 $(( $(left) - 15 - ${TESTS_RESERVE_S:-0} )))" python3 benchmarks/verify_kernel.py \
      --plan "${PLAN:-full}" ${SWEEP_EXTRA:---device-timing} --resume --shard "$i/$SHARDS" --commit "${KDTREE_COMMIT:-unknown}" \
      --out "/tmp/shard$i/verify_kernel_h200" > "/tmp/shard$i/sweep.log" 2>&1
    echo "shard $i rc=$? at $(( $(date +%s) - T0 )) s"
    if [ -f /tmp/gpu_test_ids ]; then
      mapfile -t ids < <(awk -v i="$i" -v n="$SHARDS" '(NR - 1) % n == i' /tmp/gpu_test_ids)
      CUDA_VISIBLE_DEVICES=$i XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$(at_least_20 $(( $(left) - 10 )))" python3 -m pytest -q ${XDIST--n 12} \
        --durations=5 -p no:cacheprovider "${ids[@]}" > "$OUT/gpu_tests_$i.log" 2>&1
      echo "GPU tests $i (${#ids[@]}) rc=$? at $(( $(date +%s) - T0 )) s"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests_$i.log" | tail -6
    fi
  }
  for i in $(seq 0 $((SHARDS - 1))); do shard_then_tests "$i" & done
  wait
  base=(); [ -f "$OUT/verify_kernel_h200.json" ] && base=("$OUT/verify_kernel_h200.json")
  python3 benchmarks/verify_kernel.py --merge "${base[@]}" /tmp/shard*/verify_kernel_h200.json --out "$OUT/verify_kernel_h200"
  cat /tmp/shard*/sweep.log > "$OUT/sweep.log"
else
  timeout $L python3 benchmarks/verify_kernel.py --plan "${PLAN:-full}" ${SWEEP_EXTRA:---device-timing} --resume \
    --commit "${KDTREE_COMMIT:-unknown}" --out "$OUT/verify_kernel_h200" > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$? at $(( $(date +%s) - T0 )) s"
fi
grep -E "reference failed|Traceback|Error" "$OUT/sweep.log" | head -10
python3 ffi/tools/rows.py < "$OUT/sweep.log" | tail -40
python3 -c "import json; d=json.load(open('$OUT/verify_kernel_h200.json')); print(len(d['rows']), 'rows in the results')"
