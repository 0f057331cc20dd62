#!/usr/bin/env bash
# One device call for the verify kernels: build (sm_90 only, for speed), the GPU tests of the verify op
# (TESTS=0 skips them), the variant A/B (VARIANT_SHAPES), then benchmarks/verify_kernel.py with SWEEP_ARGS until
# BUDGET_S seconds after the start. Results under $OUT. Run from the repository root:
#   KDTREE_COMMIT=<sha> BUDGET_S=540 bash ffi/tools/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
BUDGET_S=${BUDGET_S:-540}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
KDTREE_JAX_CUDA_ARCHS=90 KDTREE_JAX_PTXAS_VERBOSE=1 python3 -m pip install -q --no-build-isolation --no-deps -e . \
  > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
grep -A2 "pipelined_kernel\|stream_kernel\|wide_kernel" "$OUT/build.log" | grep "registers\|spill" | sort | uniq -c | head -20
echo "build done at $(( $(date +%s) - T0 )) s"
if [ "${TESTS:-1}" = "1" ]; then
  timeout "${TESTS_S:-300}" python3 -m pytest -q -x -p no:cacheprovider ${TEST_ARGS:-tests/test_verify_attention_gpu.py} \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -15
  echo "tests done at $(( $(date +%s) - T0 )) s"
fi
if [ -n "${VARIANT_SHAPES:-}" ]; then
  timeout "$(left)" python3 benchmarks/verify_variants.py --shapes "$VARIANT_SHAPES" ${VARIANT_ARGS:-} \
    --variants "${VARIANTS:-pipelined,wide}" --json "$OUT/variants.json"
  echo "variants done at $(( $(date +%s) - T0 )) s"
fi
if [ -n "${SWEEP_ARGS:-}" ] && [ "$(left)" -gt 30 ]; then
  timeout "$(left)" python3 benchmarks/verify_kernel.py $SWEEP_ARGS 2>&1 | tail -60
fi
echo "all done at $(( $(date +%s) - T0 )) s"
