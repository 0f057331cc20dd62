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
#include <vector>

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

// The FFI handlers (defined in verify_attention_cpu.cc and verify_attention.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_verify_attention_cpu);
#if defined(KDTREE_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_verify_attention_cuda);
// Helpers for the Python side and the benchmarks (bench.cu / verify_attention.cu).
namespace kdtree {
int cuda_sm_count(int device);                 // multiprocessors of `device` (cached; -1 on error)
double bench_mma_sync_tflops(int device);      // mma.sync m16n8k16 bf16 rate, fp32 accumulate
double bench_copy_gbps(int device, int64_t bytes, int iters);  // cudaMemcpy D2D, (read + written) / s
// The verify kernels timed with CUDA events outside XLA, per call in µs: {plain launches, CUDA graph replay, main
// kernel alone, merge alone}; -1 where something failed (verify_attention.cu).
std::vector<double> bench_verify_attention(int64_t batch, int64_t num_queries, int64_t num_heads, int64_t length,
                                           int64_t num_splits, int64_t row_groups, int64_t variant, bool scattered,
                                           int iters);
// The main kernel's block timeline of one call after `warmup` others: {start, end} per block, µs since the first
// start (%globaltimer); empty on failure (verify_attention.cu).
std::vector<double> bench_verify_block_times(int64_t batch, int64_t num_queries, int64_t num_heads, int64_t length,
                                             int64_t num_splits, int64_t row_groups, int64_t variant, bool scattered,
                                             int warmup);
}  // namespace kdtree
#endif
