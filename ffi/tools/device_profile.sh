#!/usr/bin/env bash
# One device call that checks a kernel change and profiles it (writes under $OUT, packed so that few files come
# back): build with the resource report, every GPU kernel test, the CPU handler's tests (built against this
# machine's jax), the split-count A/B by CUDA events, the `key` plan with CUDA-event timing, then Nsight Compute
# (ffi/tools/probe_verify.sh) on the given shapes.
#   KDTREE_COMMIT=<hash> bash ffi/tools/device_profile.sh "1 16 8 65536" ...
# CPU_TESTS=0 and SPLITS_AB=0 skip those steps; KEY_VARIANTS="1 2" runs the key plan once per many-row kernel
# (KDTREE_VERIFY_VARIANT; default: the default kernel only), PROFILE_VARIANT picks the one Nsight Compute sees;
# T1_ROWGROUPS_AB=1 times the decode shapes (T = 1) on the 32-row kernels too (KDTREE_VERIFY_ROW_GROUPS=2, each
# variant in KEY_VARIANTS), by CUDA events, against the one-group kernel in the split A/B.
# Exits with the GPU tests' status, so that a caller can fall back to a validated kernel when they fail.
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1
T0=$(date +%s)
W=/tmp/profile_work; mkdir -p "$W"
KDTREE_JAX_PTXAS_VERBOSE=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} \
  python3 -m pip install --no-build-isolation --no-deps -v -e . > "$W/build.log" 2>&1 || { tail -40 "$W/build.log"; cp "$W/build.log" "$OUT/"; exit 1; }
echo "build done at $(( $(date +%s) - T0 )) s"
grep -E "ptxas info.*(Compiling|Used)|spill" "$W/build.log" | grep -A2 -E "verify_attention|merge_splits" | grep -E "Used|spill" | sed 's/ptxas info    : //' | paste - - | cut -c1-110
# TESTS_S: the 75 tests took 160 s (72) + 15 s (the three compute-sanitizer cases) at 2ce109b; 200 s cut the last two.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TESTS_S:-320}" python3 -m pytest -q -n 16 --durations=5 -p no:cacheprovider tests/test_verify_attention_gpu.py > "$W/gpu_tests.log" 2>&1
gpu_rc=$?
echo "gpu tests rc=$gpu_rc at $(( $(date +%s) - T0 )) s"; grep -E "passed|failed|^(FAILED|ERROR)" "$W/gpu_tests.log" | tail -12
if [ "${CPU_TESTS:-1}" = 1 ]; then
  JAX_PLATFORMS=cpu timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_verify_attention_cpu_handler.py tests/test_verify_attention.py > "$W/cpu_handler_tests.log" 2>&1
  echo "cpu handler tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 "$W/cpu_handler_tests.log"
fi
if [ "${SPLITS_AB:-1}" = 1 ]; then
  timeout 90 python3 ffi/tools/splits_ab.py --out "$W/splits_ab" 2>&1 | tee "$W/splits_ab.log"
  echo "splits A/B done at $(( $(date +%s) - T0 )) s"
fi
if [ "${T1_ROWGROUPS_AB:-0}" = 1 ]; then
  for v in ${KEY_VARIANTS:-1}; do
    [ "$v" = default ] && v=1
    echo "T = 1 on the 32-row kernels, variant $v:"
    KDTREE_VERIFY_ROW_GROUPS=2 KDTREE_VERIFY_VARIANT=$v timeout 60 python3 ffi/tools/splits_ab.py --splits 66,132 \
      --out "$W/t1_rowgroups2_v$v" "1 1 8 65536" "1 1 8 200000" "8 1 8 65536" "1 1 8 4096" 2>&1 | tee "$W/t1_rowgroups2_v$v.log"
  done
fi
for v in ${KEY_VARIANTS:-default}; do
  [ "$v" = default ] && tag="" || tag="_v$v"
  ( [ "$v" = default ] || export KDTREE_VERIFY_VARIANT=$v
    echo "key plan, many-row kernel: ${v}"
    timeout 120 python3 benchmarks/verify_kernel.py --plan key --no-ref --device-timing --commit "${KDTREE_COMMIT:-unknown}" --out "$W/verify_kernel_key$tag" 2>&1 | python3 ffi/tools/rows.py )
done
echo "key plan done at $(( $(date +%s) - T0 )) s"
if [ $# -gt 0 ]; then
  ( [ -n "${PROFILE_VARIANT:-}" ] && export KDTREE_VERIFY_VARIANT=$PROFILE_VARIANT
    OUT="$W" SKIP_BUILD=1 timeout "${PROFILE_S:-300}" bash ffi/tools/probe_verify.sh "$@" 2>&1 | tail -150 )
fi
echo "end at $(( $(date +%s) - T0 )) s"
rm -f "$W"/*.ncu-rep.bak
tar -czf "$OUT/profile_work.tgz" -C "$W" . && ls -la "$OUT"
exit $gpu_rc
