"""Sharded K2 verify steps on every visible GPU: correctness first, then timings and expert load.

    python benchmarks/multi_gpu.py [--layers 4] [--contexts 4096,16384,65536] [--nodes 9,33]
    python benchmarks/multi_gpu.py --smoke          # tiny widths, for CPU (forced devices) and CI

1. Correctness: a small model (8 heads, 16 experts) sharded tp and ep over all devices gives the logits
   of the unsharded model (float32), and the same greedy speculative output.
2. K2's real widths, the first `--layers` layers (1 dense + MoE), random bf16 weights created directly
   sharded on the devices (never on the host), in the tp and ep layouts. The latent pool is filled
   with random rows at scattered slots (a fast fill: the verify cost does not depend on the values).
   Per context L and tree size T: the verify step (one forward of T tokens over L cached positions,
   median of timed runs inside one jitted loop), the attention alone (the per-device verify op of
   every layer), the routed+shared MoE alone, and the all-reduces alone (the same count and shapes).
   Expert load per step from the router (tokens and active experts per device), and the imbalance
   an EPLB placement planned from that load would leave.
Writes results (JSON + markdown) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import numpy as np

if "--smoke" in sys.argv:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from components import attention_loop, median_seconds, moe_loop  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P

import kdtree_jax
from kdtree_jax import eplb
from kdtree_jax.config import MESH_AXIS
from kdtree_jax.model.drafter import DrafterConfig, init_drafter
from kdtree_jax.attention_batch import AttentionBatch
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.ops.masks import causal_mask
from kdtree_jax.provenance import git_commit, smoke_dir
from kdtree_jax.sharding import attach_mesh, make_mesh, parameter_shardings, shard_model


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def check_correctness(n: int) -> dict:
    cfg = kdtree_jax.ModelConfig.preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=4,
                                                         topk_group=2)
    model = kdtree_jax.init_model(cfg, seed=3)
    drafter = init_drafter(cfg, DrafterConfig(block_size=4, num_layers=1, head_dim=16), seed=4)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 11))
    prompts = [np.random.default_rng(1).integers(0, cfg.vocab_size, 9).tolist(), [5, 6, 7]]
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(kdtree_jax.forward_logits(model, tokens))
        ref_out = kdtree_jax.generate(model, drafter, prompts, max_new_tokens=12, budget=6).tokens
        out = {}
        for layout in ("tp", "ep"):
            sm = shard_model(model, make_mesh(n), layout)
            logits = np.asarray(kdtree_jax.forward_logits(sm, tokens))
            same = kdtree_jax.generate(sm, drafter, prompts, max_new_tokens=12, budget=6).tokens == ref_out
            out[layout] = {"max_rel_err_logits": float(np.abs(logits - ref).max() / np.abs(ref).max()),
                           "greedy_speculative_equal": bool(same)}
    return out


def sharded_random_model(cfg, mesh, layout: str):
    """Random bf16 weights created on the devices in their final sharding."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    shardings = parameter_shardings(abstract, mesh, layout)

    @jax.jit
    def init():
        return nnx.state(Transformer(cfg, jnp.bfloat16, rngs=nnx.Rngs(0)))

    state = jax.jit(init.__wrapped__ if hasattr(init, "__wrapped__") else init, out_shardings=shardings)()
    model = nnx.merge(graphdef, state)
    attach_mesh(model, mesh, layout)
    return model


def filled_pool(cfg, mesh, context: int, nodes: int, key):
    """A replicated pool holding `context` random rows at scattered slots, room for `nodes` more."""
    slots = context + nodes
    rep = NamedSharding(mesh, P())

    @jax.jit
    def make(key):
        k1, k2 = jax.random.split(key)
        pages = jax.random.normal(k1, (cfg.num_hidden_layers, slots, cfg.cache_dim), jnp.bfloat16)
        table = jax.random.permutation(k2, slots).astype(jnp.int32)[None, :]
        return pages, table

    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else _null():
        pages, table = jax.jit(make, out_shardings=(rep, rep))(key)
    return pages, table


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def time_step(model, pages, table, context: int, nodes: int, iters: int, impl: str):
    """Median seconds of one verify forward, from `iters` forwards inside one jitted loop."""
    cfg = model.cfg
    rep_batch = 1
    kv_lens = jnp.full((rep_batch,), context + nodes, jnp.int32)
    write = table[:, context:context + nodes]
    batch = AttentionBatch(table, kv_lens, causal_mask(rep_batch, nodes), write)
    positions = (context + jnp.arange(nodes, dtype=jnp.int32))[None]

    @jax.jit
    def loop(model, pages, tokens):
        def body(i, carry):
            pages, tokens, acc, counts = carry
            out = model(tokens, positions, pages, batch, impl=impl)
            nxt = jnp.argmax(out.logits, -1).astype(jnp.int32)  # the next input depends on this output
            return out.kv_pages, nxt, acc + out.logits[0, 0, 0], counts.at[i].set(out.expert_counts)
        slots = model.layers[-1].mlp.num_slots
        init = (pages, tokens, jnp.zeros((), jnp.float32), jnp.zeros((iters, cfg.num_moe_layers, slots), jnp.int32))
        return jax.lax.fori_loop(0, iters, body, init)

    tokens = jax.random.randint(jax.random.key(1), (1, nodes), 0, cfg.vocab_size, jnp.int32)
    seconds, out = median_seconds(loop, model, pages, tokens, reps=3)
    return seconds / iters, out[0], np.asarray(out[3])  # counts [iters, n_moe, slots]


