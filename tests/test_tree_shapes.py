"""The static-shape analysis (kdtree_jax.speculative.tree_shapes): the DP against brute force, the
predictions against each other and against hand-worked acceptance."""

import itertools

import numpy as np
import pytest

from kdtree_jax.speculative.tree_shapes import (accepted_ddtree, accepted_static, optimal_shape,
                                                predicted_tau_independent, rank_probs, shape_nodes, shape_str,
                                                tau_anchor_mean, tau_replay)


def _brute_force(p, budget, kmax):
    best = 0.0
    for length in range(1, p.shape[0] + 1):
        for shape in itertools.product(range(1, kmax + 1), repeat=length):
            if shape_nodes(shape) <= budget:
                best = max(best, predicted_tau_independent(p, shape) - 1)
    return best


def test_optimal_shape_is_the_brute_force_optimum():
    rng = np.random.default_rng(0)
    depth, kmax = 4, 3
    for trial in range(5):
        raw = np.sort(rng.dirichlet(np.ones(kmax + 1) * 0.7, size=depth)[:, :kmax], axis=1)[:, ::-1]
        for budget in (1, 3, 6, 12, 20):
            shape, value = optimal_shape(raw, budget, kmax)
            assert shape_nodes(shape) <= budget
            assert value == pytest.approx(predicted_tau_independent(raw, shape) - 1)
            assert value == pytest.approx(_brute_force(raw, budget, kmax))


def test_predictions_agree_for_independent_ranks():
    """With ranks drawn independently per depth, the joint prediction approaches the independent one."""
    rng = np.random.default_rng(1)
    p = np.array([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]])
    full = np.concatenate([p, 1 - p.sum(1, keepdims=True)], axis=1)
    ranks = np.stack([rng.choice(4, size=20000, p=full[d]) for d in range(3)], axis=1)
    assert np.allclose(rank_probs(ranks, 3), p, atol=0.02)
    for shape in [(1, 1, 1), (2, 1), (3, 2, 1)]:
        assert tau_anchor_mean(accepted_static(ranks, shape)) == pytest.approx(
            predicted_tau_independent(p, shape), abs=0.02)


def test_replay_and_ddtree_acceptance():
    # One sequence, D = 2: anchors accept 2, 0, 1, 0, 2 tokens with the chain (ranks 0 = drafter's top-1).
    ranks = np.array([[[0, 0], [1, 0], [0, 3], [2, 2], [0, 0]]])
    acc = accepted_static(ranks, (1, 1))
    assert acc.tolist() == [[2, 0, 1, 0, 2]]
    # Steps start at anchors 0 (accepts 2), 3 (accepts 0), 4 (accepts 2): 7 tokens in 3 steps.
    assert tau_replay(acc) == pytest.approx(7 / 3)
    assert tau_anchor_mean(acc) == pytest.approx(1 + 5 / 5)
    assert accepted_static(ranks, (2, 1)).tolist() == [[2, 2, 1, 0, 2]]
    # DDTree with every node affordable (budget = K + K^2) contains every rank path below K.
    top_lp = np.log(np.tile(np.array([0.5, 0.3, 0.2]), (1, 5, 2, 1)))
    assert accepted_ddtree(ranks, top_lp, budget=12, topk=3).tolist() == [[2, 2, 1, 2, 2]]
    # Budget 1: only the top-1 child of the root.
    assert accepted_ddtree(ranks, top_lp, budget=1, topk=3).tolist() == [[1, 0, 1, 0, 1]]


def test_shape_nodes_and_str():
    assert shape_nodes(()) == 0
    assert shape_nodes((4, 2, 1)) == 4 + 8 + 8
    assert shape_str((4, 2, 1)) == "(4,2,1)"
