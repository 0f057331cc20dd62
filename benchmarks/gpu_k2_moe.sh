#!/usr/bin/env bash
# The K2 TP8-rank step's MoE in one device call (issue 46), run from the repository root:
#   KDTREE_COMMIT=<hash> bash benchmarks/gpu_k2_moe.sh
# 1. the extension for sm_90; 2. the MoE ops' GPU tests (the pairs op with and without the shared expert, the
# router's op, compute-sanitizer memcheck on all three); 3. benchmarks/moe_experts.py --shared: one MoE layer of the rank (384
# experts x 7168 x 256), the shared expert apart (XLA products; the pairs op's down kernel at both unrolls) against
# folded into the pairs op, T = 1, 4, 9;
# 4. benchmarks/decode_context.py at 64k, T = NODES, as many layers as fit: the router's choice and the shared
# expert as XLA ops (--moe xla, the model before them), then in their CUDA kernels (--moe fused), with the fair XLA
# attention baseline after the kernel's rows: before and after in one call, each step profiled (parts, kernels a step).
# Writes under $OUT: k2_moe.log, tests.log, moe_shared_fold.{md,json}, decode_context_{xla,fused}.{md,json}, all
# in 0_results.tgz. Knobs: NODES (1,9,33), DC_LAYERS (fit), DEADLINE_S (575), BEFORE_S (190: the first arm's share),
# TESTS_S (300), SKIP_BUILD, SKIP_TESTS. CPU dry run: SKIP_BUILD=1 SKIP_TESTS=1 DC_EXTRA=--smoke bash benchmarks/gpu_k2_moe.sh
set -uo pipefail
source checkpoints/device_common.sh /tmp/k2_moe k2_moe.log
echo "commit ${KDTREE_COMMIT:-unknown}"
build_extension
if [ "${SKIP_TESTS:-0}" = 0 ]; then
  # 4d9fce1's call ran out of these 200 s after 36 tests, where 57 had taken 66 s the call before and the rest took
  # 29 + 9 s in a follow-up on the same machine: the durations say which test to look at next time.
  timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider --durations=8 tests/test_moe_experts_gpu.py \
    tests/test_route_gpu.py -k "pairs or shared or memcheck or route or router" > "$OUT/tests.log" 2>&1
  echo "tests: rc=$? at $(since) s"; tail -4 "$OUT/tests.log"
fi
timeout 120 python3 benchmarks/moe_experts.py --geometry k2 --layouts tp --devices 8 --tokens-k2 1,4,9 \
  --impls pairs_du1,pairs_du2,pairs_shared --shared ${DC_EXTRA:+--smoke} --out "$OUT" --name moe_shared_fold > "$OUT/moe.log" 2>&1
echo "moe_experts: rc=$? at $(since) s"; tail -6 "$OUT/moe_shared_fold.md" 2>/dev/null
nodes=${NODES:-1,9,33}
decode_context_arm xla "${BEFORE_S:-190}" --nodes "$nodes" --moe xla --impls auto
left=$(( ${DEADLINE_S:-575} - $(since) - 30 ))
decode_context_arm fused $(( left > 60 ? left : 60 )) --nodes "$nodes" --moe fused --impls auto,xla
for arm in xla fused; do grep -A5 'kernels |$' "$OUT/decode_context_$arm.md" 2>/dev/null; done
tar -czf "$OUT/0_results.tgz" -C "$OUT" --exclude 0_results.tgz . 2>/dev/null
echo "done at $(since) s"
