// CUDA handler of the fused log-softmax + top-k (semantics: topk.h; Python side: kdtree_jax/ops/topk.py).
//
// Why.  The drafter's step took log_softmax (two XLA reduce fusions over the logits and an elementwise pass) and then
// XLA's TopK kernel, ~50 us on an H200 at the default pair's [256, 8192] float32 logits, for what is one read of a
// few MB.  Here one kernel reads each row once:
//   block      one row at a time (a grid-stride loop over rows), 1-16 warps by the row's width: a wide row wants
//              many 16-byte loads in flight per SM (few rows: K2's vocabulary on a handful of rows), a narrow one
//              gains nothing from idle warps
//   scan       each thread takes 16-byte vectors of the row, strided by the block (4 vectors in flight), plus the
//              unaligned head / odd tail element by element.  Per element it keeps the running max and sum of
//              exp(x - max) (online softmax: the sum is rescaled when the max grows, once per vector) and a sorted
//              top-K list in registers (K = k rounded up to a power of two: the list is unrolled code).  An element
//              enters the list only when it beats the list's last entry, which after the first few vectors is rare
//   merge      warp: k rounds of a shuffle argmax over the lanes' list heads, the winner lane shifts its list; the
//              warp's k best and (max, sum) go to shared memory.  Block: warp 0 merges the warps' sorted lists the
//              same way (lane w points into warp w's list) and their (max, sum) in warp order
//   output     value = (x - max) - log(sum), XLA's log_softmax rounding; lane r of warp 0 writes the r-th.
// Order.  Elements compare on (scaled logit, index): larger first, equal ones by the lower index, a total order, so
// which thread saw an element does not matter.  The log-prob is a monotone function of the scaled logit, but two
// logits can round to the same log-prob: the outputs are re-ranked by (log-prob, index) inside the k (lane ranks by
// shuffles), so the outputs are sorted exactly as lax.top_k sorts; only which element takes the k-th place among
// log-probs equal after rounding can differ from XLA's (it keeps the larger logit).
// NaN is selected as -inf (so every index returned is a real one even in a row of NaN) and makes the row's sum, and
// so every value of the row, NaN.  A row of -inf: max -inf, values NaN, indices 0..k-1, as XLA gives.
// No host sync, no allocation, no scratch: graph-safe (kCmdBufferCompatible).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "topk.h"

namespace ffi = xla::ffi;

namespace {

using kdtree::topk::kMaxK;

constexpr int kMaxWarps = 16;
// A K = 32 list is 64 registers: at 512 threads (128 registers a thread) it spilled on sm_120, so its blocks stop at
// 256 threads (8 warps).
template <int K>
constexpr int max_warps() {
  return K >= 32 ? 8 : kMaxWarps;
}
constexpr int kUnroll = 4;                    // 16-byte loads in flight per thread
constexpr int32_t kNoIndex = 0x7fffffff;      // an empty list slot: loses to every real element, -inf included
constexpr unsigned kFull = 0xffffffffu;

// (av, ai) ranks before (bv, bi): the larger value, equal values by the lower index.  Keys are never NaN.
__device__ __forceinline__ bool better(float av, int32_t ai, float bv, int32_t bi) {
  return av > bv || (av == bv && ai < bi);
}

// A 16-byte vector of the row's element type.
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static float at(const uint4& w, int j) {
    return __uint_as_float(j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w);
  }
  __device__ static float one(const float* p) { return __ldg(p); }
};
template <>
struct Vec<uint16_t> {  // bfloat16 bits
  static constexpr int kN = 8;
  __device__ static float at(const uint4& w, int j) {
    const uint32_t word = j < 2 ? w.x : j < 4 ? w.y : j < 6 ? w.z : w.w;
    return __uint_as_float(j & 1 ? word & 0xffff0000u : word << 16);
  }
  __device__ static float one(const uint16_t* p) { return __uint_as_float(uint32_t{__ldg(p)} << 16); }
};

// One thread's view of its part of a row: online (max, sum of exp) and its K best (key, index), sorted.
template <int K>
struct Partial {
  float m, s;
  float v[K];
  int32_t i[K];

