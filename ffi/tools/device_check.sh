#!/usr/bin/env bash
# One device call: build (with the compiler's resource report), SASS summary, GPU tests, benchmark.
#   bash ffi/tools/device_check.sh [budget|full|quick|tests]      (writes under $OUT)
set -uo pipefail
PLAN=${1:-budget}
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 KDTREE_JAX_PTXAS_VERBOSE=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90-real}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
grep -E "ptxas info.*(Compiling|Used)|spill" "$OUT/build.log" | sed 's/_ZN[0-9A-Za-z_]*verify_attention_cu_[0-9a-f]*//' > "$OUT/ptxas.txt"
SO=$(ls build/*/_verify_attention_ext*.so | head -1)
cuobjdump --dump-sass "$SO" > /tmp/sass.txt 2>&1
python3 - <<'PY' > "$OUT/sass_summary.txt"
import re
text = open('/tmp/sass.txt').read()
for fn in re.split(r'\n\s*Function : ', text)[1:]:
    name = fn.split('\n', 1)[0]
    if 'verify' not in name and 'merge' not in name: continue
    ops = re.findall(r'/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)', fn)
    count = lambda p: sum(1 for o in ops if o.startswith(p))
    print(name[-45:], 'instrs', len(ops), {p: count(p) for p in ['HMMA', 'LDSM', 'LDGSTS', 'LDG', 'STG', 'LDS', 'STS', 'LDL', 'STL', 'MUFU.EX2', 'BAR']})
PY
cat "$OUT/ptxas.txt" "$OUT/sass_summary.txt"
timeout 200 python3 -m pytest -x -q -p no:cacheprovider tests/test_verify_attention_gpu.py 2>&1 | tail -15 > "$OUT/gpu_tests.log"
cat "$OUT/gpu_tests.log"
if ! grep -q " passed" "$OUT/gpu_tests.log" || grep -qE "failed|error" "$OUT/gpu_tests.log"; then
  echo "GPU TESTS FAILED: benchmarking the one-row-group kernel (validated earlier) instead"
  export KDTREE_VERIFY_ROW_GROUPS=1
fi
[ "$PLAN" = tests ] && exit 0
# the key plan (one minute) is the fast A/B check; budget/quick/full are the sweeps of the results file
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/verify_kernel.py --plan "$PLAN" --commit "${KDTREE_COMMIT:-unknown}" --out "$OUT/verify_kernel_h200" 2>&1 | grep -v "^{" | tail -70
