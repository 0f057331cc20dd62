#!/usr/bin/env bash
# One device call for issue 45's server-at-the-loop's-speed A/B: benchmarks/serve_host.py --engine-process on the GPU
# (the decode loop, the in-process scheduler, the HTTP server with its decode thread in the HTTP process, then the
# HTTP server with --engine-process), then, with the time left, budget_sweep.py for issue 42. Results under $OUT,
# also packed in 0_results.tgz (the device returns eight files at most).
#
#   KDTREE_COMMIT=<hash from your checkout> bash benchmarks/gpu_serve_host.sh      # carry: [".device_wheels"]
#
# env: SESSION_S (570), HOST_S (420: serve_host's share), HOST_ARGS (serve_host.py's settings; the stream's prompt, its
#      300 tokens and a verify tree must fit --max-len: 256 does not), SWEEP_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} KDTREE_JAX_CACHE=/tmp/kdtree_jax_cache
# The servers compile what the in-process scheduler compiled before them: one persistent cache for all the processes.
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
# serve_host's own process holds its models and loop while each server runs beside it.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.3}
t_begin=$(date +%s)
SESSION_S=${SESSION_S:-570}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout -k 10 120 python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/serve_site .device_wheels/*.whl > "$OUT/wheels.log" 2>&1 || { tail -20 "$OUT/wheels.log"; exit 1; }
export PYTHONPATH=/tmp/serve_site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "wheels + build: $(( $(date +%s) - t_begin )) s"
t=$(date +%s)
timeout -k 10 "${HOST_S:-420}" python3 benchmarks/serve_host.py --engine-process --dtype bfloat16 --no-cli \
  ${HOST_ARGS:---max-batch 16 --concurrency 16 --requests 256 --max-len 512 --stream-tokens 300} \
  --label gpu --out "$OUT" > "$OUT/serve_host.log" 2>&1
echo "serve_host: rc=$? in $(( $(date +%s) - t )) s"
grep -v '^{' "$OUT/serve_host.log" | tail -14
left=$(( SESSION_S - ($(date +%s) - t_begin) ))
if [ "$left" -gt 60 ]; then
  t=$(date +%s)
  timeout -k 5 "$left" python3 benchmarks/budget_sweep.py --out "$OUT" --deadline-s $(( left - 25 )) \
    ${SWEEP_ARGS:---batch 1,16,64 --temperatures 0,0.7 --budgets 0,8,16 --repeats 5 --contexts 128} > "$OUT/sweep.log" 2>&1
  echo "sweep: rc=$? in $(( $(date +%s) - t )) s"
  grep -E '^\| 128' "$OUT"/budget_sweep_*.md | head -12
fi
ps -eo pid,args | grep "[k]dtree_jax.serve" && echo "warning: server processes still running"
tar -czf "$OUT/0_results.tgz" -C "$OUT" --exclude 0_results.tgz . 2>/dev/null
ls -la "$OUT"
