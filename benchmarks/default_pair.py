"""Measure the embedded default pair (checkpoints/default) on the held-out split of the corpus.

    python benchmarks/default_pair.py                       # everything, writes results/default_pair.{md,json}
    python benchmarks/default_pair.py --prompts 8 --budgets 8,32 --no-write   # a quick look

1. Held-out loss / perplexity of the target: next-token cross-entropy over non-overlapping windows of
   --seq-len tokens of the held-out files (joined with EOS), all of them unless --eval-windows says how many
   (evenly spaced).
2. Mean accepted length tau (tokens per target forward, bonus included) decoding --max-new-tokens 128 tokens
   from --prompts held-out prompts (--prompt-len tokens each, at varied offsets of the held-out files, round
   robin over the files), one batch, at each of --temperatures (default: greedy and T = 0.7 with --top-p 0.95,
   side by side): chain (DFlash: the drafter's top-1 path), DDTree at each budget, and autoregressive. Every
   greedy speculative output is compared with the autoregressive one (greedy decoding is lossless: they must be
   equal); sampled outputs are exact samples, not comparable token for token.
3. Tokens/s at batch 1 (the latency case speculative decoding is for) over the first --latency-prompts
   prompts at each temperature, and the batched throughput of the tau runs, both from the engine's decode
   timing (compile excluded).
4. Repetition: the share of repeated 4-grams in the last 64 tokens of each autoregressive output (a 4-gram
   position counts when the same 4 tokens already occurred earlier in those 64 tokens), mean over prompts,
   for greedy and sampled decoding and for the held-out text that actually follows each prompt (the
   reference: code repeats itself too).

The DDTree tree temperature per sampling temperature: --tree-temperature if given, else the checkpoint's
`extra.decoding.tree_temperature_by_sampling_temperature` entry for that temperature, else its
`extra.decoding.tree_temperature`, else 1.0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from typing import Optional

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


def heldout_prompts(tokenizer, count: int, length: int, seed: int = 0, reference_len: int = 0, pack=None):
    """`count` prompts of `length` tokens: round robin over the held-out files, each at a random offset
    (fixed seed) that starts a line where the file has one nearby. reference_len > 0: returns (prompts,
    references), each reference the <= reference_len tokens that follow its prompt in the file. pack: the
    held-out files of a corpus pack (corpus.build_pack) instead of this interpreter's."""
    docs = corpus.documents("eval", pack=pack)
    rng = np.random.default_rng(seed)
    encoded = [tokenizer.encode(d.text) for d in docs]
    prompts, refs = [], []
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
        refs.append(ids[start + length:start + length + reference_len])
    return (prompts, refs) if reference_len else prompts


def repeated_ngram_share(tokens, n: int = 4, window: int = 64) -> Optional[float]:
    """Share of the n-gram positions in the last `window` tokens whose n-gram already occurred earlier in that
    window (0: no repeats; a loop of period p gives ~1 - p / window). None when the window holds fewer than
    2 n-grams."""
    tail = list(tokens)[-window:]
    grams = [tuple(tail[i:i + n]) for i in range(len(tail) - n + 1)]
    if len(grams) < 2:
        return None
    seen, repeats = set(), 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def repetition(outputs, n: int = 4, window: int = 64) -> dict:
    """Mean repeated_ngram_share over sequences (those with a full window), and how many counted."""
    shares = [x for x in (repeated_ngram_share(t, n, window) for t in outputs) if x is not None]
    return {"mean": float(np.mean(shares)) if shares else None, "sequences": len(shares), "n": n, "window": window,
            "looping": int(sum(x >= 0.5 for x in shares))}


def tree_temperature_for(checkpoint: str, temperature: float) -> float:
    """The checkpoint's recommended DDTree tree temperature at this sampling temperature (see the docstring)."""
    try:
        with open(os.path.join(checkpoint, "kdtree_checkpoint.json")) as f:
            decoding = (json.load(f).get("extra") or {}).get("decoding") or {}
    except (OSError, ValueError):
        decoding = {}
    by_t = decoding.get("tree_temperature_by_sampling_temperature") or {}
    for key, value in by_t.items():
        if abs(float(key) - temperature) < 1e-9:
            return float(value)
    return recommended_tree_temperature(checkpoint)


def heldout_loss(target, tokenizer, seq_len: int, windows: int, batch: int = 8, pack=None) -> dict:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(tokenizer.path)
    eos = raw.token_to_id(EOS)
    parts = []
    for d in corpus.documents("eval", pack=pack):
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


