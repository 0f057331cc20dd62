"""One decode step, the body of the engine's loop: draft, build the tree, verify, accept, commit, emit.

Two kinds of step share the verify-and-commit half (`verify_and_commit`):
- `speculative_step`, a fixed tree (SpecConfig.menu empty): the DDTree of SpecConfig.budget (0: autoregressive, no
  drafter), the chain or a static shape, every step;
- `adaptive_step` (SpecConfig.menu set, budget "auto"): one entry of the menu, static (each entry is its own compiled
  chunk program; budget_policy.py picks the entry of each chunk). A speculative entry b drafts and verifies the
  fixed budget's own tree, which also predicts every smaller entry's tokens (a best-first tree's first b' + 1 nodes are
  the tree of budget b' < b); an autoregressive entry runs no drafter.

The drafter's context in an adaptive loop is extended lazily across autoregressive steps: such a step appends the
target features of its token to `PendingContext`, and an autoregressive chunk ends by projecting the ring into the
drafter's cache (`flush_pending`, once a chunk, after its loop: every chunk starts with the ring empty). An
autoregressive step then costs what a fixed autoregressive step costs plus the append, not a drafter pass; the drafter
sees the same context either way (each position's keys and values depend on its own features and position only).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from kdtree_jax import kv_pool
from kdtree_jax.kv_pool import KVCache
from kdtree_jax.model.drafter import Drafter, DrafterCache
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.ops import topk as topk_ops
from kdtree_jax.speculative import accept as acceptance
from kdtree_jax.speculative import budget_policy as policy_ops
from kdtree_jax.speculative import sampling as sampling_ops
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
    # What the program can do; each row's own settings are data (LoopState.sampling, sampling.py), so one program
    # serves any mix. sampled: some row may sample (False: every row greedy, the argmax of every node at once);
    # penalties: some row may have a penalty (False: no token counts in the state, no penalty work).
    sampled: bool = False
    penalties: bool = False
    max_new_tokens: int = 64
    impl: str = "auto"  # verify-attention implementation
    # Every verify row computed bit for bit as the one-token step computes it, so that greedy speculative output
    # equals autoregressive output token for token in bfloat16 (model/row_invariant.py; on a GPU it needs the XLA
    # flags of kdtree_jax.runtime.configure(row_invariant=True)). Off by default: it costs speed.
    row_invariant: bool = False
    expert_devices: int = 1  # expert-load statistics group the expert slots into this many devices
    # The adaptive budget (budget "auto"): the DDTree budgets a step may verify (0: autoregressive, no drafter pass),
    # chosen per step by budget_policy.py; empty: every step verifies `budget`. With a menu, budget = max(menu).
    menu: tuple = ()


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
    key: jnp.ndarray  # [B] keys: each row's random stream (a step draws from fold_in(key, num_out))
    accepted_hist: jnp.ndarray  # [D + 1]: count of active steps with num_accepted == d
    stop_ids: jnp.ndarray  # [S] int32 (-1 padding)
    expert_load: ExpertLoad
    # The adaptive budget's state (SpecConfig.menu set; None otherwise).
    policy: Optional[policy_ops.PolicyState] = None
    pending: Optional["PendingContext"] = None
    sampling: Optional[sampling_ops.RowSampling] = None  # each row's settings (initial_state sets them)
    counts: Optional[jnp.ndarray] = None  # [B, V] int32 token counts of prompt + emitted (SpecConfig.penalties)


class PendingContext(NamedTuple):
    """Target features of committed tokens not yet in the drafter's cache (an adaptive loop's lazy context)."""

    hidden: jnp.ndarray  # [len(drafter.target_layer_ids), B, R, hidden]: row b's first count[b] are real
    count: jnp.ndarray  # [B] int32

    @staticmethod
    def zeros(num_layers: int, batch: int, capacity: int, hidden: int, dtype) -> "PendingContext":
        return PendingContext(jnp.zeros((num_layers, batch, capacity, hidden), dtype), jnp.zeros((batch,), jnp.int32))


def tree_depth(spec: SpecConfig, drafter_depth: int) -> int:
    """The drafted depths the step's tree can reach: a DDTree of b nodes is at most b deep, a static shape as deep
    as its branching tuple, the chain the drafter's whole block."""
    if spec.tree == "ddtree":
        return max(min(spec.budget, drafter_depth), 1)
    if spec.tree == "chain":
        return drafter_depth
    return min(len(tuple(spec.tree)), drafter_depth)


