// The 16-warp kernel (T*H > 16): the wide kernel's tiling (32 query rows a block, 32-position KV tiles, 2-stage ring,
// 99 KB: runs on sm_80, sm_90 and sm_120 alike) with twice the warps, each on half the work. The wide and pipelined
// kernels hold two warps a scheduler at ~225 registers a thread, and their dependent ldmatrix -> HMMA chains and
// shared-memory round trips leave the tensor pipe busy ~30% of the time (moving barriers and copy depth changed
// nothing: benchmarks/README_verify_kernel.md). Here a thread holds at most 128 registers, so an SM runs 16 warps:
//   * S = Q·Kᵀ: warp w = (dim slice w % 4: 144 dims, Q fragments of both m16 tiles in registers; position quarter
//     w / 4: 8 of the tile's 32 positions, one n8 block): 18 MMAs a tile; the four slices' partials go to shared memory;
//   * softmax once per row: warp w owns rows 2w, 2w + 1 (16 lanes a row, 2 positions each);
//   * O += P·V: warp w owns output dims [32w, 32w + 32) of all 32 rows (32 fp32 accumulators): 16 MMAs a tile.
// Copies: the first 256 threads (8 a latent row, one 16-byte chunk per Q·Kᵀ k-step), slots through the slot ring,
// L2 prefetch, as in the other kernels. Three barriers a tile. A block whose row tile holds <= 16 rows runs a
// one-m16 instance.
#include "device.cuh"
#include "kernels.h"

namespace kdtree::verify {
namespace {

struct SplitConfig {
  static constexpr int kThreads = 512, kWarpsBlock = 16, kRowsBlock = 32;
  static constexpr int kTile = 32, kRing = 2, kLead = kRing - 1;
  static constexpr int kThreadsPerRow = 8;                                 // copy threads a latent row
  static constexpr int kChunksPerThread = kChunksPerRow / kThreadsPerRow;  // 9
  static constexpr int kCopyThreads = kTile * kThreadsPerRow;              // 256
  static constexpr int kPrefetch = 3;
  static constexpr int kSlotAhead = 2 * kLead + kPrefetch;
  static constexpr int kSlotRing = 8;
  static constexpr int kStageBytes = kTile * kRowBytes;
  static constexpr int kKvBytes = kRing * kStageBytes;                      // 74,752
  static constexpr int kPartStride = kTile + 8;                             // floats a row of a slice's partials
  static constexpr int kPartBytes = kWarps * kRowsBlock * kPartStride * 4;  // 4 slices: 20,480
  static constexpr int kPStride = kTile + 8;                                // bf16 a row of P (80 B: conflict-free)
  static constexpr int kPBytes = kRowsBlock * kPStride * 2;
  static constexpr int kPartOff = kKvBytes, kPOff = kPartOff + kPartBytes, kScaleOff = kPOff + kPBytes;
  static constexpr int kStatOff = kScaleOff + kRowsBlock * 4, kSlotOff = kStatOff + 2 * kRowsBlock * 4;
  static constexpr int kSmemBytes = kSlotOff + kSlotRing * kTile * 4;       // 99,200 B
  static_assert(kSmemBytes <= 99 * 1024, "shared memory must fit sm_120's 99 KB per block");
  static_assert(kSlotRing >= kSlotAhead - kLead + 1, "slot ring");
  static_assert(kChunksPerThread == kKSteps, "one copy chunk per k-step");
  static_assert(kPOff % 16 == 0 && kSlotOff % 16 == 0, "alignment");
};

template <int kMt, bool kDirect>
__device__ __forceinline__ void split_body(const Params& p, unsigned char* smem) {
  using W = SplitConfig;
  constexpr int kTile = W::kTile;
  const uint32_t kv_smem = smem_addr(smem);
  float* part = reinterpret_cast<float*>(smem + W::kPartOff);       // [slice][row][kPartStride]
  uint16_t* pbuf = reinterpret_cast<uint16_t*>(smem + W::kPOff);    // [row][kPStride] bf16
  float* scale_s = reinterpret_cast<float*>(smem + W::kScaleOff);   // [row]
  float* stat_s = reinterpret_cast<float*>(smem + W::kStatOff);     // [2][row]: max (base 2), sum

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, qd = lane % 4;
  const int ds = warp % 4, pq = warp / 4;  // Q·Kᵀ role: dim slice, position quarter
  const int split = blockIdx.y, b = blockIdx.z;
  const int row0 = blockIdx.x * W::kRowsBlock;

  const SplitTiles range = split_tiles<kTile>(p, b, split);
  const int valid = range.valid, first = range.first, tile_begin = range.tile_begin, tile_end = range.tile_end;

  uint32_t qf[kMt][kKSteps][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) load_q_fragments(p, b, row0 + 16 * mt, ds, g, qd, qf[mt]);
  KvPipeline<W> kv = make_kv_pipeline<W>(p, b, range, smem, kv_smem, W::kSlotOff);
  const bool copier = threadIdx.x < W::kCopyThreads;  // the other 256 threads copy nothing
  kv.copies = copier;
  if (!copier) {
    kv.my_row = 0;
    kv.prefetcher = false;
  }
  kv.start(tile_begin);

  // Softmax role: row rr (16 lanes a row), positions pp, pp + 1 of each tile.
  const int rr = warp * 2 + lane / 16, pp = (lane % 16) * 2;
  const uint32_t* mask_r =
      p.tree_mask + (static_cast<int64_t>(b) * p.num_queries + min(row0 + rr, p.rows - 1) / p.num_heads) * p.mask_words;
  float m_run = -INFINITY, l_run = 0.f;

  float acc[kMt][4][4];  // O: rows 16 mt + g (+8), dims 32 warp + 8 nb + 2 qd (+1)
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int nb = 0; nb < 4; ++nb) acc[mt][nb][0] = acc[mt][nb][1] = acc[mt][nb][2] = acc[mt][nb][3] = 0.f;

