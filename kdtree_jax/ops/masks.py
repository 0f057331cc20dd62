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


@jax.jit  # many small ops: one dispatch when called eagerly (inlined when traced)
def ancestor_mask(parents):
    """Ancestor-or-self mask of trees given as parent indices: uint32 [B, T, ceil(T/32)].

    parents: int32 [B, T], parents[b, 0] = -1 (the root) and parents[b, i] < i for i > 0. A node whose
    parent is negative is a root: its row holds only its own bit.

    Pointer doubling on the packed rows: after step k, row i holds the nodes at distance < 2**k above
    i, and hop[i] is i's 2**k-th ancestor (a root is its own ancestor, so hops saturate there).
    ceil(log2(T)) steps of a row gather and a bitwise OR: O(T * words * log T) work per tree and
    no loop over T, instead of T sequential row updates of a [T, T] bool matrix.
    """
    batch, num_queries = parents.shape
    parents = parents.astype(jnp.int32)
    node = jnp.arange(num_queries, dtype=jnp.int32)
    reach = jnp.broadcast_to(pack_mask_bits(jnp.eye(num_queries, dtype=bool)),
                             (batch, num_queries, mask_words(num_queries)))
    hop = jnp.where(parents >= 0, parents, node[None, :])
    rows = jax.vmap(lambda table, index: table[index])  # per tree: table[hop], rows picked by index
    for _ in range(max(num_queries - 1, 0).bit_length()):  # ceil(log2(T)) doublings cover depth T - 1
        reach = reach | rows(reach, hop)
        hop = rows(hop, hop)
    return reach
