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

import jax
import jax.numpy as jnp
import numpy as np


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


# Beyond this many rounds `top_k_last` hands over to `jax.lax.top_k` (the drafter's topk is a handful).
_MAX_ROUNDS = 16
_TAKEN = np.iinfo(np.int32).min  # below every key of a NaN-free input, -inf included (and -0.0's bits)


def _order_keys(x):
    """int32 keys that order as `x` (-inf < ... < -1 < 0 < 1 < ... < inf), -0.0 and +0.0 equal."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # bf16/f16 -> f32 is exact
    bits = jnp.where(bits == _TAKEN, 0, bits)  # -0.0 (sign bit alone) -> +0.0
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives: flip the magnitude so larger means greater


def _greater(a, b):
    """The (key, index) pair that comes first: the greater key, on equal keys the lesser index."""
    (key_a, index_a), (key_b, index_b) = a, b
    first = (key_a > key_b) | ((key_a == key_b) & (index_a < index_b))
    return jnp.where(first, key_a, key_b), jnp.where(first, index_a, index_b)


def _rounds(keys, index, k: int):
    """k rounds of (first (key, index) pair by `_greater`, mark it taken) over the last axis: the
    `index`es of the k greatest keys, greatest first, ties to the least index. One (key, index) reduce
    a round (a max reduce, then a min reduce of the index at it: ~3x the XLA:CPU kernels to compile)."""
    taken = []
    for _ in range(k):
        _, pos = jax.lax.reduce((keys, index), (np.int32(_TAKEN), np.int32(np.iinfo(np.int32).max)), _greater,
                                (keys.ndim - 1,))
        pos = pos[..., None]
        keys = jnp.where(index == pos, _TAKEN, keys)
        taken.append(pos)
    return jnp.concatenate(taken, axis=-1)


def top_k_last(x, k: int):
    """`jax.lax.top_k(x, k)` (values, int32 indices over the last axis) from plain reduces.

    Why: on the GPU `lax.top_k` lowers to XLA's TopK custom call (`stream_executor::cuda::Run<...>`),
    which a H200 profile of the decode loop showed with ~2.4 host-to-device copies a speculative step
    (suspected of splitting the loop's command buffer); reduces are ordinary XLA fusions.

    Same bits as `lax.top_k` for floating x up to 32 bits: greatest first, equal values (-inf included)
    lower index first. One case where `lax.top_k` itself depends on the lowering: here -0.0 equals +0.0
    (ties to the lower index), as in the GPU TopK kernel that ran the drafter's float32 [B, D, V]
    log-probs; the sort lowering (the CPU; on the GPU some bf16 shapes) puts -0.0 below +0.0. NaN
    is not supported (the all-ones NaN collides with the taken mark). k is static; k > _MAX_ROUNDS goes
    to `lax.top_k` over the same int32 keys.

    How, in one pass over the vocabulary: the row is split into chunks of `_chunk_width` (as
    `argmax_last`), the k chunks with the greatest maxima (ties: the lower chunk) hold the row's top k
    (a top-k element's chunk has a maximum at least that element, and a chunk outside those k has k
    chunks' maxima above it), so k rounds of (max, least index of it, mark taken) run over the chunk
    maxima and then over those k chunks' elements.
    """
    size = x.shape[-1]
    if not 1 <= k <= size:
        raise ValueError(f"top_k_last: k must be in [1, {size}] (the last axis); got {k}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.dtype(x.dtype).itemsize > 4:
        raise TypeError(f"top_k_last: floating x of at most 32 bits; got {x.dtype}")
    keys = _order_keys(x)
    if k > _MAX_ROUNDS:
        _, indices = jax.lax.top_k(keys, k)  # int keys: -0.0 equal to +0.0 here too
        return jnp.take_along_axis(x, indices, axis=-1, mode="promise_in_bounds"), indices.astype(jnp.int32)
    width = _chunk_width(size)
    if width == 1 or size < 1024 or size // width < k:
        index = jax.lax.broadcasted_iota(jnp.int32, keys.shape, keys.ndim - 1)
        indices = _rounds(keys, index, k)
    else:
        num_chunks = size // width
        chunks = keys.reshape(*keys.shape[:-1], num_chunks, width)
        chunk_max = jnp.max(chunks, axis=-1)
        chunk_ids = _rounds(chunk_max, jax.lax.broadcasted_iota(jnp.int32, chunk_max.shape, keys.ndim - 1),
                            k)  # [..., k]
        cand = jnp.take_along_axis(chunks, chunk_ids[..., None], axis=-2,
                                   mode="promise_in_bounds")  # [..., k, width]
        index = chunk_ids[..., None] * width + jnp.arange(width, dtype=jnp.int32)
        flat = (*keys.shape[:-1], k * width)
        indices = _rounds(cand.reshape(flat), index.reshape(flat), k)
    return jnp.take_along_axis(x, indices, axis=-1, mode="promise_in_bounds"), indices