def draft_scores(drafter: Drafter, target: Transformer, state: LoopState, spec: SpecConfig):
    """The drafter's pass: per depth, the top-`spec.topk` (log-probs, tokens) [B, d, K], d = tree_depth(): the lm
    head, the top-k and the tree's search skip the depths the tree cannot reach (at budget 8 of a 15-deep drafter,
    more than half of the head's rows)."""
    start = state.cache.seq_lens
    with jax.named_scope("drafter"):
        # The top-k of log_softmax(logits / t) in one kernel on a GPU (ops/topk.py): the same candidates as
        # top_k(log_softmax(log_softmax(logits) / t)), since log_softmax(log_softmax(x) / t) = log_softmax(x / t).
        # A drafter-like object with only __call__ (log-probs, as tests' fixed drafters) works too: the log-probs'
        # log_softmax is themselves, up to rounding.
        if hasattr(drafter, "logits"):
            depth = tree_depth(spec, drafter.cfg.depth)
            logits = drafter.logits(target, state.dcache, state.bonus, start, depth=depth)  # [B, d, V]
        else:
            logits = drafter(target, state.dcache, state.bonus, start)  # [B, D, V]
            logits = logits[:, :tree_depth(spec, logits.shape[1])]
        tree_temperature = spec.tree_temperature if spec.tree == "ddtree" else 1.0
        # Over a mesh the lm head splits the vocabulary, and the partitioner would gather the whole logits to every
        # device for the custom call; XLA's top_k there is partitioned (a fused per-shard merge is left to do).
        mesh = getattr(target, "mesh", None)
        impl = "auto" if mesh is None or mesh.size == 1 else "xla"
        return topk_ops.log_softmax_top_k(logits, spec.topk, tree_temperature, impl=impl)


def draft_tree(drafter: Drafter, target: Transformer, state: LoopState, spec: SpecConfig) -> trees.Tree:
    start = state.cache.seq_lens
    if drafter is None or (spec.budget == 0 and spec.tree == "ddtree"):
        return trees.root_only_tree(state.bonus, start, max_depth=0 if drafter is None else drafter.cfg.depth)
    top_lp, top_tok = draft_scores(drafter, target, state, spec)
    with jax.named_scope("tree"):
        if spec.tree == "ddtree":
            return trees.build_ddtree(top_lp, top_tok, state.bonus, start, spec.budget)
        if spec.tree == "chain":
            return trees.build_chain(top_tok, top_lp, state.bonus, start)
        return trees.build_static(top_lp, top_tok, state.bonus, start, tuple(spec.tree))


class Verified(NamedTuple):
    """What `verify_and_commit` hands back besides the state."""

    acc: acceptance.Acceptance
    path_hidden: Optional[jnp.ndarray]  # [len(hidden layers), B, D+1, hidden]: the accepted path's target features
    num_keep: jnp.ndarray  # [B] committed tokens per sequence (accepted nodes + the root; 0 when inactive)


def verify_and_commit(target: Transformer, drafter: Optional[Drafter], state: LoopState, spec: SpecConfig,
                      tree: trees.Tree, loop_weights=None) -> tuple[LoopState, Verified]:
    """The step after the tree: verify every node in one target pass, walk the acceptance, commit the accepted path's
    slots, emit its tokens (cut after a stop token). The drafter's context is the caller's to extend."""
    # The named scopes name the step's parts in the compiled program's metadata, which is how a profile
    # of the step attributes its kernels (kdtree_jax/profiling.py).
    num_nodes = tree.num_nodes
    with jax.named_scope("tree"):
        cache, slots, batch = kv_pool.begin_chunk(state.cache, num_nodes, tree.mask)
    hidden_layers = () if drafter is None else drafter.target_layer_ids
    # Padding nodes carry token -1; any valid id will do for their (unused) verify rows.
    with jax.named_scope("verify"):
        fwd = target(jnp.maximum(tree.tokens, 0), tree.positions, cache.pages, batch,
                     hidden_layers=hidden_layers, impl=spec.impl, loop_weights=loop_weights,
                     row_invariant=spec.row_invariant)
    cache = cache._replace(pages=fwd.kv_pages)

    with jax.named_scope("accept"):
        keys = sampling_ops.step_keys(state.key, state.num_out) if spec.sampled else None
        acc = sampling_ops.accept_rows(tree, fwd.logits, keys, state.sampling, state.counts, sampled=spec.sampled)
    active = state.active
    with jax.named_scope("commit"):
        cache = kv_pool.commit_path(cache, slots, acc.path, acc.num_accepted, active)
    num_keep = jnp.where(active, acc.num_accepted + 1, 0)

    path_hidden = None
    if drafter is not None:
        path = jnp.clip(acc.path, 0, num_nodes - 1)
        path_hidden = jnp.take_along_axis(fwd.hidden, path[None, :, :, None], axis=2)  # [n, B, D+1, H]

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
    max_new = state.out.shape[1] - state.accepted_hist.shape[0]  # the loop's width (an adaptive AR step emits 1)
    still = active & ~is_stop.any(1) & (num_out < max_new)

    hist = state.accepted_hist + jnp.zeros_like(state.accepted_hist).at[acc.num_accepted].add(active.astype(jnp.int32))
    state = state._replace(cache=cache, bonus=jnp.where(active, acc.bonus, state.bonus), out=out,
                           num_out=num_out, active=still, step=state.step + 1, accepted_hist=hist,
                           expert_load=state.expert_load.add(fwd.expert_counts),
                           counts=sampling_ops.committed_tokens(state.counts, emitted, n_emit))
    return state, Verified(acc, path_hidden, num_keep)


