// The pipelined kernel (T*H > 16): 32 query rows per block, 8 warps, every warp on all 32 rows (two m16 tiles: each
// K or V fragment read from shared memory feeds two MMAs), and the scores of tile c computed in the same phase as the
// output of tile c - 1, so that a tile costs two block barriers instead of three and each phase between barriers holds
// both MMA streams (Q·Kᵀ of c and P·V of c - 1, 68 MMAs a warp with 32-position tiles) for the schedulers to overlap.
//
// One iteration, for tile c of the split:
//   barrier A   tile c has landed; everybody is done with the softmax of c - 1 (so the partial scores are free);
//   phase 1     S partials of c: warp w = (dim slice w % 4: 144 dims, Q fragments in registers; position half w / 4),
//               the copies of tile c + kLead issued one chunk per k-step between the MMAs; then O = O * scale(c - 1)
//               + P(c - 1)·V(c - 1) over the warp's 64 output dims (P from its double buffer, V from tile c - 1's
//               stage);
//   barrier B   partials of c written;
//   phase 2     softmax of c, once per row (warp w: rows 4w .. 4w + 3, 8 lanes a row), P(c) and scale(c) into the
//               other halves of their double buffers.
// A stage is refilled only after barrier A of the iteration after its P·V, hence kLead = kRing - 2 tiles in flight.
// Blocks whose row tile holds at most 16 rows run a one-m16 instance (no MMAs on an empty tile).
//
// 32-position tiles, 5 stages (3 tiles in flight), 213 KB: sm_90-class parts (227 KB of opt-in shared memory per
// block). Where that does not fit (sm_120: 99 KB) the launcher runs the wide kernel (wide_kernel.cu: the same tiling
// with three barriers a tile and a 2-stage ring, 97 KB), which beat this kernel's 99 KB configuration (16-position
// tiles, 4 stages) by 1.25x on an H200 (64k, T = 16, H = 8: 101 vs 127 us; docs/verify_kernel.md).
#include "device.cuh"
#include "kernels.h"

namespace kdtree::verify {
namespace {

template <int kTileT, int kRingT>
struct PipelinedConfig {
  static constexpr int kThreads = 256, kRowsBlock = 32;
  static constexpr int kTile = kTileT, kRing = kRingT;
  static constexpr int kLead = kRing - 2;  // tiles in flight beyond the two being computed
  static_assert(kLead >= 1, "at least one tile in flight");
  static constexpr int kNb = kTile / 16;   // n8 score blocks per warp (its half of the tile's positions)
  static constexpr int kSub = kTile / 16;  // k16 steps of P·V per tile
  static constexpr int kPerLane = kTile / 8;  // softmax: positions per lane (8 lanes a row)
  // Copies: 8 threads a latent row, 9 16-byte chunks each (one per Q·Kᵀ k-step); kTile * 8 threads copy.
  static constexpr int kThreadsPerRow = 8;
  static constexpr int kChunksPerThread = kChunksPerRow / kThreadsPerRow;  // 9
  static constexpr int kCopyThreads = kTile * kThreadsPerRow;
  static constexpr int kPrefetch = 3;
  static constexpr int kSlotAhead = 2 * kLead + kPrefetch;
  static constexpr int kSlotRing = 8;
  static constexpr int kStageBytes = kTile * kRowBytes;
  static constexpr int kKvBytes = kRing * kStageBytes;
  static constexpr int kPartStride = kTile + 8;    // floats per row of a slice's partial scores (+8: no conflicts)
  static constexpr int kPartBytes = kWarps * kRowsBlock * kPartStride * 4;
  static constexpr int kPStride = kTile + 8;       // bf16 per row of P (ldmatrix rows 16 B apart mod 128: conflict-free)
  static constexpr int kPBufBytes = kRowsBlock * kPStride * 2;
  static constexpr int kPartOff = kKvBytes;
  static constexpr int kPOff = kPartOff + kPartBytes;                 // P double buffer
  static constexpr int kScaleOff = kPOff + 2 * kPBufBytes;            // rescale factors, double buffer
  static constexpr int kStatOff = kScaleOff + 2 * kRowsBlock * 4;     // final max and sum per row
  static constexpr int kSlotOff = kStatOff + 2 * kRowsBlock * 4;
  static constexpr int kSmemBytes = kSlotOff + kSlotRing * kTile * 4;
  static_assert(kSlotRing >= kSlotAhead - kLead + 1 && (kSlotRing & (kSlotRing - 1)) == 0, "slot ring");
  static_assert(kPOff % 16 == 0 && kSlotOff % 16 == 0, "alignment");
  static_assert(kChunksPerThread == kKSteps, "one copy chunk per k-step");
};
using LargeConfig = PipelinedConfig<32, 5>;
static_assert(LargeConfig::kSmemBytes <= 227 * 1024, "the configuration must fit sm_90's 227 KB per block");

// Partial scores of kMt m16 row tiles x (8 kNb) positions over one 144-dim slice; the next tile's copy chunks go out
// one per k-step between the MMAs (issued back to back they fill the load/store queue ahead of the ldmatrix loads).
template <class W, int kMt>
__device__ __forceinline__ void partial_scores(uint32_t k_addr, const uint32_t (&qf)[kMt][kKSteps][4], const KvRefill& refill,
                                               float (&s)[kMt][W::kNb][4]) {
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int nb = 0; nb < W::kNb; ++nb) s[mt][nb][0] = s[mt][nb][1] = s[mt][nb][2] = s[mt][nb][3] = 0.f;
  for_each_index([&](auto step) {
    constexpr int ks = decltype(step)::value;
    uint32_t kb[4];
    if constexpr (W::kNb == 2) {
      ldmatrix_x4(k_addr + ks * 32, kb);
    } else {
      ldmatrix_x2(k_addr + ks * 32, kb[0], kb[1]);
    }
    if (refill.do_copy) issue_kv_chunk<W::kThreadsPerRow, ks>(refill.copy);
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
      for (int nb = 0; nb < W::kNb; ++nb) mma_bf16(s[mt][nb], qf[mt][ks], kb[2 * nb], kb[2 * nb + 1]);
    }
  }, std::make_integer_sequence<int, kKSteps>{});
}

