"""Measure the embedded default pair (checkpoints/default) on the held-out split of the corpus.

    python benchmarks/default_pair.py                       # everything, writes results/default_pair.{md,json}
    python benchmarks/default_pair.py --prompts 8 --budgets 8,32 --no-write   # a quick look

1. Held-out loss / perplexity of the target: next-token cross-entropy over non-overlapping windows of
   --seq-len tokens of the held-out files (joined with EOS), all of them unless --eval-windows says how many
   (evenly spaced).
2. Mean accepted length tau (tokens per target forward, bonus included) with greedy decoding of
   --max-new-tokens 128 tokens from --prompts held-out prompts (--prompt-len tokens each, at varied offsets of
   the held-out files, round robin over the files), one batch: chain (DFlash: the drafter's top-1 path),
   DDTree at each budget, and autoregressive. Every speculative output is compared with the
   autoregressive one (greedy decoding is lossless: they must be equal).
3. Tokens/s at batch 1 (the latency case speculative decoding is for) over the first --latency-prompts
   prompts, and the batched throughput of the tau runs, both from the engine's decode timing (compile
   excluded).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kdtree_jax import corpus, load_checkpoint  # noqa: E402
from kdtree_jax.checkpoint import add_dtype_argument, recommended_tree_temperature  # noqa: E402
from kdtree_jax.provenance import git_commit  # noqa: E402
from kdtree_jax.speculative.engine import generate  # noqa: E402
from kdtree_jax.corpus import EOS  # noqa: E402
from kdtree_jax.decode import causal_forward  # noqa: E402


def heldout_prompts(tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` tokens: round robin over the held-out files, each at a random offset
    (fixed seed) that starts a line where the file has one nearby."""
    docs = corpus.documents("eval")
    rng = np.random.default_rng(seed)
    encoded = [tokenizer.encode(d.text) for d in docs]
    prompts = []
    for i in range(count):
        ids = encoded[i % len(encoded)]
        text_ok = len(ids) > length + 8
        if not text_ok:
            continue
        start = int(rng.integers(0, len(ids) - length - 1))
        # Move to the token after the next newline (within 32 tokens) so prompts begin at a line start.
        for j in range(start, min(start + 32, len(ids) - length - 1)):
            if "\n" in tokenizer.decode([ids[j]]):
                start = j + 1
                break
        prompts.append(ids[start:start + length])
    return prompts


def heldout_loss(target, tokenizer, seq_len: int, windows: int, batch: int = 8) -> dict:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(tokenizer.path)
    eos = raw.token_to_id(EOS)
    parts = []
    for d in corpus.documents("eval"):
        parts += raw.encode(d.text, add_special_tokens=False).ids + [eos]
    toks = np.asarray(parts, np.int32)
    n_all = (len(toks) - 1) // seq_len
    starts = np.arange(n_all) * seq_len
    if windows and windows < n_all:
        starts = starts[np.linspace(0, n_all - 1, windows).astype(int)]
    fwd = jax.jit(lambda m, t: _nll(m, t))
    total, count = 0.0, 0
    for i in range(0, len(starts), batch):
        s = starts[i:i + batch]
        x = np.stack([toks[a:a + seq_len + 1] for a in s])
        nll = np.asarray(fwd(target, jnp.asarray(x)))
        total += float(nll.sum())
        count += nll.size
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": int(count), "windows": int(len(starts)),
            "all_windows": int(n_all), "seq_len": seq_len, "split_tokens": int(len(toks))}


def _nll(model, x):
    out = causal_forward(model, x[:, :-1])
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    return -jnp.take_along_axis(logp, x[:, 1:, None], axis=-1)[..., 0]


