// The Hopper kernel (sm_90a only; issue 21): 64 query rows per block, two warpgroups, both matrix products on the
// warpgroup tensor-core path (wgmma) with every operand in 128-byte swizzled shared memory, so that a K or V row is
// read once per warpgroup instead of once per warp (the portable kernels' limit: benchmarks/README_verify_kernel.md).
//
//   * Q (64 rows x 576) stays in shared memory for the whole split; the KV rows of a 64-position tile are gathered
//     from the page-size-1 pool by cp.async (all 256 threads, 8 per row, each 16-byte chunk stored at its swizzled
//     place), double-buffered: tile c + 1 is in flight while tile c is computed.
//   * Warpgroup w owns half of everything that can be halved: the scores of positions 32w .. 32w + 31 of the tile
//     (S = Q·Kᵀ, m64n32, 36 k-steps) and output columns 256w .. 256w + 255 (O += P·V, m64n256, 4 k-steps, V read
//     MN-major from the same tile). The softmax needs both halves of a row: the warpgroups trade row maxima through
//     shared memory, and each writes its half of P (bf16) where the other's P·V reads it.
//   * One tile: barrier (tile landed) -> S -> row maxima -> barrier -> P, rescale O -> barrier -> P·V.
// The tree mask, the split-KV schedule and the partial outputs are the portable kernels' (device.cuh, merge.cu).
//
// T*H <= 64 pads the block to 64 rows: the MMAs on the padding cost tensor-core time that a memory-bound call has to
// spare (its 64-position tile takes longer to arrive than to compute).
#include "device.cuh"
#include "kernels.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDTREE_HOPPER_DEVICE_CODE 1
#include "wgmma.cuh"
#endif

namespace kdtree::verify {
namespace {

struct HopperConfig {
  static constexpr int kThreads = 256;  // two warpgroups
  static constexpr int kRowsBlock = 64;
  static constexpr int kTile = 64;                           // KV positions per tile
  static constexpr int kColBlocks = kWidth / 64;             // 9 column blocks of 64 dims (128 bytes)
  static constexpr int kBlockBytes = 64 * 128;               // one column block of 64 rows
  static constexpr int kMatrixBytes = kColBlocks * kBlockBytes;  // 72 KB: Q, or one KV tile
  static constexpr int kQOff = 0;
  static constexpr int kKvOff = kQOff + kMatrixBytes;        // two stages
  static constexpr int kPOff = kKvOff + 2 * kMatrixBytes;    // P: 64 rows x 64 positions, bf16, one column block
  static constexpr int kMaxOff = kPOff + kBlockBytes;        // [warpgroup][row] row maxima of a tile (base 2)
  static constexpr int kSumOff = kMaxOff + 2 * kRowsBlock * 4;  // [warpgroup][row] denominators (epilogue)
  static constexpr int kUsedBytes = kSumOff + 2 * kRowsBlock * 4;
  static constexpr int kSmemBytes = kUsedBytes + 1024;       // + room to align the base to a swizzle atom
  static_assert(kSmemBytes <= 227 * 1024, "must fit sm_90's 227 KB per block");
};
using W = HopperConfig;

#if KDTREE_HOPPER_DEVICE_CODE

// 16-byte async copy with separate immediate offsets into shared and global memory (zeros when src_bytes = 0).
template <int kDst, int kSrc>
__device__ __forceinline__ void cp_async_16(uint32_t dst, const char* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0+%3], [%1+%4], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes), "n"(kDst),
               "n"(kSrc));
}

// This thread's part of copying a 64-row, 576-wide matrix into the swizzled layout: rows r and r + 32 (r = thread /
// 8), 16-byte chunk (thread % 8) of each 128-byte column block. Row r + 32 has the same swizzle as row r.
__device__ __forceinline__ void copy_matrix(uint32_t base, const char* row_a, int bytes_a, const char* row_b, int bytes_b) {
  const int r = threadIdx.x / 8, chunk = threadIdx.x % 8;
  const uint32_t dst = base + r * 128 + ((chunk ^ (r % 8)) * 16);
  row_a += chunk * 16;
  row_b += chunk * 16;
  for_each_index([&](auto cb) {
    constexpr int k = decltype(cb)::value;
    cp_async_16<k * W::kBlockBytes, k * 128>(dst, row_a, bytes_a);
    cp_async_16<k * W::kBlockBytes + 32 * 128, k * 128>(dst, row_b, bytes_b);
  }, std::make_integer_sequence<int, W::kColBlocks>{});
}

