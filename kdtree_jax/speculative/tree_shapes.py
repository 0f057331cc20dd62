"""Static tree shapes from measured acceptance: the DP-optimal shape (Sequoia-style) and the predictions
that go with it.

A static shape is a branching tuple (b_1, ..., b_L), L <= D: every node at depth d - 1 gets the drafter's
top-b_d tokens of depth d as children (`tree.build_static` builds it on device). The inputs here are the
*ranks* of the target's greedy token among the drafter's depth-d proposals, measured at many anchors of
teacher-forced text (benchmarks/tree_shapes.py measures them): ranks [..., D] int, 0 = the drafter's top-1.

  rank_probs                 ranks -> p[d][r] = P(rank at depth d == r)
  predicted_tau_independent  τ of a shape if the depths were independent (the DP's objective)
  optimal_shape              the shape that maximises it within a node budget (a DP)
  accepted_static / accepted_ddtree   accepted drafted tokens at every anchor, from the measured ranks
  tau_anchor_mean / tau_replay        τ predictions from those (no independence assumption)

τ counts tokens per target forward, the bonus included (1 + accepted drafted tokens).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from kdtree_jax.speculative import tree as trees


def shape_nodes(shape) -> int:
    """Non-root nodes of a static shape: sum over levels of prod(branching[:level])."""
    return int(sum(np.prod(shape[:i + 1]) for i in range(len(shape))))


def shape_str(shape) -> str:
    """(b_1,...,b_L) without spaces, as results tables print a shape."""
    return "(" + ",".join(str(b) for b in shape) + ")"


def rank_probs(ranks: np.ndarray, kmax: int) -> np.ndarray:
    """p[d][r] = P(rank at depth d == r), r < kmax; [D, kmax] (ranks [..., D], any leading dims)."""
    ranks = ranks.reshape(-1, ranks.shape[-1])
    return np.stack([(ranks == r).mean(0) for r in range(kmax)], axis=1)


def predicted_tau_independent(p: np.ndarray, shape) -> float:
    """1 + sum_d prod_{d' <= d} sum_{r < b_d'} p[d'][r] (depths independent)."""
    surv, total = 1.0, 0.0
    for d, b in enumerate(shape):
        surv *= float(p[d, :b].sum())
        total += surv
    return 1.0 + total


def optimal_shape(p: np.ndarray, budget: int, kmax: int) -> tuple[tuple, float]:
    """The static shape with the highest expected acceptance for a node budget, assuming independent depths.

    p [D, >= kmax]: p[d][r] = P(the target's token at depth d + 1 is the drafter's rank-r proposal | the path
    above it is right) (`rank_probs`). Returns (b_1..b_L) with L <= D and b_d <= kmax maximising
    sum_d prod_{d'<=d} S_d'(b_d') (S_d(b) = sum_{r<b} p[d][r]) subject to sum_d prod_{d'<=d} b_d' <= budget,
    and that expected number of accepted drafted tokens (τ - 1 under independence). A DP over (depth, nodes
    at the depth above, budget left); ties keep the smaller branching.
    """
    depth = p.shape[0]
    surv = np.cumsum(p[:, :kmax], axis=1)  # surv[d, b - 1] = S_d(b)

    @functools.lru_cache(maxsize=None)
    def best(d: int, width: int, left: int):
        """Best (value, tail) for depths d.. given `width` nodes at depth d - 1 and `left` nodes to spend."""
        if d == depth:
            return 0.0, ()
        value, tail = 0.0, ()
        for b in range(1, kmax + 1):
            nodes = width * b
            if nodes > left:
                break
            sub, sub_tail = best(d + 1, nodes, left - nodes)
            v = float(surv[d, b - 1]) * (1.0 + sub)
            if v > value + 1e-12:
                value, tail = v, (b,) + sub_tail
        return value, tail

    value, shape = best(0, 1, budget)
    best.cache_clear()
    return shape, value


def accepted_static(ranks: np.ndarray, shape) -> np.ndarray:
    """Accepted drafted tokens of a static shape at every anchor: the leading depths whose target token is
    among the drafter's top-b_d (ranks [..., D] -> [...])."""
    ok = np.ones(ranks.shape[:-1], bool)
    total = np.zeros(ranks.shape[:-1], np.int64)
    for d, b in enumerate(shape):
        ok &= ranks[..., d] < b
        total += ok
    return total


def accepted_ddtree(ranks: np.ndarray, top_lp: np.ndarray, budget: int, topk: int) -> np.ndarray:
    """Accepted drafted tokens of DDTree at every anchor: each anchor's tree is built (`tree.build_ddtree`)
    from the drafter's top-K log-probs there (top_lp [..., D, >= topk]; node tokens = ranks) and walked along
    the target's rank path (ranks [..., D] -> [...])."""
    lead = ranks.shape[:-1]
    ranks = ranks.reshape(-1, ranks.shape[-1])
    n, depth = ranks.shape
    top_lp = top_lp.reshape(n, depth, -1)[:, :, :topk]
    tree = trees.build_ddtree(jnp.asarray(top_lp), jnp.broadcast_to(jnp.arange(topk, dtype=jnp.int32), (n, depth, topk)),
                              jnp.zeros((n,), jnp.int32), jnp.zeros((n,), jnp.int32), budget)
    parents, tokens = np.asarray(tree.parents), np.asarray(tree.tokens)
    node = np.zeros(n, np.int64)
    alive = np.ones(n, bool)
    accepted = np.zeros(n, np.int64)
    for d in range(depth):
        match = (parents == node[:, None]) & (tokens == ranks[:, d][:, None])
        match[:, 0] = False
        alive &= match.any(1)
        node = np.where(alive, match.argmax(1), node)
        accepted += alive
    return accepted.reshape(lead)


def tau_anchor_mean(accepted: np.ndarray) -> float:
    """1 + mean accepted over all anchors (every position weighs the same)."""
    return 1.0 + float(np.mean(accepted))


def tau_replay(accepted: np.ndarray) -> float:
    """Replays greedy decoding over each measured sequence (accepted [n_seq, A]): a step at anchor c
    accepts accepted[c] tokens and the next step starts at c + accepted[c] + 1. Returns tokens / steps,
    the engine's τ on those sequences. Unlike the anchor mean, this samples anchors where decode steps
    really start: decoding strides through easy stretches in few steps, so they weigh less."""
    tokens = steps = 0
    for row in np.asarray(accepted).reshape(-1, np.shape(accepted)[-1]):
        c = 0
        while c < len(row):
            tokens += int(row[c]) + 1
            steps += 1
            c += int(row[c]) + 1
    return tokens / steps if steps else float("nan")


__all__ = ["shape_nodes", "shape_str", "rank_probs", "predicted_tau_independent", "optimal_shape", "accepted_static",
           "accepted_ddtree", "tau_anchor_mean", "tau_replay"]
