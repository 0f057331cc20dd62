// CUDA handler of the MoE router's expert choice (semantics: moe_experts.h, "moe_route"; Python side:
// kdtree_jax/ops/moe.py, route_experts; the XLA formulation it replaces on a GPU: kdtree_jax/model/moe.py, route).
//
// Why an op.  XLA runs DeepSeek-V3 / Kimi K2 routing (scores, bias, group top-2 sums, the best groups, the top-k, the
// chosen scores normalised) as 6-10 small kernels a layer: a sort for every top_k, a scatter for the group mask,
// reductions and element-wise fusions.  On the H200 at a K2 TP8-rank decode step (T = 1) those took ~14 us of kernels
// a layer plus a launch gap each, more than half the routed experts' own weight-read time.  Here one warp routes
// one token, its experts spread over the lanes' registers (no shared memory but the group ranking's few words):
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
constexpr int kWarps = kThreads / 32;     // a warp routes a token: no block barrier anywhere
constexpr int kMaxPerLane = 32;           // experts a lane holds (bits of its mask)
constexpr int64_t kMaxExperts = 32 * kMaxPerLane;
constexpr int64_t kMaxGroups = 256;
constexpr int64_t kMaxTopK = 64;

struct RouteParams {
  const float* logits;  // [N, E]
  const float* bias;    // [E]
  int32_t* indices;     // [N, k]
  float* weights;       // [N, k]
  int64_t N;
  int E, k, n_group, topk_group;
  bool softmax, use_bias, norm;
  float scaling;
};

// A candidate with jax.lax.top_k's order: the larger value first, equal values by the lower id.  id < 0: none.
struct Best {
  float value;
  int id;
  float score;  // the expert's unbiased score, carried along for the weights
};

__device__ __forceinline__ bool before(const Best& a, const Best& b) {
  if (a.id < 0) return false;
  if (b.id < 0) return true;
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// Every lane gets the warp's best candidate.
__device__ __forceinline__ Best warp_best(Best b) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Best o{__shfl_xor_sync(0xffffffffu, b.value, offset), __shfl_xor_sync(0xffffffffu, b.id, offset),
                 __shfl_xor_sync(0xffffffffu, b.score, offset)};
    if (before(o, b)) b = o;
  }
  return b;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Lane l holds experts l, l + 32, l + 64, ... (kPerLane of them): loads coalesce, and every step below is a few
// register compares and warp shuffles.
template <int kPerLane>
__global__ void __launch_bounds__(kThreads) moe_route_kernel(RouteParams p) {
  __shared__ float group_score[kWarps][kMaxGroups];
  __shared__ int kept[kWarps][kMaxGroups];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (token >= p.N) return;
  const float* logits = p.logits + token * p.E;
  const int E = p.E;

  // 1. scores and the choice; `live` marks the experts still in the race
  float score[kPerLane], choice[kPerLane];
  unsigned live = 0;
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = j * 32 + lane;
    score[j] = e < E ? logits[e] : -INFINITY;
    if (e < E) live |= 1u << j;
  }
  if (p.softmax) {
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) m = fmaxf(m, score[j]);
    m = warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      score[j] = (live >> j) & 1u ? expf(score[j] - m) : 0.f;
      sum += score[j];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) score[j] /= sum;
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) score[j] = 1.f / (1.f + expf(-score[j]));
  }
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    const int e = j * 32 + lane;
    choice[j] = p.use_bias && e < E ? score[j] + p.bias[e] : score[j];
  }

  // 2. the best groups: each group's two best choices summed; the topk_group best groups keep their experts
  if (p.n_group > 1 && p.topk_group < p.n_group) {
    const int size = E / p.n_group;
    for (int g = 0; g < p.n_group; ++g) {
      // the group's best, then its best other than that one
      Best first{0.f, -1, 0.f}, runner{0.f, -1, 0.f};
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const Best c{choice[j], j * 32 + lane, 0.f};
        if (c.id < E && c.id / size == g && before(c, first)) first = c;
      }
      first = warp_best(first);
#pragma unroll
      for (int j = 0; j < kPerLane; ++j) {
        const Best c{choice[j], j * 32 + lane, 0.f};
        if (c.id < E && c.id / size == g && c.id != first.id && before(c, runner)) runner = c;
      }
      runner = warp_best(runner);
      if (lane == 0) group_score[warp][g] = size > 1 ? first.value + runner.value : first.value;
    }
    __syncwarp();
    if (lane == 0) {  // ties to the lower group id, as jax.lax.top_k ranks them
      for (int g = 0; g < p.n_group; ++g) kept[warp][g] = 0;
      for (int round = 0; round < p.topk_group; ++round) {
        Best b{0.f, -1, 0.f};
        for (int g = 0; g < p.n_group; ++g) {
          const Best c{group_score[warp][g], g, 0.f};
          if (!kept[warp][g] && before(c, b)) b = c;
        }
        kept[warp][b.id] = 1;
      }
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const int e = j * 32 + lane;
      if (e < E && !kept[warp][e / size]) live &= ~(1u << j);
    }
  }

  // 3. top-k: k rounds of the warp's best live choice; 4. the weights from the chosen experts' scores
  float sum = 0.f;
  int my_id = -1;  // lane r keeps round r's expert and score (k <= 64: two per lane at most)
  float my_score = 0.f;
  int my_id2 = -1;
  float my_score2 = 0.f;
  for (int round = 0; round < p.k; ++round) {
    Best b{0.f, -1, 0.f};
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
      const Best c{choice[j], j * 32 + lane, score[j]};
      if ((live >> j) & 1u && before(c, b)) b = c;
    }
    b = warp_best(b);
    if (b.id % 32 == lane) live &= ~(1u << (b.id / 32));
    sum += b.score;  // in choice order, as a sequential sum
    if (round % 32 == lane) {
      if (round < 32) {
        my_id = b.id;
        my_score = b.score;
      } else {
        my_id2 = b.id;
        my_score2 = b.score;
      }
    }
  }
  const float denom = sum + 1e-20f;
  if (lane < p.k) {
    p.indices[token * p.k + lane] = my_id;
    p.weights[token * p.k + lane] = (p.norm ? my_score / denom : my_score) * p.scaling;
  }
  if (lane + 32 < p.k) {
    p.indices[token * p.k + lane + 32] = my_id2;
    p.weights[token * p.k + lane + 32] = (p.norm ? my_score2 / denom : my_score2) * p.scaling;
  }
}

template <int kPerLane>
void launch(const RouteParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.N + kWarps - 1) / kWarps;
  moe_route_kernel<kPerLane><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p);
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
        "moe_route (CUDA): needs 1 <= E <= 1024, 1 <= top_k <= min(E, 64), 1 <= n_group <= 256 dividing E, "
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
  p.N = N;
  const int per_lane = static_cast<int>((E + 31) / 32);
  if (per_lane <= 1) {
    launch<1>(p, stream);
  } else if (per_lane <= 2) {
    launch<2>(p, stream);
  } else if (per_lane <= 4) {
    launch<4>(p, stream);
  } else if (per_lane <= 8) {
    launch<8>(p, stream);
  } else if (per_lane <= 16) {
    launch<16>(p, stream);
  } else {
    launch<32>(p, stream);
  }
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
