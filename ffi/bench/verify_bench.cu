// bench_verify_attention: the kernels timed with CUDA events outside XLA (a benchmark helper; never called by the
// op).  Random bf16 inputs (uniform in [-1, 1)), a causal tree mask, kv_lens = length, a pool of several layers
// (about 512 MB, at least 2) with consecutive calls on consecutive layers, as benchmarks/verify_kernel.py does.
// bench_verify_attention: the verify kernels timed with CUDA events outside XLA (the benchmark target; never part of
// the op). Random bf16 inputs (uniform in [-1, 1)), a causal tree mask, kv_lens = length, a pool of several layers
// (about 512 MB, at least 2) with consecutive calls on consecutive layers, as benchmarks/verify_kernel.py does.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "../verify/kernels.h"
#include "bench.h"

namespace kdtree {
using verify::kLatent;
using verify::kLog2e;
using verify::kMaxSplits;
using verify::kWidth;
using verify::Params;
}  // namespace kdtree

namespace {
int current_device() {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess ? device : 0;
}
__global__ void fill_random_bf16(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA77u ^ seed;
    h ^= h >> 15; h *= 0x2C1B3C6Du; h ^= h >> 12; h *= 0x297A2D39u; h ^= h >> 15;
    const float x = static_cast<float>(h >> 8) * (2.f / 16777216.f) - 1.f;
    p[i] = static_cast<uint16_t>(__float_as_uint(x) >> 16);
  }
}
}  // namespace

namespace kdtree {
namespace {
// One harness case on the device: random bf16 q and pool (several layers, about 512 MB, at least 2), the slot table
// (shuffled when `scattered`), kv_lens = length, a causal tree mask, the outputs and the split partials, and Params
// pointing at them (p.layer left for the caller: `layers` holds 0, 1, ...). `ok` is false when the sizes are out of
// range or an allocation or copy failed; the buffers are freed with the case.
struct BenchCase {
  Params p{};
  int64_t num_layers = 0;
  int32_t* layers = nullptr;
  bool ok = true;
  std::vector<void*> buffers;

  BenchCase(int64_t batch, int64_t num_queries, int64_t num_heads, int64_t length, int64_t num_splits,
            int64_t variant, bool scattered) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || batch < 1 ||
        num_queries < 1 || num_heads < 1 || length < num_queries || num_splits < 1 || num_splits > kMaxSplits ||
        variant < 0) {
      ok = false;
      return;
    }
    const int64_t rows = num_queries * num_heads, num_slots = batch * length, mask_words = (num_queries + 31) / 32;
    const int64_t layer_elems = num_slots * kWidth;
    num_layers = std::max<int64_t>(2, std::min<int64_t>(64, ((int64_t{512} << 20) / 2 + layer_elems - 1) / layer_elems));
    std::vector<int32_t> h_slots(num_slots), h_lens(batch, static_cast<int32_t>(length)), h_layers(num_layers);
    std::iota(h_slots.begin(), h_slots.end(), 0);
    if (scattered) std::shuffle(h_slots.begin(), h_slots.end(), std::mt19937(12345));
    std::iota(h_layers.begin(), h_layers.end(), 0);
    std::vector<uint32_t> h_mask(batch * num_queries * mask_words, 0u);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < num_queries; ++i)
        for (int64_t j = 0; j <= i; ++j) h_mask[(b * num_queries + i) * mask_words + j / 32] |= 1u << (j % 32);

