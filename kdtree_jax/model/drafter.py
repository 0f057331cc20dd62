"""A DFlash-style block drafter: one forward pass proposes the next `block_size - 1` tokens.

The input block is `[bonus token, MASK, ..., MASK]` at positions `start, start+1, ...`. Attention inside
the block is bidirectional, and every layer also attends to the *context*: the target's hidden states
at every committed position (from a few target layers, concatenated and projected to the model width).
Each layer keeps the keys/values of that context in a `DrafterCache`, extended as tokens are accepted,
so a step costs only the block's work plus attention over the cached context.

The drafter owns no embedding or output head: it shares the target's (their width is the target's).
The block's output at position i >= 1 gives the distribution of the token at `start + i`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from kdtree_jax.config import ModelConfig, RopeScaling
from kdtree_jax.model.layers import MLP, RMSNorm, apply_rope, linear, rope_inv_freq


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    block_size: int = 8  # the bonus token + block_size - 1 drafted positions
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    target_layer_ids: Optional[tuple[int, ...]] = None  # None: evenly spaced over the target's layers
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    # DFlash checkpoints (Qwen3-style layers): per-head RMSNorm of q and k before rope, yarn rope, and the
    # MASK input embedded from the target's vocabulary instead of a learned vector.
    qk_norm: bool = False
    rope_scaling: Optional[RopeScaling] = None
    mask_token_id: Optional[int] = None

    def __post_init__(self):
        problems = []
        if self.block_size < 2:
            problems.append(f"block_size must be >= 2; got {self.block_size}")
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.num_kv_heads >= 1 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            problems.append(f"head_dim must be even (rope); got {self.head_dim}")
        if problems:
            raise ValueError("invalid DrafterConfig: " + "; ".join(problems))

    @property
    def depth(self) -> int:
        """Drafted positions per pass (D)."""
        return self.block_size - 1

    def layer_ids(self, target: ModelConfig) -> tuple[int, ...]:
        """Which target layers' outputs feed the drafter (validated against the target)."""
        n = target.num_hidden_layers
        ids = self.target_layer_ids
        if ids is None:
            k = min(3, n)
            ids = tuple(sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)}))
        bad = [i for i in ids if not 0 <= i < n]
        if bad or not ids:
            raise ValueError(f"target_layer_ids {ids} must be a non-empty subset of [0, {n})")
        return tuple(ids)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        d = dict(d)
        if d.get("target_layer_ids") is not None:
            d["target_layer_ids"] = tuple(d["target_layer_ids"])
        if isinstance(d.get("rope_scaling"), dict):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


class DrafterCache(NamedTuple):
    """Per drafter layer, the keys/values of the context features at each position.

    Head-major: the attention's batched products take (batch, head) as their batch dimensions ahead of the
    positions, so the cache is read as stored, with no per-step transposed copy of it.
    """

    k: jnp.ndarray  # [num_layers, B, num_kv_heads, max_len, head_dim]
    v: jnp.ndarray
    lens: jnp.ndarray  # [B] int32: context positions filled


def rope_tables(cfg: DrafterConfig, positions):
    """cos, sin [..., 1, head_dim] (broadcast over heads), rotate-half layout, yarn when configured."""
    inv_freq, attention_factor = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return (jnp.cos(angles) * attention_factor)[..., None, :], (jnp.sin(angles) * attention_factor)[..., None, :]


