// CUDA handler of the MoE router's expert choice (semantics: moe_experts.h, "moe_route"; Python side:
// kdtree_jax/ops/moe.py, route_experts; the XLA formulation it replaces on a GPU: kdtree_jax/model/moe.py, route).
//
// Why an op.  XLA runs DeepSeek-V3 / Kimi K2 routing (scores, bias, group top-2 sums, the best groups, the top-k, the
// chosen scores normalised) as 6-10 small kernels a layer: a sort for every top_k, a scatter for the group mask,
// reductions and element-wise fusions.  On the H200 at a K2 TP8-rank decode step (T = 1) those took ~14 us of kernels
// a layer plus a launch gap each, more than half the routed experts' own weight-read time.  Here one block routes
// one token, its scores in shared memory:
//   1. scores = sigmoid(logits) (or softmax over the experts); choice = scores + bias when `use_bias`
//   2. n_group > topk_group: each group's score is the sum of its two best choices; the topk_group best groups
//      stay, the other groups' experts leave the race
//   3. top-k of the choice: k block-wide argmax rounds, ties to the lower expert id (jax.lax.top_k's order)
//   4. weights = the chosen experts' scores (unbiased), divided by their sum + 1e-20 when `norm`, times `scaling`
// Deterministic (fixed reduction orders); no host sync, no allocation: graph-safe.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "moe_experts.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxExperts = 4096;  // shared memory: 9 bytes an expert (37 KB at most, under 48 KB)
constexpr int64_t kMaxGroups = 256;
constexpr int64_t kMaxTopK = 64;

struct RouteParams {
  const float* logits;  // [N, E]
  const float* bias;    // [E]
  int32_t* indices;     // [N, k]
  float* weights;       // [N, k]
  int E, k, n_group, topk_group;
  bool softmax, use_bias, norm;
  float scaling;
};

// (value, id) with jax.lax.top_k's order: the larger value first, equal values by the lower id. id < 0: none.
struct Best {
  float value;
  int id;
};

__device__ __forceinline__ bool before(const Best& a, const Best& b) {
  if (a.id < 0) return false;
  if (b.id < 0) return true;
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

__device__ __forceinline__ Best warp_best(Best b) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    Best o{__shfl_xor_sync(0xffffffffu, b.value, offset), __shfl_xor_sync(0xffffffffu, b.id, offset)};
    if (before(o, b)) b = o;
  }
  return b;
}

// The block's best candidate; every thread gets it.  `slots`: kWarps Best of shared memory.
__device__ __forceinline__ Best block_best(Best b, Best* slots) {
  b = warp_best(b);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) slots[warp] = b;
  __syncthreads();
  Best all = lane < kWarps ? slots[lane] : Best{0.f, -1};
  all = warp_best(all);
  __syncthreads();  // the slots are free again
  return all;
}

__device__ __forceinline__ float block_reduce(float v, float* slots, bool take_max) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, v, offset);
    v = take_max ? fmaxf(v, o) : v + o;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) slots[warp] = v;
  __syncthreads();
  float all = slots[0];
  for (int w = 1; w < kWarps; ++w) all = take_max ? fmaxf(all, slots[w]) : all + slots[w];
  __syncthreads();
  return all;
}

__global__ void __launch_bounds__(kThreads) moe_route_kernel(RouteParams p) {
  extern __shared__ float shared[];
  float* scores = shared;                                          // [E]
  float* choice = scores + p.E;                                    // [E]
  float* group_score = choice + p.E;                               // [n_group]
  int* group_kept = reinterpret_cast<int*>(group_score + p.n_group);  // [n_group]
  bool* taken = reinterpret_cast<bool*>(group_kept + p.n_group);   // [E]
  __shared__ Best best_slots[kWarps];
  __shared__ float reduce_slots[kWarps];
  __shared__ int chosen[kMaxTopK];

  const int64_t token = blockIdx.x;
  const float* logits = p.logits + token * p.E;
  const int E = p.E;

  // 1. scores and the choice
  if (p.softmax) {
    float m = -INFINITY;
    for (int e = threadIdx.x; e < E; e += kThreads) m = fmaxf(m, logits[e]);
    m = block_reduce(m, reduce_slots, true);
    float s = 0.f;
    for (int e = threadIdx.x; e < E; e += kThreads) {
      const float v = expf(logits[e] - m);
      scores[e] = v;
      s += v;
    }
    s = block_reduce(s, reduce_slots, false);
    for (int e = threadIdx.x; e < E; e += kThreads) scores[e] /= s;
  } else {
    for (int e = threadIdx.x; e < E; e += kThreads) scores[e] = 1.f / (1.f + expf(-logits[e]));
  }
  for (int e = threadIdx.x; e < E; e += kThreads) {
    choice[e] = p.use_bias ? scores[e] + p.bias[e] : scores[e];
    taken[e] = false;
  }
  __syncthreads();

  // 2. the best groups (a thread a group: groups are small)
  if (p.n_group > 1 && p.topk_group < p.n_group) {
    const int size = E / p.n_group;
    for (int g = threadIdx.x; g < p.n_group; g += kThreads) {
      Best first{0.f, -1}, second{0.f, -1};
      for (int j = 0; j < size; ++j) {
        const Best c{choice[g * size + j], g * size + j};
        if (before(c, first)) {
          second = first;
          first = c;
        } else if (before(c, second)) {
          second = c;
        }
      }
      group_score[g] = size > 1 ? first.value + second.value : first.value;
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the topk_group best groups, ties to the lower group id
      for (int g = 0; g < p.n_group; ++g) group_kept[g] = 0;
      for (int round = 0; round < p.topk_group; ++round) {
        Best b{0.f, -1};
        for (int g = 0; g < p.n_group; ++g) {
          const Best c{group_score[g], g};
          if (!group_kept[g] && before(c, b)) b = c;
        }
        group_kept[b.id] = 1;
      }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += kThreads) {
      if (!group_kept[e / size]) choice[e] = -INFINITY;  // as the XLA formulation masks them
    }
    __syncthreads();
  }

  // 3. top-k: k rounds of the block's best untaken choice
  for (int round = 0; round < p.k; ++round) {
    Best b{0.f, -1};
    for (int e = threadIdx.x; e < E; e += kThreads) {
      const Best c{choice[e], e};
      if (!taken[e] && before(c, b)) b = c;
    }
    b = block_best(b, best_slots);
    if (threadIdx.x == 0) {
      chosen[round] = b.id;
      taken[b.id] = true;
    }
    __syncthreads();
  }

  // 4. the weights: the chosen experts' unbiased scores, normalised in choice order
  if (threadIdx.x == 0) {
    float sum = 0.f;
    for (int j = 0; j < p.k; ++j) sum += scores[chosen[j]];
    for (int j = 0; j < p.k; ++j) {
      const float w = p.norm ? scores[chosen[j]] / (sum + 1e-20f) : scores[chosen[j]];
      p.indices[token * p.k + j] = chosen[j];
      p.weights[token * p.k + j] = w * p.scaling;
    }
  }
}