    uint16_t* q = alloc<uint16_t>(batch * rows * kWidth);
    uint16_t* pool = alloc<uint16_t>(num_layers * layer_elems);
    int32_t* slots = alloc<int32_t>(num_slots);
    int32_t* lens = alloc<int32_t>(batch);
    uint32_t* mask = alloc<uint32_t>(static_cast<int64_t>(h_mask.size()));
    layers = alloc<int32_t>(num_layers);
    p.out = alloc<uint16_t>(batch * rows * kLatent);
    p.lse = alloc<float>(batch * rows);
    p.out_part = alloc<float>(batch * num_splits * rows * kLatent);
    p.lse_part = alloc<float>(batch * num_splits * rows);
    if (!ok) return;
    fill_random_bf16<<<1024, 256>>>(q, batch * rows * kWidth, 1u);
    fill_random_bf16<<<4096, 256>>>(pool, num_layers * layer_elems, 2u);
    ok = cudaMemcpy(slots, h_slots.data(), num_slots * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(lens, h_lens.data(), batch * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(layers, h_layers.data(), num_layers * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(mask, h_mask.data(), h_mask.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaDeviceSynchronize() == cudaSuccess;
    p.q = q; p.kv_pool = pool; p.kv_slots = slots; p.kv_lens = lens; p.tree_mask = mask;
    p.num_queries = static_cast<int>(num_queries); p.num_heads = static_cast<int>(num_heads); p.rows = static_cast<int>(rows);
    p.mask_words = static_cast<int>(mask_words); p.max_len = static_cast<int>(length); p.num_layers = static_cast<int>(num_layers);
    p.num_slots = num_slots; p.num_splits = static_cast<int>(num_splits); p.scale_log2 = 0.07f * kLog2e;
  }
  BenchCase(const BenchCase&) = delete;
  BenchCase& operator=(const BenchCase&) = delete;
  ~BenchCase() {
    for (void* ptr : buffers) cudaFree(ptr);
  }

  template <typename T>
  T* alloc(int64_t count) {
    void* ptr = nullptr;
    if (!ok || cudaMalloc(&ptr, count * static_cast<int64_t>(sizeof(T))) != cudaSuccess) {
      ok = false;
      return nullptr;
    }
    buffers.push_back(ptr);
    return static_cast<T*>(ptr);
  }
};
}  // namespace

std::vector<double> bench_verify_attention(int64_t batch, int64_t num_queries, int64_t num_heads, int64_t length,
                                           int64_t num_splits, int64_t variant, bool scattered,
                                           int iters) {
  std::vector<double> result(4, -1.0);  // per call: plain launches, CUDA graph replay, main kernel alone, merge alone
  if (iters < 1) return result;
  const int device = current_device();
  variant = verify::resolve_variant(variant, num_queries * num_heads, device);
  BenchCase c(batch, num_queries, num_heads, length, num_splits, variant, scattered);
  cudaStream_t stream = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const bool ok = c.ok && cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
                  cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess;
  Params& p = c.p;
  // Time `iters` calls (each on the next layer) with events; main/merge select the kernels.
  auto timed = [&](bool main, bool merge, bool use_graph) -> double {
    for (int i = 0; i < 3; ++i) {  // warm-up
      p.layer = c.layers + i % c.num_layers;
      verify::launch_verify(p, batch, variant, device, stream, main, merge);
    }
    if (use_graph) {
      if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return -1.0;
      for (int i = 0; i < iters; ++i) {
        p.layer = c.layers + i % c.num_layers;
        verify::launch_verify(p, batch, variant, device, stream, main, merge);
      }
      if (cudaStreamEndCapture(stream, &graph) != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess ||
          cudaGraphLaunch(exec, stream) != cudaSuccess) {
        return -1.0;
      }
    }
    cudaEventRecord(e0, stream);
    if (use_graph) {
      cudaGraphLaunch(exec, stream);
    } else {
      for (int i = 0; i < iters; ++i) {
        p.layer = c.layers + i % c.num_layers;
        verify::launch_verify(p, batch, variant, device, stream, main, merge);
      }
    }
    cudaEventRecord(e1, stream);
    float ms = 0.f;
    if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess ||
        cudaGetLastError() != cudaSuccess) {
      return -1.0;
    }
    return 1e3 * ms / iters;
  };
  if (ok) {
    result[0] = timed(true, true, false);
    result[1] = timed(true, true, true);
    result[2] = timed(true, false, false);
    result[3] = num_splits > 1 ? timed(false, true, false) : 0.0;
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (stream) cudaStreamDestroy(stream);
  return result;
}


}  // namespace kdtree
