// CUDA handler of the MoE router's selection (semantics: routing.h; Python side: kdtree_jax/ops/routing.py).
//
// Why.  XLA ran the DeepSeek-V3 / Kimi-K2 routing (sigmoid, + bias, group top-2 sums, group top-k, expert top-k,
// gather, normalise, scale) as ~6 small kernels a layer on an H200 (a sort kernel of 5.6 us for one token over 384
// experts, reduce fusions, multiplies): ~14 us a layer, 24 layers of a K2 step.  Here one kernel does it all:
//   block      one token at a time (a grid-stride loop over tokens), ceil(E / 128) warps: expert e is element e / nt
//              of thread e % nt (<= 4 a thread), loaded coalesced; bias loaded once per block
//   scores     sigmoid 1 / (1 + expf(-x)) (IEEE division, the accurate expf: XLA's formula), or softmax
//              exp(x - max) / sum (NaN-propagating block max, block sum in warp order); unbiased scores to shared
//   groups     (1 < n_group, topk_group < n_group) the choices' order keys go to shared memory; warp w takes groups
//              w, w + warps, ...: lanes keep a top-2 of the group's keys, merged by butterfly; lane 0 writes the
//              group score (top1 + top2 as floats).  Then in every warp lane g ranks group g against the others and
//              a ballot gives each warp the kept-group mask (no further barrier); other groups' experts become -inf
//   select     every element is a 64-bit key (total-order bits of its choice << 32 | ~index): distinct, larger =
//              better, so "larger choice, equal choices by the lower index" is one unsigned compare.  A thread
//              sorts its <= 4 keys; each warp runs k rounds of a butterfly max over the lanes' heads (the winner
//              pops); warps > 1: warp 0 merges the warps' sorted k-lists the same way (lane w walks warp w's list)
//   output     lane r < k of warp 0 holds the r-th expert: its unbiased score from shared memory, the k-sum by
//              butterfly, / (sum + 1e-20) when norm_topk_prob, * routed_scaling_factor.
// Order.  Selection is exact on the float32 choices the kernel computes.  They equal XLA's when expf rounds as XLA's
// exp does; a score 1 ulp off can flip a near-tie (two choices within an ulp or two) and the softmax's sum is added
// in another order (a few ulp).  Weights: the k-sum is added in another order than XLA's reduce (~1 ulp).
// NaN: keys use IEEE total order (positive NaN above +inf, negative NaN below -inf; lax.top_k's order on a CPU), so
// indices are always valid and distinct; a NaN logit's score and weight are NaN (softmax: the row's all are).
// No host sync, no allocation, no scratch: graph-safe (kCmdBufferCompatible).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "routing.h"

namespace ffi = xla::ffi;