  __device__ __forceinline__ void reset() {
    m = -INFINITY;
    s = 0.f;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      v[j] = -INFINITY;
      i[j] = kNoIndex;
    }
  }

  // Insert (key, idx) when it beats the last entry: a compare-and-shift per slot, unrolled so the list stays in
  // registers (a dynamically indexed array would live in local memory).
  __device__ __forceinline__ void push(float key, int32_t idx) {
    if (!better(key, idx, v[K - 1], i[K - 1])) return;
#pragma unroll
    for (int j = K - 1; j > 0; --j) {
      if (better(key, idx, v[j - 1], i[j - 1])) {
        v[j] = v[j - 1];
        i[j] = i[j - 1];
      } else if (better(key, idx, v[j], i[j])) {
        v[j] = key;
        i[j] = idx;
      }
    }
    if (better(key, idx, v[0], i[0])) {
      v[0] = key;
      i[0] = idx;
    }
  }

  // Drop the head (it won a merge round).
  __device__ __forceinline__ void pop() {
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
      v[j] = v[j + 1];
      i[j] = i[j + 1];
    }
    v[K - 1] = -INFINITY;
    i[K - 1] = kNoIndex;
  }

  // N consecutive (already scaled) logits starting at index idx0.
  template <int N>
  __device__ __forceinline__ void consume(const float (&x)[N], int32_t idx0) {
    float key[N];
    float cm = -INFINITY;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      key[j] = x[j] != x[j] ? -INFINITY : x[j];
      cm = fmaxf(cm, key[j]);
    }
    // Rescale once per vector.  m = -inf gives exp(-inf) = 0 (s was 0, or NaN, which stays NaN).
    if (cm > m) {
      s *= expf(m - cm);
      m = cm;
    }
    // While the max is -inf every exp is 0 (NaN for a NaN logit): subtract 0 there, not -inf (-inf - -inf = NaN).
    const float base = m == -INFINITY ? 0.f : m;
#pragma unroll
    for (int j = 0; j < N; ++j) s += expf(x[j] - base);
    // Skip the list unless the vector's best key could enter it (its lowest index is idx0).
    if (better(cm, idx0, v[K - 1], i[K - 1])) {
#pragma unroll
      for (int j = 0; j < N; ++j) push(key[j], idx0 + j);
    }
  }
};

// Merge two (max, sum of exp(x - max)) pairs.  A NaN sum stays NaN; -inf maxima give 0-weighted sums.
__device__ __forceinline__ void merge_lse(float& m, float& s, float om, float os) {
  const float nm = fmaxf(m, om);
  const float base = nm == -INFINITY ? 0.f : nm;
  s = s * expf(m - base) + os * expf(om - base);
  m = nm;
}

// Shuffle argmax over the warp's (v, i) by `better`: every lane gets the winner.
__device__ __forceinline__ void warp_best(float& v, int32_t& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, off);
    const int32_t oi = __shfl_xor_sync(kFull, i, off);
    if (better(ov, oi, v, i)) {
      v = ov;
      i = oi;
    }
  }
}

template <int K>
struct Shared {
  float v[kMaxWarps][K];  // each warp's k best keys, sorted
  int32_t i[kMaxWarps][K];
  float m[kMaxWarps], s[kMaxWarps];
};

