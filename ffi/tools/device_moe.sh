#!/usr/bin/env bash
# One device call that checks an MoE-op change (writes under $OUT, packed): build, the MoE and verify-kernel GPU
# tests, compute-sanitizer on the MoE table tests, the TP8-rank routed-MoE benchmark, Nsight Compute on one
# routed_experts call per T, and a 2-layer decode_context with the step profile (a check that the profiler
# path works on this machine before a long run).
#   KDTREE_COMMIT=<hash> bash ffi/tools/device_moe.sh
# env: VERIFY_TESTS=0 skips the verify-kernel tests; MOE_TOKENS (default "9 33").
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
T0=$(date +%s)
W=/tmp/moe_work; mkdir -p "$W"
stamp() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
KDTREE_JAX_PTXAS_VERBOSE=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} \
  python3 -m pip install --no-build-isolation --no-deps -v -e . > "$W/build.log" 2>&1 || { tail -40 "$W/build.log"; cp "$W/build.log" "$OUT/"; exit 1; }
stamp "build done"
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_moe_experts_gpu.py tests/test_moe_experts.py > "$W/moe_tests.log" 2>&1
moe_rc=$?
stamp "moe tests rc=$moe_rc"; grep -E "passed|failed|^(FAILED|ERROR)" "$W/moe_tests.log" | tail -8
timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_moe_experts_gpu.py -k "table_kernel or while_loop" > "$W/moe_memcheck.log" 2>&1
stamp "moe memcheck rc=$?"; grep -E "ERROR SUMMARY|passed|failed" "$W/moe_memcheck.log" | tail -3
verify_rc=0
if [ "${VERIFY_TESTS:-1}" = 1 ]; then
  timeout 260 python3 -m pytest -q -n 16 -p no:cacheprovider tests/test_verify_attention_gpu.py > "$W/verify_tests.log" 2>&1
  verify_rc=$?
  stamp "verify tests rc=$verify_rc"; grep -E "passed|failed|^(FAILED|ERROR)" "$W/verify_tests.log" | tail -8
fi
timeout 120 python3 benchmarks/moe_experts.py --devices 8 --layouts tp --tokens 9,33 --out "$W" \
  --name "moe_experts_tp8_h200_${KDTREE_COMMIT:-unknown}" > "$W/moe_bench.log" 2>&1
stamp "moe benchmark rc=$?"; grep "^| tp" "$W"/moe_experts_tp8_h200_*.md
timeout 90 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
  python3 ffi/tools/probe_moe.py ${MOE_TOKENS:-9 33} > "$W/moe_ncu.txt" 2>&1
stamp "moe ncu rc=$?"
grep -E "^T=|^  [^ ].*\(|gpu__time_duration" "$W/moe_ncu.txt" | paste - - | sed -E 's/ +\(([0-9, ]+)\)x\(([0-9, ]+)\).*gpu__time_duration.sum +[a-z]+ +/ \1 | /' | cut -c1-110 | head -60
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 timeout 150 python3 benchmarks/decode_context.py --layers 2 --contexts 4096 \
  --nodes 9 --impls auto --steps 4 --out "$W/decode_context_2layers_profile" > "$W/dc2.log" 2>&1
stamp "decode_context 2 layers rc=$?"; grep -v '^{' "$W/dc2.log" | tail -4; grep -E "^\| 4096" "$W/decode_context_2layers_profile.md"
tar -czf "$OUT/moe_work.tgz" -C "$W" . && ls -la "$OUT"
exit $(( moe_rc | verify_rc ))