def run_config(target, drafter, prompts, name, tree, budget, topk, max_new, impl, tree_temperature=1.0):
    if tree == "ar":
        res = generate(target, None, prompts, max_new_tokens=max_new, budget=0, impl=impl)
    else:
        res = generate(target, drafter, prompts, max_new_tokens=max_new, budget=budget, topk=topk, tree=tree,
                       tree_temperature=tree_temperature,
                       impl=impl)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"), help="kdtree_jax checkpoint with a target and a drafter")
    p.add_argument("--prompts", type=int, default=50, help="held-out prompts decoded in one batch")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--max-new-tokens", dest="max_new", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--max-new", dest="max_new", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # old spelling
    p.add_argument("--budgets", default="8,16,32,64,128", help="DDTree budgets (tree nodes besides the root), comma-separated")
    p.add_argument("--topk", type=int, default=4, help="drafter candidates per depth for DDTree")
    p.add_argument("--tree-temperature", type=float, default=None,
                   help="DDTree ranks prefixes by the drafter's probabilities at this temperature (< 1 sharpens); default: "
                        "the checkpoint's recommendation (kdtree_checkpoint.json extra.decoding), else 1.0")
    p.add_argument("--compare-budget", type=int, default=32,
                   help="also run DDTree at this budget with tree temperature 1.0 (0: skip)")
    p.add_argument("--latency-prompts", type=int, default=5, help="prompts decoded one at a time for tok/s")
    p.add_argument("--eval-windows", type=int, default=0, help="held-out windows for the loss (0: all)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per held-out window of the loss")
    p.add_argument("--impl", default="auto", help="verify-attention implementation (auto, reference, ffi)")
    add_dtype_argument(p)
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "default_pair"), help="results path without extension (<out>.json, <out>.md)")
    p.add_argument("--no-write", action="store_true", help="print the results, write no files")
    p.add_argument("--skip-loss", action="store_true", help="skip the held-out loss of the target and drafter")
    p.add_argument("--no-chain", action="store_true", help="skip the chain (DFlash) configuration")
    p.add_argument("--samples", type=int, default=2, help="decoded samples to include in the report")
    p.add_argument("--h200-results", default=os.path.join(ROOT, "benchmarks", "results", "spec_decode_h200.json"),
                   help="spec_decode.py's JSON from a GPU run: fills the report's H200 tok/s column (greedy rows)")
    p.add_argument("--render-only", action="store_true",
                   help="rewrite <out>.md from <out>.json (e.g. after a new --h200-results) without decoding")
    args = p.parse_args(argv)
    if args.render_only:
        with open(args.out + ".json") as f:
            result = json.load(f)
        attach_h200(result, args.h200_results)
        with open(args.out + ".md", "w") as f:
            f.write(render(result))
        return 0

    t_all = time.time()
    target, drafter, tokenizer = load_checkpoint(args.checkpoint, dtype=args.dtype)
    if args.tree_temperature is None:
        args.tree_temperature = recommended_tree_temperature(args.checkpoint)
    with open(os.path.join(args.checkpoint, "kdtree_checkpoint.json")) as f:
        meta = json.load(f)
    prompts = heldout_prompts(tokenizer, args.prompts, args.prompt_len)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    configs = [("autoregressive", "ar", 0)] + ([] if args.no_chain else [("chain (DFlash)", "chain", drafter.cfg.depth)])
    configs = [c + (1.0,) for c in configs]
    configs += [(f"DDTree budget {b}", "ddtree", b, args.tree_temperature) for b in budgets]
    if args.compare_budget and args.tree_temperature != 1.0:
        configs.append((f"DDTree budget {args.compare_budget}, tree temp. 1.0", "ddtree", args.compare_budget, 1.0))

    result = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "device": f"{jax.default_backend()}: {jax.devices()[0].device_kind}, {os.cpu_count()} cores visible",
        "checkpoint": os.path.relpath(args.checkpoint, ROOT),
        "dtype": str(target.dtype), "prompts": len(prompts), "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new, "topk": args.topk, "tree_temperature": args.tree_temperature, "block_size": drafter.cfg.block_size,
        "configs": [], "latency": [],
    }
    if not args.skip_loss:
        t = time.time()
        result["heldout"] = heldout_loss(target, tokenizer, args.seq_len, args.eval_windows)
        print(f"held-out loss {result['heldout']['loss']:.4f} ppl {result['heldout']['perplexity']:.2f} "
              f"over {result['heldout']['tokens']} tokens ({time.time() - t:.0f} s)", flush=True)

    ar_tokens = None
    for name, tree, budget, tree_temp in configs:
        t = time.time()
        res = run_config(target, drafter, prompts, name, tree, budget, args.topk, args.max_new, args.impl, tree_temp)
        st = res.stats
        if tree == "ar":
            ar_tokens = res.tokens
            mismatches = 0
        else:
            mismatches = sum(a != b for a, b in zip(ar_tokens, res.tokens))
        row = {"name": name, "tree": tree, "budget": st["budget"], "num_nodes": st["num_nodes"],
               "tau": st["tau"], "acceptance_by_depth": st["acceptance_by_depth"],
               "batch_tokens_per_second": st["tokens_per_second"], "steps": st["steps"],
               "new_tokens": st["new_tokens"], "mismatches_vs_ar": mismatches, "seconds": time.time() - t}
        result["configs"].append(row)
        print(f"{name:22s} tau {st['tau']:.3f}  batch tok/s {st['tokens_per_second']:.1f}  "
              f"mismatches {mismatches}/{len(prompts)}  ({time.time() - t:.0f} s)", flush=True)
        if tree == "ar" and args.samples:
            result["samples"] = [{"prompt": tokenizer.decode(prompts[i]), "continuation": tokenizer.decode(res.tokens[i])}
                                 for i in range(min(args.samples, len(prompts)))]

    for name, tree, budget, tree_temp in configs:
        speeds, taus = [], []
        for pr in prompts[:args.latency_prompts]:
            res = run_config(target, drafter, [pr], name, tree, budget, args.topk, args.max_new, args.impl, tree_temp)
            speeds.append(res.stats["tokens_per_second"])
            taus.append(res.stats["tau"])
        if speeds:
            result["latency"].append({"name": name, "tokens_per_second": float(np.mean(speeds)),
                                      "tau": float(np.mean(taus)), "prompts": len(speeds)})
            print(f"batch 1: {name:22s} {np.mean(speeds):.1f} tok/s (tau {np.mean(taus):.2f})", flush=True)
    result["seconds"] = time.time() - t_all
    result["training"] = meta.get("extra", {})
    attach_h200(result, args.h200_results)
    if not args.no_write:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        with open(args.out + ".md", "w") as f:
            f.write(render(result))
        print(f"wrote {args.out}.md and .json")
    return 0


