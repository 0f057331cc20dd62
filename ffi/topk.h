// Fused log-softmax + top-k over the last axis (ffi/topk.cu; Python side: kdtree_jax/ops/topk.py).
//
// Semantics (those of jax.lax.top_k(jax.nn.log_softmax(logits.astype(f32) / temperature, axis=-1), k)):
//   logits   [..., V]  bf16 or f32 (every leading dim is a row: R = their product, R = 0 allowed)
//   attr temperature   f32 > 0 (1 = no scaling; else x / t, correctly rounded, as XLA divides)
//   values   [..., k]  f32   the k largest log-probs of the row, descending
//   indices  [..., k]  s32   their vocabulary ids; equal values: the lower id first (lax.top_k's order)
// 1 <= k <= min(V, kdtree::topk::kMaxK). Values equal XLA's up to the rounding of the log-sum-exp (a few ulp).
// NaN: a NaN logit is selected as if it were -inf, and its row's log-sum-exp, hence every value of the row, is NaN.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace kdtree::topk {
constexpr int kMaxK = 32;  // the largest k the kernel keeps in registers (ops/topk.py MAX_K)
}  // namespace kdtree::topk

#if defined(KDTREE_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_log_softmax_top_k_cuda);
#endif
