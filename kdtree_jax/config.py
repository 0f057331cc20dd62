"""The target's configuration: `ModelConfig` (with yarn `RopeScaling`), presets, HF `config.json` parsing, and
the mesh axis name. The drafter's `DrafterConfig` lives beside the drafter (model/drafter.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional

# The one mesh axis the model is split over (tensor parallel heads/MLPs, or expert parallel MoE).
MESH_AXIS = "model"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (HF `rope_scaling` / `rope_parameters`). factor 1 means plain rope."""

    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    original_max_position_embeddings: int = 4096
    attention_factor: Optional[float] = None
    truncate: bool = True


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# How the router picks experts (model/moe.py route): "noaux_tc" (DeepSeek-V3, Kimi K2: on score + bias, groups ranked
# by the sum of their two best), "greedy" (the best scores), "group_limited_greedy" (DeepSeek-V2: groups ranked by
# their best score).
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Every field of a DeepSeek-V3 / Kimi K2 `config.json` that the math needs."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int  # dense MLP layers (the first `first_k_dense_replace`)
    moe_intermediate_size: int
    q_lora_rank: Optional[int]  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    routed_scaling_factor: float
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rope_interleave: bool = True  # HF weights store the rope half interleaved
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        problems = []
        if self.n_routed_experts % max(self.n_group, 1):
            problems.append(f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})")
        if not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}]")
        if self.n_routed_experts and not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            problems.append(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, {self.n_routed_experts}]")
        if self.scoring_func not in ("sigmoid", "softmax"):
            problems.append(f"scoring_func must be 'sigmoid' or 'softmax'; got {self.scoring_func!r}")
        if self.topk_method not in TOPK_METHODS:
            problems.append(f"topk_method must be one of {', '.join(TOPK_METHODS)}; got {self.topk_method!r}")
        if self.hidden_act != "silu":
            problems.append(f"hidden_act must be 'silu'; got {self.hidden_act!r}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            problems.append(f"first_k_dense_replace ({self.first_k_dense_replace}) must be in [0, num_hidden_layers]")
        if self.qk_rope_head_dim % 2:
            problems.append(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    # Derived quantities -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Width of one latent cache row: [c_kv (kv_lora_rank) | rope(k_pe) (qk_rope_head_dim)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared (as HF and DeepSeek do)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        # HF's DeepseekV3 ignores moe_layer_freq (it is 1 in every released config); so do we.
        return layer >= self.first_k_dense_replace and self.n_routed_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # Construction --------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf_config(cls, path_or_dict: Any) -> "ModelConfig":
        """Read an HF `config.json` (a path to it, its directory, or the parsed dict).

        Both layouts are understood: the Hub's (`rope_scaling` + top-level `rope_theta`) and
        transformers >= 5's (`rope_parameters` holding both).
        """
        if isinstance(path_or_dict, dict):
            raw = dict(path_or_dict)
        else:
            path = os.fspath(path_or_dict)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.exists(path):
                raise ValueError(f"no config.json at {path}")
            with open(path) as f:
                raw = json.load(f)
        # Multimodal wrappers (Kimi K2.5/K2.6) nest the language model's config.
        if "text_config" in raw and "hidden_size" not in raw:
            raw = dict(raw["text_config"])
        return cls(**_fields_from_hf(raw))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


def rope_from_hf(raw: dict) -> tuple[float, Optional[RopeScaling]]:
    """(rope_theta, yarn scaling or None) from an HF config.json dict, either layout (`rope_scaling` + a
    top-level `rope_theta`, or transformers >= 5's `rope_parameters`); the target and an imported DFlash
    drafter read rope the same way. ValueError for a scaling type other than yarn."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "yarn":
        raise ValueError(f"unsupported rope scaling type {kind!r} (only 'yarn' and default rope are)")
    orig = merged.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 4096)
    return theta, RopeScaling(
        factor=float(merged["factor"]),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=float(merged.get("mscale") or 0.0),
        mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
        original_max_position_embeddings=int(orig),
        attention_factor=None if merged.get("attention_factor") is None else float(merged["attention_factor"]),
        truncate=bool(merged.get("truncate", True)),
    )


def _fields_from_hf(raw: dict) -> dict:
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    missing = [k for k in required if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {missing}: not a DeepSeek-V3 / Kimi K2 config")
    theta, scaling = rope_from_hf(raw)
    n_routed = int(raw.get("n_routed_experts") or 0)
    return dict(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=int(raw["num_attention_heads"]),
        intermediate_size=int(raw.get("intermediate_size", 4 * raw["hidden_size"])),
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
        qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
        v_head_dim=int(raw["v_head_dim"]),
        n_routed_experts=n_routed,
        num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0) if n_routed else 0,
        n_shared_experts=int(raw.get("n_shared_experts") or 0),
        first_k_dense_replace=int(raw.get("first_k_dense_replace", 0)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        scoring_func=str(raw.get("scoring_func", "sigmoid")),
        topk_method=str(raw.get("topk_method", "noaux_tc")),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_interleave=bool(raw.get("rope_interleave", True)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        attention_bias=bool(raw.get("attention_bias", False)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        hidden_act=str(raw.get("hidden_act", "silu")),
    )


_K2_YARN = RopeScaling(factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                       original_max_position_embeddings=4096)

KIMI_K2 = ModelConfig(
    vocab_size=163840, hidden_size=7168, num_hidden_layers=61, num_attention_heads=64,
    intermediate_size=18432, moe_intermediate_size=2048, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384,
    num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.827,
    n_group=1, topk_group=1, rope_theta=50000.0, rope_scaling=_K2_YARN, max_position_embeddings=131072,
)

DEEPSEEK_V3 = KIMI_K2.replace(
    vocab_size=129280, num_attention_heads=128, n_routed_experts=256, n_group=8, topk_group=4,
    first_k_dense_replace=3, routed_scaling_factor=2.5, rope_theta=10000.0, max_position_embeddings=163840,
    rope_scaling=RopeScaling(factor=40.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                             original_max_position_embeddings=4096),
)

# One rank of K2 under TP8: 8 of the 64 heads, the whole latent cache, each expert's intermediate split
# 8 ways (and the dense MLP's too). For single-GPU benchmarks of what one of 8 GPUs does.
KIMI_K2_TP8_RANK = KIMI_K2.replace(
    num_attention_heads=8, intermediate_size=18432 // 8, moe_intermediate_size=2048 // 8,
)

# Small enough for CPU tests, but with K2's structure: low-rank q, a dense first layer, grouped
# routing, a shared expert and yarn.
TINY = ModelConfig(
    vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
    moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=2.5, n_group=2, topk_group=1, rope_theta=10000.0,
    rope_scaling=RopeScaling(factor=4.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                             original_max_position_embeddings=64),
    max_position_embeddings=1024,
)

PRESETS = {
    "kimi-k2": KIMI_K2,
    "deepseek-v3": DEEPSEEK_V3,
    "kimi-k2-tp8-rank": KIMI_K2_TP8_RANK,
    "tiny": TINY,
}
