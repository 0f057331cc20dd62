#!/usr/bin/env bash
# One H200 call for issue 44's peers benchmark: our verify op against FlashMLA and FlashInfer (benchmarks/peers.py).
#   device run: carry [".whl"], command: KDTREE_COMMIT=<the commit you run> bash benchmarks/gpu_peers.sh
# .whl/ holds the peers as wheels (made here by `python benchmarks/peers_wheels.py`: sgl-flash-mla without its SM100
# extension, flashinfer-python with its fa3 MLA module compiled ahead of time, apache-tvm-ffi without its sources; ~11 MiB). Steps, all
# inside SESSION_S seconds (the device's 600 s a command, less a margin):
#   1. the wheels into /tmp/site, as the device README says (a failed install is logged and the peers are then
#      reported unavailable: the grid goes on without them);
#   2. the extension for sm_90 (KDTREE_JAX_CUDA_ARCHS=90, `pip install --no-build-isolation --no-deps -e .`);
#   3. peers.py --out-dir $OUT with --deadline-s = what is left less PEERS_MARGIN_S (no row or XLA baseline starts
#      after it; the rows done are written after each one), under `timeout` a little later;
#   4. the logs (wheels, build, the peers run, nvidia-smi) as $OUT/peers_logs.tgz.
# Results: $OUT/peers_<device>.{md,json} (copy them to benchmarks/results/). To measure what a first call left (rows
# past its deadline, XLA baselines): PEERS_RESUME=benchmarks/results/peers_h200.json (the first call's JSON, in the
# tree so that it travels; the name must stay peers_<device>.json) bash benchmarks/gpu_peers.sh.
# env: SESSION_S (default 570), PEERS_MARGIN_S (default 60), PEERS_ARGS (more peers.py arguments, e.g. "--plan key"
#      or "--xla none"), PEERS_RESUME (an earlier peers JSON to continue: copied to $OUT first, --resume added),
#      SKIP_BUILD=1 (the extension is already built on this machine).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
LOGS=/tmp/peers_logs
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} XLA_PYTHON_CLIENT_PREALLOCATE=false \
  FLASHINFER_DISABLE_JIT=1 FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer \
  TVM_FFI_CACHE_DIR=/tmp/tvm-ffi
t_begin=$(date +%s)
SESSION_S=${SESSION_S:-570}
elapsed() { echo $(( $(date +%s) - t_begin )); }
finish() { tar -czf "$OUT/peers_logs.tgz" -C "$LOGS" . 2>/dev/null; ls -la "$OUT"; }
trap finish EXIT
nvidia-smi > "$LOGS/nvidia-smi.txt" 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
echo "commit ${KDTREE_COMMIT:-unset}; python3 $(python3 -c 'import sys; print(sys.version.split()[0])')"

# 1. The peers' wheels (the device README's wheel paragraph).
if ls .whl/*.whl > /dev/null 2>&1; then
  ls -la .whl > "$LOGS/wheels.log"
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
       >> "$LOGS/wheels.log" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    echo "wheels: installed in $(elapsed) s ($(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' '))"
  else
    echo "wheels: install FAILED (the peers will be reported unavailable):"; tail -5 "$LOGS/wheels.log"
  fi
else
  echo "wheels: no .whl/ carried (make it with python benchmarks/peers_wheels.py; carry [\".whl\"]): peers unavailable"
fi
python3 - > "$LOGS/probe.log" 2>&1 <<'PY'
import importlib.util
for name in ("torch", "jax", "flash_mla", "flashinfer", "tvm_ffi"):
    try:
        spec = importlib.util.find_spec(name)
        print(name, "at", spec.origin if spec else None)
    except Exception as e:  # noqa: BLE001
        print(name, "find_spec failed:", e)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "",
      "dlpack exchange api:", hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
PY
head -12 "$LOGS/probe.log"

# 2. Our extension for sm_90.
if [ "${SKIP_BUILD:-0}" = 0 ]; then
  if ! python3 -m pip install --no-build-isolation --no-deps -e . > "$LOGS/build.log" 2>&1; then
    echo "build FAILED after $(elapsed) s:"; tail -40 "$LOGS/build.log"; exit 1
  fi
fi
echo "build: done at $(elapsed) s"

# 3. The benchmark, with a deadline. peers.py exits 3 when a kernel faulted and broke its CUDA context (the row keeps
# the error): it starts again with --resume, which goes on after what faulted, while time is left.
resume=()
if [ -n "${PEERS_RESUME:-}" ]; then
  cp "$PEERS_RESUME" "$OUT/$(basename "$PEERS_RESUME")" && resume=(--resume)
fi
rc=3
for attempt in 1 2 3 4; do
  left=$(( SESSION_S - $(elapsed) ))
  deadline=$(( left - ${PEERS_MARGIN_S:-60} ))
  if [ "$deadline" -lt 30 ]; then echo "no time left for the benchmark ($left s)"; break; fi
  echo "peers.py (attempt $attempt): deadline ${deadline} s, hard limit $(( left - 5 )) s"
  timeout -k 5 $(( left - 5 )) python3 benchmarks/peers.py --out-dir "$OUT" --deadline-s "$deadline" --traceback "${resume[@]}" \
    ${PEERS_ARGS:-} >> "$LOGS/peers.log" 2>&1
  rc=$?
  echo "peers.py: rc=$rc at $(elapsed) s"
  [ "$rc" = 3 ] || break
  resume=(--resume)
done
cp "$LOGS/peers.log" "$OUT/peers.log"
grep -E "unavailable|failed|faulted|deadline|Traceback|Error" "$LOGS/peers.log" | sed 's/^\[[^]]*\] *//' | cut -c1-240 \
  | sort | uniq -c | sort -rn | head -15
md=$(ls "$OUT"/peers_*.md 2>/dev/null | head -1)
# The table comes back as a file; here the summary and the first rows (the reply keeps the last 12,000 characters).
[ -n "$md" ] && { grep -E "^(Peers|Targets):" "$md"; sed -n '/^| B | H | T | L | ours/,/^$/p' "$md" | head -26
                  sed -n '/^## /,$p' "$md" | head -30; }
exit $rc
