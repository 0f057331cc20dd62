"""DDTree speculative decoding: the whole decode in one jitted `lax.while_loop`.

One step, all on device (DESIGN.md, "Data flow of one speculative step"):

    drafter(block [bonus, MASK...], cached target features) -> per-depth top-K log-probs
    -> draft tree (DDTree best-first / chain / static shape) -> T slots allocated and placed
    -> target verify forward over the T nodes (tree mask, rope at start + depth)
    -> acceptance walk (greedy or sampled) -> commit the accepted path's slots, free the rest
    -> the accepted nodes' hidden states extend the drafter's context -> emit tokens.

Invariant between steps: the target cache holds every committed token except the last one (the
"bonus"), which sits at position `seq_lens` and becomes the next tree's root. The drafter's context
holds the target features of the same positions.

budget 0 is plain autoregressive decoding through the same loop (a root-only tree, no drafter pass).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import kv_pool, profiling
from kdtree_jax.decode import prefill, validate_tokens
from kdtree_jax.ops.argmax import argmax_last
from kdtree_jax.kv_pool import KVCache
from kdtree_jax.model.drafter import Drafter, DrafterCache
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.sharding import replicate
from kdtree_jax.speculative import accept as acceptance
from kdtree_jax.speculative import tree as trees

TreeShape = Union[str, tuple]  # "ddtree", "chain", or a static branching tuple such as (4, 2, 1)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static settings of one compiled decode loop."""

    tree: TreeShape = "ddtree"
    budget: int = 16  # DDTree nodes besides the root; 0: autoregressive
    topk: int = 4  # drafter candidates per depth
    # DDTree ranks prefixes by the drafter's probabilities divided by this temperature (< 1 sharpens).
    # A drafter distilled on soft labels learns the target's spread, but greedy verification accepts a
    # token whenever it is the target's argmax, which happens far more often than its probability says;
    # sharpening makes the tree trust the drafter's top choice deeper. 1.0: the probabilities as they are.
    tree_temperature: float = 1.0
    temperature: float = 0.0
    top_k: int = 0  # target sampling filters (temperature > 0)
    top_p: float = 1.0
    max_new_tokens: int = 64
    impl: str = "auto"  # verify-attention implementation
    expert_devices: int = 1  # expert-load statistics group the expert slots into this many devices


class ExpertLoad(NamedTuple):
    """Router statistics summed over the verify passes of active steps (per MoE layer)."""

    slot_tokens: jnp.ndarray  # [n_moe, slots] tokens routed to each physical expert slot
    device_tokens: jnp.ndarray  # [n_moe, devices] the same, per device (slots split contiguously)
    device_active: jnp.ndarray  # [n_moe, devices] experts with >= 1 token, per device
    imbalance: jnp.ndarray  # [n_moe] sum over steps of max/mean device tokens

    @staticmethod
    def zeros(num_moe: int, slots: int, devices: int) -> "ExpertLoad":
        return ExpertLoad(jnp.zeros((num_moe, slots), jnp.int32), jnp.zeros((num_moe, devices), jnp.int32),
                          jnp.zeros((num_moe, devices), jnp.int32), jnp.zeros((num_moe,), jnp.float32))

    def add(self, counts) -> "ExpertLoad":
        num_moe, devices = self.device_tokens.shape
        if num_moe == 0:  # a target without MoE layers
            return self
        per_device = counts.reshape(num_moe, devices, -1)
        tokens = per_device.sum(-1)
        mean = jnp.maximum(tokens.mean(-1), 1e-9)
        return ExpertLoad(self.slot_tokens + counts, self.device_tokens + tokens,
                          self.device_active + (per_device > 0).sum(-1).astype(jnp.int32),
                          self.imbalance + tokens.max(-1) / mean)


class LoopState(NamedTuple):
    """The decode loop's carry. Build it with `initial_state` (by keyword); a step returns `_replace`d copies."""

    cache: KVCache
    dcache: Optional[DrafterCache]
    bonus: jnp.ndarray  # [B] the last emitted token, not yet in the target cache
    out: jnp.ndarray  # [B, max_new + D + 1] emitted tokens
    num_out: jnp.ndarray  # [B]
    active: jnp.ndarray  # [B] bool
    step: jnp.ndarray  # [] loop iterations
    key: jnp.ndarray
    accepted_hist: jnp.ndarray  # [D + 1]: count of active steps with num_accepted == d
    stop_ids: jnp.ndarray  # [S] int32 (-1 padding)
    expert_load: ExpertLoad


