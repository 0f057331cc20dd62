"""The MoE router's selection (DeepSeek-V3 / Kimi-K2 "noaux_tc" routing), one kernel on a GPU.

`route_experts(logits, bias, top_k=..., n_group=..., ...)` returns (indices [N, k] int32, weights [N, k] float32):

    scores  = sigmoid(logits) (or softmax over the experts), in float32
    choice  = scores + bias when use_bias (noaux_tc), else scores
    groups  (n_group > 1 and topk_group < n_group) a group's score is the sum of its two largest choices; the
            topk_group best groups are kept (lax.top_k's order), the other groups' experts get choice -inf
    indices = lax.top_k(choice, top_k): descending, equal choices by the lower index
    weights = the unbiased scores of those experts, / (their sum + 1e-20) when norm_topk_prob,
              * routed_scaling_factor

Why.  XLA ran this as ~6 small kernels a MoE layer on an H200 (a sort kernel of 5.6 us for one token over 384
experts, reduce fusions, multiplies): ~14 us a layer, 24 layers of a Kimi-K2 step.  On CUDA one kernel does it
(ffi/routing.cu): one block per token, scores and the group step in shared memory, the k best by warp shuffles over
64-bit (choice, index) keys.  Elsewhere (a CPU), and where the kernel does not apply (more than MAX_EXPERTS experts,
top_k > MAX_K, grouping over more than MAX_GROUPS groups, an extension built without CUDA), the XLA formulation
`xla_route` runs; `jax.lax.platform_dependent` picks the branch when the program is lowered.

How the CUDA op differs from the XLA formulation (ffi/routing.cu says why):
  * selection is exact on the float32 choices each computes; sigmoid is XLA's formula 1 / (1 + exp(-x)) with CUDA's
    accurate expf, so a score may differ from XLA's by the rounding of exp (an ulp or two), which can flip a near-tie
    (two choices within an ulp or two); the softmax's sum is added in another order (a few ulp);
  * weights: the k-sum of the norm is added in another order (~1 ulp);
  * NaN: choices and group scores are ordered by IEEE total order (a positive NaN above +inf, a negative NaN below
    -inf), lax.top_k's order on a CPU (XLA's GPU TopK is not pinned for NaN); indices are always valid and distinct.
    A NaN logit's score (softmax: the whole row's) and weights are NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.ops.ffi import register_cuda_handler  # the CUDA op lives in the verify op's extension

TARGET = "kdtree_route_experts"
# The kernel's limits (ffi/routing.h); "auto" runs XLA past them.
MAX_EXPERTS = 512
MAX_K = 16
MAX_GROUPS = 16
IMPLS = ("auto", "xla", "cuda")
SCORING = {"sigmoid": 0, "softmax": 1}


def cuda_built() -> bool:
    """True when the extension holds the CUDA handler (registered on first use)."""
    return register_cuda_handler(TARGET, "route_experts_cuda_handler")


def grouping_applies(n_group: int, topk_group: int) -> bool:
    """Whether the group step runs (only then do n_group and topk_group matter)."""
    return n_group > 1 and topk_group < n_group


def xla_route(logits, bias, *, top_k: int, n_group: int = 1, topk_group: int = 1, scoring: str = "sigmoid",
              use_bias: bool = True, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
    """The XLA formulation (the reference; what model/moe.py `route` computed before the kernel)."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores + bias.astype(jnp.float32) if use_bias else scores
    num_tokens, num_experts = choice.shape
    if grouping_applies(n_group, topk_group):
        grouped = choice.reshape(num_tokens, n_group, num_experts // n_group)
        top2 = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)  # [N, G]
        _, best_groups = jax.lax.top_k(top2, topk_group)
        keep = jnp.zeros((num_tokens, n_group), bool).at[jnp.arange(num_tokens)[:, None], best_groups].set(True)
        # Experts of excluded groups can never be chosen (-inf, as in transformers >= 5 and DeepSeek's code).
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)
    _, indices = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return indices.astype(jnp.int32), weights * routed_scaling_factor


