// CUDA handler of the MLA layer's prologue at decode sizes (semantics: mla_prologue.h; Python side:
// kdtree_jax/ops/mla_prologue.py).
//
// Why.  At T = 1 XLA ran the layer's first part as two GEMVs over the same input (q_a_proj, kv_a_proj_with_mqa), each
// split-K reductions of its own, then the two RMSNorms (a reduction kernel each) and the rope and the concatenation of
// the latent row: ~7 launches a layer of 1-5 us, around 30 MB of weights a Kimi-K2 layer (issue 46).  Here:
//   kernel 1  grid (Q/64 + (C+R)/64 tiles, splits): partial[s, t, col] = x[t][split s] . W[split s, col], both
//             matrices as one column range (a tile reads one of them), every split's rows in a fixed order;
//   kernel 2  grid (tokens, 2): a block per (token, q | kv) adds the splits in order, rounds to bfloat16 (the
//             product's dtype), normalises (and, for kv, ropes the last R columns) and writes the outputs.
// The input is read once for both products and the two reductions share one launch.  On compute capability 9.0+
// kernel 2 is a programmatic dependent of kernel 1 and kernel 1 of whatever ran before (pdl.cuh).  No host sync, no
// allocation: graph-safe.  Deterministic: every sum runs in a fixed order that does not depend on N.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "mla_prologue.h"
#include "moe_device.cuh"
#include "pdl.cuh"

namespace ffi = xla::ffi;

namespace {

using namespace kdtree::moe;  // the GEMV loop (down_sums: float32 rows times bf16 [rows, width] weights)

constexpr int kNormThreads = 512;  // a K2 q row (1536 columns) is 3 columns a thread: 3 round trips for its splits
constexpr int kBatch = 16;  // splits' partial loads in flight at once in kernel 2 (choose_splits gives <= 16 on a K2 layer)

struct PrologueParams {
  const float* x;          // [N, H]
  const uint16_t* w_qa;    // [H, Q]
  const uint16_t* w_kva;   // [H, C + R]
  const uint16_t* q_norm;  // [Q]
  const uint16_t* kv_norm; // [C]
  const float* cos;        // [N, R]
  const float* sin;        // [N, R]
  uint16_t* q_out;         // [N, Q]
  uint16_t* latent;        // [N, C + R]
  float* partial;          // [splits, N, W]: kernel 1's per-split sums, W = Q + C + R
  int64_t N, H, Q, C, R, W;
  int64_t q_tiles;
  int splits;
  int64_t split_rows;      // input rows per split (a multiple of kStep)
  float eps;
};

__device__ __forceinline__ float bf16_value(uint16_t bits) { return __uint_as_float(uint32_t{bits} << 16); }
__device__ __forceinline__ float round_bf16(float v) { return bf16_value(bf16_bits(v)); }

// One chunk of up to kRows tokens starting at row r0 through this block's (tile, split).
template <bool kVec, int kRows, int kUnroll>
__device__ __forceinline__ void product_chunk(const PrologueParams& p, int64_t r0, int n, const uint16_t* w,
                                              int64_t width, int64_t col0, int64_t out0, int64_t k0, int64_t k1,
                                              int split, Reduction<1>& red) {
  down_sums<kVec, kRows, kUnroll>(p.x + r0 * p.H + k0, p.H, n, w + k0 * width, k1 - k0, width, col0, red);
  const int64_t col = col0 + threadIdx.x;
  if (threadIdx.x < kTileCols && col < width) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (r < n) p.partial[(split * p.N + r0 + r) * p.W + out0 + col] = column_sum(red, 0, r, threadIdx.x);
    }
  }
  __syncthreads();  // `red` is reused by the next chunk
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) mla_prologue_product_kernel(PrologueParams p) {
  __shared__ Reduction<1> red;
  kdtree::wait_for_previous_grid();
  kdtree::allow_dependent_launch();
  const bool is_q = blockIdx.x < p.q_tiles;
  const int64_t tile = is_q ? blockIdx.x : blockIdx.x - p.q_tiles;
  const uint16_t* w = is_q ? p.w_qa : p.w_kva;
  const int64_t width = is_q ? p.Q : p.C + p.R, out0 = is_q ? 0 : p.Q;
  const int split = blockIdx.y;
  const int64_t k0 = split * p.split_rows, k1 = k0 + p.split_rows < p.H ? k0 + p.split_rows : p.H;
  for (int64_t r0 = 0; r0 < p.N; r0 += kMaxRows) {
    const int n = static_cast<int>(p.N - r0 < kMaxRows ? p.N - r0 : kMaxRows);
    // One token (the autoregressive step): two steps' weight loads in flight a thread; more: four rows' sums.
    if (n == 1) {
      product_chunk<kVec, 1, 2>(p, r0, n, w, width, tile * kTileCols, out0, k0, k1, split, red);
    } else {
      product_chunk<kVec, kMaxRows, 1>(p, r0, n, w, width, tile * kTileCols, out0, k0, k1, split, red);
    }
  }
}

