"""Choose a pair's recommended generation settings (its generation_config.json) by measurement.

    python benchmarks/generation_settings.py                  # the embedded pair, the default grid, seed 0 (17 min, CPU)
    python benchmarks/generation_settings.py --append --seeds 1,2 --grid ...   # more seeds / settings, pooled
    python benchmarks/generation_settings.py --append --grid ... --write-config  # ... and write the pick
    python benchmarks/generation_settings.py --smoke          # random tiny pair, 2 settings, seconds

Every setting of --grid decodes --prompts held-out prompts (benchmarks/spec_decode.py's heldout_prompts, --prompt-len
tokens each) and the README's prompt `def fibonacci(n):`, --max-new-tokens tokens each, at DDTree budget --budget, in
one batch of settings x prompts per seed (`sampling=` one SamplingParams per row: one compiled program for the grid),
no stop tokens. Per setting, over the held-out prompts and seeds:
- rep4: share of the 4-gram positions of the generated tokens whose 4-gram already occurred earlier in them;
- last64: share of the 4-gram positions of the last 64 generated tokens whose 4-gram already occurred earlier in those
  64 tokens (benchmarks/default_pair.py's repeated_ngram_share; a loop of period p gives ~1 - p / 61), its mean and the
  outputs at >= 0.5 (looping); the same for the held-out text that really follows each prompt as the reference;
- tau: tokens per step (accepted drafted tokens + 1) and acceptance P(>= d drafted tokens accepted), from each row's
  tokens per step (chunks of one step, on_tokens), each row's last step left out (max_new_tokens may cut it);
- the fibonacci prompt's last64 and tau apart (seed 0's text in the .md).
The pick (issue 47): the best held-out tau among the settings with mean last64 <= --max-last64 (0.2) both on the held-out
prompts and on the README's prompt (what a new user sees first). An empty --grid with --append decodes nothing: it
re-reads the file, picks and writes again (with --write-config, the config). Writes
<out>/generation_settings_<device>.{md,json} with date, device and commit; --write-config writes the pick to
<checkpoint>/generation_config.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_decode import ROOT, base_meta, device_slug, heldout_prompts, load_pair  # noqa: E402
from default_pair import repeated_ngram_share  # noqa: E402

from kdtree_jax import corpus, generation_config  # noqa: E402
from kdtree_jax.checkpoint import add_dtype_argument, recommended_tree_temperature  # noqa: E402
from kdtree_jax.provenance import smoke_dir  # noqa: E402
from kdtree_jax.speculative.engine import generate  # noqa: E402
from kdtree_jax.speculative.sampling import SamplingParams  # noqa: E402

README_PROMPT = "def fibonacci(n):"
KEYS = {"t": "temperature", "p": "top_p", "k": "top_k", "rp": "repetition_penalty", "pp": "presence_penalty",
        "fp": "frequency_penalty"}
DEFAULT_GRID = ("greedy,rp=1.2,rp=1.3,"
                + ",".join(f"t={t}/p=0.95/rp={r}" for t in (0.6, 0.8, 1.0) for r in (1.0, 1.1, 1.2))
                + ",t=0.6/p=0.95/rp=1.3,t=0.7/p=0.95/rp=1.2,t=0.7/p=0.95/rp=1.3")


def parse_grid(text: str) -> list[tuple[str, SamplingParams]]:
    """'greedy,t=0.8/p=0.95/rp=1.1,...' -> [(label, SamplingParams)]; keys t p k rp pp fp (SamplingParams' fields)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        kw = {}
        for part in filter(None, item.split("/")):
            if part == "greedy":
                continue
            key, _, value = part.partition("=")
            kw[KEYS[key]] = int(value) if key == "k" else float(value)
        out.append((item, SamplingParams(**kw)))
    return out


def step_counts(calls: list) -> list:
    """A row's tokens per decode step from its on_tokens calls (one a step; the first is the prefill's token), the
    last step left out (max_new_tokens may have cut it)."""
    return [n for n in calls[1:] if n][:-1]


def summarize(rows: list) -> dict:
    """rows: dicts with tokens, steps, reference (optional): the setting's figures."""
    steps = np.concatenate([np.asarray(r["steps"]) for r in rows])
    last64 = [repeated_ngram_share(r["tokens"], 4, 64) for r in rows]
    depths = (1, 2, 4, 8)
    return {
        "rep4": float(np.mean([repeated_ngram_share(r["tokens"], 4, len(r["tokens"])) for r in rows])),
        "last64": float(np.mean(last64)),
        "looping": int(sum(x >= 0.5 for x in last64)),
        "outputs": len(rows),
        "tau": float(steps.mean()),
        "acceptance": {str(d): float((steps >= d + 1).mean()) for d in depths},
        "steps": int(steps.size),
    }


def merge(old: dict, new: dict) -> dict:
    """Two runs' results pooled per setting: means weighted by outputs (rep4, last64) or steps (tau, acceptance)."""
    by = {r["label"]: r for r in old["results"]}
    for r in new["results"]:
        o = by.get(r["label"])
        if o is None:
            by[r["label"]] = r
            continue
        for part in ("heldout", "fibonacci"):
            a, b = o[part], r[part]
            wa, wb, sa, sb = a["outputs"], b["outputs"], a["steps"], b["steps"]
            o[part] = {"rep4": (a["rep4"] * wa + b["rep4"] * wb) / (wa + wb),
                       "last64": (a["last64"] * wa + b["last64"] * wb) / (wa + wb),
                       "looping": a["looping"] + b["looping"], "outputs": wa + wb,
                       "tau": (a["tau"] * sa + b["tau"] * sb) / (sa + sb),
                       "acceptance": {d: (a["acceptance"][d] * sa + b["acceptance"][d] * sb) / (sa + sb)
                                      for d in a["acceptance"]},
                       "steps": sa + sb}
        o["seeds"] = o.get("seeds", [0]) + r["seeds"]
    return {**new, "results": list(by.values()), "runs": old.get("runs", [old["meta"]]) + [new["meta"]]}


def measure(args, grid: list, seeds: list) -> dict:
    """Decodes the grid in one batch: -> {meta, results, reference, runs}."""
    target, drafter, tokenizer, pair = load_pair(args)
    tree_t = 1.0 if args.smoke else recommended_tree_temperature(args.checkpoint)

    prompts, where = heldout_prompts(tokenizer, args.prompts, args.prompt_len, start=args.prompt_start)
    files = {d.name: np.asarray(tokenizer.encode(d.text), np.int32) for d in corpus.documents("eval")}
    refs = []
    for w in where:
        name, _, cut = w.rpartition("@")
        refs.append(files[name][int(cut):int(cut) + args.max_new_tokens].tolist())
    prompts = prompts + [np.asarray(tokenizer.encode(README_PROMPT), np.int32)]
    n = len(prompts)
    # One batch: every setting x seed (a greedy setting once: its output does not depend on the seed) x prompt, each
    # row its own SamplingParams and seed (one compiled program).
    rows = [(label, params, seed, i) for label, params in grid
            for seed in (seeds if params.temperature > 0 else seeds[:1]) for i in range(n)]
    calls = [[] for _ in rows]
    res = generate(target, drafter, [prompts[i] for *_, i in rows], max_new_tokens=args.max_new_tokens,
                   budget=args.budget, tree_temperature=tree_t, sampling=[r[1] for r in rows],
                   seed=[r[2] for r in rows], chunk_steps=1, on_tokens=lambda b, t: calls[b].append(len(t)))
    print(f"{len(rows)} rows, {res.stats['steps']} steps, decode {res.stats['decode_seconds']:.1f} s, compile "
          f"{res.stats['compile_seconds']:.1f} s, batch tau {res.stats['tau']:.3f}", file=sys.stderr, flush=True)
    per = {label: {"heldout": [], "fib": [], "seeds": []} for label, _ in grid}
    fib_text = {}
    for b, (label, _, seed, i) in enumerate(rows):
        row = {"tokens": list(res.tokens[b]), "steps": step_counts(calls[b])}
        per[label]["fib" if i == n - 1 else "heldout"].append(row)
        if i == 0:
            per[label]["seeds"].append(seed)
        if i == n - 1 and label not in fib_text:
            fib_text[label] = tokenizer.decode(res.tokens[b])

    results = []
    for label, params in grid:
        r = {"label": label, "settings": {k: getattr(params, k) for k in generation_config.KEYS},
             "heldout": summarize(per[label]["heldout"]), "fibonacci": summarize(per[label]["fib"]),
             "seeds": per[label]["seeds"], "fibonacci_text": fib_text[label]}
        results.append(r)
    reference = {"last64": float(np.mean([repeated_ngram_share(t, 4, 64) for t in refs if len(t) >= 8])),
                 "rep4": float(np.mean([repeated_ngram_share(t, 4, len(t)) for t in refs if len(t) >= 8]))}
    meta = {**base_meta(args, target, drafter, pair), "grid": args.grid, "seeds": seeds, "prompts": where,
            "budget": args.budget, "tree_temperature": tree_t, "max_new_tokens": args.max_new_tokens,
            "prompt_len": args.prompt_len, "prompt_start": args.prompt_start, "max_last64": args.max_last64,
            "batch_tau": res.stats["tau"],
            "decode_seconds": res.stats["decode_seconds"]}
    return {"meta": meta, "results": results, "reference": reference, "runs": [meta]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"), help="kdtree_jax checkpoint "
                   "with a target and a drafter")
    p.add_argument("--smoke", action="store_true", help="random tiny pair, 2 prompts x 8 tokens x 2 settings")
    p.add_argument("--grid", default=DEFAULT_GRID, help="settings, comma-separated, each key=value joined by '/' "
                   "(t temperature, p top_p, k top_k, rp / pp / fp the penalties; 'greedy': all defaults); "
                   f"default: {DEFAULT_GRID}")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts (the README's prompt besides)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per held-out prompt")
    p.add_argument("--prompt-start", type=int, default=0,
                   help="the first held-out prompt's index (spec_decode.py's heldout_prompts): e.g. --prompts 16 "
                        "--prompt-start 16 checks a pick on prompts other than those that chose it")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    p.add_argument("--budget", type=int, default=16, help="DDTree nodes per step besides the root")
    p.add_argument("--seeds", default="0", help="comma-separated; a greedy setting runs the first only")
    p.add_argument("--max-last64", type=float, default=0.2, help="the pick's bound on mean last64 repetition")
    p.add_argument("--append", action="store_true", help="pool this run with the one in <out>'s file (a setting in "
                   "both: its outputs and steps together; the file then lists both runs)")
    p.add_argument("--write-config", action="store_true", help="write the pick to <checkpoint>/generation_config.json")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"), help="directory of the result files")
    add_dtype_argument(p)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.smoke:
        args.prompts, args.prompt_len, args.max_new_tokens, args.budget = 2, 24, 8, 4
        args.grid, args.seeds, args.out = "greedy,t=1/p=0.95/rp=1.2", "0", smoke_dir("generation_settings")
    grid = parse_grid(args.grid)
    stem = os.path.join(args.out, f"generation_settings_{device_slug()}")
    if not grid and not args.append:
        p.error("an empty --grid only re-reads the file: it needs --append")
    out = measure(args, grid, [int(s) for s in args.seeds.split(",")]) if grid else None
    if args.append:
        with open(stem + ".json") as f:
            old = json.load(f)
        out = merge(old, out) if out else old
    # The pick: the best held-out tau among the settings whose held-out outputs and whose README-prompt outputs
    # both stay at mean last64 <= --max-last64 (the README prompt is what a new user sees first).
    ok = [r for r in out["results"] if r["heldout"]["last64"] <= args.max_last64
          and r["fibonacci"]["last64"] <= args.max_last64]
    pick = max(ok, key=lambda r: r["heldout"]["tau"]) if ok else None
    out["pick"] = pick and pick["label"]
    out["max_last64"] = args.max_last64
    os.makedirs(args.out, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(out, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(out))
    print(markdown(out))
    print(f"wrote {stem}.{{md,json}}", file=sys.stderr)
    if args.write_config and pick:
        config = {"do_sample": pick["settings"]["temperature"] > 0,
                  **{k: v for k, v in pick["settings"].items() if v != getattr(SamplingParams(), k)},
                  "_source": f"benchmarks/generation_settings.py: {out['pick']}, the pick of "
                             f"benchmarks/results/{os.path.basename(stem)}.md"}
        path = os.path.join(args.checkpoint, generation_config.FILENAME)
        with open(path, "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


def markdown(out: dict) -> str:
    m, ref = out["meta"], out["reference"]
    starts = sorted({run.get("prompt_start", 0) for run in out["runs"]})
    lines = [f"# Generation settings of {m['pair']}", ""]
    for run in out["runs"]:
        lines.append(f"- {run['date']} · {run['device']} ({run['backend']}, {run['cpu_count']} CPUs) · commit "
                     f"{run['commit']} · target {run['target_dtype']} · decode {run.get('decode_seconds', 0):.0f} s · "
                     f"`{run['command']}`")
    lines += ["",
             f"{len(m['prompts'])} held-out prompts a run ({m['prompt_len']} tokens, spec_decode.py's heldout_prompts from "
             f"index {' or '.join(str(i) for i in starts)}: a run's --prompt-start) and "
             f"`{README_PROMPT}`, {m['max_new_tokens']} new tokens each, DDTree budget {m['budget']} (tree temperature "
             f"{m['tree_temperature']:g}); each run one batch of every setting x seed (a greedy one once) x prompt, one "
             "compiled program; no stop tokens; a setting in several runs pools their outputs and steps.", "",
             "- **rep4**: share of the 4-gram positions of the generated tokens whose 4-gram already occurred earlier "
             "in them.",
             "- **last64**: the same within the last 64 generated tokens (a position counts when its 4-gram occurred "
             "earlier in those 64 tokens; default_pair.py's measure; a loop of period p gives ~1 - p/61); in brackets "
             "the outputs at >= 0.5 (looping).",
             "- **τ**: tokens per step (accepted drafted tokens + 1); **acc ≥ d**: share of steps with at least d "
             "drafted tokens accepted; from each row's tokens per step, its last step left out.",
             f"- Held-out text that really follows each prompt: rep4 {ref['rep4']:.3f}, last64 {ref['last64']:.3f}.",
             "", "| setting | T | top-p | rep. penalty | seeds | rep4 | last64 (looping) | τ | acc ≥ 1 / 2 / 4 / 8 | "
             "fibonacci last64 | fibonacci τ |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["results"]:
        h, fb, s = r["heldout"], r["fibonacci"], r["settings"]
        acc = " / ".join(f"{h['acceptance'][d]:.2f}" for d in h["acceptance"])
        mark = " **(pick)**" if r["label"] == out["pick"] else ""
        lines.append(f"| `{r['label']}`{mark} | {s['temperature']:g} | {s['top_p']:g} | {s['repetition_penalty']:g} | "
                     f"{','.join(map(str, r.get('seeds', [0])))} | {h['rep4']:.3f} | {h['last64']:.3f} ({h['looping']}/{h['outputs']}) | {h['tau']:.2f} | {acc} | "
                     f"{fb['last64']:.3f} ({fb['looping']}/{fb['outputs']}) | {fb['tau']:.2f} |")
    lines += ["", f"Pick: the best held-out τ among the settings whose held-out outputs and whose `{README_PROMPT}` "
              f"outputs both have mean last64 ≤ {out.get('max_last64', m['max_last64']):g}: "
              + (f"`{out['pick']}`" if out["pick"] else "none")]
    bound = out.get("max_last64", m["max_last64"])
    held = sorted((r for r in out["results"] if r["heldout"]["last64"] <= bound), key=lambda r: -r["heldout"]["tau"])
    lines += [f"Ranked by held-out τ among those with held-out last64 ≤ {bound:g} alone: " + "; ".join(
        f"`{r['label']}` τ {r['heldout']['tau']:.2f} (seeds {len(r.get('seeds', [0]))}), fibonacci last64 "
        f"{r['fibonacci']['last64']:.2f}" for r in held[:5]), ""]
    lines += ["",
              "## `def fibonacci(n):` at each setting (its first seed)", ""]
    for r in out["results"]:
        lines += [f"`{r['label']}`:", "```python", README_PROMPT + r.get("fibonacci_text", r.get("fibonacci_text_seed0", "")), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
