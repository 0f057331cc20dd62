#!/usr/bin/env bash
# Issue 47's drafter ablation, one device call of <= 9.5 minutes, run from the repository root:
#   KDTREE_COMMIT=<hash> bash checkpoints/gpu_drafter_ablation.sh
# Each arm distils a drafter from the shipped v2 target (checkpoints/default's) with v2's recipe (KL to the target's
# distribution + 0.5 x its argmax cross-entropy, over real windows and the target's own continuations at T 0 / 0.7 /
# 1.0) and its own capacity options (kdtree_jax.train drafter --drafter-layers, --drafter-intermediate,
# --drafter-heads, --target-layer-ids, --block-size), every arm for the same ARM_S seconds of training; then
# benchmarks/default_pair.py measures each arm's tau and acceptance at DDTree 16 (greedy and T = 0.7, top-p 0.95)
# on the same held-out prompts, the shipped drafter first as the reference. The arms' equal budget makes them
# comparable with each other, not with the shipped drafter's longer run (checkpoints/README.md).
# Writes under $OUT: ablation.md (one row per arm: parameters, training steps, teacher-forced chain run, tau greedy /
# T = 0.7), arm_<name>.log / default_pair_<name>.{json,md} / drafter_summary_<name>.json, all in 0_results.tgz.
# Nothing in the repository changes; the trained drafters stay in $WORK on the device.
# An arm should cost ~3.5 minutes on an H200 (an estimate, not yet measured: its continuations ~20 s, its compile ~50 s,
# ARM_S of training, its tau ~40 s), so a call holds
# two; the other capacity arms in a second call:
#   ARMS="wide=--drafter-intermediate,1536 context5=--target-layer-ids,all" (the v2 arm of the first is the reference;
#   an arm that would end past DEADLINE_S is skipped and said so).
# Knobs: ARMS (space-separated name=options; options use commas for spaces: "layers5=--drafter-layers,5"),
#        ARM_S (seconds of training an arm, 90), DEADLINE_S (540), ARM_COST_S (what an arm is expected to take, 210),
#        GEN_SEQUENCES (2048), DRAFTER_BATCH (32), EVAL_PROMPTS (16), EVAL_MAX_NEW (128), SKIP_BUILD, PACK,
#        TARGET (a pair directory whose target the arms distil from),
#        EXTRA_DRAFTER_ARGS (appended to every arm's; a CPU dry run of the plumbing: ARM_S=5 GEN_SEQUENCES=4
#        DRAFTER_BATCH=2 EVAL_PROMPTS=1 EVAL_MAX_NEW=8 DEADLINE_S=9999 SKIP_BUILD=1 EXTRA_DRAFTER_ARGS="--seq-len 64 --gen-batch 2 --anchors 2
#        --eval-sequences 2" ARMS="v2= small=--drafter-intermediate,256").
set -uo pipefail
source checkpoints/device_common.sh /tmp/drafter_ablation ablation.log
PACK=${PACK:-checkpoints/corpus_v2.jsonl.xz}
TARGET=${TARGET:-checkpoints/default}
ARMS=${ARMS:-"v2= layers5=--drafter-layers,5"}
echo "commit ${KDTREE_COMMIT:-unknown}; jax $(python3 -c 'import jax; print(jax.__version__)'); arms: $ARMS"
build_extension
evaluate() {  # evaluate NAME PAIR_DIR: tau at DDTree 16, greedy and T = 0.7, on the held-out prompts
  timeout 150 python3 benchmarks/default_pair.py --checkpoint "$2" --corpus "$PACK" --prompts "${EVAL_PROMPTS:-16}" \
    --max-new-tokens "${EVAL_MAX_NEW:-128}" --budgets 16 --no-chain --latency-prompts 0 --skip-loss --compare-budget 0 \
    --temperatures 0,0.7 --top-p 0.95 --samples 0 --h200-results "" --out "$OUT/default_pair_$1" > "$OUT/eval_$1.log" 2>&1
  echo "eval $1: rc=$? at $(since) s"
}
evaluate shipped "$TARGET"
for arm in $ARMS; do
  name=${arm%%=*}; opts=${arm#*=}; opts=${opts//,/ }
  if [ $(( $(since) + ${ARM_COST_S:-210} )) -gt "${DEADLINE_S:-540}" ]; then echo "arm $name: skipped (no time left)"; continue; fi
  python3 -m kdtree_jax.train drafter --target "$TARGET" --out "$WORK/$name" --corpus "$PACK" \
    --token-cache "$WORK/tokens" --batch "${DRAFTER_BATCH:-32}" --anchors 16 --lr 2e-3 \
    --greedy-sequences "${GEN_SEQUENCES:-2048}" --gen-batch 512 --gen-temperatures 0,0.7,1.0 --gen-top-p 0.95 \
    --gen-fraction 0.3 --hard-weight 0.5 --kl-weight 1.0 --eval-sequences 64 --eval-temperature 0.7 \
    --eval-every 1000000 --steps 1000000 --minutes $(( ${ARM_S:-90} * 3 )) ${EXTRA_DRAFTER_ARGS:-} $opts \
    --train-seconds "${ARM_S:-90}" > "$OUT/arm_$name.log" 2>&1
  echo "arm $name ($opts): rc=$? at $(since) s"; tr '\r' '\n' < "$OUT/arm_$name.log" | grep -E "done|data|Error" | tail -3
  cp "$WORK/$name.work/drafter_summary.json" "$OUT/drafter_summary_$name.json" 2>/dev/null
  [ -d "$WORK/$name/drafter" ] && evaluate "$name" "$WORK/$name"
done
python3 - "$OUT" "$ARMS" <<'EOF'
import json, os, sys
out, specs = sys.argv[1], dict(a.split("=", 1) for a in sys.argv[2].split())
arms = ["shipped"] + list(specs)
rows = ["| arm | options | drafter parameters | training steps (s) | teacher-forced chain run | tau greedy | tau T = 0.7 |",
        "|---|---|---|---|---|---|---|"]
for name in arms:
    s, pair = {}, {}
    if os.path.exists(p := os.path.join(out, f"drafter_summary_{name}.json")):
        s = json.load(open(p))
    if os.path.exists(p := os.path.join(out, f"default_pair_{name}.json")):
        pair = json.load(open(p))
    taus = {}
    for r in pair.get("rows", pair.get("configs", [])):
        if isinstance(r, dict) and r.get("budget") == 16:
            taus[float(r.get("temperature", 0))] = r.get("tau")
    fmt = lambda x: f"{x:.2f}" if isinstance(x, (int, float)) else "-"  # noqa: E731
    opts = specs.get(name, "(the shipped drafter)").replace(",", " ") or "(v2's config)"
    rows.append(f"| {name} | {opts} | {s.get('params', '-')} | "
                f"{s.get('steps', '-')} ({fmt(s.get('train_seconds'))}) | {fmt(s.get('eval_chain_run'))} | "
                f"{fmt(taus.get(0.0))} | {fmt(taus.get(0.7))} |")
open(os.path.join(out, "ablation.md"), "w").write("\n".join(rows) + "\n")
print("\n".join(rows))
EOF
tar -czf "$OUT/0_results.tgz" -C "$OUT" --exclude 0_results.tgz . 2>/dev/null
echo "done at $(since) s"
