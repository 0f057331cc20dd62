#!/usr/bin/env bash
# One H200 call for the engine-level benchmarks: build the extension for sm_90, then the K2 TP8-rank
# decode step at long context (and, unless SD_LIMIT=0, the default pair's speculative speed). Results under $OUT.
#   KDTREE_COMMIT=<hash from your checkout> bash benchmarks/device_session.sh
# Results name $KDTREE_COMMIT when it is set: pass the commit you run, as the device copy's git metadata
# can be stale. SESSION_S bounds the whole script (build included): decode_context gets what the build
# leaves, minus a margin, as its --deadline-s, and writes the rows it finished.
#   env: SESSION_S (default 360), SD_LIMIT (0: skip spec_decode), DC_SKIP=1 (skip decode_context),
#        PROFILE_SHAPES ("B T H L;..." : Nsight Compute on those verify-kernel shapes first, ffi/tools/ncu_verify.sh),
#        DC_CONTEXTS, DC_NODES, DC_LAYERS (a number or fit), DC_IMPLS (default auto,xla: the kernel and the fair
#        XLA baseline, both its forms; decode_context.py refuses the float32 oracle),
#        DC_MEM_FRACTION (XLA's share of device memory, default 0.92),
#        DC_EXTRA (more arguments), SKIP_BUILD=1 (a CPU dry run: OUT=/tmp/ds SKIP_BUILD=1 DC_EXTRA=--smoke bash ...)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90}
t_begin=$(date +%s)
SESSION_S=${SESSION_S:-360}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${SKIP_BUILD:-0}" = 0 ]; then
  KDTREE_JAX_PTXAS_VERBOSE=1 python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
echo "build: $(( $(date +%s) - t_begin )) s"
if [ -n "${PROFILE_SHAPES:-}" ]; then
  mkdir -p /tmp/profile && IFS=';' read -ra shapes <<< "$PROFILE_SHAPES"
  OUT=/tmp/profile timeout 150 bash ffi/tools/ncu_verify.sh "${shapes[@]}" 2>&1 | tail -70
  tar -czf "$OUT/profile.tgz" -C /tmp/profile .
  echo "profile: done at $(( $(date +%s) - t_begin )) s"
fi
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.stdout" 2> "$OUT/$name.log"
  echo "$name: rc=$? in $(( $(date +%s) - t )) s"
  grep -v '^{' "$OUT/$name.log" | tr '\r' '\n' | grep -v 'it/s\]' | tail -12
}
if [ "${SD_LIMIT:-0}" != 0 ]; then
  stage spec_decode "$SD_LIMIT" python3 benchmarks/spec_decode.py --prompts ${SD_PROMPTS:-4} --max-new-tokens 128 \
    --budgets ${SD_BUDGETS:-8,32,128} --cache-dir /tmp/jax_cache --out "$OUT"
fi
[ "${DC_SKIP:-0}" = 1 ] && { ls -la "$OUT"; exit 0; }
left=$(( SESSION_S - ($(date +%s) - t_begin) ))
# The script stops starting points at its deadline and saves; the stage's hard limit is a little later.
# DC_LAYERS=fit: as many layers as the memory holds; XLA's default 75% pool would waste a quarter of it.
stage decode_context $(( left > 30 ? left : 30 )) env XLA_PYTHON_CLIENT_MEM_FRACTION=${DC_MEM_FRACTION:-0.92} \
  python3 benchmarks/decode_context.py --layers ${DC_LAYERS:-4} --steps 8 \
  --contexts ${DC_CONTEXTS:-4096,16384,65536,131072,200000} --nodes ${DC_NODES:-9,33} --impls ${DC_IMPLS:-auto,xla} \
  --reference-contexts all --deadline-s $(( left > 60 ? left - 25 : 30 )) --out "$OUT/decode_context_h200" ${DC_EXTRA:-}
cat "$OUT/decode_context_h200.md" 2>/dev/null
ls -la "$OUT"
