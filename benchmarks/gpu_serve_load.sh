#!/usr/bin/env bash
# One device call for issue 27's GPU load test: the OpenAI-compatible server (kdtree_jax/serve) and
# benchmarks/serve_load.py's client on the device machine's loopback, speculative vs autoregressive, the default
# pair in bfloat16; then the leak check (1,000 requests, 10% of them disconnecting mid-stream); then, the servers
# stopped, the loop baseline (issue 45 item 3): the same requests through the engine's own decode loop in a subprocess
# (continuous batching at MAX_BATCH rows, and the first LOOP_STREAM_REQUESTS alone through engine.generate, as the
# CLI), each mode's server against it in the report's last table. Results under $OUT: serve_load_<device>.{json,md,png}
# (serve_load_h200.* on an H200) and logs.tgz (wheel install, build, servers, the loop baseline).
#
#   KDTREE_COMMIT=<hash from your checkout, not git on the device copy> bash benchmarks/gpu_serve_load.sh      # carry: [".device_wheels"]
#
# The device image has no fastapi/uvicorn/pydantic/jinja2: they travel as cp312 wheels in the gitignored .device_wheels/
# (fetch them here with `bash benchmarks/gpu_serve_load.sh --fetch-wheels`) and are installed into /tmp/serve_site.
# Results name $KDTREE_COMMIT when it is set: pass the commit you run (the device copy's git metadata can be stale).
#
# Bounded: SESSION_S (default 450) is the whole script's budget. Each phase has its own `timeout`: the wheel
# install 120 s, the build 240 s; the load test gets SIGTERM when what is left less 20 s has passed and SIGKILL 15 s
# later (`timeout` signals its whole process group, the servers included). Before that, serve_load.py's
# --deadline-s (30 s before the SIGTERM) stops it starting levels (LEAK_RESERVE_S + LOOP_RESERVE_S earlier, kept for
# the leak check and the loop baseline) and leak requests (LOOP_RESERVE_S earlier); the loop baseline is skipped with
# less than half of LOOP_RESERVE_S left and stopped at the deadline; on the deadline or SIGTERM it writes the rows
# measured so far and stops the servers (SIGTERM: they drain for 5 s; SIGKILL after 20 s).
#
# env: SESSION_S (450), REQUESTS (128 per level), CONCURRENCY ("16,1,4,64": measured in this order, the target level
#      first), MAX_BATCH (16), MAX_LEN (256), DTYPE (bfloat16), LEAK_REQUESTS (1000; 0: none), DISCONNECT (0.1),
#      LEAK_CONCURRENCY (32), LEAK_RESERVE_S (60), LOOP_RESERVE_S (150; the loop baseline's load, compiles, cost-model
#      calibration and runs), LOOP_STREAM_REQUESTS (4: each compiles generate's loop for its max_tokens),
#      REQUEST_TIMEOUT (60 s), START_TIMEOUT (180 s),
#      MEM_FRACTION (0.4: XLA's share of GPU memory for each of the two servers; the client takes none),
#      SL_EXTRA (more serve_load.py arguments; --no-loop-baseline skips the loop baseline),
#      SKIP_WHEELS=1 (the packages are importable already), SKIP_BUILD=1 (no extension build): a CPU dry run is
#        OUT=/tmp/gsl SKIP_WHEELS=1 SKIP_BUILD=1 DTYPE=auto REQUESTS=8 CONCURRENCY=2,1 LEAK_REQUESTS=20 \
#        LEAK_CONCURRENCY=4 MAX_BATCH=4 LOOP_STREAM_REQUESTS=2 LOOP_RESERVE_S=300 SESSION_S=800 \
#        bash benchmarks/gpu_serve_load.sh
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=.device_wheels
if [ "${1:-}" = --fetch-wheels ]; then  # here (a machine with pip and a registry): the cp312 wheels the device lacks
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing_extensions==4.16.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 uvicorn==0.54.0 \
    jinja2==3.1.6 markupsafe==3.0.4
  exit $?
