"""Draft trees for speculative decoding: DDTree (best-first), chain (DFlash) and static shapes.

Every speculative step the drafter proposes, for each depth d = 1..D (D = block_size - 1), its top-K
next tokens with their log-probs, sorted best first. A tree node at depth d is a prefix (r_1, ..., r_d)
of per-depth ranks: its token is the rank-r_d token of depth d and its score is the sum of the log-probs
of its ranks. Node 0 is the root: the last accepted ("bonus") token, at depth 0, score 0.

The target then checks all T nodes of the tree in one forward pass. For that it needs, per node: the
token, its rope position (start_pos + depth) and which other nodes it may attend to (its ancestors and
itself, as the kernel's packed bitmask). That is what a `Tree` holds.

All builders here have static output shapes (T depends only on static arguments), are jittable and
are vectorised over the batch. Argument checks look only at shapes and Python values, so they run
before any device work, also when the builders are called inside someone else's `jax.jit`.

DDTree tie-break
----------------
`build_ddtree` places the `budget` nodes that come first in this total order, in that order:

    higher score first; among equal scores, the rank path (r_1, ..., r_d) that is smaller
    lexicographically first, a path before its own extensions (i.e. depth-first preorder).

It is what a best-first search pops when its heap is keyed on (-score, rank path); see
`build_ddtree`. Because log-probs are <= 0 and sorted per depth, a node never comes before its parent
or its previous sibling in this order, so the first `budget` nodes form a tree and the output lists
parents before children. (Unlike "earlier push first", this order is a property of the nodes alone,
which is what lets the device code below compute it without replaying the heap.)
"""

from __future__ import annotations

import operator
from functools import lru_cache, partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kdtree_jax.ops.masks import ancestor_mask, causal_mask

# Token id of padding nodes: never equal to a sampled or argmax token, so acceptance never enters them.
PAD_TOKEN = -1


@struct.dataclass
class Tree:
    """A batch of draft trees with T nodes each (node 0 = the root = the last accepted token).

    tokens     int32  [B, T]  token of each node; PAD_TOKEN (-1) on padding nodes
    parents    int32  [B, T]  parent node index; -1 for the root; parents[b, i] < i (parents first)
    depths     int32  [B, T]  0 for the root, parent's depth + 1 otherwise
    positions  int32  [B, T]  rope position: start_pos + depth
    mask       uint32 [B, T, ceil(T/32)]  bit j of word j // 32 of row i: node j is an ancestor of
                              node i or i itself (the verify kernel's tree_mask)
    valid      bool   [B, T]  False on padding nodes (they have parent 0, depth 1, token -1)
    scores     f32    [B, T]  the node's drafter score, sum of its ranks' log-probs (root 0,
                              padding -inf; chains built without log-probs: 0)
    max_depth  int (static)   D, the number of drafted depths the tree was built from: no node is
                              deeper, and acceptance returns D + 1 slots (`accept.py`)
    """

    tokens: jax.Array
    parents: jax.Array
    depths: jax.Array
    positions: jax.Array
    mask: jax.Array
    valid: jax.Array
    scores: jax.Array
    max_depth: int = struct.field(pytree_node=False)

    @property
    def num_nodes(self) -> int:
        """T, static."""
        return self.tokens.shape[1]


# ----------------------------------------------------------------------------------------------------
# Argument checks (shapes and Python values only: no device work)
# ----------------------------------------------------------------------------------------------------


