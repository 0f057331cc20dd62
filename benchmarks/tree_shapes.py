"""Tree-shape research sweeps: DDTree budget x top-K, static branching shapes, and the best static shape
a dynamic program finds from measured acceptance rates (Sequoia-style), all on held-out prompts.

    python benchmarks/tree_shapes.py                          # checkpoints/default, the full sweep
    python benchmarks/tree_shapes.py --budgets 16,64 --topk 4 --shapes "2,2,1;4,1"
    python benchmarks/tree_shapes.py --smoke                  # random tiny pair, CPU, well under a minute

What is swept (greedy decoding; τ = tokens per target forward, bonus included):
  * DDTree at every --budgets value for every --topk K (the best-first tree over the drafter's top-K
    per depth); autoregressive and chain (DFlash) as references;
  * static shapes (--shapes, "auto" = a family of wide-at-the-root shapes): branching (b_1, ..., b_L)
    means every node at depth d - 1 gets the drafter's top-b_d tokens of depth d as children;
  * the DP-optimal static shape for each budget (below).
The depth of every tree is bounded by the drafter: the block size (bonus + D = block_size - 1 drafted
positions) is fixed by the trained drafter and is *not* swept — the drafter predicts exactly D positions
per pass, so static shapes have at most D levels.

Every configuration is one compiled decode loop (shapes are static): all prompts are decoded as one
batch with one padded shape (or in equal batches of --batch), so one compile serves every prompt; a
persistent XLA compilation cache (--cache-dir) makes a rerun of the same sweep compile nothing.
tok/s here is the batched throughput (decode only: the engine compiles ahead of time; --warmup times a
second call instead of the first); spec_decode.py measures batch-1 latency.

The DP-optimal static shape
---------------------------
1. Measure p[d][r]: greedy-continue --measure-prompts held-out prompts (other cuts of the held-out
   files than the evaluation prompts) with the target, run the target over prompt + continuation
   (teacher forcing: kdtree_jax.decode.causal_forward) for its hidden features, run the drafter through
   its inference path at every anchor c of the continuation (context = features of [0, c), block =
   [token c, MASK...]) and record where the target's greedy token at c + d ranks among the drafter's
   depth-d proposals. Because the continuation *is* the target's greedy output, the prefix before depth
   d is always the one the target would have accepted: p[d][r] = P(the target's token at depth d is the
   drafter's rank-r proposal | the path so far is right).
2. A static shape b contains the target's path to depth d iff rank_{d'} < b_{d'} for every d' <= d
   (the DFlash drafter proposes every depth in one pass, so depth d's candidates do not depend on the
   tokens chosen above it). Assuming the depths independent,
       E[accepted] = sum_d prod_{d' <= d} S_{d'}(b_{d'}),   S_d(b) = sum_{r < b} p[d][r],
   maximised by a DP over (depth, nodes at the current depth, budget left) subject to
   sum_d prod_{d' <= d} b_{d'} <= budget and b_d <= K (--dp-topk).
   The independence assumption is the weak point: easy text makes all depths right together and hard
   text all wrong, so the true joint probability of a long path is usually *higher* than the product of
   the marginals, and the DP undervalues depth. For every configuration the results give three
   predictions next to the measured τ: "independent" (the DP's objective), "joint" (1 + mean accepted
   length over all anchors, from the measured rank vectors: no independence) and "replay" (greedy
   decoding replayed over the measured sequences, each step starting where the previous one ended:
   tokens / steps, exactly what the engine would report on those sequences — anchors are weighted as
   decode steps visit them, not uniformly). DDTree gets joint and replay predictions too (each anchor's
   tree built from the drafter's teacher-forced top-K log-probs), so prediction-vs-measurement gaps are
   comparable across tree kinds.

Writes <out>/tree_shapes_<device>.{csv,json,md} and tree_shapes_<device>_{tau,tokens_per_second,
acceptance}.png (--smoke: tree_shapes_smoke_<device>*), with device kind, date and commit.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import sys
import tempfile
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import spec_decode as common  # noqa: E402  (benchmarks/spec_decode.py: prompts, pair loading, stats)

from kdtree_jax.checkpoint import add_dtype_argument  # noqa: E402
from kdtree_jax.model.drafter import DrafterCache  # noqa: E402
from kdtree_jax.speculative import tree as trees  # noqa: E402
from kdtree_jax.decode import causal_forward  # noqa: E402
from kdtree_jax.speculative.engine import generate  # noqa: E402
from kdtree_jax.speculative.tree_shapes import (accepted_ddtree, accepted_static, optimal_shape,  # noqa: E402
                                                predicted_tau_independent, rank_probs, shape_nodes, shape_str,
                                                tau_anchor_mean, tau_replay)

CSV_COLUMNS = ["kind", "shape", "topk", "budget", "nodes", "tau", "tokens_per_second", "speedup_vs_ar",
               "target_forwards", "sequence_steps", "new_tokens", "decode_seconds", "compile_seconds",
               "predicted_tau_independent", "predicted_tau_joint", "predicted_tau_replay", "acceptance_by_depth"]


# Shapes ---------------------------------------------------------------------------------------------
def auto_shapes(depth: int, max_nodes: int, kmax: int) -> list[tuple]:
    """Wide near the root, a chain below: the family most static-tree papers search over."""
    heads = [(2,), (4,), (2, 2), (4, 2), (2, 2, 2), (8, 2, 2)]
    out = []
    for head in heads:
        if len(head) > depth or max(head) > kmax:
            continue
        for length in sorted({depth, max(len(head), (depth + 1) // 2)}):
            shape = head + (1,) * (length - len(head))
            if shape_nodes(shape) <= max_nodes and shape not in out:
                out.append(shape)
    return out


def parse_shapes(text: str, depth: int, max_nodes: int, kmax: int) -> list[tuple]:
    if text.strip() == "auto":
        return auto_shapes(depth, max_nodes, kmax)
    shapes = []
    for part in text.split(";"):
        if not part.strip():
            continue
        shape = tuple(int(b) for b in part.replace("(", "").replace(")", "").split(",") if b.strip())
        if not shape or len(shape) > depth or min(shape) < 1:
            raise ValueError(f"--shapes: {part!r} must be 1..{depth} positive branching factors (D = block_size - 1 "
                             f"= {depth} is fixed by the drafter)")
        shapes.append(shape)
    return shapes


# Teacher-forced acceptance rates --------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("kmax",))
def _anchor_ranks(target, drafter, tokens, anchors, kmax: int):
    """tokens [B, S] (prompt + the target's greedy continuation), anchors [B, A] block starts c.

    Returns per anchor and depth d = 1..D: the rank of tokens[c + d] among the drafter's depth-d
    log-probs (0 = its top-1), the drafter's top-kmax log-probs, and whether the teacher-forced target's
    argmax at c + d - 1 equals tokens[c + d] (numerics check of the continuation).
    """
    b, s = tokens.shape
    a = anchors.shape[1]
    depth = drafter.cfg.depth
    out = causal_forward(target, tokens, hidden_layers=drafter.target_layer_ids)
    pred = jnp.argmax(out.logits, -1).astype(jnp.int32)
    cache = drafter.extend_context(drafter.init_cache(b, s), out.hidden, jnp.full((b,), s, jnp.int32))
    flat_c = anchors.reshape(-1)
    rep = lambda x: jnp.repeat(x, a, axis=1)  # [L, B, ...] -> [L, B*A, ...]
    cache = DrafterCache(rep(cache.k), rep(cache.v), flat_c)  # context = positions [0, c)
    rows = jnp.repeat(jnp.arange(b), a)
    logq = drafter(target, cache, tokens[rows, flat_c], flat_c)  # [B*A, D, V]
    pos = flat_c[:, None] + jnp.arange(1, depth + 1)[None, :]
    labels = tokens[rows[:, None], pos]
    label_lp = jnp.take_along_axis(logq, labels[..., None], axis=-1)
    # Ties (bf16 logits have many) broken as lax.top_k breaks them in the engine: lower token id first.
    vocab_ids = jnp.arange(logq.shape[-1], dtype=jnp.int32)
    ahead = (logq > label_lp) | ((logq == label_lp) & (vocab_ids < labels[..., None]))
    rank = ahead.sum(-1).astype(jnp.int32)
    top_lp = jax.lax.top_k(logq, kmax)[0]
    agree = pred[rows[:, None], pos - 1] == labels
    return rank.reshape(b, a, depth), top_lp.reshape(b, a, depth, kmax), agree.reshape(b, a, depth)


def teacher_forced(target, drafter, prompts, new_tokens: int, kmax: int, chunk: int, topk_ar: int) -> dict:
    """Rank of the target's greedy token among the drafter's proposals, at every anchor of the greedy
    continuations of `prompts` (see the module docstring). Returns ranks [N, D], top_lp [N, D, kmax]."""
    depth = drafter.cfg.depth
    if new_tokens <= depth:
        raise ValueError(f"--measure-new-tokens must be > D = {depth} (one full block after the prompt)")
    # The sweep's loop settings (common.run_config: DEFAULT_CHUNK_STEPS steps a chunk): where the shapes agree, as in
    # --smoke, this greedy run is the sweep's autoregressive program, compiled once.
    res = generate(target, None, [p.tolist() for p in prompts], max_new_tokens=new_tokens, budget=0, topk=topk_ar,
                   chunk_steps=common.DEFAULT_CHUNK_STEPS)
    seqs = np.stack([np.concatenate([p, np.asarray(t, np.int32)]) for p, t in zip(prompts, res.tokens)])
    plen = len(prompts[0])
    anchors = np.arange(plen, seqs.shape[1] - depth, dtype=np.int32)  # c + D <= S - 1
    ranks, tops, agree = [], [], []
    n = len(seqs)
    for i in range(0, n, chunk):
        part = seqs[i:i + chunk]
        real = len(part)
        if real < chunk:  # one compiled shape: pad with copies, drop their results
            part = np.concatenate([part, np.repeat(part[:1], chunk - real, axis=0)])
        r, t, g = _anchor_ranks(target, drafter, jnp.asarray(part), jnp.asarray(np.tile(anchors, (chunk, 1))), kmax=kmax)
        ranks.append(np.asarray(r)[:real])
        tops.append(np.asarray(t)[:real])
        agree.append(np.asarray(g)[:real])
    ranks, tops, agree = np.concatenate(ranks), np.concatenate(tops), np.concatenate(agree)
    return {"ranks": ranks, "top_lp": tops, "agreement": float(agree.mean()), "anchors": int(ranks.shape[0] * ranks.shape[1]),
            "sequences": int(n), "anchors_per_sequence": int(len(anchors))}


# Runs -----------------------------------------------------------------------------------------------
def run(target, drafter, prompt_batches, *, tree, budget, topk, max_new_tokens, impl, seed, warmup,
        tree_temperature: float = 1.0) -> dict:
    stats, _ = common.run_config(target, drafter, prompt_batches, tree=tree, budget=budget, topk=topk,
                                 temperature=0.0, top_k=0, top_p=1.0, seed=seed, max_new_tokens=max_new_tokens,
                                 impl=impl, warmup=warmup, tree_temperature=tree_temperature)
    return stats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=common.DEFAULT_CHECKPOINT, help="kdtree_jax checkpoint with a target and a drafter")
    add_dtype_argument(p)
    p.add_argument("--prompts", type=int, default=16, help="held-out evaluation prompts")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per evaluation prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per evaluation prompt")
    p.add_argument("--batch", type=int, default=0, help="prompts per decode batch (0: all in one); must divide --prompts")
    p.add_argument("--budgets", default="8,16,32,64,128,256", help="tree nodes besides the root")
    p.add_argument("--topk", dest="topks", default="2,4,8",
                   help="drafter candidates per depth for DDTree: one value or several, comma-separated")
    p.add_argument("--topks", dest="topks", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # old spelling
    common.add_tree_temperature_argument(p)
    p.add_argument("--shapes", default="auto", help='static shapes "b1,b2,...;..." or "auto"')
    p.add_argument("--dp-topk", type=int, default=0, help="widest branching the DP may use (0: max of --topk)")
    p.add_argument("--measure-prompts", type=int, default=32, help="held-out prompts for the teacher-forced p[d][r]")
    p.add_argument("--measure-new-tokens", type=int, default=64, help="greedy tokens after each measurement prompt")
    p.add_argument("--measure-batch", type=int, default=4, help="sequences per teacher-forced drafter pass")
    p.add_argument("--measure-start", type=int, default=-1,
                   help="index of the first measurement prompt (default: right after the evaluation prompts, so the "
                        "two sets are cut at other offsets; 0 with --measure-prompts = --prompts and "
                        "--measure-new-tokens = --max-new-tokens + D - 1 makes the replay predict the measured τ "
                        "exactly: a check of the prediction pipeline)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts' offsets")
    p.add_argument("--impl", default="auto", help="verify-attention implementation")
    p.add_argument("--cache-dir", default="~/.cache/kdtree_jax/jax_compilation_cache",
                   help="persistent XLA compilation cache ('' to disable)")
    p.add_argument("--warmup", action="store_true",
                   help="time a second call of every configuration (default: the first call after the ahead-of-time "
                        "compile is timed; tau does not depend on it)")
    p.add_argument("--no-plots", action="store_true", help="write no plots (the JSON and markdown only)")
    p.add_argument("--out", default=None, help="output directory (default: benchmarks/results; --smoke: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="random tiny pair on CPU: 2 prompts x 8 tokens, budgets 4,8")
    return p


SMOKE_DEFAULTS = (("--prompts", 2), ("--prompt-len", 24), ("--max-new-tokens", 8), ("--budgets", "4,8"),
                  ("--topk", "4"), ("--shapes", "2,1,1"), ("--measure-prompts", 2), ("--measure-new-tokens", 8),
                  ("--measure-batch", 2))


def main(argv=None) -> int:
    from tqdm import tqdm

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.smoke:
        given = {a.split("=")[0] for a in argv} | ({"--topk"} if "--topks" in argv else set())  # the old spelling
        for flag, value in SMOKE_DEFAULTS:
            if flag not in given:
                setattr(args, {"--topk": "topks"}.get(flag, flag[2:].replace("-", "_")), value)
    out_dir = args.out or (tempfile.mkdtemp(prefix="tree_shapes_smoke_") if args.smoke else common.DEFAULT_OUT)
    common.enable_compilation_cache(args.cache_dir)

    t_all = time.perf_counter()
    target, drafter, tokenizer, pair = common.load_pair(args)
    common.resolve_tree_temperature(args)
    depth = drafter.cfg.depth
    budgets = sorted({int(b) for b in str(args.budgets).split(",") if b.strip()})
    topks = [int(k) for k in str(args.topks).split(",") if k.strip()]
    if not budgets or min(budgets) < 1 or not topks or min(topks) < 1:
        raise ValueError(f"--budgets and --topk must be positive integers; got {args.budgets!r}, {args.topks!r}")
    dp_topk = args.dp_topk or max(topks)
    shapes = parse_shapes(args.shapes, depth, max(budgets), max(8, dp_topk))
    kmax = max([dp_topk] + topks + [max(s) for s in shapes])
    batch = args.batch or args.prompts
    if args.prompts % batch:
        raise ValueError(f"--batch ({batch}) must divide --prompts ({args.prompts}): every batch has one shape")
    prompts, where = common.heldout_prompts(tokenizer, args.prompts, args.prompt_len)
    prompt_batches = common.batches([p.tolist() for p in prompts], batch)
    base_topk = topks[0]

    meta = common.base_meta(args, target, drafter, pair)
    meta["tree_temperature"] = args.tree_temperature
    meta.update({"prompts": len(prompts), "prompt_len": args.prompt_len, "prompt_cuts": where,
                 "max_new_tokens": args.max_new_tokens, "batch": batch, "budgets": budgets, "topks": topks,
                 "dp_topk": dp_topk, "depth": depth, "temperature": 0.0, "impl": args.impl, "warmup": args.warmup,
                 "block_size_note": f"block size {drafter.cfg.block_size} (D = {depth} drafted depths) is fixed "
                                    "by the trained drafter and is not swept"})
    log = common.log
    log(f"{meta['device']} ({meta['backend']}): {pair}; D = {depth}; {len(prompts)} prompts in batches of {batch}")

    # 1. Teacher-forced acceptance rates and the DP shapes -------------------------------------------
    t = time.perf_counter()
    mstart = args.prompts if args.measure_start < 0 else args.measure_start
    mprompts, mwhere = common.heldout_prompts(tokenizer, args.measure_prompts, args.prompt_len, start=mstart)
    tf = teacher_forced(target, drafter, mprompts, args.measure_new_tokens, kmax, args.measure_batch, base_topk)
    p = rank_probs(tf["ranks"], kmax)
    dp = []
    for b in budgets:
        shape, value = optimal_shape(p, b, dp_topk)
        dp.append({"budget": b, "shape": list(shape), "nodes": shape_nodes(shape) if shape else 0,
                   "predicted_tau_independent": 1.0 + value,
                   "predicted_tau_joint": tau_anchor_mean(accepted_static(tf["ranks"], shape)),
                   "predicted_tau_replay": tau_replay(accepted_static(tf["ranks"], shape))})
    measurement = {"sequences": tf["sequences"], "anchors": tf["anchors"], "anchors_per_sequence": tf["anchors_per_sequence"],
                   "new_tokens": args.measure_new_tokens, "prompt_cuts": mwhere, "kmax": kmax,
                   "greedy_agreement": tf["agreement"], "p": p.round(5).tolist(),
                   "p_miss": (1.0 - p.sum(1)).round(5).tolist(), "seconds": time.perf_counter() - t}
    log(f"teacher-forced: {tf['anchors']} anchors, p[d][0] = {np.round(p[:, 0], 3).tolist()}; "
        f"DP shapes: {[(d['budget'], shape_str(d['shape'])) for d in dp]} ({measurement['seconds']:.0f} s)")

    # 2. The sweep -------------------------------------------------------------------------------------
    plan = [("autoregressive", "ar", base_topk, 0, None), ("chain", "chain", base_topk, 0, (1,) * depth)]
    for k in topks:
        limit = trees.max_ddtree_budget(depth, k)
        plan += [("ddtree", "ddtree", k, b, None) for b in budgets if b <= limit]
    static = [s for s in shapes]
    for d in dp:
        if d["shape"] and tuple(d["shape"]) not in static:
            static.append(tuple(d["shape"]))
    for s in static:
        if s == (1,) * depth:
            continue  # that is the chain
        plan.append(("static", s, max(s), shape_nodes(s), s))

    rows, ar_tps = [], None
    bar = tqdm(plan, unit="config", dynamic_ncols=True, file=sys.stderr)
    for kind, tree, k, b, shape in bar:
        bar.set_description(f"{kind} {shape_str(shape) if kind == 'static' else b} K={k}")
        stats = run(target, drafter, prompt_batches, tree=tree, budget=b if kind == "ddtree" else 0, topk=k,
                    max_new_tokens=args.max_new_tokens, impl=args.impl, seed=args.seed, warmup=args.warmup,
                    tree_temperature=args.tree_temperature)
        if kind == "autoregressive":
            ar_tps = stats["tokens_per_second"]
        row = {"kind": kind, "shape": shape_str(shape) if shape else "", "topk": k, "budget": b,
               "nodes": stats["num_nodes"] - 1, **{c: stats[c] for c in ("tau", "tokens_per_second", "target_forwards",
                                                                            "sequence_steps", "new_tokens", "decode_seconds",
                                                                            "compile_seconds", "acceptance_by_depth")},
               "speedup_vs_ar": stats["tokens_per_second"] / ar_tps if ar_tps else float("nan"),
               "predicted_tau_independent": None, "predicted_tau_joint": None, "predicted_tau_replay": None,
               "dp_optimal_for": [d["budget"] for d in dp if shape is not None and tuple(d["shape"]) == shape]}
        if shape is not None:
            row["predicted_tau_independent"] = predicted_tau_independent(p, shape)
            accepted = accepted_static(tf["ranks"], shape)
        elif kind == "ddtree":
            accepted = accepted_ddtree(tf["ranks"], tf["top_lp"], b, k)
        else:
            accepted = np.zeros(tf["ranks"].shape[:-1], np.int64)
            row["predicted_tau_independent"] = 1.0
        row["predicted_tau_joint"] = tau_anchor_mean(accepted)
        row["predicted_tau_replay"] = tau_replay(accepted)
        rows.append(row)
        tqdm.write(f"{kind:14s} {row['shape'] or b!s:>12} K={k}  nodes {row['nodes']:4d}  tau {stats['tau']:.3f}  "
                   f"{stats['tokens_per_second']:9.1f} tok/s  (compile {stats['compile_seconds']:.1f} s)",
                   file=sys.stderr)
    bar.close()

    # 3. DP shape vs DDTree at the same budget ---------------------------------------------------------
    for d in dp:
        srow = next((r for r in rows if d["shape"] and r["shape"] == shape_str(d["shape"])), None)
        d["measured_tau"] = srow["tau"] if srow else None
        d["measured_tokens_per_second"] = srow["tokens_per_second"] if srow else None
        d["ddtree"] = {str(r["topk"]): {"tau": r["tau"], "predicted_tau_joint": r["predicted_tau_joint"],
                                        "predicted_tau_replay": r["predicted_tau_replay"],
                                        "tokens_per_second": r["tokens_per_second"]}
                       for r in rows if r["kind"] == "ddtree" and r["budget"] == d["budget"]}
    meta["seconds"] = time.perf_counter() - t_all

    name = f"tree_shapes_{'smoke_' if args.smoke else ''}{common.device_slug()}"
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, name)
    result = common._clean({"meta": meta, "measurement": measurement, "dp": dp, "rows": rows,
                            "independence_assumption": INDEPENDENCE})
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1, allow_nan=False)
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in result["rows"]:
            w.writerow({**r, "acceptance_by_depth": ";".join(f"{a:.4f}" for a in r["acceptance_by_depth"])})
    plots = [] if args.no_plots else make_plots(base, result)
    result["plots"] = [os.path.basename(x) for x in plots]
    with open(base + ".md", "w") as f:
        f.write(render(result))
    log(f"wrote {base}.{{csv,json,md}}{' + ' + str(len(plots)) + ' plots' if plots else ''} ({meta['seconds']:.0f} s)")
    return 0


INDEPENDENCE = (
    "The DP treats the events 'the target's token at depth d is among the drafter's top-b_d' as independent "
    "across depths, with marginals p[d][r] measured with teacher forcing (the prefix before depth d is the "
    "target's own greedy path). Real acceptances are positively correlated (easy stretches are easy at every "
    "depth), so the product of marginals underestimates deep paths and the DP undervalues depth. Two further "
    "predictions drop the assumption: 'joint' = 1 + the mean accepted length over all anchors from the measured "
    "rank vectors (no independence, but every position weighs the same), and 'replay' = greedy decoding "
    "replayed over the measured sequences (a step starts where the previous one ended: tokens / steps, what the "
    "engine reports on those sequences; decoding strides through easy stretches in few steps, so 'joint' "
    "overstates τ when acceptance varies along the text). The DP optimises the independent objective, as "
    "Sequoia does; the replay is the honest yardstick for comparing its shape with DDTree.")


# Plots ----------------------------------------------------------------------------------------------
def make_plots(base: str, result: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, m = result["rows"], result["meta"]
    title = f"{m['pair']} on {m['device']}, block size {m['block_size']}"
    paths = []
    for key, label, fname in (("tau", "τ (tokens per target forward)", "tau"),
                              ("tokens_per_second", "tokens/s (batched, decode only)", "tokens_per_second")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for k in m["topks"]:
            sub = sorted((r for r in rows if r["kind"] == "ddtree" and r["topk"] == k), key=lambda r: r["nodes"])
            if sub:
                ax.plot([r["nodes"] for r in sub], [r[key] for r in sub], "o-", label=f"DDTree K={k}")
        st = [r for r in rows if r["kind"] == "static" and not r["dp_optimal_for"]]
        if st:
            ax.scatter([r["nodes"] for r in st], [r[key] for r in st], marker="s", c="gray", label="static shapes")
        dp = sorted((r for r in rows if r["kind"] == "static" and r["dp_optimal_for"]), key=lambda r: r["nodes"])
        if dp:
            ax.plot([r["nodes"] for r in dp], [r[key] for r in dp], "D--", c="tab:red", label="DP-optimal static")
            if key == "tau":
                ax.plot([r["nodes"] for r in dp], [r["predicted_tau_independent"] for r in dp], ":", c="tab:red",
                        label="DP shape, predicted (independent)")
                ax.plot([r["nodes"] for r in dp], [r["predicted_tau_replay"] for r in dp], "-.", c="tab:red", alpha=0.6,
                        label="DP shape, predicted (replay)")
        for kind, marker in (("chain", "^"), ("autoregressive", "x")):
            r = next((r for r in rows if r["kind"] == kind), None)
            if r and r[key] is not None:
                ax.scatter([max(r["nodes"], 1)], [r[key]], marker=marker, s=60, c="k", zorder=5,
                           label=kind if r["nodes"] else f"{kind} (0 nodes, drawn at 1)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes besides the root (budget)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = f"{base}_{fname}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    kbest = max(m["topks"])
    cmap = plt.get_cmap("viridis")
    sub = sorted((r for r in rows if r["kind"] == "ddtree" and r["topk"] == kbest), key=lambda r: r["nodes"])
    for i, r in enumerate(sub):
        ax.plot(range(1, len(r["acceptance_by_depth"]) + 1), r["acceptance_by_depth"], "o-", ms=3,
                c=cmap(i / max(len(sub) - 1, 1)), label=f"DDTree {r['budget']} (K={kbest})")
    for r in rows:
        if r["kind"] == "chain":
            ax.plot(range(1, len(r["acceptance_by_depth"]) + 1), r["acceptance_by_depth"], "k^--", ms=4, label="chain")
    ax.set_xlabel("depth d")
    ax.set_ylabel("P(≥ d drafted tokens accepted)")
    ax.set_title("measured acceptance by depth", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[1]
    p = np.asarray(result["measurement"]["p"])
    im = ax.imshow(p.T, aspect="auto", origin="lower", cmap="magma", extent=(0.5, p.shape[0] + 0.5, -0.5, p.shape[1] - 0.5))
    fig.colorbar(im, ax=ax)
    ax.set_xlabel("depth d")
    ax.set_ylabel("drafter rank r")
    ax.set_title("teacher-forced p[d][r] = P(target's token = drafter's rank r)", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = f"{base}_acceptance.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


# Markdown -------------------------------------------------------------------------------------------
def render(result: dict) -> str:
    m, meas, rows, dp = result["meta"], result["measurement"], result["rows"], result["dp"]
    f = common._fmt
    lines = [f"# Tree shapes: DDTree budget × top-K, static shapes, DP-optimal static shape ({m['device']})", "",
             f"{m['date']}, commit {m['commit']}, jax {m['jax']} ({m['backend']}, {m['cpu_count']} CPU cores visible). "
             f"Pair: {m['pair']} (target {m['target_dtype']}). {m['block_size_note']}.", "",
             f"{m['prompts']} held-out prompts of {m['prompt_len']} tokens, {m['max_new_tokens']} greedy tokens each, "
             f"decoded in batches of {m['batch']} (one compile per configuration). tok/s: batched throughput, "
             f"decode only{' (second call)' if m.get('warmup') else ' (first call after the ahead-of-time compile)'}. τ: tokens per target forward (bonus included).", "",
             f"Command: `{m['command']}` ({m['seconds'] / 60:.1f} min).", "",
             "## DP-optimal static shape vs DDTree at the same budget", "",
             f"p[d][r] measured with teacher forcing on {meas['sequences']} other held-out prompts continued greedily "
             f"by the target ({meas['anchors']} anchors, {meas['anchors_per_sequence']} per sequence; the "
             f"teacher-forced target's argmax agrees with the engine's greedy continuation on "
             f"{100 * meas['greedy_agreement']:.1f}% of labels). DP over branching b_d <= {m['dp_topk']}.", "",
             "| budget | DP shape | nodes | predicted τ: independent / joint / replay | measured τ | " +
             " | ".join(f"DDTree K={k} measured τ (replay)" for k in m["topks"]) + " |",
             "|---|---|---|---|---|" + "---|" * len(m["topks"])]
    for d in dp:
        cells = [str(d["budget"]), f"`{tuple(d['shape'])}`" if d["shape"] else "–", str(d["nodes"]),
                 f"{f(d['predicted_tau_independent'], '.3f')} / {f(d['predicted_tau_joint'], '.3f')} / "
                 f"{f(d['predicted_tau_replay'], '.3f')}", f(d["measured_tau"], ".3f")]
        for k in m["topks"]:
            dd = d["ddtree"].get(str(k))
            cells.append(f"{f(dd['tau'], '.3f')} ({f(dd['predicted_tau_replay'], '.3f')})" if dd else "–")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Independence assumption: {result['independence_assumption']}", "",
              "## Every configuration", "",
              "| kind | shape | K | nodes | τ | predicted τ: indep. / joint / replay | tok/s | speed-up vs AR | acceptance by depth |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_by_depth"][:8]) + (" …" if len(r["acceptance_by_depth"]) > 8 else "")
        lines.append(f"| {r['kind']}{' (DP ' + ','.join(map(str, r['dp_optimal_for'])) + ')' if r['dp_optimal_for'] else ''} "
                     f"| {r['shape'] or '–'} | {r['topk']} | {r['nodes']} | {f(r['tau'], '.3f')} | "
                     f"{f(r['predicted_tau_independent'], '.3f')} / {f(r['predicted_tau_joint'], '.3f')} / "
                     f"{f(r['predicted_tau_replay'], '.3f')} | "
                     f"{f(r['tokens_per_second'], '.1f')} | {f(r['speedup_vs_ar'], '.2f')}× | {acc} |")
    p = np.asarray(meas["p"])
    shown = min(p.shape[1], 8)
    lines += ["", "## Teacher-forced p[d][r] (rows: depth d; columns: drafter rank r; last: P(rank >= K))", "",
              "| d | " + " | ".join(f"r={r}" for r in range(shown)) + f" | ≥{p.shape[1]} |",
              "|---|" + "---|" * (shown + 1)]
    for d in range(p.shape[0]):
        lines.append(f"| {d + 1} | " + " | ".join(f"{x:.3f}" for x in p[d, :shown]) + f" | {meas['p_miss'][d]:.3f} |")
    if result.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{x}]({x})" for x in result["plots"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