// Softmax of one row for one tile: kPerLane positions per lane at tile_pos + pp, summed over the four slices'
// partials, scaled to base 2, masked (tree bits for the query tokens, nothing at or past `valid`), online update of
// the row's running max and this lane's share of the denominator; x becomes the probabilities. Returns the factor by
// which the row's output must be rescaled.
template <class W>
__device__ __forceinline__ float softmax_row(const Params& p, const float* part, const uint32_t* mask_r, int rr,
                                             int tile_pos, int pp, int first, int valid, float (&x)[W::kPerLane],
                                             float& m_run, float& l_run) {
#pragma unroll
  for (int i = 0; i < W::kPerLane; ++i) x[i] = 0.f;
#pragma unroll
  for (int sl = 0; sl < kWarps; ++sl) {
    const float* src = part + (sl * W::kRowsBlock + rr) * W::kPartStride + pp;
    if constexpr (W::kPerLane == 4) {
      const float4 t = *reinterpret_cast<const float4*>(src);
      x[0] += t.x; x[1] += t.y; x[2] += t.z; x[3] += t.w;
    } else {
      const float2 t = *reinterpret_cast<const float2*>(src);
      x[0] += t.x; x[1] += t.y;
    }
  }
#pragma unroll
  for (int i = 0; i < W::kPerLane; ++i) x[i] *= p.scale_log2;
  if (tile_pos + W::kTile > min(first, valid)) {  // only tiles that reach the query tokens or the end need the mask
    const int j0 = tile_pos - first;
    const int w0 = max(j0, 0) >> 5;  // a tile's query indices span at most two mask words
    const uint32_t lo = w0 < p.mask_words ? __ldg(mask_r + w0) : 0u;
    const uint32_t hi = w0 + 1 < p.mask_words ? __ldg(mask_r + w0 + 1) : 0u;
    const uint64_t bits = (static_cast<uint64_t>(hi) << 32) | lo;
#pragma unroll
    for (int i = 0; i < W::kPerLane; ++i) {
      const int pos = tile_pos + pp + i;
      const int j = pos - first;
      // j < T whenever pos < valid (valid <= kv_len = first + T); bit j - 32 w0 is in [0, 63).
      const bool visible = pos < valid && (j < 0 || ((bits >> (j - 32 * w0)) & 1u));
      if (!visible) x[i] = -INFINITY;
    }
  }
  float tile_max = x[0];
#pragma unroll
  for (int i = 1; i < W::kPerLane; ++i) tile_max = fmaxf(tile_max, x[i]);
#pragma unroll
  for (int o = 1; o < 8; o *= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
  const float new_max = fmaxf(m_run, tile_max);
  const float base = new_max == -INFINITY ? 0.f : new_max;  // nothing seen yet: exp2(-inf - 0) = 0, not NaN
  const float sc = fast_exp2(m_run - base);
  m_run = new_max;
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < W::kPerLane; ++i) {
    x[i] = fast_exp2(x[i] - base);
    sum += x[i];
  }
  l_run = l_run * sc + sum;
  return sc;
}

