"""Speculative decoding of the default pair: autoregressive vs chain (DFlash) vs DDTree budgets.

    python benchmarks/spec_decode.py                                   # checkpoints/default, all budgets
    python benchmarks/spec_decode.py --prompts 16 --max-new-tokens 64  # a smaller run
    python benchmarks/spec_decode.py --smoke                           # random tiny pair, CPU, seconds
    python benchmarks/spec_decode.py --budgets auto,16,32              # the adaptive budget against fixed ones

Prompts: the held-out files of the corpus (kdtree_jax/corpus.py, split "eval"), tokenized with the
checkpoint's tokenizer; prompt i is the window of --prompt-len tokens that ends where file i (round
robin) is cut, at a fraction (0.5 + i * 0.618...) mod 1 of its length (deterministic, varied offsets).

For each temperature (greedy and T = 0.7 by default) and each decoder — autoregressive (a root-only
tree through the same jitted loop), chain (the drafter's top-1 at every depth), DDTree at each
--budgets value (best-first tree of `budget` nodes over the drafter's top---topk per depth; `auto`: the
adaptive budget, each step picking from {0, 4, 8, 16, 32, 64} by the drafter's probabilities and this
device's cost model, engine.generate(budget="auto"); its rows add the steps per budget, the steps without
the drafter and the predicted vs observed tau; the cost model is measured by the first call of each
batch size and sampling mode that finds none cached, untimed, and --calibrate measures it anew) — every
prompt is decoded for --max-new-tokens tokens in batches of --batch (default 1: latency, the case
speculative decoding is for). The engine compiles the loop ahead of time, so timings are decode only:
one warm-up call first (discarded), then tokens/s = sum of decoded tokens / sum of decode seconds over
all batches (the first token of each sequence comes from the prefill and is not counted), and the
median over batches. tau (tokens per target forward, bonus included) and the per-depth acceptance
(P(at least d drafted tokens accepted)) are averaged over sequence steps. At T = 0 every speculative
output is compared token by token with the autoregressive one of the same batch size (greedy decoding is
lossless, but a T-row verify pass that rounds a row differently from the one-token step can flip a near-tie):
per decoder and batch size, how many outputs are identical and, per prompt, the index of the first generated
token that differs (0 = the token the prefill chose). --batch takes several sizes (e.g. 1,16); with more than
one, each autoregressive output is also compared with the first size's (the verify rows' batch invariance).

--chunk-steps: decode steps per host iteration (kdtree_jax.speculative.engine.ChunkedLoop; 0: the whole decode in one
call), several values each a sweep; each row reports the host's reads per step and, on a GPU, the compiled loop's
while loops outside command buffers (each reads its predicate on the host every step). The script calls
kdtree_jax.runtime.configure() before JAX starts (command buffers capture the loop); --no-command-buffers does not.
GPU comparison: `python benchmarks/spec_decode.py --batch 1,16 --chunk-steps 0,1,8,16 --temperatures 0`, once with
and once with --no-command-buffers.

--refill N: continuous batching, as a server runs. A static batch decodes until its slowest sequence is done (a
speculative sequence's steps vary with what the target accepts, so its rows finish apart); with --refill, N held-out
prompts stream through each batch size's rows, and a row whose sequence is done takes the next waiting prompt between
chunks (prefilled alone and copied into the row in one dispatch: engine.ChunkedLoop.admit, the server's admission path;
nothing compiles after an untimed warm-up). Each decoder gets a refill row per batch size, chunk size and temperature:
tok/s = every generated token / wall seconds from the first admission to the last token on the host (prefills
included), batch steps, tau, row occupancy, speed-up vs the autoregressive refill run and, greedy, how many outputs
equal that run's. H200 example: `python benchmarks/spec_decode.py --batch 16 --refill 64 --temperatures 0 --budgets 16,32`.

Writes <out>/spec_decode_<device>.{json,md} (--smoke: spec_decode_smoke_<device>.*), with the device
kind, date and commit.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import sys
import tempfile
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kdtree_jax import runtime  # noqa: E402

# Before JAX starts a backend: command buffers that capture the decode loop on a GPU (--no-command-buffers: off), and
# with --row-invariant the XLA flags a row-invariant decode needs.
runtime.configure(False if "--no-command-buffers" in sys.argv else None, row_invariant="--row-invariant" in sys.argv)

import kdtree_jax  # noqa: E402
from kdtree_jax.checkpoint import add_dtype_argument, recommended_tree_temperature  # noqa: E402
from kdtree_jax.provenance import git_commit  # noqa: E402
from kdtree_jax import corpus  # noqa: E402
from kdtree_jax.model.drafter import DrafterConfig  # noqa: E402
from kdtree_jax.speculative.sampling import SamplingParams
from kdtree_jax.speculative import tree as trees  # noqa: E402
from kdtree_jax import kv_pool  # noqa: E402
from kdtree_jax.serve.scheduler import compile_count  # noqa: E402
from kdtree_jax.speculative import admission, budget_policy, engine, validation  # noqa: E402
from kdtree_jax.speculative import cost_model as cost_models  # noqa: E402
from kdtree_jax.speculative.engine import DEFAULT_CHUNK_STEPS, generate  # noqa: E402
from kdtree_jax.tokenizer import ByteTokenizer  # noqa: E402

DEFAULT_CHECKPOINT = os.path.join(ROOT, "checkpoints", "default")
DEFAULT_OUT = os.path.join(ROOT, "benchmarks", "results")
GOLDEN = 0.6180339887498949


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# Shared with tree_shapes.py ---------------------------------------------------------------------------
def smoke_pair():
    """The random-init tiny pair of --smoke: tiny target (2 layers: 1 dense + 1 MoE), 1-layer drafter of
    block size 4, byte tokenizer (ids < 256 fit the tiny vocab of 512)."""
    cfg = kdtree_jax.ModelConfig.preset("tiny").replace(num_hidden_layers=2)
    target = kdtree_jax.init_model(cfg, seed=0)
    drafter = kdtree_jax.init_drafter(cfg, DrafterConfig(block_size=4, num_layers=1, head_dim=16), seed=1)
    return target, drafter, ByteTokenizer()


def add_tree_temperature_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree-temperature", type=float, default=None,
                   help="DDTree ranks prefixes by the drafter's probabilities at this temperature (< 1 sharpens); default: "
                        "the checkpoint's recommendation (kdtree_checkpoint.json extra.decoding), else 1.0")


def resolve_tree_temperature(args) -> None:
    """--tree-temperature, else the checkpoint's recommendation, else 1.0 (the smoke pair has none)."""
    if args.tree_temperature is None:
        args.tree_temperature = 1.0 if args.smoke else recommended_tree_temperature(args.checkpoint)


def load_pair(args):
    """(target, drafter, tokenizer, description) for --smoke or --checkpoint."""
    if args.smoke:
        target, drafter, tokenizer = smoke_pair()
        return target, drafter, tokenizer, "random-init tiny pair (smoke)"
    if not os.path.exists(os.path.join(args.checkpoint, "kdtree_checkpoint.json")):
        raise SystemExit(f"no checkpoint at {args.checkpoint} (kdtree_checkpoint.json missing); "
                         "train one (python -m kdtree_jax.train) or pass --checkpoint / --smoke")
    target, drafter, tokenizer = kdtree_jax.load_checkpoint(args.checkpoint, dtype=args.dtype)
    if drafter is None:
        raise SystemExit(f"the checkpoint at {args.checkpoint} has no drafter")
    return target, drafter, tokenizer, os.path.relpath(os.path.abspath(args.checkpoint), ROOT)