def time_attention(model, pages, table, context: int, nodes: int, iters: int, impl: str) -> float:
    """Seconds of every layer's per-device verify-attention op alone, per step."""
    cfg, mesh = model.cfg, model.mesh
    kv_lens = jnp.full((1,), context + nodes, jnp.int32)
    batch = AttentionBatch(table, kv_lens, causal_mask(1, nodes), table[:, context:context + nodes])
    q = jax.random.normal(jax.random.key(2), (1, nodes, cfg.num_attention_heads, cfg.cache_dim), jnp.bfloat16)
    q = jax.device_put(q, NamedSharding(mesh, P(None, None, MESH_AXIS, None)))
    t_attn, _ = median_seconds(attention_loop(impl, iters), q, pages, model, batch, reps=3)
    return t_attn / iters


def time_moe_and_allreduce(model, nodes: int, iters: int) -> dict:
    """Seconds per step of the MoE layers alone and of the step's all-reduces alone (same count and
    shapes as the forward's: one after attention's output projection and one after each MLP/MoE)."""
    cfg, mesh = model.cfg, model.mesh
    x = jax.random.normal(jax.random.key(3), (1, nodes, cfg.hidden_size), jnp.bfloat16)

    n_allreduce = 2 * cfg.num_hidden_layers
    partial_sums = jax.device_put(jnp.ones((mesh.size, nodes, cfg.hidden_size), jnp.bfloat16),
                                  NamedSharding(mesh, P(MESH_AXIS)))

    @jax.jit
    def allreduce_only(v):
        def per_device(v):
            def body(i, v):
                for _ in range(n_allreduce):
                    v = jax.lax.psum(v, MESH_AXIS) * (1.0 / mesh.size)
                return v
            return jax.lax.fori_loop(0, iters, body, v)
        return jax.shard_map(per_device, mesh=mesh, in_specs=P(MESH_AXIS), out_specs=P(MESH_AXIS),
                             check_vma=False)(v)

    t_moe, _ = median_seconds(moe_loop(iters), x, model, reps=3)
    t_ar, _ = median_seconds(allreduce_only, partial_sums, reps=3)
    return {"moe_s": t_moe / iters, "allreduce_s": t_ar / iters, "allreduces_per_step": n_allreduce}


