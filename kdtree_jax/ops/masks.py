"""Query-to-query visibility as the kernel's packed bitmask: bit j of word j // 32 in row i."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kdtree_jax.ops.reference import mask_words


def pack_mask_bits(visible):
    """bool [..., T, T] -> uint32 [..., T, ceil(T/32)]."""
    num_queries = visible.shape[-1]
    words = mask_words(num_queries)
    padded = jnp.zeros(visible.shape[:-1] + (words * 32,), bool).at[..., :num_queries].set(visible)
    bits = padded.reshape(visible.shape[:-1] + (words, 32)).astype(jnp.uint32)
    shifts = jnp.arange(32, dtype=jnp.uint32)
    return jnp.sum(bits << shifts, axis=-1, dtype=jnp.uint32)


def unpack_mask_bits(packed, num_queries: int):
    """uint32 [..., T, W] -> bool [..., T, T] (inverse of pack_mask_bits)."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (packed[..., :, None] >> shifts) & jnp.uint32(1)
    return bits.reshape(packed.shape[:-1] + (-1,))[..., :num_queries].astype(bool)


def causal_mask(batch: int, num_queries: int):
    """The chain's (prefill's) mask: query i sees query tokens 0..i."""
    tri = jnp.tril(jnp.ones((num_queries, num_queries), bool))
    return jnp.broadcast_to(pack_mask_bits(tri), (batch, num_queries, mask_words(num_queries)))


def ancestor_mask(parents):
    """Ancestor-or-self mask of trees given as parent indices.

    parents: int32 [B, T], parents[b, 0] = -1 (the root) and parents[b, i] < i for i > 0.
    """
    batch, num_queries = parents.shape
    eye = jnp.eye(num_queries, dtype=bool)
    visible = jnp.broadcast_to(eye, (batch, num_queries, num_queries))

    # Node i sees what its parent sees, plus itself; parents come first, so one pass in order suffices.
    def add_row(i, visible):
        parent = jnp.maximum(parents[:, i], 0)
        parent_row = jnp.take_along_axis(visible, parent[:, None, None], axis=1)[:, 0]
        has_parent = (parents[:, i] >= 0)[:, None]
        row = jnp.where(has_parent, parent_row, False) | (jnp.arange(num_queries) == i)[None, :]
        return visible.at[:, i].set(row)

    visible = jax.lax.fori_loop(1, num_queries, add_row, visible)
    return pack_mask_bits(visible)
