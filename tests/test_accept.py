"""Acceptance (kdtree_jax/speculative/accept.py): greedy walk vs a numpy walk, lossless sampling, filtering."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from kdtree_jax.speculative.accept import _per_sequence_keys, accept_greedy, accept_sampled, filter_logits
from kdtree_jax.speculative.tree import build_chain, build_ddtree, build_static, pad_tree

BATCH, DEPTH, TOPK, BUDGET, VOCAB = 16, 4, 3, 10, 6


def random_tree(rng, kind="ddtree", batch=BATCH):
    """A drafted tree over a small vocabulary (so that the target often agrees with some child)."""
    logprobs = -np.sort(rng.exponential(size=(batch, DEPTH, TOPK)), axis=-1).astype(np.float32)
    tokens = np.argsort(rng.random((batch, DEPTH, VOCAB)), axis=-1)[..., :TOPK].astype(np.int32)
    root = rng.integers(0, VOCAB, size=batch).astype(np.int32)
    start_pos = rng.integers(0, 100, size=batch).astype(np.int32)
    if kind == "ddtree":
        return build_ddtree(logprobs, tokens, root, start_pos, BUDGET)
    if kind == "padded":
        # Padding nodes hang off the root. Give them every token id (instead of -1), so that only their
        # valid = False keeps the walk out of them.
        tree = pad_tree(build_ddtree(logprobs, tokens, root, start_pos, BUDGET), BUDGET + 1 + VOCAB)
        return tree.replace(tokens=tree.tokens.at[:, BUDGET + 1:].set(jnp.arange(VOCAB, dtype=jnp.int32)))
    if kind == "chain":
        return build_chain(tokens, logprobs, root, start_pos)
    return build_static(logprobs, tokens, root, start_pos, (2, 2, 1))


def numpy_walk(tree, b, choice):
    """Greedy/sampled walk in plain Python. choice(node) -> the target's token there."""
    tokens, parents, valid = (np.asarray(x[b]) for x in (tree.tokens, tree.parents, tree.valid))
    node, path, emitted = 0, [0], []
    while True:
        token = choice(node)
        emitted.append(token)
        children = [i for i in range(len(tokens)) if parents[i] == node and valid[i] and tokens[i] == token]
        if not children:
            return path, emitted
        node = children[0]
        path.append(node)


def check_against_walk(tree, acc, walks):
    width = tree.max_depth + 1
    for b, (path, emitted) in enumerate(walks):
        assert int(acc.num_accepted[b]) == len(path) - 1
        assert int(acc.num_emitted[b]) == len(emitted)
        assert int(acc.bonus[b]) == emitted[-1]
        assert int(acc.last_node[b]) == path[-1]
        np.testing.assert_array_equal(np.asarray(acc.path[b]), path + [-1] * (width - len(path)))
        np.testing.assert_array_equal(np.asarray(acc.emitted[b]), emitted + [-1] * (width - len(emitted)))


greedy = jax.jit(accept_greedy)


@pytest.mark.parametrize("kind", ["ddtree", "padded", "chain", "static"])
def test_greedy_matches_numpy_walk(kind):
    rng = np.random.default_rng(["ddtree", "padded", "chain", "static"].index(kind))
    tree = random_tree(rng, kind)
    logits = rng.normal(size=tree.tokens.shape + (VOCAB,)).astype(np.float32)
    acc = greedy(tree, logits)
    assert acc.path.shape == (BATCH, DEPTH + 1) and acc.emitted.shape == (BATCH, DEPTH + 1)
    check_against_walk(tree, acc, [numpy_walk(tree, b, lambda n: int(np.argmax(logits[b, n]))) for b in range(BATCH)])
    assert 0 < float(np.mean(acc.num_accepted)) < DEPTH  # the walk goes somewhere, and not always all the way


def oracle_logits(rng, tree, targets, boost=50.0):
    """Logits whose argmax follows the branch from the root to targets[b], then leaves the tree."""
    tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
    logits = rng.normal(size=tokens.shape + (VOCAB,)).astype(np.float32)
    for b, target in enumerate(targets):
        node = target
        children = set(tokens[b][parents[b] == node].tolist())
        off_tree = [t for t in range(VOCAB) if t not in children][0]
        logits[b, node, off_tree] += boost
        while node > 0:  # the parent's argmax is this node's token
            logits[b, parents[b, node], tokens[b, node]] += boost
            node = parents[b, node]
    return logits


