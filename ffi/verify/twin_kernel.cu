// The twin kernel: the wide kernel's tiling (32 query rows a block, 8 warps, 32-position tiles, two stages) shrunk so
// that two blocks are resident on an SM of sm_90 (registers <= 128 a thread, shared memory <= 113 KB a block), i.e.
// four warps a scheduler instead of two. An explicit variant for an A/B against the wide and pipelined kernels, not
// picked by `auto` (benchmarks/README_verify_kernel.md, "The budget in numbers": the portable kernels' tensor pipes
// are busy ~30% of the time, stalled on shared-memory results and back-to-back MMA dependencies that two warps a
// scheduler cannot hide).
//
// What changes against the wide kernel, and why:
//   * Q lives in shared memory (32 rows x 1,168 B, the stages' padded rows: conflict-free ldmatrix), copied once per
//     block with the first tile; each k-step of Q·Kᵀ loads both m16 tiles' A fragments by ldmatrix next to K's
//     (device.cuh, score_slice_q_smem). The 72 registers the wide kernel holds Q in are what keeps it at one block an
//     SM; the price is Q re-read from shared memory every tile (+72 KB a tile: each warp its slice of all 32 rows).
//   * Q (36.5 KB) and two 32-position stages (73 KB) leave 3.5 KB of a block's 113 KB, so nothing else gets a buffer
//     of its own except the slot ring, the rescale factors and the row statistics:
//       - the slices' partial scores (20 KB) go to the free stage (the one the next tile is being copied into),
//         over its first kLateRows = 18 rows; so the copies of those rows are issued only once the softmax has read
//         the partials (after barrier B3, at the start of P·V), while the other 14 rows' copies go out during Q·Kᵀ,
//         one chunk per k-step between the MMAs, as in the wide kernel. The late rows have the P·V phase (and, with
//         two blocks an SM, the other block's work) to land; the L2 prefetch of the tiles ahead makes them L2 reads.
//       - P (32 rows x 32 positions, bf16) goes to the rope columns of the tile's own stage (bytes 1,024..1,087 of
//         each 1,168-byte row: dims 512..575 are K's rope part, which P·V never reads: V is the first 512 dims),
//         free once every warp's Q·Kᵀ of the tile is done (barrier B2); rows 1,168 B apart keep its ldmatrix
//         conflict-free as in the stages. (The block's 32 query rows map onto the tile's 32 positions' rows.)
//   * __launch_bounds__(256, 2): the compiler keeps a thread within 128 registers (O 64, S 16, P 8 and the rest).
// Everything else is the wide kernel's: warp w = (dim slice w % 4, position half w / 4) for Q·Kᵀ, each row's softmax
// once (8 lanes a row), warp w owns output dims [64w, 64w + 64) of all 32 rows for P·V; three block barriers a
// tile; the same split plan, slot ring, L2 prefetch, partials + lse for the merge, kDirect for one-split grids, PDL.
//
// Buffer lifetimes within iteration c (R: the stage holding tile c; F: the free stage, which receives tile c + 1):
//   B1  tile c has landed (this thread's copies: cp.async.wait; everybody's: the barrier); P·V of c - 1 is done, so
//       F (tile c - 1's stage, with P of c - 1 in its rope columns) is free;
//   Q·Kᵀ reads Q and R; the early rows of tile c + 1 are copied into F rows [kLateRows, 32); partials -> F rows
//       [0, kLateRows) (disjoint);
//   B2  partials written, and every read of R's rope columns done;
//   softmax reads the partials, writes P into R's rope columns and the rescale factors;
//   B3  P written, and every read of the partials done;
//   the late rows of tile c + 1 are copied into F rows [0, kLateRows); P·V reads R (dims 0..511) and P.
// The late copies are committed with the early ones at the end of the iteration, and the next B1 waits for both.
#include "device.cuh"
#include "kernels.h"

