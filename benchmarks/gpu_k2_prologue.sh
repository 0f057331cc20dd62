#!/usr/bin/env bash
# The K2 TP8-rank step's MLA prologue in one device call (issue 46 item 2), run from the repository root:
#   KDTREE_COMMIT=<hash> bash benchmarks/gpu_k2_prologue.sh
# 1. the extension for sm_90; 2. the prologue op's GPU tests (float64, the XLA formulation, rows alone vs together,
# MLA's lowering, a mesh, compute-sanitizer memcheck / racecheck / synccheck); 3. benchmarks/decode_context.py at 64k,
# T = NODES, as many layers as fit: the prologue as XLA ops (--prologue xla, the model before it), then as the CUDA
# op (--prologue cuda): before and after in one call, each step profiled (parts, kernels a step).
# Writes under $OUT: k2_prologue.log, tests.log, decode_context_{xla,cuda}.{md,json}, all in 0_results.tgz.
# Knobs: NODES (1,9: the op applies to at most 16 rows), DC_LAYERS (fit), DEADLINE_S (575), BEFORE_S (200: the first
# arm's share), TESTS_S (200), SKIP_BUILD, SKIP_TESTS. CPU dry run: SKIP_BUILD=1 SKIP_TESTS=1 DC_EXTRA=--smoke bash ...
set -uo pipefail
source checkpoints/device_common.sh /tmp/k2_prologue k2_prologue.log
echo "commit ${KDTREE_COMMIT:-unknown}"
build_extension
if [ "${SKIP_TESTS:-0}" = 0 ]; then
  timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_mla_prologue_gpu.py \
    > "$OUT/tests.log" 2>&1
  echo "tests: rc=$? at $(since) s"; tail -4 "$OUT/tests.log"
fi
nodes=${NODES:-1,9}
decode_context_arm xla "${BEFORE_S:-200}" --nodes "$nodes" --prologue xla --impls auto
left=$(( ${DEADLINE_S:-575} - $(since) - 30 ))
decode_context_arm cuda $(( left > 60 ? left : 60 )) --nodes "$nodes" --prologue cuda --impls auto
for arm in xla cuda; do grep -A5 'kernels |$' "$OUT/decode_context_$arm.md" 2>/dev/null; done
tar -czf "$OUT/0_results.tgz" -C "$OUT" --exclude 0_results.tgz . 2>/dev/null
echo "done at $(since) s"