@dataclasses.dataclass
class GenerateResult:
    tokens: list  # per sequence, the generated token ids (prompt excluded, stop token included)
    stats: dict


def _draft_tree(drafter: Drafter, target: Transformer, state: LoopState, spec: SpecConfig) -> trees.Tree:
    start = state.cache.seq_lens
    if drafter is None or (spec.budget == 0 and spec.tree == "ddtree"):
        return trees.root_only_tree(state.bonus, start, max_depth=0 if drafter is None else drafter.cfg.depth)
    with jax.named_scope("drafter"):
        logprobs = drafter(target, state.dcache, state.bonus, start)  # [B, D, V]
        if spec.tree == "ddtree" and spec.tree_temperature != 1.0:
            logprobs = jax.nn.log_softmax(logprobs / spec.tree_temperature, axis=-1)
        top_lp, top_tok = jax.lax.top_k(logprobs, spec.topk)
    with jax.named_scope("tree"):
        if spec.tree == "ddtree":
            return trees.build_ddtree(top_lp, top_tok, state.bonus, start, spec.budget)
        if spec.tree == "chain":
            return trees.build_chain(top_tok, top_lp, state.bonus, start)
        return trees.build_static(top_lp, top_tok, state.bonus, start, tuple(spec.tree))


def _speculative_step(target: Transformer, drafter: Optional[Drafter], state: LoopState, spec: SpecConfig,
                      loop_weights=None) -> LoopState:
    # The named scopes name the step's parts in the compiled program's metadata, which is how a profile
    # of the step attributes its kernels (kdtree_jax/profiling.py).
    tree = _draft_tree(drafter, target, state, spec)
    num_nodes = tree.num_nodes
    with jax.named_scope("tree"):
        cache, slots, batch = kv_pool.begin_chunk(state.cache, num_nodes, tree.mask)
    hidden_layers = () if drafter is None else drafter.target_layer_ids
    # Padding nodes carry token -1; any valid id will do for their (unused) verify rows.
    with jax.named_scope("verify"):
        fwd = target(jnp.maximum(tree.tokens, 0), tree.positions, cache.pages, batch,
                     hidden_layers=hidden_layers, impl=spec.impl, loop_weights=loop_weights)
    cache = cache._replace(pages=fwd.kv_pages)

    with jax.named_scope("accept"):
        if spec.temperature == 0:
            acc = acceptance.accept_greedy(tree, fwd.logits)
        else:
            acc = acceptance.accept_sampled(tree, fwd.logits, jax.random.fold_in(state.key, state.step),
                                            temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p)
    active = state.active
    with jax.named_scope("commit"):
        cache = kv_pool.commit_path(cache, slots, acc.path, acc.num_accepted, active)
    num_keep = jnp.where(active, acc.num_accepted + 1, 0)

    dcache = state.dcache
    if drafter is not None:
        with jax.named_scope("drafter"):
            path = jnp.clip(acc.path, 0, num_nodes - 1)
            path_hidden = jnp.take_along_axis(fwd.hidden, path[None, :, :, None], axis=2)  # [n, B, D+1, H]
            dcache = drafter.extend_context(dcache, path_hidden, num_keep)

    # Emit: the accepted tokens then the bonus, cut after a stop token.
    emitted = acc.emitted  # [B, D+1], -1 past num_emitted
    width = emitted.shape[1]
    j = jnp.arange(width)[None, :]
    in_step = j < jnp.where(active, acc.num_emitted, 0)[:, None]
    is_stop = in_step & (emitted[:, :, None] == state.stop_ids[None, None, :]).any(-1)
    first_stop = jnp.where(is_stop.any(1), jnp.argmax(is_stop, axis=1), width)
    n_emit = jnp.minimum(jnp.where(active, acc.num_emitted, 0), first_stop + 1)
    rows = jnp.arange(emitted.shape[0])[:, None]
    dest = jnp.where(j < n_emit[:, None], state.num_out[:, None] + j, state.out.shape[1])
    out = state.out.at[rows, dest].set(emitted, mode="drop")
    num_out = state.num_out + n_emit
    max_new = state.out.shape[1] - width
    still = active & ~is_stop.any(1) & (num_out < max_new)

    hist = state.accepted_hist + jnp.zeros_like(state.accepted_hist).at[acc.num_accepted].add(active.astype(jnp.int32))
    return state._replace(cache=cache, dcache=dcache, bonus=jnp.where(active, acc.bonus, state.bonus), out=out,
                          num_out=num_out, active=still, step=state.step + 1, accepted_hist=hist,
                          expert_load=state.expert_load.add(fwd.expert_counts))


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def decode_loop(target: Transformer, drafter: Optional[Drafter], state: LoopState, spec: SpecConfig) -> LoopState:
    """Speculative steps until every sequence is done; one compiled program, no host round trip."""
    max_steps = spec.max_new_tokens  # each step emits >= 1 token per active sequence

    def cond(s: LoopState):
        return (s.step < max_steps) & s.active.any()

    # Weights derived from the parameters are computed here, once: inside the body XLA would redo them at
    # every step (it does not hoist the layout copies it adds after its loop-invariant code motion).
    loop_weights = target.loop_weights()
    return jax.lax.while_loop(cond, lambda s: _speculative_step(target, drafter, s, spec, loop_weights), state)