class DrafterAttention(nnx.Module):
    def __init__(self, hidden: int, cfg: DrafterConfig, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.q_proj = linear(rngs, hidden, cfg.num_heads * cfg.head_dim, dtype)
        self.k_proj = linear(rngs, hidden, cfg.num_kv_heads * cfg.head_dim, dtype)
        self.v_proj = linear(rngs, hidden, cfg.num_kv_heads * cfg.head_dim, dtype)
        self.o_proj = linear(rngs, cfg.num_heads * cfg.head_dim, hidden, dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, rngs, axis=None)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, rngs, axis=None)
        else:
            self.q_norm = self.k_norm = None

    def keys_values(self, x, cos, sin):
        """x [B, n, hidden] -> keys, values [B, n, num_kv_heads, head_dim] (position-major, as projected)."""
        shape = x.shape[:-1] + (self.cfg.num_kv_heads, self.cfg.head_dim)
        k = self.k_proj(x).reshape(shape)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), self.v_proj(x).reshape(shape)

    def __call__(self, x, cos, sin, ctx_k, ctx_v, ctx_lens):
        """x [B, S, hidden] (the block) attends to ctx positions [0, ctx_lens) and to the whole block."""
        cfg = self.cfg
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, cfg.num_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.keys_values(x, cos, sin)
        group = cfg.num_heads // cfg.num_kv_heads
        q = q.reshape(b, s, cfg.num_kv_heads, group, cfg.head_dim)
        # Keys and values head-major like the cache ([B, Hkv, positions, D]: the batched products' batch dims
        # (b, k) ahead of the positions), so the block joins the context along positions without a transpose of
        # the cache; only block-sized tensors (q, the block's own k/v, the output) are ever transposed.
        k_blk, v_blk = k_blk.swapaxes(1, 2), v_blk.swapaxes(1, 2)  # [B, Hkv, S, D]
        # One softmax over [context ; block]: the block's keys and values joined after the cache's positions, one
        # product for the scores, one masked softmax, one product for the output. Against scoring the two parts
        # apart (two softmaxes and a combine, or two products joined only for the softmax) this is fewer kernels and
        # was the fastest on the H200 at 320 and at 65,536 context positions, the join included (the A/B:
        # benchmarks/results/history/drafter_attention_ab_h200.md), and on the CPU. Operands in their own dtype
        # with f32 accumulation (products of two bf16 values are exact in f32); P is rounded to the values' dtype
        # for P·V, as flash attention does.
        max_len = ctx_k.shape[2]  # ctx_k, ctx_v [B, Hkv, max_len, D]
        dtype = jnp.promote_types(q.dtype, ctx_k.dtype)
        keys = jnp.concatenate([ctx_k.astype(dtype), k_blk.astype(dtype)], axis=2)  # [B, Hkv, max_len + S, D]
        values = jnp.concatenate([ctx_v, v_blk.astype(ctx_v.dtype)], axis=2)
        keys_pos = jnp.arange(max_len + s)[None, :]
        visible = (keys_pos < ctx_lens[:, None]) | (keys_pos >= max_len)  # the context's filled part, the whole block
        scores = jnp.einsum("bskgd,bkld->bkgsl", q.astype(dtype), keys,
                            preferred_element_type=jnp.float32) / math.sqrt(cfg.head_dim)
        p = jax.nn.softmax(jnp.where(visible[:, None, None, None, :], scores, -jnp.inf), axis=-1)
        out = jnp.einsum("bkgsl,bkld->bkgsd", p.astype(values.dtype), values, preferred_element_type=jnp.float32)
        out = out.astype(x.dtype).transpose(0, 3, 1, 2, 4)  # [B, S, Hkv, G, D]: o_proj reads [B, S, H * D]
        return self.o_proj(out.reshape(b, s, -1))