template <typename T, int K>
__global__ void __launch_bounds__(32 * max_warps<K>()) log_softmax_top_k_kernel(const T* __restrict__ logits, int64_t rows,
                                                                         int64_t V, int k, float temperature,
                                                                         float* __restrict__ values,
                                                                         int32_t* __restrict__ indices) {
  constexpr int kN = Vec<T>::kN;
  __shared__ Shared<K> sh;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int nt = blockDim.x;
  const bool scale = temperature != 1.f;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* x = logits + row * V;
    Partial<K> p;
    p.reset();
    // The row's first 16-byte boundary: XLA aligns buffers, but a row starts at row * V elements.
    const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
    int64_t head = addr % sizeof(T) != 0 ? V : static_cast<int64_t>(((16 - (addr & 15)) & 15) / sizeof(T));
    head = head < V ? head : V;
    const int64_t nvec = (V - head) / kN, tail = head + nvec * kN;
    auto one = [&](int64_t e) {
      const float raw = Vec<T>::one(x + e);
      const float xs[1] = {scale ? __fdiv_rn(raw, temperature) : raw};
      p.consume(xs, static_cast<int32_t>(e));
    };
    for (int64_t e = threadIdx.x; e < head; e += nt) one(e);
    const uint4* body = reinterpret_cast<const uint4*>(x + head);
    for (int64_t b = threadIdx.x; b < nvec; b += int64_t{nt} * kUnroll) {
      uint4 w[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {  // every load issued before any arithmetic
        const int64_t q = b + int64_t{u} * nt;
        w[u] = q < nvec ? __ldg(body + q) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t q = b + int64_t{u} * nt;
        if (q < nvec) {
          float xs[kN];
#pragma unroll
          for (int j = 0; j < kN; ++j) {
            const float raw = Vec<T>::at(w[u], j);
            xs[j] = scale ? __fdiv_rn(raw, temperature) : raw;
          }
          p.consume(xs, static_cast<int32_t>(head + q * kN));
        }
      }
    }
    for (int64_t e = tail + threadIdx.x; e < V; e += nt) one(e);

    // Warp: (max, sum) by butterfly, then k rounds of argmax over the lanes' heads; the owner of the winner pops it.
    // Fewer than k real elements in a warp: empty slots (kNoIndex) win the last rounds; popping one changes nothing.
    float m = p.m, s = p.s;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float om = __shfl_xor_sync(kFull, m, off), os = __shfl_xor_sync(kFull, s, off);
      merge_lse(m, s, om, os);
    }
    for (int r = 0; r < k; ++r) {
      float bv = p.v[0];
      int32_t bi = p.i[0];
      warp_best(bv, bi);
      if (p.i[0] == bi) p.pop();
      if (lane == 0) {
        sh.v[warp][r] = bv;
        sh.i[warp][r] = bi;
      }
    }
    if (lane == 0) {
      sh.m[warp] = m;
      sh.s[warp] = s;
    }
    __syncthreads();

    if (warp == 0) {
      // The row's (max, sum), merged in warp order (every lane the same).
      float M = sh.m[0], S = sh.s[0];
      for (int w = 1; w < warps; ++w) merge_lse(M, S, sh.m[w], sh.s[w]);
      const float lse = logf(S);
      // Block: lane w walks warp w's sorted list; k rounds of argmax.  The row has >= k real elements and every
      // warp's list holds its k best, so every winner is real and distinct.
      int ptr = 0;
      float mine_v = -INFINITY;
      int32_t mine_i = kNoIndex;
      for (int r = 0; r < k; ++r) {
        float bv = lane < warps && ptr < k ? sh.v[lane][ptr] : -INFINITY;
        int32_t bi = lane < warps && ptr < k ? sh.i[lane][ptr] : kNoIndex;
        const int32_t head_i = bi;
        warp_best(bv, bi);
        if (lane < warps && head_i == bi) ++ptr;
        if (lane == r) {
          mine_v = bv;
          mine_i = bi;
        }
      }
      // Lane r < k holds the r-th best key.  Its log-prob, XLA's way: (x - max) - log(sum).
      const float lp = (mine_v - M) - lse;
      // Rounding can make two different logits equal log-probs: rank by (log-prob, index) as lax.top_k does.  The
      // log-probs are all NaN or none is (a NaN sum or a -inf max hits every one): NaN keeps the key order.
      // Every lane runs the shuffles (lanes past k hold -inf / kNoIndex and rank last; they write nothing).
      int rank = 0;
      for (int l = 0; l < k; ++l) {
        const float ov = __shfl_sync(kFull, lp, l);
        const int32_t oi = __shfl_sync(kFull, mine_i, l);
        rank += better(ov, oi, lp, mine_i) ? 1 : 0;
      }
      if (lp != lp) rank = lane;
      if (lane < k) {
        values[row * k + rank] = lp;
        indices[row * k + rank] = mine_i;
      }
    }
    __syncthreads();  // `sh` is reused by the next row
  }
}

// Warps per block: enough that each thread has about two rounds of its 4 loads (8 vectors), 1..16 (8 at K = 32).
int warps_for(int64_t V, int vec, int most) {
  const int64_t nvec = (V + vec - 1) / vec;
  int64_t w = (nvec + 32 * kUnroll * 2 - 1) / (32 * kUnroll * 2);
  return static_cast<int>(w < 1 ? 1 : w > most ? most : w);
}

