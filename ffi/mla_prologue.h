// The MLA layer's prologue at decode sizes, fused (ffi/mla_prologue.cu; Python side: kdtree_jax/ops/mla_prologue.py).
//
// Semantics (those of kdtree_jax.model.mla: q_a_layernorm(q_a_proj(x)) and latent_rows(x), bias-free projections):
//   x        [N, H]      f32   the layer's normed input (its bfloat16 values)
//   w_qa     [H, Q]      bf16  q_a_proj's kernel
//   w_kva    [H, C + R]  bf16  kv_a_proj_with_mqa's kernel
//   q_norm   [Q]         bf16  q_a_layernorm's weight
//   kv_norm  [C]         bf16  kv_a_layernorm's weight
//   cos, sin [N, R]      f32   each token's rope tables (rotate-half layout)
//   q_out    [N, Q]      bf16  = q_norm * bf16(a * rsqrt(mean(a^2) + eps)),  a = bf16(x . w_qa) (in float32)
//   latent   [N, C + R]  bf16  = [kv_norm * bf16(c * rsqrt(mean(c^2) + eps)) | rope(k_pe)],  [c | k_pe] = bf16(x . w_kva)
// The products accumulate in float32 in a fixed order (the same bits whatever N is); the rest rounds as XLA's
// formulation does, up to the order of the squares' sum.  Bounds: N <= kMaxTokens, Q + C + R > 0, R even.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace kdtree::mla {
constexpr int kMaxTokens = 16;  // a token's row is recomputed from the weights per 4 tokens: decode sizes only
}  // namespace kdtree::mla

#if defined(KDTREE_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_mla_prologue_cuda);
#endif