def _check_draft(top_logprobs, top_tokens, root_token, start_pos, *, logprobs_required: bool = True):
    """Checks the drafter outputs and returns (B, D, K)."""
    if top_tokens is None or jnp.ndim(top_tokens) != 3:
        raise ValueError(f"top_tokens must be [B, D, K] (D = block_size - 1); got shape {jnp.shape(top_tokens)}")
    batch, depth, topk = jnp.shape(top_tokens)
    if not jnp.issubdtype(jnp.result_type(top_tokens), jnp.integer):
        raise ValueError(f"top_tokens must be integer token ids; got dtype {jnp.result_type(top_tokens)} "
                         "(were top_tokens and top_logprobs swapped?)")
    if top_logprobs is None:
        if logprobs_required:
            raise ValueError("top_logprobs must be given ([B, D, K] float log-probs)")
    else:
        if tuple(jnp.shape(top_logprobs)) != (batch, depth, topk):
            raise ValueError(f"top_logprobs must have top_tokens' shape {[batch, depth, topk]}; "
                             f"got {list(jnp.shape(top_logprobs))}")
        if not jnp.issubdtype(jnp.result_type(top_logprobs), jnp.floating):
            raise ValueError(f"top_logprobs must be floating point; got dtype {jnp.result_type(top_logprobs)} "
                             "(were top_tokens and top_logprobs swapped?)")
    if batch < 1:
        raise ValueError(f"batch size must be >= 1; got top_tokens with shape {jnp.shape(top_tokens)}")
    if depth < 1:
        raise ValueError(f"top_tokens' depth D = block_size - 1 must be >= 1 (block_size >= 2); got D = {depth}")
    if topk < 1:
        raise ValueError(f"top_tokens' K (top-K per depth) must be >= 1; got K = {topk}")
    for name, arr in (("root_token", root_token), ("start_pos", start_pos)):
        if tuple(jnp.shape(arr)) != (batch,):
            raise ValueError(f"{name} must be [B={batch}]; got shape {list(jnp.shape(arr))}")
        if not jnp.issubdtype(jnp.result_type(arr), jnp.integer):
            raise ValueError(f"{name} must be integer; got dtype {jnp.result_type(arr)}")
    return batch, depth, topk