def run_config(target, drafter, prompts, name, tree, budget, topk, max_new, impl, tree_temperature=1.0,
               temperature=0.0, top_p=1.0, seed=0):
    sampling = dict(temperature=temperature, top_p=top_p if temperature > 0 else 1.0, seed=seed)
    if tree == "ar":
        res = generate(target, None, prompts, max_new_tokens=max_new, budget=0, impl=impl, **sampling)
    else:
        res = generate(target, drafter, prompts, max_new_tokens=max_new, budget=budget, topk=topk, tree=tree,
                       tree_temperature=tree_temperature, impl=impl, **sampling)
    return res


def _t_label(t: float) -> str:
    return "greedy" if t == 0 else f"T={t:g}"


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
                   help="DDTree ranks prefixes by the drafter's probabilities at this temperature (< 1 sharpens), at every "
                        "sampling temperature; default: the checkpoint's recommendation per sampling temperature "
                        "(kdtree_checkpoint.json extra.decoding), else 1.0")
    p.add_argument("--temperatures", default="0,0.7",
                   help="sampling temperatures, comma-separated, reported side by side (0: greedy)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p filter of the sampled (temperature > 0) runs")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the temperature > 0 runs")
    p.add_argument("--prompt-seed", type=int, default=0,
                   help="offsets of the held-out prompts (0: the evaluation's; choose tree temperatures on others, e.g. 7 "
                        "as benchmarks/tree_temperature.py does)")
    p.add_argument("--corpus", default=None,
                   help="take the held-out files from this corpus pack (e.g. checkpoints/corpus_v2.jsonl.xz: this "
                        "repository's frozen held-out split) instead of this interpreter's standard library")
    p.add_argument("--compare-budget", type=int, default=32,
                   help="also run DDTree at this budget with tree temperature 1.0 (0: skip; greedy only)")
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
    temps = [float(t) for t in args.temperatures.split(",") if t.strip()]
    if not temps or any(t < 0 for t in temps):
        p.error(f"--temperatures must list temperatures >= 0; got {args.temperatures!r}")
    tree_temps = {t: (args.tree_temperature if args.tree_temperature is not None
                      else tree_temperature_for(args.checkpoint, t)) for t in temps}
    with open(os.path.join(args.checkpoint, "kdtree_checkpoint.json")) as f:
        meta = json.load(f)
    prompts, refs = heldout_prompts(tokenizer, args.prompts, args.prompt_len, seed=args.prompt_seed,
                                    reference_len=args.max_new, pack=args.corpus)
    budgets = [int(b) for b in args.budgets.split(",") if b]

    def configs_at(t):
        tt = tree_temps[t]
        cs = [("autoregressive", "ar", 0, 1.0)]
        cs += [] if args.no_chain else [("chain (DFlash)", "chain", drafter.cfg.depth, 1.0)]
        cs += [(f"DDTree budget {b}", "ddtree", b, tt) for b in budgets]
        if t == 0 and args.compare_budget and tt != 1.0:
            cs.append((f"DDTree budget {args.compare_budget}, tree temp. 1.0", "ddtree", args.compare_budget, 1.0))
        return cs

    result = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "device": f"{jax.default_backend()}: {jax.devices()[0].device_kind}, {os.cpu_count()} cores visible",
        "checkpoint": os.path.relpath(os.path.abspath(args.checkpoint), ROOT),
        "dtype": str(target.dtype), "prompts": len(prompts), "prompt_len": args.prompt_len,
        "max_new_tokens": args.max_new, "topk": args.topk, "tree_temperature": tree_temps.get(0.0, tree_temps[temps[0]]),
        "tree_temperatures": {str(t): tree_temps[t] for t in temps}, "temperatures": temps, "top_p": args.top_p,
        "seed": args.seed, "prompt_seed": args.prompt_seed, "corpus": args.corpus or "stdlib", "block_size": drafter.cfg.block_size,
        "configs": [], "latency": [], "repetition": {},
    }
    if not args.skip_loss:
        t = time.time()
        result["heldout"] = heldout_loss(target, tokenizer, args.seq_len, args.eval_windows, pack=args.corpus)
        print(f"held-out loss {result['heldout']['loss']:.4f} ppl {result['heldout']['perplexity']:.2f} "
              f"over {result['heldout']['tokens']} tokens ({time.time() - t:.0f} s)", flush=True)
    result["repetition"]["reference"] = repetition(refs)

    def write_partial():
        """The JSON so far (a run cut short by a time limit keeps its rows; the final write replaces it)."""
        if not args.no_write:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out + ".json", "w") as f:
                json.dump({**result, "partial": True, "seconds": time.time() - t_all}, f, indent=2)

    for temp in temps:
        ar_tokens = None
        for name, tree, budget, tree_temp in configs_at(temp):
            t = time.time()
            res = run_config(target, drafter, prompts, name, tree, budget, args.topk, args.max_new, args.impl, tree_temp,
                             temp, args.top_p, args.seed)
            st = res.stats
            if tree == "ar":
                ar_tokens = res.tokens
                result["repetition"][_t_label(temp)] = repetition(res.tokens)
            mismatches = (sum(a != b for a, b in zip(ar_tokens, res.tokens)) if temp == 0 else None)
            row = {"name": name, "tree": tree, "temperature": temp, "tree_temperature": tree_temp,
                   "budget": st["budget"], "num_nodes": st["num_nodes"],
                   "tau": st["tau"], "acceptance_by_depth": st["acceptance_by_depth"],
                   "batch_tokens_per_second": st["tokens_per_second"], "steps": st["steps"],
                   "new_tokens": st["new_tokens"], "mismatches_vs_ar": mismatches, "seconds": time.time() - t}
            result["configs"].append(row)
            write_partial()
            eq = f"mismatches {mismatches}/{len(prompts)}" if temp == 0 else "sampled"
            print(f"{_t_label(temp):7s} {name:22s} tau {st['tau']:.3f}  batch tok/s {st['tokens_per_second']:.1f}  "
                  f"{eq}  ({time.time() - t:.0f} s)", flush=True)
            if tree == "ar" and args.samples:
                result.setdefault("samples_by_temperature", {})[_t_label(temp)] = [
                    {"prompt": tokenizer.decode(prompts[i]), "continuation": tokenizer.decode(res.tokens[i])}
                    for i in range(min(args.samples, len(prompts)))]
                if temp == 0:
                    result["samples"] = result["samples_by_temperature"]["greedy"]
        rp = result["repetition"][_t_label(temp)]
        if rp["mean"] is not None:
            print(f"{_t_label(temp):7s} repeated 4-grams in the last 64 tokens: {rp['mean']:.3f} "
                  f"({rp['looping']}/{rp['sequences']} sequences >= 0.5)", flush=True)

    for temp in temps:
        for name, tree, budget, tree_temp in configs_at(temp):
            speeds, taus = [], []
            for pr in prompts[:args.latency_prompts]:
                res = run_config(target, drafter, [pr], name, tree, budget, args.topk, args.max_new, args.impl, tree_temp,
                                 temp, args.top_p, args.seed)
                speeds.append(res.stats["tokens_per_second"])
                taus.append(res.stats["tau"])
            if speeds:
                result["latency"].append({"name": name, "temperature": temp, "tokens_per_second": float(np.mean(speeds)),
                                          "tau": float(np.mean(taus)), "prompts": len(speeds)})
                write_partial()
                print(f"batch 1: {_t_label(temp):7s} {name:22s} {np.mean(speeds):.1f} tok/s (tau {np.mean(taus):.2f})",
                      flush=True)
    result["seconds"] = time.time() - t_all
    result["training"] = meta.get("extra", {})
    attach_h200(result, args.h200_results)
    if not args.no_write:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        with open(args.out + ".md", "w") as f:
            f.write(render(result))
        print(f"wrote {args.out}.md and .json")
    return 0


