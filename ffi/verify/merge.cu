// The combine step of split-KV: merge each query row's per-split partials (out / l, lse) by LSE weights into the
// final bf16 row and its lse. Two shapes of the same arithmetic: a block per (row, column chunk) for many splits
// (few rows), a warp per (row, column quarter) for up to 16 splits (many rows).
#include "device.cuh"
#include "kernels.h"

namespace kdtree::verify {
namespace {

// Merge the splits of one query row: weights exp(lse_s - max), out = sum w_s out_s / sum w_s, over the splits that
// hold positions (device.cuh, split_plan: a count from the device kv_len and the partition, the same for a verify
// pass's root row and the one-token call at its position), in split order. Which merge runs, and its instance, is
// chosen from the partition's split count and B * H, never from T, so a row's merge arithmetic does not depend on T.
// For more than 16 splits (few query rows: T*H <= 16 with B = 1 runs 256 splits): a 256-thread block per
// (row, column chunk); kLanesPerSplit lanes cover the chunk's columns of one split (4 floats each), so a block
// reads 256 / kLanesPerSplit splits per pass. Each thread keeps 8 16-byte loads in flight, and the first round is
// issued before the weights are known (every split writes its partial, empty ones zeros). The chunk is narrow
// when there are few rows: at T = 1, H = 8, B = 1 a (row, quarter) block had to read 128 KB (32 blocks for the
// whole GPU, 3.9 us at 64k, H200, 5353a84); 32-column chunks give 128 blocks of 32 KB, one round trip each.
constexpr int kMergeThreads = 256;
constexpr int kMergeWarps = kMergeThreads / 32;
constexpr int kMergeUnroll = 8;

__device__ __forceinline__ float block_reduce(float v, float* scratch, bool is_max) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, o);
    v = is_max ? fmaxf(v, other) : v + other;
  }
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < kMergeWarps; ++w) total = is_max ? fmaxf(total, scratch[w]) : total + scratch[w];
  __syncthreads();
  return total;
}

// Column chunks per row of a merge_splits_kernel instance (4 columns a lane).
template <int kLanesPerSplit>
constexpr int kMergeChunks = kLatent / (4 * kLanesPerSplit);

template <int kLanesPerSplit>
__global__ void __launch_bounds__(kMergeThreads) merge_splits_kernel(const Params p) {
  static_assert(kLanesPerSplit >= 8 && kLanesPerSplit <= 32 && 32 % kLanesPerSplit == 0, "splits share warps evenly");
  constexpr int kChunks = kMergeChunks<kLanesPerSplit>;
  constexpr int kSplitsPerPass = kMergeThreads / kLanesPerSplit;
  __shared__ float weight[kMaxSplits];
  __shared__ float scratch[kMergeWarps];
  __shared__ float4 partial[kMergeWarps][kLanesPerSplit];
  const int r = static_cast<int>(blockIdx.x / kChunks), chunk = static_cast<int>(blockIdx.x % kChunks);
  const int b = blockIdx.y;
  const int vec = threadIdx.x % kLanesPerSplit, grp = threadIdx.x / kLanesPerSplit;
  const int64_t part_row0 = static_cast<int64_t>(b) * p.num_splits * p.rows + r;  // split s at + s * rows
  wait_for_previous_grid();
  const int used = split_plan(p, b).used;
  if (used <= 1) return;  // the main kernel wrote this sequence's rows itself (device.cuh, SplitTiles::direct)
  const int col = (chunk * kLanesPerSplit + vec) * 4;
  auto load_part = [&](int s) {
    return s < used ? *reinterpret_cast<const float4*>(p.out_part + (part_row0 + static_cast<int64_t>(s) * p.rows) * kLatent + col)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
  };
  float4 v[kMergeUnroll];
#pragma unroll
  for (int u = 0; u < kMergeUnroll; ++u) v[u] = load_part(grp + u * kSplitsPerPass);  // round 0, in flight now

  float local_max = -INFINITY;
  for (int s = threadIdx.x; s < used; s += kMergeThreads) {
    weight[s] = p.lse_part[part_row0 + static_cast<int64_t>(s) * p.rows];
    local_max = fmaxf(local_max, weight[s]);
  }
  const float m = block_reduce(local_max, scratch, true);
  float local_sum = 0.f;
  for (int s = threadIdx.x; s < used; s += kMergeThreads) {
    weight[s] = m == -INFINITY ? 0.f : __expf(weight[s] - m);
    local_sum += weight[s];
  }
  const float total = block_reduce(local_sum, scratch, false);  // (its barrier also publishes weight[])

  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = grp;; ) {
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      const int s = s0 + u * kSplitsPerPass;
      const float w = s < used ? weight[s] : 0.f;
      sum.x += w * v[u].x; sum.y += w * v[u].y; sum.z += w * v[u].z; sum.w += w * v[u].w;
    }
    s0 += kSplitsPerPass * kMergeUnroll;
    if (s0 >= used) break;
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) v[u] = load_part(s0 + u * kSplitsPerPass);  // the next round
  }
  // The groups of one warp (lanes kLanesPerSplit apart hold the same columns), then the warps.
