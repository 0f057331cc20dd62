// The wide kernel (T*H > 16 where the pipelined kernel's 213 KB of shared memory do not fit: sm_120, sm_80).
#include "device.cuh"
#include "kernels.h"

namespace kdtree::verify {
namespace {

// The wide kernel (T*H > 16): 32 query rows per block, 8 warps, and every warp works on all 32 rows (two m16
// tiles), so each K or V fragment read from shared memory feeds twice the MMAs of the two-group kernel and each
// KV element is read from shared memory once per block (the two-group kernel reads it once per row group).
//   * S = Q·Kᵀ: warp w = (dim slice w % 4, position half w / 4) multiplies its 144 dims (Q fragments of both
//     m16 tiles stay in registers: 72 regs) for 16 of the tile's 32 positions; the partials go to shared memory;
//   * softmax, once per row: warp w sums the four slices of rows [4w, 4w + 4) (8 lanes per row, 4 positions
//     each), masks, keeps the row's running max and (per lane) sum, and writes P (bf16) and the row's rescale
//     factor to shared memory — 4 exp2 per lane instead of 16, and no warp repeats another's softmax;
//   * O += P·V: warp w owns output dims [64w, 64w + 64) of all 32 rows (64 fp32 accumulators); P's A fragments
//     come from shared memory by ldmatrix.
// Three barriers per 32-position tile (tile landed / partial scores written / P written).  Same copy pipeline
// as the other kernels: a 2-slot ring of 32-position tiles, slots through the shared slot ring, L2 prefetch.
struct WideConfig {
  static constexpr int kThreads = 256, kRowsW = 32;
  static constexpr int kTile = 32, kRing = 2, kLead = kRing - 1;
  static constexpr int kThreadsPerRow = kThreads / kTile;                  // 8
  static constexpr int kChunksPerThread = kChunksPerRow / kThreadsPerRow;  // 9
  static constexpr int kPrefetch = 3;
  static constexpr int kSlotAhead = 2 * kLead + kPrefetch;
  static constexpr int kSlotRing = 8;
  static_assert(kSlotRing >= kRing + kPrefetch, "slot ring");
  static constexpr int kStageBytes = kTile * kRowBytes;
  static constexpr int kKvBytes = kRing * kStageBytes;                  // 74,752
  static constexpr int kPartStride = kTile + 8;                         // floats per row of a slice's partial scores
  static constexpr int kPartBytes = kWarps * kRowsW * kPartStride * 4;  // 4 slices: 20,480
  static constexpr int kPStride = kTile + 8;                            // bf16 per row of P (80 B: ldmatrix conflict-free)
  static constexpr int kPBytes = kRowsW * kPStride * 2;                 // 2,560
  static constexpr int kScaleBytes = kRowsW * 4;                        // this tile's rescale factor per row
  static constexpr int kStatBytes = 2 * kRowsW * 4;                     // final max and sum per row
  static constexpr int kSlotBytes = kSlotRing * kTile * 4;
  static constexpr int kPartOff = kKvBytes, kPOff = kPartOff + kPartBytes, kScaleOff = kPOff + kPBytes;
  static constexpr int kStatOff = kScaleOff + kScaleBytes, kSlotOff = kStatOff + kStatBytes;
  static constexpr int kSmemBytes = kSlotOff + kSlotBytes;              // 99,200 B
  static_assert(kSmemBytes <= 99 * 1024, "shared memory must fit sm_120's 99 KB per block");
  static_assert(kPOff % 16 == 0 && kSlotOff % 16 == 0, "alignment");
};

template <bool kDirect>
__global__ void __launch_bounds__(WideConfig::kThreads, 1) verify_attention_wide_kernel(const Params p) {
  using W = WideConfig;
  constexpr int kTile = W::kTile;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t kv_smem = smem_addr(smem);
  float* part = reinterpret_cast<float*>(smem + W::kPartOff);        // [slice][row][kPartStride]
  uint16_t* pbuf = reinterpret_cast<uint16_t*>(smem + W::kPOff);     // [row][kPStride] bf16
  const uint32_t p_smem = kv_smem + W::kPOff;
  float* scale_s = reinterpret_cast<float*>(smem + W::kScaleOff);    // [row]
  float* stat_s = reinterpret_cast<float*>(smem + W::kStatOff);      // [2][row]: max (base 2), sum

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, qd = lane % 4;
  const int ds = warp % 4, ph = warp / 4;  // Q·Kᵀ role: dim slice, position half
  const int split = blockIdx.y, b = blockIdx.z;
  const int row0 = blockIdx.x * W::kRowsW;

  wait_for_previous_grid();
  allow_dependent_launch();
  const SplitTiles range = split_tiles<kTile>(p, b, split);
  if (range.idle(kDirect, split)) return;
  const int valid = range.valid, first = range.first, tile_begin = range.tile_begin, tile_end = range.tile_end;

  // Q fragments: both m16 tiles (rows row0 + 16 mt + g, + 8), this warp's 144-dim slice.
  uint32_t qf[2][kKSteps][4];
  load_q_fragments(p, b, row0, ds, g, qd, qf[0]);
  load_q_fragments(p, b, row0 + 16, ds, g, qd, qf[1]);
  const KvPipeline<W> kv = make_kv_pipeline<W>(p, b, range, smem, kv_smem, W::kSlotOff);
  kv.start(tile_begin);

  // Softmax role: row rr of the block (8 lanes per row), positions pp .. pp + 3 of each tile.
  const int rr = warp * 4 + lane / 8, pp = (lane % 8) * 4;
  const uint32_t* mask_r = p.tree_mask + (static_cast<int64_t>(b) * p.num_queries + min(row0 + rr, p.rows - 1) / p.num_heads) * p.mask_words;
  float m_run = -INFINITY;  // running max of row rr (base 2)
  float l_run = 0.f;        // this lane's share of the running denominator

  float acc[2][8][4];  // O: rows 16 mt + g (+8), dims 64 warp + 8 nb + 2 qd (+1)
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) acc[mt][nb][0] = acc[mt][nb][1] = acc[mt][nb][2] = acc[mt][nb][3] = 0.f;

