// Shared declarations of the verify-attention extension (see DESIGN.md, "The kernel contract").
//
// Semantics every implementation keeps (reference: kdtree_jax/ops/reference.py):
//   * positions [0, min(kv_len, Lmax)) of a sequence are valid; the last T of kv_len are the query tokens:
//     query token j sits at position first + j with first = kv_len - T;
//   * a position before `first` is visible to every query; query token j is visible to query i when bit j
//     of tree_mask[b, i, j / 32] is set;
//   * slots are clamped into [0, num_slots); a negative layer counts from the end (as JAX's dynamic
//     indexing does) and is then clamped into [0, num_layers): bad data never reads out of bounds;
//   * a query with nothing visible gets out = 0 and lse = -inf; lse is the natural log, float32.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace kdtree {

#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t clamp_layer(int64_t layer, int64_t num_layers) {
  if (layer < 0) layer += num_layers;
  return layer < 0 ? 0 : (layer >= num_layers ? num_layers - 1 : layer);
}

// Is position `pos` (already known to be < min(kv_len, Lmax)) visible to the query whose mask row is
// `mask_row` (ceil(T/32) words)?  `first` = kv_len - T, may be negative.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline bool position_visible(int64_t pos, int64_t first, int64_t num_queries, const uint32_t* mask_row) {
  const int64_t j = pos - first;
  if (j < 0) return true;             // prefix: seen by everybody
  if (j >= num_queries) return false;  // cannot happen for pos < kv_len; kept as a guard
  return (mask_row[j >> 5] >> (j & 31)) & 1u;
}

}  // namespace kdtree

// The FFI handlers (defined in verify_attention_cpu.cc and verify/api.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_verify_attention_cpu);
#if defined(KDTREE_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_verify_attention_cuda);
// Host helpers for the Python side (verify/api.cu).
namespace kdtree {
int cuda_sm_count(int device);  // multiprocessors of `device` (cached; -1 on error)
// The kernel variant (verify/params.h, Variant) that `variant` (0 = automatic) resolves to for `rows` = T*H query rows
// on `device`; -1 when it cannot run there.
int cuda_resolve_variant(int64_t variant, int64_t rows, int device);
}  // namespace kdtree
#endif