def attach_h200(result: dict, path: str) -> None:
    """Greedy batch-1 rows of a GPU spec_decode run, keyed by this report's config names."""
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        run = json.load(f)
    names = {"autoregressive": "autoregressive", "chain": "chain (DFlash)"}
    rows = []
    for row in run["rows"]:
        if row["temperature"] != 0:
            continue
        name = names.get(row["decoder"], f"DDTree budget {row['budget']}")
        rows.append({"name": name, "tokens_per_second": row["tokens_per_second"], "tau": row["tau"],
                     "speedup_vs_ar": row["speedup_vs_ar"]})
    m = run["meta"]
    result["h200"] = {"rows": rows, "source": f"`{os.path.relpath(path, ROOT)}` ({m.get('date', '')}, commit "
                      f"{m.get('commit', '?')})", "note": f"{m.get('prompts', '?')} prompts of {m.get('prompt_len', '?')} "
                      f"tokens, {m.get('max_new_tokens', '?')} new tokens, batch 1, tree temperature "
                      f"{m.get('tree_temperature', 1.0)}; its held-out prompts differ from this CPU's"}


def render(r: dict) -> str:
    lines = ["# The embedded default pair: held-out quality, tau and speed",
             "",
             f"{r['date']}, commit {r['commit']}, checkpoint `{r['checkpoint']}` ({r['dtype']}), {r['device']}.",
             f"Regenerate: `python benchmarks/default_pair.py` ({r['seconds'] / 60:.0f} min on this machine).",
             ""]
    if "heldout" in r:
        h = r["heldout"]
        lines += ["## Target, held-out split",
                  "",
                  f"Next-token loss **{h['loss']:.3f}** nats, perplexity **{h['perplexity']:.1f}**, over {h['tokens']:,} "
                  f"predicted tokens ({h['windows']} of {h['all_windows']} non-overlapping windows of {h['seq_len']} "
                  f"tokens; the split has {h['split_tokens']:,} tokens).", ""]
    chain = next((c for c in r["configs"] if c["tree"] == "chain"), None)
    lines += ["## Mean accepted length tau (greedy)", "",
              f"{r['prompts']} held-out prompts of {r['prompt_len']} tokens, {r['max_new_tokens']} new tokens each, "
              f"one batch; drafter block size {r['block_size']} (depth {r['block_size'] - 1}), DDTree top-k "
              f"{r['topk']} per depth, tree temperature {r.get('tree_temperature', 1.0)}. tau = tokens emitted per target forward (accepted drafts + the bonus token), "
              "over all sequences' steps. Batch tok/s: the whole batch's new tokens per second of decode on this "
              "CPU (compile excluded). 'Equal to AR': sequences whose output is identical to autoregressive greedy.",
              "",
              "| decoding | tree nodes | tau | tau / chain tau | P(accept ≥1) | P(≥3) | batch tok/s | equal to AR |",
              "|---|---|---|---|---|---|---|---|"]
    for c in r["configs"]:
        acc = c["acceptance_by_depth"]
        a1 = f"{acc[0]:.2f}" if acc else "–"
        a3 = f"{acc[2]:.2f}" if len(acc) > 2 else "–"
        ratio = f"{c['tau'] / chain['tau']:.2f}" if chain and c["tree"] != "ar" else "–"
        lines.append(f"| {c['name']} | {c['num_nodes']} | {c['tau']:.2f} | {ratio} | {a1} | {a3} | "
                     f"{c['batch_tokens_per_second']:.1f} | {r['prompts'] - c['mismatches_vs_ar']}/{r['prompts']} |")
    lines += ["", "## Tokens/s at batch 1", "",
              "| decoding | this CPU: tok/s | speed-up vs AR | tau | H200: tok/s |", "|---|---|---|---|---|"]
    base = next((l["tokens_per_second"] for l in r["latency"] if l["name"] == "autoregressive"), None)
    h200 = {row["name"]: row for row in r.get("h200", {}).get("rows", [])}
    for l in r["latency"]:
        up = f"{l['tokens_per_second'] / base:.2f}×" if base else "–"
        g = h200.get(l["name"])
        gpu = f"{g['tokens_per_second']:.0f} ({g['speedup_vs_ar']:.2f}×, tau {g['tau']:.2f})" if g else "not measured"
        lines.append(f"| {l['name']} | {l['tokens_per_second']:.1f} | {up} | {l['tau']:.2f} | {gpu} |")
    if r["latency"]:
        lines += ["", f"Mean over the first {r['latency'][0]['prompts']} prompts, decoded one at a time."]
    if h200:
        lines += [f"H200 column: {r['h200']['source']} ({r['h200']['note']})."]
    t32 = next((c["tau"] for c in r["configs"] if c["tree"] == "ddtree" and c["budget"] == 32), None)
    if t32 is not None and chain:
        lines += ["", "## Targets", "",
                  f"- DDTree tau at budget 32 ≥ 3.5: **{'met' if t32 >= 3.5 else 'not met'}** ({t32:.2f}).",
                  f"- DDTree tau ≥ 1.25 × chain tau (budget 32): **{'met' if t32 >= 1.25 * chain['tau'] else 'not met'}** "
                  f"({t32 / chain['tau']:.2f}×).",
                  f"- Greedy speculative == greedy autoregressive: "
                  f"{sum(c['mismatches_vs_ar'] == 0 for c in r['configs'])}/{len(r['configs'])} configurations identical on "
                  "every prompt."]
    if r.get("notes"):  # hand-written reading of a run, kept in its JSON so that re-rendering keeps it
        lines += [""] + r["notes"]
    if r.get("samples"):
        lines += ["", f"## Samples (autoregressive greedy, {r['dtype']})", ""]
        for s in r["samples"]:
            lines += ["Prompt:", "```python", s["prompt"], "```", "Continuation:", "```python", s["continuation"], "```", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
