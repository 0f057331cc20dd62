"""The MoE router's expert choice after its product, one kernel on a GPU.

`choose_experts(router_logits, bias, cfg)` returns (indices [T, k] int32, weights [T, k] float32) with the semantics
of `kdtree_jax.model.moe.route` (DeepSeek-V3 / Kimi K2: sigmoid or softmax scores, chosen on score + bias, the best
groups first, weighted by the normalised unbiased scores times routed_scaling_factor), which stays the reference and
runs everywhere the kernel does not (a CPU, more than MAX_EXPERTS experts, an extension built without CUDA).

Why.  XLA ran the choice as a chain of small kernels around a TopK it lowers to a sort of each token's scores: the
sort alone took 5.7 us a layer in the Kimi-K2 TP8-rank step at T = 1 on an H200 (b64d7bb), ~10 us a layer with its
neighbours, for ~1.5 KB of scores a token.  ffi/moe_route.cu does it in one warp per token.

How the CUDA op differs from `route`: the weights' normalising sum (and softmax's denominator) may be added in
another order (a few ulp); a NaN choice counts as -inf.  Indices are chosen by the same order (larger first, equal
ones by the lower id), on scores that round as XLA's do.
"""

from __future__ import annotations

import jax
import numpy as np

from kdtree_jax.ops.ffi import register_cuda_handler  # the CUDA op lives in the verify op's extension

TARGET = "kdtree_moe_route"
MAX_EXPERTS = 1024  # ffi/moe_route.h kMaxExperts: a token's scores live in a warp's registers
MAX_GROUPS = 64
MAX_K = 32


def cuda_built() -> bool:
    """True when the extension holds the CUDA handler (registered on first use)."""
    return register_cuda_handler(TARGET, "moe_route_cuda_handler")


def kernel_applies(num_experts: int, cfg) -> bool:
    """Whether the router's sizes are within the kernel's limits (and the extension has it). The kernel ranks groups
    as noaux_tc does (the sum of their two best choices): DeepSeek-V2's group_limited_greedy keeps `route`."""
    grouped = cfg.n_group > 1 and cfg.topk_group < cfg.n_group
    return (num_experts <= MAX_EXPERTS and cfg.num_experts_per_tok <= min(MAX_K, num_experts)
            and cfg.n_group <= MAX_GROUPS and not (grouped and cfg.topk_method == "group_limited_greedy")
            and cuda_built())


def cuda_choose_experts(router_logits, bias, cfg):
    """The CUDA op itself (lowers for a GPU only): router_logits [T, E] float32, bias [E] float32."""
    if not cuda_built():  # also registers the target: a first call here must find it
        raise ValueError("choose_experts: the CUDA op needs the extension built with nvcc; this one has none")
    num_tokens, k = router_logits.shape[0], cfg.num_experts_per_tok
    grouped = cfg.n_group > 1 and cfg.topk_group < cfg.n_group
    out_types = (jax.ShapeDtypeStruct((num_tokens, k), np.int32), jax.ShapeDtypeStruct((num_tokens, k), np.float32))
    call = jax.ffi.ffi_call(TARGET, out_types, vmap_method="sequential")
    return call(router_logits.astype(np.float32), bias.astype(np.float32), top_k=np.int64(k),
                n_group=np.int64(cfg.n_group if grouped else 1), topk_group=np.int64(cfg.topk_group if grouped else 1),
                sigmoid=cfg.scoring_func == "sigmoid", with_bias=cfg.topk_method == "noaux_tc",
                normalize=bool(cfg.norm_topk_prob), scale=np.float32(cfg.routed_scaling_factor))


def choose_experts(router_logits, bias, cfg, reference):
    """(indices, weights) of `reference` (model/moe.py `route`, called as reference(logits, bias, cfg)), by the CUDA
    op when lowered for a GPU and `kernel_applies`; `jax.lax.platform_dependent` picks the branch at lowering."""
    if not kernel_applies(router_logits.shape[-1], cfg):
        return reference(router_logits, bias, cfg)
    return jax.lax.platform_dependent(router_logits, bias, cuda=lambda l, b: cuda_choose_experts(l, b, cfg),
                                      default=lambda l, b: reference(l, b, cfg))


__all__ = ["choose_experts", "cuda_choose_experts", "cuda_built", "kernel_applies", "MAX_EXPERTS"]
