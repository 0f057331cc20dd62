"""The reference system's headline on our engine: one rank of K2 under TP8, decode steps at long context.

    python benchmarks/decode_context.py [--layers N] [--contexts 4096,16384,65536,131072,200000] [--nodes 9,33]
    python benchmarks/decode_context.py --smoke     # tiny widths, CPU, seconds

What one of 8 GPUs holds and does under TP8 (`rank_configs`):
- the target: the `kimi-k2-tp8-rank` preset (8 of the 64 heads, the whole latent cache, 1/8 of every
  expert and of the dense MLP) with a vocab-parallel lm head and embedding: 163840 / 8 = 20480 rows each;
- the drafter: its heads, KV heads and MLP split 8 ways like the target's (32 -> 4 heads, 8 -> 1 KV head,
  12288 -> 1536), the `fc` that projects the target's features replicated, and the target's 20480-row
  head slice (shared).
The cross-rank parts (two all-reduces per layer, the vocab-parallel logsumexp/top-k/argmax merge of a few
values per row) are not modelled: one GPU times one rank's own work.

As many layers as asked (random bf16 weights made on the device); the KV pool filled to L (fast fill:
random latent rows written straight into the pool at scattered slots, and random drafter context K/V;
the cost does not depend on the values), then the jitted speculative step -- drafter, DDTree of T
nodes, verify forward, acceptance, commit -- timed as the mean over K steps of one compiled
`lax.while_loop` (the engine's own decode loop), with the FFI kernel ("auto") and with the fair XLA baseline
attention, in the same run: kdtree_jax/ops/xla.py (bf16 gather from the pool + einsums with float32 accumulation,
float32 softmax) in both its forms, dense over L (impl "xla") and chunked over L (impl "xla_chunked",
ops.xla.DEFAULT_CHUNK positions a step, online softmax), each a step of its own (`--xla-forms`); at each (L, T) the
faster step of the two is the baseline, as benchmarks/verify_kernel.py takes the faster form for the op alone. The
float32-HIGHEST reference (ops/reference.py) is a correctness oracle, never a baseline: `--impls` refuses it.

Per component, two ways. (1) Inside the step: one run of each step loop under the profiler, its kernels
grouped by the named scopes the engine and model set (kdtree_jax/profiling.py): attention (the verify
op), MoE (router, routed and shared experts), dense (everything else of the verify forward: norms, MLA
projections, the dense layer's MLP), drafter (its pass, top-K and context extension), head, tree + accept +
commit; "unaccounted" is the step less them: kernels outside every part plus the GPU's idle time. (2) Alone,
in jitted loops of the same shapes (benchmarks/components.py), kept beside for comparison; a part alone
pays its own launches and bookkeeping, and those loops summed to ~1.2x the step. Rows without a profile
(--profile none or kernel, or a failed profile) show the parts timed alone.
Idle, apart from the call: the timed step is a call's time over its steps, so it holds the call's own cost (launch,
set-up kernels, host; the call runs on a fresh copy of the state) spread over them. The engine's chunked loop
(`--engine-chunks`) is timed as a decode runs it; its idle is against the union of the loop's kernels from the
profile, which runs after every timing of its group.
Floors: the bytes each must read over the best copy bandwidth measured in the same run (cudaMemcpy
through ffi/bench.cu when the extension has CUDA, and two XLA loops; the largest is used): KV rows; the
weights of the experts the router activated in the timed step itself (the engine's router statistics:
distinct experts per MoE layer per step), the shared experts and the router; every other weight read
once; the drafter's weights, head slice and context K/V. Writes
benchmarks/results/decode_context_<device>.{md,json}.

The MoE component must route like the step. With random weights a token's hidden state is mostly its
embedding, and a tree repeats tokens across branches, so a step's T rows reach far fewer experts than T
independent random rows (K2 TP8 rank, T = 33: ~65 against ~186 per layer). Its input is therefore T rows
built from u distinct random vectors, with u chosen so that the router activates as many experts per layer
as the kernel's steps did (on average over the contexts).

Compiles are the slow part on a device (each point is its own program), so every program of a group is
lowered first and compiled in parallel threads (XLA releases the GIL), then timed one at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kdtree_jax import runtime  # noqa: E402

# Before JAX starts: the engine's flags, so that the step loop runs as the engine's does: command buffers that capture
# the while loop (KDTREE_JAX_COMMAND_BUFFERS=0 for the loop run from the host, one predicate copy and round trip a
# step: ~0.8 ms of idle a 25-layer Kimi-K2 step on an H200, 2bc58a7), programmatic dependent launch, and with
# --row-invariant the flags a row-invariant step needs.
runtime.configure(row_invariant="--row-invariant" in sys.argv)

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from components import attention_loop, dense_loop, median_seconds, moe_loop  # noqa: E402

import kdtree_jax
from kdtree_jax import kv_pool
from kdtree_jax.model.drafter import Drafter, DrafterCache, DrafterConfig
from kdtree_jax.model.layers import rope_cos_sin
from kdtree_jax.model.mla import AttentionBatch
from kdtree_jax.model.transformer import DecoderLayer, Transformer
from kdtree_jax.ops.masks import causal_mask
from kdtree_jax.ops.xla import DEFAULT_CHUNK as XLA_CHUNK
from kdtree_jax.profiling import profile_call
from kdtree_jax.provenance import git_commit, smoke_dir
from kdtree_jax.speculative import accept as acceptance
from kdtree_jax.speculative import engine
from kdtree_jax.speculative import tree as trees

TP = 8  # the tensor-parallel degree whose one rank is modelled
# Row fields that a profile of the step replaces: field -> kdtree_jax.profiling component.
PROFILED_PARTS = {"attention_ms": "attention", "moe_ms": "moe", "dense_ms": "dense", "drafter_ms": "drafter",
                  "head_ms": "head", "tree_accept_commit_ms": "tree_accept_commit"}
TOPK = 8
ITERS = 8  # rounds per component loop
# The fair XLA baseline's forms (--xla-forms) and the kdtree_jax.ops impl that runs each inside the model.
XLA_FORMS = {"dense": "xla", "chunked": "xla_chunked"}
XLA_IMPLS = tuple(XLA_FORMS.values())


def step_impls(impls: list[str], forms: list[str]) -> list[str]:
    """--impls as the attention impls the steps run: 'xla', the fair XLA baseline, becomes one impl per form of
    --xla-forms. The float32 oracle ('reference') is refused: a correctness check, never a baseline."""
    for form in forms:
        if form not in XLA_FORMS:
            raise ValueError(f"--xla-forms: unknown form {form!r} (known: {', '.join(XLA_FORMS)})")
    out = []
    for impl in impls:
        if impl == "reference":
            raise ValueError("--impls: 'reference' is the float32-HIGHEST oracle (kdtree_jax/ops/reference.py), a "
                             "correctness check, not a baseline; 'xla' times the fair XLA baseline")
        if impl not in ("auto", "ffi", "xla"):
            raise ValueError(f"--impls: unknown impl {impl!r} (known: auto, ffi, xla)")
        for name in ([XLA_FORMS[f] for f in forms] if impl == "xla" else [impl]):
            if name not in out:
                out.append(name)
    return out


def impl_label(impl: str, meta: dict) -> str:
    """A row's attention as the tables name it."""
    if impl == "xla":
        return "XLA dense"
    if impl == "xla_chunked":
        return f"XLA chunked ({meta.get('xla_chunk', XLA_CHUNK)})"
    if impl == "reference":
        return "float32 oracle"
    return impl