class DrafterLayer(nnx.Module):
    def __init__(self, hidden: int, cfg: DrafterConfig, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, rngs)
        self.self_attn = DrafterAttention(hidden, cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, rngs)
        self.mlp = MLP(hidden, cfg.intermediate_size, dtype, rngs)

    def __call__(self, x, cos, sin, ctx_k, ctx_v, ctx_lens):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, ctx_lens)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nnx.Module):
    def __init__(self, target_cfg: ModelConfig, cfg: DrafterConfig, dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.target_layer_ids = cfg.layer_ids(target_cfg)
        hidden = target_cfg.hidden_size
        self.fc = linear(rngs, len(self.target_layer_ids) * hidden, hidden, dtype)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, rngs)
        if cfg.mask_token_id is None:
            self.mask_embedding = nnx.Param(jax.random.normal(rngs.params(), (hidden,), jnp.float32).astype(dtype))
        elif not 0 <= cfg.mask_token_id < target_cfg.vocab_size:
            raise ValueError(f"mask_token_id ({cfg.mask_token_id}) must be in [0, vocab_size={target_cfg.vocab_size})")
        else:
            self.mask_embedding = None
        self.layers = nnx.List([DrafterLayer(hidden, cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps, dtype, rngs)

    @property
    def dtype(self):
        return self.fc.kernel.dtype

    def init_cache(self, batch: int, max_len: int) -> DrafterCache:
        cfg = self.cfg
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)  # head-major (DrafterCache)
        return DrafterCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype), jnp.zeros((batch,), jnp.int32))

    def context_features(self, target_hidden):
        """target_hidden [len(target_layer_ids), B, n, hidden] -> projected context [B, n, hidden]."""
        stacked = jnp.concatenate(list(target_hidden), axis=-1)
        return self.hidden_norm(self.fc(stacked.astype(self.dtype)))

    def extend_context(self, cache: DrafterCache, target_hidden, num_new) -> DrafterCache:
        """Append the features of the next positions; the first num_new[b] of n are real."""
        feats = self.context_features(target_hidden)
        b, n, _ = feats.shape
        positions = cache.lens[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
        cos, sin = rope_tables(self.cfg, positions)
        # Padding goes past the end of the table, where the scatter drops it.
        dest = jnp.where(jnp.arange(n)[None, :] < num_new[:, None], positions, cache.k.shape[3])
        # Every layer's keys (values) in one scatter: a scatter per layer and tensor was a kernel each on a GPU.
        # [layer, row, :, dest]: the index arrays are split by the slice (heads), so (NumPy's rule) their broadcast
        # shape [B, n, L] leads the indexed shape, then the sliced heads and head_dim: the updates are the projected
        # k, v [B, n, Hkv, D] of each layer stacked on axis 2, written to cache[i, b, :, dest[b, j]] (head-major).
        layers = jnp.arange(len(self.layers))[None, None, :]
        rows, dest = jnp.arange(b)[:, None, None], dest[:, :, None]
        ks, vs = zip(*(layer.self_attn.keys_values(feats, cos, sin) for layer in self.layers))
        k_all = cache.k.at[layers, rows, :, dest].set(jnp.stack(ks, axis=2).astype(cache.k.dtype), mode="drop")
        v_all = cache.v.at[layers, rows, :, dest].set(jnp.stack(vs, axis=2).astype(cache.v.dtype), mode="drop")
        return DrafterCache(k_all, v_all, cache.lens + num_new.astype(jnp.int32))

    def __call__(self, target, cache: DrafterCache, bonus, start_pos):
        """Log-probs [B, D, V] (float32) of the tokens at start_pos + 1 .. start_pos + D.

        bonus [B]: the last accepted token, at position start_pos [B] (== cache.lens, normally).
        `target` provides the shared embedding and lm head.
        """
        return jax.nn.log_softmax(self.logits(target, cache, bonus, start_pos), axis=-1)

    def logits(self, target, cache: DrafterCache, bonus, start_pos, depth: Optional[int] = None):
        """The logits [B, D, V] (float32, `target.lm_logits`) whose log_softmax `__call__` returns: the decode loop
        takes them to ops.topk.log_softmax_top_k, which fuses the log_softmax with its top-k.

        `depth` (static, <= D): only the first `depth` drafted positions go through the final norm and the lm head
        (a tree of b nodes is at most b deep, so a small budget's step needs no more); the block itself is whole,
        so these are the full pass's first `depth` logits (up to the head product's rounding for another row count)."""
        b = bonus.shape[0]
        block = self.cfg.block_size
        first = target.embed(bonus[:, None]).astype(self.dtype)
        if self.mask_embedding is None:
            mask_vec = target.embed(jnp.asarray(self.cfg.mask_token_id, jnp.int32)).astype(self.dtype)
        else:
            mask_vec = self.mask_embedding[...]
        masks = jnp.broadcast_to(mask_vec, (b, block - 1, first.shape[-1]))
        x = jnp.concatenate([first, masks], axis=1)
        positions = start_pos[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
        cos, sin = rope_tables(self.cfg, positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], cache.lens)
        depth = self.cfg.depth if depth is None else depth
        if not 1 <= depth <= self.cfg.depth:
            raise ValueError(f"depth must be in [1, {self.cfg.depth}] (the drafter's block_size - 1); got {depth}")
        return target.lm_logits(self.norm(x[:, 1:1 + depth]))


def init_drafter(target_cfg: ModelConfig, cfg: DrafterConfig | None = None, seed: int = 0, dtype=jnp.float32) -> Drafter:
    """A drafter with random weights, shaped for `target_cfg`."""
    return Drafter(target_cfg, cfg or DrafterConfig(), dtype, rngs=nnx.Rngs(seed))