def test_greedy_oracle_and_always_wrong():
    rng = np.random.default_rng(10)
    tree = random_tree(rng)
    depths, tokens = np.asarray(tree.depths), np.asarray(tree.tokens)
    targets = rng.integers(0, BUDGET + 1, size=BATCH)
    targets[0] = int(np.argmax(depths[0]))  # the deepest node
    acc = greedy(tree, oracle_logits(rng, tree, targets))
    for b, target in enumerate(targets):
        assert int(acc.num_accepted[b]) == depths[b, target]
        assert int(acc.last_node[b]) == target
        branch = [target]
        while branch[-1] > 0:
            branch.append(int(tree.parents[b, branch[-1]]))
        branch = branch[::-1]
        np.testing.assert_array_equal(np.asarray(acc.path[b, :len(branch)]), branch)
        np.testing.assert_array_equal(np.asarray(acc.emitted[b, :len(branch) - 1]), tokens[b, branch[1:]])

    # Always wrong: the target's choice at the root is never one of the root's children.
    acc = greedy(tree, oracle_logits(rng, tree, np.zeros(BATCH, int)))
    np.testing.assert_array_equal(np.asarray(acc.num_accepted), 0)
    np.testing.assert_array_equal(np.asarray(acc.num_emitted), 1)
    np.testing.assert_array_equal(np.asarray(acc.emitted[:, 0]), np.asarray(acc.bonus))
    np.testing.assert_array_equal(np.asarray(acc.emitted[:, 1:]), -1)
    for b in range(BATCH):
        assert int(acc.bonus[b]) not in tokens[b][np.asarray(tree.parents[b]) == 0]


sampled = jax.jit(accept_sampled, static_argnames=("top_k",))


def test_sampled_walk_and_keys():
    rng = np.random.default_rng(11)
    tree = random_tree(rng)
    logits = rng.normal(size=tree.tokens.shape + (VOCAB,)).astype(np.float32)
    key = jax.random.key(0)
    config = dict(temperature=0.9, top_k=4, top_p=0.9)  # one static config: one compile per key form

    # The walk follows the sampled tokens: redo it in numpy with the same draws (fold_in(key_b, node)).
    acc = sampled(tree, logits, key, **config)
    seq_keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(BATCH))
    draw_row = jax.jit(lambda key, row: jax.random.categorical(key, filter_logits(row, 0.9, 4, 0.9)))

    def draw(b, node):
        return int(draw_row(jax.random.fold_in(seq_keys[b], node), logits[b, node]))

    check_against_walk(tree, acc, [numpy_walk(tree, b, partial(draw, b)) for b in range(BATCH)])

    # A batch of keys: a sequence's draws don't depend on the rest of the batch.
    same = sampled(tree, logits, seq_keys, **config)
    np.testing.assert_array_equal(np.asarray(same.emitted), np.asarray(acc.emitted))
    rows = np.array([3, 7])
    alone = sampled(jax.tree.map(lambda x: x[rows], tree), logits[rows], seq_keys[rows], **config)
    np.testing.assert_array_equal(np.asarray(alone.emitted), np.asarray(acc.emitted)[rows])
    raw_keys = _per_sequence_keys(jax.random.key_data(key), BATCH)  # raw uint32 keys work the same way
    np.testing.assert_array_equal(np.asarray(raw_keys), np.asarray(jax.random.key_data(seq_keys)))

    # Temperature 0 is greedy, static (accept_greedy) or traced (argmax-only filtering).
    want = greedy(tree, logits)
    for got in (accept_sampled(tree, logits, key, temperature=0), sampled(tree, logits, key, **{**config, "temperature": 0.0})):
        np.testing.assert_array_equal(np.asarray(got.emitted), np.asarray(want.emitted))
    # A near-deterministic target is followed down its branch.
    targets = rng.integers(0, BUDGET + 1, size=BATCH)
    got = sampled(tree, oracle_logits(rng, tree, targets, boost=1e4), key, **config)
    np.testing.assert_array_equal(np.asarray(got.last_node), targets)


# ----------------------------------------------------------------------------------------------------
# Losslessness: the emitted tokens are exact samples of the target
# ----------------------------------------------------------------------------------------------------

