"""Paged MLA verify attention in pure JAX: the oracle every other implementation is checked against.

The contract (DESIGN.md, "The kernel contract"):

    q          [B, T, H, Dc + Dr]   absorbed query rows
    kv_pool    [NL, S, Dc + Dr]     latent cache of all layers, one row per slot
    layer      []  int32            which layer of the pool to read
    kv_slots   [B, Lmax] int32      slot of each position; positions [0, kv_lens[b]) are valid
    kv_lens    [B] int32            valid length, including the T query tokens (the last T positions)
    tree_mask  [B, T, ceil(T/32)] uint32   bit j of row i: query i sees query token j
    -> out [B, T, H, Dc] (q's dtype), lse [B, T, H] float32 (natural log)

Every prefix position (before the last T) is visible to every query; a query with nothing visible gets
out = 0 and lse = -inf. Accumulation is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mask_words(num_queries: int) -> int:
    """Number of uint32 words per tree-mask row."""
    return (num_queries + 31) // 32


def visible_positions(kv_lens, tree_mask, max_len: int):
    """[B, T, Lmax] bool: which cache positions each query sees (prefix, plus its tree-mask bits)."""
    batch, num_queries, _ = tree_mask.shape
    pos = jnp.arange(max_len, dtype=jnp.int32)[None, :]  # [1, L]
    first_query_pos = (kv_lens - num_queries)[:, None]  # [B, 1]
    in_prefix = (pos < first_query_pos) & (pos >= 0)  # [B, L]
    # Query-token index j of position p, and whether p is one of the last T positions.
    j = pos - first_query_pos  # [B, L]
    is_query_tok = (j >= 0) & (j < num_queries) & (pos < kv_lens[:, None])
    j_safe = jnp.clip(j, 0, num_queries - 1)
    word = jnp.take_along_axis(
        tree_mask, jnp.broadcast_to((j_safe // 32)[:, None, :], (batch, num_queries, max_len)), axis=2
    )  # [B, T, L]
    bit = (word >> (j_safe % 32).astype(jnp.uint32)[:, None, :]) & jnp.uint32(1)
    sees_query_tok = is_query_tok[:, None, :] & (bit == 1)
    return in_prefix[:, None, :] | sees_query_tok


def verify_attention_reference(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, *, softmax_scale: float, rope_dim: int = 64):
    """Gather the sequence's latent rows, score with all Dc + Dr dims, average the first Dc dims."""
    batch, num_queries, num_heads, width = q.shape
    latent_dim = width - rope_dim
    max_len = kv_slots.shape[1]

    layer_rows = jax.lax.dynamic_index_in_dim(kv_pool, jnp.asarray(layer, jnp.int32), axis=0, keepdims=False)
    kv = jnp.take(layer_rows, kv_slots, axis=0, mode="clip").astype(jnp.float32)  # [B, L, D]

    scores = jnp.einsum("bthd,bld->bthl", q.astype(jnp.float32), kv, precision=jax.lax.Precision.HIGHEST)
    scores = scores * jnp.float32(softmax_scale)
    visible = visible_positions(kv_lens.astype(jnp.int32), tree_mask, max_len)[:, :, None, :]  # [B, T, 1, L]
    scores = jnp.where(visible, scores, -jnp.inf)

    lse = jax.nn.logsumexp(scores, axis=-1)  # -inf where nothing is visible
    any_visible = jnp.isfinite(lse)
    probs = jnp.where(visible, jnp.exp(scores - jnp.where(any_visible, lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("bthl,bld->bthd", probs, kv[..., :latent_dim], precision=jax.lax.Precision.HIGHEST)
    return out.astype(q.dtype), lse
