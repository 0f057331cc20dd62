// What the two routed-expert ops share (moe_experts.cu: rows sorted by expert; moe_pairs.cu: the router's
// (token, choice) pairs in place): a block's thread layout and the GEMV loops of the gate/up and down products.
// Both ops run a pair's arithmetic here, in the same order, so the same pair gives the same bits in either.
//
// A block (kWarps warps) covers 64 output columns: a thread owns 8 consecutive columns (one 16-byte weight load
// per weight row) and one slice of the reduction dim, 8 reduction rows per step, slices interleaved by 8 rows so
// that the kSlices slices of a block cover the reduction dim in contiguous strides. The 8 threads of a column
// group read one 128-byte line of a weight row; a warp reads 4 such lines. Each step issues all its 16-byte
// weight loads before any arithmetic, so every thread keeps up to 256 bytes in flight; independent warps
// overlap one another's load latency with their FMAs. Partial sums of the slices are reduced with warp
// shuffles, then across warps through shared memory (the caller adds the warps, in warp order).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kdtree::moe {

constexpr int kWarps = 4;                       // 128 threads: several blocks per SM at ~150 registers
constexpr int kThreads = kWarps * 32;
constexpr int kColsPerThread = 8;               // one 16-byte load of bf16 weights
constexpr int kColGroups = 8;                   // threads sharing one reduction row: 8 x 16 B = 128 B
constexpr int kTileCols = kColGroups * kColsPerThread;  // 64 output columns per block
constexpr int kSlicesPerWarp = 32 / kColGroups;         // 4
constexpr int kSlices = kWarps * kSlicesPerWarp;        // 16 slices of the reduction dim per block
constexpr int kStep = 8;                        // reduction rows per slice step
constexpr int kMaxRows = 4;                     // accumulator rows per chunk

// Per-warp column sums of up to kMaxRows rows, for kMats matrices (gate and up: 2; down: 1).
template <int kMats>
using Reduction = float[kMats][kWarps][kMaxRows][kTileCols];

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// 8 consecutive bf16 at p, of which the first `valid` exist.  kVec: one 16-byte load (the caller guarantees
// `valid` is 0 or 8 and p is 16-byte aligned); else element by element, zeros past `valid`.
template <bool kVec>
__device__ __forceinline__ uint4 load_bf16x8(const uint16_t* p, int valid) {
  if constexpr (kVec) {
    if (valid <= 0) return make_uint4(0, 0, 0, 0);
    return __ldg(reinterpret_cast<const uint4*>(p));
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t lo = 2 * i < valid ? __ldg(p + 2 * i) : 0u;
      const uint32_t hi = 2 * i + 1 < valid ? __ldg(p + 2 * i + 1) : 0u;
      w[i] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Element i (compile-time after unrolling) of 8 packed bf16.
__device__ __forceinline__ float bf16_at(const uint4& raw, int i) {
  const uint32_t w = i < 2 ? raw.x : i < 4 ? raw.y : i < 6 ? raw.z : raw.w;
  return i & 1 ? bf16_hi(w) : bf16_lo(w);
}

__device__ __forceinline__ void unpack(const uint4& raw, float (&v)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = bf16_lo(w[i]);
    v[2 * i + 1] = bf16_hi(w[i]);
  }
}

// 8 consecutive floats of an activation row (kVec: two 16-byte loads; rows of a multiple of 8 floats).
template <bool kVec>
__device__ __forceinline__ void load_f32x8(const float* p, int valid, float (&v)[8]) {
  if constexpr (kVec) {
    if (valid <= 0) {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.f;
      return;
    }
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = i < valid ? p[i] : 0.f;
  }
}

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + __expf(-g)) * u; }

__device__ __forceinline__ uint16_t bf16_bits(float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  return *reinterpret_cast<const uint16_t*>(&b);
}

// Sum a thread's [kRows][8] partials over the block's kSlices slices; warp w's totals of output column
// (r, c) end up in red[m][w][r][c] (summed over warps by the caller, in warp order).
template <int kRows, int kMats>
__device__ __forceinline__ void reduce_slices(float (&acc)[kMats][kRows][8], Reduction<kMats>& red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, cg = lane & (kColGroups - 1);
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float v = acc[m][r][j];
#pragma unroll
        for (int off = kColGroups; off < 32; off <<= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane < kColGroups) red[m][warp][r][cg * 8 + j] = v;
      }
}

// Column c of row r of matrix m, summed over the block's warps in order.
template <int kMats>
__device__ __forceinline__ float column_sum(const Reduction<kMats>& red, int m, int r, int c) {
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) s += red[m][w][r][c];
  return s;
}

// This thread's part of a block's work: its slice of the reduction dim, its first output column of the block's 64
// starting at col0, and how many of its 8 columns exist in a row of `width`.
struct ThreadPart {
  int slice;
  int64_t col;
  int col_valid;
};
__device__ __forceinline__ ThreadPart thread_part(int64_t col0, int64_t width) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t col = col0 + (lane & (kColGroups - 1)) * kColsPerThread;
  return ThreadPart{warp * kSlicesPerWarp + (lane >> 3), col,
                    static_cast<int>(col < width ? (width - col < 8 ? width - col : 8) : 0)};
}