  const int mat = lane / 8;
  // K (x2): positions 8 pq + lane % 8, dims 144 ds + 8 (lane / 8 % 2); lanes 16-31 repeat (ignored by .x2).
  const uint32_t k_lane = ((lane % 8) + pq * 8) * kRowBytes + (ds * kKSlice + (mat % 2) * 8) * 2;
  const uint32_t v_lane = ((lane % 8) + (mat % 2) * 8) * kRowBytes + (warp * 32 + (mat / 2) * 8) * 2;
  const uint32_t p_lane = kv_smem + W::kPOff + ((lane % 8) + (mat % 2) * 8) * (W::kPStride * 2) + (mat / 2) * 16;
  float* my_part = part + ds * W::kRowsBlock * W::kPartStride;

  uint32_t read_off = 0, write_off = W::kLead * W::kStageBytes;
  for (int tile = tile_begin; tile < tile_end; ++tile) {
    cp_async_wait<W::kLead - 1>();
    __syncthreads();  // A: the tile has landed; everybody is done with the previous tile's P and V
    const uint32_t stage_base = kv_smem + read_off;
    const KvRefill refill = kv.begin_refill(tile, write_off);
    {
      float s[kMt][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) s[mt][0] = s[mt][1] = s[mt][2] = s[mt][3] = 0.f;
      for_each_index([&](auto step) {
        constexpr int ks = decltype(step)::value;
        uint32_t kb0, kb1;
        ldmatrix_x2(stage_base + k_lane + ks * 32, kb0, kb1);
        if (refill.do_copy) issue_kv_chunk<W::kThreadsPerRow, ks>(refill.copy);
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) mma_bf16(s[mt], qf[mt][ks], kb0, kb1);
      }, std::make_integer_sequence<int, kKSteps>{});
      kv.finish_refill(refill, tile, read_off, write_off);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        const int col = pq * 8 + 2 * qd;
        *reinterpret_cast<float2*>(my_part + (mt * 16 + g) * W::kPartStride + col) = make_float2(s[mt][0], s[mt][1]);
        *reinterpret_cast<float2*>(my_part + (mt * 16 + g + 8) * W::kPartStride + col) = make_float2(s[mt][2], s[mt][3]);
      }
    }
    __syncthreads();  // B: partial scores written

