"""Multi-head latent attention (MLA) in the absorbed form, over the paged latent cache.

Per token the cache holds one latent row `[c_kv (kv_lora_rank, after kv_a_layernorm) | rope(k_pe)]`,
shared by all heads. A query row is `[q_nope · W_UK | rope(q_pe)]`; the attention output is a weighted
sum of latent rows, which `W_UV` then maps to each head's value. Mathematically equal to HF's
decompressed attention (tests/test_model.py checks it), but it reads one row per position instead of
H keys and H values.
"""

from __future__ import annotations

from typing import NamedTuple

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from kdtree_jax.attention_batch import AttentionBatch  # noqa: F401  (re-exported: model/transformer.py imports it here)
from kdtree_jax.config import ModelConfig
from kdtree_jax.model.layers import RMSNorm, apply_rope, linear
from kdtree_jax.model.row_invariant import RowLayout
from kdtree_jax.ops import mla_prologue, verify_attention
from kdtree_jax.sharding import MeshLayout


# HF and DeepSeek's reference code build q_a_layernorm / kv_a_layernorm with the RMSNorm default eps,
# not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class AbsorbedWeights(NamedTuple):
    """kv_b_proj split per head and laid out head-major, as the two absorbed products read them: W_UK
    [H, kv_lora_rank, qk_nope] and W_UV [H, v, kv_lora_rank]. A decode loop computes them once, before its
    while loop. Split inside the loop body, kv_b_proj was re-sliced and transposed at every step (on the CPU
    two copies per layer and step, ~13% of a DDTree step of the default pair); computed outside in another
    layout, XLA still copied them inside the body into the head-major layout of its batched dots."""

    w_uk: jnp.ndarray
    w_uv: jnp.ndarray


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, placement: MeshLayout | None = None):
        self.cfg = cfg
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = linear(rngs, h, heads * cfg.qk_head_dim, dtype, axes=("embed", "heads"))
        else:
            self.q_a_proj = linear(rngs, h, cfg.q_lora_rank, dtype, bias=cfg.attention_bias, axes=("embed", "q_lora"))
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype, rngs, axis="q_lora")
            self.q_b_proj = linear(rngs, cfg.q_lora_rank, heads * cfg.qk_head_dim, dtype, axes=("q_lora", "heads"))
        self.kv_a_proj_with_mqa = linear(rngs, h, cfg.cache_dim, dtype, bias=cfg.attention_bias,
                                         axes=("embed", "kv_latent"))
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype, rngs, axis="kv_latent")
        self.kv_b_proj = linear(rngs, cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype,
                                axes=("kv_latent", "heads"))
        self.o_proj = linear(rngs, heads * cfg.v_head_dim, h, dtype, bias=cfg.attention_bias, axes=("heads", "embed"))
        # On a mesh (sharding.shard_model gives it): attention runs per device on the heads the layout gives it.
        self.placement = placement

    def absorbed_weights(self) -> AbsorbedWeights:
        """The two halves of kv_b_proj, per head: W_UK [H, c, nope] and W_UV [H, v, c]."""
        cfg = self.cfg
        w = self.kv_b_proj.kernel[...].reshape(cfg.kv_lora_rank, cfg.num_attention_heads, -1)
        return AbsorbedWeights(jnp.transpose(w[..., : cfg.qk_nope_head_dim], (1, 0, 2)),
                               jnp.transpose(w[..., cfg.qk_nope_head_dim:], (1, 2, 0)))

    def queries(self, q_in, cos, sin):
        """[B, T, H, qk_nope], [B, T, H, qk_rope] (rope applied) from the query's input (`projections`)."""
        cfg = self.cfg
        q = (self.q_proj if cfg.q_lora_rank is None else self.q_b_proj)(q_in)
        q = q.reshape(*q_in.shape[:-1], cfg.num_attention_heads, cfg.qk_head_dim)
        q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        return q_nope, apply_rope(q_pe, cos[..., None, :], sin[..., None, :])

    def projections(self, x, cos, sin):
        """(the query's input: q_a_layernorm(q_a_proj(x)) [.., q_lora_rank], or x itself without q_lora; the cache
        rows of these tokens [.., kv_lora_rank + qk_rope]). At decode sizes on a GPU one CUDA op computes both
        (ops/mla_prologue.py: the two products over the shared input, the norms and the rope), else the modules."""
        cfg = self.cfg

        def reference(x, cos, sin):
            q_in = x if cfg.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))
            return q_in, self.latent_rows(x, cos, sin)

        if cfg.q_lora_rank is None or cfg.attention_bias:
            return reference(x, cos, sin)
        weights = mla_prologue.PrologueWeights(self.q_a_proj.kernel[...], self.kv_a_proj_with_mqa.kernel[...],
                                               self.q_a_layernorm.weight[...], self.kv_a_layernorm.weight[...])
        mesh = None if self.placement is None else self.placement.mesh
        return mla_prologue.prologue(x, weights, cos, sin, LATENT_NORM_EPS, reference, mesh=mesh)

    def latent_and_query_rows(self, x, cos, sin, w_uk):
        """(the cache rows of these tokens, the attention op's query rows: `query_rows`)."""
        q_in, latent = self.projections(x, cos, sin)
        return latent, self.query_rows(q_in, cos, sin, w_uk)

    def latent_rows(self, x, cos, sin):
        """The cache rows of these tokens: [B, T, kv_lora_rank + qk_rope]."""
        cfg = self.cfg
        kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = kv[..., : cfg.kv_lora_rank], kv[..., cfg.kv_lora_rank:]
        return jnp.concatenate([self.kv_a_layernorm(c_kv), apply_rope(k_pe, cos, sin)], axis=-1)

    def __call__(self, x, cos, sin, kv_pages, layer: int, batch: AttentionBatch, *, impl: str = "auto",
                 absorbed: AbsorbedWeights | None = None, rows: RowLayout | None = None, residual=None):
        """x [B, T, hidden] (or the rows of a row-invariant pass, `rows`: model/row_invariant.py) -> (out like x,
        kv_pages with this layer's T rows written). `absorbed`: this layer's absorbed_weights() computed by the
        caller (outside its loop), else here. `residual`: returned added to out (inside the row blocks of a
        row-invariant pass, so that the output product and the add fuse alike in every pass)."""
        rows = RowLayout(*x.shape[:2]) if rows is None else rows
        w_uk, w_uv = self.absorbed_weights() if absorbed is None else absorbed
        latent, q_rows = rows.map(lambda h, c, s: self.latent_and_query_rows(h, c, s, w_uk), x, cos, sin)
        # In place when kv_pages is donated: one row per new token, no copy of the pool.
        kv_pages = kv_pages.at[layer, batch.write_slots].set(rows.unflat(latent).astype(kv_pages.dtype), mode="drop")
        out_latent = self.attend(rows.unflat(q_rows).astype(kv_pages.dtype), kv_pages, layer, batch, impl,
                                 rows.split_policy)
        if residual is None:
            return rows.map(lambda o: self.output(o, w_uv, x.dtype), rows.flat(out_latent)), kv_pages
        return rows.map(lambda r, o: r + self.output(o, w_uv, x.dtype), residual, rows.flat(out_latent)), kv_pages

    def query_rows(self, q_in, cos, sin, w_uk):
        """The attention op's queries [.., H, kv_lora_rank + qk_rope] from the query's input (`projections`): q_nope
        absorbed into the latent space by W_UK, then the roped part."""
        q_nope, q_pe = self.queries(q_in, cos, sin)
        q_latent = jnp.einsum("...hn,hcn->...hc", q_nope, w_uk)
        return jnp.concatenate([q_latent, q_pe], axis=-1)

    def output(self, out_latent, w_uv, dtype):
        """The attention op's latent output [.., H, kv_lora_rank] up-projected by W_UV, then o_proj: [.., hidden]."""
        out = jnp.einsum("...hc,hvc->...hv", out_latent.astype(dtype), w_uv)
        return self.o_proj(out.reshape(*out.shape[:-2], -1))

    def attend(self, q_rows, kv_pages, layer: int, batch: AttentionBatch, impl: str,
               split_policy: str = "occupancy"):
        """The verify-attention op; on a mesh, each device runs it on its own heads against its
        (replicated) copy of the latent pool, so the custom call never needs partitioning."""
        op = functools.partial(verify_attention, softmax_scale=self.cfg.softmax_scale,
                               rope_dim=self.cfg.qk_rope_head_dim, impl=impl, split_policy=split_policy)
        args = (q_rows, kv_pages, jnp.asarray(layer, jnp.int32), batch.kv_slots, batch.kv_lens, batch.tree_mask)
        with jax.named_scope("attention_op"):  # profiles attribute by this scope (kdtree_jax/profiling.py)
            if self.placement is None:
                return op(*args)[0]
            spec, whole = self.placement.spec, self.placement.spec()
            rows = spec("batch", "seq", "heads", "kv_latent")  # q [B, T, H, Dc + Dr], out [B, T, H, Dc]
            sharded = jax.shard_map(op, mesh=self.placement.mesh, in_specs=(rows,) + (whole,) * 5,
                                    out_specs=(rows, spec("batch", "seq", "heads")), check_vma=False)
            return sharded(*args)[0]
