"""Our model loaded from tiny HF DeepseekV3 checkpoints reproduces transformers' own forward.

The checkpoints and reference logits were made once by tests/fixtures/make_hf_tiny.py (torch +
transformers); CI needs neither.
"""

import json
import os
import shutil

import numpy as np
import jax.numpy as jnp
import pytest
from safetensors.numpy import load_file, save_file

import kdtree_jax
from kdtree_jax.config import ModelConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
CHECKPOINTS = ["hf_tiny_k2", "hf_tiny_v3"]


def _max_rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_match_transformers(name):
    path = os.path.join(FIXTURES, name)
    ref = np.load(os.path.join(path, "reference.npz"))
    cfg, model = kdtree_jax.load_hf(path, dtype=jnp.float32)
    logits = np.asarray(kdtree_jax.forward_logits(model, ref["input_ids"]))
    assert logits.shape == ref["logits"].shape
    assert _max_rel_err(logits, ref["logits"]) < 1e-3


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_hidden_states_match_transformers(name):
    """The hidden states the drafter will consume are HF's per-layer outputs (before the final norm)."""
    path = os.path.join(FIXTURES, name)
    ref = np.load(os.path.join(path, "reference.npz"))
    cfg, model = kdtree_jax.load_hf(path, dtype=jnp.float32)
    ids = ref["input_ids"]
    cache = kdtree_jax.init_cache(cfg, ids.shape[0], ids.shape[1], dtype=jnp.float32)
    layers = tuple(range(cfg.num_hidden_layers - 1))  # HF's last entry is after the final norm
    _, hidden, _ = kdtree_jax.prefill(model, cache, ids, hidden_layers=layers, chunk_size=ids.shape[1])
    for i in layers:
        assert _max_rel_err(np.asarray(hidden[i]), ref["hidden_states"][i + 1]) < 1e-3


def test_both_config_layouts_parse_to_the_same_config():
    """transformers >= 5 writes `rope_parameters`; the Hub's files have `rope_scaling` + `rope_theta`."""
    with open(os.path.join(FIXTURES, "hf_tiny_k2", "config.json")) as f:
        v5 = json.load(f)
    assert "rope_parameters" in v5
    hub = {k: v for k, v in v5.items() if k != "rope_parameters"}
    params = dict(v5["rope_parameters"])
    hub["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    hub["rope_scaling"] = params
    a, b = ModelConfig.from_hf_config(v5), ModelConfig.from_hf_config(hub)
    assert a == b
    assert a.rope_theta == 50000.0 and a.rope_scaling.factor == 32.0


def test_shape_mismatch_names_the_tensor(tmp_path):
    src = os.path.join(FIXTURES, "hf_tiny_k2")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        cfg = json.load(f)
    cfg["moe_intermediate_size"] = 32  # the weights say 24
    with open(dst / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"shape mismatch.*experts"):
        kdtree_jax.load_hf(str(dst), dtype=jnp.float32)


def test_missing_tensor_is_named(tmp_path):
    src = os.path.join(FIXTURES, "hf_tiny_v3")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.2\.mlp\.gate\.e_score_correction_bias"):
        kdtree_jax.load_hf(str(dst), dtype=jnp.float32)
