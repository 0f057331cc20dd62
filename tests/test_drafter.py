"""The block drafter: cached context == recomputed context, it really reads the context, and its attention equals a
float64 formulation."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import kdtree_jax
from kdtree_jax.model.drafter import DrafterConfig, init_drafter, rope_tables
from kdtree_jax.model.layers import apply_rope

TINY = kdtree_jax.ModelConfig.preset("tiny")

# The drafter's two calls, jitted as the engine runs them (eagerly, each call compiles every one of its operations
# on its own: ~350 small programs for this file); the modules are arguments, not closed over.
extend_context = jax.jit(lambda drafter, cache, feats, lens: drafter.extend_context(cache, feats, lens))
propose = jax.jit(lambda drafter, target, cache, bonus, start: drafter(target, cache, bonus, start))


@pytest.fixture(scope="module")
def pair():
    target = kdtree_jax.init_model(TINY, seed=1)
    drafter = init_drafter(TINY, DrafterConfig(block_size=6, num_layers=2, target_layer_ids=(0, 2)), seed=2)
    return target, drafter


def _features(rng, n_layers, batch, length):
    return jnp.asarray(rng.standard_normal((n_layers, batch, length, TINY.hidden_size)).astype(np.float32))


def test_context_extended_in_pieces_equals_all_at_once(pair):
    target, drafter = pair
    rng = np.random.default_rng(0)
    feats = _features(rng, 2, 2, 14)
    whole = extend_context(drafter, drafter.init_cache(2, 32), feats, jnp.array([14, 9]))
    # The same features in ragged pieces (the second sequence's first piece is shorter, padded).
    pieces = drafter.init_cache(2, 32)
    pieces = extend_context(drafter, pieces, feats[:, :, :6], jnp.array([6, 4]))
    rest = jnp.stack([feats[:, 0, 6:14], jnp.concatenate([feats[:, 1, 4:9], feats[:, 1, :3]], axis=1)], axis=1)
    pieces = extend_context(drafter, pieces, rest, jnp.array([8, 5]))
    np.testing.assert_array_equal(np.asarray(pieces.lens), [14, 9])
    for b, n in ((0, 14), (1, 9)):
        np.testing.assert_allclose(np.asarray(pieces.k[:, b, :, :n]), np.asarray(whole.k[:, b, :, :n]), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(pieces.v[:, b, :, :n]), np.asarray(whole.v[:, b, :, :n]), rtol=1e-6, atol=1e-6)
    bonus, start = jnp.array([5, 7]), jnp.array([14, 9])
    np.testing.assert_allclose(np.asarray(propose(drafter, target, pieces, bonus, start)),
                               np.asarray(propose(drafter, target, whole, bonus, start)), rtol=1e-5, atol=1e-5)


def test_cache_is_head_major(pair):
    """cache.k / .v [num_layers, B, num_kv_heads, max_len, head_dim]: position p of row b holds the layer's
    projected key/value of the p-th context feature; positions past lens stay untouched (padding dropped)."""
    _, drafter = pair
    cfg = drafter.cfg
    rng = np.random.default_rng(2)
    feats = _features(rng, 2, 2, 7)
    cache = extend_context(drafter, drafter.init_cache(2, 12), feats, jnp.array([7, 4]))
    assert cache.k.shape == cache.v.shape == (cfg.num_layers, 2, cfg.num_kv_heads, 12, cfg.head_dim)
    cos, sin = rope_tables(cfg, jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7)))
    proj = drafter.context_features(feats)
    for i, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.keys_values(proj, cos, sin)  # [B, n, Hkv, D]
        for b, n in ((0, 7), (1, 4)):
            np.testing.assert_allclose(np.asarray(cache.k[i, b, :, :n]), np.asarray(k[b, :n].swapaxes(0, 1)), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(cache.v[i, b, :, :n]), np.asarray(v[b, :n].swapaxes(0, 1)), rtol=1e-5, atol=1e-5)
            assert not np.asarray(cache.k[i, b, :, n:]).any() and not np.asarray(cache.v[i, b, :, n:]).any()


def test_proposals_depend_on_context_and_not_on_padding(pair):
    target, drafter = pair
    rng = np.random.default_rng(1)
    feats = _features(rng, 2, 1, 10)
    cache = extend_context(drafter, drafter.init_cache(1, 16), feats, jnp.array([8]))
    out = propose(drafter, target, cache, jnp.array([3]), jnp.array([8]))
    assert out.shape == (1, 5, TINY.vocab_size)
    np.testing.assert_allclose(np.exp(np.asarray(out)).sum(-1), 1.0, rtol=1e-5)
    # Positions past the context length are invisible: changing them changes nothing.
    garbage = cache._replace(k=cache.k.at[:, :, :, 8:].set(100.0), v=cache.v.at[:, :, :, 8:].set(-100.0))
    np.testing.assert_array_equal(np.asarray(propose(drafter, target, garbage, jnp.array([3]), jnp.array([8]))),
                                  np.asarray(out))
    # A different context does change the proposals.
    other = extend_context(drafter, drafter.init_cache(1, 16), feats * -1.0, jnp.array([8]))
    changed = np.asarray(propose(drafter, target, other, jnp.array([3]), jnp.array([8])))
    assert np.abs(changed - np.asarray(out)).max() > 1e-3


def test_drafter_config_validation():
    with pytest.raises(ValueError, match="block_size"):
        DrafterConfig(block_size=1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        DrafterConfig(num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="target_layer_ids"):
        init_drafter(TINY, DrafterConfig(target_layer_ids=(0, 7)))


def _attention_float64(layer, x, cos, sin, ctx_k, ctx_v, lens):
    """The drafter layer's attention, one row and one head at a time in float64 NumPy: each block query over the
    context's first lens[b] keys and the whole block (bidirectional), grouped-query heads, softmax, o_proj."""
    cfg = layer.cfg
    b, s, _ = x.shape
    f64 = lambda a: np.asarray(a, np.float64)
    assert layer.q_norm is None  # the pair's drafter (no per-head q/k norm)
    q = f64(apply_rope(layer.q_proj(x).reshape(b, s, cfg.num_heads, cfg.head_dim), cos, sin))
    k_blk, v_blk = (f64(a) for a in layer.keys_values(x, cos, sin))  # [B, S, Hkv, D]
    ctx_k, ctx_v = f64(ctx_k), f64(ctx_v)  # [B, Hkv, L, D]
    group = cfg.num_heads // cfg.num_kv_heads
    out = np.zeros((b, s, cfg.num_heads, cfg.head_dim))
    for row in range(b):
        for h in range(cfg.num_heads):
            kv = h // group
            keys = np.concatenate([ctx_k[row, kv, : lens[row]], k_blk[row, :, kv]])
            values = np.concatenate([ctx_v[row, kv, : lens[row]], v_blk[row, :, kv]])
            scores = q[row, :, h] @ keys.T / np.sqrt(cfg.head_dim)
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[row, :, h] = (p / p.sum(-1, keepdims=True)) @ values
    bias = getattr(layer.o_proj, "bias", None)
    return out.reshape(b, s, -1) @ f64(layer.o_proj.kernel[...]) + (0.0 if bias is None else f64(bias[...]))


