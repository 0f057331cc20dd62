"""Where a row-invariant verify pass's root row first leaves the one-token step (issue 24), layer by layer.

The embedded default pair in bfloat16: B held-out prompts prefilled, then (a) the one-token step on each prompt's
greedy next token and (b) a T-node verify pass (that token as the root, random tokens under random parents, a wider
slot table, as the engine's speculative loops have), both with `row_invariant=True`. Compares, bit for bit, the root
row's hidden features after every layer and its logits, and the attention op alone at the pair's geometry (one-token
call against the T-row call on the same pool, the invariant split policy). Prints one JSON object.

    XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0 --xla_allow_excess_precision=false" \
        python ffi/tools/root_row_layers.py --batch 1 --nodes 17
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from kdtree_jax import corpus, kv_pool, load_checkpoint  # noqa: E402
from kdtree_jax.decode import prefill  # noqa: E402
from kdtree_jax.ops import verify_attention  # noqa: E402
from kdtree_jax.ops.masks import causal_mask, pack_mask_bits  # noqa: E402


def tree_mask(rng, batch: int, nodes: int):
    parents = [[-1] + [int(rng.integers(0, i)) for i in range(1, nodes)] for _ in range(batch)]
    visible = np.zeros((batch, nodes, nodes), bool)
    for b in range(batch):
        for i in range(nodes):
            j = i
            while j >= 0:
                visible[b, i, j], j = True, parents[b][j]
    return pack_mask_bits(jnp.asarray(visible))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nodes", type=int, default=17)
    p.add_argument("--no-row-invariant", action="store_true", help="the plain passes instead")
    args = p.parse_args(argv)
    invariant = not args.no_row_invariant
    target, _, tokenizer = load_checkpoint(os.path.join(ROOT, "checkpoints", "default"), dtype=jnp.bfloat16)
    cfg, layers = target.cfg, tuple(range(target.cfg.num_hidden_layers))
    docs = corpus.documents("eval")
    prompts = [tokenizer.encode(docs[i % len(docs)].text)[:40 + 4 * (i % 5)] for i in range(args.batch)]
    ids = np.zeros((args.batch, 64), np.int32)
    for b, pr in enumerate(prompts):
        ids[b, :len(pr)] = pr
    cache = kv_pool.init_cache(cfg, args.batch, 256, dtype=jnp.bfloat16)
    last, _, cache = prefill(target, cache, ids, np.array([len(x) for x in prompts], np.int32), chunk_size=64)
    root = jnp.argmax(last, axis=-1).astype(jnp.int32)

    @jax.jit
    def run(cache, tokens, mask):
        num = tokens.shape[1]
        cache, _, batch = kv_pool.begin_chunk(cache, num, mask)
        positions = cache.seq_lens[:, None] + jnp.arange(num, dtype=jnp.int32)[None, :]
        fwd = target(tokens, positions, cache.pages, batch, hidden_layers=layers, loop_weights=target.loop_weights(),
                     row_invariant=invariant)
        return fwd.logits[:, 0], fwd.hidden[:, :, 0]

    rng = np.random.default_rng(args.nodes)
    one = run(jax.tree.map(jnp.copy, cache), root[:, None], causal_mask(args.batch, 1))
    wide = cache._replace(slot_table=jnp.pad(cache.slot_table, ((0, 0), (0, 64))))
    tokens = jnp.concatenate([root[:, None], jnp.asarray(rng.integers(0, cfg.vocab_size, (args.batch, args.nodes - 1)),
                                                          jnp.int32)], axis=1)
    many = run(wide, tokens, tree_mask(rng, args.batch, args.nodes))
    report = {"device": jax.devices()[0].device_kind, "batch": args.batch, "nodes": args.nodes,
              "row_invariant": invariant, "xla_flags": os.environ.get("XLA_FLAGS", ""), "layers": []}
    for i in layers:
        a, b = np.asarray(one[1][i], np.float32), np.asarray(many[1][i], np.float32)
        report["layers"].append({"layer": i, "equal": bool(np.array_equal(a, b)), "max_abs_diff": float(np.abs(a - b).max()),
                                 "moe": bool(cfg.is_moe_layer(i))})
    a, b = np.asarray(one[0]), np.asarray(many[0])
    report["logits"] = {"equal": bool(np.array_equal(a, b)), "max_abs_diff": float(np.abs(a - b).max())}

    # The attention op alone at the pair's geometry on random rows: the root row of a T-row call against the call.
    heads, width = cfg.num_attention_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    prefix = len(prompts[-1])
    pool = jnp.asarray(rng.standard_normal((2, 4096, width)), jnp.bfloat16)
    table = jnp.asarray(np.stack([rng.permutation(4096)[:prefix + args.nodes + 64] for _ in range(args.batch)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((args.batch, args.nodes, heads, width)), jnp.bfloat16)
    op = jax.jit(lambda *a: verify_attention(*a, softmax_scale=width ** -0.5, rope_dim=cfg.qk_rope_head_dim,
                                             split_policy="invariant"))
    o1 = op(q[:, :1], pool, jnp.int32(1), table[:, :prefix + 17], jnp.full((args.batch,), prefix + 1, jnp.int32),
            causal_mask(args.batch, 1))
    on = op(q, pool, jnp.int32(1), table, jnp.full((args.batch,), prefix + args.nodes, jnp.int32),
            tree_mask(rng, args.batch, args.nodes))
    report["attention_op"] = {name: bool(np.array_equal(np.asarray(x[:, 0], np.float32), np.asarray(y[:, 0], np.float32)))
                              for name, x, y in (("out", o1[0], on[0]), ("lse", o1[1], on[1]))}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