def heldout_prompts(tokenizer, count: int, length: int, start: int = 0):
    """Prompts `start .. start + count - 1`: prompt i is the `length` tokens before the cut of held-out
    file i (round robin over the files long enough) at fraction (0.5 + i * golden) mod 1 of the file.
    Returns (prompts as int32 arrays, descriptions "file@token")."""
    docs = corpus.documents("eval")
    encoded = [(d.name, np.asarray(tokenizer.encode(d.text), np.int32)) for d in docs]
    usable = [(n, ids) for n, ids in encoded if len(ids) > length + 1]
    if not usable:
        raise ValueError(f"no held-out file is longer than --prompt-len {length} tokens")
    prompts, where = [], []
    for i in range(start, start + count):
        name, ids = usable[i % len(usable)]
        frac = (0.5 + i * GOLDEN) % 1.0
        cut = length + int(frac * (len(ids) - length))
        prompts.append(ids[cut - length:cut])
        where.append(f"{name}@{cut}")
    return prompts, where


def greedy_loop_state(target, drafter, prompts: list, spec: engine.SpecConfig,
                      chunk_steps: int = engine.DEFAULT_CHUNK_STEPS):
    """A greedy decode loop's starting state for `prompts` under `spec`, with no stop ids (no row stops early: every
    timed step is a full batch's), and the drafter the loop runs (None where spec.budget is 0): -> (state, drafter).
    What the adaptive-budget benchmarks time their programs from."""
    use = drafter if spec.budget > 0 else None
    req = validation.validate(target, use, prompts, max_new_tokens=spec.max_new_tokens, budget=spec.budget,
                              topk=spec.topk, tree_temperature=1.0, temperature=0.0, stop_ids=(), tree="ddtree")
    state, loop_drafter, _ = engine.setup(target, use, req, spec, seed=0, chunk_size=64, kv_dtype=None, num_moe=0,
                                          slots=0, chunk_steps=chunk_steps)
    return state._replace(stop_ids=jnp.full_like(state.stop_ids, -1)), loop_drafter


def batches(items: list, size: int) -> list:
    """Consecutive batches of `size` (the last one may be shorter)."""
    return [items[i:i + size] for i in range(0, len(items), size)]


def device_kind() -> str:
    return str(jax.devices()[0].device_kind)


def device_slug(kind: str | None = None) -> str:
    """'cpu', 'h200', ... for file names."""
    kind = (kind or device_kind()).lower().replace("nvidia", "").strip()
    return re.sub(r"[^a-z0-9]+", "_", kind).strip("_") or "unknown"


def base_meta(args, target, drafter, pair: str) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "device": device_kind(),
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "pair": pair,
        "target_dtype": str(target.dtype),
        "target": {k: getattr(target.cfg, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                         "n_routed_experts", "num_experts_per_tok", "kv_lora_rank")},
        "drafter": drafter.cfg.to_dict(),
        "block_size": drafter.cfg.block_size,
        "command": " ".join([os.path.basename(sys.argv[0])] + list(args.argv)),
    }


