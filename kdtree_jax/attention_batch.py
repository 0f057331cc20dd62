"""`AttentionBatch`: where a forward pass's tokens live in the paged latent pool and what they may see.

A leaf module (jax only): the pool (kv_pool.py) builds it, the model (model/mla.py) consumes it, and
neither has to import the other for it. The fields are the verify-attention op's slot arguments (the
kernel contract in docs/design.md) plus where the new rows are written.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class AttentionBatch(NamedTuple):
    """Where a forward pass's T tokens live in the paged pool, and what they may see."""

    kv_slots: jnp.ndarray  # [B, Lmax] int32: slot of every position (incl. the T new ones)
    kv_lens: jnp.ndarray  # [B] int32: valid positions, the T new tokens being the last T
    tree_mask: jnp.ndarray  # [B, T, ceil(T/32)] uint32: query-to-query visibility
    write_slots: jnp.ndarray  # [B, T] int32: where the T new latent rows are written


__all__ = ["AttentionBatch"]
