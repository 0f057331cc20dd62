"""Per-row sampling settings and penalties (kdtree_jax/speculative/sampling.py) against independent references:
accept.filter_logits row by row, penalties written out in numpy, and a numpy walk over the tree that penalises each
node with the counts of its own path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.speculative import sampling
from kdtree_jax.speculative.accept import filter_logits
from kdtree_jax.speculative.sampling import RowSampling, SamplingParams

from test_accept import BATCH, VOCAB, check_against_walk, numpy_walk, random_tree

SETTINGS = [SamplingParams(),  # greedy
            SamplingParams(temperature=0.8, top_p=0.9),
            SamplingParams(temperature=1.3, top_k=3),
            SamplingParams(temperature=0.6, top_k=4, top_p=0.7),
            SamplingParams(temperature=1.0, top_k=1),
            SamplingParams(temperature=0.9, top_k=VOCAB + 5, top_p=0.5),
            SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.3),
            SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, top_p=0.95)]


def test_filter_rows_matches_filter_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(len(SETTINGS), 50)).astype(np.float32)
    logits[:, 10:14] = logits[:, 10:11]  # ties, at the top-k boundary for some rows
    logits[:, 3] = logits[:, 10] + 0.5
    got = np.asarray(jax.jit(sampling.filter_rows)(logits, RowSampling.of(SETTINGS)))
    for b, p in enumerate(SETTINGS):
        want = np.asarray(filter_logits(logits[b], p.temperature, min(p.top_k, 50), p.top_p))
        np.testing.assert_array_equal(np.isfinite(got[b]), np.isfinite(want), err_msg=str(p))
        np.testing.assert_allclose(got[b][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6, err_msg=str(p))


def test_filter_rows_finds_the_cutoffs_in_the_head_or_past_it():
    """A CPU looks for the rows' cutoffs among their HEAD best logits first and sorts the whole rows when some row's
    cutoff lies past them: either way the rows equal filter_logits, with cutoffs inside and past the head."""
    vocab = 4 * sampling.HEAD + 7
    rng = np.random.default_rng()
    peaked = rng.normal(size=vocab) * 4  # a top-p 0.95 nucleus well inside the head
    flat = rng.normal(size=vocab) * 0.05  # top-p 0.9 of a flat row reaches past the head
    cases = [(peaked, SamplingParams(temperature=0.7, top_p=0.95)),
             (peaked, SamplingParams(temperature=1.0, top_k=10, top_p=0.9)),
             (flat, SamplingParams(temperature=1.0, top_p=0.9)),
             (peaked, SamplingParams(temperature=1.0, top_k=sampling.HEAD + 20)),
             (flat, SamplingParams(temperature=0.0, top_p=0.5)),  # greedy: its settings never ask for the sort
             (flat, SamplingParams(temperature=1.0, top_k=5))]
    filter_jit = jax.jit(sampling.filter_rows, static_argnames="head")
    for batch, in_head in (([0, 1, 4, 5], True), ([0, 2], False), ([3, 1], False)):
        logits = np.stack([cases[i][0] for i in batch]).astype(np.float32)
        rows = RowSampling.of([cases[i][1] for i in batch])
        t = np.asarray(rows.temperature)
        scaled = logits / np.where(t > 0, t, 1.0)[:, None]
        k = np.where((rows.top_k > 0) & (rows.top_k < vocab), rows.top_k, vocab)[:, None]
        _, exact = sampling._filtered(jnp.asarray(scaled), jax.lax.top_k(jnp.asarray(scaled), sampling.HEAD)[0],
                                      jnp.asarray(k), jnp.asarray(rows.top_p)[:, None])
        assert bool(np.all(np.asarray(exact) | (np.asarray(rows.temperature) <= 0))) == in_head, batch
        for head in (True, False):
            got = np.asarray(filter_jit(logits, rows, head=head))
            for b, i in enumerate(batch):
                p = cases[i][1]
                want = np.asarray(filter_logits(logits[b], p.temperature, min(p.top_k, vocab), p.top_p))
                np.testing.assert_array_equal(np.isfinite(got[b]), np.isfinite(want), err_msg=f"{p} head={head}")
                np.testing.assert_allclose(got[b][np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6)


def numpy_penalize(logits, counts, p: SamplingParams):
    out = logits.astype(np.float64).copy()
    seen = counts > 0
    out[seen] = np.where(out[seen] > 0, out[seen] / p.repetition_penalty, out[seen] * p.repetition_penalty)
    return out - p.presence_penalty * seen - p.frequency_penalty * counts


def test_penalize_and_counts():
    rng = np.random.default_rng(1)
    tokens = rng.integers(-1, 20, size=(len(SETTINGS), 30))
    counts = np.asarray(sampling.count_tokens(tokens, 20))
    for b in range(len(SETTINGS)):
        np.testing.assert_array_equal(counts[b], np.bincount(tokens[b][tokens[b] >= 0], minlength=20))
    logits = rng.normal(size=(len(SETTINGS), 20)).astype(np.float32)
    got = np.asarray(sampling.penalize(logits, counts, RowSampling.of(SETTINGS)))
    for b, p in enumerate(SETTINGS):
        np.testing.assert_allclose(got[b], numpy_penalize(logits[b], counts[b], p), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0.0)


def node_tokens(tree, b, node):
    """The tokens from depth 1 down to `node`, by following parents in Python."""
    tokens, parents = np.asarray(tree.tokens[b]), np.asarray(tree.parents[b])
    out = []
    while node > 0:
        out.append(int(tokens[node]))
        node = int(parents[node])
    return out[::-1]


def test_path_tokens():
    tree = random_tree(np.random.default_rng(2))
    paths = np.asarray(sampling.path_tokens(tree))
    for b in range(BATCH):
        for node in range(tree.num_nodes):
            want = node_tokens(tree, b, node)
            assert sorted(t for t in paths[b, node] if t >= 0) == sorted(want)


@pytest.mark.parametrize("sampled", [False, True])
def test_accept_rows_penalises_each_node_by_its_own_path(sampled):
    """The walk at each node uses counts = committed + the node's path: checked against a numpy walk doing so."""
    rng = np.random.default_rng(3)
    tree = random_tree(rng)
    logits = rng.normal(size=tree.tokens.shape + (VOCAB,)).astype(np.float32) * 2
    committed = (rng.random((BATCH, VOCAB)) < 0.2).astype(np.int32)  # most tokens unseen: the path's count
    strong = [SamplingParams(temperature=0.8, repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=1.0),
              SamplingParams(temperature=0.5, top_p=0.8, presence_penalty=3.0),
              SamplingParams(temperature=0.0, frequency_penalty=2.0), SamplingParams(temperature=0.0)]
    params = [(SETTINGS + strong)[b % (len(SETTINGS) + len(strong))] for b in range(BATCH)]
    # Most rows penalised hard, so that a node's path tokens change which token it picks.
    params = [p if p.penalised or b % 4 == 0 else dataclasses_replace(p, presence_penalty=2.0, frequency_penalty=1.0)
              for b, p in enumerate(params)]
    if not sampled:
        params = [dataclasses_replace(p, temperature=0.0) for p in params]
    rows = RowSampling.of(params)
    keys = sampling.batch_keys(7, BATCH)
    acc = jax.jit(sampling.accept_rows, static_argnames="sampled")(tree, logits, keys, rows, committed,
                                                                   sampled=sampled)
    draw_row = jax.jit(lambda key, row, r: sampling.filter_rows(row[None], r)[0])

    def choice(b, node):
        counts = committed[b] + np.bincount(node_tokens(tree, b, node), minlength=VOCAB)
        row = numpy_penalize(logits[b, node], counts, params[b]).astype(np.float32)
        if params[b].temperature == 0:
            return int(np.argmax(row))
        filtered = draw_row(keys[b], row, rows.row(b))
        return int(jax.random.categorical(jax.random.fold_in(keys[b], node), filtered))

    check_against_walk(tree, acc, [numpy_walk(tree, b, lambda n, b=b: choice(b, n)) for b in range(BATCH)])
    assert int(np.asarray(acc.num_accepted).max()) >= 2, "walks must go below the root's children to test paths"
    if sampled:  # a greedy row in a sampled program takes the argmax, as it would alone
        greedy_rows = [b for b, p in enumerate(params) if p.temperature == 0]
        alone = sampling.accept_rows(tree, logits, keys, rows, committed, sampled=False)
        for b in greedy_rows:
            np.testing.assert_array_equal(np.asarray(acc.emitted[b]), np.asarray(alone.emitted[b]))


def dataclasses_replace(p, **kw):
    import dataclasses
    return dataclasses.replace(p, **kw)


def test_penalties_off_is_plain_acceptance():
    """No counts: the greedy rows are accept_greedy's walk."""
    from kdtree_jax.speculative.accept import accept_greedy
    rng = np.random.default_rng(4)
    tree = random_tree(rng)
    logits = rng.normal(size=tree.tokens.shape + (VOCAB,)).astype(np.float32)
    rows = RowSampling.of([SamplingParams()] * BATCH)
    got = sampling.accept_rows(tree, logits, sampling.batch_keys(0, BATCH), rows, None, sampled=True)
    np.testing.assert_array_equal(np.asarray(got.emitted), np.asarray(accept_greedy(tree, logits).emitted))