#pragma unroll
  for (int o = kLanesPerSplit; o < 32; o *= 2) {
    sum.x += __shfl_xor_sync(0xffffffffu, sum.x, o); sum.y += __shfl_xor_sync(0xffffffffu, sum.y, o);
    sum.z += __shfl_xor_sync(0xffffffffu, sum.z, o); sum.w += __shfl_xor_sync(0xffffffffu, sum.w, o);
  }
  if (threadIdx.x % 32 < kLanesPerSplit) partial[threadIdx.x / 32][vec] = sum;
  __syncthreads();
  if (threadIdx.x >= kLanesPerSplit) return;  // thread t < kLanesPerSplit: vec = t, group 0 of warp 0
#pragma unroll
  for (int w = 1; w < kMergeWarps; ++w) {
    const float4 o = partial[w][vec];
    sum.x += o.x; sum.y += o.y; sum.z += o.z; sum.w += o.w;
  }
  const float inv_total = total > 0.f ? 1.f / total : 0.f;
  const int64_t row_index = static_cast<int64_t>(b) * p.rows + r;
  uint2 packed;
  packed.x = pack_bf16(sum.x * inv_total, sum.y * inv_total);
  packed.y = pack_bf16(sum.z * inv_total, sum.w * inv_total);
  *reinterpret_cast<uint2*>(p.out + row_index * kLatent + col) = packed;
  if (chunk == 0 && vec == 0) p.lse[row_index] = total > 0.f ? m + logf(total) : -INFINITY;
}

// A merge_splits_kernel instance and its grid for B * rows query rows.
template <int kLanesPerSplit>
void launch_block_merge(const Params& p, int64_t batch, cudaStream_t stream, bool pdl) {
  launch_kernel(merge_splits_kernel<kLanesPerSplit>,
                dim3(static_cast<unsigned>(p.rows * kMergeChunks<kLanesPerSplit>), static_cast<unsigned>(batch)),
                dim3(kMergeThreads), 0, stream, pdl, p);
}

// The instance (its split grouping, hence its summation order) comes from the call's query rows B * T * H, except
// under the invariant partition (p.split_parts > 0: the split policy of row-invariant decoding, issue 24), where it
// comes from B * H, the rows of a one-token call, so that a verify pass's rows merge as the one-token call's do. At
// least ~2 blocks per SM of an H200 at T = 1: 16 / 8 / 4 chunks per row; a many-row call takes the widest chunks
// (the fewest blocks: each block's two reductions and its lse loads are its fixed cost).
void launch_many_split_merge_impl(const Params& p, int64_t batch, cudaStream_t stream, bool pdl) {
  const int64_t rows = batch * (p.split_parts > 0 ? p.num_heads : p.rows);
  if (rows <= 16) {
    launch_block_merge<8>(p, batch, stream, pdl);
  } else if (rows <= 64) {
    launch_block_merge<16>(p, batch, stream, pdl);
  } else {
    launch_block_merge<32>(p, batch, stream, pdl);
  }
}