@jax.jit
def _extend_drafter(drafter: Drafter, dcache: DrafterCache, hidden, num_new):
    return drafter.extend_context(dcache, hidden, num_new)


def _first_token(last_logits, spec: SpecConfig, key):
    if spec.temperature == 0:
        return argmax_last(last_logits)
    filtered = acceptance.filter_logits(last_logits, spec.temperature, spec.top_k, spec.top_p)
    keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(last_logits.shape[0]))
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)


def _expert_load_stats(load: ExpertLoad, steps: int) -> dict:
    """Per-step means of the router statistics, per MoE layer and overall."""
    if load.slot_tokens.shape[0] == 0 or steps == 0:
        return {}
    device_tokens = np.asarray(load.device_tokens) / steps
    device_active = np.asarray(load.device_active) / steps
    imbalance = np.asarray(load.imbalance) / steps
    return {
        "devices": int(device_tokens.shape[1]),
        "tokens_per_device_per_step": device_tokens.mean(0).round(3).tolist(),
        "active_experts_per_device_per_step": device_active.mean(0).round(3).tolist(),
        "max_over_mean_device_tokens": float(imbalance.mean()),
        "max_over_mean_by_layer": imbalance.round(4).tolist(),
        "slot_tokens": np.asarray(load.slot_tokens).tolist(),  # [n_moe, slots] totals, for EPLB
    }


def _as_batch(prompt_ids) -> tuple[list[np.ndarray], bool]:
    """A prompt (list of ids), a batch of prompts (list of lists, ragged) or a [B, L] array."""
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        arr = np.asarray(prompt_ids)
        if arr.ndim == 1:
            return [arr], True
        if arr.ndim == 2:
            return list(arr), False
        raise ValueError(f"prompt_ids must be [L] or [B, L]; got shape {arr.shape}")
    prompt_ids = list(prompt_ids)
    if prompt_ids and all(np.isscalar(t) for t in prompt_ids):
        return [np.asarray(prompt_ids)], True
    return [np.asarray(p) for p in prompt_ids], False


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _Request(NamedTuple):
    """A validated `generate` call: the prompts, the stop ids and the loop's static geometry."""

    prompts: list  # [np.ndarray] one per sequence
    stop: np.ndarray  # [S] int32, -1 padding
    use_drafter: bool  # False: autoregressive (no drafter, or ddtree with budget 0)
    depth: int  # the drafter's D (0 without one)
    num_nodes: int  # T, tree nodes per step (1 without the drafter)