// The sum of v over the block's threads, returned to every thread.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) total += scratch[i];
  return total;
}

__global__ void __launch_bounds__(kNormThreads) mla_prologue_norm_kernel(PrologueParams p) {
  extern __shared__ float row[];  // the token's product over this block's width, rounded to bf16
  __shared__ float scratch[kNormThreads / 32];
  kdtree::wait_for_previous_grid();
  kdtree::allow_dependent_launch();
  const int64_t t = blockIdx.x;
  const bool is_q = blockIdx.y == 0;
  const int64_t width = is_q ? p.Q : p.C + p.R, normed = is_q ? p.Q : p.C, out0 = is_q ? 0 : p.Q;
  float squares = 0.f;
  for (int64_t c = threadIdx.x; c < width; c += kNormThreads) {
    const float* part = p.partial + t * p.W + out0 + c;
    float s = 0.f;
    for (int s0 = 0; s0 < p.splits; s0 += kBatch) {  // kBatch loads in flight, added in split order
      float v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) v[j] = s0 + j < p.splits ? __ldcg(part + (s0 + j) * p.N * p.W) : 0.f;
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (s0 + j < p.splits) s += v[j];
      }
    }
    const float a = round_bf16(s);
    row[c] = a;
    if (c < normed) squares = fmaf(a, a, squares);
  }
  const float inv = rsqrtf(block_sum(squares, scratch) / static_cast<float>(normed) + p.eps);  // syncs `row` too
  const uint16_t* weight = is_q ? p.q_norm : p.kv_norm;
  uint16_t* out = is_q ? p.q_out + t * p.Q : p.latent + t * (p.C + p.R);
  for (int64_t c = threadIdx.x; c < normed; c += kNormThreads) {
    out[c] = bf16_bits(bf16_value(weight[c]) * round_bf16(row[c] * inv));
  }
  if (!is_q) {  // rotate-half rope of k_pe: out = k_pe * cos + [-k_pe[R/2:], k_pe[:R/2]] * sin
    const int64_t half = p.R / 2;
    const float* k_pe = row + p.C;
    for (int64_t j = threadIdx.x; j < p.R; j += kNormThreads) {
      const float rotated = j < half ? -k_pe[j + half] : k_pe[j - half];
      out[p.C + j] = bf16_bits(k_pe[j] * p.cos[t * p.R + j] + rotated * p.sin[t * p.R + j]);
    }
  }
}

template <bool kVec>
void launch(const PrologueParams& p, cudaStream_t stream) {
  const bool pdl = kdtree::pdl_supported();
  const int64_t kv_tiles = (p.C + p.R + kTileCols - 1) / kTileCols;
  kdtree::launch_kernel(mla_prologue_product_kernel<kVec>,
                        dim3(static_cast<unsigned>(p.q_tiles + kv_tiles), static_cast<unsigned>(p.splits)),
                        dim3(kThreads), 0, stream, pdl, p);
  const size_t smem = sizeof(float) * static_cast<size_t>(p.Q > p.C + p.R ? p.Q : p.C + p.R);
  kdtree::launch_kernel(mla_prologue_norm_kernel, dim3(static_cast<unsigned>(p.N), 2), dim3(kNormThreads), smem,
                        stream, pdl, p);
}

using F32x2 = ffi::Buffer<ffi::F32, 2>;
using Scratch = ffi::Buffer<ffi::F32, 1>;

constexpr int64_t kMaxWidth = 48 * 1024 / sizeof(float);  // kernel 2's row in the default 48 KB of shared memory

