#!/usr/bin/env bash
# One H200 call for the engine-level benchmarks: build the extension for sm_90, then the K2 TP8-rank
# decode step at long context and the default pair's speculative speed. Results under $OUT.
#   bash benchmarks/device_session.sh            (each stage has its own time limit; a stage that runs
#                                                 out still leaves the rows it wrote)
# Results name $KDTREE_COMMIT when it is set: pass the commit you run, as the device copy's git metadata
# can be stale (e.g. the run command `KDTREE_COMMIT=<hash from your checkout> bash benchmarks/device_session.sh`).
set -uo pipefail
OUT=${OUT:-/tmp/out}
export PYTHONUNBUFFERED=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.stdout" 2> "$OUT/$name.log"
  echo "$name: rc=$? in $(( $(date +%s) - t )) s"
  grep -v '^{' "$OUT/$name.log" | tr '\r' '\n' | grep -v 'it/s\]' | tail -6
}
stage spec_decode ${SD_LIMIT:-110} python3 benchmarks/spec_decode.py --prompts ${SD_PROMPTS:-4} --max-new-tokens 128 \
  --budgets ${SD_BUDGETS:-8,32,128} --cache-dir /tmp/jax_cache --out "$OUT"
# Longest-first order, so that a stage cut short by its limit still has the 64k and 200k rows.
stage decode_context ${DC_LIMIT:-240} python3 benchmarks/decode_context.py --layers ${DC_LAYERS:-4} --steps 8 \
  --contexts ${DC_CONTEXTS:-65536,4096,200000,16384,131072} --reference-contexts 65536 --out "$OUT/decode_context_h200"
ls -la "$OUT"