def cuda_route(logits, bias, *, top_k: int, n_group: int = 1, topk_group: int = 1, scoring: str = "sigmoid",
               use_bias: bool = True, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
    """The CUDA op itself (ffi/routing.cu; lowers for a GPU only), within the kernel's limits (`kernel_applies`)."""
    if not cuda_built():  # also registers the target: a first call here must find it
        raise ValueError("route_experts: the CUDA op needs the extension built with nvcc; this one has none")
    num_tokens = logits.shape[0]
    if not grouping_applies(n_group, topk_group):
        n_group = topk_group = 1
    out_types = (jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32),
                 jax.ShapeDtypeStruct((num_tokens, top_k), jnp.float32))
    call = jax.ffi.ffi_call(TARGET, out_types, vmap_method="sequential")
    return call(logits.astype(jnp.float32), bias.astype(jnp.float32), top_k=np.int64(top_k),
                n_group=np.int64(n_group), topk_group=np.int64(topk_group), scoring=np.int64(SCORING[scoring]),
                use_bias=np.bool_(use_bias), norm_topk_prob=np.bool_(norm_topk_prob),
                routed_scaling_factor=np.float32(routed_scaling_factor))


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def validate_args(logits, bias, top_k, n_group, topk_group, scoring, routed_scaling_factor, impl="auto") -> None:
    """Static checks with one-line errors that name the argument (no device work)."""
    if impl not in IMPLS:
        raise ValueError(f"route_experts: impl must be one of {IMPLS}; got {impl!r}")
    if jnp.ndim(logits) != 2:
        raise ValueError(f"route_experts: logits must be [N, E]; got shape {jnp.shape(logits)}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"route_experts: logits must be floating point; got {logits.dtype}")
    num_experts = logits.shape[1]
    if tuple(jnp.shape(bias)) != (num_experts,) or not jnp.issubdtype(jnp.result_type(bias), jnp.floating):
        raise ValueError(f"route_experts: bias must be floating point [E={num_experts}]; got shape {jnp.shape(bias)}")
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"route_experts: top_k must be an int in [1, E={num_experts}]; got {top_k!r}")
    if not _is_int(n_group) or n_group < 1 or num_experts % n_group:
        raise ValueError(f"route_experts: n_group must be an int >= 1 dividing E={num_experts}; got {n_group!r}")
    if not _is_int(topk_group) or not 1 <= topk_group <= n_group:
        raise ValueError(f"route_experts: topk_group must be an int in [1, n_group={n_group}]; got {topk_group!r}")
    if scoring not in SCORING:
        raise ValueError(f"route_experts: scoring must be one of {tuple(SCORING)}; got {scoring!r}")
    if not isinstance(routed_scaling_factor, (int, float, np.floating, np.integer)) or isinstance(
            routed_scaling_factor, bool):
        raise ValueError(f"route_experts: routed_scaling_factor must be a Python float; got {routed_scaling_factor!r}")
    if impl == "cuda" and not within_limits(num_experts, top_k, n_group, topk_group):
        raise ValueError(f"route_experts: impl='cuda' takes E <= {MAX_EXPERTS}, top_k <= {MAX_K} and n_group <= "
                         f"{MAX_GROUPS} when grouping; got E={num_experts}, top_k={top_k}, n_group={n_group}")


def within_limits(num_experts: int, top_k: int, n_group: int, topk_group: int) -> bool:
    return (1 <= num_experts <= MAX_EXPERTS and 1 <= top_k <= min(MAX_K, num_experts)
            and (not grouping_applies(n_group, topk_group) or n_group <= MAX_GROUPS))


def kernel_applies(logits, top_k: int, n_group: int, topk_group: int) -> bool:
    """Whether the shapes are within the CUDA kernel's limits (and the extension has it)."""
    return within_limits(logits.shape[-1], top_k, n_group, topk_group) and cuda_built()


def route_experts(logits, bias, *, top_k: int, n_group: int = 1, topk_group: int = 1, scoring: str = "sigmoid",
                  use_bias: bool = True, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                  impl: str = "auto"):
    """(indices [N, k] int32, weights [N, k] float32): each token's top_k experts and their weights (module doc).

    impl: "auto" = the CUDA op when lowered for a GPU and `kernel_applies`, the XLA formulation otherwise; "xla" = the
    XLA formulation everywhere; "cuda" = the CUDA op on a GPU (errors past the kernel's limits), XLA elsewhere."""
    validate_args(logits, bias, top_k, n_group, topk_group, scoring, routed_scaling_factor, impl)
    kwargs = dict(top_k=int(top_k), n_group=int(n_group), topk_group=int(topk_group), scoring=scoring,
                  use_bias=bool(use_bias), norm_topk_prob=bool(norm_topk_prob),
                  routed_scaling_factor=float(routed_scaling_factor))
    xla = functools.partial(xla_route, **kwargs)
    if impl == "xla" or not kernel_applies(logits, top_k, n_group, topk_group):  # (impl="cuda" CPU-only: XLA too)
        return xla(logits, bias)
    return with_xla_derivative(functools.partial(cuda_route, **kwargs), xla)(logits, bias)


def with_xla_derivative(cuda, xla):
    """(logits, bias) -> cuda's result when lowered for a GPU, xla's elsewhere; differentiated as xla is.

    The kernel has no derivative, and differentiating `platform_dependent` differentiates every branch, so without
    this a training step (which differentiates the router's weights) fails at trace time. The two branches compute
    the same function, so the XLA formulation's derivative is the kernel's too."""

    @jax.custom_jvp
    def routed(logits, bias):
        return jax.lax.platform_dependent(logits, bias, cuda=cuda, default=xla)

    @routed.defjvp
    def routed_jvp(primals, tangents):
        return jax.jvp(xla, primals, tangents)

    return routed


__all__ = ["route_experts", "xla_route", "cuda_route", "cuda_built", "kernel_applies", "grouping_applies",
           "MAX_EXPERTS", "MAX_K", "MAX_GROUPS", "IMPLS", "SCORING"]
