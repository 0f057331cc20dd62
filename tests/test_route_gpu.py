"""The router's expert choice as one CUDA kernel (ffi/moe_route.cu, ops/route.py) against XLA's `route` on the same
GPU and a float64 recomputation of the weights (needs a GPU; marked `gpu`).

Configs: Kimi K2's (384 experts, top-8, one group, sigmoid + bias), DeepSeek-V3's (256 experts in 8 groups, the best
4 kept), softmax scores without bias or normalisation, odd sizes, the kernel's limits (1024 experts, top-32), one
expert a group; inputs with ties (logits on a coarse grid: lax.top_k's lower-id order must hold), -inf and NaN
logits. Outputs are NaN / garbage-poisoned through the allocator first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.config import ModelConfig
from kdtree_jax.model.moe import route
from kdtree_jax.ops import route as route_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu" or not route_ops.cuda_built(),
                       reason="needs a GPU and the extension's CUDA router op"),
]

BASE = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
            v_head_dim=16, n_shared_experts=1, first_k_dense_replace=1)
# (experts, top_k, n_group, topk_group, scoring, method, normalise, scale)
CONFIGS = {
    "k2": (384, 8, 1, 1, "sigmoid", "noaux_tc", True, 2.827),
    "v3_groups": (256, 8, 8, 4, "sigmoid", "noaux_tc", True, 2.5),
    "softmax_plain": (64, 6, 1, 1, "softmax", "greedy", False, 1.0),
    "odd": (7, 3, 1, 1, "sigmoid", "noaux_tc", True, 1.0),
    "limits": (1024, 32, 4, 3, "sigmoid", "noaux_tc", True, 1.5),
    "one_expert_groups": (16, 3, 16, 5, "softmax", "noaux_tc", True, 1.0),
}


def config(name):
    e, k, g, tg, scoring, method, norm, scale = CONFIGS[name]
    return ModelConfig(**BASE, n_routed_experts=e, num_experts_per_tok=k, n_group=g, topk_group=tg,
                       scoring_func=scoring, topk_method=method, norm_topk_prob=norm, routed_scaling_factor=scale)


def inputs(rng, tokens, experts, kind):
    if kind == "ties":  # a coarse grid: many equal scores
        logits = rng.integers(-3, 4, (tokens, experts)).astype(np.float32) / 2
    else:
        logits = rng.normal(0, 2, (tokens, experts)).astype(np.float32)
    if kind == "special":
        logits[0, :] = -np.inf
        logits[-1, ::3] = np.nan
        logits[-1, 1] = np.inf
    bias = rng.normal(0, 0.1, experts).astype(np.float32)
    if kind == "ties":
        bias = np.round(bias * 4) / 4
    return jnp.asarray(logits), jnp.asarray(bias)


def weights_f64(logits, bias, indices, cfg):
    x = np.asarray(logits, np.float64)
    scores = 1 / (1 + np.exp(-x)) if cfg.scoring_func == "sigmoid" else \
        np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
    w = np.take_along_axis(scores, np.asarray(indices), -1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor


INPUTS = [(1, "random"), (9, "random"), (33, "ties"), (5, "special")]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("tokens,kind", INPUTS)
def test_kernel_matches_xla_route(name, tokens, kind):
    cfg = config(name)
    rng = np.random.default_rng(list(CONFIGS).index(name) * 10 + INPUTS.index((tokens, kind)))
    logits, bias = inputs(rng, tokens, cfg.n_routed_experts, kind)
    k = cfg.num_experts_per_tok
    jax.block_until_ready([jnp.full((tokens, k), -7, jnp.int32), jnp.full((tokens, k), jnp.nan, jnp.float32)])
    got_i, got_w = jax.jit(lambda l, b: route_ops.cuda_choose_experts(l, b, cfg))(logits, bias)
    want_i, want_w = jax.jit(lambda l, b: route(l, b, cfg))(logits, bias)
    got_i, want_i = np.asarray(got_i), np.asarray(want_i)
    special = kind == "special"
    rows = slice(1, -1) if special else slice(None)  # the -inf / NaN rows: checked below
    np.testing.assert_array_equal(got_i[rows], want_i[rows])
    np.testing.assert_allclose(np.asarray(got_w)[rows], np.asarray(want_w)[rows], rtol=2e-6, atol=1e-7)
    if not special:
        np.testing.assert_allclose(np.asarray(got_w), weights_f64(logits, bias, got_i, cfg), rtol=1e-5)
    else:
        assert ((got_i >= 0) & (got_i < cfg.n_routed_experts)).all()  # real ids even in a row of -inf / NaN
        assert all(len(set(r)) == k for r in got_i)


def test_router_lowers_to_the_kernel_on_gpu():
    from flax import nnx

    from kdtree_jax.model.moe import Router
    cfg = config("k2")
    router = Router(cfg, jnp.bfloat16, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (3, cfg.hidden_size), jnp.bfloat16)
    fn = nnx.jit(lambda r, x: r(x))
    assert route_ops.TARGET in fn.lower(router, x).as_text()
    got_i, got_w = fn(router, x)
    logits = x.astype(jnp.float32) @ router.weight[...].astype(jnp.float32).T
    want_i, want_w = route(logits, router.e_score_correction_bias[...], cfg)
    np.testing.assert_array_equal(np.asarray(got_i), np.asarray(want_i))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(want_w), rtol=2e-6)
