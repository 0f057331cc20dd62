// The MoE router's expert choice after its product, fused (ffi/moe_route.cu; Python side: kdtree_jax/ops/route.py).
//
// Semantics (those of kdtree_jax.model.moe.route, DeepSeek-V3 / Kimi K2 routing):
//   logits   [T, E]  f32   the router's product
//   bias     [E]     f32   e_score_correction_bias (read only with attr with_bias)
//   scores = sigmoid(logits) (attr sigmoid) or softmax over E; the choice = scores + bias (with_bias) or scores
//   groups (n_group > 1, topk_group < n_group): the topk_group groups of E / n_group experts with the largest sums of
//            their two best choices are kept, the other groups' experts never chosen
//   indices  [T, k]  s32   the k best choices, descending, equal ones by the lower id (lax.top_k's order)
//   weights  [T, k]  f32   the chosen experts' scores, over their sum + 1e-20 (attr normalize), times attr scale
// Bounds: 1 <= E <= kMaxExperts, 1 <= k <= min(E, kMaxK), 1 <= n_group <= kMaxGroups dividing E.  A NaN choice
// counts as -inf.  Scores round as XLA's; the weights' sum (and softmax's) may be added in another order (a few ulp).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace kdtree::route {
constexpr int kMaxExperts = 1024;  // a token's scores and choices live in a warp's registers (ops/route.py MAX_EXPERTS)
constexpr int kMaxGroups = 64;
constexpr int kMaxK = 32;
}  // namespace kdtree::route

#if defined(KDTREE_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_moe_route_cuda);
#endif
