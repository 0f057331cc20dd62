"""Importing a DFlash drafter from its HF layout (a checkpoint written here in that layout)."""

import json

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from safetensors.numpy import save_file

import kdtree_jax
from kdtree_jax.config import RopeScaling
from kdtree_jax.convert_dflash import load_dflash_drafter
from kdtree_jax.model.drafter import DrafterConfig, init_drafter

TINY = kdtree_jax.ModelConfig.preset("tiny")
CFG = DrafterConfig(block_size=5, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                    target_layer_ids=(0, 2), rope_theta=50000.0, qk_norm=True, mask_token_id=7,
                    rope_scaling=RopeScaling(factor=8.0, beta_fast=32.0, beta_slow=1.0, mscale=0.0,
                                             mscale_all_dim=0.0, original_max_position_embeddings=32))


def _write_dflash(path, drafter, prefix="model.", extra=None):
    tensors = {}
    for p, var in nnx.to_flat_state(nnx.state(drafter)):
        parts = [str(x) for x in p]
        value = np.asarray(var.get_value(), np.float32)
        if parts[-1] == "kernel":
            value = value.T
        tensors[prefix + ".".join(parts[:-1] + ["weight"])] = np.ascontiguousarray(value)
    tensors.update(extra or {})
    save_file(tensors, str(path / "model.safetensors"))
    config = {"hidden_size": TINY.hidden_size, "num_hidden_layers": CFG.num_layers, "num_attention_heads": CFG.num_heads,
              "num_key_value_heads": CFG.num_kv_heads, "head_dim": CFG.head_dim, "intermediate_size": CFG.intermediate_size,
              "rms_norm_eps": 1e-6, "rope_theta": CFG.rope_theta, "block_size": CFG.block_size,
              "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32},
              "dflash_config": {"target_layer_ids": list(CFG.target_layer_ids), "mask_token_id": CFG.mask_token_id}}
    (path / "config.json").write_text(json.dumps(config))


def test_imported_drafter_proposes_exactly_what_the_original_does(tmp_path):
    target = kdtree_jax.init_model(TINY, seed=1)
    original = init_drafter(TINY, CFG, seed=2)
    _write_dflash(tmp_path, original)
    imported = load_dflash_drafter(str(tmp_path), TINY, dtype=jnp.float32)
    assert imported.cfg == CFG
    rng = np.random.default_rng(0)
    feats = jnp.asarray(rng.standard_normal((2, 1, 9, TINY.hidden_size)).astype(np.float32))
    # Both drafters through one jitted program (same structure): equal outputs mean equal weights, bit for bit. (Run
    # eagerly, every operation of the two calls is a program compiled on its own.)
    @jax.jit
    def propose(d, target, feats):
        cache = d.extend_context(d.init_cache(1, 16), feats, jnp.array([9]))
        return d(target, cache, jnp.array([3]), jnp.array([9]))

    outs = [np.asarray(propose(d, target, feats)) for d in (original, imported)]
    np.testing.assert_array_equal(outs[0], outs[1])


def test_unsupported_or_mismatched_checkpoints_are_refused(tmp_path):
    original = init_drafter(TINY, CFG, seed=2)
    (tmp_path / "a").mkdir()
    _write_dflash(tmp_path / "a", original, extra={"model.conv.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(ValueError, match="does not implement.*conv"):
        load_dflash_drafter(str(tmp_path / "a"), TINY)
    (tmp_path / "b").mkdir()
    _write_dflash(tmp_path / "b", original)
    with pytest.raises(ValueError, match="hidden_size"):
        load_dflash_drafter(str(tmp_path / "b"), TINY.replace(hidden_size=128))
