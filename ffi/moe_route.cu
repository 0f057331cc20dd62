// CUDA handler of the MoE router's expert choice (semantics: moe_route.h; Python side: kdtree_jax/ops/route.py).
//
// Why.  After the router's product, XLA ran the choice as a chain of small kernels: the sigmoid and the bias add,
// the group ranking where there is one, a TopK that XLA lowers to a sort of each token's E scores (5.7 us a layer in
// the Kimi-K2 TP8-rank step at T = 1 on an H200, b64d7bb), the gather of the chosen scores and the normalisation:
// ~10 us a layer for ~1.5 KB of scores a token.  Here one kernel does it, one warp per token, everything in registers
// (no shared memory, no block barrier: a first form with a block per token and k block-wide argmax rounds took 7.9 us
// a layer on an H100, fa0e52c; this one 6.6 us in the same step's profile at 4d9fce1, a span that may include its
// programmatic wait on the router's product; the K2 rank's MoE at T = 1 went 0.966 -> 0.790 ms a step with the
// shared expert's fold, benchmarks/results/history/k2_moe_fusions_h100_4d9fce1.md):
//   scores     lane l holds experts l, l + 32, ... (PER of them: E <= 32 PER): sigmoid (or softmax: a warp max and
//              sum first), and the choice, the score plus the bias (noaux_tc)
//   groups     (n_group > 1 and topk_group < n_group) per group the sum of its two best choices (two warp argmax
//              rounds), the topk_group best groups kept (lane g holds groups g and g + 32), the others' choices -inf
//   top-k      k rounds of a warp argmax over the experts not yet taken (a bit per register slot); the winner's score
//              rides along, lane r keeps round r's
//   weights    the chosen scores over their sum (added in choice order) plus 1e-20, times the scale
// Order.  Choices compare on (value, index): larger first, equal ones by the lower index (lax.top_k's order), groups
// likewise; a NaN choice counts as -inf.  The scores round as XLA's do (1 / (1 + exp(-x)) in float32); sums may be
// added in another order than XLA's (the weights' normalisation, softmax's denominator): a few ulp.
// No host sync, no allocation, no scratch: graph-safe; a programmatic dependent (pdl.cuh) of the router's product.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "moe_route.h"
#include "pdl.cuh"

namespace ffi = xla::ffi;

namespace {

using kdtree::route::kMaxExperts;
using kdtree::route::kMaxGroups;
using kdtree::route::kMaxK;

constexpr int kWarpsPerBlock = 4;
constexpr int32_t kNoIndex = 0x7fffffff;  // no candidate: loses to every real expert, -inf included
constexpr unsigned kFull = 0xffffffffu;

struct RouteParams {
  const float* logits;  // [T, E]
  const float* bias;    // [E]
  int32_t* indices;     // [T, K]
  float* weights;       // [T, K]
  int64_t T;
  int E, K, groups, topk_group;
  bool sigmoid, with_bias, normalize;
  float scale;
};

__device__ __forceinline__ bool better(float av, int32_t ai, float bv, int32_t bi) {
  return av > bv || (av == bv && ai < bi);
}

// The warp's best (value, index) of one candidate a lane, `carry` riding along with the winner; every lane returns it.
__device__ __forceinline__ void warp_best(float& v, int32_t& i, float& carry) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, offset);
    const int32_t oi = __shfl_xor_sync(kFull, i, offset);
    const float oc = __shfl_xor_sync(kFull, carry, offset);
    if (better(ov, oi, v, i)) {
      v = ov;
      i = oi;
      carry = oc;
    }
  }
}

// The warp's best open choice (bit j of `open`: slot j, expert j * 32 + lane) that `keep(expert)` admits, with its
// score riding along; every lane returns it.
template <int PER, typename Keep>
__device__ __forceinline__ void best_open(const float (&choice)[PER], const float (&score)[PER], uint32_t open, int lane,
                                          Keep keep, float& v, int32_t& i, float& s) {
  v = -INFINITY;
  i = kNoIndex;
  s = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int e = j * 32 + lane;
    if (((open >> j) & 1u) && keep(e) && better(choice[j], e, v, i)) {
      v = choice[j];
      i = e;
      s = score[j];
    }
  }
  warp_best(v, i, s);
}