template <bool kDirect>
__device__ __forceinline__ void hopper_body(const Params& p, unsigned char* smem_raw) {
  using namespace sm90;
  const uint32_t raw_base = smem_addr(smem_raw);
  const uint32_t base = (raw_base + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw_base);
  float* max_s = reinterpret_cast<float*>(smem + W::kMaxOff);
  float* sum_s = reinterpret_cast<float*>(smem + W::kSumOff);

  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int lane = t % 32, g = lane / 4, qd = lane % 4;
  const int row_a = 16 * (t / 32) + g, row_b = row_a + 8;  // this thread's rows of S and O (block-local)
  const int split = blockIdx.y, b = blockIdx.z;
  const int row0 = blockIdx.x * W::kRowsBlock;

  const SplitTiles range = split_tiles<W::kTile>(p, b, split);
  const int valid = range.valid, first = range.first;

  // Per-row state: running max (base 2) and this thread's share of the denominator.
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  float acc[128];  // O: rows row_a / row_b, columns 256 wg + 8 j + 2 qd (+1) in acc[4 j + (0, 1) / (2, 3)]
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;

  if (range.tile_begin < range.tile_end) {
    const uint16_t* layer_rows = layer_rows_of(p);
    const int32_t* slots = slot_table_of(p, b);
    const int copy_row = threadIdx.x / 8;  // and copy_row + 32
    auto kv_row = [&](int tile, int r, int& bytes) {
      const int pos = tile * W::kTile + r;
      const bool ok = tile < range.tile_end && pos < valid;
      bytes = ok ? 16 : 0;
      return ok ? __ldg(slots + pos) : 0;
    };
    auto issue_tile = [&](int stage, int32_t raw_a, int bytes_a, int32_t raw_b, int bytes_b) {
      copy_matrix(base + W::kKvOff + stage * W::kMatrixBytes,
                  reinterpret_cast<const char*>(layer_rows + clamp_slot(raw_a, p.num_slots) * kWidth), bytes_a,
                  reinterpret_cast<const char*>(layer_rows + clamp_slot(raw_b, p.num_slots) * kWidth), bytes_b);
    };

    // Prologue: Q and the first tile in one group, the second tile in another (its stage is free until the first
    // tile's P·V is done); the slots of the third tile read ahead.
    {
      const int qa = row0 + copy_row, qb = qa + 32;
      const char* q_rows = reinterpret_cast<const char*>(p.q + static_cast<int64_t>(b) * p.rows * kWidth);
      copy_matrix(base + W::kQOff, q_rows + static_cast<int64_t>(min(qa, p.rows - 1)) * kWidth * 2, qa < p.rows ? 16 : 0,
                  q_rows + static_cast<int64_t>(min(qb, p.rows - 1)) * kWidth * 2, qb < p.rows ? 16 : 0);
    }
    int bytes_a, bytes_b;
    int32_t raw_a = kv_row(range.tile_begin, copy_row, bytes_a), raw_b = kv_row(range.tile_begin, copy_row + 32, bytes_b);
    issue_tile(0, raw_a, bytes_a, raw_b, bytes_b);
    cp_async_commit();
    raw_a = kv_row(range.tile_begin + 1, copy_row, bytes_a);
    raw_b = kv_row(range.tile_begin + 1, copy_row + 32, bytes_b);
    if (range.tile_begin + 1 < range.tile_end) issue_tile(1, raw_a, bytes_a, raw_b, bytes_b);
    cp_async_commit();
    raw_a = kv_row(range.tile_begin + 2, copy_row, bytes_a);
    raw_b = kv_row(range.tile_begin + 2, copy_row + 32, bytes_b);

    // Tree-mask rows of this thread's two query rows (padding rows read the last real row's).
    const uint32_t* mask_a = p.tree_mask +
        (static_cast<int64_t>(b) * p.num_queries + min(row0 + row_a, p.rows - 1) / p.num_heads) * p.mask_words;
    const uint32_t* mask_b = p.tree_mask +
        (static_cast<int64_t>(b) * p.num_queries + min(row0 + row_b, p.rows - 1) / p.num_heads) * p.mask_words;

    const uint64_t q_desc = smem_descriptor(base + W::kQOff, 16, 1024);
    const uint64_t p_desc = smem_descriptor(base + W::kPOff, 16, 1024);
    const uint32_t p_row_a = base + W::kPOff + row_a * 128, p_row_b = p_row_a + 8 * 128;

    for (int tile = range.tile_begin; tile < range.tile_end; ++tile) {
      const int stage = (tile - range.tile_begin) & 1;
      const uint32_t kv = base + W::kKvOff + stage * W::kMatrixBytes;
      // The first iteration has the second tile's group in flight too; later ones only their own tile's.
      if (tile == range.tile_begin) {
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      fence_proxy_async();
      __syncthreads();  // tile landed for everybody; both warpgroups are done with the other stage and with P

      // S = Q · K[32 wg .. 32 wg + 31]ᵀ over the 576 dims: column block k / 4, 32-byte step k % 4 inside its rows.
      // The next tile's copies are issued while the MMAs run (into the other stage, which they do not read).
      float s[16];
      {
        const uint64_t k_desc = smem_descriptor(kv + wg * 32 * 128, 16, 1024);
        wgmma_fence();
        for_each_index([&](auto step) {
          constexpr int k = decltype(step)::value;
          constexpr uint32_t off = (k / 4) * W::kBlockBytes + (k % 4) * 32;
          wgmma_m64n32k16(s, advance(q_desc, off), advance(k_desc, off), k > 0);
        }, std::make_integer_sequence<int, kWidth / 16>{});
        wgmma_commit();
        if (tile > range.tile_begin) {
          if (tile + 1 < range.tile_end) issue_tile(stage ^ 1, raw_a, bytes_a, raw_b, bytes_b);
          cp_async_commit();
          raw_a = kv_row(tile + 2, copy_row, bytes_a);
          raw_b = kv_row(tile + 2, copy_row + 32, bytes_b);
        }
        wgmma_wait_all();
        fence_registers(s);
      }

      // Scores in base 2, the tree mask and the valid length (tiles that reach the query tokens or the end only).
      const int half_pos = tile * W::kTile + 32 * wg;
#pragma unroll
      for (int i = 0; i < 16; ++i) s[i] *= p.scale_log2;
      if (tile * W::kTile + W::kTile > min(first, valid)) {
        const int j0 = half_pos - first;
        const int w0 = max(j0, 0) >> 5;  // the half's 32 query indices span at most two mask words
        auto bits_of = [&](const uint32_t* mask_r) {
          const uint32_t lo = w0 < p.mask_words ? __ldg(mask_r + w0) : 0u;
          const uint32_t hi = w0 + 1 < p.mask_words ? __ldg(mask_r + w0 + 1) : 0u;
          return (static_cast<uint64_t>(hi) << 32) | lo;
        };
        const uint64_t bits_a = bits_of(mask_a), bits_b = bits_of(mask_b);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int pos = half_pos + 8 * (i / 4) + 2 * qd + (i % 2);
          const int j = pos - first;
          const uint64_t bits = (i % 4) < 2 ? bits_a : bits_b;
          // j < T whenever pos < valid; bit j - 32 w0 is in [0, 63).
          const bool visible = pos < valid && (j < 0 || ((bits >> (j - 32 * w0)) & 1u));
          if (!visible) s[i] = -INFINITY;
        }
      }

      // Row maxima of this half (4 lanes a row), traded with the other warpgroup.
      float tile_a = -INFINITY, tile_b = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        tile_a = fmaxf(tile_a, fmaxf(s[4 * j], s[4 * j + 1]));
        tile_b = fmaxf(tile_b, fmaxf(s[4 * j + 2], s[4 * j + 3]));
      }
#pragma unroll
      for (int o = 1; o < 4; o *= 2) {
        tile_a = fmaxf(tile_a, __shfl_xor_sync(0xffffffffu, tile_a, o));
        tile_b = fmaxf(tile_b, __shfl_xor_sync(0xffffffffu, tile_b, o));
      }
      if (qd == 0) {
        max_s[wg * W::kRowsBlock + row_a] = tile_a;
        max_s[wg * W::kRowsBlock + row_b] = tile_b;
      }
      named_barrier(1, W::kThreads);
      const float new_a = fmaxf(m_a, fmaxf(tile_a, max_s[(wg ^ 1) * W::kRowsBlock + row_a]));
      const float new_b = fmaxf(m_b, fmaxf(tile_b, max_s[(wg ^ 1) * W::kRowsBlock + row_b]));
      // A row that has seen nothing yet keeps max -inf; subtract 0 then so that exp2(-inf) = 0, not NaN.
      const float base_a = new_a == -INFINITY ? 0.f : new_a, base_b = new_b == -INFINITY ? 0.f : new_b;
      const float sc_a = fast_exp2(m_a - base_a), sc_b = fast_exp2(m_b - base_b);
      m_a = new_a;
      m_b = new_b;
      float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        s[4 * j] = fast_exp2(s[4 * j] - base_a);
        s[4 * j + 1] = fast_exp2(s[4 * j + 1] - base_a);
        s[4 * j + 2] = fast_exp2(s[4 * j + 2] - base_b);
        s[4 * j + 3] = fast_exp2(s[4 * j + 3] - base_b);
        sum_a += s[4 * j] + s[4 * j + 1];
        sum_b += s[4 * j + 2] + s[4 * j + 3];
        // P[row][32 wg + 8 j + 2 qd]: 16-byte chunk 4 wg + j of the row, swizzled.
        const uint32_t chunk = ((4 * wg + j) ^ g) * 16 + 4 * qd;  // row_a % 8 == row_b % 8 == g
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_row_a + chunk), "r"(pack_bf16(s[4 * j], s[4 * j + 1])));
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_row_b + chunk), "r"(pack_bf16(s[4 * j + 2], s[4 * j + 3])));
      }
      l_a = l_a * sc_a + sum_a;
      l_b = l_b * sc_b + sum_b;
      if (sc_a != 1.f || sc_b != 1.f) {  // once the maxima settle, most tiles move none
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          acc[4 * j] *= sc_a;
          acc[4 * j + 1] *= sc_a;
          acc[4 * j + 2] *= sc_b;
          acc[4 * j + 3] *= sc_b;
        }
      }
      fence_proxy_async();
      named_barrier(2, W::kThreads);  // both halves of P written

      // O[:, 256 wg ..] += P · V: V is the tile's first 512 dims read MN-major (column block 4 wg + n / 64, position
      // rows 16 k .. 16 k + 15).
      {
        const uint64_t v_desc = smem_descriptor(kv + 4 * wg * W::kBlockBytes, W::kBlockBytes, 1024);
        wgmma_fence();
        for_each_index([&](auto step) {
          constexpr int k = decltype(step)::value;
          wgmma_m64n256k16_mn_major_b(acc, advance(p_desc, k * 32), advance(v_desc, k * 16 * 128), 1);
        }, std::make_integer_sequence<int, W::kTile / 16>{});
        wgmma_commit();
        wgmma_wait_all();
        fence_registers(acc);
      }
    }
    cp_async_wait<0>();
  }

  // Epilogue: each warpgroup holds the denominators of its half of the positions; the maxima agree.