def layers_that_fit(cfg, n: int, fraction: float) -> int:
    """Full K2 layers (1 dense + MoE) whose weights fill `fraction` of the devices' memory together."""
    def weight_bytes(layers):
        abstract = nnx.eval_shape(lambda: Transformer(cfg.replace(num_hidden_layers=layers), jnp.bfloat16,
                                                      rngs=nnx.Rngs(0)))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract)))
    one, two = weight_bytes(1), weight_bytes(2)
    stats = jax.devices()[0].memory_stats() or {}
    per_device = stats.get("bytes_limit", 80 * 2**30)
    return max(1, 1 + int((fraction * per_device * n - one) // (two - one)))


def expert_load_summary(counts: np.ndarray, n: int) -> dict:
    """counts [steps, n_moe, slots] -> per-device tokens and active experts per step (mean over steps and
    layers), and the mean max/mean token imbalance over devices."""
    steps, n_moe, slots = counts.shape
    per_dev = counts.reshape(steps, n_moe, n, slots // n)
    return {"tokens_per_device_per_step": per_dev.sum(-1).mean((0, 1)).round(2).tolist(),
            "active_experts_per_device_per_step": (per_dev > 0).sum(-1).mean((0, 1)).round(2).tolist(),
            "max_active_experts_on_a_device": float((per_dev > 0).sum(-1).max(-1).mean()),
            "max_over_mean_device_tokens": float(eplb.imbalance(counts.reshape(-1, slots), n).mean())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="auto",
                   help="K2 layers (1 dense + the rest MoE), or 'auto': as many as fill --memory-fraction")
    p.add_argument("--memory-fraction", type=float, default=0.5,
                   help="share of all devices' memory that --layers auto fills with weights")
    p.add_argument("--layouts", default="tp,ep", help="sharding layouts to time: tp (tensor parallel), ep (expert parallel), comma-separated")
    p.add_argument("--contexts", default="4096,16384,65536", help="context lengths (tokens in the KV pool), comma-separated")
    p.add_argument("--nodes", default="9,33", help="tree sizes T")
    p.add_argument("--iters", type=int, default=10, help="forwards per timed loop")
    p.add_argument("--impl", default="auto", help="verify-attention implementation (auto, reference, ffi)")
    p.add_argument("--parts-nodes", default="9", help="tree sizes at which attention/MoE/all-reduce are timed alone")
    p.add_argument("--reference-contexts", default="4096",
                   help="contexts at which the step is also timed with the XLA reference attention")
    p.add_argument("--eplb", default="4096:33",
                   help="context:T points where the ep step is timed again on the EPLB placement planned from "
                        "that point's measured load ('' for none)")
    p.add_argument("--smoke", action="store_true", help="tiny widths on forced CPU devices")
    p.add_argument("--out", default=os.environ.get("OUT"),
                   help="output directory (default: $OUT, else benchmarks/results; --smoke: $OUT or a temp dir)")
    args = p.parse_args(argv)

    n = len(jax.devices())
    device = f"{n}x {jax.devices()[0].device_kind}"
    log(f"devices: {device}")
    result = {"meta": {"date": datetime.date.today().isoformat(), "device": device, "devices": n,
                       "commit": git_commit(), "jax": jax.__version__}}
    result["correctness"] = check_correctness(n)
    log("correctness", result["correctness"])

    cfg = kdtree_jax.ModelConfig.preset("kimi-k2")
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.smoke:
        cfg = kdtree_jax.ModelConfig.preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=4,
                                                             topk_group=2)
        contexts = [c for c in contexts if c <= 256] or [64]
    layers = layers_that_fit(cfg, n, args.memory_fraction) if args.layers == "auto" else int(args.layers)
    cfg = cfg.replace(num_hidden_layers=layers)
    log(f"{layers} layers ({cfg.num_moe_layers} MoE)")
    nodes_list = [int(t) for t in args.nodes.split(",")]
    parts_nodes = [int(t) for t in args.parts_nodes.split(",") if t]
    eplb_points = [tuple(int(v) for v in pt.split(":")) for pt in args.eplb.split(",") if pt]
    mesh = make_mesh(n)
    rows = []

    def record(row):
        rows.append(row)
        log(json.dumps(row))
        _dump(args, result, rows, cfg, n)  # after every row: a run cut short still leaves its data

    for layout in args.layouts.split(","):
        t0 = time.perf_counter()
        model = sharded_random_model(cfg, mesh, layout)
        jax.block_until_ready(nnx.state(model))
        log(f"{layout}: model ready in {time.perf_counter() - t0:.1f} s")
        alone = {t: time_moe_and_allreduce(model, t, args.iters) for t in parts_nodes}
        plans = {}  # (context, T) -> the EPLB placement planned from that point's measured load
        for context in contexts:
            for nodes in nodes_list:
                pages, table = filled_pool(cfg, mesh, context, nodes, jax.random.key(context + nodes))
                step, pages, counts = time_step(model, pages, table, context, nodes, args.iters, args.impl)
                attention = time_attention(model, pages, table, context, nodes, args.iters, args.impl) \
                    if nodes in parts_nodes else float("nan")
                ref_step = None
                if args.impl != "reference" and (context in [int(c) for c in args.reference_contexts.split(",")]
                                                 or args.smoke):
                    ref_step, pages, _ = time_step(model, pages, table, context, nodes, args.iters, "reference")
                load = counts.sum(0)
                plans[context, nodes] = eplb.plan_placement(load, num_devices=n, redundant_per_device=1)
                part = alone.get(nodes, {})
                record({"layout": layout, "context": context, "nodes": nodes, "step_ms": step * 1e3,
                        "reference_attention_step_ms": None if ref_step is None else ref_step * 1e3,
                        "attention_ms": attention * 1e3, "moe_ms": part.get("moe_s", float("nan")) * 1e3,
                        "allreduce_ms": part.get("allreduce_s", float("nan")) * 1e3,
                        "allreduces_per_step": 2 * cfg.num_hidden_layers,
                        **expert_load_summary(counts, n),
                        "eplb_planned_max_over_mean": float(eplb.imbalance(
                            eplb.placed_load(load, plans[context, nodes]), n).mean())})
                del pages, table
        if layout == "ep":
            for context, nodes in eplb_points:
                if (context, nodes) not in plans:
                    continue
                # Re-place the model's own experts (in place: K2's experts are too big to hold twice),
                # planned from that point's measured load, and time the same loop again: the inputs
                # and so the routing are the same, so this is the placement's best case.
                model = eplb.apply_placement(model, plans[context, nodes], copy=False)
                pages, table = filled_pool(cfg, mesh, context, nodes, jax.random.key(context + nodes))
                step, pages, counts = time_step(model, pages, table, context, nodes, args.iters, args.impl)
                part = time_moe_and_allreduce(model, nodes, args.iters)
                record({"layout": "ep+eplb", "context": context, "nodes": nodes, "step_ms": step * 1e3,
                        "reference_attention_step_ms": None, "attention_ms": float("nan"),
                        "moe_ms": part["moe_s"] * 1e3, "allreduce_ms": part["allreduce_s"] * 1e3,
                        "allreduces_per_step": part["allreduces_per_step"],
                        **expert_load_summary(counts, n), "eplb_planned_max_over_mean": float("nan")})
                break  # one placement per model: its experts were moved in place
        del model
        gc.collect()  # free this layout's weights before the next one is made
    print(json.dumps(_dump(args, result, rows, cfg, n)))


def _dump(args, result, rows, cfg, n):
    result["rows"] = rows
    result["config"] = {"layers": cfg.num_hidden_layers, "moe_layers": cfg.num_moe_layers, "iters": args.iters,
                        "impl": args.impl, "note": "tokens/active experts per device use the ep grouping "
                        "(device d holds expert slots [d*s, (d+1)*s)) in every layout; in tp every device "
                        "holds a slice of every expert, so these are what ep would see for the same tokens"}
    if args.out is None:
        args.out = smoke_dir("multi_gpu") if args.smoke else os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(args.out, exist_ok=True)
    name = "multi_gpu_smoke" if args.smoke else f"multi_gpu_{n}x"
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(markdown(result))
    log(f"wrote {os.path.join(args.out, name)}.{{json,md}}")
    return result


def markdown(result) -> str:
    meta, cfg = result["meta"], result["config"]
    lines = [f"# Sharded K2 verify steps on {meta['device']}", "",
             f"{meta['date']}, commit {meta['commit']}, jax {meta['jax']}; {cfg['layers']} K2 layers "
             f"({cfg['moe_layers']} MoE), random bf16 weights, batch 1, {cfg['iters']} forwards per timed loop.", "",
             "## Correctness (small model, float32, sharded vs unsharded)", "",
             "| layout | max rel. error of logits | greedy speculative output equal |", "|---|---|---|"]
    for layout, c in result["correctness"].items():
        lines.append(f"| {layout} | {c['max_rel_err_logits']:.1e} | {'yes' if c['greedy_speculative_equal'] else 'NO'} |")
    lines += ["", "## Verify step", "",
              "| layout | L | T | step ms | per layer ms | XLA-attention step ms | attention ms | MoE ms | "
              "all-reduce ms | tokens/device/step | active experts/device/step | max/mean tokens | EPLB planned |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt="{:.3f}"):
        return "–" if v is None or (isinstance(v, float) and v != v) else fmt.format(v)
    for r in result["rows"]:
        lines.append(" | ".join(["", r["layout"], str(r["context"]), str(r["nodes"]), f(r["step_ms"]),
                                 f(r["step_ms"] / cfg["layers"]), f(r["reference_attention_step_ms"]),
                                 f(r["attention_ms"]), f(r["moe_ms"]), f(r["allreduce_ms"]),
                                 " / ".join(f"{v:g}" for v in r["tokens_per_device_per_step"]),
                                 " / ".join(f"{v:g}" for v in r["active_experts_per_device_per_step"]),
                                 f(r["max_over_mean_device_tokens"], "{:.2f}"),
                                 f(r["eplb_planned_max_over_mean"], "{:.2f}"), ""]).strip())
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