def enable_compilation_cache(cache_dir: str):
    """Persistent XLA compilation cache (shapes are static: a rerun of the same sweep compiles nothing)."""
    if not cache_dir:
        return
    cache_dir = os.path.expanduser(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def aggregate(results: list, batch_sizes: list) -> dict:
    """Pools the engine's stats over the batches of one configuration."""
    steps = np.array([r.stats["sequence_steps"] for r in results], np.float64)
    total_steps = steps.sum()
    decoded = np.array([r.stats["new_tokens"] - b for r, b in zip(results, batch_sizes)], np.float64)
    seconds = np.array([r.stats["decode_seconds"] for r in results], np.float64)
    depth = len(results[0].stats["acceptance_by_depth"])
    acc = np.zeros(depth)
    tau = 0.0
    if total_steps:
        tau = float(sum(r.stats["tau"] * s for r, s in zip(results, steps) if s) / total_steps)
        for r, s in zip(results, steps):
            if s:
                acc += np.asarray(r.stats["acceptance_by_depth"]) * s
        acc /= total_steps
    return {
        "tau": tau if total_steps else float("nan"),
        "acceptance_by_depth": acc.round(5).tolist(),
        "tokens_per_second": float(decoded.sum() / seconds.sum()) if seconds.sum() > 0 else float("nan"),
        "tokens_per_second_median": float(np.median(decoded / np.maximum(seconds, 1e-12))),
        "target_forwards": int(sum(r.stats["steps"] for r in results)),
        "sequence_steps": int(total_steps),
        "new_tokens": int(sum(r.stats["new_tokens"] for r in results)),
        "decode_seconds": float(seconds.sum()),
        "prefill_seconds": float(sum(r.stats["prefill_seconds"] for r in results)),
        "num_nodes": int(results[0].stats["num_nodes"]),
    }


def aggregate_policy(results: list, batch_sizes: list, first=None) -> dict:
    """The adaptive budget's stats["budget_policy"] pooled over the batches of one configuration: steps per budget
    and without the drafter summed; predicted and observed tau (each call's, over its drafted sequence steps)
    averaged with weights drafted batch steps x batch size (a call's drafted sequence steps when every row is
    active: the summaries carry ratios only); the cost model as the first (warm-up) call found or measured it."""
    policies = [r.stats["budget_policy"] for r in results]
    menu = policies[0]["menu"]
    weights = np.array([sum(p["budget_steps"].values()) * b for p, b in zip(policies, batch_sizes)], np.float64)

    def pooled(key):
        values = np.array([p[key] for p in policies], np.float64)
        ok = (weights > 0) & np.isfinite(values)
        return float((values[ok] * weights[ok]).sum() / weights[ok].sum()) if ok.any() else float("nan")

    head = (first or results[0]).stats["budget_policy"]
    return {
        "menu": menu,
        "budget_steps": {str(b): int(sum(p["budget_steps"][str(b)] for p in policies)) for b in menu},
        "steps_without_drafter": int(sum(p["steps_without_drafter"] for p in policies)),
        "predicted_tau": pooled("predicted_tau"),
        "observed_tau": pooled("observed_tau"),
        "costs_ms": policies[-1]["costs_ms"],
        "calibration": policies[-1].get("calibration"),
        "calibrated": bool(head.get("calibrated")),
        "calibration_seconds": head.get("calibration_seconds"),
        "cost_model": head.get("cost_model"),
    }


def run_config(target, drafter, prompt_batches, *, tree, budget, topk, temperature, top_k, top_p, seed,
               max_new_tokens, impl, warmup: bool = True, tree_temperature: float = 1.0, profile: bool = False,
               chunk_steps: int = DEFAULT_CHUNK_STEPS, row_invariant: bool = False, calibrate: bool = False):
    """Decodes every batch with one decoder; returns (aggregated stats, tokens per prompt, compile s).
    profile: the first call also runs the loop once under the profiler (kdtree_jax.profiling); its split of a
    step's kernel time by part is stats["step_profile"] (with warmup, that call is not timed).
    budget "auto": the adaptive budget; the first call takes the cost model from the cache or measures it (untimed:
    engine.generate times the decode only; calibrate: measured again), and stats["budget_policy"] pools what the
    policy did (aggregate_policy)."""
    kwargs = dict(max_new_tokens=max_new_tokens, budget=budget, topk=topk, temperature=temperature, top_k=top_k,
                  top_p=top_p, impl=impl, tree=tree, tree_temperature=tree_temperature, chunk_steps=chunk_steps,
                  row_invariant=row_invariant)
    use = None if tree == "ar" else drafter
    if tree == "ar":
        kwargs.update(tree="ddtree", budget=0)
    t0 = time.perf_counter()
    # Compiles (or hits the cache); with budget "auto" it also finds or measures the cost model.
    first = generate(target, use, prompt_batches[0], seed=seed, profile=profile,
                     calibrate=calibrate and budget == "auto", **kwargs)
    compile_seconds = first.stats["compile_seconds"]
    results = [] if warmup else [first]
    for i, pb in enumerate(prompt_batches):
        if i == 0 and not warmup:
            continue
        results.append(generate(target, use, pb, seed=seed + i, **kwargs))
    stats = aggregate(results, [len(pb) for pb in prompt_batches])
    stats["compile_seconds"] = compile_seconds
    if "budget_policy" in first.stats:
        stats["budget_policy"] = aggregate_policy(results, [len(pb) for pb in prompt_batches], first)
    # Host reads of the loop's output per decode step (one a chunk), and on a GPU the compiled loop's while loops
    # outside command buffers (each adds a host round trip per step: its predicate).
    stats["chunk_steps"] = chunk_steps
    stats["host_syncs_per_step"] = (sum(r.stats["host_syncs"] for r in results)
                                    / max(sum(r.stats["steps"] for r in results), 1))
    stats["host_driven_loops"] = first.stats.get("host_driven_loops")
    if profile:
        prof = dict(first.stats["profile"])
        if warmup and stats.get("target_forwards"):  # the timed step, not the first call's (it builds the graph)
            prof["step_ms"] = 1e3 * stats["decode_seconds"] / stats["target_forwards"]
            prof["idle_ms"] = prof["step_ms"] - prof["busy_ms"]
        stats["step_profile"] = prof
    stats["wall_seconds"] = time.perf_counter() - t0
    return stats, [t for r in results for t in r.tokens]


# Refill mode (--refill N): continuous batching -------------------------------------------------------------------
# A static batch decodes until its slowest sequence is done, so speculative decoding's ragged finish (a sequence's
# steps vary with how much of its drafts the target accepts) leaves rows idle; a server gives a finished row the next
# prompt instead. Here N prompts stream through B rows of one loop state: between chunks of the chunked loop, each
# row whose sequence is done takes the next waiting prompt, prefilled alone and copied in (engine.ChunkedLoop.admit:
# one dispatch of one program, the server's admission path), so nothing compiles after the warm-up.
def refill_pass(loop: engine.ChunkedLoop, state, prompts: list, admit, max_new_tokens):
    """Stream `prompts` through the rows of `state` (every row free): -> (tokens per prompt, the final state, wall
    seconds from the first admission to the last token on the host, chunks, host seconds spent admitting).

    max_new_tokens: the tokens each prompt decodes (the first included), one count for all or a list of one per
    prompt; none above the loop's own max_new_tokens. admit(state, row, prompt, i, max_tokens) -> (state, first
    token [1]): prompts[i] in batch row `row`, to stop after max_tokens tokens. The host keeps one
    chunk in flight: it launches chunk c + 1 before it reads chunk c, and a row that chunk c shows done takes its
    next prompt in the state chunk c + 1 returns (the state is donated chunk to chunk), so the admission's prefill
    and copy queue behind chunk c + 1 and the device does not wait for the host. The price: a finished row idles
    through the rest of its chunk and the next one (the occupancy figure of the report says how much that costs).
    """
    batch = state.bonus.shape[0]
    counts = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    # Every row's output ends at the loop's max_new_tokens (a row's own count moves its start back: admission.py).
    limit = engine.output_limit(state)
    waiting = collections.deque(range(len(prompts)))
    owner = [None] * batch  # the prompt each row decodes (None: free)
    tokens = [[] for _ in prompts]
    done = [False] * len(prompts)
    firsts = []  # (prompt, its first token on the device) admitted since the last read
    admit_seconds = [0.0]
    max_chunks = len(prompts) * (-(-max(counts) // loop.steps) + 2) + 2  # a bug's bound, far beyond any run

    def fill(state, rows):
        t = time.perf_counter()
        for row in rows:
            if not waiting:
                break
            i = waiting.popleft()
            state, first = admit(state, row, prompts[i], i, counts[i])
            owner[row] = i
            firsts.append((i, first))
        admit_seconds[0] += time.perf_counter() - t
        return state

    t0 = time.perf_counter()
    current = loop(fill(state, range(batch)))
    current_owners = list(owner)
    chunks = finished = 0
    while True:
        following = loop(current.state)  # enqueued behind `current`
        following_owners = list(owner)  # a row admitted below joins after `following`: it has no tokens there
        got = jax.device_get((current.tokens, current.start, current.num_out, current.active, [f for _, f in firsts]))
        chunk_tokens, start, num_out, active, first_tokens = got
        chunks += 1
        for (i, _), first in zip(firsts, first_tokens):
            tokens[i].append(int(first[0]))
        firsts.clear()
        for row, i in enumerate(current_owners):
            if i is None or done[i]:
                continue
            end = min(int(num_out[row]), limit)  # a step may write past max_new_tokens: not output
            tokens[i] += chunk_tokens[row, :max(end - int(start[row]), 0)].tolist()
            if not active[row]:
                done[i], owner[row] = True, None
                finished += 1
        if finished == len(prompts):
            break
        free = [row for row in range(batch) if owner[row] is None]
        if free and waiting:
            following = following._replace(state=fill(following.state, free))
        current, current_owners = following, following_owners
        if chunks >= max_chunks:
            raise RuntimeError(f"the refill run did not finish within {max_chunks} chunks")
    wall = time.perf_counter() - t0
    return tokens, following.state, wall, chunks, admit_seconds[0]


def run_refill(target, drafter, prompts: list, *, batch: int, tree, budget, topk, temperature, top_k, top_p, seed,
               max_new_tokens, impl, tree_temperature: float = 1.0, chunk_steps: int = DEFAULT_CHUNK_STEPS,
               row_invariant: bool = False, calibrate: bool = False, max_len: int | None = None):
    """One decoder in refill mode: `prompts` (any number) through `batch` rows, chunks of `chunk_steps`
    steps; max_new_tokens: every prompt's output length, or a list of one per prompt (the loop's out buffer and the
    pool's room are the largest's); max_len: the pool's positions a row (a server's --max-len; default: what the
    longest prompt and output need). An untimed warm-up (the first batch + 1 prompts through the same rows, then one
    prompt of each prefill bucket they leave out) compiles the prefill, the admission and the chunk program; then
    the timed pass. -> (stats, tokens per prompt). Prompt i's first token is sampled with
    seed + i (T > 0); the steps share the loop's random stream (seed).
    budget "auto": the adaptive budget, its costs from the cost model that the static run of this decoder found or
    measured (same batch size and prompt length), else (or with calibrate) measured now with the first `batch`
    prompts in the rows, before the warm-up; stats["budget_policy"] is what the policy did in the timed pass."""
    use = None if tree == "ar" else drafter
    tree, budget = ("ddtree", 0) if tree == "ar" else (tree, budget)
    counts = max_new_tokens  # each row stops at its own count (admit); the loop's is the largest
    max_new_tokens = counts if isinstance(counts, int) else max(counts)
    req = validation.validate(target, use, prompts[:batch], max_new_tokens=max_new_tokens, budget=budget, topk=topk,
                              tree_temperature=tree_temperature, temperature=temperature, stop_ids=(), tree=tree,
                              top_k=top_k, top_p=top_p)
    # budget "auto": the menu generate() compiles in, and its largest budget sizes the trees (the pool's room).
    menu = validation.adaptive_menu(budget, None, use, tree, topk) if req.use_drafter else ()
    if isinstance(budget, str):
        budget = max(menu) if menu else 0
    # The SpecConfig and the pool generate() builds for a batch of these prompts: the chunk program is then the one
    # the static run of the same decoder compiled, when it ran last (engine.chunked_loop).
    spec = engine.SpecConfig(tree=tree if isinstance(tree, str) else tuple(tree),
                             budget=budget if req.use_drafter else 0, topk=topk,
                             tree_temperature=float(tree_temperature), sampled=float(temperature) > 0,
                             max_new_tokens=max_new_tokens, impl=impl,
                             row_invariant=bool(row_invariant), menu=menu)
    use = use if req.use_drafter else None
    depth = req.depth if req.use_drafter else 0
    longest = max(len(p) for p in prompts)
    chunk = min(admission.PREFILL_CHUNK, validation.round_up(longest, 16))
    needed = validation.round_up(validation.round_up(longest, chunk) + max_new_tokens + req.num_nodes + depth + 1, 64)
    if max_len is not None and max_len < needed:
        raise ValueError(f"max_len {max_len} holds no {longest}-token prompt, {max_new_tokens} new tokens and a "
                         f"{req.num_nodes}-node tree (it needs {needed})")
    max_len = max_len or needed
    moe = [layer.mlp for layer in target.layers if layer.is_moe]

    costs = {}  # budget "auto": the policy's costs (set below, after the compile)

    def empty_state():
        cache = kv_pool.init_cache(target.cfg, batch, max_len, dtype=target.dtype)
        dcache = use.init_cache(batch, max_len) if use is not None else None
        adaptive = engine.adaptive_parts(target, use, spec, batch, chunk_steps=chunk_steps) if spec.menu else None
        state = engine.initial_state(cache, dcache, np.zeros((batch,), np.int32), max_new_tokens=max_new_tokens,
                                     width=depth + 1, stop_ids=req.stop, key=jax.random.key(seed),
                                     expert_load=engine.ExpertLoad.zeros(len(moe), moe[0].num_slots if moe else 0, 1),
                                     active=np.zeros((batch,), bool), adaptive=adaptive)
        return engine.with_costs(state, spec, costs) if costs else state

    loop = engine.chunked_loop(target, use, spec, min(chunk_steps, max_new_tokens))
    settings = SamplingParams(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k))

    def admit(state, row, prompt, i, max_tokens):
        return loop.admit(state, prompt, row, max_tokens=max_tokens, seed=seed + i, sampling=settings)

    t0 = time.perf_counter()
    loop.compile(empty_state())  # a hit when the static run of this decoder just compiled it (generate's loop)
    calibration = None
    if spec.menu:
        calibration = refill_costs(loop, empty_state(), spec, prompts[:batch], admit, target=target, drafter=use,
                                   calibrate=calibrate)
        costs.update(calibration.pop("costs"))
    # The warm-up admits into a fresh state, into the state an admission returns and into the one a chunk returns
    # (jax keys its programs on where the arguments live, and these differ), then one prompt of each prefill bucket
    # those left out (admission compiles a program per bucket): every program the timed pass runs.
    warm = list(range(min(batch + 1, len(prompts))))
    buckets = {admission.prompt_bucket(len(prompts[i]), max_len) for i in warm}
    for i, prompt in enumerate(prompts):
        if admission.prompt_bucket(len(prompt), max_len) not in buckets:
            buckets.add(admission.prompt_bucket(len(prompt), max_len))
            warm.append(i)
    refill_pass(loop, empty_state(), [prompts[i] for i in warm], admit,
                counts if isinstance(counts, int) else [counts[i] for i in warm])
    warmup_seconds = time.perf_counter() - t0
    compiles = compile_count()
    tokens, final, wall, chunks, admit_seconds = refill_pass(loop, empty_state(), prompts, admit, counts)
    compiles = compile_count() - compiles
    kv_pool.check_overflow(final.cache)
    hist = np.asarray(final.accepted_hist).astype(np.int64)
    seq_steps, steps = int(hist.sum()), int(final.step)
    new_tokens = sum(len(t) for t in tokens)
    stats = {
        "mode": "refill",
        "prompts": len(prompts),
        "tau": float((hist * (np.arange(hist.size) + 1)).sum() / seq_steps) if seq_steps else float("nan"),
        "acceptance_by_depth": [float(hist[d:].sum() / seq_steps) if seq_steps else float("nan")
                                for d in range(1, hist.size)],
        # Every generated token, the first included: its prefill is inside the wall time here.
        "new_tokens": new_tokens,
        "timed_seconds": wall,
        "tokens_per_second": new_tokens / wall,
        "target_forwards": steps,  # the batch's steps
        "sequence_steps": seq_steps,  # steps summed over the prompts
        "occupancy": seq_steps / (steps * batch) if steps else float("nan"),  # rows decoding per batch step
        "chunks": chunks,
        "chunk_steps": loop.steps,
        "admission_host_seconds": admit_seconds,
        "warmup_seconds": warmup_seconds,
        "compiles_after_warmup": compiles,
        "num_nodes": req.num_nodes,
    }
    if spec.menu:
        stats["budget_policy"] = {**budget_policy.summary(final.policy, spec.menu), **calibration}
    return stats, tokens


def refill_costs(loop: engine.ChunkedLoop, state, spec, prompts: list, admit, *, target, drafter,
                 calibrate: bool = False) -> dict:
    """The adaptive refill loop's costs, as engine.generate finds them: the cached cost model's point for this batch
    size and the prompts' mean length, else (or with calibrate) engine.calibrate with `prompts` (one a row) admitted
    into `state`. -> {"costs": CostModel.costs(...), "calibrated", "calibration_seconds", "cost_model"}."""
    batch = state.bonus.shape[0]
    model = cost_models.CostModel.load(cost_models.fingerprint(target, drafter, spec))
    context = float(np.mean([len(p) for p in prompts]))
    t0 = time.perf_counter()
    point = None if calibrate else model.lookup(batch, context)
    if point is None:
        for row, prompt in enumerate(prompts):
            state, _ = admit(state, row, prompt, row, None)
        model.add(engine.calibrate(loop, state, spec, depth=drafter.cfg.depth))
        model.save()
    return {"costs": model.costs(batch, context), "calibrated": point is None,
            "calibration_seconds": time.perf_counter() - t0, "cost_model": str(model.path)}

def parse_budgets(value) -> list:
    """--budgets: comma-separated integers and 'auto' (the adaptive budget), in the order given."""
    budgets = []
    for b in str(value).split(","):
        b = b.strip().lower()
        if not b:
            continue
        if b == "auto":
            budgets.append("auto")
            continue
        try:
            budgets.append(int(b))
        except ValueError:
            raise ValueError(f"--budgets must be integers or 'auto' separated by commas; got {value!r}") from None
    if not budgets:
        raise ValueError(f"--budgets names no budget; got {value!r}")
    return budgets


def policy_note(row: dict) -> str:
    """The log line's adaptive-budget tail ("" for a fixed budget)."""
    p = row.get("budget_policy")
    if not p:
        return ""
    used = ", ".join(f"{b}: {n}" for b, n in p["budget_steps"].items() if n)
    return (f"  steps per budget {{{used or '-'}}}, {p['steps_without_drafter']} without the drafter, tau predicted "
            f"{_fmt(p['predicted_tau'], '.2f')} observed {_fmt(p['observed_tau'], '.2f')}"
            + (f" (cost model measured: {p['calibration_seconds']:.1f} s)" if p.get("calibrated") else ""))


def parse_batch_sizes(value) -> list[int]:
    """--batch: one size or several comma-separated, each >= 1."""
    try:
        sizes = [int(b) for b in str(value).split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batch must be positive integers separated by commas; got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch must be positive integers separated by commas; got {value!r}")
    return sizes


def first_difference(a, b):
    """Index of the first generated token where two outputs differ (None: identical). An output that is a
    proper prefix of the other (one stopped earlier) differs at the shorter one's length."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def identity_report(reference: list, outputs: list) -> dict:
    """Greedy outputs against the autoregressive ones, prompt by prompt."""
    firsts = [first_difference(list(a), list(b)) for a, b in zip(reference, outputs)]
    differing = sum(f is not None for f in firsts)
    return {"identical_to_ar": len(firsts) - differing, "mismatches_vs_ar": differing, "first_difference": firsts}


def identity_note(row: dict, tree: str, count: int) -> str:
    """The log line's greedy-identity tail of a speculative row ("" for autoregressive or sampled rows)."""
    if row.get("identical_to_ar") is None or tree == "ar":
        return ""
    return (f"  identical {row['identical_to_ar']}/{count}"
            f" (first differences at {summarize_differences(row['first_difference'])})")


def summarize_differences(firsts: list, shown: int = 8) -> str:
    """'–' when every output is identical, else the sorted first-difference indices ('2, 17, 40')."""
    at = sorted(f for f in firsts if f is not None)
    if not at:
        return "–"
    text = ", ".join(str(f) for f in at[:shown])
    return text + (f", … ({len(at)} outputs)" if len(at) > shown else "")


# This benchmark --------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT, help="pair to measure (default: checkpoints/default)")
    add_dtype_argument(p)
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    p.add_argument("--batch", default="1",
                   help="prompts decoded together (1: latency); several sizes comma-separated (e.g. 1,16), each a sweep")
    p.add_argument("--budgets", default="8,16,32,64,128,256",
                   help="DDTree budgets (tree nodes besides the root), comma-separated; 'auto' among them: the "
                        "adaptive budget (engine.generate(budget='auto'): each step picks from {0, 4, 8, 16, 32, 64} "
                        "by the drafter's probabilities and this device's measured cost model; its rows add the steps "
                        "per budget, the steps without the drafter and the predicted vs observed tau)")
    p.add_argument("--calibrate", action="store_true",
                   help="with 'auto' in --budgets: measure the adaptive budget's cost model again (once per batch "
                        "size, chunk size and temperature, untimed) instead of using the cached one")
    p.add_argument("--topk", type=int, default=4, help="drafter candidates per depth for DDTree")
    add_tree_temperature_argument(p)
    p.add_argument("--temperatures", default="0,0.7", help="0 = greedy; > 0 = exact sampling of the target")
    p.add_argument("--top-k", type=int, default=0, help="target sampling filter at T > 0 (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="target sampling filter at T > 0")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i of a batch run uses seed + i)")
    p.add_argument("--impl", default="auto", help="verify-attention implementation")
    p.add_argument("--no-chain", action="store_true", help="skip the chain (DFlash) decoder")
    p.add_argument("--row-invariant", action="store_true",
                   help="row-invariant decoding (every decoder): each verify row computed bit for bit as the one-token "
                        "step computes it (rows padded to 64-multiples, T-independent attention splits, the XLA flags "
                        "of kdtree_jax.runtime.configure(row_invariant=True)); slower, for checking greedy equality")
    p.add_argument("--chunk-steps", default=None,
                   help="decode steps per host iteration (the loop hands its tokens to the host after each chunk); "
                        "0: the whole decode in one call; several comma-separated (e.g. 0,1,8,16), each a sweep "
                        "(default: engine.default_chunk_steps(), what generate takes: 8; with --refill, half of it, "
                        "what the server takes)")
    p.add_argument("--refill", type=int, default=0, metavar="N",
                   help="also measure continuous batching: N held-out prompts (N larger than every --batch size; "
                        "the first --prompts of them are the static run's) stream through each batch size's rows, "
                        "and a row whose sequence is done takes the next waiting prompt between chunks (prefilled "
                        "alone and copied in, as the server admits requests; nothing compiles after an untimed "
                        "warm-up). Every decoder, batch size, --chunk-steps value (>= 1) and temperature gets a "
                        "refill row: tok/s = all generated tokens / wall seconds from the first admission to the "
                        "last token on the host (prefills included), batch steps, tau, row occupancy, speed-up vs "
                        "autoregressive refill and, greedy, outputs identical to the autoregressive refill run's. "
                        "0 (default): off; --smoke: 2 x the largest batch + 1 unless given")
    p.add_argument("--no-command-buffers", action="store_true",
                   help="leave XLA's command buffers as XLA_FLAGS set them (default: kdtree_jax.runtime.configure(), "
                        "which lets a CUDA graph capture the decode loop on a GPU)")
    p.add_argument("--profile", action="store_true",
                   help="profile one step of each decoder's loop (a one-step call after the timed decode, the graph "
                        "replayed as in the timed calls): a step's kernel time by part (drafter, tree, the verify "
                        "pass's attention / MoE / dense, head) and the device's idle time, in the JSON and a table")
    p.add_argument("--cache-dir", default="~/.cache/kdtree_jax/jax_compilation_cache",
                   help="persistent XLA compilation cache ('' to disable)")
    p.add_argument("--out", default=None,
                   help="output directory (default: benchmarks/results; --smoke: a temp dir, removed at exit)")
    p.add_argument("--smoke", action="store_true",
                   help="random tiny pair on CPU, 2 prompts x 8 tokens, budgets 4,8 (runs in well under a minute)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    given = {a.split("=")[0] for a in argv}
    if args.smoke:
        for flag, value in (("--prompts", 2), ("--prompt-len", 24), ("--max-new-tokens", 8), ("--budgets", "4,8")):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    out_dir = args.out or (tempfile.mkdtemp(prefix="spec_decode_smoke_") if args.smoke else DEFAULT_OUT)
    if args.smoke and not args.out:  # a smoke run's files are for a look only: removed at exit (--out keeps them)
        import atexit
        import shutil

        atexit.register(shutil.rmtree, out_dir, True)
    enable_compilation_cache(args.cache_dir)

    batch_sizes = parse_batch_sizes(args.batch)
    if args.chunk_steps is None:
        args.chunk_steps = str(engine.default_chunk_steps(continuous=bool(args.refill)))
    try:
        chunk_list = [int(k) for k in str(args.chunk_steps).split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"--chunk-steps must be integers >= 0 separated by commas; got {args.chunk_steps!r}") from None
    if not chunk_list or min(chunk_list) < 0:
        raise ValueError(f"--chunk-steps must be integers >= 0 separated by commas; got {args.chunk_steps!r}")
    if args.prompts < 1:
        raise ValueError(f"--prompts must be >= 1; got {args.prompts}")
    if args.smoke and "--refill" not in given:
        args.refill = 2 * max(batch_sizes) + 1
    if args.refill < 0 or 0 < args.refill <= max(batch_sizes):
        parser.error(f"--refill must be larger than every --batch size (the largest is {max(batch_sizes)}: the rows "
                     f"need prompts waiting to take), or 0 (off); got {args.refill}")
    if args.refill and min(chunk_list) < 1:
        parser.error(f"--refill needs every --chunk-steps value >= 1 (rows take new prompts between chunks); got "
                     f"{args.chunk_steps}")

    t_all = time.perf_counter()
    target, drafter, tokenizer, pair = load_pair(args)
    resolve_tree_temperature(args)
    depth = drafter.cfg.depth
    budgets = parse_budgets(args.budgets)
    temperatures = [float(t) for t in str(args.temperatures).split(",") if t.strip()]
    limit = trees.max_ddtree_budget(depth, args.topk)
    bad = [b for b in budgets if b != "auto" and not 1 <= b <= limit]
    if bad:
        raise ValueError(f"--budgets must be 'auto' or in [1, {limit}] for block_size {drafter.cfg.block_size} and "
                         f"--topk {args.topk}; got {bad}")
    prompts, where = heldout_prompts(tokenizer, args.prompts, args.prompt_len)
    refill_prompts, refill_where = (heldout_prompts(tokenizer, args.refill, args.prompt_len) if args.refill
                                    else ([], []))

    decoders = [("autoregressive", "ar", 0)]
    if not args.no_chain:
        decoders.append(("chain", "chain", 0))
    decoders += [(f"DDTree {b}", "ddtree", b) for b in budgets]
    meta = base_meta(args, target, drafter, pair)
    meta.update({"prompts": len(prompts), "prompt_len": args.prompt_len, "prompt_cuts": where,
                 "max_new_tokens": args.max_new_tokens,
                 "batch": batch_sizes[0] if len(batch_sizes) == 1 else batch_sizes, "batch_sizes": batch_sizes,
                 "topk": args.topk,
                 "tree_temperature": args.tree_temperature,
                 "budgets": budgets, "temperatures": temperatures, "top_k": args.top_k, "top_p": args.top_p,
                 "seed": args.seed, "impl": args.impl, "depth": depth, "chunk_steps": chunk_list,
                 "refill": args.refill, "refill_prompt_cuts": refill_where,
                 "row_invariant": args.row_invariant, "row_invariant_flags": runtime.row_invariant_configured(),
                 "command_buffers": runtime.command_buffers_configured(), "xla_flags": os.environ.get("XLA_FLAGS", "")})
    log(f"{meta['device']} ({meta['backend']}): {pair}, {len(prompts)} prompts x {args.max_new_tokens} new tokens, "
        f"batch {','.join(map(str, batch_sizes))}, block size {drafter.cfg.block_size}"
        + (f"; refill: {args.refill} prompts" if args.refill else ""))

    rows = []
    first_ar = {}  # temperature -> autoregressive outputs at the first batch size
    for batch, chunk in [(b, k) for b in batch_sizes for k in chunk_list]:
        prompt_batches = batches([p.tolist() for p in prompts], batch)
        for temperature in temperatures:
            ar_tokens, ar_tps = None, None
            refill_ar_tokens, refill_ar_tps = None, None
            for name, tree, budget in decoders:
                stats, tokens = run_config(target, drafter, prompt_batches, tree=tree, budget=budget, topk=args.topk,
                                           temperature=temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                           max_new_tokens=args.max_new_tokens, impl=args.impl,
                                           tree_temperature=args.tree_temperature, profile=args.profile,
                                           chunk_steps=chunk, row_invariant=args.row_invariant,
                                           calibrate=args.calibrate)
                if tree == "ar":
                    ar_tokens, ar_tps = tokens, stats["tokens_per_second"]
                    first_ar.setdefault(temperature, tokens)
                row = {"mode": "static", "decoder": name, "tree": tree,
                       "budget": budget if tree == "ddtree" else stats["num_nodes"] - 1,
                       "batch": batch, "temperature": temperature, **stats,
                       "speedup_vs_ar": stats["tokens_per_second"] / ar_tps if ar_tps else float("nan")}
                if temperature == 0 and ar_tokens is not None:
                    row.update(identity_report(ar_tokens, tokens))
                    if tree == "ar" and batch != batch_sizes[0]:
                        ref = identity_report(first_ar[temperature], tokens)
                        row["ar_batch_reference"] = batch_sizes[0]
                        row["identical_to_first_batch_ar"] = ref["identical_to_ar"]
                        row["first_difference_vs_first_batch_ar"] = ref["first_difference"]
                else:
                    row["mismatches_vs_ar"] = None
                rows.append(row)
                same = identity_note(row, tree, len(tokens))
                log(f"B={batch} k={chunk} T={temperature:g} {name:16s} nodes {stats['num_nodes']:4d}  "
                    f"tau {stats['tau']:.3f}  {stats['tokens_per_second']:8.1f} tok/s  x{row['speedup_vs_ar']:.2f}  "
                    f"host syncs/step {stats['host_syncs_per_step']:.3f}"
                    f"{'' if stats['host_driven_loops'] is None else ' host-driven loops %d' % stats['host_driven_loops']}  "
                    f"(compile {stats['compile_seconds']:.1f} s, {stats['wall_seconds']:.1f} s){same}"
                    f"{policy_note(row)}")
                if not args.refill:
                    continue
                # The same decoder in refill mode, right after its static run: its chunk program is compiled.
                stats, tokens = run_refill(target, drafter, [p.tolist() for p in refill_prompts], batch=batch,
                                           tree=tree, budget=budget, topk=args.topk, temperature=temperature,
                                           top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                                           max_new_tokens=args.max_new_tokens, impl=args.impl,
                                           tree_temperature=args.tree_temperature, chunk_steps=chunk,
                                           row_invariant=args.row_invariant)
                if tree == "ar":
                    refill_ar_tokens, refill_ar_tps = tokens, stats["tokens_per_second"]
                speedup = stats["tokens_per_second"] / refill_ar_tps if refill_ar_tps else float("nan")
                refill_row = {**stats, "decoder": name, "tree": tree, "budget": row["budget"], "batch": batch,
                              "temperature": temperature, "speedup_vs_ar": speedup,
                              "static_speedup_vs_ar": row["speedup_vs_ar"]}
                if temperature == 0 and refill_ar_tokens is not None:
                    refill_row.update(identity_report(refill_ar_tokens, tokens))
                else:
                    refill_row["mismatches_vs_ar"] = None
                rows.append(refill_row)
                same = identity_note(refill_row, tree, len(tokens))
                log(f"B={batch} k={chunk} T={temperature:g} {name:16s} refill {args.refill} prompts: "
                    f"tau {stats['tau']:.3f}  {stats['tokens_per_second']:8.1f} tok/s  x{speedup:.2f}  "
                    f"{stats['target_forwards']} steps, occupancy {stats['occupancy']:.3f}  (warm-up "
                    f"{stats['warmup_seconds']:.1f} s, timed {stats['timed_seconds']:.2f} s, compiles after it "
                    f"{stats['compiles_after_warmup']}){same}{policy_note(refill_row)}")
    meta["seconds"] = time.perf_counter() - t_all

    name = f"spec_decode_{'smoke_' if args.smoke else ''}{device_slug()}"
    os.makedirs(out_dir, exist_ok=True)
    result = {"meta": meta, "rows": rows}
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(_clean(result), f, indent=1, allow_nan=False)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(render(result))
    log(f"wrote {os.path.join(out_dir, name)}.{{json,md}} ({meta['seconds']:.0f} s)"
        + (" (--smoke without --out: removed at exit; the report follows)" if args.smoke and not args.out else ""))
    if args.smoke and not args.out:
        print(render(result))
    return 0


def _clean(obj):
    """NaN -> None so the JSON is strict."""
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def _fmt(x, spec=".2f"):
    return "–" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


def step_cells(r: dict, m: dict) -> list:
    """[step ms, "batch steps / mean sequence steps"] of a row: the time of one step of a batch, and how many steps a
    batch ran (its slowest sequence decides; averaged over batches) against the mean over its sequences."""
    forwards, seq_steps, seconds = r.get("target_forwards"), r.get("sequence_steps"), r.get("decode_seconds")
    if not forwards or not seq_steps or seconds is None:
        return ["–", "–"]
    n_batches = -(-m["prompts"] // r["batch"])
    return [f"{1e3 * seconds / forwards:.3f}", f"{forwards / n_batches:.1f} / {seq_steps / m['prompts']:.1f}"]


def render(result: dict) -> str:
    m = result["meta"]
    rows = [r for r in result["rows"] if r.get("mode", "static") == "static"]
    refill_rows = [r for r in result["rows"] if r.get("mode") == "refill"]
    shown = min(m["depth"], 8)
    lines = [f"# Speculative decoding: autoregressive vs chain vs DDTree ({m['device']})", "",
             f"{m['date']}, commit {m['commit']}, jax {m['jax']} ({m['backend']}, {m['cpu_count']} CPU cores visible). "
             f"Pair: {m['pair']} (target {m['target_dtype']}, {m['target']['num_hidden_layers']} layers, "
             f"hidden {m['target']['hidden_size']}; drafter block size {m['block_size']}, "
             f"{m['drafter']['num_layers']} layers).", "",
             f"{m['prompts']} held-out prompts of {m['prompt_len']} tokens, {m['max_new_tokens']} new tokens each, "
             f"batch {', '.join(map(str, m.get('batch_sizes', [m['batch']])))}; DDTree top-K {m['topk']}, tree temperature {m.get('tree_temperature', 1.0)}; sampling filters top-k {m['top_k']}, top-p {m['top_p']}. "
             f"tok/s: decode only (compile excluded, one warm-up call discarded), summed over batches. "
             f"tau: tokens per target forward (bonus included). acc@d: P(>= d drafted tokens accepted in a step). "
             f"step ms: decode seconds / target forwards (a batch's step). batch / seq steps: a batch's steps (its slowest "
             f"sequence decides) against a sequence's mean steps; their ratio is what a static batch loses to its stragglers. "
             f"Greedy: identical = outputs equal to the autoregressive ones of the same batch size, token for token; "
             f"first differences = for each output that is not, the index of its first differing generated token "
             f"(0 = the prefill's token).",
             "", f"Command: `{m['command']}` ({m['seconds'] / 60:.1f} min).", ""]
    if m["backend"] == "cpu":
        lines += ["On a CPU a verify pass costs nearly in proportion to its tree nodes (compute-bound: there is no "
                  "memory-bound regime where T nodes cost little more than one), so speed-ups below 1× are the "
                  "expected outcome at large budgets here; τ and the acceptance rates carry over to an accelerator, "
                  "tok/s does not.", ""]
    batch_sizes = m.get("batch_sizes", [m["batch"]])
    greedy_rows = [r for r in rows if r["temperature"] == 0 and r["tree"] != "ar" and r.get("identical_to_ar") is not None]
    if greedy_rows:  # the identity summary: every decoder at every batch size
        lines += ["## Greedy outputs identical to autoregressive", "",
                  "Per decoder and batch size: outputs identical to the autoregressive ones of that batch size, and "
                  "the sorted indices of the first differing generated token of the others.", "",
                  "| decoder | " + " | ".join(f"batch {b}: identical | batch {b}: first differences" for b in batch_sizes) + " |",
                  "|---|" + "---|---|" * len(batch_sizes)]
        for name in dict.fromkeys(r["decoder"] for r in greedy_rows):
            cells = [name]
            for b in batch_sizes:
                r = next((r for r in greedy_rows if r["decoder"] == name and r.get("batch", b) == b), None)
                cells += (["–", "–"] if r is None else
                          [f"{r['identical_to_ar']}/{m['prompts']}", summarize_differences(r["first_difference"])])
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    chunk_list = m.get("chunk_steps", [None])
    for batch, chunk, temperature in [(b, k, t) for b in batch_sizes for k in chunk_list for t in m["temperatures"]]:
        sub = [r for r in rows if r["temperature"] == temperature and r.get("batch", batch) == batch
               and r.get("chunk_steps", chunk) == chunk]
        label = "greedy" if temperature == 0 else f"T = {temperature:g}"
        if len(batch_sizes) > 1:
            label += f", batch {batch}"
        if chunk is not None:
            syncs = max((r.get("host_syncs_per_step", 0) for r in sub), default=0)
            loops = {r.get("host_driven_loops") for r in sub} - {None}
            label += (f", {'the whole decode in one call' if chunk == 0 else f'{chunk} steps a chunk'} (host reads "
                      f"<= {syncs:.3f} a step; command buffers "
                      f"{('on' if m.get('command_buffers') else 'off') if m['backend'] == 'gpu' else 'n/a (CPU)'}"
                      + (f", while loops run from the host: {', '.join(map(str, sorted(loops)))}" if loops else "")
                      + ")")
        greedy = temperature == 0
        lines += [f"## {label}", "",
                  "| decoder | nodes | tau | tok/s | speed-up vs AR | step ms | batch / seq steps | " +
                  " | ".join(f"acc@{d}" for d in range(1, shown + 1)) +
                  (" | identical to AR | first differences |" if greedy else " |"),
                  "|---|---|---|---|---|---|---|" + "---|" * shown + ("---|---|" if greedy else "")]
        for r in sub:
            acc = r["acceptance_by_depth"] + [None] * shown
            cells = [r["decoder"], str(r["num_nodes"]), _fmt(r["tau"], ".3f"), _fmt(r["tokens_per_second"], ".1f"),
                     _fmt(r["speedup_vs_ar"], ".2f") + "×", *step_cells(r, m)] + [_fmt(a, ".3f") for a in acc[:shown]]
            if greedy:
                if r.get("identical_to_ar") is None:
                    cells += ["–", "–"]
                elif r["tree"] == "ar":  # itself; against the first batch size's when there are several
                    if "identical_to_first_batch_ar" in r:
                        cells += [f"{r['identical_to_first_batch_ar']}/{m['prompts']} vs batch {r['ar_batch_reference']}",
                                  summarize_differences(r["first_difference_vs_first_batch_ar"])]
                    else:
                        cells += ["(reference)", "–"]
                else:
                    cells += [f"{r['identical_to_ar']}/{m['prompts']}", summarize_differences(r["first_difference"])]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += policy_lines(sub)
        profiled = [r for r in sub if r.get("step_profile")]
        if profiled:
            parts = ("drafter", "tree_accept_commit", "attention", "moe", "dense", "head", "other")
            lines += [f"Where a step goes ({label}; ms of kernels per step by part, from a profiled one-step call after the timed decode, the "
                      "chunk's set-up outside its loop counted once a chunk; "
                      + ("on a CPU thunks overlap and the profiler slows them, so the parts need not add up to the step"
                         if m["backend"] == "cpu" else "idle: the timed step less the union of its kernels; in the body: "
                         "of that, the GPU's idle time between the first and the last kernel of the loop body's profiled "
                         "step, the graph's own gaps (the rest is the loop's relaunch of its body each step, the chunk's "
                         "launch and the host's reads, spread over its steps)")
                      + "):", "",
                      "| decoder | step ms | drafter | tree+accept+commit | attention | MoE | dense | head | other | idle "
                      "| in the body | kernels / step |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in profiled:
                prof = r["step_profile"]
                in_step = prof.get("loop_idle_ms")
                lines.append(f"| {r['decoder']} | {prof['step_ms']:.3f} | "
                             + " | ".join(f"{prof['components_ms'][k]:.3f}" for k in parts)
                             + (" | – | – |" if m["backend"] == "cpu" else f" | {prof['idle_ms']:.3f} | "
                                + ("–" if in_step is None else f"{in_step:.3f}") + " |")
                             + f" {prof['kernels_per_step']:.0f} |")
            lines.append("")
            gapped = [r for r in profiled if r["step_profile"].get("idle_gaps") and m["backend"] != "cpu"]
            if gapped:
                lines += ["Largest idle gaps in the profiled call, by the kernels around them (ms per step, gaps "
                          "per step; the profiled call is one step, so a gap once a call counts whole, e.g. the launch of the "
                          "chunk's graph):", ""]
                for r in gapped:
                    lines.append(f"- {r['decoder']}: " + "; ".join(
                        f"`{name}` {ms:.3f} ({n:g})" for name, ms, n in r["step_profile"]["idle_gaps"][:5]))
                lines.append("")
    if refill_rows:
        lines += render_refill(m, refill_rows, chunk_list)
    return "\n".join(lines)


def render_refill(m: dict, rows: list, chunk_list: list) -> list:
    """The refill sections: one table per batch size, chunk size and temperature."""
    n = m["refill"]
    lines = ["## Refill (continuous batching)", "",
             f"{n} held-out prompts (the first {m['prompts']} are the ones above) stream through the batch's rows: "
             f"a row whose sequence is done takes the next waiting prompt between chunks (prefilled alone and copied "
             f"into the row in one dispatch: `engine.ChunkedLoop.admit`, the server's admission), with one chunk in "
             f"flight, so a row that finishes idles through the rest of its chunk and the next one. tok/s: every "
             f"generated token "
             f"(the first included) / wall seconds from the first admission to the last token on the host, prefills "
             f"included, after an untimed warm-up that compiled everything (compiles: XLA compiles during the timed "
             f"run). batch steps: target forwards of the batch; occupancy: rows decoding per batch step / batch size "
             f"(what the idle rows cost). speed-up vs AR: against the autoregressive refill run of the same table; "
             f"static: the static batch's speed-up above, for comparison. Greedy: identical = outputs equal to the "
             f"autoregressive refill run's, prompt by prompt.", ""]
    for batch, chunk, temperature in [(b, k, t) for b in m.get("batch_sizes", [m["batch"]]) for k in chunk_list
                                      for t in m["temperatures"]]:
        sub = [r for r in rows if r["batch"] == batch and r["chunk_steps"] == min(chunk, m["max_new_tokens"])
               and r["temperature"] == temperature]
        if not sub:
            continue
        greedy = temperature == 0
        label = "greedy" if greedy else f"T = {temperature:g}"
        lines += [f"### Refill, {label}, batch {batch}, {chunk} steps a chunk", "",
                  "| decoder | nodes | tau | tok/s | speed-up vs AR | static speed-up vs AR | batch steps | occupancy "
                  "| chunks | admission host ms | compiles |"
                  + (" identical to AR | first differences |" if greedy else ""),
                  "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if greedy else "")]
        for r in sub:
            cells = [r["decoder"], str(r["num_nodes"]), _fmt(r["tau"], ".3f"), _fmt(r["tokens_per_second"], ".1f"),
                     _fmt(r["speedup_vs_ar"], ".2f") + "×", _fmt(r.get("static_speedup_vs_ar"), ".2f") + "×",
                     str(r["target_forwards"]), _fmt(r["occupancy"], ".3f"), str(r["chunks"]),
                     _fmt(1e3 * r["admission_host_seconds"], ".1f"), str(r["compiles_after_warmup"])]
            if greedy:
                cells += (["(reference)", "–"] if r["tree"] == "ar" else
                          ["–", "–"] if r.get("identical_to_ar") is None else
                          [f"{r['identical_to_ar']}/{n}", summarize_differences(r["first_difference"])])
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += policy_lines(sub)
    return lines


def policy_lines(rows: list) -> list:
    """What the adaptive budget's rows did, one line each (nothing for fixed budgets): batch steps per budget, batch
    steps without the drafter, and the tokens per sequence step of the
    drafted steps that the policy predicted for the budgets it chose against those it got; the cost model's costs."""
    adaptive = [r for r in rows if r.get("budget_policy")]
    if not adaptive:
        return []
    lines = ["Adaptive budget (`auto`): batch steps per budget, batch steps without the drafter, "
             "and tokens per sequence step of the drafted steps, predicted for the chosen "
             "budgets vs observed; the cost model's step costs (ms):", ""]
    for r in adaptive:
        p = r["budget_policy"]
        used = ", ".join(f"{b}: {n}" for b, n in p["budget_steps"].items())
        costs = p.get("costs_ms") or {}
        verify = ", ".join(f"{b}: {v:.3g}" for b, v in zip(p["menu"], costs.get("verify", []))
                           if v is not None and v < 1e29)  # pruned entries cost 1e30
        lines.append(f"- {r['decoder']}: {{{used}}}, {p['steps_without_drafter']} without the drafter; tau predicted "
                     f"{_fmt(p['predicted_tau'], '.3f')}, observed {_fmt(p['observed_tau'], '.3f')}"
                     + (f"; costs: AR step {costs['ar']:.3g}, drafter {costs['draft']:.3g}, verify {{{verify}}}"
                        if costs else "")
                     + (f" (measured in this run, {p['calibration_seconds']:.1f} s)" if p.get("calibrated") else ""))
    lines.append("")
    return lines


if __name__ == "__main__":
    sys.exit(main())
