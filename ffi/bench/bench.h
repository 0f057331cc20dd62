// The benchmark target's functions (module kdtree_jax._kernel_bench): ceilings and the verify kernels timed outside XLA.
#pragma once

#include <cstdint>
#include <vector>

namespace kdtree {
double bench_mma_sync_tflops(int device);                      // mma.sync m16n8k16 bf16 rate, fp32 accumulate
double bench_copy_gbps(int device, int64_t bytes, int iters);  // cudaMemcpy D2D, (read + written) / s
int cuda_sm_count(int device);                                 // (verify/api.cu)
// The verify kernels of `variant` (verify/params.h; 0 = automatic) timed with CUDA events, µs per call: {plain
// launches, CUDA graph replay, main kernel alone, merge alone}; -1 where something failed.
std::vector<double> bench_verify_attention(int64_t batch, int64_t num_queries, int64_t num_heads, int64_t length,
                                           int64_t num_splits, int64_t variant, bool scattered, int iters);
}  // namespace kdtree
