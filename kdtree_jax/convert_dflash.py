"""Import a DFlash block drafter from its HF layout (config.json + safetensors), e.g. z-lab's drafters for
Kimi K2.5 / Qwen3, into our `Drafter`.

What the public checkpoints show (issue 5's survey): Qwen3-style layers (per-head q/k RMSNorm before
rope, no biases), `fc` projecting the concatenated target features, `hidden_norm`, a final `norm`, yarn
rope, `block_size`, and `dflash_config: {target_layer_ids, mask_token_id}`; the block input is
[bonus, mask_token_id, ...] embedded with the target's table. Their key names are ours:
`fc.weight`, `hidden_norm.weight`, `layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm,
post_attention_layernorm, mlp.{gate,up,down}_proj}.weight`, `norm.weight` (a `model.` prefix is accepted).

Assumed, not verified against DFlash's own forward (no reference model runs here): `target_layer_ids[i]`
names the output of target layer i (HF's hidden_states[i + 1]), as in our target's `hidden_layers`.
DFlash2 extras (grouped convolution, candidate selector, logit soft-cap) are refused, not ignored.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax.config import ModelConfig, rope_from_hf
from kdtree_jax.convert_hf import SafetensorsDir, preview_names
from kdtree_jax.model.drafter import Drafter, DrafterConfig

UNSUPPORTED_KEYS = ("conv", "selector", "softcap", "output_multiplier")


def dflash_config(raw: dict) -> DrafterConfig:
    """DrafterConfig from a DFlash config.json dict."""
    extra = raw.get("dflash_config") or {}
    theta, scaling = rope_from_hf(raw)
    heads = int(raw["num_attention_heads"])
    return DrafterConfig(
        block_size=int(extra.get("block_size", raw.get("block_size", 16))),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        intermediate_size=int(raw["intermediate_size"]),
        target_layer_ids=tuple(int(i) for i in extra["target_layer_ids"]) if "target_layer_ids" in extra else None,
        rope_theta=theta,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        qk_norm=True,
        rope_scaling=scaling,
        mask_token_id=None if extra.get("mask_token_id") is None else int(extra["mask_token_id"]),
    )


def load_dflash_drafter(path: str, target_cfg: ModelConfig, dtype=jnp.bfloat16) -> Drafter:
    """A `Drafter` holding a DFlash checkpoint's weights, shaped for the target `target_cfg`."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    if int(raw["hidden_size"]) != target_cfg.hidden_size:
        raise ValueError(f"the drafter's hidden_size ({raw['hidden_size']}) must equal the target's "
                         f"({target_cfg.hidden_size}): it shares the target's embedding and lm head")
    cfg = dflash_config(raw)
    tensors = SafetensorsDir(path)
    names = {k[len("model."):] if k.startswith("model.") else k: k for k in tensors.keys()}
    odd = [k for k in names if any(u in k for u in UNSUPPORTED_KEYS)]
    if odd:
        raise ValueError(f"DFlash features this drafter does not implement: {preview_names(sorted(odd))}")

    abstract = nnx.eval_shape(lambda: Drafter(target_cfg, cfg, dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    used, missing, mismatched = set(), [], []
    values = []
    for p, var in flat:
        parts = [str(x) for x in p]
        key = ".".join(parts[:-1] + ["weight"])
        if key not in names:
            missing.append(key)
            values.append(None)
            continue
        used.add(key)
        value = np.asarray(tensors.get(names[key]), np.float32)
        if parts[-1] == "kernel":
            value = value.T  # HF stores [out, in]
        if tuple(value.shape) != tuple(var.get_value().shape):
            mismatched.append(f"{key}: {tuple(value.shape)} vs expected {tuple(var.get_value().shape)}")
        values.append(value)
    leftover = sorted(k for k in names if k not in used)
    problems = [f"{n} {what}: {preview_names(items)}" for n, what, items in
                ((len(missing), "missing", missing), (len(mismatched), "mis-shaped", mismatched),
                 (len(leftover), "unexpected", leftover)) if items]
    if problems:
        raise ValueError(f"DFlash checkpoint {path}: " + "; ".join(problems))
    for (p, var), value in zip(flat, values):
        var.set_value(jnp.asarray(value, dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