fi
OUT=${OUT:-/tmp/out}
LOGS=${LOGS:-/tmp/gpu_serve_load_logs}
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90}
t_begin=$(date +%s)
SESSION_S=${SESSION_S:-450}
elapsed() { echo $(( $(date +%s) - t_begin )); }
pack_logs() { tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; }
[ -n "${KDTREE_COMMIT:-}" ] || echo "warning: KDTREE_COMMIT is not set: the results name the copy's git HEAD"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
python3 --version

# 1. fastapi, uvicorn, pydantic (+ pydantic_core's compiled module for this Python) from the carried wheels.
if [ "${SKIP_WHEELS:-0}" = 0 ]; then
  ls "$WHEELS"/*.whl > /dev/null 2>&1 || { echo "error: no $WHEELS/*.whl here: name $WHEELS in the call's carry"; exit 1; }
  timeout -k 10 120 python3 -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/serve_site "$WHEELS"/*.whl > "$LOGS/wheels.log" 2>&1 \
    || { tail -20 "$LOGS/wheels.log"; pack_logs; exit 1; }
  export PYTHONPATH=/tmp/serve_site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import fastapi, uvicorn, pydantic, pydantic_core, httpx, matplotlib, jax
print('packages: fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'pydantic', pydantic.VERSION,
      'pydantic_core', pydantic_core.__version__, 'httpx', httpx.__version__, 'jax', jax.__version__)" \
  || { echo "error: the server's packages do not import"; pack_logs; exit 1; }
echo "wheels: $(elapsed) s"

# 2. The extension (the verify-attention kernel for sm_90).
if [ "${SKIP_BUILD:-0}" = 0 ]; then
  timeout -k 10 240 python3 -m pip install -q --no-build-isolation --no-deps -e . > "$LOGS/build.log" 2>&1 \
    || { tail -40 "$LOGS/build.log"; pack_logs; exit 1; }
fi
echo "build: $(elapsed) s"

# 3. The load test: serve_load.py starts both servers on free loopback ports, waits for /health, warms them up,
#    measures each level, runs the leak check, writes the results and stops the servers.
left=$(( SESSION_S - $(elapsed) ))
if [ "$left" -lt 90 ]; then echo "error: only $left s left for the load test"; pack_logs; exit 1; fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.4}
t=$(date +%s)
timeout -k 15 $(( left - 20 )) python3 benchmarks/serve_load.py --dtype "${DTYPE:-bfloat16}" \
  --max-batch "${MAX_BATCH:-16}" --max-len "${MAX_LEN:-256}" --requests "${REQUESTS:-128}" \
  --concurrency "${CONCURRENCY:-16,1,4,64}" --leak-requests "${LEAK_REQUESTS:-1000}" \
  --disconnect-fraction "${DISCONNECT:-0.1}" --leak-concurrency "${LEAK_CONCURRENCY:-32}" \
  --request-timeout "${REQUEST_TIMEOUT:-60}" --start-timeout "${START_TIMEOUT:-180}" \
  --deadline-s $(( left - 50 )) --leak-reserve-s "${LEAK_RESERVE_S:-60}" --loop-reserve-s "${LOOP_RESERVE_S:-150}" \
  --loop-stream-requests "${LOOP_STREAM_REQUESTS:-4}" --out "$OUT" --log-dir "$LOGS" \
  ${SL_EXTRA:-} 2>&1 | tee "$LOGS/serve_load.log"
rc=${PIPESTATUS[0]}
echo "serve_load: rc=$rc in $(( $(date +%s) - t )) s (total $(elapsed) s)"
for f in "$LOGS"/serve_load_*_server.log; do
  [ -f "$f" ] && { echo "--- $(basename "$f") (last lines)"; tail -4 "$f"; }
done
# Any server still running is a failure to stop cleanly: name it (this script ends nothing it did not start).
left_over=$(ps -eo pid,args | grep "[k]dtree_jax.serve" || true)
[ -n "$left_over" ] && echo "warning: server processes still running: $left_over" || echo "servers: all stopped"
cat "$OUT"/serve_load_*.md 2>/dev/null
pack_logs
ls -la "$OUT"
exit "$rc"