MARKOV_VOCAB, MARKOV_START = 5, 2
LOSSLESS_SEQS, LOSSLESS_STEPS = 20_000, 3


def numpy_filter(logits, temperature, top_k, top_p):
    """Independent filter in float64: probabilities of the sampling distribution."""
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < len(x):
        x = np.where(x >= np.sort(x)[::-1][top_k - 1], x, -np.inf)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    cutoff = probs[order][before < top_p].min()
    probs = np.where(probs >= cutoff, probs, 0.0)
    return probs / probs.sum()


@partial(jax.jit, static_argnames=("top_k",))
def markov_speculative_decode(table, key, temperature, top_p, top_k):
    """LOSSLESS_STEPS speculative steps on a Markov target (logits at a node = table[node's token]).

    Each step drafts a DDTree from the last bonus token with a drafter that knows the target only
    roughly, like a real one: depth d's top-K come from a noisy copy of the target's table, conditioned
    on its own top-1 guess at depth d - 1. (A draft independent of the target would hide bugs: averaged
    over uniformly random trees, even a wrong acceptance rule can come out unbiased.) Returns all
    emitted tokens [B, steps * (D + 1)] (-1 padded) and the numbers of accepted nodes [B, steps].
    """

    def draft(root, draft_key):
        guess, tokens, logprobs = root, [], []
        for d in range(DEPTH):
            noise = jax.random.normal(jax.random.fold_in(draft_key, d), (LOSSLESS_SEQS, MARKOV_VOCAB))
            top_logprobs, top_tokens = jax.lax.top_k(jax.nn.log_softmax(table[guess] + noise), TOPK)
            tokens.append(top_tokens)
            logprobs.append(top_logprobs)
            guess = top_tokens[:, 0]
        return jnp.stack(logprobs, axis=1), jnp.stack(tokens, axis=1)

    def step(root, step_key):
        draft_key, accept_key = jax.random.split(step_key)
        logprobs, tokens = draft(root, draft_key)
        tree = build_ddtree(logprobs, tokens, root, jnp.zeros_like(root), BUDGET)
        acc = accept_sampled(tree, table[tree.tokens], accept_key, temperature=temperature, top_k=top_k, top_p=top_p)
        return acc.bonus, (acc.emitted, acc.num_accepted)

    root = jnp.full((LOSSLESS_SEQS,), MARKOV_START, jnp.int32)
    _, (emitted, accepted) = jax.lax.scan(step, root, jax.random.split(key, LOSSLESS_STEPS))
    return jnp.concatenate(list(emitted), axis=1), accepted.T


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 3, 0.8), (1.5, 0, 0.6)])
def test_sampled_acceptance_is_lossless(temperature, top_k, top_p):
    """The first 3 emitted tokens, over 20k seeds, follow the target's Markov chain exactly (chi-square)."""
    rng = np.random.default_rng(12)
    table = rng.normal(size=(MARKOV_VOCAB, MARKOV_VOCAB)).astype(np.float32)
    emitted, accepted = markov_speculative_decode(jnp.asarray(table), jax.random.key(13), temperature, top_p, top_k)
    emitted, accepted = np.asarray(emitted), np.asarray(accepted)
    assert accepted.mean() > 0.8  # the tree walk is exercised (about one accepted node per step), not just the bonus

    # First 3 emitted tokens of each sequence (every step emits at least one).
    order = np.argsort(emitted < 0, axis=1, kind="stable")
    first3 = np.take_along_axis(emitted, order[:, :3], axis=1)
    assert (first3 >= 0).all()
    observed = np.bincount(np.ravel_multi_index(first3.T, (MARKOV_VOCAB,) * 3), minlength=MARKOV_VOCAB ** 3)

    q = np.stack([numpy_filter(table[prev], temperature, top_k, top_p) for prev in range(MARKOV_VOCAB)])
    exact = np.einsum("a,ab,bc->abc", q[MARKOV_START], q, q).ravel()  # P(x1, x2, x3 | x0 = start)
    expected = exact * LOSSLESS_SEQS
    assert observed[expected == 0].sum() == 0  # filtered-out continuations never appear
    # Chi-square over the cells expecting >= 5, the rest pooled into one cell.
    big = expected >= 5
    obs = np.append(observed[big], observed[~big & (expected > 0)].sum())
    exp = np.append(expected[big], expected[~big & (expected > 0)].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    p_value = stats.chisquare(obs, exp).pvalue
    print(f"chi-square p = {p_value:.3g} over {len(obs)} cells; mean accepted {accepted.mean():.2f}")
    assert p_value > 1e-3, (p_value, len(obs))


# ----------------------------------------------------------------------------------------------------
# Filtering
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 7, 1.0), (1.3, 0, 0.7), (0.8, 10, 0.5),
                                                     (2.0, 50, 0.95), (1.0, 1, 0.3)])
