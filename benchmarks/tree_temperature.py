"""Choose a pair's DDTree tree temperature: tau of DDTree per (budget, tree temperature), beside the chain.

    python benchmarks/tree_temperature.py                   # the embedded pair, 16 prompts (seed 7), budget 32
    python benchmarks/tree_temperature.py --smoke           # 2 prompts x 8 tokens, seconds (flags given override it)

The prompts are cut from the held-out files like benchmarks/default_pair.py's, at the offsets of another
--prompt-seed (default 7; default_pair evaluates seed 0), so a temperature chosen here is not tuned on the
evaluation prompts. --sampling-temperatures 0,0.7 sweeps the same tree temperatures under sampled verification
too (top-p --top-p, seed --seed: an exact sample of the target, so its tau is a noisier figure than greedy's).
Write the chosen values into the checkpoint's metadata (extra.decoding.tree_temperature for greedy: what generate
and the CLI use; extra.decoding.tree_temperature_by_sampling_temperature {"0": ..., "0.7": ...}: what
benchmarks/default_pair.py uses per sampling temperature). Writes <out>.{json,md}.
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


def _label(sampling_temperature: float) -> str:
    return "greedy" if sampling_temperature == 0 else f"T={sampling_temperature:g}"


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
    p.add_argument("--sampling-temperatures", default="0",
                   help="sampling temperatures to sweep the tree temperatures at, comma-separated (0: greedy)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p filter of the sampled (temperature > 0) runs")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the temperature > 0 runs")
    p.add_argument("--corpus", default=None,
                   help="take the held-out files from this corpus pack (e.g. checkpoints/corpus_v2.jsonl.xz) "
                        "instead of this interpreter's standard library")
    p.add_argument("--topk", type=int, default=4, help="drafter candidates per depth for DDTree")
    p.add_argument("--impl", default="auto", help="verify-attention implementation (auto, reference, ffi)")
    add_dtype_argument(p)
    p.add_argument("--out", default=None, help="results path without extension (default: "
                   "benchmarks/results/tree_temperature_cpu; --smoke: a temp dir)")
    p.add_argument("--smoke", action="store_true",
                   help="2 prompts x 8 new tokens, budget 4, two temperatures (each unless given)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (os.path.join(smoke_dir("tree_temperature"), "tree_temperature_smoke") if args.smoke
                    else os.path.join(ROOT, "benchmarks", "results", "tree_temperature_cpu"))
    if args.smoke:  # the smoke's settings, except those given (a flag given as --flag or --flag=value)
        given = {a.split("=")[0] for a in argv}
        for flags, dest, value in ((("--prompts",), "prompts", 2), (("--prompt-len",), "prompt_len", 24),
                                   (("--max-new-tokens", "--max-new"), "max_new", 8), (("--budgets",), "budgets", "4"),
                                   (("--temperatures",), "temperatures", "1.0,0.5")):
            if not given & set(flags):
                setattr(args, dest, value)

    target, drafter, tokenizer = load_checkpoint(args.checkpoint, dtype=args.dtype)
    prompts = heldout_prompts(tokenizer, args.prompts, args.prompt_len, seed=args.prompt_seed, pack=args.corpus)
    sampling = [float(t) for t in args.sampling_temperatures.split(",") if t.strip()]

    def run(tree, budget, temperature, sampling_temperature):
        return run_config(target, drafter, prompts, tree, tree, budget, args.topk, args.max_new, args.impl,
                          temperature, sampling_temperature, args.top_p, args.seed).stats["tau"]

    chains, rows = {}, []
    for st in sampling:
        chains[st] = run("chain", 0, 1.0, st)
        print(f"{_label(st)}: chain tau {chains[st]:.3f}", flush=True)
        for b in args.budgets.split(","):
            for t in args.temperatures.split(","):
                rows.append({"sampling_temperature": st, "budget": int(b), "tree_temperature": float(t),
                             "tau": run("ddtree", int(b), float(t), st)})
                print(f"{_label(st)}: budget {b} tree temperature {t}: tau {rows[-1]['tau']:.3f}", flush=True)
    best = {_label(st): max((r for r in rows if r["sampling_temperature"] == st), key=lambda r: r["tau"])
            for st in sampling}
    result = {"date": datetime.date.today().isoformat(), "commit": git_commit(), "device": jax.devices()[0].device_kind,
              "checkpoint": os.path.relpath(os.path.abspath(args.checkpoint), ROOT), "dtype": str(target.dtype),
              "prompts": len(prompts), "prompt_len": args.prompt_len, "prompt_seed": args.prompt_seed,
              "corpus": args.corpus or "stdlib", "max_new_tokens": args.max_new, "topk": args.topk,
              "sampling_temperatures": sampling, "top_p": args.top_p, "seed": args.seed,
              "chain_tau": chains.get(0.0, chains[sampling[0]]),
              "chain_tau_by_sampling_temperature": {str(st): chains[st] for st in sampling}, "rows": rows,
              "best": {k: {"tree_temperature": r["tree_temperature"], "budget": r["budget"], "tau": r["tau"]}
                       for k, r in best.items()}}
    sampled = [st for st in sampling if st > 0]
    how = " and ".join((["greedy"] if 0.0 in sampling else []) + (
        ["sampled at " + ", ".join(f"T = {st:g}" for st in sampled) + f" (top-p {args.top_p:g}, seed {args.seed})"]
        if sampled else []))
    lines = [f"# DDTree tree temperature ({result['device']})", "",
             f"{result['date']}, commit {result['commit']}, `{result['checkpoint']}` ({result['dtype']}); "
             f"{len(prompts)} held-out prompts of {args.prompt_len} tokens (prompt seed {args.prompt_seed}), "
             f"{args.max_new} new tokens, " + how + f", top-k {args.topk} per depth. Chain tau "
             + ", ".join(f"{chains[st]:.2f} ({_label(st)})" for st in sampling) + ".", "",
             "| decoding | budget | tree temperature | tau | × chain |", "|---|---|---|---|---|"]
    lines += [f"| {_label(r['sampling_temperature'])} | {r['budget']} | {r['tree_temperature']:g} | {r['tau']:.2f} | "
              f"{r['tau'] / chains[r['sampling_temperature']]:.2f} |" for r in rows]
    lines += ["", "Best: " + "; ".join(f"{k} {v['tree_temperature']:g} (tau {v['tau']:.2f} at budget {v['budget']})"
                                       for k, v in result["best"].items()) + "."]
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
