"""Load HF DeepSeek-V3 / Kimi K2 checkpoints (config.json + *.safetensors) into the Flax model.

Parameter names mirror HF's, so each model parameter maps to one HF key (routed experts: one key per
expert, stacked here). Linear weights are stored [out, in] by HF and [in, out] by Flax. The rope part of
q and of k_pe is stored interleaved in HF weights; we permute those output rows once at load time so the
forward pass uses rotate-half rope without any per-token permutation.
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from kdtree_jax.config import ModelConfig
from kdtree_jax.model.layers import deinterleave_permutation
from kdtree_jax.model.transformer import Transformer

# Wrappers (Kimi K2.5 / K2.6) nest the language model under a prefix.
KEY_PREFIXES = ("language_model.",)
# Present in some checkpoints, not parameters of ours.
IGNORED_KEYS = re.compile(r".*rotary_emb\.inv_freq$")


class SafetensorsDir:
    """Lazy access to every tensor of a checkpoint directory, one tensor at a time."""

    def __init__(self, path: str):
        self.path = path
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {path}")
        self.key_file: dict[str, str] = {}
        for f in files:
            with safe_open(f, framework="numpy") as st:
                for k in st.keys():
                    self.key_file[self._normalise(k)] = (f, k)

    @staticmethod
    def _normalise(key: str) -> str:
        for prefix in KEY_PREFIXES:
            if key.startswith(prefix):
                return key[len(prefix):]
        return key

    def keys(self) -> Iterable[str]:
        return self.key_file.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.key_file

    def get(self, key: str) -> jax.Array:
        f, raw_key = self.key_file[key]
        # The flax framework reads bf16 (numpy cannot).
        with safe_open(f, framework="flax") as st:
            return st.get_tensor(raw_key)


def hf_keys_for(path: tuple, cfg: ModelConfig) -> list[str]:
    """HF key(s) of one model parameter, given its NNX path like ('layers', 3, 'mlp', 'experts', 'up_proj')."""
    parts = [str(p) for p in path]
    if parts[0] == "lm_head":
        return ["lm_head.weight"]
    if parts[-2] == "experts":  # stacked routed experts
        stem = "model." + ".".join(parts[:-1])
        return [f"{stem}.{e}.{parts[-1]}.weight" for e in range(cfg.n_routed_experts)]
    leaf = {"kernel": "weight", "embedding": "weight"}.get(parts[-1], parts[-1])
    return ["model." + ".".join(parts[:-1] + [leaf])]


def _deinterleave_rows(w_out_in, cfg: ModelConfig, per_head: bool):
    """Permute the rope output rows of an [out, in] HF weight (or [out] bias) to rotate-half order."""
    rope = cfg.qk_rope_head_dim
    perm = deinterleave_permutation(rope)
    if per_head:  # q: each head is [nope | rope]
        w = w_out_in.reshape(cfg.num_attention_heads, cfg.qk_head_dim, *w_out_in.shape[1:])
        w = jnp.concatenate([w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:][:, perm]], axis=1)
        return w.reshape(w_out_in.shape)
    # kv_a_proj_with_mqa: [c_kv (kv_lora_rank) | k_pe (rope)]
    return jnp.concatenate([w_out_in[: cfg.kv_lora_rank], w_out_in[cfg.kv_lora_rank:][perm]], axis=0)


def hf_to_param(path: tuple, tensors: list, cfg: ModelConfig):
    """Turn the HF tensor(s) of one parameter into its Flax layout."""
    name = path[-1]
    module = path[-2] if len(path) > 1 else ""
    if module == "experts":  # [I, H] per expert -> [E, H, I] (gate/up) or [E, I, H] (down)
        return jnp.stack([t.T for t in tensors])
    (t,) = tensors
    if cfg.rope_interleave and module in ("q_b_proj", "q_proj") and name in ("kernel", "bias"):
        t = _deinterleave_rows(t, cfg, per_head=True)
    if cfg.rope_interleave and module == "kv_a_proj_with_mqa" and name in ("kernel", "bias"):
        t = _deinterleave_rows(t, cfg, per_head=False)
    return t.T if name == "kernel" else t


def load_hf(path: str, dtype=jnp.bfloat16) -> tuple[ModelConfig, Transformer]:
    """config + model from an HF checkpoint directory (unquantized safetensors).

    Every expected tensor must be present with the right shape; missing, mis-shaped and unexpected
    tensors are all reported in one ValueError.
    """
    cfg = ModelConfig.from_hf_config(path)
    tensors = SafetensorsDir(path)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)

    used, missing, mismatched, values = set(), [], [], []
    for p, var in flat:
        keys = hf_keys_for(p, cfg)
        absent = [k for k in keys if k not in tensors]
        if absent:
            missing.extend(absent)
            values.append(None)
            continue
        used.update(keys)
        value = hf_to_param(p, [tensors.get(k) for k in keys], cfg)
        if tuple(value.shape) != tuple(var.shape):
            mismatched.append(f"{keys[0] if len(keys) == 1 else keys[0] + ' (+ other experts)'}: "
                              f"checkpoint gives {tuple(value.shape)} in our layout, config expects {tuple(var.shape)}")
            values.append(None)
            continue
        values.append(value.astype(var.dtype))

    layer_re = re.compile(r"^model\.layers\.(\d+)\.")
    leftover = sorted(k for k in tensors.keys() if k not in used and not IGNORED_KEYS.match(k)
                      # Layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer) are not ours.
                      and not (layer_re.match(k) and int(layer_re.match(k).group(1)) >= cfg.num_hidden_layers))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {_preview(missing)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es): {_preview(mismatched)}")
    if leftover:
        problems.append(f"{len(leftover)} unexpected tensor(s): {_preview(leftover)}")
    if problems:
        raise ValueError(f"checkpoint {path} does not match its config.json: " + "; ".join(problems))

    for (p, var), value in zip(flat, values):
        var.set_value(value) if hasattr(var, "set_value") else setattr(var, "value", value)
    return cfg, nnx.merge(graphdef, nnx.from_flat_state(flat))


def _preview(items: list, n: int = 8) -> str:
    shown = ", ".join(items[:n])
    return shown + (f", ... ({len(items) - n} more)" if len(items) > n else "")
