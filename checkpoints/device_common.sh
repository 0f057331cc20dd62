# What the device scripts of this folder share; sourced from the repository root, after `set -uo pipefail`:
#   source checkpoints/device_common.sh WORK_DEFAULT LOG_NAME
# $OUT (the device's result folder, /tmp/out elsewhere), a fresh $WORK (WORK_DEFAULT unless set), everything printed
# also kept in $OUT/LOG_NAME, T0 and since (seconds since the start), and build_extension (the editable install for
# sm_90 in the foreground, its log in $OUT/build.log; SKIP_BUILD=1 skips it), pair_ab (two pairs timed side by side)
# and decode_context_arm (one arm of a K2-step A/B).
OUT=${OUT:-/tmp/out}
WORK=${WORK:-$1}
T0=$(date +%s)
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$OUT/$2") 2>&1
export PYTHONUNBUFFERED=1 KDTREE_JAX_CUDA_ARCHS=${KDTREE_JAX_CUDA_ARCHS:-90} TOKENIZERS_PARALLELISM=false
since() { echo $(( $(date +%s) - T0 )); }
build_extension() {
  [ "${SKIP_BUILD:-0}" = 1 ] && return 0
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  echo "build: $(since) s"
}
# pair_ab SHIPPED CANDIDATE: benchmarks/spec_decode.py on each pair, ROUNDS rounds alternating them (the shipped pair
# first in odd rounds): batches BATCHES, budgets 0 (AR) and BUDGETS, TEMPERATURES (greedy and T = 0.7, top-p 0.95),
# PROMPTS held-out prompts x MAX_NEW tokens. A run that would end past DEADLINE_S is skipped and said so (RUN_COST_S:
# what a first run is expected to take; later runs read their programs back from the shared compilation cache).
# Writes $OUT/spec_decode_{shipped,candidate}_round<r>.json and $OUT/ab.md (tok/s, speed-up over AR and tau per pair,
# round and cell).
pair_ab() {
  local shipped=$1 candidate=$2 round pair order ckpt left
  for round in $(seq 1 "${ROUNDS:-2}"); do
    order="shipped candidate"; [ $(( round % 2 )) = 0 ] && order="candidate shipped"
    for pair in $order; do
      ckpt=$shipped; [ "$pair" = candidate ] && ckpt=$candidate
      left=$(( ${DEADLINE_S:-540} - $(since) ))
      if [ "$left" -lt "${RUN_COST_S:-150}" ]; then echo "$pair round $round: skipped ($left s left)"; continue; fi
      mkdir -p "$WORK/$pair$round"
      timeout "$left" python3 benchmarks/spec_decode.py --checkpoint "$ckpt" --batch "${BATCHES:-1,16}" \
        --budgets "${BUDGETS:-8,16}" --temperatures "${TEMPERATURES:-0,0.7}" --top-p 0.95 --no-chain \
        --prompts "${PROMPTS:-16}" --max-new-tokens "${MAX_NEW:-96}" --cache-dir "$WORK/jax_cache" \
        --out "$WORK/$pair$round" > "$WORK/$pair$round.log" 2>&1
      echo "$pair round $round: rc=$? at $(since) s"
      cp "$WORK/$pair$round"/spec_decode_*.json "$OUT/spec_decode_${pair}_round$round.json" 2>/dev/null
    done
  done
  python3 - "$OUT" <<'EOF'
import glob, json, os, re, sys
out = sys.argv[1]
rows = ["| pair | round | batch | T | decoder | tok/s | x AR | tau |", "|---|---|---|---|---|---|---|---|"]
for path in sorted(glob.glob(os.path.join(out, "spec_decode_*_round*.json"))):
    pair, rnd = re.match(r".*spec_decode_(\w+?)_round(\d+)\.json", path).groups()
    for r in json.load(open(path))["rows"]:
        rows.append(f"| {pair} | {rnd} | {r['batch']} | {r['temperature']:g} | {r['decoder']} | "
                    f"{r['tokens_per_second']:,.0f} | {r['speedup_vs_ar']:.2f} | {r['tau']:.2f} |")
open(os.path.join(out, "ab.md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
}

# decode_context_arm NAME SECONDS ARGS...: one benchmarks/decode_context.py process (the K2 TP8 rank, DC_LAYERS layers
# (fit), 64k context, 8 steps, 4 engine chunks; ARGS: its nodes and the arm's own flags), stopped from starting points
# SECONDS from now; writes $OUT/decode_context_NAME.{md,json} and $OUT/dc_NAME.log (DC_EXTRA: more arguments).
decode_context_arm() {
  local name=$1 limit=$2
  shift 2
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout $(( limit + 30 )) python3 benchmarks/decode_context.py \
    --layers "${DC_LAYERS:-fit}" --contexts 65536 --steps 8 --engine-chunks 4 --deadline-s "$limit" \
    --out "$OUT/decode_context_$name" ${DC_EXTRA:-} "$@" > "$OUT/dc_$name.log" 2>&1
  echo "decode_context $name: rc=$? at $(since) s"
}