def _static_int(value, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int; got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a static Python int; got {type(value).__name__}") from None


def max_ddtree_budget(depth: int, topk: int) -> int:
    """Number of distinct non-root nodes a D-deep, K-wide draft can make: sum_{d=1..D} K**d."""
    return sum(topk ** d for d in range(1, depth + 1))


# ----------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------


def _finish(tokens, parents, depths, valid, scores, start_pos, max_depth: int) -> Tree:
    """Adds positions and the ancestor mask to a tree's per-node arrays."""
    depths = depths.astype(jnp.int32)
    return Tree(
        tokens=tokens.astype(jnp.int32),
        parents=parents.astype(jnp.int32),
        depths=depths,
        positions=start_pos.astype(jnp.int32)[:, None] + depths,
        mask=ancestor_mask(parents),
        valid=valid,
        scores=scores.astype(jnp.float32),
        max_depth=max_depth,
    )


def root_only_tree(root_token, start_pos, max_depth: int = 0) -> Tree:
    """T = 1: just the root. Plain autoregressive decoding is a speculative step with this tree."""
    root_token, start_pos = jnp.asarray(root_token), jnp.asarray(start_pos)
    if root_token.ndim != 1 or start_pos.shape != root_token.shape:
        raise ValueError(f"root_token and start_pos must both be [B]; got {root_token.shape} and {start_pos.shape}")
    batch = root_token.shape[0]
    zeros = jnp.zeros((batch, 1), jnp.int32)
    return _finish(root_token[:, None], zeros - 1, zeros, jnp.ones((batch, 1), bool),
                   jnp.zeros((batch, 1), jnp.float32), start_pos, _static_int(max_depth, "max_depth"))


def pad_tree(tree: Tree, num_nodes: int) -> Tree:
    """Appends padding nodes up to `num_nodes` (static), e.g. to give trees of several shapes one T.

    A padding node: token -1, parent 0 (the root), depth 1, valid False, score -inf. Its verify
    output is garbage and unused; acceptance never moves into it.
    """
    num_nodes = _static_int(num_nodes, "num_nodes")
    extra = num_nodes - tree.num_nodes
    if extra < 0:
        raise ValueError(f"num_nodes must be >= the tree's T = {tree.num_nodes}; got {num_nodes}")
    batch = tree.tokens.shape[0]

    def extend(x, fill):
        return jnp.concatenate([x, jnp.full((batch, extra), fill, x.dtype)], axis=1)

    return _finish(extend(tree.tokens, PAD_TOKEN), extend(tree.parents, 0), extend(tree.depths, 1),
                   extend(tree.valid, False), extend(tree.scores, -jnp.inf), tree.positions[:, 0],
                   tree.max_depth)


# ----------------------------------------------------------------------------------------------------
# DDTree: the `budget` best prefixes
# ----------------------------------------------------------------------------------------------------


def build_ddtree(top_logprobs, top_tokens, root_token, start_pos, budget: int, method: str = "auto") -> Tree:
    """DDTree: the `budget` highest-scoring prefixes of the draft as a tree of T = budget + 1 nodes.

    top_logprobs  f32   [B, D, K]  per depth, the drafter's top-K log-probs, sorted descending
                                   (as `lax.top_k` returns them); <= 0 and not NaN
    top_tokens    int   [B, D, K]  the matching token ids (distinct within a depth)
    root_token    int   [B]        the last accepted token (the root, depth 0)
    start_pos     int   [B]        the root's rope position
    budget        int   static, 0 <= budget <= sum_{d=1..D} K**d; 0 gives the root-only tree

    The reference algorithm (the paper's; tests/test_tree.py runs it with `heapq`): a max-heap of
    candidates starts with the root's first child (rank 0 at depth 1); pop the best, make it a node,
    push its next sibling (same parent, rank + 1, if < K) and its first child (rank 0 at depth d + 1,
    if d + 1 <= D); stop after `budget` pops. Node order in the output = pop order; with the heap keyed
    on (-score, rank path) that is the order in this module's docstring.

    On device the same nodes are found by one top-k over every rank path that can make the cut, or,
    when there are too many of those, level by level with D sorts; never by `budget` sequential pops
    (see `_ddtree_one`). (Measured on an H200, D = 15, K = 8: 1.1 ms at budget 512 and 0.7 ms at
    budget 64, against 12.5 ms and 1.8 ms for a lax.fori_loop replaying the heap: each pop is a few
    tiny kernels. On CPU the loop is the faster of the two.)

    method: "auto" (the one top-k when the candidate set has at most STATIC_CANDIDATE_LIMIT paths, else the
    level search), "static" (the one top-k up to STATIC_CANDIDATE_MAX; ValueError above that: see
    `static_candidate_count`) or "levels". All three give the same tree; benchmarks and tests compare them.
    """
    batch, depth, topk = _check_draft(top_logprobs, top_tokens, root_token, start_pos)
    budget = _static_int(budget, "budget")
    if method not in DDTREE_METHODS:
        raise ValueError(f"method must be one of {DDTREE_METHODS}; got {method!r}")
    limit = max_ddtree_budget(depth, topk)
    if not 0 <= budget <= limit:
        raise ValueError(f"budget must be in [0, {limit}] (sum of K**d for d = 1..D, with D = {depth}, "
                         f"K = {topk}: the number of distinct prefixes); got {budget}")
    if budget == 0:
        return root_only_tree(root_token, start_pos, max_depth=depth)
    return _build_ddtree_jit(jnp.asarray(top_logprobs, jnp.float32), jnp.asarray(top_tokens, jnp.int32),
                             jnp.asarray(root_token, jnp.int32), jnp.asarray(start_pos, jnp.int32), budget,
                             method=method)


def _candidate_layout(num_keep: int, topk: int):
    """Which (parent slot j, rank r) pairs can make a level's best `num_keep` nodes, as numpy arrays.

    Parents are listed best first (slot j = j-th in the total order). Child (j, r) comes after every
    child (j', r') with j' <= j, r' <= r (a better-or-equal parent plus a better-or-equal rank gives a
    better-or-equal score, and equal scores fall back to the rank path, which also says "earlier").
    That is (j + 1)(r + 1) - 1 nodes of its own level ahead of it, so only pairs with
    (j + 1)(r + 1) <= num_keep can be in the best num_keep: about num_keep * ln(num_keep) pairs
    instead of num_keep * K.
    """
    parent_slot, rank = [], []
    for j in range(num_keep):
        width = min(topk, num_keep // (j + 1))
        parent_slot.extend([j] * width)
        rank.extend(range(width))
    return np.asarray(parent_slot, np.int32), np.asarray(rank, np.int32)


def _path_keys(paths, topk: int):
    """Rank paths [N, D] (-1 past the node's depth) as a few int32 sort keys, same lexicographic order.

    Each rank is stored as rank + 1 in [0, K] (so the -1 padding sorts first and a path comes before
    its extensions), packed big-endian, as many ranks per non-negative int32 as fit. Fewer keys make
    the sort's comparator (and its compile time) much smaller than one key per depth.
    """
    bits = topk.bit_length()
    per_word = 31 // bits
    keys = []
    for start in range(0, paths.shape[1], per_word):
        word = jnp.zeros(paths.shape[:1], jnp.int32)
        for d in range(start, min(start + per_word, paths.shape[1])):
            word = (word << bits) | (paths[:, d] + 1)
        keys.append(word)
    return tuple(keys)


def _sort_by_node_order(invalid, scores, paths, topk: int, *payload):
    """Sorts nodes into the module's total order (invalid ones last); returns the sorted payload."""
    keys = (invalid.astype(jnp.int32), -scores) + _path_keys(paths, topk)
    out = jax.lax.sort(keys + payload, num_keys=len(keys))
    return out[len(keys):]


# Above this many candidates the level-by-level search is used. With the one top-k (D = 15, K = 8, measured
# on the 2-core CPU at batch 1 / 50): the top-k wins 5x / 6x at 3,097 candidates (budget 32), 1.5x / 2.3x at
# 24,316 (budget 64) and ties at ~75,000 (budget 96). On an H200 (batch 1, per step): 45 vs 303 µs at 3,097
# and 68 vs 367 µs at 24,316 (results/tree_build_h200.md). (With a five-key sort in its place it had tied
# with the level search on an H200 at 3,097 and lost on the CPU from 948.)
STATIC_CANDIDATE_LIMIT = 32768
# method="static" (benchmarks, tests) forces the one top-k up to this many candidates.
STATIC_CANDIDATE_MAX = 131072
DDTREE_METHODS = ("auto", "static", "levels")


def static_candidate_count(budget: int, depth: int, topk: int, limit: int = STATIC_CANDIDATE_MAX) -> int | None:
    """How many rank paths can be among the best `budget` nodes of a D-deep, K-wide draft (the set
    `build_ddtree(..., method="static")` takes one top-k over), or None if more than `limit`."""
    candidates = _static_candidates(budget, depth, topk, limit)
    return None if candidates is None else int(candidates[0].shape[0])


@lru_cache(maxsize=64)
def _static_candidates(budget: int, depth: int, topk: int, limit: int):
    """Every rank path that can be among the best `budget` nodes whatever the log-probs, or None if
    there are more than `limit` of them.

    Node (r_1, ..., r_d) comes after each (r'_1, ..., r'_k) with k <= d and r'_i <= r_i (lower ranks and
    a prefix score at least as high, and an earlier rank path on a tie): that is
    sum_{k=1..d} prod_{i<=k} (r_i + 1) nodes counting itself, so it can be among the best `budget` only
    if that sum is <= budget. Returns numpy (paths [C, D] with -1 past the depth, depths [C], index of
    each candidate's parent among the candidates or -1 for depth 1); a parent is always a candidate.
    The paths are listed in depth-first preorder, ranks ascending: the tie order of the node order, which
    `_ddtree_one_static` relies on.
    """
    paths, depths, parents = [], [], []

    def extend(prefix, parent, prod, count):
        for r in range(topk):
            p = prod * (r + 1)
            if count + p > budget:
                break  # larger ranks only grow the count
            if len(paths) >= limit:
                raise OverflowError
            index = len(paths)
            path = prefix + (r,)
            paths.append(path + (-1,) * (depth - len(path)))
            depths.append(len(path))
            parents.append(parent)
            if len(path) < depth:
                extend(path, index, p, count + p)

    try:
        extend((), -1, 1, 0)
    except OverflowError:
        return None
    return np.asarray(paths, np.int32), np.asarray(depths, np.int32), np.asarray(parents, np.int32)


def _ddtree_one_static(top_logprobs, budget: int, candidates):
    """`_ddtree_one` by one top-k over a candidate set fixed by (budget, D, K) (see `_static_candidates`):
    every candidate's score, then the first `budget` in the node order. Scores add up the depths in the
    same order as the level search, so they are bit-identical to it."""
    paths, depths, parents = candidates
    depth, topk = top_logprobs.shape
    # One gather of every candidate's log-prob at every depth. (Fifteen per-depth gathers with constant
    # indices, vmapped, cost ~0.6 s per step inside the engine's while loop on XLA:CPU, against 0.3 ms
    # in a jit of their own.)
    per_depth = top_logprobs[np.arange(depth)[None, :], np.maximum(paths, 0)]  # [C, D]
    scores = jnp.zeros((paths.shape[0],), jnp.float32)
    for d in range(depth):
        has = paths[:, d] >= 0
        if not has.any():
            break
        scores = jnp.where(has, scores + per_depth[:, d], scores)
    # The candidates are listed in rank-path order (depth-first preorder, ranks ascending), so the node
    # order is "higher score first, then lower index": exactly lax.top_k's order, whose ties go to the
    # lower index. One top-k instead of a sort on five keys (a few kernels on a GPU instead of a
    # multi-pass sort of the whole set).
    _, chosen = jax.lax.top_k(scores, budget)
    node_depth = jnp.asarray(depths)[chosen]
    out_index = jnp.zeros((paths.shape[0],), jnp.int32).at[chosen].set(jnp.arange(1, budget + 1, dtype=jnp.int32))
    parent = jnp.asarray(parents)[chosen]
    node_parents = jnp.where(parent < 0, 0, out_index[jnp.maximum(parent, 0)])
    return node_depth, jnp.asarray(paths)[chosen], node_parents, scores[chosen]


def _ddtree_one(top_logprobs, budget: int, method: str = "auto"):
    """One sequence: the best `budget` nodes in order, as (depth, rank path, parent index, score).
    method "auto": one top-k over the static candidate set when it is small enough (each level of the search
    is a sort), else the level-by-level search; "static" / "levels" force one (same result)."""
    depth, topk = top_logprobs.shape
    if method != "levels":
        limit = STATIC_CANDIDATE_LIMIT if method == "auto" else STATIC_CANDIDATE_MAX
        candidates = _static_candidates(budget, depth, topk, limit)
        if candidates is not None:
            return _ddtree_one_static(top_logprobs, budget, candidates)
        if method == "static":
            raise ValueError(f"more than {limit} static candidates at budget {budget}, D = {depth}, K = {topk}")
    return _ddtree_one_levels(top_logprobs, budget)


def _ddtree_one_levels(top_logprobs, budget: int):
    """`_ddtree_one` level by level: the best `budget` nodes of depth d all have parents among the best `budget` nodes
    of depth d - 1 (a node's first child is never behind the first child of a node ahead of it), so
    each level keeps its best `budget` nodes (fewer valid ones if K**d < budget) and proposes children
    of those only. The answer is then the best `budget` of all kept nodes: the node order puts every
    node behind its ancestors, so those form a tree. D small sorts instead of `budget` heap pops.
    """
    depth, topk = top_logprobs.shape
    keep = budget
    cand_parent, cand_rank = _candidate_layout(keep, topk)

    def level(prev, xs):
        prev_scores, prev_paths, prev_valid = prev
        logprobs, d = xs
        scores = prev_scores[cand_parent] + logprobs[cand_rank]
        valid = prev_valid[cand_parent]
        paths = jnp.where(jnp.arange(depth)[None, :] == d, cand_rank[:, None], prev_paths[cand_parent])
        order = jnp.arange(cand_parent.shape[0], dtype=jnp.int32)
        (order,) = _sort_by_node_order(~valid, scores, paths, topk, order)
        order = order[:keep]
        kept = (scores[order], paths[order], valid[order])
        return kept, kept + (jnp.asarray(cand_parent)[order],)

    # Level 0 holds the root alone (slot 0); the other slots are invalid placeholders.
    root_level = (jnp.zeros((keep,), jnp.float32), jnp.full((keep, depth), -1, jnp.int32),
                  jnp.arange(keep) == 0)
    # Unrolled on accelerators: there a rolled scan is a device loop whose every level costs a host round
    # trip. Rolled on the CPU, where the unrolled body is slower (default pair, batch 1, budget 32:
    # 140 vs 199 tok/s).
    unroll = 1 if jax.default_backend() == "cpu" else True
    _, (scores, paths, valid, parent_slot) = jax.lax.scan(
        level, root_level, (top_logprobs, jnp.arange(depth)), unroll=unroll)  # each [D, keep, ...]

    # Merge the levels: flat index f = (depth - 1) * keep + slot.
    flat = jnp.arange(depth * keep, dtype=jnp.int32)
    (chosen,) = _sort_by_node_order(~valid.reshape(-1), scores.reshape(-1), paths.reshape(-1, depth), topk, flat)
    chosen = chosen[:budget]
    node_depth = chosen // keep + 1
    # Output index of each kept node (the root is 0, the i-th chosen node is i + 1).
    out_index = jnp.zeros((depth * keep,), jnp.int32).at[chosen].set(jnp.arange(1, budget + 1, dtype=jnp.int32))
    parent_flat = (node_depth - 2) * keep + parent_slot.reshape(-1)[chosen]
    parents = jnp.where(node_depth == 1, 0, out_index[jnp.maximum(parent_flat, 0)])
    return node_depth, paths.reshape(-1, depth)[chosen], parents, scores.reshape(-1)[chosen]


@partial(jax.jit, static_argnames=("budget", "method"))
def _build_ddtree_jit(top_logprobs, top_tokens, root_token, start_pos, budget: int, method: str = "auto") -> Tree:
    batch, depth, _ = top_logprobs.shape
    node_depth, paths, parents, scores = jax.vmap(partial(_ddtree_one, budget=budget, method=method))(top_logprobs)
    # A node's token: rank paths[depth - 1] at its own depth.
    own_rank = jnp.take_along_axis(paths, (node_depth - 1)[..., None], axis=2)[..., 0]
    tokens = top_tokens[jnp.arange(batch)[:, None], node_depth - 1, own_rank]

    def with_root(root_value, values):
        return jnp.concatenate([jnp.broadcast_to(root_value, (batch, 1)).astype(values.dtype), values], axis=1)

    return _finish(with_root(root_token[:, None], tokens), with_root(-1, parents), with_root(0, node_depth),
                   jnp.ones((batch, budget + 1), bool), with_root(0.0, scores), start_pos, depth)


# ----------------------------------------------------------------------------------------------------
# Chain (DFlash) and static shapes
# ----------------------------------------------------------------------------------------------------


def build_chain(top_tokens, top_logprobs, root_token, start_pos, depth: int | None = None) -> Tree:
    """DFlash: the drafter's top-1 token at each depth 1..depth, one chain of T = 1 + depth nodes.

    Note the argument order (tokens first, unlike `build_ddtree`). top_logprobs may be None (then
    scores are 0). depth defaults to D; it must be in [1, D]. The mask is the causal one.
    """
    batch, max_depth, _ = _check_draft(top_logprobs, top_tokens, root_token, start_pos, logprobs_required=False)
    depth = max_depth if depth is None else _static_int(depth, "depth")
    if not 1 <= depth <= max_depth:
        raise ValueError(f"depth must be in [1, D = {max_depth}]; got {depth}")
    top_tokens = jnp.asarray(top_tokens, jnp.int32)
    tokens = jnp.concatenate([jnp.asarray(root_token, jnp.int32)[:, None], top_tokens[:, :depth, 0]], axis=1)
    node = jnp.arange(depth + 1, dtype=jnp.int32)
    if top_logprobs is None:
        scores = jnp.zeros((batch, depth + 1), jnp.float32)
    else:
        steps = jnp.asarray(top_logprobs, jnp.float32)[:, :depth, 0]
        scores = jnp.concatenate([jnp.zeros((batch, 1), jnp.float32), jnp.cumsum(steps, axis=1)], axis=1)
    depths = jnp.broadcast_to(node, (batch, depth + 1))
    return Tree(tokens=tokens, parents=depths - 1, depths=depths,
                positions=jnp.asarray(start_pos, jnp.int32)[:, None] + depths,
                mask=causal_mask(batch, depth + 1), valid=jnp.ones((batch, depth + 1), bool),
                scores=scores, max_depth=max_depth)


def static_tree_structure(branching: tuple[int, ...]):
    """The node layout of a static shape, as numpy arrays (parents, depths, rank paths [T, L]).

    Level by level (breadth first), each level in rank-path (lexicographic) order; node i at depth d
    takes ranks 0..branching[d] - 1 at depth d + 1 for its children.
    """
    paths = [()]
    levels = [[()]]
    for width in branching:
        levels.append([p + (r,) for p in levels[-1] for r in range(width)])
        paths.extend(levels[-1])
    index = {p: i for i, p in enumerate(paths)}
    parents = np.asarray([-1] + [index[p[:-1]] for p in paths[1:]], np.int32)
    depths = np.asarray([len(p) for p in paths], np.int32)
    rank_paths = np.full((len(paths), max(len(branching), 1)), -1, np.int32)
    for i, p in enumerate(paths):
        rank_paths[i, :len(p)] = p
    return parents, depths, rank_paths


def build_static(top_logprobs, top_tokens, root_token, start_pos, branching: tuple[int, ...]) -> Tree:
    """A fixed tree shape (research): every node at depth d has branching[d] children, ranks 0..b-1.

    T = 1 + sum over levels of prod(branching[:l]). len(branching) <= D, 1 <= branching[d] <= K;
    an empty tuple gives the root-only tree.
    """
    batch, depth, topk = _check_draft(top_logprobs, top_tokens, root_token, start_pos)
    branching = tuple(_static_int(b, "branching entries") for b in branching)
    if len(branching) > depth:
        raise ValueError(f"branching must have at most D = {depth} entries; got {len(branching)}")
    if any(not 1 <= b <= topk for b in branching):
        raise ValueError(f"branching entries must be in [1, K = {topk}]; got {branching}")
    if not branching:
        return root_only_tree(root_token, start_pos, max_depth=depth)
    parents, depths, rank_paths = static_tree_structure(branching)
    num_nodes = parents.shape[0]

    top_logprobs = jnp.asarray(top_logprobs, jnp.float32)
    own_rank = np.maximum(rank_paths[np.arange(num_nodes), np.maximum(depths - 1, 0)], 0)
    tokens = jnp.asarray(top_tokens, jnp.int32)[:, np.maximum(depths - 1, 0), own_rank]
    tokens = tokens.at[:, 0].set(jnp.asarray(root_token, jnp.int32))
    scores = jnp.zeros((batch, num_nodes), jnp.float32)
    for d in range(len(branching)):  # accumulate in depth order, like the DDTree scores
        has = rank_paths[:, d] >= 0
        scores = scores + jnp.where(has, top_logprobs[:, d, np.maximum(rank_paths[:, d], 0)], 0.0)
    return _finish(tokens, jnp.broadcast_to(parents, (batch, num_nodes)), jnp.broadcast_to(depths, (batch, num_nodes)),
                   jnp.ones((batch, num_nodes), bool), scores, jnp.asarray(start_pos), depth)


__all__ = ["Tree", "PAD_TOKEN", "build_ddtree", "build_chain", "build_static", "root_only_tree", "pad_tree",
           "max_ddtree_budget", "static_candidate_count", "static_tree_structure"]
