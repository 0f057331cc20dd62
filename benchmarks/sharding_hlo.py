"""Collectives per verify step of the sharded K2 stack, read from the compiled HLO (no GPU needed).

    python benchmarks/sharding_hlo.py [--layers 4] [--devices 8] [--tree-nodes 9] [--context 4096]

Builds Kimi K2 (full widths, the first `--layers` layers: one dense, the rest MoE) as abstract arrays
(nothing is allocated), shards it over `--devices` forced CPU devices in the tp and ep layouts, compiles
one verify forward of a `--tree-nodes`-node tree at `--context` positions, and counts the collectives
in the optimized HLO: kind, count and bytes per step, per layer type, and projected to 61 layers (dense
layers x 1 + MoE layers x 60). Writes benchmarks/results/sharding.{md,json}.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--help" not in sys.argv and "-h" not in sys.argv:
    _n = next((sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--devices"), "8")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import datetime
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import kdtree_jax
from kdtree_jax import decode, kv_pool
from kdtree_jax.provenance import git_commit
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.sharding import attach_mesh, make_mesh, parameter_shardings

DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1, "f64": 8, "s64": 8}
COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(")


def _bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape_text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * DTYPE_BYTES.get(dtype, 4)
    return total


def collectives(hlo: str):
    found = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m and "-done" not in line:
            found.append((m.group(2), _bytes(m.group(1)), m.group(1)))
    return found


def compile_step(cfg, layout: str, n: int, nodes: int, context: int):
    mesh = make_mesh(n)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, jnp.bfloat16, rngs=nnx.Rngs(0)))
    shardings = parameter_shardings(abstract, mesh, layout)
    graphdef, state = nnx.split(abstract)
    def with_sharding(var, sharding):
        value = var.get_value()
        return var.replace(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))

    state = jax.tree.map(with_sharding, state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
    model = nnx.merge(graphdef, state)
    attach_mesh(model, mesh, layout)
    rep = NamedSharding(mesh, P())
    cache = jax.eval_shape(lambda: kv_pool.init_cache(cfg, 1, context + nodes, dtype=jnp.bfloat16))
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), cache)
    tokens = jax.ShapeDtypeStruct((1, nodes), jnp.int32, sharding=rep)
    valid = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep)
    lowered = decode.forward_chunk.lower(model, cache, tokens, valid, impl="reference")
    return lowered.compile().as_text()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=3, help="K2 layers to compile (1 dense + the rest MoE)")
    p.add_argument("--devices", type=int, default=8, help="CPU devices to shard over (read before JAX starts)")
    p.add_argument("--tree-nodes", type=int, default=9, help="tree size T of the compiled verify step")
    p.add_argument("--context", type=int, default=4096, help="context length of the compiled verify step")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "sharding"), help="output directory")
    args = p.parse_args(argv)

    k2 = kdtree_jax.ModelConfig.preset("kimi-k2")
    results = {}
    for layout in ("tp", "ep"):
        per_count = {}
        for layers in (1, args.layers):  # difference of two compiles isolates one MoE layer's collectives
            cfg = k2.replace(num_hidden_layers=layers)
            found = collectives(compile_step(cfg, layout, args.devices, args.tree_nodes, args.context))
            per_count[layers] = found
            print(f"{layout}: {layers} layer(s) -> {len(found)} collectives, {sum(b for _, b, _ in found)} bytes",
                  file=sys.stderr)
        one, many = per_count[1], per_count[args.layers]
        moe_layers = args.layers - 1
        moe_count = (len(many) - len(one)) / moe_layers
        moe_bytes = (sum(b for _, b, _ in many) - sum(b for _, b, _ in one)) / moe_layers
        results[layout] = {
            "kinds": sorted({k for k, _, _ in many}),
            "dense_layer_plus_head": {"count": len(one), "bytes": sum(b for _, b, _ in one),
                                      "ops": [f"{k} {s}" for k, _, s in one]},
            "per_moe_layer": {"count": moe_count, "bytes": moe_bytes},
            "projected_61_layers": {"count": len(one) + 60 * moe_count,
                                    "bytes": sum(b for _, b, _ in one) + 60 * moe_bytes},
            "compiled_ops": [f"{k} {s}" for k, _, s in many],
        }

    commit = git_commit()
    meta = {"date": datetime.date.today().isoformat(), "commit": commit, "devices": args.devices,
            "device": f"{args.devices} forced CPU devices (HLO only, no timing)", "tree_nodes": args.tree_nodes,
            "context": args.context, "compiled_layers": args.layers, "model": "kimi-k2 (bf16, abstract weights)"}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "layouts": results}, f, indent=1)
    lines = [f"# Collectives per verify step, K2 sharded over {args.devices} devices (from compiled HLO)", "",
             f"{meta['date']}, commit {commit}. {meta['device']}; one verify forward of a {args.tree_nodes}-node tree at "
             f"{args.context} cached positions, batch 1, bf16. Compiled with 1 and {args.layers} layers of K2's real widths; "
             "the difference gives one MoE layer, projected to 61 layers (1 dense + 60 MoE, as K2). "
             "Regenerate: `python benchmarks/sharding_hlo.py`.", "",
             "| layout | kinds | dense layer + head: count / bytes | per MoE layer: count / bytes | projected 61 layers: count / bytes |",
             "|---|---|---|---|---|"]
    for layout, r in results.items():
        d, m, t = r["dense_layer_plus_head"], r["per_moe_layer"], r["projected_61_layers"]
        lines.append(f"| {layout} | {', '.join(r['kinds'])} | {d['count']} / {d['bytes']:,} | {m['count']:.0f} / "
                     f"{m['bytes']:,.0f} | {t['count']:.0f} / {t['bytes']:,.0f} |")
    lines += ["", "Reading it: per layer, one all-reduce after o_proj (heads are split, so o_proj's contraction is "
              "partial) and one after the MLP (dense layer: the split intermediate; MoE layer: the routed psum and "
              "the shared expert's partial sum, combined into one tuple all-reduce). No all-gather of parameters or "
              "of the latent pool. tp and ep move the same bytes: both sum [tokens, hidden] activations once per "
              "sublayer; they differ in which device does which expert's work (see the expert-load statistics).", "",
              "Caveat: XLA's CPU pipeline promotes these bf16 all-reduces to f32 (their operand is a convert "
              "fusion). The activations are bf16, so on GPUs (NCCL reduces bf16) the bytes should be half; "
              "that is an expectation, not a measurement.", "",
              "Collective ops in the compiled step, per layout:", ""]
    for layout, r in results.items():
        lines.append(f"- {layout}: " + "; ".join(r["compiled_ops"]))
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
