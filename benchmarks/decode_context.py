"""The reference system's headline on our engine: one rank of K2 under TP8, decode steps at long context.

    python benchmarks/decode_context.py [--layers N] [--contexts 4096,16384,65536,131072,200000] [--nodes 9,33]
    python benchmarks/decode_context.py --smoke     # tiny widths, CPU, seconds

The `kimi-k2-tp8-rank` preset (K2's per-rank shapes under TP8: 8 heads, the whole latent cache, 1/8 of
every expert) with as many layers as fit (random bf16 weights made on the device), a replicated drafter,
the KV pool filled to L (fast fill: random latent rows written straight into the pool at scattered
slots; attention cost does not depend on the values), then the jitted speculative step — drafter, DDTree
of T nodes, verify forward, acceptance, commit — timed as the mean over K steps of one compiled
`lax.while_loop` (the engine's own decode loop), with the FFI kernel and with the XLA reference attention.

Per component, timed alone in jitted loops of the same shapes: attention (the verify op of every layer),
routed + shared MoE, the drafter pass, tree + acceptance + commit; "dense rest" is the step minus those.
Floors: bytes each must read over the copy bandwidth measured in the same run (KV rows; the weights of the
experts the router actually activated; every other weight read once). Writes
benchmarks/results/decode_context_<device>.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from components import attention_loop, median_seconds, moe_loop  # noqa: E402

import kdtree_jax
from kdtree_jax import kv_pool
from kdtree_jax.model.drafter import Drafter, DrafterConfig
from kdtree_jax.model.mla import AttentionBatch
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.ops.masks import causal_mask
from kdtree_jax.provenance import git_commit
from kdtree_jax.spec import accept as acceptance
from kdtree_jax.spec import engine
from kdtree_jax.spec import tree as trees


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def on_device(build):
    """Build a module with random weights directly on the device (never on the host)."""
    abstract = nnx.eval_shape(build)
    graphdef, _ = nnx.split(abstract)
    state = jax.jit(lambda: nnx.state(build()))()
    return nnx.merge(graphdef, state)


def param_bytes(module, skip_experts: bool = False) -> int:
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(module)):
        if skip_experts and "experts" in [str(p) for p in path]:
            continue
        if path[0] == "embed_tokens":  # a lookup reads T rows, not the table
            continue
        total += int(np.prod(var.get_value().shape)) * var.get_value().dtype.itemsize
    return total


def copy_bandwidth() -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB (1 MiB on CPU)."""
    n = (1 << 30) if jax.default_backend() == "gpu" else (1 << 19)
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda x: x + jnp.bfloat16(1))  # one read, one write
    jax.block_until_ready(f(x))
    times = []
    for _ in range(10):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / float(np.median(times))


def filled_state(target, drafter, context: int, nodes: int, steps: int, key):
    """A LoopState whose pool holds `context` random rows at scattered slots, room for `steps` more steps."""
    cfg = target.cfg
    max_len = context + (steps + 2) * (drafter.cfg.block_size + nodes)
    num_slots = max_len

    @jax.jit
    def make(key):
        k1, k2, k3 = jax.random.split(key, 3)
        pages = jax.random.normal(k1, (cfg.num_hidden_layers, num_slots, cfg.cache_dim), jnp.bfloat16)
        order = jax.random.permutation(k2, num_slots).astype(jnp.int32)
        table = order[None, :max_len]
        free = order[context:][::-1]  # the slots after the context's, on the free stack
        free = jnp.concatenate([free, jnp.zeros((num_slots - free.shape[0],), jnp.int32)])
        cache = kv_pool.KVCache(pages, free, jnp.asarray(num_slots - context, jnp.int32), table,
                                jnp.array([context], jnp.int32), jnp.asarray(False))
        feats = jax.random.normal(k3, (len(drafter.target_layer_ids), 1, context, cfg.hidden_size), jnp.bfloat16)
        dcache = drafter.extend_context(drafter.init_cache(1, max_len), feats, jnp.array([context], jnp.int32))
        return cache, dcache

    cache, dcache = make(key)
    width = drafter.cfg.block_size
    moe = [l.mlp for l in target.layers if l.is_moe]
    return engine.LoopState(cache, dcache, jnp.array([1], jnp.int32), jnp.full((1, steps + width + 1), -1, jnp.int32),
                            jnp.ones((1,), jnp.int32), jnp.ones((1,), bool), jnp.zeros((), jnp.int32),
                            jax.random.key(0), jnp.zeros((width,), jnp.int32), jnp.array([-1], jnp.int32),
                            engine.ExpertLoad.zeros(len(moe), moe[0].num_slots if moe else 0, 1))


