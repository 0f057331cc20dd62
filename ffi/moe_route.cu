// CUDA handler of the MoE router's expert choice (semantics: moe_route.h; Python side: kdtree_jax/ops/route.py).
//
// Why.  After the router's product, XLA ran the choice as a chain of small kernels: the sigmoid and the bias add,
// the group ranking where there is one, a TopK that XLA lowers to a sort of each token's E scores (5.7 us a layer in
// the Kimi-K2 TP8-rank step at T = 1 on an H200, b64d7bb), the gather of the chosen scores and the normalisation:
// ~10 us a layer for ~1.5 KB of scores a token.  Here one kernel does it, one block per token:
//   scores     each thread takes experts tid, tid + blockDim, ...: sigmoid (or softmax: a block max and sum first),
//              the bias added for the choice (noaux_tc); both kept in shared memory (E <= kMaxExperts)
//   groups     (n_group > 1 and topk_group < n_group) warp w ranks groups w, w + warps, ...: the sum of the group's
//              two best choices; thread 0 keeps the topk_group best groups and the others' choices become -inf
//   top-k      k rounds of a block argmax over the experts not yet taken
//   weights    the chosen experts' unbiased scores in choice order, normalised by their sum (plus 1e-20) and scaled
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

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
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

__device__ __forceinline__ void warp_best(float& v, int32_t& i) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, offset);
    const int32_t oi = __shfl_xor_sync(kFull, i, offset);
    if (better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

// The block's best (value, index) of one candidate a thread; every thread returns it.
__device__ void block_best(float& v, int32_t& i, float* warp_v, int32_t* warp_i) {
  warp_best(v, i);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_v[warp] = v;
    warp_i[warp] = i;
  }
  __syncthreads();
  v = lane < kWarps ? warp_v[lane] : -INFINITY;
  i = lane < kWarps ? warp_i[lane] : kNoIndex;
  warp_best(v, i);
  __syncthreads();  // warp_v / warp_i are free again
}

// Block max or sum of one value a thread, in a fixed order (deterministic); every thread returns it.
template <bool kMax>
__device__ float block_reduce(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float o = __shfl_xor_sync(kFull, v, offset);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < kWarps ? scratch[lane] : (kMax ? -INFINITY : 0.f);
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float o = __shfl_xor_sync(kFull, v, offset);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  __syncthreads();
  return v;
}

__global__ void __launch_bounds__(kThreads) moe_route_kernel(RouteParams p) {
  __shared__ float score[kMaxExperts];
  __shared__ float choice[kMaxExperts];
  __shared__ bool taken[kMaxExperts];
  __shared__ float group_value[kMaxGroups];
  __shared__ bool group_kept[kMaxGroups];
  __shared__ int32_t chosen[kMaxK];
  __shared__ float warp_v[kWarps];
  __shared__ int32_t warp_i[kWarps];
  kdtree::wait_for_previous_grid();
  kdtree::allow_dependent_launch();
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {
    const float* row = p.logits + t * p.E;
    if (p.sigmoid) {
      for (int e = tid; e < p.E; e += kThreads) score[e] = 1.f / (1.f + expf(-row[e]));
    } else {  // softmax, as jax.nn.softmax: exp(x - max) / sum
      float m = -INFINITY;
      for (int e = tid; e < p.E; e += kThreads) m = fmaxf(m, row[e]);
      m = block_reduce<true>(m, warp_v);
      float s = 0.f;
      for (int e = tid; e < p.E; e += kThreads) {
        score[e] = expf(row[e] - m);
        s += score[e];
      }
      s = block_reduce<false>(s, warp_v);
      for (int e = tid; e < p.E; e += kThreads) score[e] = score[e] / s;
    }
    for (int e = tid; e < p.E; e += kThreads) {
      const float c = p.with_bias ? score[e] + p.bias[e] : score[e];
      choice[e] = isnan(c) ? -INFINITY : c;
      taken[e] = false;
    }
    __syncthreads();
    if (p.groups > 1 && p.topk_group < p.groups) {
      const int per = p.E / p.groups;
      for (int g = warp; g < p.groups; g += kWarps) {  // the sum of the group's two best choices
        float v1 = -INFINITY;
        int32_t i1 = kNoIndex;
        for (int e = g * per + lane; e < (g + 1) * per; e += 32) {
          if (better(choice[e], e, v1, i1)) {
            v1 = choice[e];
            i1 = e;
          }
        }
        warp_best(v1, i1);
        float v2 = -INFINITY;
        int32_t i2 = kNoIndex;
        for (int e = g * per + lane; e < (g + 1) * per; e += 32) {
          if (e != i1 && better(choice[e], e, v2, i2)) {
            v2 = choice[e];
            i2 = e;
          }
        }
        warp_best(v2, i2);
        if (lane == 0) group_value[g] = per >= 2 ? v1 + v2 : v1;
      }
      __syncthreads();
      if (tid == 0) {  // at most kMaxGroups groups: one thread ranks them
        for (int g = 0; g < p.groups; ++g) group_kept[g] = false;
        for (int r = 0; r < p.topk_group; ++r) {
          float bv = -INFINITY;
          int32_t bg = kNoIndex;
          for (int g = 0; g < p.groups; ++g) {
            if (!group_kept[g] && better(group_value[g], g, bv, bg)) {
              bv = group_value[g];
              bg = g;
            }
          }
          group_kept[bg] = true;
        }
      }
      __syncthreads();
      for (int e = tid; e < p.E; e += kThreads) {
        if (!group_kept[e / per]) choice[e] = -INFINITY;
      }
      __syncthreads();
    }
    for (int r = 0; r < p.K; ++r) {
      float v = -INFINITY;
      int32_t i = kNoIndex;
      for (int e = tid; e < p.E; e += kThreads) {
        if (!taken[e] && better(choice[e], e, v, i)) {
          v = choice[e];
          i = e;
        }
      }
      block_best(v, i, warp_v, warp_i);
      if (tid == 0) {
        chosen[r] = i;
        taken[i] = true;
      }
      __syncthreads();
    }
    if (tid == 0) {  // the chosen experts' unbiased scores, normalised in choice order
      float sum = 0.f;
      if (p.normalize) {
        for (int r = 0; r < p.K; ++r) sum += score[chosen[r]];
      }
      for (int r = 0; r < p.K; ++r) {
        const float w = score[chosen[r]];
        p.indices[t * p.K + r] = chosen[r];
        p.weights[t * p.K + r] = (p.normalize ? w / (sum + 1e-20f) : w) * p.scale;
      }
    }
    __syncthreads();  // the shared arrays are the next token's
  }
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
  const unsigned blocks = static_cast<unsigned>(T < 65535 ? T : 65535);
  kdtree::launch_kernel(moe_route_kernel, dim3(blocks), dim3(kThreads), 0, stream, kdtree::pdl_supported(), p);
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