template <bool kMax>
__device__ __forceinline__ float warp_reduce(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float o = __shfl_xor_sync(kFull, v, offset);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  return v;
}

template <int PER>
__device__ __forceinline__ void route_token(const RouteParams& p, int64_t t, int lane) {
  const float* row = p.logits + t * p.E;
  float score[PER], choice[PER];
  uint32_t open = 0;  // bit j: expert j * 32 + lane exists and is not taken yet
  float m = -INFINITY;
  if (!p.sigmoid) {
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      if (j * 32 + lane < p.E) m = fmaxf(m, row[j * 32 + lane]);
    }
    m = warp_reduce<true>(m);
  }
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int e = j * 32 + lane;
    const bool real = e < p.E;
    const float x = real ? row[e] : 0.f;
    score[j] = p.sigmoid ? 1.f / (1.f + expf(-x)) : (real ? expf(x - m) : 0.f);
    sum += score[j];
    if (real) open |= 1u << j;
  }
  if (!p.sigmoid) {  // softmax, as jax.nn.softmax: exp(x - max) / sum
    sum = warp_reduce<false>(sum);
#pragma unroll
    for (int j = 0; j < PER; ++j) score[j] = score[j] / sum;
  }
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int e = j * 32 + lane;
    const float c = p.with_bias && e < p.E ? score[j] + p.bias[e] : score[j];
    choice[j] = isnan(c) ? -INFINITY : c;
  }
  if (p.groups > 1 && p.topk_group < p.groups) {
    const int per = p.E / p.groups;
    float group_lo = -INFINITY, group_hi = -INFINITY;  // this lane's groups: lane and lane + 32
    for (int g = 0; g < p.groups; ++g) {
      float v1, v2, unused;
      int32_t i1, i2;
      best_open(choice, score, open, lane, [&](int e) { return e / per == g; }, v1, i1, unused);
      best_open(choice, score, open, lane, [&](int e) { return e / per == g && e != i1; }, v2, i2, unused);
      const float value = per >= 2 ? v1 + v2 : v1;
      if (g == lane) group_lo = value;
      if (g == lane + 32) group_hi = value;
    }
    uint64_t kept = 0;
    for (int r = 0; r < p.topk_group; ++r) {
      float v = -INFINITY, c = 0.f;
      int32_t g = kNoIndex;
      if (lane < p.groups && !((kept >> lane) & 1u)) {
        v = group_lo;
        g = lane;
      }
      if (lane + 32 < p.groups && !((kept >> (lane + 32)) & 1u) && better(group_hi, lane + 32, v, g)) {
        v = group_hi;
        g = lane + 32;
      }
      warp_best(v, g, c);
      kept |= uint64_t{1} << g;
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int e = j * 32 + lane;
      if (e < p.E && !((kept >> (e / per)) & 1u)) choice[j] = -INFINITY;
    }
  }
  int32_t mine = 0;  // lane r: round r's expert and score
  float my_score = 0.f, total = 0.f;
  for (int r = 0; r < p.K; ++r) {
    float v, s;
    int32_t i;
    best_open(choice, score, open, lane, [](int) { return true; }, v, i, s);
    if ((i & 31) == lane) open &= ~(1u << (i >> 5));
    if (lane == r) {
      mine = i;
      my_score = s;
    }
    total += s;  // every lane adds the same scores in choice order
  }
  if (lane < p.K) {
    p.indices[t * p.K + lane] = mine;
    p.weights[t * p.K + lane] = (p.normalize ? my_score / (total + 1e-20f) : my_score) * p.scale;
  }
}

