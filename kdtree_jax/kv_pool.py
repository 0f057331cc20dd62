"""The paged latent KV pool (page_size 1) with an on-device slot allocator and per-sequence slot tables.

Every token of every sequence owns one *slot*: a row of `pages[layer, slot]` in each layer holding that
token's latent `[c_kv | rope(k_pe)]`. A sequence's positions map to slots through its row of
`slot_table`, so slots need not be contiguous, and committing an accepted tree path is a rewrite of the
table, never a KV copy. Free slots sit on a stack (`free_slots[:num_free]`); allocation pops, release
pushes, all on device with static shapes and no host sync. An allocation that finds too few free slots
(or a position past `max_len`) sets the sticky `overflow` flag, which the host checks after a jitted call:
the pool never silently hands out a slot twice.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from kdtree_jax.attention_batch import AttentionBatch
from kdtree_jax.config import ModelConfig
from kdtree_jax.ops.masks import causal_mask


class KVCache(NamedTuple):
    pages: jnp.ndarray  # [num_layers, num_slots, kv_lora_rank + qk_rope] latent rows
    free_slots: jnp.ndarray  # [num_slots] int32; entries [0, num_free) are free
    num_free: jnp.ndarray  # [] int32
    slot_table: jnp.ndarray  # [B, max_len] int32: slot of each position of each sequence
    seq_lens: jnp.ndarray  # [B] int32: committed positions per sequence
    overflow: jnp.ndarray  # [] bool: an allocation or a position ran out of room (sticky)

    @property
    def batch(self) -> int:
        return self.slot_table.shape[0]

    @property
    def max_len(self) -> int:
        return self.slot_table.shape[1]

    @property
    def num_slots(self) -> int:
        return self.pages.shape[1]


class PoolExhaustedError(RuntimeError):
    """The KV pool (or a sequence's slot table) ran out of room during a jitted step."""


def init_cache(cfg: ModelConfig, batch: int, max_len: int, *, num_slots: int | None = None,
               dtype=jnp.bfloat16) -> KVCache:
    """An empty pool for `batch` sequences of up to `max_len` positions (default: room for all of them)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1; got {max_len}")
    num_slots = batch * max_len if num_slots is None else num_slots
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1; got {num_slots}")
    # Pop order is ascending slot ids, so a fresh pool fills contiguously.
    free = jnp.arange(num_slots - 1, -1, -1, dtype=jnp.int32)
    return KVCache(
        pages=jnp.zeros((cfg.num_hidden_layers, num_slots, cfg.cache_dim), dtype),
        free_slots=free,
        num_free=jnp.asarray(num_slots, jnp.int32),
        slot_table=jnp.zeros((batch, max_len), jnp.int32),
        seq_lens=jnp.zeros((batch,), jnp.int32),
        overflow=jnp.asarray(False),
    )


def check_overflow(cache: KVCache) -> None:
    """Host-side check after a jitted call; raises instead of returning corrupted output."""
    if bool(cache.overflow):
        raise PoolExhaustedError(
            f"KV pool exhausted: {cache.num_slots} slots for {cache.batch} sequences of up to {cache.max_len} "
            "positions were not enough; give init_cache a larger num_slots/max_len or generate fewer tokens")


def allocate(cache: KVCache, count: int) -> tuple[KVCache, jnp.ndarray]:
    """Pop `count` slots per sequence: (cache, slots [B, count])."""
    need = cache.batch * count
    short = cache.num_free < need
    start = jnp.maximum(cache.num_free - need, 0)
    popped = jax.lax.dynamic_slice_in_dim(cache.free_slots, start, need)
    # Popped from the top of the stack, the last entry first, so a fresh pool hands out 0, 1, 2, ...
    slots = popped[::-1].reshape(cache.batch, count)
    return cache._replace(num_free=jnp.where(short, cache.num_free, start), overflow=cache.overflow | short), slots


def release(cache: KVCache, slots, keep) -> KVCache:
    """Push back the slots where `keep` is True (any shapes, same for both)."""
    slots, keep = slots.reshape(-1), keep.reshape(-1)
    dest = cache.num_free + jnp.cumsum(keep.astype(jnp.int32)) - 1
    dest = jnp.where(keep, dest, cache.num_slots)  # out of range: dropped
    free = cache.free_slots.at[dest].set(slots, mode="drop")
    return cache._replace(free_slots=free, num_free=cache.num_free + keep.sum(dtype=jnp.int32))


def place(cache: KVCache, slots) -> KVCache:
    """Give positions [seq_len, seq_len + n) of each sequence the slots [B, n] (seq_lens unchanged)."""
    batch, count = slots.shape
    positions = cache.seq_lens[:, None] + jnp.arange(count, dtype=jnp.int32)[None, :]
    past_end = jnp.any(positions >= cache.max_len)
    table = cache.slot_table.at[jnp.arange(batch)[:, None], positions].set(slots, mode="drop")
    return cache._replace(slot_table=table, overflow=cache.overflow | past_end)


def attention_batch(cache: KVCache, slots, tree_mask) -> AttentionBatch:
    """The attention inputs for T new tokens placed at [seq_len, seq_len + T) with the given mask."""
    return AttentionBatch(kv_slots=cache.slot_table, kv_lens=cache.seq_lens + slots.shape[1],
                          tree_mask=tree_mask, write_slots=slots)


def begin_chunk(cache: KVCache, num_tokens: int, tree_mask=None):
    """Allocate and place slots for `num_tokens` new tokens per sequence: (cache, slots, batch).

    tree_mask: the tokens' visibility among themselves (a draft tree's); None is causal (a prompt chunk).
    """
    cache, slots = allocate(cache, num_tokens)
    cache = place(cache, slots)
    mask = causal_mask(cache.batch, num_tokens) if tree_mask is None else tree_mask
    return cache, slots, attention_batch(cache, slots, mask)


def end_chunk(cache: KVCache, slots, num_valid) -> KVCache:
    """Keep the first `num_valid[b]` tokens of the chunk, free the slots of the padding after them."""
    pad = jnp.arange(slots.shape[1])[None, :] >= num_valid[:, None]
    cache = release(cache, slots, pad)
    return cache._replace(seq_lens=cache.seq_lens + num_valid.astype(jnp.int32))


def reset_sequences(cache: KVCache, which) -> KVCache:
    """Free every slot of the sequences where `which` [B] is True and set their lengths to 0."""
    positions = jnp.arange(cache.max_len)[None, :]
    owned = which[:, None] & (positions < cache.seq_lens[:, None])
    cache = release(cache, cache.slot_table, owned)
    return cache._replace(seq_lens=jnp.where(which, 0, cache.seq_lens))


def commit_path(cache: KVCache, node_slots, path, num_accepted, active) -> KVCache:
    """Make an accepted tree path the sequences' next positions, free every other node's slot.

    node_slots [B, T]: slot of each tree node (placed at positions [seq_len, seq_len + T) for the
    verify pass); path [B, D+1]: accepted node indices, root first; num_accepted [B]: accepted nodes
    after the root. The path's rows were computed at rope positions seq_len + depth, which are exactly
    the positions they take now, so committing is a rewrite of the slot table: no KV row moves.
    Inactive sequences keep nothing.
    """
    batch, num_nodes = node_slots.shape
    steps = jnp.arange(path.shape[1])[None, :]
    num_keep = jnp.where(active, num_accepted + 1, 0)
    on_path = steps < num_keep[:, None]
    path_safe = jnp.clip(path, 0, num_nodes - 1)
    rows = jnp.arange(batch)[:, None]
    dest = jnp.where(on_path, cache.seq_lens[:, None] + steps, cache.max_len)
    table = cache.slot_table.at[rows, dest].set(jnp.take_along_axis(node_slots, path_safe, axis=1), mode="drop")
    kept = jnp.zeros((batch, num_nodes), bool).at[rows, jnp.where(on_path, path_safe, num_nodes)].set(True, mode="drop")
    cache = release(cache._replace(slot_table=table), node_slots, ~kept)
    return cache._replace(seq_lens=cache.seq_lens + num_keep.astype(jnp.int32))


def defrag(cache: KVCache) -> KVCache:
    """Compact a churned pool: every live row moves to slots [0, live), in (sequence, position) order,
    and the free list becomes the contiguous rest. Logits are unchanged (only slot ids change).

    This copies the live rows once; run it between requests, not per step.
    """
    live = jnp.arange(cache.max_len)[None, :] < cache.seq_lens[:, None]  # [B, Lmax]
    new_ids = jnp.where(live, jnp.cumsum(live.reshape(-1)).reshape(live.shape) - 1, 0).astype(jnp.int32)
    total = live.sum(dtype=jnp.int32)
    src = jnp.where(live, cache.slot_table, 0).reshape(-1)
    dst = jnp.where(live.reshape(-1), new_ids.reshape(-1), cache.num_slots)
    pages = jnp.zeros_like(cache.pages).at[:, dst].set(cache.pages[:, src], mode="drop")
    # Free slots are [total, num_slots); popped from the top of the stack in ascending order.
    idx = jnp.arange(cache.num_slots, dtype=jnp.int32)
    free = jnp.where(idx < cache.num_slots - total, cache.num_slots - 1 - idx, 0).astype(jnp.int32)
    return cache._replace(pages=pages, free_slots=free, num_free=cache.num_slots - total,
                          slot_table=jnp.where(live, new_ids, 0))
