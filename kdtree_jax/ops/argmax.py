"""argmax over the vocabulary axis, fast on every backend.

XLA:CPU lowers `jnp.argmax` to a variadic (value, index) reduce that it does not vectorise: over
[50, 33, 8192] logits it takes ~31 ms on 2 cores, where a plain max takes ~1.3 ms. Greedy acceptance
reduces every tree node's row, so on a CPU that reduce was most of a DDTree step. Here the max runs
over the whole axis split into chunks, and the (small) argmax only over the chunk maxima and then
within the one winning chunk: ~3 ms for the same input and the same result, the first index of the
maximum, for NaN-free input (XLA's max reduce does not promise to propagate NaN, so a row holding a NaN
may give another index than `jnp.argmax`; a NaN logit is a broken model anyway). On a GPU both forms are
one pass over the logits.
"""
from __future__ import annotations

import jax.numpy as jnp


def _chunk_width(size: int) -> int:
    """The divisor of `size` nearest above sqrt(size) (1 if `size` is prime: no chunking)."""
    for width in range(max(1, int(size ** 0.5)), size + 1):
        if size % width == 0:
            return width if width < size else 1
    return 1


def argmax_last(x):
    """`jnp.argmax(x, axis=-1)` as int32 for NaN-free x (ties: the first index, as jnp.argmax)."""
    size = x.shape[-1]
    width = _chunk_width(size)
    if width == 1 or size < 1024:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    chunks = x.reshape(*x.shape[:-1], size // width, width)
    best_chunk = jnp.argmax(jnp.max(chunks, axis=-1), axis=-1)  # the first chunk holding the maximum
    row = jnp.take_along_axis(chunks, best_chunk[..., None, None], axis=-2)[..., 0, :]
    return (best_chunk * width + jnp.argmax(row, axis=-1)).astype(jnp.int32)
