"""Draft trees (kdtree_jax/speculative/tree.py) against independent plain-Python / numpy formulations.

The DDTree builder on device finds the nodes level by level with sorts; the reference here is the
paper's algorithm as written: a `heapq` best-first search, popping `budget` times.
"""

from __future__ import annotations

import heapq
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.ops.masks import ancestor_mask, unpack_mask_bits
from kdtree_jax.speculative.tree import (PAD_TOKEN, build_chain, build_ddtree, build_static, max_ddtree_budget, pad_tree,
                                  root_only_tree)

VOCAB = 1000


def random_draft(rng, batch, depth, topk):
    """Drafter-like outputs: per depth, K distinct tokens and sorted (descending) log-probs.

    Rows cycle through three flavours: continuous log-probs; log-probs rounded to multiples of 0.5
    (many exact ties, including ties between nodes of different depths); and rounded ones whose tail
    is -inf (tokens the drafter gives probability 0).
    """
    logprobs = np.log(rng.dirichlet(np.ones(4 * topk), size=(batch, depth)))
    logprobs = -np.sort(-logprobs, axis=-1)[..., :topk].astype(np.float32)
    logprobs[1::3] = np.round(logprobs[1::3] * 2) / 2
    logprobs[2::3] = np.round(logprobs[2::3] * 2) / 2
    logprobs[2::3, :, topk // 2 + 1:] = -np.inf
    tokens = np.stack([[rng.permutation(VOCAB)[:topk] for _ in range(depth)] for _ in range(batch)]).astype(np.int32)
    root = rng.integers(0, VOCAB, size=batch).astype(np.int32)
    start_pos = rng.integers(0, 10_000, size=batch).astype(np.int32)
    return logprobs, tokens, root, start_pos


def heapq_ddtree(logprobs, budget):
    """The best-first search, popping `budget` nodes. Returns [(rank path, parent index, score)] in pop order.

    The heap key (-score, rank path) is the documented tie break: higher score first, then the
    lexicographically smaller rank path (a path before its extensions). Scores accumulate in float32,
    root to leaf, like the device code.
    """
    depth, topk = logprobs.shape
    heap = [(-float(logprobs[0, 0]), (0,), 0, np.float32(logprobs[0, 0]))]  # the root's first child
    nodes = []
    while len(nodes) < budget:
        _, path, parent, score = heapq.heappop(heap)
        nodes.append((path, parent, score))
        index = len(nodes)  # node 0 is the root
        d, r = len(path), path[-1]
        if r + 1 < topk:  # next sibling: same parent, next rank
            parent_score = nodes[parent - 1][2] if parent > 0 else np.float32(0)
            sibling = np.float32(parent_score + logprobs[d - 1, r + 1])
            heapq.heappush(heap, (-float(sibling), path[:-1] + (r + 1,), parent, sibling))
        if d < depth:  # first child
            child = np.float32(score + logprobs[d, 0])
            heapq.heappush(heap, (-float(child), path + (0,), index, child))
    return nodes


def numpy_ancestors(parents):
    """bool [T, T]: [i, j] iff j is i or an ancestor of i, by walking parent pointers."""
    num_nodes = len(parents)
    visible = np.zeros((num_nodes, num_nodes), bool)
    for i in range(num_nodes):
        j = i
        while j >= 0:
            visible[i, j] = True
            j = parents[j]
    return visible


def check_tree_basics(tree, root, start_pos):
    """Structure every builder guarantees."""
    parents, depths = np.asarray(tree.parents), np.asarray(tree.depths)
    batch, num_nodes = parents.shape
    assert tree.tokens.dtype == jnp.int32 and tree.parents.dtype == jnp.int32 and tree.mask.dtype == jnp.uint32
    assert tree.mask.shape == (batch, num_nodes, (num_nodes + 31) // 32)
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 0]), root)
    np.testing.assert_array_equal(parents[:, 0], -1)
    assert (parents[:, 1:] < np.arange(1, num_nodes)).all() and (parents[:, 1:] >= 0).all()  # parents first
    np.testing.assert_array_equal(depths[:, 0], 0)
    np.testing.assert_array_equal(depths[:, 1:], np.take_along_axis(depths, parents[:, 1:], axis=1) + 1)
    np.testing.assert_array_equal(np.asarray(tree.positions), start_pos[:, None] + depths)
    assert depths.max() <= tree.max_depth
    visible = np.asarray(unpack_mask_bits(tree.mask, num_nodes))
    for b in range(batch):
        np.testing.assert_array_equal(visible[b], numpy_ancestors(parents[b]))