// The same merge for few splits (many query rows: T*H > 128 or B > 1): one warp per (row, column quarter), eight
// to a block, every split's 16-byte load issued before the weights, the weights reduced by shuffles. The block
// merge above spends a 512-thread block and two block-wide reductions on each (row, quarter): with 2-16 splits
// most of its warps idle and the blocks' launch and reductions dominate (H200, 2cc2658: 67 us for the 2,056
// rows of T = 257, H = 8 over 2 splits, against 98 us for the main kernel at L = 4k).
constexpr int kWarpMergeMaxSplits = 16;
constexpr int kMergeQuarters = kLatent / (32 * 4);  // the warp merge's column quarters: 4
constexpr int kWarpMergeWarps = 8;

__global__ void __launch_bounds__(kWarpMergeWarps * 32) merge_splits_warp_kernel(const Params p, int64_t items) {
  const int lane = threadIdx.x % 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpMergeWarps + threadIdx.x / 32;
  if (item >= items) return;  // a whole warp: items = B * rows * quarters
  const int64_t row_index = item / kMergeQuarters;  // b * rows + r
  const int quarter = static_cast<int>(item % kMergeQuarters);
  const int64_t b = row_index / p.rows, r = row_index % p.rows;
  const int64_t part_row0 = b * p.num_splits * p.rows + r;  // split s at + s * rows
  wait_for_previous_grid();
  const int used = split_plan(p, static_cast<int>(b)).used;
  if (used <= 1) return;  // the main kernel wrote this sequence's rows itself (device.cuh, SplitTiles::direct)
  const int col = quarter * 128 + lane * 4;
  float4 v[kWarpMergeMaxSplits];
#pragma unroll
  for (int s = 0; s < kWarpMergeMaxSplits; ++s) {
    if (s < used) v[s] = *reinterpret_cast<const float4*>(p.out_part + (part_row0 + static_cast<int64_t>(s) * p.rows) * kLatent + col);
  }
  const float lse_s = lane < used ? p.lse_part[part_row0 + static_cast<int64_t>(lane) * p.rows] : -INFINITY;
  float m = lse_s;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const float w_s = m == -INFINITY ? 0.f : __expf(lse_s - m);  // 0 for lanes past the splits
  float total = w_s;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int s = 0; s < kWarpMergeMaxSplits; ++s) {
    if (s < used) {  // uniform over the warp
      const float w = __shfl_sync(0xffffffffu, w_s, s);
      sum.x += w * v[s].x; sum.y += w * v[s].y; sum.z += w * v[s].z; sum.w += w * v[s].w;
    }
  }
  const float inv_total = total > 0.f ? 1.f / total : 0.f;
  uint2 packed;
  packed.x = pack_bf16(sum.x * inv_total, sum.y * inv_total);
  packed.y = pack_bf16(sum.z * inv_total, sum.w * inv_total);
  *reinterpret_cast<uint2*>(p.out + row_index * kLatent + col) = packed;
  if (quarter == 0 && lane == 0) p.lse[row_index] = total > 0.f ? m + logf(total) : -INFINITY;
}

}  // namespace

cudaError_t merge_setup() {
  // The merge runs right after the main kernel: the same carveout spares the multiprocessors a shared memory / L1
  // reconfiguration (a drain) between the two launches.
  const void* merges[] = {reinterpret_cast<const void*>(merge_splits_kernel<8>),
                          reinterpret_cast<const void*>(merge_splits_kernel<16>),
                          reinterpret_cast<const void*>(merge_splits_kernel<32>),
                          reinterpret_cast<const void*>(merge_splits_warp_kernel)};
  for (const void* fn : merges) {
    if (cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
        err != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}

// The merge by the partition's split count (not the grid's, which the table width can cap; device.cuh, split_plan).
void launch_merge(const Params& p, int64_t batch, cudaStream_t stream, bool pdl) {
  if (p.num_splits <= 1) return;
  if ((p.split_parts > 0 ? p.split_parts : p.num_splits) > kWarpMergeMaxSplits) {
    launch_many_split_merge_impl(p, batch, stream, pdl);
  } else {
    const int64_t items = batch * p.rows * kMergeQuarters;
    launch_kernel(merge_splits_warp_kernel, dim3(static_cast<unsigned>((items + kWarpMergeWarps - 1) / kWarpMergeWarps)),
                  dim3(kWarpMergeWarps * 32), 0, stream, pdl, p, items);
  }
}

}  // namespace kdtree::verify
