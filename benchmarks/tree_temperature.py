"""Choose a pair's DDTree tree temperature: tau of DDTree per (budget, tree temperature), beside the chain.

    python benchmarks/tree_temperature.py                   # the embedded pair, 16 prompts (seed 7), budget 32
    python benchmarks/tree_temperature.py --smoke           # 2 prompts x 8 tokens, seconds

The prompts are cut from the held-out files like benchmarks/default_pair.py's, at the offsets of another
--prompt-seed (default 7; default_pair evaluates seed 0), so a temperature chosen here is not tuned on the
evaluation prompts. Write the chosen value into the checkpoint's metadata (extra.decoding.tree_temperature);
generate and the benchmarks use it from there. Writes <out>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from default_pair import ROOT, heldout_prompts, run_config  # noqa: E402

from kdtree_jax import load_checkpoint  # noqa: E402
from kdtree_jax.checkpoint import add_dtype_argument  # noqa: E402
from kdtree_jax.provenance import git_commit, smoke_dir  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"), help="kdtree_jax checkpoint with a target and a drafter")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts decoded in one batch")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--prompt-seed", type=int, default=7, help="offsets of the prompts (default_pair.py uses 0)")
    p.add_argument("--max-new-tokens", dest="max_new", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--max-new", dest="max_new", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # old spelling
    p.add_argument("--budgets", default="32", help="DDTree budgets (tree nodes besides the root), comma-separated")
    p.add_argument("--temperatures", default="1.0,0.7,0.5,0.4", help="tree temperatures to compare")
    p.add_argument("--topk", type=int, default=4, help="drafter candidates per depth for DDTree")
    p.add_argument("--impl", default="auto", help="verify-attention implementation (auto, reference, ffi)")
    add_dtype_argument(p)
    p.add_argument("--out", default=None, help="results path without extension (default: "
                   "benchmarks/results/tree_temperature_cpu; --smoke: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="2 prompts x 8 new tokens, budget 4, two temperatures")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (os.path.join(smoke_dir("tree_temperature"), "tree_temperature_smoke") if args.smoke
                    else os.path.join(ROOT, "benchmarks", "results", "tree_temperature_cpu"))
    if args.smoke:
        args.prompts, args.prompt_len, args.max_new, args.budgets, args.temperatures = 2, 24, 8, "4", "1.0,0.5"

    target, drafter, tokenizer = load_checkpoint(args.checkpoint, dtype=args.dtype)
    prompts = heldout_prompts(tokenizer, args.prompts, args.prompt_len, seed=args.prompt_seed)

    def run(tree, budget, temperature):
        return run_config(target, drafter, prompts, tree, tree, budget, args.topk, args.max_new, args.impl,
                          temperature).stats["tau"]

    chain = run("chain", 0, 1.0)
    rows = [{"budget": int(b), "tree_temperature": float(t), "tau": run("ddtree", int(b), float(t))}
            for b in args.budgets.split(",") for t in args.temperatures.split(",")]
    result = {"date": datetime.date.today().isoformat(), "commit": git_commit(), "device": jax.devices()[0].device_kind,
              "checkpoint": os.path.relpath(os.path.abspath(args.checkpoint), ROOT), "prompts": len(prompts),
              "prompt_len": args.prompt_len, "prompt_seed": args.prompt_seed, "max_new_tokens": args.max_new,
              "topk": args.topk, "chain_tau": chain, "rows": rows}
    lines = [f"# DDTree tree temperature ({result['device']})", "",
             f"{result['date']}, commit {result['commit']}, `{result['checkpoint']}`; {len(prompts)} held-out prompts "
             f"of {args.prompt_len} tokens (prompt seed {args.prompt_seed}), {args.max_new} greedy new tokens, "
             f"top-k {args.topk} per depth. Chain tau {chain:.2f}.", "",
             "| budget | tree temperature | tau | × chain |", "|---|---|---|---|"]
    lines += [f"| {r['budget']} | {r['tree_temperature']:g} | {r['tau']:.2f} | {r['tau'] / chain:.2f} |" for r in rows]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
