"""The DeepSeek-V3 / Kimi K2 decoder: embeddings, MLA + (dense MLP | MoE) layers, final norm, lm head."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from kdtree_jax.config import ModelConfig
from kdtree_jax.model.layers import MLP, RMSNorm, dot_transposed, linear, logical_axes, rope_cos_sin
from kdtree_jax.model.mla import MLA, AbsorbedWeights, AttentionBatch
from kdtree_jax.model.moe import MoE, expert_counts
from kdtree_jax.model.row_invariant import RowLayout


class LoopWeights(NamedTuple):
    """One layer's weights derived from its parameters, as a decode loop computes them once before its body
    (in the body XLA redoes them at every step: it does not hoist the layout copies that it adds after its
    loop-invariant code motion)."""

    absorbed: AbsorbedWeights  # MLA.absorbed_weights()
    experts: tuple | None  # MoE.loop_weights() (None: a dense layer, a GPU, a mesh)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.self_attn = MLA(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.is_moe = cfg.is_moe_layer(layer)
        if self.is_moe:
            self.mlp = MoE(cfg, dtype, rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)

    def loop_weights(self) -> LoopWeights:
        return LoopWeights(self.self_attn.absorbed_weights(), self.mlp.loop_weights() if self.is_moe else None)

    def __call__(self, x, cos, sin, kv_pages, layer: int, batch: AttentionBatch, impl: str,
                 loop_weights: LoopWeights | None = None, rows: RowLayout | None = None):
        """-> (x, kv_pages, the physical expert slots of each real row [rows, k], or None for a dense layer). x: [B, T, hidden], or the
        rows of a row-invariant pass (`rows`, model/row_invariant.py)."""
        lw = loop_weights
        rows = RowLayout(*x.shape[:2]) if rows is None else rows
        # The residual adds happen inside the row blocks of a row-invariant pass (model/row_invariant.py), next to the
        # products they follow, as in every pass; unpadded this is x + attn, x + mlp as usual.
        x, kv_pages = self.self_attn(rows.map(self.input_layernorm, x), cos, sin, kv_pages, layer, batch, impl=impl,
                                     absorbed=None if lw is None else lw.absorbed, rows=rows, residual=x)
        if self.is_moe:
            normed = rows.map(self.post_attention_layernorm, x)
            with jax.named_scope("moe"):  # profiles attribute by these scopes (kdtree_jax/profiling.py)
                x, slots = self.mlp(normed, None if lw is None else lw.experts, rows=rows, residual=x)
            return x, kv_pages, slots
        return rows.map(lambda h: h + self.mlp(self.post_attention_layernorm(h)), x), kv_pages, None


class ForwardOutput(NamedTuple):
    logits: jnp.ndarray  # [B, T, V] float32
    hidden: jnp.ndarray  # [len(hidden_layers), B, T, hidden]: residual stream after each requested layer
    kv_pages: jnp.ndarray  # the pool with these tokens' latent rows written
    expert_counts: jnp.ndarray  # [num_moe_layers, expert slots] int32: tokens routed to each (router stats)


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                      embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
        # The embedding stays whole on every device (a lookup into a vocab-split table would gather it);
        # the lm head splits the vocab ("vocab_out").
        logical_axes(self.embed_tokens.embedding, "vocab", "embed")
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, rngs)
        self.mesh = None  # set by sharding.shard_model
        self.lm_head = None if cfg.tie_word_embeddings else linear(rngs, cfg.hidden_size, cfg.vocab_size, dtype,
                                                                   axes=("embed", "vocab_out"))

    @property
    def dtype(self):
        return self.embed_tokens.embedding.dtype

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def lm_logits(self, x):
        """The lm head alone (the drafter brings its own final norm): [.., hidden] -> float32 [.., V].

        The product accumulates in float32 and is returned as it was accumulated, whatever the weights' dtype:
        a bfloat16 product cast afterwards rounds the logits to bfloat16 steps (0.06 near 10), and near-tied
        logits then tie exactly far more often, which is where greedy decoders part (issue 24)."""
        if self.lm_head is None:
            return dot_transposed(x, self.embed_tokens.embedding[...], preferred_element_type=jnp.float32)
        kernel = self.lm_head.kernel[...]  # the input in the head's dtype, as nnx.Linear takes it
        logits = jnp.dot(x.astype(kernel.dtype), kernel, preferred_element_type=jnp.float32)
        # A vocabulary split over a mesh it does not divide is padded with zero columns (sharding.pad_vocab);
        # the padded ids' logits are cut off here, so every caller sees [.., vocab_size].
        return logits if kernel.shape[-1] == self.cfg.vocab_size else logits[..., :self.cfg.vocab_size]

    def head(self, hidden):
        """Final norm + lm head: [.., hidden] -> float32 logits [.., V]."""
        with jax.named_scope("head"):
            return self.lm_logits(self.norm(hidden))

    def loop_weights(self) -> tuple[LoopWeights, ...]:
        """Every layer's LoopWeights: what a decode loop computes once, before its while loop, and passes to
        each forward as `loop_weights`."""
        return tuple(layer.loop_weights() for layer in self.layers)

    def __call__(self, tokens, positions, kv_pages, batch: AttentionBatch, *,
                 hidden_layers: Sequence[int] = (), impl: str = "auto",
                 loop_weights: Sequence[LoopWeights] | None = None, row_invariant: bool = False) -> ForwardOutput:
        """Run T new tokens per sequence against the paged cache.

        tokens, positions [B, T] int32 (positions drive rope: for a tree, start + depth);
        `batch` says where the tokens' rows go and which cached positions each may see;
        `loop_weights`: loop_weights() computed by the caller (a decode loop, once), else derived per call;
        `row_invariant`: compute each token's row bit for bit as a pass of that token alone would on a GPU (the
        rows padded, the attention op's T-independent splits: model/row_invariant.py; needs
        runtime.configure(row_invariant=True)'s XLA flags), at a cost in speed.
        """
        bad = [i for i in hidden_layers if not 0 <= i < self.cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"hidden_layers {bad} out of range [0, {self.cfg.num_hidden_layers})")
        rows = RowLayout.of(*tokens.shape, row_invariant)
        cos, sin = (rows.flat(t) for t in rope_cos_sin(self.cfg, positions))
        x = rows.flat(self.embed(tokens))
        captured, routed = {}, []
        for i, layer in enumerate(self.layers):
            x, kv_pages, slots = layer(x, cos, sin, kv_pages, i, batch, impl,
                                       None if loop_weights is None else loop_weights[i], rows)
            if slots is not None:
                routed.append(slots)
            if i in hidden_layers:
                captured[i] = rows.unflat(x)
        if hidden_layers:
            hidden = jnp.stack([captured[i] for i in hidden_layers])
        else:
            hidden = jnp.zeros((0,) + tokens.shape + x.shape[-1:], x.dtype)
        moe_layers = [layer.mlp for layer in self.layers if layer.is_moe]
        with jax.named_scope("moe"):
            counts = expert_counts(routed, moe_layers[0].num_slots) if routed else jnp.zeros((0, 0), jnp.int32)
        return ForwardOutput(rows.unflat(rows.map(self.head, x)), hidden, kv_pages, counts)
