// The stream kernel (T*H <= 16: decode and small trees): one row group of 4 warps on one m16 tile of query rows,
// 16-position KV tiles in a 5-slot ring, two blocks per SM. These rows are memory-bound, so the depth of the copy
// pipeline is what counts.  S = Q·Kᵀ: warp w multiplies its 144-dim slice of the 576 dims (its Q fragments stay in
// registers) and the four partial score blocks are summed through shared memory; every warp runs the online
// softmax; O += P·V: warp w owns output dims [128w, 128w+128).
#include "device.cuh"
#include "kernels.h"

namespace kdtree::verify {
namespace {

// A block is one row group of 4 warps on 16 query rows (one m16 tile), two blocks per SM (kGroups stays a
// parameter of the tiling arithmetic; 1 is the only instance since the 32-row kernels took the larger row counts).  Every thread of the block issues copies:
// kThreadsPerRow threads per latent row of a tile, kChunksPerThread 16-byte copies each.
//   * one group: 16-position tiles in a 5-tile ring (4 tiles, 75 KB, in flight per block, 150 KB per SM):
//     these rows are memory-bound, so the depth of the copy pipeline is what counts;
//   * two groups: 32-position tiles in a 2-tile ring (one lands while one is computed): the fixed work of an
//     iteration (two barriers, the softmax's shuffles, the rescale, the copy issue) is shared by twice the
//     MMAs, which is what counts for these compute-heavy rows (the 32-wide partial scores leave no room in
//     99 KB for a third tile).
template <int kGroups>
struct Config {
  static constexpr int kThreads = kGroups * kWarps * 32;
  static constexpr int kTile = kGroups == 1 ? 16 : 32;  // KV positions per loop iteration (one ring slot)
  static constexpr int kRing = kGroups == 1 ? 5 : 2;    // ring slots: kRing - 1 tiles in flight
  static constexpr int kLead = kRing - 1;                // iteration t copies tile t + kLead
  static constexpr int kSub = kTile / 16;               // k16 steps of P·V (pairs of n8 score blocks) per tile
  static constexpr int kBlocksN = kTile / 8;            // n8 score blocks per tile
  static constexpr int kScoreStride = kTile + 8;        // floats per partial-score row (+8: conflict-free float2)
  static constexpr int kStageBytes = kTile * kRowBytes;
  static constexpr int kMinBlocksPerSm = kGroups == 1 ? 2 : 1;
  static constexpr int kThreadsPerRow = kThreads / kTile;                  // 8
  static constexpr int kChunksPerThread = kChunksPerRow / kThreadsPerRow;  // 9
  // Slots and L2 prefetch.  The slots of a tile are copied into a small shared ring (cp.async, in the commit
  // group of an earlier tile), so no copy ever waits for an index load; the rows of the kPrefetch tiles after
  // the last one requested are prefetched into L2, so that a tile's cp.async finds them there (L2 latency
  // instead of a DRAM round trip per tile: the 2-slot ring of the two-group kernel leaves a tile one
  // iteration to land).
  static constexpr int kPrefetch = kGroups == 1 ? 2 : 3;
  static constexpr int kSlotAhead = 2 * kLead + kPrefetch;  // tile whose slots iteration t requests: t + kSlotAhead
  static constexpr int kSlotRing = 8;                              // >= kRing + kPrefetch, a power of two
  static_assert(kSlotRing >= kRing + kPrefetch && (kSlotRing & (kSlotRing - 1)) == 0, "slot ring");
  static constexpr int kKvBytes = kRing * kStageBytes;
  static constexpr int kScoreBytes = kGroups * kWarps * kRows * kScoreStride * 4;
  static constexpr int kSlotBytes = kSlotRing * kTile * 4;
  static constexpr int kSmemBytes = kKvBytes + kScoreBytes + kSlotBytes;  // 100,096 / 96,256 B
  static_assert(kSmemBytes <= 99 * 1024, "shared memory must fit sm_120's 99 KB per block");
  static_assert(kChunksPerRow % kThreadsPerRow == 0 && kThreads % kTile == 0, "copy layout");
};

template <bool kDirect, int kGroups>
__global__ void __launch_bounds__(Config<kGroups>::kThreads, Config<kGroups>::kMinBlocksPerSm)
verify_attention_kernel(const Params p) {
  using C = Config<kGroups>;
  constexpr int kTile = C::kTile, kSub = C::kSub, kBlocksN = C::kBlocksN, kScoreStride = C::kScoreStride;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t kv_smem = smem_addr(smem);

  const int lane = threadIdx.x % 32;
  const int group = threadIdx.x / (kWarps * 32);       // which 16 query rows
  const int warp = (threadIdx.x / 32) % kWarps;        // which dim slice / output columns within the group
  // [group][warp][row][kScoreStride]: this group's partial scores.
  float* score_part = reinterpret_cast<float*>(smem + C::kKvBytes) + group * kWarps * kRows * kScoreStride;
  const int g = lane / 4, qd = lane % 4;  // MMA fragment coordinates: row in the m16 tile, column pair
  const int split = blockIdx.y, b = blockIdx.z;
  const int row0 = (blockIdx.x * kGroups + group) * kRows;

  // This sequence's valid positions and this split's share of them (whole tiles).
  const SplitTiles range = split_tiles<kTile>(p, b, split);
  const int valid = range.valid, first = range.first, tile_begin = range.tile_begin, tile_end = range.tile_end;

  // Q fragments of this warp's 144-dim slice, rows row0+g and row0+g+8 (zeros past the last row).  Loaded
  // before the prologue's copies, which wait for their slots: both round trips overlap.
  uint32_t qf[kKSteps][4];
  load_q_fragments(p, b, row0, warp, g, qd, qf);
  const KvPipeline<C> kv = make_kv_pipeline<C>(p, b, range, smem, kv_smem, C::kKvBytes + C::kScoreBytes);
  kv.start(tile_begin);

  // Tree-mask rows of this thread's two query rows (clamped: rows past the end are computed, not stored).
  const uint32_t* mask_a = p.tree_mask + (static_cast<int64_t>(b) * p.num_queries + min(row0 + g, p.rows - 1) / p.num_heads) * p.mask_words;
  const uint32_t* mask_b = p.tree_mask + (static_cast<int64_t>(b) * p.num_queries + min(row0 + g + 8, p.rows - 1) / p.num_heads) * p.mask_words;

  float acc[kOutBlocks][4];
#pragma unroll
  for (int i = 0; i < kOutBlocks; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // base-2 scaled running max of rows g, g+8
  float row_sum[2] = {0.f, 0.f};              // this thread's share of the running denominators

  const int mat = lane / 8;  // which 8x8 matrix of an ldmatrix.x4 this lane addresses
  // Q·Kᵀ B fragments: rows = positions (two n8 blocks), columns = this warp's dims.
  const uint32_t k_lane = ((lane % 8) + (mat / 2) * 8) * kRowBytes + (warp * kKSlice + (mat % 2) * 8) * 2;
  // P·V B fragments (transposed): rows = positions (the k16 step), columns = this warp's output dims.
  const uint32_t v_lane = ((lane % 8) + (mat % 2) * 8) * kRowBytes + (warp * kOutCols + (mat / 2) * 8) * 2;
  float* my_part = score_part + warp * kRows * kScoreStride;

  // Ring slots (byte offsets) of the tile computed and of the tile requested; advanced without a division.
  uint32_t read_off = 0, write_off = C::kLead * C::kStageBytes;
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    cp_async_wait<C::kLead - 1>();  // this tile's copies (this thread's) have landed ...
    // ... and everybody's; everybody is also done with tile - 1 (its slot is refilled next) and with the
    // partial scores of the previous tile.
    __syncthreads();
    const uint32_t stage_base = kv_smem + read_off;
    // The next tile's copies go out one chunk per k-step of Q·Kᵀ below, between its MMAs (as in score_slice).
    static_assert(C::kChunksPerThread == kKSteps, "one copy chunk per k-step");
    const KvRefill refill = kv.begin_refill(tile, write_off);

    // Partial scores over this warp's dims: 16 rows x kTile positions.  With 16-position tiles the even and
    // odd k-steps go to separate accumulators (two chains of 5 and 4 MMAs instead of one of 9); with 32 the
    // four n8 blocks already are four independent chains.
    constexpr int kChains = kSub == 1 ? 2 : 1;
    float s[kBlocksN][4], s_odd[kChains == 2 ? kBlocksN : 1][4];
#pragma unroll
    for (int nb = 0; nb < kBlocksN; ++nb) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
    for (int nb = 0; nb < (kChains == 2 ? kBlocksN : 1); ++nb) s_odd[nb][0] = s_odd[nb][1] = s_odd[nb][2] = s_odd[nb][3] = 0.f;
    for_each_index([&](auto step) {
      constexpr int ks = decltype(step)::value;
#pragma unroll
      for (int u = 0; u < kSub; ++u) {
        uint32_t kb[4];
        ldmatrix_x4(stage_base + k_lane + u * 16 * kRowBytes + ks * 32, kb);
        if (u == 0 && refill.do_copy) issue_kv_chunk<C::kThreadsPerRow, ks>(refill.copy);
        float (&d0)[4] = kChains == 2 && ks % 2 == 1 ? s_odd[0] : s[2 * u];
        float (&d1)[4] = kChains == 2 && ks % 2 == 1 ? s_odd[kChains == 2 ? 1 : 0] : s[2 * u + 1];
        mma_bf16(d0, qf[ks], kb[0], kb[1]);
        mma_bf16(d1, qf[ks], kb[2], kb[3]);
      }
    }, std::make_integer_sequence<int, kKSteps>{});
    kv.finish_refill(refill, tile, read_off, write_off);
    if constexpr (kChains == 2) {
#pragma unroll
      for (int nb = 0; nb < kBlocksN; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nb][e] += s_odd[nb][e];
      }
    }
#pragma unroll
    for (int nb = 0; nb < kBlocksN; ++nb) {
      *reinterpret_cast<float2*>(my_part + g * kScoreStride + nb * 8 + 2 * qd) = make_float2(s[nb][0], s[nb][1]);
      *reinterpret_cast<float2*>(my_part + (g + 8) * kScoreStride + nb * 8 + 2 * qd) = make_float2(s[nb][2], s[nb][3]);
    }
    __syncthreads();
    // Full scores (sum of the four warps' slices), scaled to base 2.
#pragma unroll
    for (int nb = 0; nb < kBlocksN; ++nb) {
      float2 top = make_float2(0.f, 0.f), bottom = make_float2(0.f, 0.f);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float* part = score_part + w * kRows * kScoreStride;
        const float2 t = *reinterpret_cast<const float2*>(part + g * kScoreStride + nb * 8 + 2 * qd);
        const float2 u = *reinterpret_cast<const float2*>(part + (g + 8) * kScoreStride + nb * 8 + 2 * qd);
        top.x += t.x; top.y += t.y; bottom.x += u.x; bottom.y += u.y;
      }
      s[nb][0] = top.x * p.scale_log2; s[nb][1] = top.y * p.scale_log2;
      s[nb][2] = bottom.x * p.scale_log2; s[nb][3] = bottom.y * p.scale_log2;
    }
    // Masking: only tiles that reach past the prefix (or past the valid length) need it.  The query indices
    // j = pos - first of a tile span at most two mask words per row (kTile <= 32): the four words of this
    // thread's two rows are loaded together (one memory round trip per masked tile, not one per element).
    const int tile_pos = tile * kTile;
    if (tile_pos + kTile > min(first, valid)) {
      const int j0 = tile_pos - first;      // query index of the tile's first position (< 0: prefix)
      const int w0 = max(j0, 0) >> 5;       // first mask word the tile touches
      const uint32_t* rows_m[2] = {mask_a, mask_b};
      uint64_t bits[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t lo = w0 < p.mask_words ? __ldg(rows_m[h] + w0) : 0u;
        const uint32_t hi = w0 + 1 < p.mask_words ? __ldg(rows_m[h] + w0 + 1) : 0u;
        bits[h] = (static_cast<uint64_t>(hi) << 32) | lo;
      }
#pragma unroll
      for (int nb = 0; nb < kBlocksN; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = tile_pos + nb * 8 + 2 * qd + (e & 1);
          const int j = pos - first;
          // j < T whenever pos < valid (valid <= kv_len = first + T); bit j - 32*w0 is in [0, 63).
          const bool visible = pos < valid && (j < 0 || ((bits[e >> 1] >> (j - 32 * w0)) & 1u));
          if (!visible) s[nb][e] = -INFINITY;
        }
      }
    }
    // Online softmax (rows g and g+8): new max over the quad, rescale, probabilities.
    float scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = s[0][2 * h];
#pragma unroll
      for (int nb = 0; nb < kBlocksN; ++nb) tile_max = fmaxf(tile_max, fmaxf(s[nb][2 * h], s[nb][2 * h + 1]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float new_max = fmaxf(row_max[h], tile_max);
      // A row that has seen nothing yet keeps max -inf; subtract 0 then so that exp2(-inf) = 0, not NaN.
      const float base = new_max == -INFINITY ? 0.f : new_max;
      scale[h] = fast_exp2(row_max[h] - base);
      row_max[h] = new_max;
      row_sum[h] *= scale[h];
#pragma unroll
      for (int nb = 0; nb < kBlocksN; ++nb) {
        s[nb][2 * h] = fast_exp2(s[nb][2 * h] - base);
        s[nb][2 * h + 1] = fast_exp2(s[nb][2 * h + 1] - base);
        row_sum[h] += s[nb][2 * h] + s[nb][2 * h + 1];
      }
    }
    // Rescale O only when some row's max moved (after the first tiles of a long row it rarely does).
    // The vote is per warp: each warp owns its accumulators, and skipping a multiply by exactly 1 is exact.
    if (__any_sync(0xffffffffu, scale[0] != 1.f || scale[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < kOutBlocks; ++i) {
        acc[i][0] *= scale[0]; acc[i][1] *= scale[0]; acc[i][2] *= scale[1]; acc[i][3] *= scale[1];
      }
    }
    // O += P·V over this warp's 128 output dims, one k16 step per 16 positions.  P (bf16) as A fragments:
    // the accumulator layout of two n8 score blocks is the A layout of one k16 step.  V is row-major
    // [position][dim]: transposed ldmatrix.
#pragma unroll
    for (int u = 0; u < kSub; ++u) {
      const uint32_t pf[4] = {pack_bf16(s[2 * u][0], s[2 * u][1]), pack_bf16(s[2 * u][2], s[2 * u][3]),
                              pack_bf16(s[2 * u + 1][0], s[2 * u + 1][1]), pack_bf16(s[2 * u + 1][2], s[2 * u + 1][3])};
#pragma unroll
      for (int j = 0; j < kOutBlocks / 2; ++j) {
        uint32_t vb[4];
        ldmatrix_x4_trans(stage_base + v_lane + u * 16 * kRowBytes + j * 32, vb);
        mma_bf16(acc[2 * j], pf, vb[0], vb[1]);
        mma_bf16(acc[2 * j + 1], pf, vb[2], vb[3]);
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: full denominators over the quad, normalise, write final rows or per-split partials.
  float inv[2], lse_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    inv[h] = sum > 0.f ? 1.f / sum : 0.f;
    lse_row[h] = sum > 0.f ? (row_max[h] + log2f(sum)) * kLn2 : -INFINITY;
  }
  const int r[2] = {row0 + g, row0 + g + 8};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (r[h] >= p.rows) continue;
    const int64_t row_index = kDirect ? static_cast<int64_t>(b) * p.rows + r[h]
                                      : (static_cast<int64_t>(b) * p.num_splits + split) * p.rows + r[h];
    if (kDirect) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(p.out + row_index * kLatent + warp * kOutCols + 2 * qd);
#pragma unroll
      for (int i = 0; i < kOutBlocks; ++i) dst[i * 4] = pack_bf16(acc[i][2 * h] * inv[h], acc[i][2 * h + 1] * inv[h]);
      if (warp == 0 && qd == 0) p.lse[row_index] = lse_row[h];
    } else {
      float2* dst = reinterpret_cast<float2*>(p.out_part + row_index * kLatent + warp * kOutCols + 2 * qd);
#pragma unroll
      for (int i = 0; i < kOutBlocks; ++i) dst[i * 4] = make_float2(acc[i][2 * h] * inv[h], acc[i][2 * h + 1] * inv[h]);
      if (warp == 0 && qd == 0) p.lse_part[row_index] = lse_row[h];
    }
  }
}


}  // namespace

cudaError_t stream_kernel_setup() {
  for (const void* fn : {reinterpret_cast<const void*>(verify_attention_kernel<true, 1>),
                         reinterpret_cast<const void*>(verify_attention_kernel<false, 1>)}) {
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, Config<1>::kSmemBytes);
    // The largest carveout, so that two blocks share a multiprocessor where it has room.
    if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

void launch_stream_kernel(const Params& p, int64_t batch, cudaStream_t stream) {
  using C = Config<1>;
  const dim3 grid(static_cast<unsigned>((p.rows + kRows - 1) / kRows), static_cast<unsigned>(p.num_splits),
                  static_cast<unsigned>(batch));
  (p.num_splits == 1 ? verify_attention_kernel<true, 1> : verify_attention_kernel<false, 1>)
      <<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
}

}  // namespace kdtree::verify
