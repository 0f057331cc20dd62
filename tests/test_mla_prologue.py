"""MLA's prologue op on a CPU: its CUDA branch traces through MLA.projections and the mesh wrapper, and the program
a CPU lowers keeps the modules' reference bit for bit (the op itself runs on a GPU only: test_mla_prologue_gpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from kdtree_jax.config import ModelConfig
from kdtree_jax.model.layers import rope_cos_sin
from kdtree_jax.model.mla import MLA
from kdtree_jax.ops import mla_prologue as ops

CFG = ModelConfig(vocab_size=64, hidden_size=256, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                  q_lora_rank=80, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                  moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                  first_k_dense_replace=1, routed_scaling_factor=1.0)


@pytest.fixture
def taken(monkeypatch):
    """The model takes the op, and the extension is said to hold it (its CUDA branch is then traced)."""
    monkeypatch.setattr(ops, "MODEL_TAKES_IT", True)
    monkeypatch.setattr(ops, "cuda_built", lambda: True)


def inputs(tokens):
    x = jax.random.normal(jax.random.key(1), (1, tokens, CFG.hidden_size), jnp.bfloat16)
    cos, sin = rope_cos_sin(CFG, jnp.arange(tokens)[None] + 40)
    return x, cos, sin


def test_projections_trace_the_op_and_a_cpu_keeps_the_reference(taken):
    mla = MLA(CFG, jnp.bfloat16, nnx.Rngs(0))
    x, cos, sin = inputs(3)
    graph, state = nnx.split(mla)
    fn = lambda state, x, c, s: nnx.merge(graph, state).projections(x, c, s)  # noqa: E731
    assert ops.TARGET in str(jax.make_jaxpr(fn)(state, x, cos, sin))  # the CUDA branch, with the op's operands
    got = jax.jit(fn)(state, x, cos, sin)
    q_in = mla.q_a_layernorm(mla.q_a_proj(x))
    want = (q_in, mla.latent_rows(x, cos, sin))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_more_rows_than_the_op_takes_never_trace_it(taken):
    mla = MLA(CFG, jnp.bfloat16, nnx.Rngs(0))
    x, cos, sin = inputs(ops.MAX_TOKENS + 1)
    graph, state = nnx.split(mla)
    jaxpr = jax.make_jaxpr(lambda state, x, c, s: nnx.merge(graph, state).projections(x, c, s))(state, x, cos, sin)
    assert ops.TARGET not in str(jaxpr)


def test_on_a_mesh_the_op_runs_whole_on_each_device(taken):
    h, q, c, r = 256, 96, 64, 32
    rng = np.random.default_rng(0)
    w = ops.PrologueWeights(*(jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in ((h, q), (h, c + r), (q,), (c,))))
    x = jnp.asarray(rng.normal(size=(2, h)), jnp.bfloat16)
    cos, sin = jnp.ones((2, r)), jnp.zeros((2, r))
    mesh = Mesh(np.array(jax.devices()), ("model",))
    reference = lambda x, c_, s: (x[:, :q], jnp.concatenate([x[:, :c], x[:, :r]], -1))  # noqa: E731
    fn = lambda x, c_, s: ops.prologue(x, w, c_, s, 1e-6, reference, mesh=mesh)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(fn)(x, cos, sin))
    assert "shard_map" in jaxpr and ops.TARGET in jaxpr
    for g, want in zip(jax.jit(fn)(x, cos, sin), reference(x, cos, sin)):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(want, np.float32))