def measure(target, drafter, context: int, nodes: int, steps: int, impl: str, bandwidth: float,
            shared: dict) -> dict:
    """One (L, T, impl) point. `shared` caches the parts whose cost does not depend on L or the attention
    impl (MoE, drafter, tree + accept + commit): timed once per T, which keeps the compiles few."""
    cfg = target.cfg
    spec = engine.SpecConfig(budget=nodes - 1, topk=8, max_new_tokens=steps, impl=impl)
    state = filled_state(target, drafter, context, nodes, steps, jax.random.key(context))
    loop = engine.decode_loop.lower(target, drafter, state, spec=spec).compile()
    copies = [jax.tree.map(jnp.copy, state) for _ in range(3)]  # the loop donates its state
    jax.block_until_ready(copies)
    times, final = [], None
    for s in copies:
        t = time.perf_counter()
        final = loop(target, drafter, s)
        jax.block_until_ready(final.num_out)
        times.append(time.perf_counter() - t)
    steps_run = int(final.step)
    step_s = float(np.median(times[1:])) / steps_run
    counts = np.asarray(final.expert_load.slot_tokens)  # [n_moe, E] tokens over the steps

    # Components alone -----------------------------------------------------------------------------
    # The timed loops donated their states; components get inputs of their own.
    fresh = filled_state(target, drafter, context, nodes, steps, jax.random.key(context + 1))
    cache, dcache = fresh.cache, fresh.dcache
    batch = AttentionBatch(cache.slot_table, jnp.array([context + nodes], jnp.int32), causal_mask(1, nodes),
                           cache.slot_table[:, context:context + nodes])
    q = jax.random.normal(jax.random.key(2), (1, nodes, cfg.num_attention_heads, cfg.cache_dim), jnp.bfloat16)
    iters = 8

    x = jax.random.normal(jax.random.key(3), (1, nodes, cfg.hidden_size), jnp.bfloat16)

    # Modules and caches are jit arguments, never closed over (a closure bakes them in as constants).
    @jax.jit
    def drafter_only(bonus, target, drafter, dcache, start):
        def body(i, bonus):
            lp = drafter(target, dcache, bonus, start)
            return jnp.argmax(lp[:, 0], -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, iters, body, bonus)

    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(4), (1, drafter.cfg.depth, cfg.vocab_size)), -1)
    top_lp, top_tok = jax.lax.top_k(lp, 8)
    logits = jax.random.normal(jax.random.key(5), (1, nodes, cfg.vocab_size), jnp.float32)

    @jax.jit
    def tree_accept_commit(cache, bonus, top_lp, top_tok, logits):
        def body(i, carry):
            cache, bonus = carry
            t = trees.build_ddtree(top_lp, top_tok, bonus, cache.seq_lens, nodes - 1)
            cache, slots = kv_pool.allocate(cache, nodes)
            cache = kv_pool.place(cache, slots)
            acc = acceptance.accept_greedy(t, logits)
            cache = kv_pool.commit_path(cache, slots, acc.path, acc.num_accepted * 0, jnp.ones((1,), bool))
            cache = cache._replace(seq_lens=cache.seq_lens - 1)  # stay at the same context length
            return cache, acc.bonus
        return jax.lax.fori_loop(0, iters, body, (cache, bonus))[1]

    t_attn = median_seconds(attention_loop(batch, impl, iters), q, cache.pages, target)[0] / iters
    if nodes not in shared:
        shared[nodes] = (
            median_seconds(moe_loop(iters), x, target)[0] / iters,
            median_seconds(drafter_only, jnp.array([1], jnp.int32), target, drafter, dcache, cache.seq_lens)[0] / iters,
            median_seconds(tree_accept_commit, cache, jnp.array([1], jnp.int32), top_lp, top_tok, logits)[0] / iters)
    t_moe, t_draft, t_tree = shared[nodes]

    kv_bytes = cfg.num_hidden_layers * (context + nodes) * cfg.cache_dim * 2
    expert_bytes_each = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    activated_per_layer = float(np.mean([(c > 0).sum() for c in counts])) / max(steps_run, 1)
    # Distinct experts over all steps / steps underestimates per-step activation; per step we need the
    # router's own count: tokens*topk is the upper bound, distinct-over-run/steps the lower bound.
    per_step_upper = min(nodes * cfg.num_experts_per_tok, cfg.n_routed_experts)
    moe_floor_low = cfg.num_moe_layers * activated_per_layer * expert_bytes_each / bandwidth
    moe_floor_high = cfg.num_moe_layers * per_step_upper * expert_bytes_each / bandwidth
    dense_bytes = param_bytes(target, skip_experts=True) + param_bytes(drafter)
    floors = {"attention_ms": kv_bytes / bandwidth * 1e3, "moe_ms_low": moe_floor_low * 1e3,
              "moe_ms_high": moe_floor_high * 1e3, "dense_ms": dense_bytes / bandwidth * 1e3}
    step_floor = floors["attention_ms"] + floors["moe_ms_low"] + floors["dense_ms"]
    return {
        "context": context, "nodes": nodes, "impl": impl, "steps": steps_run,
        "tau": float((np.asarray(final.accepted_hist) * (np.arange(final.accepted_hist.shape[0]) + 1)).sum()
                     / max(int(np.asarray(final.accepted_hist).sum()), 1)),
        "step_ms": step_s * 1e3, "attention_ms": t_attn * 1e3, "moe_ms": t_moe * 1e3, "drafter_ms": t_draft * 1e3,
        "tree_accept_commit_ms": t_tree * 1e3,
        "dense_rest_ms": (step_s - t_attn - t_moe - t_draft - t_tree) * 1e3,
        "attention_share": t_attn / step_s, "tree_share": t_tree / step_s,
        "floors": floors, "step_floor_ms": step_floor, "step_over_floor": step_s * 1e3 / step_floor,
        "moe_over_floor": t_moe * 1e3 / max(floors["moe_ms_low"], 1e-9),
        "distinct_experts_per_layer_over_run": float(np.mean([(c > 0).sum() for c in counts])),
        # Per-layer costs scaled to K2's 61 layers (1 dense + 60 MoE); drafter and tree are per step.
        "projected_61_layer_step_ms": ((step_s - t_draft - t_tree) / cfg.num_hidden_layers * 61 + t_draft + t_tree) * 1e3,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=0, help="target layers (0: as many as fit in memory)")
    p.add_argument("--contexts", default="4096,16384,65536,131072,200000")
    p.add_argument("--nodes", default="9,33")
    p.add_argument("--steps", type=int, default=16, help="speculative steps per timed loop")
    p.add_argument("--impls", default="auto,reference")
    p.add_argument("--reference-contexts", default="4096,65536",
                   help="contexts at which impls other than 'auto' also run ('all': every context)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    device = jax.devices()[0].device_kind
    cfg = kdtree_jax.ModelConfig.preset("kimi-k2-tp8-rank")
    dcfg = DrafterConfig(block_size=16, num_layers=2, num_heads=32, num_kv_heads=8, head_dim=128,
                         intermediate_size=12288)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.smoke:
        cfg = kdtree_jax.ModelConfig.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2)
        dcfg = DrafterConfig(block_size=4, num_layers=1, head_dim=16)
        contexts = [64]
    per_layer = 3 * cfg.n_routed_experts * cfg.hidden_size * cfg.moe_intermediate_size * 2 \
        + max(contexts) * cfg.cache_dim * 2
    stats = jax.devices()[0].memory_stats() or {}
    fit = int(max(2, min(61, 0.7 * stats.get("bytes_limit", 100e9) // per_layer)))
    layers = args.layers or (2 if args.smoke else fit)
    cfg = cfg.replace(num_hidden_layers=layers)
    # Every layer is its own code in the compiled step, so compile time grows with --layers; per-layer
    # costs do not change with the count, and the 61-layer step is projected from them.
    log(f"{device}: {layers} layers of {cfg.hidden_size} wide, {cfg.n_routed_experts} experts")
    target = on_device(lambda: Transformer(cfg, jnp.bfloat16, rngs=nnx.Rngs(0)))
    drafter = on_device(lambda: Drafter(cfg, dcfg, jnp.bfloat16, rngs=nnx.Rngs(1)))
    bandwidth = copy_bandwidth()
    log(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")

    rows = []
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   "decode_context_smoke" if args.smoke else "decode_context_h200")
    meta = {"date": datetime.date.today().isoformat(), "device": device, "layers": layers, "layers_that_fit": fit,
            "commit": git_commit(),
            "copy_bandwidth_TBps": bandwidth / 1e12, "preset": "tiny (smoke)" if args.smoke else "kimi-k2-tp8-rank",
            "fill": "random latent rows written straight into the pool at scattered slots (values do not change the cost)"}
    shared = {}
    for context in contexts:
        for nodes in [int(t) for t in args.nodes.split(",")]:
            for impl in args.impls.split(","):
                if impl != "auto" and args.reference_contexts != "all" and not args.smoke \
                        and str(context) not in args.reference_contexts.split(","):
                    continue
                try:
                    row = measure(target, drafter, context, nodes, args.steps, impl, bandwidth, shared)
                except Exception as e:  # e.g. the reference attention running out of memory at 200k
                    row = {"context": context, "nodes": nodes, "impl": impl, "error": f"{type(e).__name__}: {e}"[:300]}
                rows.append(row)
                log(json.dumps(row))
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with open(out + ".json", "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    write_markdown(out + ".md", meta, rows)


def write_markdown(path, meta, rows):
    lines = [f"# Decode steps at long context, {meta['preset']}, {meta['layers']} layers ({meta['device']})", "",
             f"{meta['date']}, commit {meta['commit']}; copy bandwidth {meta['copy_bandwidth_TBps']:.2f} TB/s. "
             f"Pool fill: {meta['fill']}. {meta['layers']} layers timed ({meta.get('layers_that_fit', '?')} would fit "
             "in 70% of memory; compile time grows with the layer count, per-layer costs do not).", "",
             "| L | T | attention | tau | step ms | attention ms (share) | MoE ms (floor) | drafter ms | tree+accept+commit ms (share) | dense rest ms | step / floor | 61 layers (projected) ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['nodes']} | {r['impl']} | {r['error']} |||||||||")
            continue
        f = r["floors"]
        lines.append(f"| {r['context']} | {r['nodes']} | {r['impl']} | {r['tau']:.2f} | {r['step_ms']:.3f} | {r['attention_ms']:.3f} "
                     f"({100 * r['attention_share']:.0f}%) | {r['moe_ms']:.3f} ({f['moe_ms_low']:.3f}–{f['moe_ms_high']:.3f}) | "
                     f"{r['drafter_ms']:.3f} | {r['tree_accept_commit_ms']:.3f} ({100 * r['tree_share']:.1f}%) | "
                     f"{r['dense_rest_ms']:.3f} | {r['step_over_floor']:.2f} | {r['projected_61_layer_step_ms']:.1f} |")
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
