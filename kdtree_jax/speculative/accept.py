"""Acceptance: which part of a draft tree the target agrees with, and the token it adds ("bonus").

After the verify pass we have the target's logits at every tree node: row n is the target's
distribution for the token that follows node n's prefix. Walk from the root: at the current node pick
the target's token (argmax, or a sample); if a valid child of the node carries that token, move to it
and continue; otherwise stop, and the picked token is the bonus. The emitted tokens are the picked
tokens along the walk, so each one is exactly what plain decoding with the target would have picked
after the same prefix: the draft only decides how many of them one verify pass yields. With sampling
that makes the output an exact sample of the (filtered) target, as long as every visited node gets
fresh randomness of its own.

Shapes are static: D = tree.max_depth, so a walk visits at most D + 1 nodes (the root and at most D
accepted nodes) and emits at most D + 1 tokens.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kdtree_jax.ops.argmax import argmax_last
from kdtree_jax.ops.masks import pack_mask_bits
from kdtree_jax.speculative.tree import Tree


class Acceptance(NamedTuple):
    """Result of one acceptance walk, per sequence. Padding is -1 in every array.

    path          int32 [B, D+1]  node indices visited, from the root (path[:, 0] = 0); entries past
                                  num_accepted are -1
    num_accepted  int32 [B]       accepted non-root nodes, 0..D
    bonus         int32 [B]       the target's token at the last visited node (not in the tree)
    emitted       int32 [B, D+1]  tokens produced this step, in order: the accepted nodes' tokens,
                                  then the bonus; entries past num_accepted are -1
    num_emitted   int32 [B]       num_accepted + 1
    last_node     int32 [B]       path[num_accepted]: the deepest accepted node (0 = the root), whose
                                  target logits gave the bonus; its KV and hidden state are the last
                                  ones to keep
    """

    path: jax.Array
    num_accepted: jax.Array
    bonus: jax.Array
    emitted: jax.Array
    num_emitted: jax.Array
    last_node: jax.Array


def _check_logits(tree: Tree, target_logits) -> None:
    batch, num_nodes = tree.tokens.shape
    shape = tuple(jnp.shape(target_logits))
    if len(shape) != 3 or shape[:2] != (batch, num_nodes):
        raise ValueError(f"target_logits must be [B={batch}, T={num_nodes}, V]; got shape {list(shape)}")


def walk(tree: Tree, choose) -> Acceptance:
    """The acceptance walk, one node per iteration. choose(node [B]) -> the target's token at that node,
    [B] int32. `accept_sampled` walks with a sampling `choose`; `accept_greedy` gets the same result as the
    walk with an argmax `choose` without the loop (`_walk_all`), which benchmarks time against this.

    At most D + 1 picks (at most D accepted nodes, then the bonus), one per loop iteration; the loop
    stops early once every sequence has its bonus, since each pick reads a [B, V] row of logits (and
    sampling filters it): typical acceptance lengths are far below D.
    """
    batch = tree.tokens.shape[0]
    max_depth = tree.max_depth
    rows = jnp.arange(batch)
    if max_depth == 0:
        # A root-only tree (an autoregressive step): its one pick is the bonus. No loop: on a CPU the while loop's
        # condition and carry cost more thunks than the pick itself.
        token = choose(jnp.zeros((batch,), jnp.int32))
        zeros = jnp.zeros((batch,), jnp.int32)
        return Acceptance(path=jnp.zeros((batch, 1), jnp.int32), num_accepted=zeros, bonus=token,
                          emitted=token[:, None], num_emitted=zeros + 1, last_node=zeros)

    def not_finished(carry):
        s, _, done = carry[:3]
        return (s <= max_depth) & ~jnp.all(done)

    def step(carry):
        s, node, done, path, emitted, num_accepted, bonus = carry
        token = choose(node)
        child_match = (tree.parents == node[:, None]) & tree.valid & (tree.tokens == token[:, None])
        found = child_match.any(axis=1) & ~done
        child = jnp.argmax(child_match, axis=1).astype(jnp.int32)  # the first match if siblings repeat
        emitted = emitted.at[rows, s].set(jnp.where(done, -1, token))
        # path has one spare column so that step s = D (where nothing can be found) stays in range.
        path = path.at[rows, s + 1].set(jnp.where(found, child, -1))
        bonus = jnp.where(done | found, bonus, token)
        return (s + 1, jnp.where(found, child, node), done | ~found, path, emitted,
                num_accepted + found.astype(jnp.int32), bonus)

    init = (jnp.int32(0), jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool),
            jnp.full((batch, max_depth + 2), -1, jnp.int32).at[:, 0].set(0),
            jnp.full((batch, max_depth + 1), -1, jnp.int32), jnp.zeros((batch,), jnp.int32),
            jnp.full((batch,), -1, jnp.int32))
    _, node, _, path, emitted, num_accepted, bonus = jax.lax.while_loop(not_finished, step, init)
    return Acceptance(path=path[:, :max_depth + 1], num_accepted=num_accepted, bonus=bonus, emitted=emitted,
                      num_emitted=num_accepted + 1, last_node=node)


def _walk_all(tree: Tree, choice) -> Acceptance:
    """The acceptance walk of `walk`, given the target's token at *every* node (choice [B, T] int32),
    without a loop: the same result, as a few small array ops.

    A node is a step of the walk iff it is valid, its token is its parent's choice, no earlier sibling
    qualifies as well (the walk takes the first match), and the same holds for each of its ancestors
    up to the root: its row of the tree's ancestor bitmask meets no failing node. Those nodes form one
    chain from the root (at most one per depth). A loop of <= D + 1 steps with a data-dependent stop is
    a device-to-host round trip per step on a GPU; this is a fixed handful of kernels.
    """
    batch, num_nodes = tree.tokens.shape
    max_depth = tree.max_depth
    node = jnp.arange(num_nodes, dtype=jnp.int32)
    parents = tree.parents
    parent_choice = jnp.take_along_axis(choice, jnp.clip(parents, 0, num_nodes - 1), axis=1)
    good = tree.valid & (parents >= 0) & (node[None, :] > 0) & (tree.tokens == parent_choice)
    earlier_good_sibling = ((parents[:, :, None] == parents[:, None, :]) & (node[None, None, :] < node[None, :, None])
                            & good[:, None, :]).any(-1)
    step = good & ~earlier_good_sibling
    failing = pack_mask_bits(~step & (node[None, :] > 0))  # [B, W]; the root never fails
    on_path = jnp.all((tree.mask & failing[:, None, :]) == 0, axis=-1)  # [B, T]
    num_accepted = on_path.sum(axis=1, dtype=jnp.int32) - 1
    at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == jnp.arange(max_depth + 1)[None, :, None])
    path = jnp.where(at_depth.any(-1), jnp.argmax(at_depth, axis=-1), -1).astype(jnp.int32)  # [B, D+1]
    last_node = jnp.take_along_axis(path, num_accepted[:, None], axis=1)[:, 0]
    picks = jnp.take_along_axis(choice, jnp.maximum(path, 0), axis=1)  # the choice at each visited node
    emitted = jnp.where(jnp.arange(max_depth + 1)[None, :] <= num_accepted[:, None], picks, -1).astype(jnp.int32)
    bonus = jnp.take_along_axis(choice, last_node[:, None], axis=1)[:, 0].astype(jnp.int32)
    return Acceptance(path=path, num_accepted=num_accepted, bonus=bonus, emitted=emitted,
                      num_emitted=num_accepted + 1, last_node=last_node)


def accept_greedy(tree: Tree, target_logits) -> Acceptance:
    """Greedy verification: follow the target's argmax (ties: the lowest token id) down the tree.

    The argmax of every node's row is taken at once (one reduction over [B, T, V]: on a GPU cheaper than
    a loop that reduces only the visited rows but pays a host round trip per step; `argmax_last` keeps it
    cheap on a CPU too), then `_walk_all`.
    """
    _check_logits(tree, target_logits)
    return _walk_all(tree, argmax_last(target_logits))


def _is_static_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_sampling(temperature, top_k, top_p) -> int:
    if _is_static_number(temperature) and temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy); got {temperature}")
    if isinstance(top_k, bool):
        raise ValueError(f"top_k must be a static int >= 0 (0 = off); got {top_k!r}")
    try:
        top_k = operator.index(top_k)
    except TypeError:
        raise ValueError(f"top_k must be a static int >= 0 (0 = off); got {type(top_k).__name__}") from None
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off); got {top_k}")
    if _is_static_number(top_p) and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off); got {top_p}")
    return top_k


def filter_logits(logits, temperature, top_k: int = 0, top_p=1.0):
    """The sampling distribution as logits: f32 [..., V], -inf on removed tokens.

    In order:
      1. divide by temperature;
      2. top-k (0 = off): keep the tokens whose logit is >= the k-th largest (ties at the boundary all stay);
      3. top-p (1 = off): with the kept tokens' probabilities renormalised and sorted best first, token i
         stays iff the summed probability of tokens 0..i-1 is < top_p -- the smallest best-first set
         whose mass reaches top_p (the best token always stays; ties at the cutoff value all stay).
    Sampling from the result (softmax / `jax.random.categorical`) renormalises over the kept set.

    temperature == 0 means greedy: only the argmax (the lowest id among ties) stays, at logit 0.
    temperature and top_p may be traced scalars (then temperature >= 0 and 0 < top_p <= 1 are the
    caller's to ensure); top_k is static.
    """
    top_k = _check_sampling(temperature, top_k, top_p)
    logits = jnp.asarray(logits, jnp.float32)
    vocab = logits.shape[-1]
    token_ids = jnp.arange(vocab)
    argmax_only = jnp.where(token_ids == argmax_last(logits)[..., None], 0.0, -jnp.inf)
    if _is_static_number(temperature) and temperature == 0:
        return argmax_only

    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    sorted_desc = None  # best-first logits, when we have them anyway
    if top_k > 0 and top_k < vocab:
        sorted_desc = jax.lax.top_k(scaled, top_k)[0]
        scaled = jnp.where(scaled >= sorted_desc[..., -1:], scaled, -jnp.inf)

    if not (_is_static_number(top_p) and top_p >= 1.0):
        if sorted_desc is None:
            sorted_desc = -jnp.sort(-scaled, axis=-1)
        # With top-k on, the kept set is sorted_desc plus, possibly, ties of its last value; the cumulative
        # mass of sorted_desc's entries is the same either way, and the normaliser covers all kept tokens.
        probs = jnp.exp(sorted_desc - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
        mass = jnp.cumsum(probs, axis=-1)
        mass_before = jnp.concatenate([jnp.zeros_like(mass[..., :1]), mass[..., :-1]], axis=-1)
        num_kept = jnp.maximum(jnp.sum(mass_before < top_p, axis=-1, keepdims=True), 1)
        cutoff = jnp.take_along_axis(sorted_desc, num_kept - 1, axis=-1)
        keep = (scaled >= cutoff) | (top_p >= 1.0)
        scaled = jnp.where(keep, scaled, -jnp.inf)

    if _is_static_number(temperature):
        return scaled
    return jnp.where(temperature > 0, scaled, argmax_only)


def _per_sequence_keys(key, batch: int):
    """[B] keys: a batch of keys is used as given; a single key gets the row index folded in."""
    is_typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    single_ndim = 0 if is_typed else 1
    if key.ndim == single_ndim:
        return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))
    if key.ndim == single_ndim + 1 and key.shape[0] == batch:
        return key
    raise ValueError(f"key must be one PRNG key or a batch of {batch} keys; got shape {key.shape}")


def accept_sampled(tree: Tree, target_logits, key, *, temperature, top_k: int = 0, top_p=1.0) -> Acceptance:
    """Lossless sampled verification: at each visited node, sample the filtered target distribution.

    key: one PRNG key (then sequence b uses fold_in(key, b): its draws depend on its row in the batch)
    or a batch of B keys (one per sequence: draws independent of the batch's composition); typed keys
    (`jax.random.key`) or raw uint32 ones. The draw at node n uses fold_in(sequence key, n). The engine
    must give every step a new key (e.g. fold in the step or the sequence's position).

    temperature / top_k / top_p: as in `filter_logits`. A static temperature == 0 is `accept_greedy`.
    Only the <= D + 1 visited rows are filtered and sampled, not all T.
    """
    _check_logits(tree, target_logits)
    top_k = _check_sampling(temperature, top_k, top_p)
    if _is_static_number(temperature) and temperature == 0:
        return accept_greedy(tree, target_logits)
    seq_keys = _per_sequence_keys(jnp.asarray(key) if not isinstance(key, jax.Array) else key, tree.tokens.shape[0])

    def choose(node):
        row = jnp.take_along_axis(target_logits, node[:, None, None], axis=1)[:, 0]  # [B, V]
        row = filter_logits(row, temperature, top_k, top_p)
        node_keys = jax.vmap(jax.random.fold_in)(seq_keys, node)
        return jax.vmap(jax.random.categorical)(node_keys, row).astype(jnp.int32)

    return walk(tree, choose)


__all__ = ["Acceptance", "accept_greedy", "accept_sampled", "filter_logits", "walk"]