namespace kdtree::verify {
namespace {

struct TwinConfig {
  static constexpr int kThreads = 256, kRowsW = 32, kBlocksPerSm = 2;
  static constexpr int kTile = 32, kRing = 2, kLead = kRing - 1;
  static constexpr int kThreadsPerRow = kThreads / kTile;                  // 8
  static constexpr int kChunksPerThread = kChunksPerRow / kThreadsPerRow;  // 9
  static constexpr int kPrefetch = 3;
  static constexpr int kSlotAhead = 2 * kLead + kPrefetch;
  static constexpr int kSlotRing = 8;
  static_assert(kSlotRing >= kRing + kPrefetch, "slot ring");
  static constexpr int kStageBytes = kTile * kRowBytes;                    // 37,376
  static constexpr int kKvBytes = kRing * kStageBytes;                     // 74,752
  static constexpr int kQBytes = kRowsW * kRowBytes;                       // 37,376
  // The partial scores, in the free stage (see above): 4 slices x 32 rows x 40 floats.
  static constexpr int kPartStride = kTile + 8;                            // floats per row of a slice's partials
  static constexpr int kPartBytes = kWarps * kRowsW * kPartStride * 4;     // 20,480
  static constexpr int kLateRows = (kPartBytes + kRowBytes - 1) / kRowBytes;  // 18: the free stage's rows they cover
  static_assert(kLateRows < kTile, "some rows of the next tile are copied during Q·Kᵀ");
  // P, in the rope columns of the tile's stage: query row r at stage row r, bytes kPCol .. kPCol + 2 kTile.
  static constexpr int kPCol = kLatent * 2;                                // 1,024
  static_assert(kRowsW == kTile, "P's 32 query rows live in the tile's 32 stage rows");
  static_assert(kPCol + kTile * 2 <= kRowBytes, "P fits the rope columns (and the row padding) of a stage row");
  static constexpr int kScaleBytes = kRowsW * 4;                           // this tile's rescale factor per row
  static constexpr int kStatBytes = 2 * kRowsW * 4;                        // final max and sum per row
  static constexpr int kSlotBytes = kSlotRing * kTile * 4;
  // The stages first: make_kv_pipeline takes the slot ring's offset from the stages' base.
  static constexpr int kQOff = kKvBytes, kScaleOff = kQOff + kQBytes, kStatOff = kScaleOff + kScaleBytes;
  static constexpr int kSlotOff = kStatOff + kStatBytes;
  static constexpr int kSmemBytes = kSlotOff + kSlotBytes;                 // 113,536 B
  static_assert(kQOff % 16 == 0 && kSlotOff % 16 == 0 && kStageBytes % 16 == 0, "alignment");
  // Two blocks an SM of sm_90: 228 KB of shared memory an SM, of which each resident block takes 1 KB for itself.
  static_assert(kBlocksPerSm * (kSmemBytes + 1024) <= 228 * 1024, "two blocks must fit an sm_90 SM's shared memory");
};

template <bool kDirect>
__global__ void __launch_bounds__(TwinConfig::kThreads, TwinConfig::kBlocksPerSm)
    verify_attention_twin_kernel(const Params p) {
  using W = TwinConfig;
  constexpr int kTile = W::kTile;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t kv_smem = smem_addr(smem);
  const uint32_t q_smem = kv_smem + W::kQOff;                         // [row][kRowBytes] bf16
  float* scale_s = reinterpret_cast<float*>(smem + W::kScaleOff);     // [row]
  float* stat_s = reinterpret_cast<float*>(smem + W::kStatOff);       // [2][row]: max (base 2), sum

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

  // Q into shared memory: its copies join the first tile's commit group (kv.start), which the first B1 waits for.
  load_q_rows<W::kThreadsPerRow, W::kChunksPerThread>(p, b, row0, q_smem);
  const KvPipeline<W> kv = make_kv_pipeline<W>(p, b, range, smem, kv_smem, W::kSlotOff);
  kv.start(tile_begin);
  // Whether this thread's row of a tile is one the partial scores cover in the free stage: copied after B3.
  const bool late_row = kv.my_row < W::kLateRows;

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

  // ldmatrix lane addresses (matrix mat = lane / 8 of an x4 load): Q's and P's A fragments (rows + 8 (mat % 2), dims
  // + 8 (mat / 2)), K's B fragments (positions 16 ph + 8 (mat / 2), dims + 8 (mat % 2)), V's transposed B fragments.
  const int mat = lane / 8;
  const uint32_t q_lane = q_smem + ((lane % 8) + (mat % 2) * 8) * kRowBytes + (ds * kKSlice + (mat / 2) * 8) * 2;
  const uint32_t k_lane = ((lane % 8) + (mat / 2) * 8 + ph * 16) * kRowBytes + (ds * kKSlice + (mat % 2) * 8) * 2;
  const uint32_t v_lane = ((lane % 8) + (mat % 2) * 8) * kRowBytes + (warp * 64 + (mat / 2) * 8) * 2;
  const uint32_t p_lane = ((lane % 8) + (mat % 2) * 8) * kRowBytes + W::kPCol + (mat / 2) * 16;

  uint32_t read_off = 0, write_off = W::kLead * W::kStageBytes;
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    cp_async_wait<W::kLead - 1>();
    __syncthreads();  // B1: the tile (and at the first, Q) has landed; everybody is done with the previous P and V
    const uint32_t stage_base = kv_smem + read_off;
    float* part = reinterpret_cast<float*>(smem + write_off);  // [slice][row][kPartStride], in the free stage
    const KvRefill refill = kv.begin_refill(tile, write_off);

    // Partial scores: 32 rows x positions [16 ph, 16 ph + 16) over dims slice ds; the early rows' copies of the
    // next tile go out one chunk per k-step between the MMAs.
    {
      static_assert(W::kChunksPerThread == kKSteps, "one copy chunk per k-step");
      float s[2][2][4];
      score_slice_q_smem<W::kThreadsPerRow>(stage_base + k_lane, q_lane, refill.copy, refill.do_copy && !late_row, s);
      store_partials<W::kPartStride>(part + ds * W::kRowsW * W::kPartStride, ph * 16, g, qd, s);
    }
    __syncthreads();  // B2: partial scores written; every warp's reads of this stage's rope columns done

    // Softmax of row rr, positions pp .. pp + 3: sum the four slices, scale to base 2, mask, online update; P into
    // the rope columns of the tile's stage row rr.
    {
      float x[4];
      row_scores<kTile, W::kPartStride, W::kRowsW>(p, part, mask_r, rr, tile * kTile, pp, first, valid, x);
      const float sc = online_softmax<8>(x, m_run, l_run);
      *reinterpret_cast<uint2*>(smem + read_off + rr * kRowBytes + W::kPCol + pp * 2) =
          make_uint2(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]));
      if (lane % 8 == 0) scale_s[rr] = sc;
    }
    __syncthreads();  // B3: P and the rescale factors written; the partials read, so their rows are free