def attach_h200(result: dict, path: str) -> None:
    """Batch-1 rows of a GPU spec_decode run (every temperature), keyed by this report's config names."""
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        run = json.load(f)
    names = {"autoregressive": "autoregressive", "chain": "chain (DFlash)"}
    rows = []
    for row in run["rows"]:
        name = names.get(row["decoder"], f"DDTree budget {row['budget']}")
        rows.append({"name": name, "temperature": float(row.get("temperature", 0)),
                     "tokens_per_second": row["tokens_per_second"], "tau": row["tau"],
                     "speedup_vs_ar": row["speedup_vs_ar"]})
    m = run["meta"]
    result["h200"] = {"rows": rows, "source": f"`{os.path.relpath(path, ROOT)}` ({m.get('date', '')}, commit "
                      f"{m.get('commit', '?')})", "note": f"{m.get('prompts', '?')} prompts of {m.get('prompt_len', '?')} "
                      f"tokens, {m.get('max_new_tokens', '?')} new tokens, batch 1, tree temperature "
                      f"{m.get('tree_temperature', 1.0)}; its held-out prompts differ from this CPU's"}


def _rows_by_temperature(rows: list) -> dict:
    """{temperature: {name: row}} (rows without a temperature are greedy: reports before issue 26)."""
    out: dict = {}
    for row in rows:
        out.setdefault(float(row.get("temperature", 0.0)), {})[row["name"]] = row
    return out