// Gate/up sums of kRows input rows (x, x + x_stride, ...; the first n real) over hidden rows [h_begin, h_end)
// for the block's 64 intermediate columns starting at `col0`: wg and wu are one expert's [H, I] weights. On
// return (after a block barrier) red[0|1] holds the per-warp sums.
template <bool kVec, int kRows>
__device__ __forceinline__ void gate_up_sums(const uint16_t* x, int64_t x_stride, int n, const uint16_t* wg,
                                             const uint16_t* wu, int64_t I, int64_t col0, int64_t h_begin,
                                             int64_t h_end, Reduction<2>& red) {
  const ThreadPart t = thread_part(col0, I);
  const int slice = t.slice, col_valid = t.col_valid;
  wg += t.col;
  wu += t.col;

  float acc[2][kRows][8] = {};
  for (int64_t h0 = h_begin + slice * kStep; h0 < h_end; h0 += int64_t{kSlices} * kStep) {
    // Issue every load of the step first: 16 weight lines + the rows' 8 inputs.
    uint4 g_raw[kStep], u_raw[kStep], x_raw[kRows];
#pragma unroll
    for (int i = 0; i < kStep; ++i) {
      const int v = h0 + i < h_end ? col_valid : 0;
      g_raw[i] = load_bf16x8<kVec>(wg + (h0 + i) * I, v);
      u_raw[i] = load_bf16x8<kVec>(wu + (h0 + i) * I, v);
    }
    const int h_valid = static_cast<int>(h_end - h0 < 8 ? h_end - h0 : 8);
#pragma unroll
    for (int r = 0; r < kRows; ++r) x_raw[r] = load_bf16x8<kVec>(x + r * x_stride + h0, r < n ? h_valid : 0);
#pragma unroll
    for (int i = 0; i < kStep; ++i) {
      float g[8], u[8];
      unpack(g_raw[i], g);
      unpack(u_raw[i], u);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float xi = bf16_at(x_raw[r], i);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[0][r][j] = fmaf(xi, g[j], acc[0][r][j]);
          acc[1][r][j] = fmaf(xi, u[j], acc[1][r][j]);
        }
      }
    }
  }
  reduce_slices<kRows, 2>(acc, red);
  __syncthreads();
}

// Down sums of kRows activation rows (hid, hid + hid_stride, ...: float32 [I] each; the first n real) for the
// block's 64 hidden columns starting at `col0`: wd is one expert's [I, H] weights. On return (after a block
// barrier) red[0] holds the per-warp sums. kUnroll: the slice's steps whose loads are issued together (2: 256 bytes
// in flight a thread, as gate_up_sums has; affordable with one row's accumulators) -- the steps are still added in
// order, so the bits do not depend on it.
template <bool kVec, int kRows, int kUnroll = 1>
__device__ __forceinline__ void down_sums(const float* hid, int64_t hid_stride, int n, const uint16_t* wd, int64_t I,
                                          int64_t H, int64_t col0, Reduction<1>& red) {
  const ThreadPart t = thread_part(col0, H);
  const int slice = t.slice, col_valid = t.col_valid;
  wd += t.col;
  float acc[1][kRows][8] = {};
  constexpr int64_t kStride = int64_t{kSlices} * kStep;  // rows between a slice's consecutive steps
  for (int64_t i00 = int64_t{slice} * kStep; i00 < I; i00 += kUnroll * kStride) {
    uint4 d_raw[kUnroll][kStep];
    float hv[kUnroll][kRows][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i0 = i00 + u * kStride;
#pragma unroll
      for (int i = 0; i < kStep; ++i) d_raw[u][i] = load_bf16x8<kVec>(wd + (i0 + i) * H, i0 + i < I ? col_valid : 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i0 = i00 + u * kStride;
      const int i_valid = static_cast<int>(I - i0 >= 8 ? 8 : (I - i0 > 0 ? I - i0 : 0));
#pragma unroll
      for (int r = 0; r < kRows; ++r) load_f32x8<kVec>(hid + r * hid_stride + i0, r < n ? i_valid : 0, hv[u][r]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int i = 0; i < kStep; ++i) {
        float d[8];
        unpack(d_raw[u][i], d);
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[0][r][j] = fmaf(hv[u][r][i], d[j], acc[0][r][j]);
      }
    }
  }
  reduce_slices<kRows, 1>(acc, red);
  __syncthreads();
}

// A reduction dim of `rows` cut into at most `splits` splits: rows per split (a multiple of kStep) and how many splits
// that makes (none empty; 1 when rows is 0).
struct DimSplits {
  int64_t rows;
  int count;
};
inline DimSplits split_dim(int64_t rows, int64_t splits) {
  const int64_t per = ((rows + splits - 1) / splits + kStep - 1) / kStep * kStep;
  return {per, per > 0 ? static_cast<int>((rows + per - 1) / per) : 1};
}

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Multiprocessor count of the current device (cached; 132 when the query fails).
inline int sm_count() {
  static const int n = [] {
    int dev = 0, count = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || count <= 0) {
      count = 132;
    }
    return count;
  }();
  return n;
}

}  // namespace kdtree::moe