#pragma unroll
  for (int o = 1; o < 4; o *= 2) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, o);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, o);
  }
  if (qd == 0) {
    sum_s[wg * W::kRowsBlock + row_a] = l_a;
    sum_s[wg * W::kRowsBlock + row_b] = l_b;
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rl = h == 0 ? row_a : row_b, r = row0 + rl;
    if (r >= p.rows) continue;
    const float sum = sum_s[rl] + sum_s[W::kRowsBlock + rl];
    const float m = h == 0 ? m_a : m_b;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const float lse_row = sum > 0.f ? (m + log2f(sum)) * kLn2 : -INFINITY;
    const int64_t row_index = kDirect ? static_cast<int64_t>(b) * p.rows + r
                                      : (static_cast<int64_t>(b) * p.num_splits + split) * p.rows + r;
    const int col0 = 256 * wg + 2 * qd;
    if (kDirect) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(p.out + row_index * kLatent + col0);
#pragma unroll
      for (int j = 0; j < 32; ++j) dst[j * 4] = pack_bf16(acc[4 * j + 2 * h] * inv, acc[4 * j + 2 * h + 1] * inv);
      if (wg == 0 && qd == 0) p.lse[row_index] = lse_row;
    } else {
      float2* dst = reinterpret_cast<float2*>(p.out_part + row_index * kLatent + col0);
#pragma unroll
      for (int j = 0; j < 32; ++j) dst[j * 4] = make_float2(acc[4 * j + 2 * h] * inv, acc[4 * j + 2 * h + 1] * inv);
      if (wg == 0 && qd == 0) p.lse_part[row_index] = lse_row;
    }
  }
}

#endif  // KDTREE_HOPPER_DEVICE_CODE

template <bool kDirect>
__global__ void __launch_bounds__(W::kThreads, 1) verify_attention_hopper_symmetric_kernel(const Params p) {
#if KDTREE_HOPPER_DEVICE_CODE
  extern __shared__ __align__(1024) unsigned char smem[];
  hopper_body<kDirect>(p, smem);
#endif
}

}  // namespace

cudaError_t hopper_symmetric_kernel_setup() {
  for (const void* fn : {reinterpret_cast<const void*>(verify_attention_hopper_symmetric_kernel<true>),
                         reinterpret_cast<const void*>(verify_attention_hopper_symmetric_kernel<false>)}) {
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, W::kSmemBytes);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

void launch_hopper_symmetric_kernel(const Params& p, int64_t batch, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.rows + W::kRowsBlock - 1) / W::kRowsBlock), static_cast<unsigned>(p.num_splits),
                  static_cast<unsigned>(batch));
  (p.num_splits == 1 ? verify_attention_hopper_symmetric_kernel<true> : verify_attention_hopper_symmetric_kernel<false>)
      <<<grid, W::kThreads, W::kSmemBytes, stream>>>(p);
}



}  // namespace kdtree::verify