namespace {

using kdtree::routing::kMaxExperts;
using kdtree::routing::kMaxGroups;
using kdtree::routing::kMaxK;

constexpr int kPer = 4;                                 // experts a thread
constexpr int kMaxWarps = kMaxExperts / (32 * kPer);    // 4
constexpr unsigned kFull = 0xffffffffu;
static_assert(kMaxK <= 32 && kMaxGroups <= 32 && kMaxWarps <= 4, "lanes / ballot bits / the 2-step merge below");

// IEEE total order as an unsigned key: -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN.
__device__ __forceinline__ uint32_t order_bits(float v) {
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float from_order_bits(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// An expert's key: choice order bits, then the complemented index (a lower index is the larger key).  Every real
// key is > 0 (the low word ~e is nonzero for e < 2^32 - 1); 0 is an empty slot.
__device__ __forceinline__ uint64_t expert_key(uint32_t order, int e) {
  return (uint64_t{order} << 32) | uint64_t{~static_cast<uint32_t>(e)};
}
__device__ __forceinline__ int key_index(uint64_t key) { return static_cast<int>(~static_cast<uint32_t>(key)); }

__device__ __forceinline__ uint64_t shfl_xor_u64(uint64_t v, int off) {
  const uint32_t lo = __shfl_xor_sync(kFull, static_cast<uint32_t>(v), off);
  const uint32_t hi = __shfl_xor_sync(kFull, static_cast<uint32_t>(v >> 32), off);
  return (uint64_t{hi} << 32) | lo;
}
__device__ __forceinline__ uint64_t shfl_u64(uint64_t v, int src) {
  const uint32_t lo = __shfl_sync(kFull, static_cast<uint32_t>(v), src);
  const uint32_t hi = __shfl_sync(kFull, static_cast<uint32_t>(v >> 32), src);
  return (uint64_t{hi} << 32) | lo;
}

// max that propagates NaN (XLA's max does; fmaxf drops it).
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

__device__ __forceinline__ void compare_swap(uint64_t& a, uint64_t& b) {  // a >= b after
  const uint64_t hi = a > b ? a : b, lo = a > b ? b : a;
  a = hi;
  b = lo;
}

struct Shared {
  float score[kMaxExperts];       // unbiased scores of the token
  uint32_t order[kMaxExperts];    // choices' order bits (the group step)
  float group[kMaxGroups];        // group scores
  uint64_t best[kMaxWarps][kMaxK];  // each warp's k best keys, sorted
  float red[2][kMaxWarps];        // softmax: per-warp max and sum
};

// Minimum 8 blocks an SM: without it ptxas (CUDA 13, sm_90) spilled 4 bytes at 40 registers; with it none (44-56
// registers by architecture).
__global__ void __launch_bounds__(32 * kMaxWarps, 8) route_experts_kernel(
    const float* __restrict__ logits, const float* __restrict__ bias, int64_t rows, int E, int k, int n_group,
    int topk_group, int scoring, bool use_bias, bool norm, float scale, int32_t* __restrict__ indices,
    float* __restrict__ weights) {
  __shared__ Shared sh;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int nt = blockDim.x;
  const bool grouped = n_group > 1;  // the host passes n_group = 1 when grouping does not apply
  const int gsize = E / n_group;

  float b[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int e = threadIdx.x + j * nt;
    b[j] = use_bias && e < E ? __ldg(bias + e) : 0.f;
  }

  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const float* x = logits + row * E;
    float s[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int e = threadIdx.x + j * nt;
      s[j] = e < E ? __ldg(x + e) : -INFINITY;
    }
    if (scoring == 1) {
      // softmax, jax.nn.softmax's way: exp(x - max) / sum(exp(x - max)).
      float m = -INFINITY;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (threadIdx.x + j * nt < E) m = nan_max(m, s[j]);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) m = nan_max(m, __shfl_xor_sync(kFull, m, off));
      if (lane == 0) sh.red[0][warp] = m;
      __syncthreads();
      m = sh.red[0][0];
      for (int w = 1; w < warps; ++w) m = nan_max(m, sh.red[0][w]);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (threadIdx.x + j * nt < E) {
          s[j] = expf(s[j] - m);
          sum += s[j];
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kFull, sum, off);
      if (lane == 0) sh.red[1][warp] = sum;
      __syncthreads();
      sum = sh.red[1][0];
      for (int w = 1; w < warps; ++w) sum += sh.red[1][w];
#pragma unroll
      for (int j = 0; j < kPer; ++j) s[j] = __fdiv_rn(s[j], sum);
    } else {
#pragma unroll
      for (int j = 0; j < kPer; ++j) s[j] = __fdiv_rn(1.f, 1.f + expf(-s[j]));
    }

    uint32_t o[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int e = threadIdx.x + j * nt;
      o[j] = order_bits(use_bias ? s[j] + b[j] : s[j]);
      if (e < E) {
        sh.score[e] = s[j];
        sh.order[e] = o[j];
      }
    }
    __syncthreads();  // scores (the output) and order bits (the group step) visible to every warp

    if (grouped) {
      for (int g = warp; g < n_group; g += warps) {
        // The group's two largest keys (with multiplicity): top1 >= top2.  0 is below every real key but one (the
        // all-ones negative NaN, whose bits it equals, so the sum still comes out right).
        uint32_t t1 = 0, t2 = 0;
        for (int i = lane; i < gsize; i += 32) {
          const uint32_t v = sh.order[g * gsize + i];
          if (v > t1) {
            t2 = t1;
            t1 = v;
          } else if (v > t2) {
            t2 = v;
          }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          const uint32_t o1 = __shfl_xor_sync(kFull, t1, off), o2 = __shfl_xor_sync(kFull, t2, off);
          const uint32_t hi = max(t1, o1), lo = min(t1, o1);
          t2 = max(lo, max(t2, o2));
          t1 = hi;
        }
        if (lane == 0) sh.group[g] = gsize == 1 ? from_order_bits(t1) : from_order_bits(t1) + from_order_bits(t2);
      }
      __syncthreads();
      // Lane g ranks group g (larger score first, equal scores by the lower group); a ballot hands every warp the
      // kept groups.
      bool keep = false;
      if (lane < n_group) {
        const uint32_t mine = order_bits(sh.group[lane]);
        int rank = 0;
        for (int h = 0; h < n_group; ++h) {
          const uint32_t other = order_bits(sh.group[h]);
          rank += other > mine || (other == mine && h < lane) ? 1 : 0;
        }
        keep = rank < topk_group;
      }
      const uint32_t kept = __ballot_sync(kFull, keep);
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int e = threadIdx.x + j * nt;
        if (e < E && !((kept >> (e / gsize)) & 1u)) o[j] = order_bits(-INFINITY);
      }
    }

    // The thread's keys, sorted (larger first).
    uint64_t key[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int e = threadIdx.x + j * nt;
      key[j] = e < E ? expert_key(o[j], e) : 0;
    }
    static_assert(kPer == 4, "the sorting network below is for four keys");
    compare_swap(key[0], key[1]);
    compare_swap(key[2], key[3]);
    compare_swap(key[0], key[2]);
    compare_swap(key[1], key[3]);
    compare_swap(key[1], key[2]);

    // Warp: k rounds of a butterfly max over the lanes' heads; the owner pops its head; lane r keeps the r-th.
    // A warp with fewer than k real keys gets empty (0) winners in the last rounds: popping a 0 changes nothing.
    uint64_t mine = 0;
    for (int r = 0; r < k; ++r) {
      uint64_t best = key[0];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const uint64_t other = shfl_xor_u64(best, off);
        best = other > best ? other : best;
      }
      if (key[0] == best) {
#pragma unroll
        for (int j = 0; j < kPer - 1; ++j) key[j] = key[j + 1];
        key[kPer - 1] = 0;
      }
      if (lane == r) mine = best;
    }