def speculative_step(target: Transformer, drafter: Optional[Drafter], state: LoopState, spec: SpecConfig,
                     loop_weights=None, entry: Optional[int] = None) -> LoopState:
    """One step of a fixed tree: draft, verify, commit, extend the drafter's context (module docstring). An adaptive
    loop's (SpecConfig.menu) steps take their static menu `entry` (len(menu): autoregressive)."""
    if spec.menu:
        if entry is None:
            raise ValueError("an adaptive loop's step takes its menu entry (engine.ChunkedLoop picks one per chunk)")
        return adaptive_step(target, drafter, state, spec, loop_weights, entry)
    tree = draft_tree(drafter, target, state, spec)
    state, verified = verify_and_commit(target, drafter, state, spec, tree, loop_weights)
    if drafter is not None:
        with jax.named_scope("drafter"):
            state = state._replace(dcache=drafter.extend_context(state.dcache, verified.path_hidden,
                                                                 verified.num_keep))
    return state


# The adaptive budget -------------------------------------------------------------------------------------------------


def pending_capacity(chunk_steps: int) -> int:
    """Rows of an adaptive loop's PendingContext: what one chunk of autoregressive steps appends (a row a step; a
    drafting step extends the drafter's cache itself, and an autoregressive chunk flushes the ring after its loop)."""
    return max(int(chunk_steps), 1)


def flush_pending(drafter: Drafter, state: LoopState) -> LoopState:
    """The state with the pending features appended to the drafter's cache and the ring emptied."""
    with jax.named_scope("drafter"):
        dcache = drafter.extend_context(state.dcache, state.pending.hidden, state.pending.count)
    return state._replace(dcache=dcache, pending=state.pending._replace(count=jnp.zeros_like(state.pending.count)))


def adaptive_step(target: Transformer, drafter: Drafter, state: LoopState, spec: SpecConfig, loop_weights,
                  entry: int) -> LoopState:
    """One step of the adaptive budget at a static menu entry (module docstring; budget_policy.py for the policy)."""
    menu, policy, pending = spec.menu, state.policy, state.pending
    if not policy_ops.is_speculative(menu, entry):
        # Autoregressive: the root alone (a walk of depth 0, as the fixed autoregressive step's), no drafter; its
        # token's target features wait in the ring.
        tree = trees.root_only_tree(state.bonus, state.cache.seq_lens, max_depth=0)
        state, verified = verify_and_commit(target, drafter, state, spec, tree, loop_weights)
        with jax.named_scope("drafter"):
            # One row a step (an inactive row keeps none: past the ring's end, where the scatter drops it).
            dest = jnp.where(verified.num_keep > 0, pending.count, pending.hidden.shape[2])
            rows = jnp.arange(dest.shape[0])
            pending = PendingContext(pending.hidden.at[:, rows, dest].set(
                verified.path_hidden[:, :, 0].astype(pending.hidden.dtype), mode="drop"),
                pending.count + verified.num_keep)
        with jax.named_scope("policy"):
            policy = policy_ops.count_undrafted(policy, menu)
        return state._replace(policy=policy, pending=pending)

    active = state.active
    # The fixed budget's own tree: it predicts this entry and every smaller one (their trees are its first nodes); the
    # policy scales the larger entries' predictions (budget_policy.absorb). Building the menu's largest tree instead,
    # to predict every entry, cost more than the choice saved: on the H200 a DDTree-64 build is ~100 us a step at
    # batch 1 and 16 (215 at 64) against ~22-29 for budget 8 (a step of the default pair is ~0.25-0.5 ms).
    tree = draft_tree(drafter, target, state, dataclasses.replace(spec, budget=menu[entry]))
    state, verified = verify_and_commit(target, drafter, state, spec, tree, loop_weights)
    with jax.named_scope("drafter"):
        state = state._replace(dcache=drafter.extend_context(state.dcache, verified.path_hidden, verified.num_keep))
    with jax.named_scope("policy"):  # the chunk's end absorbs it (budget_policy.absorb)
        policy = policy_ops.log_step(policy, menu, entry, scores=tree.scores, valid=tree.valid,
                                     path=verified.acc.path, active=active)
    return state._replace(policy=policy)
