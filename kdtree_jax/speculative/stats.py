"""`generate`'s statistics from the decode loop's final state and the timings: tokens per step and per second, the
acceptance by depth, the router's expert load, the adaptive budget's summary and the step profile."""

from __future__ import annotations

from typing import Optional

import numpy as np

from kdtree_jax.speculative import budget_policy
from kdtree_jax.speculative.step import ExpertLoad, LoopState, SpecConfig


def expert_load_stats(load: ExpertLoad, steps: int) -> dict:
    """Per-step means of the router statistics, per MoE layer and overall."""
    if load.slot_tokens.shape[0] == 0 or steps == 0:
        return {}
    device_tokens = np.asarray(load.device_tokens) / steps
    device_active = np.asarray(load.device_active) / steps
    imbalance = np.asarray(load.imbalance) / steps
    return {
        "devices": int(device_tokens.shape[1]),
        "tokens_per_device_per_step": device_tokens.mean(0).round(3).tolist(),
        "active_experts_per_device_per_step": device_active.mean(0).round(3).tolist(),
        "max_over_mean_device_tokens": float(imbalance.mean()),
        "max_over_mean_by_layer": imbalance.round(4).tolist(),
        "slot_tokens": np.asarray(load.slot_tokens).tolist(),  # [n_moe, slots] totals, for EPLB
    }


def generate_stats(final: LoopState, tokens: list, spec: SpecConfig, num_nodes: int, *, t_prefill: float, t_compile: float,
           t_decode: float, step_profile: Optional[dict]) -> dict:
    """`GenerateResult.stats` from the loop's final state and the timings."""
    width = final.accepted_hist.shape[0]
    hist = np.asarray(final.accepted_hist).astype(np.int64)
    seq_steps = int(hist.sum())
    new_tokens = sum(len(t) for t in tokens)
    stats = {
        "steps": int(final.step),
        "sequence_steps": seq_steps,
        "tau": float((hist * (np.arange(width) + 1)).sum() / seq_steps) if seq_steps else float("nan"),
        # P(at least d drafted tokens accepted in a step), d = 1..D
        "acceptance_by_depth": [float(hist[d:].sum() / seq_steps) if seq_steps else float("nan")
                                for d in range(1, width)],
        "new_tokens": new_tokens,
        "prefill_seconds": t_prefill,
        "compile_seconds": t_compile,
        "decode_seconds": t_decode,
        # Tokens from the decode loop (the first token of each sequence comes from the prefill).
        "tokens_per_second": (new_tokens - len(tokens)) / t_decode if t_decode > 0 else float("nan"),
        "tree": spec.tree if isinstance(spec.tree, str) else list(spec.tree),
        "budget": num_nodes - 1,  # tree nodes besides the root
        "tree_temperature": spec.tree_temperature,
        "num_nodes": num_nodes,
        "expert_load": expert_load_stats(final.expert_load, int(final.step)),
    }
    if spec.menu and final.policy is not None:
        stats["budget"] = "auto"
        stats["budget_policy"] = budget_policy.summary(final.policy, spec.menu)
    if step_profile is not None:
        step_ms = t_decode / max(int(final.step), 1) * 1e3
        stats["profile"] = {**step_profile, "step_ms": step_ms, "idle_ms": step_ms - step_profile["busy_ms"]}
    return stats
