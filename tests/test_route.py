"""ops/route.py off the GPU: `choose_experts` is `route` wherever the CUDA kernel does not run (its branch, traced but
not lowered, is a stand-in here), and the kernel's limits decide when it may (the GPU tests: test_route_gpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import kdtree_jax
from kdtree_jax.model.moe import route
from kdtree_jax.ops import route as route_ops

CFG = kdtree_jax.ModelConfig.preset("tiny").replace(n_routed_experts=16, n_group=4, topk_group=2)


def test_cpu_branch_is_the_reference(monkeypatch):
    monkeypatch.setattr(route_ops, "kernel_applies", lambda *a: True)
    monkeypatch.setattr(route_ops, "cuda_choose_experts",
                        lambda l, b, cfg: (jnp.zeros((l.shape[0], cfg.num_experts_per_tok), jnp.int32),
                                           jnp.full((l.shape[0], cfg.num_experts_per_tok), jnp.nan)))
    logits = jax.random.normal(jax.random.key(0), (5, 16))
    bias = jax.random.normal(jax.random.key(1), (16,)) * 0.1
    got = jax.jit(lambda l, b: route_ops.choose_experts(l, b, CFG, route))(logits, bias)
    want = route(logits, bias, CFG)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_kernel_limits(monkeypatch):
    monkeypatch.setattr(route_ops, "cuda_built", lambda: True)
    assert route_ops.kernel_applies(384, CFG.replace(n_routed_experts=384, n_group=1, topk_group=1,
                                                     num_experts_per_tok=8))
    assert not route_ops.kernel_applies(route_ops.MAX_EXPERTS + 8, CFG.replace(
        n_routed_experts=route_ops.MAX_EXPERTS + 8, n_group=1, topk_group=1))
    assert not route_ops.kernel_applies(64, CFG.replace(n_routed_experts=64, num_experts_per_tok=route_ops.MAX_K + 1,
                                                        n_group=1, topk_group=1))
    # The kernel ranks groups by their two best choices (noaux_tc): DeepSeek-V2's rule stays with `route`.
    assert route_ops.kernel_applies(16, CFG)
    assert not route_ops.kernel_applies(16, CFG.replace(topk_method="group_limited_greedy"))
    assert route_ops.kernel_applies(16, CFG.replace(topk_method="group_limited_greedy", n_group=1, topk_group=1))
    monkeypatch.setattr(route_ops, "cuda_built", lambda: False)
    assert not route_ops.kernel_applies(16, CFG)