ffi::Error MlaPrologueCuda(cudaStream_t stream, F32x2 x, ffi::AnyBuffer w_qa, ffi::AnyBuffer w_kva,
                           ffi::AnyBuffer q_norm, ffi::AnyBuffer kv_norm, F32x2 cos, F32x2 sin, float eps,
                           int64_t splits, ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> latent,
                           ffi::Result<Scratch> partial) {
  const ffi::AnyBuffer* bf16_buffers[] = {&w_qa, &w_kva, &q_norm, &kv_norm, &*q_out, &*latent};
  for (const ffi::AnyBuffer* b : bf16_buffers) {
    if (b->element_type() != ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument("mla_prologue (CUDA): the weights and outputs must be bfloat16");
    }
  }
  const auto xd = x.dimensions(), qd = w_qa.dimensions(), kd = w_kva.dimensions(), cd = cos.dimensions(),
             sd = sin.dimensions(), qod = q_out->dimensions(), ld = latent->dimensions();
  if (xd.size() != 2 || qd.size() != 2 || kd.size() != 2 || q_norm.dimensions().size() != 1 ||
      kv_norm.dimensions().size() != 1 || qod.size() != 2 || ld.size() != 2) {
    return ffi::Error::InvalidArgument("mla_prologue (CUDA): x, the kernels and the outputs must be 2-D, the norms 1-D");
  }
  const int64_t N = xd[0], H = xd[1], Q = qd[1], C = kv_norm.dimensions()[0], R = kd[1] - C;
  if (qd[0] != H || kd[0] != H || q_norm.dimensions()[0] != Q || Q < 1 || C < 1 || R < 0 || R % 2 != 0 ||
      cd[0] != N || cd[1] != R || sd[0] != N || sd[1] != R || qod[0] != N || qod[1] != Q || ld[0] != N ||
      ld[1] != C + R || N > kdtree::mla::kMaxTokens || Q > kMaxWidth || C + R > kMaxWidth || splits < 1 ||
      splits > 65535 || partial->element_count() < splits * N * (Q + C + R)) {
    return ffi::Error::InvalidArgument(
        "mla_prologue (CUDA): inconsistent shapes (x [N<=16,H], w_qa [H,Q], w_kva [H,C+R], q_norm [Q], kv_norm [C], "
        "cos/sin [N,R] with R even, q_out [N,Q], latent [N,C+R], Q and C+R <= 12288, partial >= splits*N*(Q+C+R))");
  }
  if (N == 0) return ffi::Error::Success();

  PrologueParams p{};
  p.x = x.typed_data();
  p.w_qa = static_cast<const uint16_t*>(w_qa.untyped_data());
  p.w_kva = static_cast<const uint16_t*>(w_kva.untyped_data());
  p.q_norm = static_cast<const uint16_t*>(q_norm.untyped_data());
  p.kv_norm = static_cast<const uint16_t*>(kv_norm.untyped_data());
  p.cos = cos.typed_data();
  p.sin = sin.typed_data();
  p.q_out = static_cast<uint16_t*>(q_out->untyped_data());
  p.latent = static_cast<uint16_t*>(latent->untyped_data());
  p.partial = partial->typed_data();
  p.N = N;
  p.H = H;
  p.Q = Q;
  p.C = C;
  p.R = R;
  p.W = Q + C + R;
  p.q_tiles = (Q + kTileCols - 1) / kTileCols;
  p.eps = eps;
  const DimSplits cut = split_dim(H, splits);
  p.split_rows = cut.rows;
  p.splits = cut.count;
  const bool vec = H % 8 == 0 && Q % 8 == 0 && (C + R) % 8 == 0 && aligned16(p.x) && aligned16(p.w_qa) &&
                   aligned16(p.w_kva);
  if (vec) {
    launch<true>(p, stream);
  } else {
    launch<false>(p, stream);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("mla_prologue (CUDA): kernel launch: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kdtree_mla_prologue_cuda, MlaPrologueCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<F32x2>()           // x [N, H]
                                  .Arg<ffi::AnyBuffer>()  // w_qa [H, Q]
                                  .Arg<ffi::AnyBuffer>()  // w_kva [H, C + R]
                                  .Arg<ffi::AnyBuffer>()  // q_norm [Q]
                                  .Arg<ffi::AnyBuffer>()  // kv_norm [C]
                                  .Arg<F32x2>()           // cos [N, R]
                                  .Arg<F32x2>()           // sin [N, R]
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("splits")  // input-dim splits of kernel 1
                                  .Ret<ffi::AnyBuffer>()  // q_out [N, Q]
                                  .Ret<ffi::AnyBuffer>()  // latent [N, C + R]
                                  .Ret<Scratch>(),        // partial (scratch) [splits * N * (Q + C + R)]
                              {ffi::Traits::kCmdBufferCompatible});
