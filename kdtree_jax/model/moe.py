"""Mixture of experts: DeepSeek-V3 / Kimi K2 routing, shared experts, grouped routed experts."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from kdtree_jax.config import ModelConfig
from kdtree_jax.model.layers import MLP


def route(router_logits, bias, cfg: ModelConfig):
    """Choose experts per token: (indices [N, k] int32, weights [N, k] float32).

    Experts are *chosen* on `score + e_score_correction_bias` (first the best `topk_group` groups,
    ranked by the sum of each group's top-2 biased scores), but *weighted* by the unbiased scores of
    the chosen experts, normalised, times `routed_scaling_factor`.
    """
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores + bias.astype(jnp.float32) if cfg.topk_method == "noaux_tc" else scores
    num_tokens, num_experts = choice.shape
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        grouped = choice.reshape(num_tokens, cfg.n_group, num_experts // cfg.n_group)
        top2 = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)  # [N, G]
        _, best_groups = jax.lax.top_k(top2, cfg.topk_group)
        keep = jnp.zeros((num_tokens, cfg.n_group), bool).at[jnp.arange(num_tokens)[:, None], best_groups].set(True)
        # Experts of excluded groups can never be chosen (-inf, as in transformers >= 5 and DeepSeek's code).
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)
    _, indices = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return indices.astype(jnp.int32), weights * cfg.routed_scaling_factor


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.normal(stddev=1.0 / math.sqrt(cfg.hidden_size))
        self.weight = nnx.Param(init(rngs.params(), (cfg.n_routed_experts, cfg.hidden_size), jnp.float32).astype(dtype))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((cfg.n_routed_experts,), jnp.float32))

    def __call__(self, x2d):
        # The router runs in float32 whatever the model's dtype (as HF does).
        logits = x2d.astype(jnp.float32) @ self.weight[...].astype(jnp.float32).T
        return route(logits, self.e_score_correction_bias[...], self.cfg)


class RoutedExperts(nnx.Module):
    """All routed experts' SwiGLU weights stacked on a leading expert axis."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        normal = nnx.initializers.normal
        self.gate_proj = nnx.Param(normal(1.0 / math.sqrt(h))(rngs.params(), (e, h, i), dtype))
        self.up_proj = nnx.Param(normal(1.0 / math.sqrt(h))(rngs.params(), (e, h, i), dtype))
        self.down_proj = nnx.Param(normal(1.0 / math.sqrt(i))(rngs.params(), (e, i, h), dtype))

    def __call__(self, x2d, indices, weights):
        """Sum over each token's chosen experts of weight * expert(x), as one grouped matmul.

        The (token, expert) pairs are sorted by expert so that `ragged_dot` runs each expert over one
        contiguous block of rows: exact, and no expert runs on tokens that did not choose it.
        """
        num_tokens, k = indices.shape
        num_experts = self.gate_proj.shape[0]
        flat_expert = indices.reshape(-1)
        order = jnp.argsort(flat_expert, stable=True)
        token_of_row = order // k
        rows = x2d[token_of_row]
        group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
        gate = jax.lax.ragged_dot(rows, self.gate_proj[...], group_sizes)
        up = jax.lax.ragged_dot(rows, self.up_proj[...], group_sizes)
        out_rows = jax.lax.ragged_dot(jax.nn.silu(gate) * up, self.down_proj[...], group_sizes)
        out_rows = out_rows * weights.reshape(-1)[order][:, None].astype(out_rows.dtype)
        return jnp.zeros_like(x2d).at[token_of_row].add(out_rows)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.gate = Router(cfg, dtype, rngs)
        self.experts = RoutedExperts(cfg, dtype, rngs)
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, rngs)
        else:
            self.shared_experts = None

    def __call__(self, x):
        x2d = x.reshape(-1, x.shape[-1])
        indices, weights = self.gate(x2d)
        out = self.experts(x2d, indices, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x2d)
        return out.reshape(x.shape)