template <int PER>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) moe_route_kernel(RouteParams p) {
  kdtree::wait_for_previous_grid();
  kdtree::allow_dependent_launch();
  const int lane = threadIdx.x % 32;
  for (int64_t t = blockIdx.x * int64_t{kWarpsPerBlock} + threadIdx.x / 32; t < p.T;
       t += int64_t{gridDim.x} * kWarpsPerBlock) {
    route_token<PER>(p, t, lane);
  }
}

template <int PER>
void launch(const RouteParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.T + kWarpsPerBlock - 1) / kWarpsPerBlock;
  kdtree::launch_kernel(moe_route_kernel<PER>, dim3(static_cast<unsigned>(blocks < 65535 ? blocks : 65535)),
                        dim3(kWarpsPerBlock * 32), 0, stream, kdtree::pdl_supported(), p);
}

using Logits = ffi::Buffer<ffi::F32, 2>;
using Bias = ffi::Buffer<ffi::F32, 1>;
using Indices = ffi::Buffer<ffi::S32, 2>;
using Weights = ffi::Buffer<ffi::F32, 2>;

ffi::Error MoeRouteCuda(cudaStream_t stream, Logits logits, Bias bias, int64_t top_k, int64_t n_group,
                        int64_t topk_group, bool sigmoid, bool with_bias, bool normalize, float scale,
                        ffi::Result<Indices> indices, ffi::Result<Weights> weights) {
  const auto ld = logits.dimensions();
  const int64_t T = ld[0], E = ld[1];
  if (bias.dimensions()[0] != E || indices->dimensions()[0] != T || indices->dimensions()[1] != top_k ||
      weights->dimensions()[0] != T || weights->dimensions()[1] != top_k) {
    return ffi::Error::InvalidArgument("moe_route (CUDA): logits [T,E], bias [E], indices / weights [T,top_k]");
  }
  if (E < 1 || E > kMaxExperts || top_k < 1 || top_k > kMaxK || top_k > E || n_group < 1 || n_group > kMaxGroups ||
      E % n_group != 0 || topk_group < 1 || topk_group > n_group) {
    return ffi::Error::InvalidArgument(
        "moe_route (CUDA): needs 1 <= E <= " + std::to_string(kMaxExperts) + ", 1 <= top_k <= min(E, " +
        std::to_string(kMaxK) + "), 1 <= n_group <= " + std::to_string(kMaxGroups) +
        " dividing E, 1 <= topk_group <= n_group");
  }
  if (T == 0) return ffi::Error::Success();
  RouteParams p{logits.typed_data(), bias.typed_data(), indices->typed_data(), weights->typed_data(), T,
                static_cast<int>(E), static_cast<int>(top_k), static_cast<int>(n_group), static_cast<int>(topk_group),
                sigmoid, with_bias, normalize, scale};
  // Experts a lane holds: the fewest register slots that cover E (each size its own unrolled code).
  const int per = static_cast<int>((E + 31) / 32);
  if (per <= 1) {
    launch<1>(p, stream);
  } else if (per <= 2) {
    launch<2>(p, stream);
  } else if (per <= 4) {
    launch<4>(p, stream);
  } else if (per <= 8) {
    launch<8>(p, stream);
  } else if (per <= 12) {
    launch<12>(p, stream);
  } else if (per <= 16) {
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
                                  .Arg<Logits>()                 // router logits [T, E] f32
                                  .Arg<Bias>()                   // e_score_correction_bias [E] f32
                                  .Attr<int64_t>("top_k")
                                  .Attr<int64_t>("n_group")
                                  .Attr<int64_t>("topk_group")
                                  .Attr<bool>("sigmoid")         // else softmax
                                  .Attr<bool>("with_bias")       // noaux_tc: choose on score + bias
                                  .Attr<bool>("normalize")       // norm_topk_prob
                                  .Attr<float>("scale")          // routed_scaling_factor
                                  .Ret<Indices>()                // indices [T, top_k]
                                  .Ret<Weights>(),               // weights [T, top_k]
                              {ffi::Traits::kCmdBufferCompatible});
