"""The paged pool: on-device allocator, release, overflow, and in-place (donated) updates."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import kdtree_jax
from kdtree_jax import decode, kv_pool
from kdtree_jax.config import ModelConfig

TINY = ModelConfig.preset("tiny")


def test_allocate_and_release_round_trip():
    cache = kv_pool.init_cache(TINY, 2, 8, num_slots=10, dtype=jnp.float32)
    cache, a = kv_pool.allocate(cache, 3)
    assert sorted(np.asarray(a).ravel().tolist()) == list(range(6))  # a fresh pool fills from slot 0
    assert int(cache.num_free) == 4
    keep = np.array([[True, False, True], [False, False, True]])
    cache = kv_pool.release(cache, a, jnp.asarray(keep))
    assert int(cache.num_free) == 7
    cache, b = kv_pool.allocate(cache, 3)
    # Every slot handed out now is either never used or one that was released; none is owned twice.
    still_owned = set(np.asarray(a)[~keep].tolist())
    assert not still_owned & set(np.asarray(b).ravel().tolist())
    assert len(set(np.asarray(b).ravel().tolist())) == 6
    assert not bool(cache.overflow)


def test_exhaustion_sets_overflow_and_raises_on_check():
    cache = kv_pool.init_cache(TINY, 2, 8, num_slots=5, dtype=jnp.float32)
    cache, _ = kv_pool.allocate(cache, 2)
    assert not bool(cache.overflow)
    cache, _ = kv_pool.allocate(cache, 1)
    assert bool(cache.overflow)
    with pytest.raises(kv_pool.PoolExhaustedError, match="exhausted"):
        kv_pool.check_overflow(cache)


def test_decode_step_does_not_copy_the_pool():
    """With the cache donated, XLA updates the pool in place: no temporary as large as the pool, and the
    pool's buffer is aliased from input to output."""
    cfg = TINY
    model = kdtree_jax.init_model(cfg, seed=0)
    # A pool with room to spare (4x what the batch's tables can address), as a server would size it.
    cache = kv_pool.init_cache(cfg, 2, 4096, num_slots=4 * 2 * 4096, dtype=jnp.float32)  # 15.7 MB
    pool_bytes = cache.pages.size * cache.pages.dtype.itemsize
    tokens = jnp.zeros((2, 1), jnp.int32)
    compiled = decode.forward_chunk.lower(model, cache, tokens, jnp.ones((2,), jnp.int32), impl="reference").compile()
    mem = compiled.memory_analysis()
    assert mem is not None
    assert mem.alias_size_in_bytes >= pool_bytes
    # The reference attention gathers each sequence's rows ([B, Lmax, D] per layer, 1/12 of this pool)
    # but must never materialise a second pool.
    assert mem.temp_size_in_bytes < pool_bytes / 2


def test_defrag_keeps_logits_identical():
    """Churn a pool (sequences reset and refilled, padding freed), compact it, and check that every
    sequence's next-token logits are bit-identical before and after."""
    cfg = TINY
    model = kdtree_jax.init_model(cfg, seed=4)
    rng = np.random.default_rng(9)
    cache = kv_pool.init_cache(cfg, 3, 48, num_slots=200, dtype=jnp.float32)
    cache = cache._replace(free_slots=jnp.asarray(rng.permutation(200).astype(np.int32)))
    _, _, cache = kdtree_jax.prefill(model, cache, rng.integers(0, cfg.vocab_size, (3, 20)), [20, 7, 13], chunk_size=8)
    cache = kv_pool.reset_sequences(cache, jnp.array([False, True, False]))
    _, _, cache = kdtree_jax.prefill(model, cache, rng.integers(0, cfg.vocab_size, (3, 9)), [3, 9, 5], chunk_size=8)
    live = int(np.asarray(cache.seq_lens).sum())
    assert int(cache.num_free) == 200 - live

    probe = rng.integers(0, cfg.vocab_size, 3)
    before, _ = kdtree_jax.decode_step(model, jax.tree.map(jnp.copy, cache), probe, impl="reference")
    packed = kv_pool.defrag(cache)
    table = np.asarray(packed.slot_table)
    owned = np.concatenate([table[b, :n] for b, n in enumerate(np.asarray(packed.seq_lens))])
    assert sorted(owned.tolist()) == list(range(live))  # compact: slots 0..live-1, each once
    assert int(packed.num_free) == 200 - live
    after, packed = kdtree_jax.decode_step(model, packed, probe, impl="reference")
    np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