def test_attention_matches_a_float64_formulation(pair):
    """The drafter's attention (one softmax over the cached context's filled part and the block) against a plain
    per-row, per-head float64 formulation, on random inputs: an empty context, a partial one and a full one."""
    _, drafter = pair
    layer = drafter.layers[0].self_attn
    cfg = drafter.cfg
    rng = np.random.default_rng(5)
    b, s, max_len = 3, cfg.block_size, 11
    x = jnp.asarray(rng.standard_normal((b, s, TINY.hidden_size)).astype(np.float32))
    lens = np.array([0, 4, max_len])
    cos, sin = rope_tables(cfg, jnp.asarray(lens)[:, None] + jnp.arange(s)[None, :])
    shape = (b, cfg.num_kv_heads, max_len, cfg.head_dim)
    ctx_k = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    ctx_v = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    got = jax.jit(lambda layer, *a: layer(*a))(layer, x, cos, sin, ctx_k, ctx_v, jnp.asarray(lens, jnp.int32))
    want = _attention_float64(layer, x, cos, sin, ctx_k, ctx_v, lens)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)


def test_a_small_budgets_step_reads_only_the_depths_its_tree_can_reach():
    """step.draft_tree at budget b asks the drafter's head for min(b, D) depths (a tree of b nodes is at most b deep)
    and builds the tree the whole draft gives. The drafter is sure of one token a depth, so the budget-b tree is the
    chain of depth b: a head cut one depth short would lose its last node."""
    from types import SimpleNamespace
    from kdtree_jax.speculative import step as steps, tree as trees

    depth, vocab, batch = 5, 16, 2
    rng = np.random.default_rng(7)
    sure = np.full((batch, depth, vocab), -30.0, np.float32)
    sure[np.arange(batch)[:, None], np.arange(depth)[None, :], rng.integers(0, vocab, (batch, depth))] = 0.0
    sure += rng.uniform(0.0, 0.1, sure.shape).astype(np.float32)
    asked = []

    class SureDrafter:
        cfg = SimpleNamespace(depth=depth)

        def logits(self, target, cache, bonus, start, depth=None):
            asked.append(depth)
            return jnp.asarray(sure[:, :depth])

    start = jnp.array([4, 9], jnp.int32)
    state = SimpleNamespace(cache=SimpleNamespace(seq_lens=start), dcache=None, bonus=jnp.array([1, 2], jnp.int32))
    full_lp, full_tok = jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(sure), -1), 4)
    for budget in (1, 3, depth, depth + 3):
        asked.clear()
        got = steps.draft_tree(SureDrafter(), None, state, steps.SpecConfig(budget=budget, topk=4))
        assert asked == [min(budget, depth)]
        want = trees.build_ddtree(full_lp, full_tok, state.bonus, start, budget)
        for name in ("tokens", "parents", "depths", "positions", "valid", "mask"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
        np.testing.assert_allclose(np.asarray(got.scores), np.asarray(want.scores), rtol=1e-6)
        assert int(np.asarray(got.depths).max()) == min(budget, depth)
    chain = steps.SpecConfig(tree="chain")
    assert steps.tree_depth(chain, depth) == depth and steps.tree_depth(steps.SpecConfig(tree=(2, 1)), depth) == 2
