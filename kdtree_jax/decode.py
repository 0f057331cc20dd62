"""Plain (non-speculative) use of the target over the paged pool: chunked prefill and decode steps.

All jitted functions take the model as a pytree argument (Flax NNX modules are pytrees) and donate the
cache, so the pool is updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax import kv_pool
from kdtree_jax.attention_batch import AttentionBatch
from kdtree_jax.config import ModelConfig
from kdtree_jax.kv_pool import KVCache
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.ops.masks import causal_mask


def init_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> Transformer:
    """A target model with random weights."""
    return Transformer(cfg, dtype, rngs=nnx.Rngs(seed))


def validate_tokens(tokens, vocab_size: int, name: str = "tokens") -> np.ndarray:
    """Host-side check of token ids (int, in [0, vocab)), before any device work."""
    arr = np.asarray(tokens)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must be integer token ids; got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = arr[(arr < 0) | (arr >= vocab_size)]
        raise ValueError(f"{name} holds ids outside [0, vocab_size={vocab_size}): e.g. {bad[:5].tolist()}")
    return arr.astype(np.int32)


def _forward_chunk(model: Transformer, cache: KVCache, tokens, num_valid, hidden_layers, impl):
    cache, slots, batch = kv_pool.begin_chunk(cache, tokens.shape[1])
    positions = cache.seq_lens[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    out = model(tokens, positions, cache.pages, batch, hidden_layers=hidden_layers, impl=impl)
    cache = kv_pool.end_chunk(cache._replace(pages=out.kv_pages), slots, num_valid)
    return out.logits, out.hidden, cache


@functools.partial(jax.jit, static_argnames=("hidden_layers", "impl"), donate_argnames=("cache",))
def forward_chunk(model: Transformer, cache: KVCache, tokens, num_valid, *, hidden_layers=(), impl="auto"):
    """Append a causal chunk tokens [B, C] (the first num_valid[b] real, the rest padding) to each sequence.

    Returns (logits [B, C, V] float32, hidden [len(hidden_layers), B, C, hidden], cache).
    """
    return _forward_chunk(model, cache, tokens, num_valid, hidden_layers, impl)


def decode_step(model: Transformer, cache: KVCache, tokens, *, impl: str = "auto"):
    """One token per sequence: tokens [B] -> (logits [B, V], cache)."""
    tokens = jnp.asarray(tokens, jnp.int32)[:, None]
    logits, _, cache = forward_chunk(model, cache, tokens, jnp.ones((tokens.shape[0],), jnp.int32), impl=impl)
    return logits[:, 0], cache


def prefill(model: Transformer, cache: KVCache, prompt_ids, prompt_lens=None, *, chunk_size: int = 64,
            hidden_layers=(), impl: str = "auto", on_progress=None):
    """Feed right-padded prompts [B, L] (real lengths `prompt_lens`) in causal chunks of `chunk_size`.

    on_progress("prefill", tokens done, tokens in all) after each chunk has run (given one, the host waits for
    each chunk instead of queueing them all: the count is what the device did).
    Every chunk has the same static shape, so one compile serves any prompt length. Returns the logits
    at each prompt's last token [B, V], the requested hidden states of every prompt token
    [len(hidden_layers), B, L, hidden] and the cache.
    """
    cfg = model.cfg
    prompt_ids = validate_tokens(prompt_ids, cfg.vocab_size, "prompt_ids")
    if prompt_ids.ndim != 2 or prompt_ids.shape[0] != cache.batch:
        raise ValueError(f"prompt_ids must be [B={cache.batch}, L]; got shape {prompt_ids.shape}")
    batch, length = prompt_ids.shape
    prompt_lens = np.full((batch,), length, np.int32) if prompt_lens is None else np.asarray(prompt_lens, np.int32)
    if prompt_lens.shape != (batch,) or prompt_lens.min() < 1 or prompt_lens.max() > length:
        raise ValueError(f"prompt_lens must be [B={batch}] with values in [1, {length}]; got {prompt_lens}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    seq_lens = np.asarray(cache.seq_lens)
    if (seq_lens + prompt_lens).max() > cache.max_len:
        raise ValueError(f"prompt of {int(prompt_lens.max())} tokens does not fit: the cache holds at most "
                         f"{cache.max_len} positions per sequence ({int(seq_lens.max())} already used)")
    chunk = min(chunk_size, length)
    if batch * chunk > cache.num_slots:
        raise ValueError(f"the pool's {cache.num_slots} slots cannot hold one chunk of {chunk} tokens "
                         f"for {batch} sequences")

    padded_len = -(-length // chunk) * chunk
    tokens = np.zeros((batch, padded_len), np.int32)
    tokens[:, :length] = prompt_ids
    last_logits, hidden = None, []
    for start in range(0, padded_len, chunk):
        num_valid = np.clip(prompt_lens - start, 0, chunk).astype(np.int32)
        logits, h, cache = forward_chunk(model, cache, jnp.asarray(tokens[:, start:start + chunk]),
                                         jnp.asarray(num_valid), hidden_layers=tuple(hidden_layers), impl=impl)
        hidden.append(h)
        # Each prompt's last token lies in some chunk; pick its logits there.
        idx = prompt_lens - 1 - start
        here = jnp.asarray((idx >= 0) & (idx < chunk))
        picked = jnp.take_along_axis(logits, jnp.asarray(np.clip(idx, 0, chunk - 1))[:, None, None], axis=1)[:, 0]
        last_logits = picked if last_logits is None else jnp.where(here[:, None], picked, last_logits)
        if on_progress is not None:
            last_logits.block_until_ready()
            total = int(prompt_lens.max())  # the longest prompt (the padding past it is not counted)
            on_progress("prefill", min(start + chunk, total), total)
    kv_pool.check_overflow(cache)
    hidden = jnp.concatenate(hidden, axis=2)[:, :, :length]
    return last_logits, hidden, cache


def forward_logits(model: Transformer, tokens, *, impl: str = "auto"):
    """Causal prefill of whole sequences: tokens [B, L] int32 -> logits [B, L, V] float32."""
    tokens = validate_tokens(tokens, model.cfg.vocab_size)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, L]; got shape {tokens.shape}")
    batch, length = tokens.shape
    cache = kv_pool.init_cache(model.cfg, batch, length, dtype=model.dtype)
    logits, _, _ = forward_chunk(model, cache, jnp.asarray(tokens), jnp.full((batch,), length, jnp.int32), impl=impl)
    return logits


def causal_forward(model: Transformer, tokens, hidden_layers=()):
    """Whole sequences [B, S] through the target over a fresh contiguous latent pool, causal, with the
    pure-JAX attention (differentiable: training and teacher forcing use it). -> ForwardOutput (logits and
    the hidden states of `hidden_layers`)."""
    b, s = tokens.shape
    cfg = model.cfg
    slots = jnp.arange(b * s, dtype=jnp.int32).reshape(b, s)
    pages = jnp.zeros((cfg.num_hidden_layers, b * s, cfg.cache_dim), model.dtype)
    batch = AttentionBatch(kv_slots=slots, kv_lens=jnp.full((b,), s, jnp.int32), tree_mask=causal_mask(b, s),
                           write_slots=slots)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (b, s))
    return model(tokens, positions, pages, batch, hidden_layers=tuple(hidden_layers), impl="reference")