    if (warps > 1) {
      if (lane < k) sh.best[warp][lane] = mine;
      __syncthreads();
      if (warp == 0) {
        // Lane w < warps walks warp w's sorted list; k rounds of a max over lanes 0..3 (xor 1, 2 keep lanes 0..3
        // among themselves), then broadcast.  E >= k real keys in all, each warp's list holds its k best: every
        // winner is real and distinct.
        int ptr = 0;
        mine = 0;
        for (int r = 0; r < k; ++r) {
          const uint64_t head = lane < warps && ptr < k ? sh.best[lane][ptr] : 0;
          uint64_t best = head;
#pragma unroll
          for (int off = 1; off < kMaxWarps; off <<= 1) {
            const uint64_t other = shfl_xor_u64(best, off);
            best = other > best ? other : best;
          }
          best = shfl_u64(best, 0);
          if (lane < warps && head == best) ++ptr;
          if (lane == r) mine = best;
        }
      }
    }

    if (warp == 0) {
      const int e = key_index(mine);
      float w = lane < k ? sh.score[e] : 0.f;
      if (norm) {
        float sum = w;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kFull, sum, off);
        w = __fdiv_rn(w, sum + 1e-20f);
      }
      w *= scale;
      if (lane < k) {
        indices[row * k + lane] = e;
        weights[row * k + lane] = w;
      }
    }
    __syncthreads();  // `sh` is reused by the next token
  }
}