# Tree nodes a step may verify (root included). The tree builders themselves stop only at the number of distinct
# prefixes (sum of K**d: 1.4e9 at D = 15, K = 4), but the step's cost grows faster than its nodes: the DDTree
# level search sorts D x budget x ln(budget) candidates, the verify pass runs T query rows against the context
# with a T x T ancestor mask, and the lm head writes T x V logits. Measured with the default pair on the 2-core CPU
# (16 new tokens, 2 steps): 0.2 s a step at budget 256, 0.8 s at 1024, 3.2 s at 2048, 13.6 s at 4096 (and 15 s of
# compile); the DDTree paper's largest budget is 1024. Larger trees are research for a faster device, not a run.
MAX_TREE_NODES = 4097


def _available_memory_bytes(target: Transformer) -> Optional[int]:
    """Memory free for one generate call on the target's first device: the allocator's limit less what is in use on
    an accelerator, the host's available memory on a CPU; None when unknown."""
    import os

    mesh = getattr(target, "mesh", None)
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def _validate(target: Transformer, drafter: Optional[Drafter], prompt_ids, *, max_new_tokens: int, budget: int,
              topk: int, tree_temperature: float, temperature: float, stop_ids, tree: TreeShape) -> _Request:
    """Checks every argument of `generate` before any device work; raises ValueError naming the argument.

    Beyond the types and signs: the context (the longest prompt, and it plus max_new_tokens, against the target's
    max_position_embeddings), the tree's size (at most MAX_TREE_NODES nodes a step) and the memory the call needs
    (the KV pool and the drafter's context for prompt + max_new_tokens per sequence, and a step's logits), so that
    a huge value is a one-line error instead of a hang or an out-of-memory traceback."""
    import operator

    def integer(value, name):
        if isinstance(value, bool):
            raise ValueError(f"{name} must be an integer; got {value!r}")
        try:
            return operator.index(value)
        except TypeError:
            raise ValueError(f"{name} must be an integer; got {value!r}") from None

    cfg = target.cfg
    prompts, _ = _as_batch(prompt_ids)
    if not prompts:
        raise ValueError("prompt_ids holds no prompt")
    for b, p in enumerate(prompts):
        if p.ndim != 1:
            raise ValueError(f"prompt_ids[{b}] must be a flat list of token ids; got shape {p.shape}")
        if p.size == 0:
            raise ValueError(f"prompt_ids[{b}] is empty (every prompt needs at least one token)"
                             if len(prompts) > 1 else "prompt_ids is empty (a prompt needs at least one token)")
    for p in prompts:
        validate_tokens(p, cfg.vocab_size, "prompt_ids")
    max_new_tokens = integer(max_new_tokens, "max_new_tokens")
    budget = integer(budget, "budget")
    topk = integer(topk, "topk")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0; got {budget}")
    if not 1 <= topk <= cfg.vocab_size:
        raise ValueError(f"topk must be in [1, {cfg.vocab_size}] (the vocabulary); got {topk}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    if not tree_temperature > 0:
        raise ValueError(f"tree_temperature must be > 0; got {tree_temperature}")
    if isinstance(tree, str) and tree not in ("ddtree", "chain"):
        raise ValueError(f"tree must be 'ddtree', 'chain' or a tuple of branching factors; got {tree!r}")
    stop = validate_tokens(np.asarray(list(stop_ids)), cfg.vocab_size, "stop_ids") if stop_ids else np.array([-1], np.int32)

    # The context: rope positions past max_position_embeddings are outside what the target was trained on (and
    # outside its yarn scaling): the output degrades without a word, so refuse before any device work.
    context = cfg.max_position_embeddings
    longest = max(p.size for p in prompts)
    if longest > context:
        raise ValueError(f"the prompt has {longest} tokens, more than the model's context of {context} tokens "
                         "(max_position_embeddings); shorten it")
    if longest + max_new_tokens > context:
        raise ValueError(f"the prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{longest + max_new_tokens} tokens exceeds the model's context of {context} tokens "
                         f"(max_position_embeddings); max_new_tokens can be at most {context - longest}")

    if drafter is not None and drafter.cfg.depth < 1:
        raise ValueError("the drafter's block_size must be >= 2")
    use_drafter = drafter is not None and not (tree == "ddtree" and budget == 0)
    depth = drafter.cfg.depth if drafter is not None else 0
    if use_drafter and tree == "ddtree":
        limit = min(trees.max_ddtree_budget(depth, topk), MAX_TREE_NODES - 1)
        if budget > limit:
            why = ("the most nodes a step may verify" if limit == MAX_TREE_NODES - 1 else
                   f"the distinct prefixes of block_size {drafter.cfg.block_size} and topk {topk}")
            raise ValueError(f"budget must be <= {limit} ({why}); got {budget}")
    if not isinstance(tree, str):
        branching = tuple(integer(b, "tree entries") for b in tree)
        if use_drafter and len(branching) > depth:
            raise ValueError(f"a static tree has at most {depth} levels (the drafter's block_size - 1); "
                             f"got {len(branching)}")
        if any(not 1 <= b <= topk for b in branching):
            raise ValueError(f"static tree branching factors must be in [1, topk={topk}]; got {list(branching)}")
        nodes, width = 1, 1
        for b in branching:
            width *= b
            nodes += width
            if nodes > MAX_TREE_NODES:
                raise ValueError(f"the static tree {list(branching)} has more than {MAX_TREE_NODES} nodes (the most "
                                 "a step may verify)")
    num_nodes = (budget + 1 if tree == "ddtree" else depth + 1 if tree == "chain" else nodes)
    if not use_drafter:
        num_nodes = 1

    # Memory: what `_setup` allocates (the KV pool, the drafter's context, the prompts' hidden states) and a step's
    # largest buffers (logits and the ancestor mask of T nodes), against what the device has free.
    batch = len(prompts)
    padded = _round_up(longest, 64)
    max_len = _round_up(padded + max_new_tokens + num_nodes + depth + 1, 64)
    itemsize = jnp.dtype(target.dtype).itemsize
    need = cfg.num_hidden_layers * batch * max_len * cfg.cache_dim * itemsize + batch * max_len * 8
    if use_drafter:
        dcfg = drafter.cfg
        need += 2 * dcfg.num_layers * batch * max_len * dcfg.num_kv_heads * dcfg.head_dim * itemsize
        need += len(drafter.target_layer_ids) * batch * padded * cfg.hidden_size * itemsize
    need += batch * num_nodes * (cfg.vocab_size * 4 + -(-num_nodes // 32) * 4 + cfg.num_hidden_layers * cfg.hidden_size * 4)
    available = _available_memory_bytes(target)
    if available is not None and need > available:
        raise ValueError(f"{batch} prompt(s) of up to {longest} tokens + max_new_tokens {max_new_tokens} with "
                         f"{num_nodes}-node trees need about {_format_bytes(need)} (KV pool, drafter context, a "
                         f"step's logits) but the device has {_format_bytes(available)} free: lower max_new_tokens, "
                         "budget or the number of prompts")
    return _Request(prompts, stop, use_drafter, depth, num_nodes)


def initial_state(cache: KVCache, dcache: Optional[DrafterCache], first_tokens, *, max_new_tokens: int, width: int,
                  stop_ids, key, expert_load: ExpertLoad, active=None) -> LoopState:
    """The decode loop's starting state (the public way to build a LoopState, for `decode_loop`).

    cache: the target's pool after the prompts (the first token not yet in it); dcache: the drafter's
    context over the same positions (None without a drafter); first_tokens [B]: each sequence's first
    generated token (the first tree's root), already emitted; width: D + 1 (tokens a step can emit; 1
    without a drafter); stop_ids [S] int32 (-1 padding); active [B] bool (default: every sequence).
    """
    first_tokens = jnp.asarray(first_tokens, jnp.int32)
    batch = first_tokens.shape[0]
    return LoopState(
        cache=cache,
        dcache=dcache,
        bonus=first_tokens,
        out=jnp.full((batch, max_new_tokens + width), -1, jnp.int32).at[:, 0].set(first_tokens),
        num_out=jnp.ones((batch,), jnp.int32),
        active=jnp.ones((batch,), bool) if active is None else jnp.asarray(active, bool),
        step=jnp.zeros((), jnp.int32),
        key=key,
        accepted_hist=jnp.zeros((width,), jnp.int32),
        stop_ids=jnp.asarray(stop_ids, jnp.int32),
        expert_load=expert_load,
    )


def _setup(target: Transformer, drafter: Optional[Drafter], req: _Request, spec: SpecConfig, *, seed: int,
           chunk_size: int, kv_dtype, num_moe: int, slots: int):
    """Prefill the prompts and the drafter's context, pick the first tokens: -> (the loop's starting state, the
    drafter the loop runs (None when autoregressive; replicated on a sharded target's mesh), prefill seconds)."""
    cfg = target.cfg
    batch = len(req.prompts)
    lens = np.array([p.size for p in req.prompts], np.int32)
    chunk = min(chunk_size, _round_up(int(lens.max()), 16))
    padded = _round_up(int(lens.max()), chunk)
    ids = np.zeros((batch, padded), np.int32)
    for b, p in enumerate(req.prompts):
        ids[b, :p.size] = p
    # Room for the prompt, every new token and one verify tree past the end; bucketed so similar
    # requests share a compiled loop.
    max_len = _round_up(padded + spec.max_new_tokens + req.num_nodes + req.depth + 1, 64)

    key = jax.random.key(seed)
    cache = kv_pool.init_cache(cfg, batch, max_len, dtype=kv_dtype or target.dtype)
    mesh = getattr(target, "mesh", None)
    if mesh is not None:  # a sharded target: the pool and the drafter live whole on every device
        cache = replicate(cache, mesh)
        if drafter is not None:
            drafter = replicate(drafter, mesh)

    t0 = time.perf_counter()
    hidden_layers = drafter.target_layer_ids if req.use_drafter else ()
    last_logits, hidden, cache = prefill(target, cache, ids, lens, chunk_size=chunk,
                                         hidden_layers=hidden_layers, impl=spec.impl)
    dcache = None
    if req.use_drafter:
        dcache = _extend_drafter(drafter, drafter.init_cache(batch, max_len), hidden, jnp.asarray(lens))
    first = _first_token(last_logits, spec, jax.random.fold_in(key, 1 << 30))
    first_np = np.asarray(first)
    t_prefill = time.perf_counter() - t0

    active = ~np.isin(first_np, req.stop) & (spec.max_new_tokens > 1)
    state = initial_state(cache, dcache, first, max_new_tokens=spec.max_new_tokens,
                          width=(req.depth if req.use_drafter else 0) + 1, stop_ids=req.stop, key=key,
                          expert_load=ExpertLoad.zeros(num_moe, slots, spec.expert_devices), active=active)
    return state, (drafter if req.use_drafter else None), t_prefill


def _run_loop(target: Transformer, drafter: Optional[Drafter], state: LoopState, spec: SpecConfig, profile: bool):
    """Compile the loop ahead (cached by jax for later calls with the same shapes, so tokens/s times decoding
    only), optionally profile it once on a copy of the state, run it: -> (final state, compile s, decode s,
    step profile or None)."""
    t1 = time.perf_counter()
    loop = decode_loop.lower(target, drafter, state, spec=spec).compile()
    t_compile = time.perf_counter() - t1
    step_profile = None
    if profile:
        copy = jax.tree.map(jnp.copy, state)  # the loop donates its state
        step_profile = profiling.profile_call(loop, (target, drafter, copy), steps_of=lambda out: out.step)
        del copy
    t1 = time.perf_counter()
    final = loop(target, drafter, state)
    final.num_out.block_until_ready()
    t_decode = time.perf_counter() - t1
    kv_pool.check_overflow(final.cache)
    return final, t_compile, t_decode, step_profile


def _stats(final: LoopState, tokens: list, spec: SpecConfig, num_nodes: int, *, t_prefill: float, t_compile: float,
           t_decode: float, step_profile: Optional[dict]) -> dict:
    """`GenerateResult.stats` from the loop's final state and the timings."""
    width = final.accepted_hist.shape[0]
    hist = np.asarray(final.accepted_hist).astype(np.int64)
    seq_steps = int(hist.sum())
    new_tokens = sum(len(t) for t in tokens)
    stats = {
        "steps": int(final.step),
        "sequence_steps": seq_steps,
        "tau": float((hist * (np.arange(width) + 1)).sum() / seq_steps) if seq_steps else float("nan"),
        # P(at least d drafted tokens accepted in a step), d = 1..D
        "acceptance_by_depth": [float(hist[d:].sum() / seq_steps) if seq_steps else float("nan")
                                for d in range(1, width)],
        "new_tokens": new_tokens,
        "prefill_seconds": t_prefill,
        "compile_seconds": t_compile,
        "decode_seconds": t_decode,
        # Tokens from the decode loop (the first token of each sequence comes from the prefill).
        "tokens_per_second": (new_tokens - len(tokens)) / t_decode if t_decode > 0 else float("nan"),
        "tree": spec.tree if isinstance(spec.tree, str) else list(spec.tree),
        "budget": num_nodes - 1,  # tree nodes besides the root
        "tree_temperature": spec.tree_temperature,
        "num_nodes": num_nodes,
        "expert_load": _expert_load_stats(final.expert_load, int(final.step)),
    }
    if step_profile is not None:
        step_ms = t_decode / max(int(final.step), 1) * 1e3
        stats["profile"] = {**step_profile, "step_ms": step_ms, "idle_ms": step_ms - step_profile["busy_ms"]}
    return stats


def generate(target: Transformer, drafter: Optional[Drafter], prompt_ids, *, max_new_tokens: int = 64,
             budget: int = 16, topk: int = 4, tree_temperature: float = 1.0, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, stop_ids: Sequence[int] = (), tree: TreeShape = "ddtree", impl: str = "auto",
             chunk_size: int = 64, kv_dtype=None, expert_devices: Optional[int] = None,
             profile: bool = False) -> GenerateResult:
    """Speculative decoding of one prompt or a batch of (ragged) prompts.

    tree: "ddtree" (the `budget` best prefixes of the drafter's top-`topk` per depth), "chain" (DFlash:
    top-1 per depth) or a tuple of branching factors per depth (a static shape). budget 0 (or no
    drafter) decodes autoregressively through the same loop. temperature 0 is greedy; otherwise every
    emitted token is an exact sample of the target's (top-k/top-p filtered) distribution.
    Returns the generated ids per sequence and stats: steps, tau (mean tokens per step), per-depth
    acceptance, tokens/s, and the router's expert load per step grouped into `expert_devices` devices
    (default: the target's mesh size) — the imbalance an expert-parallel layout would see.
    profile: first run the decode loop once under the profiler, on a copy of its starting state (memory for a
    second KV pool), and add stats["profile"]: each step's kernel time by part (kdtree_jax.profiling) and the
    idle time of the timed run (its step time less the union of the profiled step's kernels).

    Reads top to bottom as: `_validate` the arguments, `_setup` (prefill, first tokens, `initial_state`),
    `_run_loop` (compile, `decode_loop`), `_stats`.
    """
    req = _validate(target, drafter, prompt_ids, max_new_tokens=max_new_tokens, budget=budget, topk=topk,
                    tree_temperature=tree_temperature, temperature=temperature, stop_ids=stop_ids, tree=tree)
    mesh = getattr(target, "mesh", None)
    devices = expert_devices or (mesh.size if mesh is not None else 1)
    moe_layers = [layer.mlp for layer in target.layers if layer.is_moe]
    slots = moe_layers[0].num_slots if moe_layers else 0
    if slots % devices:
        raise ValueError(f"expert_devices ({devices}) must divide the expert slots per layer ({slots})")
    spec = SpecConfig(tree=tree if isinstance(tree, str) else tuple(int(b) for b in tree),
                      budget=budget if req.use_drafter else 0, topk=topk, tree_temperature=float(tree_temperature),
                      temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                      max_new_tokens=max_new_tokens, impl=impl, expert_devices=devices)

    state, loop_drafter, t_prefill = _setup(target, drafter, req, spec, seed=seed, chunk_size=chunk_size,
                                            kv_dtype=kv_dtype, num_moe=len(moe_layers), slots=slots)
    final, t_compile, t_decode, step_profile = _run_loop(target, loop_drafter, state, spec, profile)

    out_np, num_out = np.asarray(final.out), np.asarray(final.num_out)
    tokens = [out_np[b, :min(int(num_out[b]), max_new_tokens)].tolist() for b in range(len(req.prompts))]
    stats = _stats(final, tokens, spec, req.num_nodes, t_prefill=t_prefill, t_compile=t_compile, t_decode=t_decode,
                   step_profile=step_profile)
    return GenerateResult(tokens=tokens, stats=stats)
