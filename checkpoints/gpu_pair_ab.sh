#!/usr/bin/env bash
# A candidate default pair timed beside the shipped one in one device call (issue 47: a drafter ships when decoding
# gets faster, not only tau), run from the repository root with the candidate carried:
#   KDTREE_COMMIT=<hash> CANDIDATE=.candidates/drafter_v3_517d095 bash checkpoints/gpu_pair_ab.sh   (run's carry: .candidates)
# CANDIDATE: a directory with a drafter piece (drafter/) and its pair's kdtree_checkpoint.json, whose target is
# checkpoints/default's stored as that metadata says (plain, or int8: re-stored here; the rounding is deterministic,
# so this is the very target the drafter was distilled from). A 19 MB pair does not travel beside the shipped 27.9 MB
# one (the tree's 64 MiB); its drafter does.
# Then benchmarks/spec_decode.py on each pair, ROUNDS rounds alternating the pairs (shipped first in odd rounds):
# batches BATCHES, budgets 0 (AR) and BUDGETS, greedy and T = 0.7 (top-p 0.95), 16 held-out prompts x 96 tokens.
# Writes under $OUT: ab.md (tok/s, speed-up over AR and tau per pair, round and cell), each run's spec_decode JSON,
# ab.log; all in 0_results.tgz. Knobs: ROUNDS (2), BATCHES (1,16), BUDGETS (8,16), TEMPERATURES (0,0.7), SKIP_BUILD,
# DEADLINE_S (540), RUN_COST_S (150: an estimate, not yet measured on a GPU).
# CPU dry run: SKIP_BUILD=1 ROUNDS=1 BATCHES=1 BUDGETS=4 TEMPERATURES=0 PROMPTS=2 MAX_NEW=8.
set -uo pipefail
source checkpoints/device_common.sh /tmp/pair_ab ab.log
CANDIDATE=${CANDIDATE:?CANDIDATE: a directory with drafter/ and kdtree_checkpoint.json}
echo "commit ${KDTREE_COMMIT:-unknown}; candidate $CANDIDATE"
build_extension
python3 - "$CANDIDATE" "$WORK/candidate" <<'EOF' || exit 1
import json, os, shutil, sys
from kdtree_jax.checkpoint import METADATA_FILE, load_checkpoint, read_metadata, save_checkpoint
src, dst = sys.argv[1:]
meta = json.load(open(os.path.join(src, METADATA_FILE)))
weights = (meta["target"].get("weights") or {}).get("kind", "plain")
target, _, _ = load_checkpoint("checkpoints/default")
save_checkpoint(dst, target, None, "checkpoints/default/tokenizer", weights=weights)
shutil.copytree(os.path.join(src, "drafter"), os.path.join(dst, "drafter"))
for f in ("generation_config.json",):
    shutil.copy(os.path.join("checkpoints/default", f), dst)
json.dump(meta, open(os.path.join(dst, METADATA_FILE), "w"), indent=2)
t, d, _ = load_checkpoint(dst)  # the assembled pair reads back
print(f"candidate pair in {dst}: target {weights}, drafter {d.cfg.num_layers} layers")
EOF
for round in $(seq 1 "${ROUNDS:-2}"); do
  order="shipped candidate"; [ $(( round % 2 )) = 0 ] && order="candidate shipped"
  for pair in $order; do
    ckpt=checkpoints/default; [ "$pair" = candidate ] && ckpt="$WORK/candidate"
    # A run that would end past DEADLINE_S is skipped and said so (RUN_COST_S: what a first run is expected to take;
    # the later rounds read their programs back from the shared compilation cache).
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
tar -czf "$OUT/0_results.tgz" -C "$OUT" --exclude 0_results.tgz . 2>/dev/null
echo "done at $(since) s"