def xla_baselines(by: dict) -> dict:
    """(L, T) -> the fair XLA baseline's row there: the faster step of the XLA forms timed (rows keyed by
    (L, T, impl))."""
    best = {}
    for (context, nodes, impl), r in by.items():
        if impl in XLA_IMPLS and ((context, nodes) not in best or r["step_ms"] < best[(context, nodes)]["step_ms"]):
            best[(context, nodes)] = r
    return best


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def rank_configs(smoke: bool, layers: int):
    """(target cfg, drafter cfg, tp, the full drafter cfg) of one TP rank."""
    if smoke:
        tp = 2
        full = kdtree_jax.ModelConfig.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64)
        cfg = full.replace(vocab_size=full.vocab_size // tp)
        dfull = DrafterConfig(block_size=4, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64)
    else:
        tp = TP
        full = kdtree_jax.ModelConfig.preset("kimi-k2")
        # Heads and MLPs are already per rank in the preset; the lm head and embedding are vocab-parallel.
        cfg = kdtree_jax.ModelConfig.preset("kimi-k2-tp8-rank").replace(vocab_size=full.vocab_size // tp)
        dfull = DrafterConfig(block_size=16, num_layers=2, num_heads=32, num_kv_heads=8, head_dim=128,
                              intermediate_size=12288)
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        if getattr(dfull, name) % tp:
            raise ValueError(f"drafter {name} ({getattr(dfull, name)}) must divide by tp ({tp})")
    dcfg = dataclasses.replace(dfull, num_heads=dfull.num_heads // tp, num_kv_heads=dfull.num_kv_heads // tp,
                               intermediate_size=dfull.intermediate_size // tp)
    return cfg.replace(num_hidden_layers=layers), dcfg, tp, dfull


def layers_that_fit(cfg, dcfg, contexts: list[int], max_len_of, reserve_gb: float) -> int:
    """The most target layers whose weights and KV pools (one pool per context, all held at once, plus the
    copy a timed run makes) fit in the device's memory limit, leaving `reserve_gb` for the drafter,
    workspaces and temporaries."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        raise SystemExit("--layers fit needs a device that reports its memory limit (a GPU); pass a number")

    def weight_bytes(n):
        abstract = nnx.eval_shape(lambda: Transformer(cfg.replace(num_hidden_layers=n), jnp.bfloat16,
                                                      rngs=nnx.Rngs(0)))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract)))

    first = cfg.first_k_dense_replace + 1  # the dense layers and one MoE layer
    per_layer_weights = weight_bytes(first + 1) - weight_bytes(first)  # one more MoE layer
    base = weight_bytes(first) - first * per_layer_weights  # embedding, head, and the dense layers' excess
    # Every context's pool is held at once, and each timed run copies the pool it donates to the loop (an
    # H200 run at 27 layers ran out of memory on that copy at 200k): one more pool of the largest context.
    rows = sum(max_len_of(c) for c in contexts) + max(max_len_of(c) for c in contexts)
    per_layer_kv = rows * cfg.cache_dim * 2
    free = stats["bytes_limit"] - reserve_gb * 2**30 - base
    n = int(free // (per_layer_weights + per_layer_kv))
    log(f"--layers fit: limit {stats['bytes_limit'] / 2**30:.1f} GiB, {per_layer_weights / 2**30:.2f} GiB of weights "
        f"+ {per_layer_kv / 2**30:.2f} GiB of KV per layer, {reserve_gb} GiB reserved -> {n} layers")
    if n < first:
        raise SystemExit(f"only {n} layers fit; pass --layers explicitly or fewer --contexts")
    return n


def on_device(build):
    """Build a module with random weights directly on the device (never on the host)."""
    abstract = nnx.eval_shape(build)
    graphdef, _ = nnx.split(abstract)
    state = jax.jit(lambda: nnx.state(build()))()
    return nnx.merge(graphdef, state)


def random_target(cfg, dtype, seed: int = 0) -> Transformer:
    """The target with random weights made on the device, layer by layer: one jitted init per kind of layer
    (dense, MoE), run once per layer with that layer's own key, and one for the embedding, final norm and head.
    `on_device` of the whole model compiles one program with every layer's initializers in it: ~23 s for 25
    K2 TP8-rank layers with XLA:CPU against ~4 s for these (results/history/decode_context_init_compile_cpu.md), and
    on the H200 a fit run spent 94-129 s before its KV states were ready. Same initializers as
    Transformer's, other keys."""
    build = lambda: Transformer(cfg, dtype, rngs=nnx.Rngs(seed))  # noqa: E731
    model = nnx.eval_shape(build)

    def everything_but_layers():  # XLA drops the layers' initializers: they are not returned
        return nnx.State({k: v for k, v in nnx.state(build()).items() if k != "layers"})

    nnx.update(model, jax.jit(everything_but_layers)())
    kinds = {}
    for i, layer in enumerate(model.layers):
        if layer.is_moe not in kinds:
            kinds[layer.is_moe] = jax.jit(
                lambda key, i=i: nnx.state(DecoderLayer(cfg, i, dtype, rngs=nnx.Rngs(key))))
        nnx.update(layer, kinds[layer.is_moe](jax.random.fold_in(jax.random.key(seed), i)))
    return model


def param_bytes(module, skip=()) -> int:
    """Bytes of the module's parameters, leaving out paths that contain any name in `skip`."""
    total = 0
    for path, var in nnx.to_flat_state(nnx.state(module)):
        names = [str(p) for p in path]
        if any(s in names for s in skip):
            continue
        value = var.get_value()
        total += int(np.prod(value.shape)) * value.dtype.itemsize
    return total


def copy_bandwidth() -> dict:
    """Bytes moved per second (read + write for copies, read for the reduction), several ways."""
    gpu = jax.default_backend() == "gpu"
    n = (1 << 30) if gpu else (1 << 19)
    out = {}
    if gpu:
        try:
            from kdtree_jax.ops import ffi as ffi_ops
            bench = ffi_ops.bench_module()  # the benchmark target; None where the CUDA part was not built
            if bench is not None:
                gbps = float(bench.bench_copy_gbps(0, 2 * n, 20))
                if gbps > 0:
                    out["cudaMemcpy_d2d"] = gbps * 1e9
        except Exception as e:  # the extension is optional for this measurement
            log(f"bench_copy_gbps unavailable: {e}")
    x = jnp.ones((n,), jnp.bfloat16)
    variants = {"xla_x_plus_1_bf16": (jax.jit(lambda x: x + jnp.bfloat16(1)), 2 * x.nbytes),
                "xla_sum_read_only": (jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), x.nbytes)}
    for name, (f, nbytes) in variants.items():
        jax.block_until_ready(f(x))
        times = []
        for _ in range(10):
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            times.append(time.perf_counter() - t)
        out[name] = nbytes / float(np.median(times))
    return out


def make_state(cfg, dcfg, n_feature_layers: int, context: int, max_len: int, steps: int, num_moe: int,
               moe_slots: int, key):
    """A LoopState whose pool holds `context` random rows at scattered slots and whose drafter context
    holds `context` random K/V rows, with room for `steps` more steps."""
    num_slots = max_len

    @jax.jit
    def make(key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        pages = jax.random.normal(k1, (cfg.num_hidden_layers, num_slots, cfg.cache_dim), jnp.bfloat16)
        order = jax.random.permutation(k2, num_slots).astype(jnp.int32)
        table = order[None, :max_len]
        free = order[context:][::-1]  # the slots after the context's, on the free stack
        free = jnp.concatenate([free, jnp.zeros((num_slots - free.shape[0],), jnp.int32)])
        cache = kv_pool.KVCache(pages=pages, free_slots=free, num_free=jnp.asarray(num_slots - context, jnp.int32),
                                slot_table=table, seq_lens=jnp.array([context], jnp.int32), overflow=jnp.asarray(False))
        shape = (dcfg.num_layers, 1, dcfg.num_kv_heads, max_len, dcfg.head_dim)  # head-major, as init_cache
        dcache = DrafterCache(k=jax.random.normal(k3, shape, jnp.bfloat16), v=jax.random.normal(k4, shape, jnp.bfloat16),
                              lens=jnp.array([context], jnp.int32))
        return cache, dcache

    cache, dcache = make(key)
    width = dcfg.block_size
    return engine.initial_state(cache, dcache, jnp.array([1], jnp.int32), max_new_tokens=steps + 1, width=width,
                                stop_ids=jnp.array([-1], jnp.int32), key=jax.random.key(0),
                                expert_load=engine.ExpertLoad.zeros(num_moe, moe_slots, 1))


# Component loops. Modules and caches are jit arguments, never closed over (a closure bakes them in as
# constants). Each round's input depends on the last round's output, so nothing is hoisted.

@jax.jit
def moe_counts(x, target):
    """[n_moe, slots] tokens routed to each expert for one verify pass of x (the step's T tokens)."""
    return jnp.stack([block.mlp(x)[1] for block in target.layers if block.is_moe])


@jax.jit
def head_only(h, target):
    """The verify pass's final norm + lm head over T rows, and the greedy pick."""
    def body(i, h):
        logits = target.head(h)
        return h.at[..., :1].add((jnp.argmax(logits, -1)[..., None] % 2).astype(h.dtype) * 1e-3)
    return jax.lax.fori_loop(0, ITERS, body, h)


def drafter_loop(topk: int):
    """The drafter's per-step work as in the engine: block pass, log-softmax, top-K, and extending its
    context by the accepted nodes' features (here one node per step)."""
    @jax.jit
    def run(bonus, target, drafter, dcache, feats):
        def body(i, carry):
            bonus, dcache = carry
            lp = drafter(target, dcache, bonus, dcache.lens)
            _, top_tok = jax.lax.top_k(lp, topk)
            dcache = drafter.extend_context(dcache, feats, jnp.ones_like(bonus))
            dcache = dcache._replace(lens=dcache.lens - 1)  # stay at the same context length
            return top_tok[:, 0, 0].astype(jnp.int32), dcache
        return jax.lax.fori_loop(0, ITERS, body, (bonus, dcache))[0]
    return run


def tree_loops(nodes: int):
    """jit'd loops of the tree build alone, the acceptance alone, and tree + accept + commit."""
    budget = nodes - 1

    @jax.jit
    def tree_only(bonus, start, top_lp, top_tok):
        def body(i, bonus):
            t = trees.build_ddtree(top_lp, top_tok, bonus, start, budget)
            return t.tokens[:, -1] + t.mask[:, -1, 0].astype(jnp.int32)
        return jax.lax.fori_loop(0, ITERS, body, bonus)

    @jax.jit
    def accept_only(tree, logits):
        def body(i, tree):
            acc = acceptance.accept_greedy(tree, logits)
            return tree.replace(tokens=tree.tokens.at[:, 0].set(acc.bonus))
        return jax.lax.fori_loop(0, ITERS, body, tree)

    @jax.jit
    def all_three(cache, bonus, top_lp, top_tok, logits):
        def body(i, carry):
            cache, bonus = carry
            t = trees.build_ddtree(top_lp, top_tok, bonus, cache.seq_lens, budget)
            cache, slots = kv_pool.allocate(cache, nodes)
            cache = kv_pool.place(cache, slots)
            acc = acceptance.accept_greedy(t, logits)
            cache = kv_pool.commit_path(cache, slots, acc.path, acc.num_accepted * 0, jnp.ones((1,), bool))
            cache = cache._replace(seq_lens=cache.seq_lens - 1)  # stay at the same context length
            return cache, acc.bonus
        return jax.lax.fori_loop(0, ITERS, body, (cache, bonus))[1]

    return tree_only, accept_only, all_three


def derive(row: dict, layers: int, num_moe: int) -> dict:
    """The figures computed from a row's measured times and floors (shares, ratios, the 61-layer projection).

    Projection: the measured step less its per-step parts (drafter, head, tree + accept + commit) is the
    layers' part; each of the 61 - layers missing layers is an MoE layer, costed as the measured MoE per
    MoE layer plus the layers' part without MoE averaged over all layers (the one dense layer's MLP is
    spread over them: a small overestimate). It uses the step as measured, so components timed alone
    enter only through the MoE and the per-step parts. Rows from before the dense parts were timed
    (no "dense_ms") get "dense_rest_ms", the step less the other parts, instead of "unaccounted_ms".
    Profiled rows (their parts measured inside the step) also get the kernels outside every part and the
    GPU's idle time (the step less the union of its kernels), which together make "unaccounted"; rows with the
    engine's chunked loop timed get its step's idle time, less the union of the kernels inside the loop
    ("engine_idle_ms"), and the timed call's own cost ("call_ms": the timed step beyond the engine's, times its steps).
    """
    parts = ("attention_ms", "moe_ms", "drafter_ms", "head_ms", "tree_accept_commit_ms")
    f = row["floors"]
    if row.get("step_ms") is None or any(row.get(k) is None for k in parts) or f.get("moe_ms") is None:
        return row
    s = row["step_ms"]
    per_step = row["drafter_ms"] + row["head_ms"] + row["tree_accept_commit_ms"]
    rest = s - row["attention_ms"] - row["moe_ms"] - per_step
    measured = {"dense_rest_ms": rest} if row.get("dense_ms") is None else {"unaccounted_ms": rest - row["dense_ms"]}
    if row.get("profile"):  # unaccounted = kernels outside the named parts + the GPU idle between kernels
        measured.update(other_kernels_ms=row["profile"]["components_ms"]["other"],
                        idle_ms=s - row["profile"]["busy_ms"])
        outside = row["profile"].get("outside_loops")
        if row.get("engine_step_ms") is not None and outside:
            # The decode's step (its chunks' calls included) less the union of the kernels inside the loop; the timed
            # call's own cost is what its step holds beyond the engine's, over its steps.
            loop_busy = row["profile"]["busy_ms"] - outside["ms_per_call"] / outside["call_steps"]
            measured["engine_idle_ms"] = row["engine_step_ms"] - loop_busy
            measured["call_ms"] = row["steps"] * (s - row["engine_step_ms"])
    layer_part = s - per_step
    missing = 61 - layers
    projected = s + missing * ((layer_part - row["moe_ms"]) / layers + row["moe_ms"] / max(num_moe, 1))
    floor_layers = f["attention_ms"] + f["moe_ms"] + f.get("dense_ms", f.get("dense_rest_ms"))
    step_floor = floor_layers + f["drafter_ms"] + f["head_ms"]
    projected_floor = step_floor + missing * ((floor_layers - f["moe_ms"]) / layers + f["moe_ms"] / max(num_moe, 1))
    row.update({**measured, "step_floor_ms": step_floor, "step_over_floor": s / step_floor,
                "attention_share": row["attention_ms"] / s, "tree_share": row["tree_accept_commit_ms"] / s,
                "moe_over_floor": row["moe_ms"] / f["moe_ms"],
                "projected_61_layer_step_ms": projected, "projected_61_layer_floor_ms": projected_floor,
                "projected_61_layer_tree_share": row["tree_accept_commit_ms"] / projected})
    return row


def command_buffer_note(meta: dict, rows: list) -> str:
    """How the step loops ran: inside command buffers (as the engine's) or from the host (a round trip a step)."""
    if "command_buffers" not in meta:
        return ""  # a run from before the flag was recorded (it ran its loops from the host)
    loops = sorted({r["host_driven_loops"] for r in rows if r.get("host_driven_loops") is not None})
    return (" Step loops " + ("in command buffers (the while loop captured, as the engine runs it)"
                              if meta["command_buffers"] else "run from the host (command buffers off, or a CPU)")
            + (f"; while loops run from the host per step program: {', '.join(map(str, loops))}" if loops else "") + ".")


def render(path: str) -> None:
    """Recompute the derived figures of a results JSON (e.g. after a change of formula) and its markdown."""
    with open(path + ".json") as fh:
        data = json.load(fh)
    meta = data["meta"]
    layers = meta["layers"]
    num_moe = meta.get("moe_layers", layers - 1)  # K2: the first layer is dense
    rows = [derive(r, layers, num_moe) for r in data["rows"]]
    with open(path + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    write_markdown(path + ".md", meta, rows)


def tree_only_main(args) -> None:
    """--tree-only: the tree build (one top-k over a static candidate set vs the level-by-level search) and
    the greedy acceptance (closed form vs the step-by-step walk), alone, K2 drafter shapes (D = 15, K = 8,
    the rank's 20480-row vocab slice). No model and no extension needed."""
    depth, vocab = (3, 64) if args.smoke else (15, 163840 // TP)
    node_list = [int(t) for t in args.nodes.split(",")]
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(4), (1, depth, vocab)), -1)
    top_lp, top_tok = jax.lax.top_k(lp, TOPK)
    start = jnp.array([1000], jnp.int32)
    rows, timings = [], {}

    def old_greedy(tree, logits):
        def choose(node):
            row = jnp.take_along_axis(logits, node[:, None, None], axis=1)[:, 0]
            return jnp.argmax(row, axis=-1).astype(jnp.int32)
        return acceptance.walk(tree, choose)

    for nodes in node_list:
        budget = min(nodes - 1, trees.max_ddtree_budget(depth, TOPK))
        logits = jax.random.normal(jax.random.key(5), (1, budget + 1, vocab), jnp.float32)
        tree = trees.build_ddtree(top_lp, top_tok, jnp.array([1], jnp.int32), start, budget)
        # Logits that accept a few levels: the target's argmax at each node is its first child's token.
        first_child = jnp.argmax(tree.parents[0][None, :] == jnp.arange(budget + 1)[:, None], axis=1)
        follow = jnp.where(jnp.any(tree.parents[0][None, :] == jnp.arange(budget + 1)[:, None], axis=1),
                           tree.tokens[0][first_child], 0)
        logits_follow = logits.at[0, jnp.arange(budget + 1), follow].add(100.0)
        candidates = trees.static_candidate_count(budget, depth, TOPK)
        for mode in ("static", "levels") if candidates is not None else ("levels",):
            @jax.jit
            def tree_loop(bonus, top_lp, top_tok):
                def body(i, bonus):
                    t = trees.build_ddtree(top_lp, top_tok, bonus, start, budget, method=mode)
                    return t.tokens[:, -1] + t.mask[:, -1, 0].astype(jnp.int32)
                return jax.lax.fori_loop(0, ITERS, body, bonus)

            exe = tree_loop.lower(jnp.array([1], jnp.int32), top_lp, top_tok).compile()
            timings[(nodes, "tree_" + mode)] = median_seconds(exe, jnp.array([1], jnp.int32), top_lp, top_tok,
                                                              reps=9)[0] / ITERS
        for name, fn in (("accept_closed_form", acceptance.accept_greedy), ("accept_walk", old_greedy)):
            for which, lg in (("random", logits), ("follows_first_child", logits_follow)):
                @jax.jit
                def accept_loop(tree, lg):
                    def body(i, tree):
                        acc = fn(tree, lg)
                        return tree.replace(tokens=tree.tokens.at[:, 0].set(acc.bonus))
                    return jax.lax.fori_loop(0, ITERS, body, tree)
                timings[(nodes, f"{name}_{which}")] = median_seconds(accept_loop, tree, lg, reps=9)[0] / ITERS
        accepted = int(acceptance.accept_greedy(tree, logits_follow).num_accepted[0])

        @jax.jit
        def empty_loop(x):  # the loop's own cost per round, to subtract
            return jax.lax.fori_loop(0, ITERS, lambda i, x: x + 1, x)
        timings[(nodes, "empty_loop")] = median_seconds(empty_loop, jnp.array([1], jnp.int32), reps=9)[0] / ITERS
        row = {"nodes": nodes, "budget": budget, "accepted_when_following": accepted,
               "static_candidates": candidates}
        row.update({k[1] + "_us": v * 1e6 for k, v in timings.items() if k[0] == nodes})
        rows.append(row)
        log(json.dumps(row))
    out = args.out or (os.path.join(smoke_dir("tree_build"), "tree_build_smoke") if args.smoke
                       else os.path.join(os.path.dirname(__file__), "results", "tree_build_h200"))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": jax.devices()[0].device_kind, "commit": git_commit(), "depth": depth, "topk": TOPK,
            "vocab": vocab, "timing": f"median of 9 calls of a {ITERS}-round jitted fori_loop, per round"}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    keys = [k for k in rows[0] if k.endswith("_us")]
    lines = [f"# Tree build and greedy acceptance alone ({meta['device']})", "",
             f"{meta['date']}, commit {meta['commit']}; D = {depth}, K = {TOPK}, vocab slice {vocab}; "
             f"{meta['timing']} (µs; empty_loop is the loop's own round).", "",
             "| T | static candidates | accepted (following) | " + " | ".join(k[:-3] for k in keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    for r in rows:
        lines.append(f"| {r['nodes']} | {r['static_candidates']} | {r['accepted_when_following']} | "
                     + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    with open(out + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    log(f"wrote {out}.{{json,md}}")


class Job:
    """One program: lowered now, compiled in a thread, timed later."""

    def __init__(self, name, fn, args, kwargs=None):
        self.name, self.args = name, args
        t = time.perf_counter()
        self.lowered = fn.lower(*args, **(kwargs or {}))
        self.lower_s = time.perf_counter() - t
        self.future = None

    def compile(self):
        t = time.perf_counter()
        exe = self.lowered.compile()
        return exe, time.perf_counter() - t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="4",
                   help="target layers, or 'fit': as many as the device's memory holds with every context's pool "
                        "(per-layer costs do not change with it; the fixed per-step costs weigh less with more)")
    p.add_argument("--reserve-gb", type=float, default=12.0,
                   help="with --layers fit: memory left for the drafter, workspaces and temporaries")
    p.add_argument("--contexts", default="4096,16384,65536,131072,200000", help="context lengths (tokens in the KV pool) to time, comma-separated")
    p.add_argument("--nodes", default="9,33", help="tree sizes T (nodes a verify step) to time, comma-separated")
    p.add_argument("--steps", type=int, default=8, help="speculative steps per timed loop")
    p.add_argument("--engine-chunks", type=int, default=4,
                   help="also time the engine's chunked loop (kdtree_jax.speculative.engine.ChunkedLoop, --steps steps a "
                        "chunk, the next chunk enqueued before the host reads the last) over this many chunks, for the "
                        "first impl: the step as a decode pays it, the calls' cost included (0: off)")
    p.add_argument("--impls", default="auto,xla",
                   help="attention impls of the timed steps, comma-separated: auto (the extension's kernel, "
                        "kdtree_jax.ops), ffi, xla (the fair XLA baseline, kdtree_jax/ops/xla.py: bf16 inputs, float32 "
                        "accumulation; one step per form of --xla-forms). The step with 'auto' is compared with the "
                        "faster XLA step. 'reference', the float32 oracle, is a correctness check and is refused")
    p.add_argument("--xla-forms", default="dense,chunked",
                   help="the XLA baseline's forms to time, comma-separated: dense (all of L at once, impl 'xla') and "
                        f"chunked (over L, {XLA_CHUNK} positions a step, online softmax, impl 'xla_chunked'); the "
                        "faster step is the baseline (default: both, as verify_kernel.py does for the op alone)")
    p.add_argument("--reference-contexts", default="all",
                   help="contexts at which the impls other than 'auto' (the XLA baseline) also run ('all': every "
                        "context)")
    p.add_argument("--deadline-s", type=float, default=0,
                   help="start no new point after this many seconds from the start, compilation included (0: none); "
                        "a compile it cuts short keeps running beside the timings, which the report then flags")
    p.add_argument("--compile-threads", type=int, default=0, help="0: one per CPU core")
    p.add_argument("--profile", choices=("all", "kernel", "none"), default="all",
                   help="profile one run of each step loop (kernel: the FFI kernel's steps only; a few seconds per "
                        "step loop) and split the step into its parts by the kernels' named scopes "
                        "(kdtree_jax/profiling.py)")
    p.add_argument("--smoke", action="store_true", help="tiny widths and contexts on the CPU: a check that the script runs")
    p.add_argument("--out", default=None,
                   help="output path without extension: writes OUT.json and OUT.md (default: "
                        "benchmarks/results/decode_context_h200, or tree_build_h200 with --tree-only; --smoke: a temp dir)")
    p.add_argument("--tree-only", action="store_true",
                   help="only the tree build and the acceptance alone, old and new formulations (no model)")
    p.add_argument("--row-invariant", action="store_true",
                   help="row-invariant steps (SpecConfig.row_invariant: rows padded to 64-multiples, the attention "
                        "op's T-independent split partition; the XLA flags of runtime.configure(row_invariant=True) "
                        "are set here); run with and without to measure what the invariance costs")
    p.add_argument("--moe", choices=("fused", "xla"), default="fused",
                   help="fused: the MoE layers as the model runs them, the router's choice one CUDA kernel "
                        "(ops/route.py) and the shared expert inside the routed experts' pairs op where the model folds "
                        "it (MoE.folds_shared); xla: both as XLA ops, as the model ran them before (an A/B arm: run "
                        "once with each)")
    p.add_argument("--prologue", choices=("cuda", "xla"), default="xla",
                   help="cuda: MLA's q_a / kv_a products, norms and rope as one CUDA op at decode sizes "
                        "(ops/mla_prologue.py, forced on: the model does not take it yet, MODEL_TAKES_IT); xla: as "
                        "XLA ops, as the model runs them (an A/B arm)")
    p.add_argument("--render", default=None, metavar="PATH",
                   help="only recompute PATH.json's derived figures and rewrite PATH.md (no device work)")
    args = p.parse_args(argv)
    if args.render:
        render(args.render)
        return
    if args.tree_only:
        tree_only_main(args)
        return
    t_start = time.perf_counter()
    if args.moe == "xla":  # the A/B's other arm: the model then finds neither op in the extension
        from kdtree_jax.ops import moe as moe_ops
        from kdtree_jax.ops import route as route_ops
        moe_ops.pairs_shared_built = lambda: False
        route_ops.cuda_built = lambda: False
    from kdtree_jax.ops import mla_prologue
    mla_prologue.MODEL_TAKES_IT = args.prologue == "cuda"  # the prologue A/B's two arms
    if args.prologue == "cuda" and jax.default_backend() == "gpu" and not mla_prologue.cuda_built():
        p.error("--prologue cuda: this extension has no CUDA prologue op (rebuild it with nvcc)")

    def time_left():
        return args.deadline_s - (time.perf_counter() - t_start) if args.deadline_s else float("inf")

    device = jax.devices()[0].device_kind
    contexts = [64] if args.smoke else [int(c) for c in args.contexts.split(",")]
    node_list = [int(t) for t in args.nodes.split(",")]
    try:
        impls = step_impls(args.impls.split(","), args.xla_forms.split(","))
    except ValueError as e:
        p.error(str(e))
    if args.layers != "fit" and not args.layers.isdigit():
        p.error(f"--layers must be a number or 'fit', got {args.layers!r}")
    cfg, dcfg, tp, dfull = rank_configs(args.smoke, 2 if args.smoke or args.layers == "fit" else int(args.layers))
    max_nodes = max(node_list)
    width = dcfg.block_size

    def max_len_of(context):  # the pool's rows for one context: the context plus room for every step's writes
        return -(-(context + (room_steps + 2) * (width + max_nodes)) // 64) * 64

    room_steps = args.steps * max(args.engine_chunks, 1)  # every state has room for the chunked loop's steps

    if args.layers == "fit" and not args.smoke:
        cfg = cfg.replace(num_hidden_layers=layers_that_fit(cfg, dcfg, contexts, max_len_of, args.reserve_gb))
    layers = cfg.num_hidden_layers
    log(f"{device}: {layers} layers of {cfg.hidden_size} wide, {cfg.n_routed_experts} experts, "
        f"vocab slice {cfg.vocab_size}; drafter per rank {dcfg}")
    target = random_target(cfg, jnp.bfloat16, seed=0)
    drafter = on_device(lambda: Drafter(cfg, dcfg, jnp.bfloat16, rngs=nnx.Rngs(1)))
    jax.block_until_ready((nnx.state(target), nnx.state(drafter)))
    log(f"random weights on the device ({time.perf_counter() - t_start:.0f} s)")
    bws = copy_bandwidth()
    bw_name = max(bws, key=bws.get)
    bandwidth = bws[bw_name]
    log("bandwidth " + ", ".join(f"{k} {v / 1e12:.2f} TB/s" for k, v in bws.items()) + f"; floors use {bw_name}")

    moe_layers = [l.mlp for l in target.layers if l.is_moe]
    num_moe, moe_slots = len(moe_layers), (moe_layers[0].num_slots if moe_layers else 0)
    n_feat = len(drafter.target_layer_ids)

    # Byte counts (per step) ---------------------------------------------------------------------------
    expert_bytes_each = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    moe_fixed_bytes = sum(param_bytes(l.mlp, skip=("experts",)) for l in target.layers if l.is_moe)
    head_bytes = param_bytes(target.lm_head) if target.lm_head is not None else 0
    dense_bytes = param_bytes(target, skip=("experts", "embed_tokens")) - moe_fixed_bytes - head_bytes
    drafter_weight_bytes = param_bytes(drafter) + head_bytes  # the drafter reads the head slice again
    drafter_kv_row_bytes = dcfg.num_layers * 2 * dcfg.num_kv_heads * dcfg.head_dim * 2

    out = args.out or (os.path.join(smoke_dir("decode_context"), "decode_context_smoke") if args.smoke
                       else os.path.join(os.path.dirname(__file__), "results", "decode_context_h200"))
    meta = {"moe_layers": num_moe, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device, "layers": layers, "commit": git_commit(), "row_invariant": args.row_invariant,
            "moe": args.moe, "prologue": args.prologue,
            "command_buffers": runtime.command_buffers_configured() and jax.default_backend() == "gpu",
            "bandwidths_TBps": {k: v / 1e12 for k, v in bws.items()}, "floor_bandwidth": bw_name,
            "copy_bandwidth_TBps": bandwidth / 1e12,
            "preset": "tiny (smoke)" if args.smoke else "kimi-k2-tp8-rank",
            "rank_model": {"tp": tp, "target_vocab_rows": cfg.vocab_size, "target_heads": cfg.num_attention_heads,
                           "moe_intermediate": cfg.moe_intermediate_size, "dense_intermediate": cfg.intermediate_size,
                           "drafter_full": dataclasses.asdict(dfull), "drafter_rank": dataclasses.asdict(dcfg),
                           "drafter_fc": "replicated", "not_modelled": "the per-layer all-reduces and the "
                           "vocab-parallel merges (logsumexp, top-K, argmax of a few values per row)"},
            "bytes": {"expert_each": expert_bytes_each, "moe_shared_and_router": moe_fixed_bytes,
                      "target_head_slice": head_bytes, "target_dense_other": dense_bytes,
                      "drafter_weights_and_head": drafter_weight_bytes, "drafter_kv_per_position": drafter_kv_row_bytes},
            "fill": "random latent rows written straight into the pool at scattered slots, random drafter "
                    "context K/V (values do not change the cost)",
            "timing": f"step: mean over {args.steps} steps of one compiled decode loop, median of 3 runs after a "
                      f"warm-up; components: median of 5 calls of a {ITERS}-round jitted loop",
            "steps": args.steps, "engine_chunks": args.engine_chunks,
            "xla_baseline": "kdtree_jax/ops/xla.py: bf16 gather + einsums, float32 accumulation and softmax; per "
                            "(L, T) the faster step of its forms timed (impls " + ", ".join(
                                i for i in impls if i in XLA_IMPLS) + ")", "xla_chunk": XLA_CHUNK,
            "compile_s": {}, "lower_s": {}, "moe_inputs": {}}
    rows = []

    def save():
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        write_markdown(out + ".md", meta, rows)

    # States, one per context (T-independent: room for the largest tree) -----------------------------------
    states = {}
    for context in contexts:
        states[context] = make_state(cfg, dcfg, n_feat, context, max_len_of(context), room_steps, num_moe, moe_slots,
                                     jax.random.key(context))
    jax.block_until_ready(states)
    log(f"states ready ({time.perf_counter() - t_start:.0f} s)")

    # Shared inputs
    x_by_t = {t: jax.random.normal(jax.random.key(3 + t), (1, t, cfg.hidden_size), jnp.bfloat16) for t in node_list}
    lp = jax.nn.log_softmax(jax.random.normal(jax.random.key(4), (1, dcfg.depth, cfg.vocab_size)), -1)
    top_lp, top_tok = jax.lax.top_k(lp, TOPK)
    feats = jax.random.normal(jax.random.key(6), (n_feat, 1, 1, cfg.hidden_size), jnp.bfloat16)
    small = states[min(contexts)]
    absorbed = tuple(block.self_attn.absorbed_weights() for block in target.layers)  # as a decode loop has them

    def tree_inputs(nodes):
        logits = jax.random.normal(jax.random.key(5), (1, nodes, cfg.vocab_size), jnp.float32)
        tree = trees.build_ddtree(top_lp, top_tok, jnp.array([1], jnp.int32), small.cache.seq_lens, nodes - 1)
        return logits, tree

    # Groups of programs: everything for the kernel first (a cut-short run still has it), then the reference.
    def group_jobs(impl_set, shared: bool):
        jobs = {}
        for context in contexts:
            st = states[context]
            for nodes in node_list:
                for impl in impl_set:
                    if impl != "auto" and args.reference_contexts != "all" \
                            and str(context) not in args.reference_contexts.split(","):
                        continue
                    spec = engine.SpecConfig(budget=nodes - 1, topk=TOPK, max_new_tokens=args.steps, impl=impl,
                                             row_invariant=args.row_invariant)
                    jobs[("step", context, nodes, impl)] = Job("step", engine.decode_loop, (target, drafter, st),
                                                               {"spec": spec})
                    if args.engine_chunks and impl == impls[0]:
                        runner = engine.ChunkedLoop(target, drafter, dataclasses.replace(
                            spec, max_new_tokens=room_steps), args.steps)
                        job = jobs[("chunks", context, nodes, impl)] = Job("chunks", runner, (st,))
                        job.runner = runner  # time_job gives it the compiled program and runs its chunks
                    batch = AttentionBatch(st.cache.slot_table, jnp.array([context + nodes], jnp.int32),
                                           causal_mask(1, nodes), st.cache.slot_table[:, context:context + nodes])
                    q = jax.random.normal(jax.random.key(2), (1, nodes, cfg.num_attention_heads, cfg.cache_dim),
                                          jnp.bfloat16)
                    policy = "invariant" if args.row_invariant else "occupancy"
                    jobs[("attn", context, nodes, impl)] = Job("attn", attention_loop(impl, ITERS, policy),
                                                               (q, st.cache.pages, target, batch))
            if shared:
                jobs[("drafter", context)] = Job("drafter", drafter_loop(TOPK), (
                    jnp.array([1], jnp.int32), target, drafter, st.dcache, feats))
        if shared:
            for nodes in node_list:
                x = x_by_t[nodes]
                jobs[("moe", nodes)] = Job("moe", moe_loop(ITERS), (x, target))
                cos, sin = rope_cos_sin(cfg, jnp.arange(nodes, dtype=jnp.int32)[None] + min(contexts))
                jobs[("dense", nodes)] = Job("dense", dense_loop(ITERS), (x, target, absorbed, cos, sin))
                jobs[("moe_counts", nodes)] = Job("moe_counts", moe_counts, (x, target))
                jobs[("head", nodes)] = Job("head", head_only, (x, target))
                logits, tree = tree_inputs(nodes)
                t_only, a_only, all3 = tree_loops(nodes)
                cache = small.cache._replace(pages=jnp.zeros((1, small.cache.num_slots, 1), jnp.bfloat16))
                jobs[("tree", nodes)] = Job("tree", t_only, (jnp.array([1], jnp.int32), small.cache.seq_lens,
                                                              top_lp, top_tok))
                jobs[("accept", nodes)] = Job("accept", a_only, (tree, logits))
                jobs[("tree_accept_commit", nodes)] = Job("tac", all3, (cache, jnp.array([1], jnp.int32), top_lp,
                                                                         top_tok, logits))
        return jobs

    threads = args.compile_threads or os.cpu_count() or 4
    results = {}  # key -> seconds per round / per step
    extra = {}

    def run_group(impl_set, shared):
        t0 = time.perf_counter()
        jobs = group_jobs(impl_set, shared)
        t1 = time.perf_counter()
        log(f"group {impl_set}: lowered {len(jobs)} programs in {t1 - t0:.0f} s; compiling on {threads} threads")
        pool = ThreadPoolExecutor(threads)
        for job in jobs.values():
            job.future = pool.submit(job.compile)
        # Every compile first, then the timings: XLA autotunes on the device while it compiles, which would
        # disturb a timing running beside it. A deadline leaves 20 s for the timings.
        compiled = {}
        for key, job in jobs.items():
            try:
                wait = max(time_left() - 20, 0) if args.deadline_s else None
                compiled[key] = job.future.result(timeout=wait)
            except Exception as e:  # a compile failure, or the deadline
                results[key] = e
        pool.shutdown(wait=False, cancel_futures=True)
        t2 = time.perf_counter()
        log(f"group {impl_set}: compiled {len(compiled)} of {len(jobs)} programs in {t2 - t1:.0f} s")
        # A compile the deadline cut short still runs in its thread (XLA cannot be interrupted): the timings below
        # then share the host and the device with it, and a host-bound loop reads slow. Say so in the report.
        running = sum(not job.future.done() for job in jobs.values())
        if running:
            meta["timed_beside_compiles"] = meta.get("timed_beside_compiles", 0) + running
            log(f"group {impl_set}: warning: {running} compile(s) still running past the deadline; the timings "
                f"below run beside them and may read slow")
        for key, (exe, cs) in compiled.items():
            if key[0] == "moe" and ("moe_counts", key[1]) in compiled:
                route_like_steps(key[1], jobs, compiled[("moe_counts", key[1])][0])
            name = "/".join(map(str, key))
            meta["compile_s"][name] = round(cs, 2)
            meta["lower_s"][name] = round(jobs[key].lower_s, 2)
            if time_left() < 0:
                results[key] = TimeoutError("deadline")
                continue
            try:
                results[key] = time_job(key, exe, jobs[key])
            except Exception as e:
                results[key] = e
        for key, (exe, _) in compiled.items():
            if (key[0] == "step" and isinstance(results.get(key), float) and time_left() >= 0
                    and (args.profile == "all" or (args.profile == "kernel" and key[3] == "auto"))):
                profile_job(key, exe, jobs[key])
        log(f"group {impl_set}: timed in {time.perf_counter() - t2:.0f} s")

    def route_like_steps(nodes, jobs, counts_exe):
        """Give the MoE jobs of T = nodes inputs that reach as many experts per layer as the timed steps did."""
        timed = {k: e["moe_distinct_in_step"] for k, e in extra.items()
                 if k[0] == "step" and k[2] == nodes and e.get("moe_distinct_in_step") is not None}
        want = [v for k, v in timed.items() if k[3] == "auto"] or list(timed.values())  # the kernel's steps first
        if not want:
            return
        want = float(np.mean(want))
        base = jax.random.normal(jax.random.key(7 + nodes), (nodes, cfg.hidden_size), jnp.bfloat16)
        best = None
        for u in range(1, nodes + 1):  # u distinct rows, repeated in turn
            x = base[jnp.arange(nodes) % u][None]
            got = float((np.asarray(counts_exe(x, target)) > 0).sum(-1).mean())
            if best is None or abs(got - want) < abs(best[2] - want):
                best = (x, u, got)
        x, u, got = best
        for k in (("moe", nodes), ("moe_counts", nodes)):
            jobs[k].args = (x,) + tuple(jobs[k].args[1:])
        meta["moe_inputs"][str(nodes)] = {"distinct_rows": u, "distinct_experts": got, "steps_distinct_experts": want}
        log(f"MoE inputs for T = {nodes}: {u} distinct rows reach {got:.1f} experts per layer (steps: {want:.1f})")

    def profile_job(key, exe, job):
        """Profile a step loop after every timing of its group: a trace taken of a replayed CUDA graph can leave
        later replays slower (the engine's timed decode read 2x slow after one, spec_decode at 0ec9d93, H200)."""
        steps_run = extra[key]["steps"]
        try:
            s = engine.one_step_left(jax.tree.map(jnp.copy, job.args[2]))
            first = not any("profile" in e for e in extra.values())  # keep raw stats of one trace
            # The one-step run does the call's set-up once, as the timed call does: that work counts 1/steps_run a
            # step (call_steps), as in the timed step.
            extra[key]["profile"] = profile_call(exe, (job.args[0], job.args[1], s), call_steps=steps_run,
                                                 steps_of=lambda out: out.step, sample=12 if first else 0)
        except Exception as e:  # a failed profile leaves the timing and the components timed alone
            extra[key]["profile_error"] = f"{type(e).__name__}: {e}"[:300]
            log(f"profile of {key}: {extra[key]['profile_error']}")

    def time_fresh(run, state, reps):
        """([seconds] of reps runs, the last run's output): run(a fresh copy of state) each time. The loop
        donates its state, so every run gets its own copy, made one at a time: four copies made up front held four
        pools at once (out of memory at 200k on the H200 with 26 layers, 2026-11-30), and the previous run's output
        (which holds a pool) is dropped before the next copy."""
        times, final = [], None
        for _ in range(reps):
            final = None
            s = jax.tree.map(jnp.copy, state)
            jax.block_until_ready(s)
            t = time.perf_counter()
            final = run(s)
            jax.block_until_ready(final)
            times.append(time.perf_counter() - t)
        return times, final

    def time_job(key, exe, job):
        kind = key[0]
        if kind == "step":
            def run(s):
                return exe(job.args[0], job.args[1], s)
            times, final = time_fresh(run, job.args[2], 4)
            steps_run = int(final.step)
            hist = np.asarray(final.accepted_hist)
            active = np.asarray(final.expert_load.device_active)  # [moe layers, devices], summed over steps
            extra[key] = {"steps": steps_run, "host_driven_loops": runtime.host_driven_loops(exe.as_text() or ""),
                          "tau": float((hist * (np.arange(hist.shape[0]) + 1)).sum() / max(int(hist.sum()), 1)),
                          "moe_distinct_in_step": float(active.sum(-1).mean() / steps_run) if active.size else None}
            return float(np.median(times[1:])) / steps_run
        if kind == "chunks":  # the engine's pipelined chunks over the state's room, from a fresh copy each run
            job.runner.compiled = exe
            times, (final, chunks) = time_fresh(job.runner.run, job.args[0], 3)
            extra[key] = {"steps": int(final.step), "chunks": chunks}
            return float(np.median(times[1:])) / int(final.step)
        if kind == "moe_counts":
            return np.asarray(exe(*job.args))
        return median_seconds(exe, *job.args)[0] / ITERS

    def value(key):
        v = results.get(key)
        return v if isinstance(v, float) else None

    def build_rows():
        rows.clear()
        for context in contexts:
            for nodes in node_list:
                for impl in impls:
                    key = ("step", context, nodes, impl)
                    if key not in results:
                        continue
                    rows.append(make_row(context, nodes, impl))

    def make_row(context, nodes, impl):
        step = value(("step", context, nodes, impl))
        errs = {"/".join(map(str, k)): f"{type(v).__name__}: {v}"[:300] for k, v in results.items()
                if isinstance(v, Exception) and (k[1:] in [(context, nodes, impl), (context,), (nodes,)])}
        parts = {"attention_ms": value(("attn", context, nodes, impl)), "moe_ms": value(("moe", nodes)),
                 "drafter_ms": value(("drafter", context)), "head_ms": value(("head", nodes)),
                 "dense_ms": value(("dense", nodes)),
                 "tree_accept_commit_ms": value(("tree_accept_commit", nodes)),
                 "tree_build_ms": value(("tree", nodes)), "accept_ms": value(("accept", nodes))}
        parts = {k: (None if v is None else v * 1e3) for k, v in parts.items()}
        counts = results.get(("moe_counts", nodes))
        component_distinct = float(np.mean([(c > 0).sum() for c in counts])) if isinstance(counts, np.ndarray) else None
        in_step = extra.get(("step", context, nodes, impl), {}).get("moe_distinct_in_step")
        distinct = in_step if in_step is not None else component_distinct  # the floor: what the step read
        floors = {"attention_ms": layers * (context + nodes) * cfg.cache_dim * 2 / bandwidth * 1e3,
                  "moe_ms": None if distinct is None else
                  (num_moe * distinct * expert_bytes_each + moe_fixed_bytes) / bandwidth * 1e3,
                  "drafter_ms": (drafter_weight_bytes + context * drafter_kv_row_bytes) / bandwidth * 1e3,
                  "head_ms": head_bytes / bandwidth * 1e3,
                  "dense_ms": dense_bytes / bandwidth * 1e3}
        chunked = value(("chunks", context, nodes, impl))
        row = {"context": context, "nodes": nodes, "impl": impl, **extra.get(("step", context, nodes, impl), {}),
               "step_ms": None if step is None else step * 1e3, **parts,
               **({} if chunked is None else {"engine_step_ms": chunked * 1e3,
                                              "engine_chunks": extra[("chunks", context, nodes, impl)]}),
               "moe_distinct_experts_per_layer": distinct, "moe_component_distinct_experts": component_distinct,
               "floors": floors}
        if errs:
            row["errors"] = errs
        profile = row.get("profile")
        if profile is not None:  # the parts as they ran inside the step; the loops' figures are kept beside
            row["alone_ms"] = {k: parts[k] for k in PROFILED_PARTS}
            row.update({k: profile["components_ms"][c] for k, c in PROFILED_PARTS.items()})
        if step is None or any(v is None for k, v in parts.items() if k != "dense_ms") or floors["moe_ms"] is None:
            return row
        return derive(row, layers, num_moe)

    # The kernel's group first (with the components that do not depend on the attention), then the others.
    groups = [g for g in ([i for i in impls if i == "auto"], [i for i in impls if i != "auto"]) if g]
    for n, g in enumerate(groups):
        if time_left() < 40:  # too little left to compile a group and time it
            log(f"deadline: group {g} not run")
            break
        run_group(g, shared=n == 0)
        build_rows()
        for r in rows:
            log(json.dumps({k: v for k, v in r.items() if k not in ("floors", "errors")}))
        meta["wall_s"] = round(time.perf_counter() - t_start, 1)
        save()
    build_rows()
    meta["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    log(f"wrote {out}.{{json,md}} ({meta['wall_s']} s)")


def _f(v, fmt="{:.3f}"):
    return "–" if v is None else fmt.format(v)


def dense_cells(r):
    """The dense parts' cell and the unaccounted cell; older rows had only the step less the other parts."""
    f = r["floors"]
    if r.get("dense_ms") is None:
        return f"rest {r['dense_rest_ms']:.3f} ({f.get('dense_ms', f.get('dense_rest_ms')):.3f}) | –"
    return f"{r['dense_ms']:.3f} ({f['dense_ms']:.3f}) | {r['unaccounted_ms']:.3f}"


def write_markdown(path, meta, rows):
    bws = ", ".join(f"{k} {v:.2f}" for k, v in meta["bandwidths_TBps"].items())
    rm = meta["rank_model"]
    lines = [f"# Decode steps at long context, {meta['preset']}, {meta['layers']} layers ({meta['device']})", "",
             f"{meta['date']}, commit {meta['commit']}. Bandwidth measured (TB/s): {bws}; floors use "
             f"{meta['floor_bandwidth']} ({meta['copy_bandwidth_TBps']:.2f} TB/s). Pool fill: {meta['fill']}. "
             f"{meta['timing']}." + command_buffer_note(meta, rows)
             + (" MoE: " + {"fused": "the router's choice one CUDA kernel, the shared expert inside the routed "
                "experts' pairs op (as the model runs them)", "xla": "the router's choice and the shared expert as XLA "
                "ops (the model before them: an A/B arm)"}[meta["moe"]] + "." if "moe" in meta else "")
             + (" MLA prologue: " + {"cuda": "one CUDA op (ops/mla_prologue.py, forced on: an A/B arm)",
                                     "xla": "XLA ops (as the model runs it)"}[meta["prologue"]] + "."
                if "prologue" in meta else ""), ""]
    if meta.get("timed_beside_compiles"):
        lines += [f"**Warning:** {meta['timed_beside_compiles']} compile(s) cut short by `--deadline-s` still ran while "
                  "the rows below were timed (XLA cannot stop a compile): their times may read slow. Rerun with a "
                  "longer deadline for figures to quote.", ""]
    lines += [f"One TP{rm['tp']} rank: {rm['target_heads']} heads, expert intermediate {rm['moe_intermediate']}, "
             f"lm head / embedding slice {rm['target_vocab_rows']} rows; drafter per rank "
             f"{rm['drafter_rank']['num_heads']} heads / {rm['drafter_rank']['num_kv_heads']} KV head(s) / MLP "
             f"{rm['drafter_rank']['intermediate_size']} (of {rm['drafter_full']['num_heads']} / "
             f"{rm['drafter_full']['num_kv_heads']} / {rm['drafter_full']['intermediate_size']}), fc "
             f"{rm['drafter_fc']}, the head slice shared. Not modelled: {rm['not_modelled']}.", "",
             "Times in ms, floors in parentheses (bytes / bandwidth). Parts: kernel time inside the timed step, "
             "from a profile of one step of it (one run of the loop with one step left; kdtree_jax/profiling.py), "
             "on rows marked * ; otherwise each part "
             "timed alone in its own loop. Unaccounted: the step less the parts. Tree+accept+commit [build / "
             "acceptance]: the brackets are timed alone.", "",
             "| L | T | attention | tau | step (floor) | step / floor | attention (floor) share | MoE (floor) | "
             "drafter (floor) | head (floor) | tree+accept+commit [build / accept] share | dense (floor) | "
             "unaccounted | 61 layers, projected (floor) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["floors"]
        if "step_over_floor" not in r:
            lines.append(f"| {r['context']} | {r['nodes']} | {impl_label(r['impl'], meta)} | – | {_f(r.get('step_ms'))} | – | "
                         f"{_f(r.get('attention_ms'))} | – | – | – | – | – | – | – |"
                         + (f" errors: {'; '.join(r['errors'].values())[:300]}" if r.get("errors") else ""))
            continue
        lines.append(
            f"| {r['context']} | {r['nodes']} | {impl_label(r['impl'], meta)}{' *' if r.get('profile') else ''} | {r['tau']:.2f} | {r['step_ms']:.3f} ({r['step_floor_ms']:.3f}) | "
            f"{r['step_over_floor']:.2f} | {r['attention_ms']:.3f} ({f['attention_ms']:.3f}) {100 * r['attention_share']:.1f}% | "
            f"{r['moe_ms']:.3f} ({f['moe_ms']:.3f}) | {r['drafter_ms']:.3f} ({f['drafter_ms']:.3f}) | "
            f"{r['head_ms']:.3f} ({f['head_ms']:.3f}) | {r['tree_accept_commit_ms']:.3f} [{r['tree_build_ms']:.3f} / "
            f"{r['accept_ms']:.3f}] {100 * r['tree_share']:.1f}% | {dense_cells(r)} | "
            f"{r['projected_61_layer_step_ms']:.1f} ({r['projected_61_layer_floor_ms']:.1f}) |")
    full = [r for r in rows if "step_over_floor" in r]
    by = {(r["context"], r["nodes"], r["impl"]): r for r in full}
    base = xla_baselines(by)
    if base:
        forms = [i for i in XLA_IMPLS if any(k[2] == i for k in by)]
        title = ("Kernel vs the fair XLA baseline attention (kdtree_jax/ops/xla.py: bf16 gather + einsums, float32 "
                 "accumulation and softmax; same run), at each L and T the faster step of its forms timed: "
                 + " and ".join(impl_label(i, meta) for i in forms) + ". The float32 oracle is not a baseline")
    else:  # results of older runs, which compared with the float32-HIGHEST oracle
        base = {k[:2]: r for k, r in by.items() if k[2] == "reference"}
        title = ("Kernel vs the float32-HIGHEST oracle as attention (kdtree_jax/ops/reference.py; an older run, "
                 "not the fair XLA baseline)")
    pairs = [(k, by[k], base.get(k[:2])) for k in sorted(by) if k[2] == "auto"]
    if any(ref for _, _, ref in pairs):
        lines += ["", title + ": step ms, attention ms, and the step ratio.", "",
                  "| L | T | step kernel | step XLA | XLA attention | XLA / kernel | attention kernel | attention XLA | "
                  "61 layers kernel | 61 layers XLA |", "|---|---|---|---|---|---|---|---|---|---|"]
        for (c, t, _), a, ref in pairs:
            if ref:
                lines.append(f"| {c} | {t} | {a['step_ms']:.3f} | {ref['step_ms']:.3f} | {impl_label(ref['impl'], meta)} | "
                             f"{ref['step_ms'] / a['step_ms']:.2f} | "
                             f"{a['attention_ms']:.3f} | {ref['attention_ms']:.3f} | {a['projected_61_layer_step_ms']:.1f} | "
                             f"{ref['projected_61_layer_step_ms']:.1f} |")
    profiled = [r for r in full if r.get("profile") and r.get("alone_ms")]
    if profiled:
        names = [("attention_ms", "attention"), ("moe_ms", "MoE"), ("dense_ms", "dense"), ("drafter_ms", "drafter"),
                 ("head_ms", "head"), ("tree_accept_commit_ms", "tree+accept+commit")]
        lines += ["", "Inside the step (profile) vs alone (own loop), ms per step; other: kernels outside the "
                  "named parts (embedding, pool writes, the loop's bookkeeping); idle: the step less the union of its "
                  "kernels. The timed step is one call's time over its steps, so it holds the call's own cost (its "
                  "launch, set-up and host time, on a fresh copy of the state) spread over them. engine step: the "
                  "engine's chunked loop (ChunkedLoop, as a decode runs it: the next chunk enqueued before the host "
                  "reads the last; its calls' cost included) over its chunks; its idle = engine step - the union of the "
                  "kernels inside the loop (% of the engine step); call = steps x (step - engine step). The profile is "
                  "of a one-step run of the loop, after the timings; the kernels outside the loop (set-up a call does "
                  "once) count 1/steps of the timed call a step, as in the timed step.", "",
                  "| L | T | impl | attention | " + " | ".join(n for _, n in names[1:])
                  + " | other | idle | step | engine step (chunks) | its idle | call | kernels |",
                  "|---|---|---|" + "---|" * (len(names) + 7)]
        for r in profiled:
            cells = " | ".join(f"{r[k]:.3f} / {r['alone_ms'][k]:.3f}" if r["alone_ms"].get(k) is not None
                               else f"{r[k]:.3f} / –" for k, _ in names)
            chunked = "– | – | –" if r.get("engine_idle_ms") is None else (
                f"{r['engine_step_ms']:.3f} ({r['engine_chunks']['chunks']}) | {r['engine_idle_ms']:.3f} "
                f"({100 * r['engine_idle_ms'] / r['engine_step_ms']:.1f}%) | {r['call_ms']:.2f}")
            lines.append(f"| {r['context']} | {r['nodes']} | {impl_label(r['impl'], meta)} | {cells} | {r['other_kernels_ms']:.3f} | "
                         f"{r['idle_ms']:.3f} | {r['step_ms']:.3f} | {chunked} | "
                         f"{r['profile']['kernels_per_step']:.0f} |")
    shown = next((r for r in profiled if (r["context"], r["nodes"], r["impl"]) == (65536, 9, "auto")),
                 profiled[0] if profiled else None)
    if shown is not None and shown["profile"].get("top_kernels"):
        lines += ["", f"Largest kernels per part at L = {shown['context']}, T = {shown['nodes']}, {impl_label(shown['impl'], meta)} "
                  "(ms per step, launches per step; a kernel's instances in every layer added up):", ""]
        for part, top in shown["profile"]["top_kernels"].items():
            lines.append(f"- {part}: " + "; ".join(f"`{name}` {ms:.3f} ({n:g})" for name, ms, n in top[:4]))
    gapped = [r for r in profiled if r["profile"].get("idle_gaps")]
    if gapped:
        lines += ["", "Largest idle gaps per step in the profiled call, by the kernels around them (the kernel that ended "
                  "last -> the kernel that starts; ms per step, gaps per step; the profiled call runs on a fresh copy of "
                  "the state, and its gaps need not be the timed loop's: the idle columns above are those):", ""]
        for r in gapped:
            lines.append(f"- L = {r['context']}, T = {r['nodes']}, {impl_label(r['impl'], meta)}: " + "; ".join(
                f"`{name}` {ms:.3f} ({n:g})" for name, ms, n in r["profile"]["idle_gaps"][:6]))
    kernel = [r for r in full if r["impl"] == "auto"]
    if kernel:
        def span(vals, fmt):
            return f"{fmt.format(min(vals))}–{fmt.format(max(vals))}"
        at64 = [r for r in kernel if r["context"] == 65536 and r["nodes"] == 9]
        lines += ["", "Targets (kernel rows):",
                  "- attention ≤ 15% of the step at 64k, T = 9: "
                  + (f"{100 * at64[0]['attention_share']:.1f}% ({'met' if at64[0]['attention_share'] <= 0.15 else 'missed'})"
                     if at64 else "not measured"),
                  "- MoE within 1.5× of its floor: " + "; ".join(
                      f"T = {t}: {min(r['moe_over_floor'] for r in kernel if r['nodes'] == t):.2f}× "
                      f"({'met' if max(r['moe_over_floor'] for r in kernel if r['nodes'] == t) <= 1.5 else 'missed'})"
                      for t in sorted({r['nodes'] for r in kernel})),
                  f"- step within 1.5× of the step floor: {span([r['step_over_floor'] for r in kernel], '{:.2f}')}× "
                  f"({'met' if max(r['step_over_floor'] for r in kernel) <= 1.5 else 'missed'}); projected 61-layer step "
                  f"over its floor: {span([r['projected_61_layer_step_ms'] / r['projected_61_layer_floor_ms'] for r in kernel], '{:.2f}')}×",
                  f"- tree + accept + commit < 2% of the step: {span([100 * r['tree_share'] for r in kernel], '{:.1f}')}% of "
                  f"this {meta['layers']}-layer step ({'met' if max(r['tree_share'] for r in kernel) < 0.02 else 'missed'}), "
                  f"{span([100 * r['projected_61_layer_tree_share'] for r in kernel], '{:.2f}')}% of the projected 61-layer step"]
        chunked = [r for r in kernel if r.get("engine_idle_ms") is not None]
        if chunked:
            lines.append(f"- idle ≤ 3% of the engine's step (chunks of {meta.get('steps')} steps, their calls included): "
                         + "; ".join(f"T = {r['nodes']}: {100 * r['engine_idle_ms'] / r['engine_step_ms']:.1f}% "
                                     f"({'met' if r['engine_idle_ms'] <= 0.03 * r['engine_step_ms'] else 'missed'})"
                                     for r in chunked))
    def distinct_span(t):
        vals = [r["moe_distinct_experts_per_layer"] for r in rows
                if r["nodes"] == t and r.get("moe_distinct_experts_per_layer") is not None]
        return f"{min(vals):.1f}–{max(vals):.1f}" if vals else "–"
    moe_inputs = meta.get("moe_inputs") or {}
    lines += ["", "MoE: distinct experts per MoE layer per step, " + (
              "counted in the timed steps (the MoE floor uses each row's own): " if moe_inputs else
              "router on the MoE component's random inputs (this run predates counting them in the step): ")
              + ", ".join(f"T={t}: {distinct_span(t)}" for t in sorted({r['nodes'] for r in rows})) + "."
              + "".join(f" The MoE component at T={t} ran on {v['distinct_rows']} distinct rows, which reach "
                        f"{v['distinct_experts']:.1f} experts per layer." for t, v in sorted(moe_inputs.items(), key=lambda kv: int(kv[0]))),
              "Projection (not a measurement): the measured step plus, for each of the 61 − layers missing "
              "layers, the measured MoE per MoE layer and the step's layer part without MoE per layer (the "
              "layer part: the step less drafter, head and tree + accept + commit). Floors likewise.", ""]
    if meta.get("notes"):  # reading notes live in the JSON, so --render keeps them
        lines += ["## Reading it", ""] + list(meta["notes"]) + [""]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # compiles cut short by the deadline may still run in pool threads: do not wait for them
