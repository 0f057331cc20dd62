// The MoE router's selection in one kernel (ffi/routing.cu; Python side: kdtree_jax/ops/routing.py).
//
// Semantics (those of kdtree_jax/ops/routing.py xla_route, DeepSeek-V3 / Kimi-K2 "noaux_tc" routing):
//   logits   [..., E]  f32 (every leading dim is a token: N = their product, N = 0 allowed)
//   bias     [E]       f32 (e_score_correction_bias; read only when use_bias)
//   attrs    top_k, n_group, topk_group (s64), scoring (s64: 0 sigmoid, 1 softmax), use_bias, norm_topk_prob (pred),
//            routed_scaling_factor (f32)
//   indices  [..., k]  s32  the chosen experts, best first (lax.top_k's order: larger choice first, equal ones by the
//                           lower index)
//   weights  [..., k]  f32  their unbiased scores, / (sum + 1e-20) when norm_topk_prob, * routed_scaling_factor
// score = sigmoid(x) = 1 / (1 + expf(-x)) or softmax over the row; choice = score + bias (use_bias) or score.  With
// 1 < n_group and topk_group < n_group, a group's score is the sum of its two largest choices (its one choice when a
// group holds one expert), the topk_group best groups are kept (equal scores: the lower group first) and the other
// groups' experts get choice -inf.  Choices and group scores are ordered by IEEE total order (positive NaN above +inf,
// negative NaN below -inf), as lax.top_k orders them on a CPU.
// Limits: 1 <= E <= kMaxExperts, 1 <= k <= min(E, kMaxK), E % n_group == 0, 1 <= topk_group <= n_group, and
// n_group <= kMaxGroups when grouping applies (ops/routing.py runs XLA past them).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace kdtree::routing {
constexpr int kMaxExperts = 512;  // ops/routing.py MAX_EXPERTS: four experts a thread, at most four warps a token
constexpr int kMaxK = 16;         // ops/routing.py MAX_K: the k best are lanes of one warp
constexpr int kMaxGroups = 16;    // ops/routing.py MAX_GROUPS: a group's keep flag is a lane of a ballot
}  // namespace kdtree::routing

#if defined(KDTREE_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_route_experts_cuda);
#endif