def test_filter_logits_matches_numpy(temperature, top_k, top_p):
    rng = np.random.default_rng(14)
    logits = rng.normal(size=(32, 40)).astype(np.float32) * 3
    got = np.asarray(filter_logits(logits, temperature, top_k, top_p))
    traced = np.asarray(jax.jit(filter_logits, static_argnums=2)(logits, jnp.float32(temperature), top_k,
                                                                 jnp.float32(top_p)))
    np.testing.assert_array_equal(traced == -np.inf, got == -np.inf)
    for row, out in zip(logits, got):
        want = numpy_filter(row, temperature, top_k, top_p)
        np.testing.assert_array_equal(out == -np.inf, want == 0)
        if top_k:
            assert (out > -np.inf).sum() <= top_k
        probs = np.exp(out - out.max())
        np.testing.assert_allclose(probs / probs.sum(), want, rtol=1e-5, atol=1e-7)


def test_filter_logits_edge_cases():
    logits = np.array([[1.0, 3.0, 3.0, -2.0, 0.5]], np.float32)
    np.testing.assert_array_equal(np.asarray(filter_logits(logits, 0.0)), [[-np.inf, 0.0, -np.inf, -np.inf, -np.inf]])
    # Ties at the top-k boundary stay.
    np.testing.assert_array_equal(np.asarray(filter_logits(logits, 1.0, top_k=1)) > -np.inf, [[0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(np.asarray(filter_logits(logits, 1.0, top_k=9)), logits)  # k >= V: off
    # The best token always stays, even for a tiny top_p.
    assert (np.asarray(filter_logits(logits, 1.0, top_p=1e-6)) > -np.inf).sum() == 2
    for kwargs, name in (({"temperature": -1.0}, "temperature"), ({"temperature": 1.0, "top_k": -1}, "top_k"),
                         ({"temperature": 1.0, "top_p": 0.0}, "top_p"), ({"temperature": 1.0, "top_p": 1.5}, "top_p")):
        with pytest.raises(ValueError, match=name):
            filter_logits(logits, **kwargs)
    with pytest.raises(ValueError, match="target_logits"):
        accept_greedy(random_tree(np.random.default_rng(0), batch=2), np.zeros((2, 3, VOCAB), np.float32))


def test_a_root_only_walk_is_the_loops_first_pick():
    """A depth-0 tree (an autoregressive step) skips the walk's loop: its Acceptance is what the loop gives the same
    root with room for deeper nodes (max_depth 3), which stops after the root's pick."""
    from kdtree_jax.speculative.accept import walk
    from kdtree_jax.speculative.tree import root_only_tree
    logits = jax.random.normal(jax.random.key(3), (4, 1, 50))
    keys = jax.random.split(jax.random.key(4), 4)

    def choose(node):
        row = jnp.take_along_axis(logits, node[:, None, None], axis=1)[:, 0]
        return jax.vmap(jax.random.categorical)(jax.vmap(jax.random.fold_in)(keys, node), row).astype(jnp.int32)

    roots, starts = jnp.array([5, 6, 7, 8]), jnp.array([3, 9, 1, 4])
    fast = walk(root_only_tree(roots, starts, max_depth=0), choose)
    loop = walk(root_only_tree(roots, starts, max_depth=3), choose)
    for name in ("num_accepted", "bonus", "num_emitted", "last_node"):
        np.testing.assert_array_equal(np.asarray(getattr(fast, name)), np.asarray(getattr(loop, name)), err_msg=name)
    np.testing.assert_array_equal(np.asarray(fast.path), np.asarray(loop.path)[:, :1])
    np.testing.assert_array_equal(np.asarray(fast.emitted), np.asarray(loop.emitted)[:, :1])
    assert fast.emitted.dtype == loop.emitted.dtype == jnp.int32