using Logits = ffi::Buffer<ffi::F32, 2>;
using Bias = ffi::Buffer<ffi::F32, 1>;
using Indices = ffi::Buffer<ffi::S32, 2>;
using Weights = ffi::Buffer<ffi::F32, 2>;

ffi::Error MoeRouteCuda(cudaStream_t stream, Logits logits, Bias bias, int64_t top_k, int64_t n_group,
                        int64_t topk_group, bool softmax, bool use_bias, bool norm, float scaling,
                        ffi::Result<Indices> indices, ffi::Result<Weights> weights) {
  const auto ld = logits.dimensions();
  const int64_t N = ld[0], E = ld[1];
  if (bias.dimensions()[0] != E || indices->dimensions()[0] != N || indices->dimensions()[1] != top_k ||
      weights->dimensions()[0] != N || weights->dimensions()[1] != top_k) {
    return ffi::Error::InvalidArgument("moe_route (CUDA): logits [N, E], bias [E], indices / weights [N, top_k]");
  }
  if (E < 1 || E > kMaxExperts || top_k < 1 || top_k > E || top_k > kMaxTopK || n_group < 1 ||
      n_group > kMaxGroups || E % n_group != 0 || topk_group < 1 || topk_group > n_group ||
      (n_group > 1 && topk_group < n_group && topk_group * (E / n_group) < top_k)) {
    return ffi::Error::InvalidArgument(
        "moe_route (CUDA): needs 1 <= E <= 4096, 1 <= top_k <= min(E, 64), 1 <= n_group <= 256 dividing E, "
        "1 <= topk_group <= n_group, and top_k experts in the kept groups");
  }
  if (N == 0) return ffi::Error::Success();
  RouteParams p{};
  p.logits = logits.typed_data();
  p.bias = bias.typed_data();
  p.indices = indices->typed_data();
  p.weights = weights->typed_data();
  p.E = static_cast<int>(E);
  p.k = static_cast<int>(top_k);
  p.n_group = static_cast<int>(n_group);
  p.topk_group = static_cast<int>(topk_group);
  p.softmax = softmax;
  p.use_bias = use_bias;
  p.norm = norm;
  p.scaling = scaling;
  const size_t shared = sizeof(float) * (2 * E + 2 * n_group) + E;  // scores, choice, group score / kept, taken
  const unsigned blocks = static_cast<unsigned>(N < 2147483647 ? N : 2147483647);
  moe_route_kernel<<<blocks, kThreads, shared, stream>>>(p);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("moe_route (CUDA): kernel launch: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kdtree_moe_route_cuda, MoeRouteCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<Logits>()                  // router logits [N, E] float32
                                  .Arg<Bias>()                    // e_score_correction_bias [E] float32
                                  .Attr<int64_t>("top_k")
                                  .Attr<int64_t>("n_group")
                                  .Attr<int64_t>("topk_group")
                                  .Attr<bool>("softmax")          // else sigmoid
                                  .Attr<bool>("use_bias")         // noaux_tc: choose on score + bias
                                  .Attr<bool>("norm")             // norm_topk_prob
                                  .Attr<float>("scaling")         // routed_scaling_factor
                                  .Ret<Indices>()                 // indices [N, top_k]
                                  .Ret<Weights>(),                // weights [N, top_k]
                              {ffi::Traits::kCmdBufferCompatible});
