#!/usr/bin/env bash
# A candidate default pair timed beside the shipped one in one device call (issue 47: a drafter ships when decoding
# gets faster, not only tau), run from the repository root with the candidate carried:
#   KDTREE_COMMIT=<hash> CANDIDATE=.candidates/drafter_v3_517d095 bash checkpoints/gpu_pair_ab.sh   (run's carry: .candidates)
# CANDIDATE: a directory with a drafter piece (drafter/) and its pair's kdtree_checkpoint.json, whose target is
# checkpoints/default's stored as that metadata says (plain, or int8: re-stored here; the rounding is deterministic,
# so this is the very target the drafter was distilled from). A 19 MB pair does not travel beside the shipped 27.9 MB
# one (the tree's 64 MiB); its drafter does.
# Then benchmarks/spec_decode.py on each pair, ROUNDS rounds alternating the pairs (device_common.sh's pair_ab:
# batches BATCHES, budgets 0 (AR) and BUDGETS, greedy and T = 0.7 (top-p 0.95), 16 held-out prompts x 96 tokens).
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
pair_ab checkpoints/default "$WORK/candidate"
tar -czf "$OUT/0_results.tgz" -C "$OUT" --exclude 0_results.tgz . 2>/dev/null
echo "done at $(since) s"
