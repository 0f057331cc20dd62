#!/usr/bin/env bash
# One device call (writes under $OUT): build with the resource report, the GPU tests (parallel), a timing plan
# with plain launches and a few rows with command buffers, then Nsight Compute on two shapes.
#   bash ffi/tools/device_run.sh [PLAN=key] [NCU_SHAPES...]
set -uo pipefail
PLAN=${1:-key}; shift || true
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
t0=$(date +%s)
KDTREE_JAX_PTXAS_VERBOSE=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} \
  python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
grep -E "ptxas info.*(Compiling|Used)|spill" "$OUT/build.log" | grep -A2 -E "verify_attention(_wide)?_kernel|merge_splits" | grep -E "Used|spill" | sed 's/ptxas info    : //' | paste - - | cut -c1-120
t0=$(date +%s)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_verify_attention_gpu.py > "$OUT/gpu_tests.log" 2>&1
tail -4 "$OUT/gpu_tests.log"; echo "tests: $(( $(date +%s) - t0 )) s"
if ! grep -q " passed" "$OUT/gpu_tests.log" || grep -qE "[0-9]+ (failed|error)" "$OUT/gpu_tests.log"; then
  grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/gpu_tests.log" | head -20; echo "GPU TESTS FAILED"
fi
t0=$(date +%s)
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/verify_kernel.py --plan "$PLAN" --no-ref --commit "${KDTREE_COMMIT:-unknown}" --out "$OUT/verify_kernel_h200" 2>&1 | grep -E "^\| [0-9]|copy_gbps|Traceback|Error"
echo "bench: $(( $(date +%s) - t0 )) s"
timeout 120 python3 benchmarks/verify_kernel.py --plan mini --command-buffers --commit "${KDTREE_COMMIT:-unknown}" --out "$OUT/verify_kernel_h200_cb" 2>&1 | grep -E "^\| [0-9]|Traceback|Error"
if [ $# -gt 0 ]; then SKIP_BUILD=1 bash ffi/tools/probe_verify.sh "$@" 2>&1 | grep -v "^total\|^d\|^-"; fi