# (B, D, K, budget): budget 1; budgets on the K**d boundaries (K, K + K**2, all nodes); the general case;
# D > budget; a large one. B = 6 gives two rows of each random_draft flavour.
DDTREE_CASES = [
    (6, 4, 3, 1),
    (6, 4, 3, 3),
    (6, 4, 3, 12),
    (6, 3, 2, 14),
    (6, 5, 4, 40),
    (6, 9, 2, 5),
    (6, 10, 6, 300),
]


@pytest.mark.parametrize("batch,depth,topk,budget", DDTREE_CASES)
def test_ddtree_matches_heapq(batch, depth, topk, budget):
    rng = np.random.default_rng(budget * 1000 + depth * 10 + topk)
    logprobs, tokens, root, start_pos = random_draft(rng, batch, depth, topk)
    tree = build_ddtree(logprobs, tokens, root, start_pos, budget)
    assert tree.num_nodes == budget + 1 and tree.max_depth == depth
    check_tree_basics(tree, root, start_pos)
    assert np.asarray(tree.valid).all()
    for b in range(batch):
        nodes = heapq_ddtree(logprobs[b], budget)
        np.testing.assert_array_equal(np.asarray(tree.parents[b, 1:]), [parent for _, parent, _ in nodes])
        np.testing.assert_array_equal(np.asarray(tree.depths[b, 1:]), [len(path) for path, _, _ in nodes])
        np.testing.assert_array_equal(np.asarray(tree.tokens[b, 1:]),
                                      [tokens[b, len(path) - 1, path[-1]] for path, _, _ in nodes])
        np.testing.assert_array_equal(np.asarray(tree.scores[b]), [0.0] + [score for _, _, score in nodes])


@pytest.mark.parametrize("batch,depth,topk,budget", [c for c in DDTREE_CASES if max_ddtree_budget(c[1], c[2]) <= 400])
def test_ddtree_is_the_best_prefixes(batch, depth, topk, budget):
    """Independent of any search: the nodes are the first `budget` of all prefixes in the documented order."""
    rng = np.random.default_rng(7 + budget)
    logprobs, tokens, root, start_pos = random_draft(rng, batch, depth, topk)
    tree = build_ddtree(logprobs, tokens, root, start_pos, budget)
    for b in range(batch):
        prefixes = []
        for d in range(1, depth + 1):
            for path in itertools.product(range(topk), repeat=d):
                score = np.float32(0)
                for level, rank in enumerate(path):
                    score = np.float32(score + logprobs[b, level, rank])
                prefixes.append((-float(score), path))
        best = sorted(prefixes)[:budget]
        got_tokens = np.asarray(tree.tokens[b, 1:])
        np.testing.assert_array_equal(got_tokens, [tokens[b, len(path) - 1, path[-1]] for _, path in best])
        np.testing.assert_array_equal(np.asarray(tree.scores[b, 1:]), [-s for s, _ in best])