    {  // Softmax of row rr, positions pp, pp + 1: the four slices summed, base 2, masked, online update.
      float x[2] = {0.f, 0.f};
#pragma unroll
      for (int sl = 0; sl < kWarps; ++sl) {
        const float2 t = *reinterpret_cast<const float2*>(part + (sl * W::kRowsBlock + rr) * W::kPartStride + pp);
        x[0] += t.x;
        x[1] += t.y;
      }
      x[0] *= p.scale_log2;
      x[1] *= p.scale_log2;
      const int tile_pos = tile * kTile;
      if (tile_pos + kTile > min(first, valid)) {  // only tiles reaching the query tokens or the end need the mask
        const int j0 = tile_pos - first;
        const int w0 = max(j0, 0) >> 5;  // a tile's query indices span at most two mask words
        const uint32_t lo = w0 < p.mask_words ? __ldg(mask_r + w0) : 0u;
        const uint32_t hi = w0 + 1 < p.mask_words ? __ldg(mask_r + w0 + 1) : 0u;
        const uint64_t bits = (static_cast<uint64_t>(hi) << 32) | lo;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int pos = tile_pos + pp + i;
          const int j = pos - first;
          const bool visible = pos < valid && (j < 0 || ((bits >> (j - 32 * w0)) & 1u));
          if (!visible) x[i] = -INFINITY;
        }
      }
      float tile_max = fmaxf(x[0], x[1]);
#pragma unroll
      for (int o = 1; o < 16; o *= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
      const float new_max = fmaxf(m_run, tile_max);
      const float base = new_max == -INFINITY ? 0.f : new_max;  // nothing seen yet: exp2(-inf) = 0, not NaN
      const float sc = fast_exp2(m_run - base);
      m_run = new_max;
      x[0] = fast_exp2(x[0] - base);
      x[1] = fast_exp2(x[1] - base);
      l_run = l_run * sc + (x[0] + x[1]);
      *reinterpret_cast<uint32_t*>(pbuf + rr * W::kPStride + pp) = pack_bf16(x[0], x[1]);
      if (lane % 16 == 0) scale_s[rr] = sc;
    }
    __syncthreads();  // C: P and the rescale factors written

    {  // Rescale O (skipped, per warp, when no row max moved), then O += P·V over this warp's 32 dims.
      float f[kMt][2];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) { f[mt][0] = scale_s[16 * mt + g]; f[mt][1] = scale_s[16 * mt + g + 8]; }
      bool moved = false;
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) moved |= f[mt][0] != 1.f || f[mt][1] != 1.f;
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
          for (int nb = 0; nb < 4; ++nb) {
            acc[mt][nb][0] *= f[mt][0]; acc[mt][nb][1] *= f[mt][0];
            acc[mt][nb][2] *= f[mt][1]; acc[mt][nb][3] *= f[mt][1];
          }
      }
    }
#pragma unroll
    for (int u = 0; u < kTile / 16; ++u) {
      uint32_t pa[kMt][4];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) ldmatrix_x4(p_lane + mt * 16 * (W::kPStride * 2) + u * 32, pa[mt]);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t vb[4];
        ldmatrix_x4_trans(stage_base + v_lane + u * 16 * kRowBytes + j * 32, vb);
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) {
          mma_bf16(acc[mt][2 * j], pa[mt], vb[0], vb[1]);
          mma_bf16(acc[mt][2 * j + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: the softmax lanes publish each row's max and denominator; every warp normalises its columns.
#pragma unroll
  for (int o = 1; o < 16; o *= 2) l_run += __shfl_xor_sync(0xffffffffu, l_run, o);
  if (lane % 16 == 0) {
    stat_s[rr] = m_run;
    stat_s[W::kRowsBlock + rr] = l_run;
  }
  __syncthreads();
  write_rows<kDirect>(p, acc, stat_s, row0, b, split, warp * 32, g, qd, warp == 0 && qd == 0);
}

template <bool kDirect>
__global__ void __launch_bounds__(SplitConfig::kThreads, 1) verify_attention_split_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (static_cast<int>(blockIdx.x) * SplitConfig::kRowsBlock + 16 < p.rows) {
    split_body<2, kDirect>(p, smem);
  } else {
    split_body<1, kDirect>(p, smem);
  }
}

}  // namespace

cudaError_t split_kernel_setup() {
  for (const void* fn : {reinterpret_cast<const void*>(verify_attention_split_kernel<true>),
                         reinterpret_cast<const void*>(verify_attention_split_kernel<false>)}) {
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, SplitConfig::kSmemBytes);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

void launch_split_kernel(const Params& p, int64_t batch, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.rows + SplitConfig::kRowsBlock - 1) / SplitConfig::kRowsBlock),
                  static_cast<unsigned>(p.num_splits), static_cast<unsigned>(batch));
  (p.num_splits == 1 ? verify_attention_split_kernel<true> : verify_attention_split_kernel<false>)
      <<<grid, SplitConfig::kThreads, SplitConfig::kSmemBytes, stream>>>(p);
}

}  // namespace kdtree::verify