def _fmt_rep(rp: Optional[dict]) -> str:
    if not rp or rp.get("mean") is None:
        return "–"
    return f"{rp['mean']:.3f} ({rp['looping']}/{rp['sequences']} ≥ 0.5)"


def render(r: dict) -> str:
    temps = [float(t) for t in r.get("temperatures", [0.0])]
    tree_temps = r.get("tree_temperatures") or {str(t): r.get("tree_temperature", 1.0) for t in temps}
    tt = [tree_temps.get(str(t), r.get("tree_temperature", 1.0)) for t in temps]
    tt_text = (f"{tt[0]}" if len(set(tt)) == 1 else
               " / ".join(f"{v} ({_t_label(t)})" for t, v in zip(temps, tt)))
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
    by_t = _rows_by_temperature(r["configs"])
    greedy = by_t.get(0.0, {})
    chains = {t: next((c for c in rows.values() if c["tree"] == "chain"), None) for t, rows in by_t.items()}
    sampled = [t for t in temps if t > 0]
    top_p = r.get("top_p", 1.0)
    title = "greedy" + "".join(f" and T = {t:g} (top-p {top_p:g})" for t in sampled)
    lines += [f"## Mean accepted length tau ({title})", "",
              f"{r['prompts']} held-out prompts of {r['prompt_len']} tokens, {r['max_new_tokens']} new tokens each, "
              f"one batch; drafter block size {r['block_size']} (depth {r['block_size'] - 1}), DDTree top-k "
              f"{r['topk']} per depth, tree temperature {tt_text}. tau = tokens emitted per target forward (accepted "
              "drafts + the bonus token), over all sequences' steps. Batch tok/s: the whole batch's new tokens per "
              "second of decode on this device (compile excluded). 'Equal to AR': sequences whose greedy output is "
              "identical to autoregressive greedy (a sampled run is an exact sample of the target, not comparable "
              "token for token)."
              + (f" Sampling seed {r.get('seed', 0)}." if sampled else ""), ""]
    head = "| decoding | tree nodes | tau | tau / chain tau | P(accept ≥1) | P(≥3) | batch tok/s | equal to AR |"
    sep = "|---|---|---|---|---|---|---|---|"
    for t in sampled:
        head += f" tau {_t_label(t)} | tau / chain {_t_label(t)} | P(≥1) {_t_label(t)} | batch tok/s {_t_label(t)} |"
        sep += "---|---|---|---|"
    lines += [head, sep]
    names = list(dict.fromkeys(c["name"] for c in r["configs"]))
    for name in names:
        c = greedy.get(name)
        if c is not None:
            acc = c["acceptance_by_depth"]
            a1 = f"{acc[0]:.2f}" if acc else "–"
            a3 = f"{acc[2]:.2f}" if len(acc) > 2 else "–"
            ch = chains.get(0.0)
            ratio = f"{c['tau'] / ch['tau']:.2f}" if ch and c["tree"] != "ar" else "–"
            mm = c.get("mismatches_vs_ar")
            eq = f"{r['prompts'] - mm}/{r['prompts']}" if mm is not None else "–"
            line = (f"| {name} | {c['num_nodes']} | {c['tau']:.2f} | {ratio} | {a1} | {a3} | "
                    f"{c['batch_tokens_per_second']:.1f} | {eq} |")
        else:
            any_row = next(rows[name] for rows in by_t.values() if name in rows)
            line = f"| {name} | {any_row['num_nodes']} | – | – | – | – | – | – |"
        for t in sampled:
            cs = by_t.get(t, {}).get(name)
            if cs is None:
                line += " – | – | – | – |"
                continue
            acc = cs["acceptance_by_depth"]
            ch = chains.get(t)
            ratio = f"{cs['tau'] / ch['tau']:.2f}" if ch and cs["tree"] != "ar" else "–"
            line += (f" {cs['tau']:.2f} | {ratio} | {f'{acc[0]:.2f}' if acc else '–'} | "
                     f"{cs['batch_tokens_per_second']:.1f} |")
        lines.append(line)

    lat = _rows_by_temperature(r["latency"])
    h200 = _rows_by_temperature(r.get("h200", {}).get("rows", []))
    lines += ["", "## Tokens/s at batch 1", ""]
    head = "| decoding |"
    sep = "|---|"
    for t in temps:
        lab = _t_label(t)
        head += f" {lab}: tok/s | {lab}: speed-up vs AR | {lab}: tau | H200 {lab}: tok/s |"
        sep += "---|---|---|---|"
    lines += [head, sep]
    lat_names = list(dict.fromkeys(l["name"] for l in r["latency"]))
    for name in lat_names:
        line = f"| {name} |"
        for t in temps:
            l = lat.get(t, {}).get(name)
            base = lat.get(t, {}).get("autoregressive")
            g = h200.get(t, {}).get(name)
            gpu = f"{g['tokens_per_second']:.0f} ({g['speedup_vs_ar']:.2f}×, tau {g['tau']:.2f})" if g else "not measured"
            if l is None:
                line += f" – | – | – | {gpu} |"
                continue
            up = f"{l['tokens_per_second'] / base['tokens_per_second']:.2f}×" if base else "–"
            line += f" {l['tokens_per_second']:.1f} | {up} | {l['tau']:.2f} | {gpu} |"
        lines.append(line)
    if r["latency"]:
        lines += ["", f"Mean over the first {r['latency'][0]['prompts']} prompts, decoded one at a time on this device."]
    if h200:
        lines += [f"H200 columns: {r['h200']['source']} ({r['h200']['note']})."]

    reps = r.get("repetition") or {}
    if reps:
        lines += ["", "## Repetition of the autoregressive samples", "",
                  "Share of repeated 4-grams in the last 64 tokens of each output (a 4-gram position counts when the same "
                  "4 tokens occurred earlier in those 64 tokens; 0 = no repeats, a tight loop ≈ 1), mean over the "
                  "prompts; in brackets the sequences at ≥ 0.5 (looping). Reference: the held-out text that actually "
                  "follows each prompt (up to the same number of tokens).", "",
                  "| text | repeated 4-grams, last 64 tokens |", "|---|---|"]
        for key in ["greedy"] + [_t_label(t) for t in sampled] + ["reference"]:
            if key in reps:
                label = {"greedy": "autoregressive greedy", "reference": "held-out reference text"}.get(
                    key, f"autoregressive {key}, top-p {top_p:g}")
                lines.append(f"| {label} | {_fmt_rep(reps[key])} |")

    ch0 = chains.get(0.0)
    t32 = next((c["tau"] for c in greedy.values() if c["tree"] == "ddtree" and c["budget"] == 32
                and "tree temp. 1.0" not in c["name"]), None)
    if t32 is not None and ch0:
        lines += ["", "## Targets", "",
                  f"- DDTree tau at budget 32 ≥ 3.5: **{'met' if t32 >= 3.5 else 'not met'}** ({t32:.2f}).",
                  f"- DDTree tau ≥ 1.25 × chain tau (budget 32): **{'met' if t32 >= 1.25 * ch0['tau'] else 'not met'}** "
                  f"({t32 / ch0['tau']:.2f}×).",
                  f"- Greedy speculative == greedy autoregressive: "
                  f"{sum(c.get('mismatches_vs_ar') == 0 for c in greedy.values())}/{len(greedy)} configurations "
                  "identical on every prompt."]
    if r.get("notes"):  # hand-written reading of a run, kept in its JSON so that re-rendering keeps it
        lines += [""] + r["notes"]
    samples = r.get("samples_by_temperature") or ({"greedy": r["samples"]} if r.get("samples") else {})
    for key, ss in samples.items():
        lines += ["", f"## Samples (autoregressive {key}{'' if key == 'greedy' else f', top-p {top_p:g}'}, {r['dtype']})", ""]
        for smp in ss:
            lines += ["Prompt:", "```python", smp["prompt"], "```", "Continuation:", "```python", smp["continuation"],
                      "```", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from kdtree_jax import runtime

    runtime.configure()  # on a GPU: the decode loop inside a CUDA graph (docs/usage.md, "Device-resident loop")
    sys.exit(main())