def test_ddtree_budget_zero_and_inside_jit():
    rng = np.random.default_rng(3)
    logprobs, tokens, root, start_pos = random_draft(rng, 6, 9, 2)  # a DDTREE_CASES shape: compiled already
    tree = build_ddtree(logprobs, tokens, root, start_pos, 0)
    assert tree.num_nodes == 1 and tree.max_depth == 9
    check_tree_basics(tree, root, start_pos)
    np.testing.assert_array_equal(np.asarray(tree.mask[:, 0, 0]), 1)

    # Called inside a caller's jit: checks only look at shapes, results are the same.
    jitted = jax.jit(lambda *args: build_ddtree(*args, budget=5))(logprobs, tokens, root, start_pos)
    eager = build_ddtree(logprobs, tokens, root, start_pos, 5)
    for name in ("tokens", "parents", "depths", "positions", "mask", "valid", "scores"):
        np.testing.assert_array_equal(np.asarray(getattr(jitted, name)), np.asarray(getattr(eager, name)))


def test_chain():
    rng = np.random.default_rng(4)
    logprobs, tokens, root, start_pos = random_draft(rng, 3, 5, 4)
    for depth in (None, 2):
        tree = build_chain(tokens, logprobs, root, start_pos, depth)
        length = 5 if depth is None else depth
        assert tree.num_nodes == length + 1 and tree.max_depth == 5
        check_tree_basics(tree, root, start_pos)
        np.testing.assert_array_equal(np.asarray(tree.parents), np.broadcast_to(np.arange(-1, length), (3, length + 1)))
        np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1:]), tokens[:, :length, 0])
        np.testing.assert_allclose(np.asarray(tree.scores[:, 1:]), np.cumsum(logprobs[:, :length, 0], axis=1), rtol=1e-6)
    no_scores = build_chain(tokens, None, root, start_pos)
    np.testing.assert_array_equal(np.asarray(no_scores.scores), 0.0)


def test_static_shape():
    rng = np.random.default_rng(5)
    logprobs, tokens, root, start_pos = random_draft(rng, 3, 4, 3)
    logprobs[2] = np.maximum(logprobs[2], -50.0)  # finite scores, to compare sums
    branching = (3, 2, 1)
    tree = build_static(logprobs, tokens, root, start_pos, branching)
    assert tree.num_nodes == 1 + 3 + 6 + 6 and tree.max_depth == 4
    check_tree_basics(tree, root, start_pos)
    parents, depths, toks = (np.asarray(x) for x in (tree.parents, tree.depths, tree.tokens))
    for b in range(3):
        # Each node at depth d has branching[d] children, carrying ranks 0..branching[d]-1 of depth d + 1.
        rank_of = {0: ()}
        for i in range(1, tree.num_nodes):
            siblings = [j for j in range(1, i) if parents[b, j] == parents[b, i]]
            rank_of[i] = rank_of[parents[b, i]] + (len(siblings),)
            d = depths[b, i]
            assert toks[b, i] == tokens[b, d - 1, rank_of[i][-1]]
            np.testing.assert_allclose(tree.scores[b, i], sum(logprobs[b, k, r] for k, r in enumerate(rank_of[i])),
                                       rtol=1e-5)
        for i in range(tree.num_nodes):
            children = (parents[b] == i).sum()
            assert children == (branching[depths[b, i]] if depths[b, i] < len(branching) else 0)
    assert build_static(logprobs, tokens, root, start_pos, ()).num_nodes == 1


def test_pad_tree():
    rng = np.random.default_rng(6)
    logprobs, tokens, root, start_pos = random_draft(rng, 2, 3, 2)
    tree = pad_tree(build_ddtree(logprobs, tokens, root, start_pos, 4), 40)  # T 5 -> 40, two mask words
    assert tree.num_nodes == 40 and tree.mask.shape == (2, 40, 2)
    check_tree_basics(tree, root, start_pos)
    np.testing.assert_array_equal(np.asarray(tree.valid[:, :5]), True)
    np.testing.assert_array_equal(np.asarray(tree.valid[:, 5:]), False)
    np.testing.assert_array_equal(np.asarray(tree.tokens[:, 5:]), PAD_TOKEN)
    np.testing.assert_array_equal(np.asarray(tree.parents[:, 5:]), 0)
    assert (np.asarray(tree.scores[:, 5:]) == -np.inf).all()


