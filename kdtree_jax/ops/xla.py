"""Paged MLA verify attention as a skilled JAX user writes it in XLA: the baseline of every kernel speed-up.

Why this module exists: the float32-HIGHEST oracle (ops/reference.py) is a correctness oracle, several times
slower than what anyone would run (float32 operands, 6-pass dots); a kernel quoted against it looks faster
than it is. This is the formulation a competent JAX user writes for the same contract, with no custom kernel:

  - the sequence's latent rows gathered straight from the pool, `kv_pool[layer, kv_slots]` (one XLA gather
    with (layer, slot) index pairs: the layer is never sliced out and copied);
  - bf16 operands as stored (no upcast, no HIGHEST precision), float32 accumulation through
    `preferred_element_type=jnp.float32`: scores over all Dc + Dr dims, the output over the first Dc;
  - softmax in float32 (prefix visible to all, the tree's bits for the last T positions, nothing at or past
    kv_len), probabilities cast to the latent dtype for the value product.

Two formulations, chosen by the static `chunk`:
  - dense (`chunk=None`): all L positions at once, [B, T, H, L] float32 scores (what one writes first);
  - chunked (`chunk=int`): a `lax.scan` over fixed-size chunks of positions with an online-softmax merge
    (running max, running sum, rescaled float32 accumulator): bounded temporaries at long context and large T.
The benchmarks time both and quote the faster one as the baseline (benchmarks/verify_kernel.py, verify_variants.py;
benchmarks/decode_context.py times the whole step with each, as `verify_attention(impl="xla" / "xla_chunked")`,
whose chunked form takes DEFAULT_CHUNK positions a step).

Contract (DESIGN.md, "The kernel contract"; the same as ops/reference.py): out [B, T, H, Dc] in q's dtype,
lse [B, T, H] float32 (natural log); any (Dc, Dr) with Dr = rope_dim; a row with nothing visible gives out = 0
and lse = -inf; out-of-range layer and slot indices are clamped like the reference's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DEFAULT_CHUNK = 16384  # positions a step of verify_attention(impl="xla_chunked"); verify_kernel.py's --xla-chunk default


def _visible(kv_lens, tree_mask, pos, max_len: int):
    """[B, T, P] bool for positions pos [P] int32: the prefix (before the last T positions of kv_len) is seen by
    every query, position kv_len - T + j by query i where bit j of tree_mask[b, i] is set; positions at or past
    kv_len or past the table (max_len, where a chunk pads it) by none."""
    batch, num_queries, words = tree_mask.shape
    first_query = (kv_lens - num_queries)[:, None]            # [B, 1]
    pos = pos[None, :]                                        # [1, P]
    in_table = pos < jnp.minimum(kv_lens[:, None], max_len)    # [B, P]
    in_prefix = (pos < first_query) & in_table
    j = pos - first_query                                     # query-token index of a position
    is_query = (j >= 0) & in_table
    j_safe = jnp.clip(j, 0, num_queries - 1)
    if words == 1:  # T <= 32: one word a row, no gather
        word = tree_mask[:, :, :1]                             # [B, T, 1]
    else:
        index = jnp.broadcast_to((j_safe // 32)[:, None, :], (batch, num_queries, j_safe.shape[1]))
        word = jnp.take_along_axis(tree_mask, index, axis=2)  # [B, T, P]
    bit = (word >> (j_safe % 32).astype(jnp.uint32)[:, None, :]) & jnp.uint32(1)
    return in_prefix[:, None, :] | (is_query[:, None, :] & (bit == 1))


def _gather_rows(kv_pool, layer, slots):
    """The latent rows of `slots` [B, P] of layer `layer`: one gather from the pool. Indices as the reference
    takes them: a negative layer counts from the end once (lax.dynamic_index_in_dim), then both are clamped."""
    num_layers, num_slots, _ = kv_pool.shape
    layer = jnp.asarray(layer, jnp.int32)
    layer = jnp.clip(jnp.where(layer < 0, layer + num_layers, layer), 0, num_layers - 1)
    slots = jnp.clip(slots, 0, num_slots - 1)
    return kv_pool[layer, slots]                              # [B, P, D] in the pool's dtype


def _scores(q, kv, visible, softmax_scale):
    """Masked, scaled float32 scores [B, T, H, P] (-inf where not visible)."""
    scores = jnp.einsum("bthd,bld->bthl", q, kv, preferred_element_type=jnp.float32)
    return jnp.where(visible[:, :, None, :], scores * jnp.float32(softmax_scale), -jnp.inf)


def _value(p, kv, latent_dim):
    """sum_l p[b, t, h, l] * kv[b, l, :Dc], p cast to the latent dtype, float32 accumulation."""
    return jnp.einsum("bthl,bld->bthd", p.astype(kv.dtype), kv[..., :latent_dim], preferred_element_type=jnp.float32)


def _dense(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, softmax_scale, latent_dim):
    max_len = kv_slots.shape[1]
    kv = _gather_rows(kv_pool, layer, kv_slots)
    visible = _visible(kv_lens, tree_mask, jnp.arange(max_len, dtype=jnp.int32), max_len)
    scores = _scores(q, kv, visible, softmax_scale)
    row_max = jnp.max(scores, axis=-1)                        # -inf where nothing is visible
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(scores - row_max[..., None])                  # 0 where masked
    total = jnp.sum(p, axis=-1)
    any_visible = total > 0
    inv = jnp.where(any_visible, 1.0 / jnp.where(any_visible, total, 1.0), 0.0)
    out = _value(p * inv[..., None], kv, latent_dim)          # softmax normalised in float32, then cast
    lse = jnp.where(any_visible, row_max + jnp.log(jnp.where(any_visible, total, 1.0)), -jnp.inf)
    return out.astype(q.dtype), lse


def _chunked(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, softmax_scale, latent_dim, chunk):
    batch, num_queries, num_heads, _ = q.shape
    max_len = kv_slots.shape[1]
    chunk = min(chunk, max_len)  # a chunk longer than the table is the table
    num_chunks = -(-max_len // chunk)
    padded = jnp.pad(kv_slots, ((0, 0), (0, num_chunks * chunk - max_len)))  # padding masked by max_len
    slot_chunks = padded.reshape(batch, num_chunks, chunk).transpose(1, 0, 2)  # [n, B, c]
    offsets = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
    stats_shape = (batch, num_queries, num_heads)

    def step(carry, xs):
        run_max, run_sum, acc = carry
        slots, start = xs
        kv = _gather_rows(kv_pool, layer, slots)
        visible = _visible(kv_lens, tree_mask, start + jnp.arange(chunk, dtype=jnp.int32), max_len)
        scores = _scores(q, kv, visible, softmax_scale)
        new_max = jnp.maximum(run_max, jnp.max(scores, axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        scale_old = jnp.exp(run_max - safe_max)                # 0 while nothing was visible before
        p = jnp.exp(scores - safe_max[..., None])
        run_sum = run_sum * scale_old + jnp.sum(p, axis=-1)
        acc = acc * scale_old[..., None] + _value(p, kv, latent_dim)
        return (new_max, run_sum, acc), None

    init = (jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (latent_dim,), jnp.float32))
    (run_max, run_sum, acc), _ = jax.lax.scan(step, init, (slot_chunks, offsets))
    any_visible = run_sum > 0
    safe_sum = jnp.where(any_visible, run_sum, 1.0)
    out = jnp.where(any_visible[..., None], acc / safe_sum[..., None], 0.0)
    lse = jnp.where(any_visible, run_max + jnp.log(safe_sum), -jnp.inf)
    return out.astype(q.dtype), lse


def verify_attention_xla(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, *, softmax_scale: float,
                         rope_dim: int = 64, chunk: int | None = None):
    """The XLA baseline of the verify-attention op: dense (`chunk=None`) or chunked over L (`chunk` positions
    a step, online softmax). Shapes as in the contract (validated by `kdtree_jax.ops.validate_verify_args`
    when called through `verify_attention(..., impl="xla")`, which takes the dense form, or impl="xla_chunked",
    chunk DEFAULT_CHUNK)."""
    if chunk is not None and (isinstance(chunk, bool) or int(chunk) != chunk or chunk < 1):
        raise ValueError(f"chunk must be None (dense) or a positive int (positions per step); got {chunk!r}")
    latent_dim = q.shape[-1] - rope_dim
    if latent_dim <= 0:
        raise ValueError(f"rope_dim ({rope_dim}) must leave a positive latent width (q's last dim {q.shape[-1]})")
    kv_lens = kv_lens.astype(jnp.int32)
    if chunk is None:
        return _dense(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, float(softmax_scale), latent_dim)
    return _chunked(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, float(softmax_scale), latent_dim, int(chunk))


def xla_op(chunk: int | None = None, **kwargs):
    """verify_attention_xla with `chunk` and keyword arguments bound (a benchmark's op)."""
    return functools.partial(verify_attention_xla, chunk=chunk, **kwargs)


__all__ = ["verify_attention_xla", "xla_op", "DEFAULT_CHUNK"]