    // The late rows' copies, back to back: they have this phase to land before the next B1.
    if (late_row && refill.do_copy) {
      copy_row_chunks<W::kThreadsPerRow>(refill.copy.dst, refill.copy.src, refill.copy.bytes,
                                         std::make_integer_sequence<int, W::kChunksPerThread>{});
    }

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
      for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(stage_base + p_lane + mt * 16 * kRowBytes + u * 32, pa[mt]);
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
    // L2 prefetch, slot requests, one commit group for both the early and the late copies; the stages swap.
    kv.finish_refill(refill, tile, read_off, write_off);
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

cudaError_t twin_kernel_setup() {
  for (const void* fn : {reinterpret_cast<const void*>(verify_attention_twin_kernel<true>),
                         reinterpret_cast<const void*>(verify_attention_twin_kernel<false>)}) {
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, TwinConfig::kSmemBytes);
    // All of the unified L1 / shared memory as shared memory: two blocks' 2 x 112 KB need it.
    if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

void launch_twin_kernel(const Params& p, int64_t batch, cudaStream_t stream, bool pdl) {
  const dim3 grid(static_cast<unsigned>((p.rows + TwinConfig::kRowsW - 1) / TwinConfig::kRowsW),
                  static_cast<unsigned>(p.num_splits), static_cast<unsigned>(batch));
  launch_kernel(p.num_splits == 1 ? verify_attention_twin_kernel<true> : verify_attention_twin_kernel<false>, grid,
                dim3(TwinConfig::kThreads), TwinConfig::kSmemBytes, stream, pdl, p);
}

int twin_kernel_smem_bytes() { return TwinConfig::kSmemBytes; }

}  // namespace kdtree::verify