using Logits = ffi::Buffer<ffi::F32>;
using Indices = ffi::Buffer<ffi::S32>;
using Weights = ffi::Buffer<ffi::F32>;

ffi::Error RouteExpertsCuda(cudaStream_t stream, Logits logits, Logits bias, int64_t top_k, int64_t n_group,
                            int64_t topk_group, int64_t scoring, bool use_bias, bool norm_topk_prob,
                            float routed_scaling_factor, ffi::Result<Indices> indices, ffi::Result<Weights> weights) {
  const auto ld = logits.dimensions(), bd = bias.dimensions(), id = indices->dimensions(), wd = weights->dimensions();
  if (ld.size() < 1 || id.size() != ld.size() || wd.size() != ld.size() || bd.size() != 1) {
    return ffi::Error::InvalidArgument("route_experts (CUDA): logits [..., E], bias [E], indices / weights [..., k]");
  }
  const size_t last = ld.size() - 1;
  int64_t rows = 1;
  for (size_t d = 0; d < last; ++d) {
    if (id[d] != ld[d] || wd[d] != ld[d]) {
      return ffi::Error::InvalidArgument("route_experts (CUDA): indices / weights leading dims differ from logits'");
    }
    rows *= ld[d];
  }
  const int64_t E = ld[last];
  if (E < 1 || E > kMaxExperts || bd[0] != E) {
    return ffi::Error::InvalidArgument("route_experts (CUDA): need 1 <= E <= 512 experts and bias [E]");
  }
  if (top_k < 1 || top_k > kMaxK || top_k > E || id[last] != top_k || wd[last] != top_k) {
    return ffi::Error::InvalidArgument("route_experts (CUDA): need 1 <= top_k <= min(E, 16), outputs [..., top_k]");
  }
  if (n_group < 1 || E % n_group != 0 || topk_group < 1 || topk_group > n_group) {
    return ffi::Error::InvalidArgument("route_experts (CUDA): need n_group | E and 1 <= topk_group <= n_group");
  }
  const bool grouped = n_group > 1 && topk_group < n_group;
  if (grouped && n_group > kMaxGroups) {
    return ffi::Error::InvalidArgument("route_experts (CUDA): need n_group <= 16 when grouping applies");
  }
  if (scoring != 0 && scoring != 1) {
    return ffi::Error::InvalidArgument("route_experts (CUDA): scoring must be 0 (sigmoid) or 1 (softmax)");
  }
  if (rows == 0) return ffi::Error::Success();
  const int warps = static_cast<int>((E + 32 * kPer - 1) / (32 * kPer));
  const int64_t grid = rows < 0x7fffffff ? rows : 0x7fffffff;
  route_experts_kernel<<<static_cast<unsigned>(grid), 32 * warps, 0, stream>>>(
      logits.typed_data(), bias.typed_data(), rows, static_cast<int>(E), static_cast<int>(top_k),
      grouped ? static_cast<int>(n_group) : 1, grouped ? static_cast<int>(topk_group) : 1, static_cast<int>(scoring),
      use_bias, norm_topk_prob, routed_scaling_factor, indices->typed_data(), weights->typed_data());
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("route_experts (CUDA): kernel launch: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kdtree_route_experts_cuda, RouteExpertsCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<Logits>()                          // logits [..., E] f32
                                  .Arg<Logits>()                          // bias [E] f32
                                  .Attr<int64_t>("top_k")                 // 1..16
                                  .Attr<int64_t>("n_group")               // E % n_group == 0
                                  .Attr<int64_t>("topk_group")            // 1..n_group
                                  .Attr<int64_t>("scoring")               // 0 sigmoid, 1 softmax
                                  .Attr<bool>("use_bias")                 // noaux_tc: choose on score + bias
                                  .Attr<bool>("norm_topk_prob")           // weights / (their sum + 1e-20)
                                  .Attr<float>("routed_scaling_factor")   // weights * this
                                  .Ret<Indices>()                         // indices [..., k] s32
                                  .Ret<Weights>(),                        // weights [..., k] f32
                              {ffi::Traits::kCmdBufferCompatible});
