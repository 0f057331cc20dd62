"""The paged MLA verify-attention op: one contract, several implementations.

`verify_attention` is the single dispatch point the model calls, so an implementation can be swapped
without touching the model. `impl`:
  - "reference": the pure-JAX oracle (ops/reference.py: float32, HIGHEST precision; correctness only, never a
    baseline);
  - "xla": what a skilled JAX user writes without a custom kernel (ops/xla.py: bf16 gather from the pool, einsums
    with float32 accumulation, float32 softmax), dense over L; the baseline every kernel speed-up is quoted
    against, in whichever of its two forms is faster;
  - "xla_chunked": the same, chunked over L (`ops.xla.DEFAULT_CHUNK` positions a step, online softmax): the other
    form, reachable through the model (`kdtree_jax.ops.xla.verify_attention_xla(..., chunk=N)` takes any N);
  - "ffi": the compiled extension (CPU handler, CUDA kernel), see ops/ffi.py;
  - "auto": the extension where it is built, else the reference.
"""

from __future__ import annotations

import jax.numpy as jnp

from kdtree_jax.ops import ffi
from kdtree_jax.ops.ffi import SPLIT_POLICIES
from kdtree_jax.ops.reference import mask_words, verify_attention_reference
from kdtree_jax.ops.xla import DEFAULT_CHUNK, verify_attention_xla

IMPLS = ("auto", "reference", "xla", "xla_chunked", "ffi")


def validate_verify_args(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, rope_dim: int) -> None:
    """Static shape/dtype checks with errors that name the argument (no device work)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D]; got shape {q.shape}")
    batch, num_queries, _, width = q.shape
    if kv_pool.ndim != 3:
        raise ValueError(f"kv_pool must be [num_layers, num_slots, D]; got shape {kv_pool.shape}")
    if kv_pool.shape[-1] != width:
        raise ValueError(f"q's last dim ({width}) must equal kv_pool's last dim ({kv_pool.shape[-1]})")
    if not 0 <= rope_dim < width:
        raise ValueError(f"rope_dim must be in [0, {width}); got {rope_dim}")
    if jnp.ndim(layer) != 0:
        raise ValueError(f"layer must be a scalar; got shape {jnp.shape(layer)}")
    if kv_slots.ndim != 2 or kv_slots.shape[0] != batch:
        raise ValueError(f"kv_slots must be [B={batch}, Lmax]; got shape {kv_slots.shape}")
    if kv_slots.shape[1] < num_queries:
        raise ValueError(f"kv_slots' Lmax ({kv_slots.shape[1]}) must be >= T ({num_queries})")
    if kv_lens.shape != (batch,):
        raise ValueError(f"kv_lens must be [B={batch}]; got shape {kv_lens.shape}")
    expected_mask = (batch, num_queries, mask_words(num_queries))
    if tuple(tree_mask.shape) != expected_mask:
        raise ValueError(f"tree_mask must be {list(expected_mask)} uint32; got shape {tree_mask.shape}")
    if tree_mask.dtype != jnp.uint32:
        raise ValueError(f"tree_mask must be uint32; got {tree_mask.dtype}")
    for name, arr in (("kv_slots", kv_slots), ("kv_lens", kv_lens)):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32; got {arr.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating) or not jnp.issubdtype(kv_pool.dtype, jnp.floating):
        raise ValueError(f"q and kv_pool must be floating point; got {q.dtype} and {kv_pool.dtype}")


def verify_attention(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, *, softmax_scale: float,
                     rope_dim: int = 64, num_splits: int = 0, impl: str = "auto", split_policy: str = "occupancy"):
    """out [B, T, H, Dc], lse [B, T, H] -- see ops/reference.py for the full contract.

    split_policy: how the CUDA kernel picks its KV split count: "occupancy" (the fastest for the call's T) or
    "invariant" (independent of T, so a verify pass's root row equals the one-token call's bit for bit; what
    row-invariant decoding uses, at a cost: kdtree_jax/ops/ffi.py). The other implementations ignore it."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if split_policy not in SPLIT_POLICIES:
        raise ValueError(f"split_policy must be one of {SPLIT_POLICIES}; got {split_policy!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 = choose automatically); got {num_splits}")
    layer = jnp.asarray(layer, jnp.int32)
    validate_verify_args(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, rope_dim)
    if impl == "reference":
        return verify_attention_reference(q, kv_pool, layer, kv_slots, kv_lens, tree_mask,
                                          softmax_scale=softmax_scale, rope_dim=rope_dim)
    if impl in ("xla", "xla_chunked"):
        return verify_attention_xla(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, softmax_scale=softmax_scale,
                                    rope_dim=rope_dim, chunk=DEFAULT_CHUNK if impl == "xla_chunked" else None)
    # The compiled extension (ops/ffi.py) is optional: a checkout without a build runs "auto" on the reference.
    if ffi.available():
        return ffi.verify_attention_ffi(q, kv_pool, layer, kv_slots, kv_lens, tree_mask,
                                        softmax_scale=softmax_scale, rope_dim=rope_dim, num_splits=num_splits,
                                        split_policy=split_policy)
    if impl == "ffi":
        raise ValueError("impl='ffi' but the compiled extension is not built; reinstall with `pip install -e .`")
    return verify_attention_reference(q, kv_pool, layer, kv_slots, kv_lens, tree_mask,
                                      softmax_scale=softmax_scale, rope_dim=rope_dim)


__all__ = ["verify_attention", "verify_attention_reference", "verify_attention_xla", "validate_verify_args", "mask_words", "IMPLS", "SPLIT_POLICIES"]
