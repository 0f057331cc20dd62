#!/usr/bin/env bash
# One H200 call for the adaptive budget (issue 42): build for sm_90, then under $OUT
#   adaptive_overhead_h200.*  the adaptive program's step against the fixed programs, per budget (batch 1 / 16 / 64)
#   budget_sweep_h200.*       each fixed budget's tok/s beside auto's and AR's per (batch, temperature, context)
#   spec_decode_h200.*        spec_decode.py with auto in its budgets, static batches and continuous batching (--refill)
#   generate_auto.json        the CLI's first run with --budget auto (calibration included)
#   KDTREE_COMMIT=<hash from your checkout> bash benchmarks/gpu_adaptive.sh   (git on the device copy can name an older
#   commit: this session's runs at 2b798dc-1ee1b64 said f295d9e)
# env: STAGES (default "sweep refill": the rest is a second call's), SESSION_S (default 570), SWEEP_ARGS (default
#      "--budgets 0,8,16,32": the default menu's six entries compile ~2x as long, and 3 timed passes a decoder fit only
#      with four), REFILL_ARGS, OVERHEAD_BATCH / OVERHEAD_MENU / OVERHEAD_ARGS (e.g. "--profile": each row's kernels per
#      step, where a drafting entry's 8-16% over its fixed program at batch 1-16 has to be found, budget_sweep_h100 at
#      c468e17). SKIP_BUILD=1 on a machine where the extension is already built (a warm one after gpu_peers.sh).
#      STAGES=gap: adaptive_gap.py at batch 1 and 16 with --trace (the host's parts of a generate call, the device's
#      idle gaps in its decode). STAGES=autotune (AUTOTUNE_ARGS, AUTOTUNE_S a sweep): two sweeps of the AR-only cells, programs compiled one at a time against 8 at once.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} KDTREE_JAX_CACHE=/tmp/kdtree_jax_cache
t_begin=$(date +%s)
SESSION_S=${SESSION_S:-570}
STAGES=${STAGES:-sweep refill}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${SKIP_BUILD:-0}" = 0 ]; then
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
echo "build: $(( $(date +%s) - t_begin )) s"
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local left=$(( SESSION_S - ($(date +%s) - t_begin) ))
  [ "$left" -lt 20 ] && { echo "$name: skipped (no time left)"; return; }
  [ "$limit" -gt "$left" ] && limit=$left
  local t=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.stdout" 2> "$OUT/$name.log"
  echo "$name: rc=$? in $(( $(date +%s) - t )) s"
  grep -v '^{' "$OUT/$name.log" | tr '\r' '\n' | grep -v 'it/s\]' | tail -8
}
has() { [[ " $STAGES " == *" $1 "* ]]; }
has gap && stage gap 200 python3 benchmarks/adaptive_gap.py --batch 1,16 --rounds 1 --trace --out "$OUT" \
  && grep -v '^ ' "$OUT/gap.stdout" | head -4 && grep -A3 'traced' "$OUT/gap.stdout" | cut -c1-400
has generate && stage generate 120 python3 -m kdtree_jax.generate --prompt "def fibonacci(n):" --max-new-tokens 128
has sweep && stage sweep 400 python3 benchmarks/budget_sweep.py --out "$OUT" --deadline-s 380 ${SWEEP_ARGS:---budgets 0,8,16,32} && head -40 "$OUT"/budget_sweep_*.md
has refill && stage refill 150 python3 benchmarks/spec_decode.py --batch 16 --refill 64 --temperatures 0 \
  --budgets auto,8,16 --prompts 16 --max-new-tokens 96 --out "$OUT" ${REFILL_ARGS:-} && tail -30 "$OUT"/spec_decode_*.md
# The same autoregressive program decoded 15-18% apart in one sweep (budget_sweep_h100_80gb_hbm3 at 1ee1b64: the
# AR decoder's copy, compiled in the parallel precompile, against auto's verdict's, compiled alone): the sweep's
# AR and auto cells with every program compiled one at a time, then 8 at once, each with its own compilation cache.
has autotune && for t in 1 8; do stage "autotune_threads$t" ${AUTOTUNE_S:-300} python3 benchmarks/budget_sweep.py --out "$OUT/threads$t" \
  ${AUTOTUNE_ARGS:---batch 16,64 --temperatures 0,0.7 --budgets 0,8 --repeats 5} --precompile-threads $t \
  --cache-dir "/tmp/jax_cache_threads$t" --deadline-s $(( ${AUTOTUNE_S:-300} - 20 )) && grep '^| 128' "$OUT"/threads$t/budget_sweep_*.md; done
has overhead && stage overhead 120 python3 benchmarks/adaptive_overhead.py --batch ${OVERHEAD_BATCH:-16} \
  --menu ${OVERHEAD_MENU:-0,8,32} --out "$OUT" ${OVERHEAD_ARGS:-} && cat "$OUT"/adaptive_overhead_*.md
# The device returns at most eight files of $OUT, in name order: every result also in one archive named to come first.
tar -czf "$OUT/0_results.tgz" -C "$OUT" --exclude 0_results.tgz . 2>/dev/null
ls -la "$OUT"