template <typename T, int K>
void launch(const void* logits, int64_t rows, int64_t V, int k, float temperature, float* values, int32_t* indices,
            cudaStream_t stream) {
  const int threads = 32 * warps_for(V, Vec<T>::kN, max_warps<K>());
  const int64_t grid = rows < 0x7fffffff ? rows : 0x7fffffff;
  log_softmax_top_k_kernel<T, K><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
      static_cast<const T*>(logits), rows, V, k, temperature, values, indices);
}

template <typename T>
void launch_k(const void* logits, int64_t rows, int64_t V, int k, float temperature, float* values, int32_t* indices,
              cudaStream_t stream) {
  static_assert(kMaxK == 32, "the list sizes below go up to kMaxK");
  if (k <= 1) {
    launch<T, 1>(logits, rows, V, k, temperature, values, indices, stream);
  } else if (k <= 2) {
    launch<T, 2>(logits, rows, V, k, temperature, values, indices, stream);
  } else if (k <= 4) {
    launch<T, 4>(logits, rows, V, k, temperature, values, indices, stream);
  } else if (k <= 8) {
    launch<T, 8>(logits, rows, V, k, temperature, values, indices, stream);
  } else if (k <= 16) {
    launch<T, 16>(logits, rows, V, k, temperature, values, indices, stream);
  } else {
    launch<T, 32>(logits, rows, V, k, temperature, values, indices, stream);
  }
}

using Values = ffi::Buffer<ffi::F32>;
using Indices = ffi::Buffer<ffi::S32>;

ffi::Error LogSoftmaxTopKCuda(cudaStream_t stream, ffi::AnyBuffer logits, float temperature,
                              ffi::Result<Values> values, ffi::Result<Indices> indices) {
  const ffi::DataType dtype = logits.element_type();
  if (dtype != ffi::DataType::F32 && dtype != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("log_softmax_top_k (CUDA): logits must be float32 or bfloat16");
  }
  const auto ld = logits.dimensions(), vd = values->dimensions(), id = indices->dimensions();
  if (ld.size() < 1 || vd.size() != ld.size() || id.size() != ld.size()) {
    return ffi::Error::InvalidArgument("log_softmax_top_k (CUDA): logits [..., V], values and indices [..., k]");
  }
  const size_t last = ld.size() - 1;
  int64_t rows = 1;
  for (size_t d = 0; d < last; ++d) {
    if (vd[d] != ld[d] || id[d] != ld[d]) {
      return ffi::Error::InvalidArgument("log_softmax_top_k (CUDA): values / indices leading dims differ from logits'");
    }
    rows *= ld[d];
  }
  const int64_t V = ld[last], k = vd[last];
  if (id[last] != k || k < 1 || k > kMaxK || k > V || V > 0x7fffffff) {
    return ffi::Error::InvalidArgument("log_softmax_top_k (CUDA): need 1 <= k <= min(V, 32) and V < 2^31");
  }
  if (!(temperature > 0.f)) {  // NaN fails too; +inf scales every logit to 0 (-inf ones to NaN), as x / t in XLA
    return ffi::Error::InvalidArgument("log_softmax_top_k (CUDA): temperature must be > 0");
  }
  if (rows == 0) return ffi::Error::Success();
  const int kk = static_cast<int>(k);
  if (dtype == ffi::DataType::F32) {
    launch_k<float>(logits.untyped_data(), rows, V, kk, temperature, values->typed_data(), indices->typed_data(),
                    stream);
  } else {
    launch_k<uint16_t>(logits.untyped_data(), rows, V, kk, temperature, values->typed_data(), indices->typed_data(),
                       stream);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("log_softmax_top_k (CUDA): kernel launch: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kdtree_log_softmax_top_k_cuda, LogSoftmaxTopKCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()        // logits [..., V] f32 / bf16
                                  .Attr<float>("temperature")   // > 0; 1 = no scaling
                                  .Ret<Values>()                // values [..., k] f32
                                  .Ret<Indices>(),              // indices [..., k] s32
                              {ffi::Traits::kCmdBufferCompatible});