template <class W, int kMt, bool kDirect>
__device__ __forceinline__ void pipelined_body(const Params& p, unsigned char* smem) {
  constexpr int kTile = W::kTile;
  const uint32_t kv_smem = smem_addr(smem);
  float* part = reinterpret_cast<float*>(smem + W::kPartOff);       // [slice][row][kPartStride]
  uint16_t* pbuf = reinterpret_cast<uint16_t*>(smem + W::kPOff);    // [2][row][kPStride] bf16
  float* scale_s = reinterpret_cast<float*>(smem + W::kScaleOff);   // [2][row]
  float* stat_s = reinterpret_cast<float*>(smem + W::kStatOff);     // [2][row]: max (base 2), sum

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, qd = lane % 4;
  const int ds = warp % 4, ph = warp / 4;  // Q·Kᵀ role: dim slice, position half
  const int split = blockIdx.y, b = blockIdx.z;
  const int row0 = blockIdx.x * W::kRowsBlock;

  const SplitTiles range = split_tiles<kTile>(p, b, split);
  if (range.idle(kDirect, split)) return;
  const int valid = range.valid, first = range.first, tile_begin = range.tile_begin, tile_end = range.tile_end;

  uint32_t qf[kMt][kKSteps][4];
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) load_q_fragments(p, b, row0 + 16 * mt, ds, g, qd, qf[mt]);
  KvPipeline<W> kv = make_kv_pipeline<W>(p, b, range, smem, kv_smem, W::kSlotOff);
  // Threads past kTile * 8 (small configuration) copy nothing: their row index would leave the tile.
  const bool copier = threadIdx.x < W::kCopyThreads;
  kv.copies = copier;
  if (!copier) {
    kv.my_row = 0;
    kv.prefetcher = false;
  }
  kv.start(tile_begin);

  // Softmax role: row rr of the block (8 lanes a row), positions pp .. pp + kPerLane - 1 of each tile.
  const int rr = warp * 4 + lane / 8, pp = (lane % 8) * W::kPerLane;
  const uint32_t* mask_r =
      p.tree_mask + (static_cast<int64_t>(b) * p.num_queries + min(row0 + rr, p.rows - 1) / p.num_heads) * p.mask_words;
  float m_run = -INFINITY, l_run = 0.f;

  float acc[kMt][8][4];  // O: rows 16 mt + g (+8), dims 64 warp + 8 nb + 2 qd (+1)
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) acc[mt][nb][0] = acc[mt][nb][1] = acc[mt][nb][2] = acc[mt][nb][3] = 0.f;

  const int mat = lane / 8;
  const uint32_t k_lane = W::kNb == 2
      ? ((lane % 8) + (mat / 2) * 8 + ph * 16) * kRowBytes + (ds * kKSlice + (mat % 2) * 8) * 2
      : ((lane % 8) + ph * 8) * kRowBytes + (ds * kKSlice + (mat % 2) * 8) * 2;
  const uint32_t v_lane = ((lane % 8) + (mat % 2) * 8) * kRowBytes + (warp * 64 + (mat / 2) * 8) * 2;
  const uint32_t p_lane = kv_smem + W::kPOff + ((lane % 8) + (mat % 2) * 8) * (W::kPStride * 2) + (mat / 2) * 16;
  float* my_part = part + ds * W::kRowsBlock * W::kPartStride;

  // Stage offsets: tile's (read_off), the refill's (write_off), tile - 1's (last_off: its V for P·V).
  uint32_t read_off = 0, write_off = W::kLead * W::kStageBytes, last_off = 0;
  for (int tile = tile_begin; tile <= tile_end; ++tile) {
    const bool scores = tile < tile_end, output = tile > tile_begin;
    const uint32_t v_stage = kv_smem + last_off;
    cp_async_wait<W::kLead - 1>();
    __syncthreads();  // A: tile landed; the softmax of tile - 1 is done (partials free, P(tile - 1) visible)
    if (scores) {
      const KvRefill refill = kv.begin_refill(tile, write_off);
      float s[kMt][W::kNb][4];
      partial_scores<W, kMt>(kv_smem + read_off + k_lane, qf, refill, s);
      last_off = read_off;
      kv.finish_refill(refill, tile, read_off, write_off);
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
        for (int nb = 0; nb < W::kNb; ++nb) {
          const int col = ph * (kTile / 2) + nb * 8 + 2 * qd;
          *reinterpret_cast<float2*>(my_part + (mt * 16 + g) * W::kPartStride + col) = make_float2(s[mt][nb][0], s[mt][nb][1]);
          *reinterpret_cast<float2*>(my_part + (mt * 16 + g + 8) * W::kPartStride + col) = make_float2(s[mt][nb][2], s[mt][nb][3]);
        }
    }
    if (output) {
      // O = O * scale(tile - 1) + P(tile - 1)·V(tile - 1); the rescale is skipped (per warp) when no row max moved.
      const int buf = (tile - 1) & 1;
      const float* sc = scale_s + buf * W::kRowsBlock;
      float f[kMt][2];
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) { f[mt][0] = sc[16 * mt + g]; f[mt][1] = sc[16 * mt + g + 8]; }
      bool moved = false;
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) moved |= f[mt][0] != 1.f || f[mt][1] != 1.f;
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt)
#pragma unroll
          for (int nb = 0; nb < 8; ++nb) {
            acc[mt][nb][0] *= f[mt][0]; acc[mt][nb][1] *= f[mt][0];
            acc[mt][nb][2] *= f[mt][1]; acc[mt][nb][3] *= f[mt][1];
          }
      }
      const uint32_t p_base = p_lane + buf * W::kPBufBytes;