def test_ancestor_mask_forests():
    """ops/masks.ancestor_mask on random parent arrays (also nodes with parent -1: roots of a forest)."""
    rng = np.random.default_rng(8)
    for num_nodes in (1, 33, 100):  # one node; a part-filled second word; four words
        parents = np.array([[-1] + [int(rng.integers(-1, i)) for i in range(1, num_nodes)] for _ in range(3)], np.int32)
        parents[0, 1:] = np.arange(num_nodes - 1)  # one long chain
        visible = np.asarray(unpack_mask_bits(ancestor_mask(jnp.asarray(parents)), num_nodes))
        for b in range(3):
            np.testing.assert_array_equal(visible[b], numpy_ancestors(parents[b]))


def test_validation_errors():
    rng = np.random.default_rng(9)
    logprobs, tokens, root, start_pos = random_draft(rng, 2, 3, 2)
    with pytest.raises(ValueError, match=r"budget must be in \[0, 14\]"):
        build_ddtree(logprobs, tokens, root, start_pos, 15)
    with pytest.raises(ValueError, match="budget"):
        build_ddtree(logprobs, tokens, root, start_pos, -1)
    with pytest.raises(ValueError, match="budget"):
        build_ddtree(logprobs, tokens, root, start_pos, 2.0)
    with pytest.raises(ValueError, match="K"):
        build_ddtree(logprobs[:, :, :0], tokens[:, :, :0], root, start_pos, 1)
    with pytest.raises(ValueError, match="block_size"):
        build_ddtree(logprobs[:, :0], tokens[:, :0], root, start_pos, 1)
    with pytest.raises(ValueError, match="top_logprobs"):
        build_ddtree(logprobs[:, :, :1], tokens, root, start_pos, 1)
    with pytest.raises(ValueError, match="swapped"):
        build_ddtree(tokens, logprobs, root, start_pos, 1)
    with pytest.raises(ValueError, match="root_token"):
        build_ddtree(logprobs, tokens, root[:1], start_pos, 1)
    with pytest.raises(ValueError, match="start_pos"):
        build_ddtree(logprobs, tokens, root, start_pos[:, None], 1)
    with pytest.raises(ValueError, match="branching entries"):
        build_static(logprobs, tokens, root, start_pos, (2, 0))
    with pytest.raises(ValueError, match="branching entries"):
        build_static(logprobs, tokens, root, start_pos, (3,))
    with pytest.raises(ValueError, match="branching must have at most"):
        build_static(logprobs, tokens, root, start_pos, (1, 1, 1, 1))
    with pytest.raises(ValueError, match="depth"):
        build_chain(tokens, logprobs, root, start_pos, 4)
    with pytest.raises(ValueError, match="depth"):
        build_chain(tokens, logprobs, root, start_pos, 0)
    with pytest.raises(ValueError, match="swapped"):
        build_chain(logprobs, tokens, root, start_pos)
    with pytest.raises(ValueError, match="num_nodes"):
        pad_tree(root_only_tree(root, start_pos), 0)


@pytest.mark.parametrize("topk,budget", [(4, 16), (4, 32), (8, 32), (8, 64)])
def test_ddtree_static_candidates_equal_level_search(topk, budget):
    """The engine's geometry (D = 15): the one top-k over the static candidate set (ties to the lower index)
    and the level-by-level search give bit-identical trees, whichever STATIC_CANDIDATE_LIMIT picks."""
    from kdtree_jax.speculative.tree import static_candidate_count

    count = static_candidate_count(budget, 15, topk)
    assert budget <= count <= max_ddtree_budget(15, topk)
    assert static_candidate_count(budget, 15, topk, limit=count - 1) is None
    draft = random_draft(np.random.default_rng(budget + topk), 6, 15, topk)
    one_sort = build_ddtree(*draft, budget, method="static")
    levels = build_ddtree(*draft, budget, method="levels")
    with pytest.raises(ValueError, match="method"):
        build_ddtree(*draft, budget, method="heap")
    for a, b in zip(jax.tree.leaves(one_sort), jax.tree.leaves(levels)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