  const int mat = lane / 8;
  const uint32_t k_lane = ((lane % 8) + (mat / 2) * 8 + ph * 16) * kRowBytes + (ds * kKSlice + (mat % 2) * 8) * 2;
  const uint32_t v_lane = ((lane % 8) + (mat % 2) * 8) * kRowBytes + (warp * 64 + (mat / 2) * 8) * 2;
  const uint32_t p_lane = p_smem + ((lane % 8) + (mat % 2) * 8) * (W::kPStride * 2) + (mat / 2) * 16;
  float* my_part = part + ds * W::kRowsW * W::kPartStride;

  uint32_t read_off = 0, write_off = W::kLead * W::kStageBytes;
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    cp_async_wait<W::kLead - 1>();
    __syncthreads();  // B1: the tile has landed; everybody is done with the previous tile's P and V
    const uint32_t stage_base = kv_smem + read_off;
    // The next tile's copies go out one chunk per k-step of Q·Kᵀ below, between its MMAs: issued back to back,
    // the 9 copies filled the load/store queue, and the ldmatrix loads behind them waited (ncu, 2026-11-30:
    // 11% of the stall samples at the copies and the loads after them).
    const KvRefill refill = kv.begin_refill(tile, write_off);

    // Partial scores: 32 rows x positions [16 ph, 16 ph + 16) over dims slice ds.
    {
      static_assert(W::kChunksPerThread == kKSteps, "one copy chunk per k-step");
      float s[2][2][4];
      score_slice<W::kThreadsPerRow>(stage_base + k_lane, qf, refill, s);
      kv.finish_refill(refill, tile, read_off, write_off);
      store_partials<W::kPartStride>(my_part, ph * 16, g, qd, s);
    }
    __syncthreads();  // B2: partial scores written

    // Softmax of row rr, positions pp .. pp + 3: sum the four slices, scale to base 2, mask, online update.
    {
      float x[4];
      row_scores<kTile, W::kPartStride, W::kRowsW>(p, part, mask_r, rr, tile * kTile, pp, first, valid, x);
      const float sc = online_softmax<8>(x, m_run, l_run);
      *reinterpret_cast<uint2*>(pbuf + rr * W::kPStride + pp) = make_uint2(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]));
      if (lane % 8 == 0) scale_s[rr] = sc;
    }
    __syncthreads();  // B3: P and the rescale factors written

    // Rescale O (skipped, per warp, when no row max moved), then O += P·V over this warp's 64 dims.
    {
      const float f[2][2] = {{scale_s[g], scale_s[g + 8]}, {scale_s[16 + g], scale_s[24 + g]}};
      if (__any_sync(0xffffffffu, f[0][0] != 1.f || f[0][1] != 1.f || f[1][0] != 1.f || f[1][1] != 1.f)) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nb = 0; nb < 8; ++nb) {
            acc[mt][nb][0] *= f[mt][0]; acc[mt][nb][1] *= f[mt][0];
            acc[mt][nb][2] *= f[mt][1]; acc[mt][nb][3] *= f[mt][1];
          }
      }
    }
#pragma unroll
    for (int u = 0; u < kTile / 16; ++u) {
      uint32_t pa[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(p_lane + mt * 16 * (W::kPStride * 2) + u * 32, pa[mt]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t vb[4];
        ldmatrix_x4_trans(stage_base + v_lane + u * 16 * kRowBytes + j * 32, vb);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_bf16(acc[mt][2 * j], pa[mt], vb[0], vb[1]);
          mma_bf16(acc[mt][2 * j + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: the softmax lanes publish each row's max and denominator; every warp normalises its columns.
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 4);
  if (lane % 8 == 0) {
    stat_s[rr] = m_run;
    stat_s[W::kRowsW + rr] = l_run;
  }
  __syncthreads();
  write_rows(p, range.direct(kDirect), acc, stat_s, row0, b, split, warp * 64, g, qd, warp == 0 && qd == 0);
}

}  // namespace

cudaError_t wide_kernel_setup() {
  for (const void* fn : {reinterpret_cast<const void*>(verify_attention_wide_kernel<true>),
                         reinterpret_cast<const void*>(verify_attention_wide_kernel<false>)}) {
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, WideConfig::kSmemBytes);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

void launch_wide_kernel(const Params& p, int64_t batch, cudaStream_t stream, bool pdl) {
  const dim3 grid(static_cast<unsigned>((p.rows + WideConfig::kRowsW - 1) / WideConfig::kRowsW),
                  static_cast<unsigned>(p.num_splits), static_cast<unsigned>(batch));
  launch_kernel(p.num_splits == 1 ? verify_attention_wide_kernel<true> : verify_attention_wide_kernel<false>, grid,
                dim3(WideConfig::kThreads), WideConfig::kSmemBytes, stream, pdl, p);
}

}  // namespace kdtree::verify