#pragma unroll
      for (int u = 0; u < W::kSub; ++u) {
        uint32_t pa[kMt][4];
#pragma unroll
        for (int mt = 0; mt < kMt; ++mt) ldmatrix_x4(p_base + mt * 16 * (W::kPStride * 2) + u * 32, pa[mt]);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          uint32_t vb[4];
          ldmatrix_x4_trans(v_stage + v_lane + u * 16 * kRowBytes + j * 32, vb);
#pragma unroll
          for (int mt = 0; mt < kMt; ++mt) {
            mma_bf16(acc[mt][2 * j], pa[mt], vb[0], vb[1]);
            mma_bf16(acc[mt][2 * j + 1], pa[mt], vb[2], vb[3]);
          }
        }
      }
    }
    if (!scores) break;
    __syncthreads();  // B: the partial scores of this tile are written
    {
      float x[W::kPerLane];
      const float sc = softmax_row<W>(p, part, mask_r, rr, tile * kTile, pp, first, valid, x, m_run, l_run);
      uint16_t* prow = pbuf + (tile & 1) * (W::kPBufBytes / 2) + rr * W::kPStride + pp;
      if constexpr (W::kPerLane == 4) {
        *reinterpret_cast<uint2*>(prow) = make_uint2(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]));
      } else {
        *reinterpret_cast<uint32_t*>(prow) = pack_bf16(x[0], x[1]);
      }
      if (lane % 8 == 0) scale_s[(tile & 1) * W::kRowsBlock + rr] = sc;
    }
  }
  cp_async_wait<0>();

  // Epilogue: the softmax lanes publish each row's max and denominator; every warp normalises its columns.
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
  l_run += __shfl_xor_sync(0xffffffffu, l_run, 4);
  if (lane % 8 == 0) {
    stat_s[rr] = m_run;
    stat_s[W::kRowsBlock + rr] = l_run;
  }
  __syncthreads();
  write_rows(p, range.direct(kDirect), acc, stat_s, row0, b, split, warp * 64, g, qd, warp == 0 && qd == 0);
}

template <class W, bool kDirect>
__global__ void __launch_bounds__(W::kThreads, 1) verify_attention_pipelined_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  wait_for_previous_grid();
  allow_dependent_launch();
  if (static_cast<int>(blockIdx.x) * W::kRowsBlock + 16 < p.rows) {
    pipelined_body<W, 2, kDirect>(p, smem);
  } else {
    pipelined_body<W, 1, kDirect>(p, smem);
  }
}

template <class W>
cudaError_t setup_config() {
  for (const void* fn : {reinterpret_cast<const void*>(verify_attention_pipelined_kernel<W, true>),
                         reinterpret_cast<const void*>(verify_attention_pipelined_kernel<W, false>)}) {
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, W::kSmemBytes);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <class W>
void launch_config(const Params& p, int64_t batch, cudaStream_t stream, bool pdl) {
  const dim3 grid(static_cast<unsigned>((p.rows + W::kRowsBlock - 1) / W::kRowsBlock), static_cast<unsigned>(p.num_splits),
                  static_cast<unsigned>(batch));
  launch_kernel(p.num_splits == 1 ? verify_attention_pipelined_kernel<W, true> : verify_attention_pipelined_kernel<W, false>,
                grid, dim3(W::kThreads), W::kSmemBytes, stream, pdl, p);
}

}  // namespace

cudaError_t pipelined_kernel_setup() { return setup_config<LargeConfig>(); }

void launch_pipelined_kernel(const Params& p, int64_t batch, cudaStream_t stream, bool pdl) {
  launch_config<LargeConfig>(p, batch, stream, pdl);
}

int pipelined_kernel_smem_bytes() { return LargeConfig::kSmemBytes; }

}  // namespace kdtree::verify
