// The Hopper kernel (sm_90a only; issue 21): 64 query rows per block, two warpgroups with different jobs, both matrix
// products on the warpgroup tensor-core path (wgmma) with every operand in 128-byte swizzled shared memory, so that a
// K or V row is read once per warpgroup instead of once per warp (the portable kernels' limit:
// docs/verify_kernel.md).
//
//   * Q (64 rows x 576) stays in shared memory for the whole split; the KV rows of a 64-position tile are gathered
//     from the page-size-1 pool into two stages.
//   * The scores warpgroup (0) computes S = Q·Kᵀ for the whole tile (m64n64, 36 k-steps), the masked online softmax of
//     full rows (no maxima to trade), writes P (bf16) and each row's rescale factor to shared memory, and accumulates
//     output columns 0 .. 255 (O += P·V, m64n256, V read MN-major from the same tile).
//   * The output warpgroup (1) copies the KV tiles (cp.async, each 16-byte chunk at its swizzled place) and
//     accumulates output columns 256 .. 511 from the same P; its P·V runs while the scores warpgroup computes the next
//     tile's scores and softmax, so the tensor cores are not idle during the softmax.
// The two hand work over with named barriers (bar.arrive by the producer, bar.sync by the consumer):
//   FULL        tile c landed (output -> scores; arrived while the output warpgroup's P·V of c - 1 runs),
//   P_READY     P(c) and the rescale factors written (scores -> output),
//   P_FREE      the output warpgroup's P·V of c is done with P (output -> scores, before P(c + 1) is written),
//   STAGE_FREE  the scores warpgroup's Q·Kᵀ and P·V of c are done with c's stage (scores -> output, before tile c + 2
//               is copied into it).
// Each barrier is arrived at once per use by one side and waited at once by the other, and no side can arrive twice
// before the other has waited (each arrival follows a wait on the other side's previous step), so counts never mix.
// compute-sanitizer's racecheck does not take bar.arrive as ordering: it reports the rescale factors' store and load
// (ordered by P_READY and P_FREE) and nothing else; the test accepts exactly those two sites. Making P_READY a full
// barrier instead confused both racecheck and synccheck (2bee08a, reverted).
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
  static constexpr int kTile = 64;                               // KV positions per tile
  static constexpr int kColBlocks = kWidth / 64;                 // 9 column blocks of 64 dims (128 bytes)
  static constexpr int kBlockBytes = 64 * 128;                   // one column block of 64 rows
  static constexpr int kMatrixBytes = kColBlocks * kBlockBytes;  // 72 KB: Q, or one KV tile
  static constexpr int kQOff = 0;
  static constexpr int kKvOff = kQOff + kMatrixBytes;            // two stages
  static constexpr int kPOff = kKvOff + 2 * kMatrixBytes;        // P: 64 rows x 64 positions, bf16, one column block
  static constexpr int kScaleOff = kPOff + kBlockBytes;          // [row] rescale factor of the tile
  static constexpr int kStatOff = kScaleOff + kRowsBlock * 4;    // [row] final max (base 2), [row] final sum
  static constexpr int kUsedBytes = kStatOff + 2 * kRowsBlock * 4;
  static constexpr int kSmemBytes = kUsedBytes + 1024;           // + room to align the base to a swizzle atom
  static_assert(kSmemBytes <= 227 * 1024, "must fit sm_90's 227 KB per block");
};
using W = HopperConfig;

enum Barrier : int { kFull = 1, kPReady = 2, kPFree = 3, kStageFree = 4 };  // 0 is __syncthreads

#if KDTREE_HOPPER_DEVICE_CODE

__device__ __forceinline__ void arrive(Barrier id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(static_cast<int>(id)), "n"(W::kThreads) : "memory");
}
__device__ __forceinline__ void wait(Barrier id) { sm90::named_barrier(id, W::kThreads); }

// The output warpgroup's share of copying a 64-row, 576-wide matrix into the swizzled layout: thread t copies rows
// t / 8 + 16 i (i < 4), 16-byte chunk t % 8 of each 128-byte column block. The four rows share a swizzle (16 i % 8 = 0).
struct MatrixRows {
  const char* row[4];
  int bytes[4];
};
__device__ __forceinline__ void copy_matrix(uint32_t base, const MatrixRows& m, int t) {
  const int r = t / 8, chunk = t % 8;
  const uint32_t dst = base + r * 128 + ((chunk ^ (r % 8)) * 16);
  for_each_index([&](auto row) {
    constexpr int i = decltype(row)::value;
    const char* src = m.row[i] + chunk * 16;
    for_each_index([&](auto cb) {
      constexpr int k = decltype(cb)::value;
      cp_async_16_at<k * W::kBlockBytes + i * 16 * 128, k * 128>(dst, src, m.bytes[i]);
    }, std::make_integer_sequence<int, W::kColBlocks>{});
  }, std::make_integer_sequence<int, 4>{});
}

// P·V for one warpgroup's 256 output columns (column blocks 4 half .. 4 half + 3 of the tile's first 512 dims).
__device__ __forceinline__ void output_mma(float (&acc)[128], uint64_t p_desc, uint32_t kv, int half) {
  using namespace sm90;
  const uint64_t v_desc = smem_descriptor(kv + 4 * half * W::kBlockBytes, W::kBlockBytes, 1024);
  for_each_index([&](auto step) {
    constexpr int k = decltype(step)::value;  // positions 16 k .. 16 k + 15
    wgmma_m64n256k16_mn_major_b(acc, advance(p_desc, k * 32), advance(v_desc, k * 16 * 128), 1);
  }, std::make_integer_sequence<int, W::kTile / 16>{});
}

__device__ __forceinline__ void rescale(float (&acc)[128], float sc_a, float sc_b) {
  if (sc_a == 1.f && sc_b == 1.f) return;  // once the maxima settle, most tiles move none
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    acc[4 * j] *= sc_a;
    acc[4 * j + 1] *= sc_a;
    acc[4 * j + 2] *= sc_b;
    acc[4 * j + 3] *= sc_b;
  }
}

template <bool kDirect>
__device__ __forceinline__ void hopper_body(const Params& p, unsigned char* smem_raw) {
  using namespace sm90;
  const uint32_t raw_base = smem_addr(smem_raw);
  const uint32_t base = (raw_base + 1023u) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw_base);
  float* scale_s = reinterpret_cast<float*>(smem + W::kScaleOff);
  float* stat_s = reinterpret_cast<float*>(smem + W::kStatOff);

  const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
  const int lane = t % 32, g = lane / 4, qd = lane % 4;
  const int row_a = 16 * (t / 32) + g, row_b = row_a + 8;  // this thread's accumulator rows (block-local)
  const int split = blockIdx.y, b = blockIdx.z;
  const int row0 = blockIdx.x * W::kRowsBlock;

  const SplitTiles range = split_tiles<W::kTile>(p, b, split);
  if (range.idle(kDirect, split)) return;
  const bool direct = range.direct(kDirect);
  const int valid = range.valid, first = range.first, t0 = range.tile_begin, t_end = range.tile_end;
  const uint64_t p_desc = smem_descriptor(base + W::kPOff, 16, 1024);

  float acc[128];  // O: rows row_a / row_b, columns 256 wg + 8 j + 2 qd (+1) in acc[4 j + (0, 1) / (2, 3)]
#pragma unroll
  for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;  // scores warpgroup: row max (base 2), its sum share

  if (wg == 1 && t0 < t_end) {
    // ---- Output warpgroup: copies, then P·V of columns 256 .. 511.
    const uint16_t* layer_rows = layer_rows_of(p);
    const int32_t* slots = slot_table_of(p, b);
    // Slots are read a tile ahead of their copy and turned into row addresses only when the copy is issued, so that
    // nothing waits for the read.
    struct TileSlots {
      int32_t raw[4];
      bool ok[4];
    };
    auto read_slots = [&](int tile) {
      TileSlots ts;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int pos = tile * W::kTile + t / 8 + 16 * i;
        ts.ok[i] = tile < t_end && pos < valid;
        ts.raw[i] = ts.ok[i] ? __ldg(slots + pos) : 0;
      }
      return ts;
    };
    auto tile_rows = [&](const TileSlots& ts) {  // zeros past the end
      MatrixRows m;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        m.bytes[i] = ts.ok[i] ? 16 : 0;
        m.row[i] = reinterpret_cast<const char*>(layer_rows + clamp_slot(ts.raw[i], p.num_slots) * kWidth);
      }
      return m;
    };
    {
      MatrixRows q;
      const char* q_rows = reinterpret_cast<const char*>(p.q + static_cast<int64_t>(b) * p.rows * kWidth);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = row0 + t / 8 + 16 * i;
        q.row[i] = q_rows + static_cast<int64_t>(min(r, p.rows - 1)) * kWidth * 2;
        q.bytes[i] = r < p.rows ? 16 : 0;
      }
      copy_matrix(base + W::kQOff, q, t);
    }
    copy_matrix(base + W::kKvOff, tile_rows(read_slots(t0)), t);
    cp_async_commit();
    if (t0 + 1 < t_end) copy_matrix(base + W::kKvOff + W::kMatrixBytes, tile_rows(read_slots(t0 + 1)), t);
    cp_async_commit();
    TileSlots next = read_slots(t0 + 2);
    cp_async_wait<1>();
    fence_proxy_async();
    arrive(kFull);  // Q and tile t0

    for (int tile = t0; tile < t_end; ++tile) {
      const int stage = (tile - t0) & 1;
      const uint32_t kv = base + W::kKvOff + stage * W::kMatrixBytes;
      wait(kPReady);
      rescale(acc, scale_s[row_a], scale_s[row_b]);
      wgmma_fence();
      output_mma(acc, p_desc, kv, 1);
      wgmma_commit();
      if (tile + 1 < t_end) {
        // Tile + 1 is handed over while this P·V runs, so that its scores overlap both warpgroups' P·V of this tile.
        cp_async_wait<0>();
        fence_proxy_async();
        arrive(kFull);
      }
      wgmma_wait();
      fence_registers(acc);
      if (tile + 1 < t_end) {
        arrive(kPFree);
        wait(kStageFree);  // the scores warpgroup is done with this stage
        if (tile + 2 < t_end) copy_matrix(kv, tile_rows(next), t);
        cp_async_commit();
        next = read_slots(tile + 3);
      }
    }
  } else if (wg == 0 && t0 < t_end) {
    // ---- Scores warpgroup: S = Q·Kᵀ, softmax, P, then P·V of columns 0 .. 255.
    const uint32_t* mask_a = p.tree_mask +
        (static_cast<int64_t>(b) * p.num_queries + min(row0 + row_a, p.rows - 1) / p.num_heads) * p.mask_words;
    const uint32_t* mask_b = p.tree_mask +
        (static_cast<int64_t>(b) * p.num_queries + min(row0 + row_b, p.rows - 1) / p.num_heads) * p.mask_words;
    const uint64_t q_desc = smem_descriptor(base + W::kQOff, 16, 1024);
    const uint32_t p_row_a = base + W::kPOff + row_a * 128, p_row_b = p_row_a + 8 * 128;

    for (int tile = t0; tile < t_end; ++tile) {
      const int stage = (tile - t0) & 1;
      const uint32_t kv = base + W::kKvOff + stage * W::kMatrixBytes;
      wait(kFull);
      // S over the 576 dims: column block k / 4, 32-byte step k % 4 inside its rows. The previous tile's P·V (issued
      // last iteration) is the older of the two groups in flight.
      float s[32];
      {
        const uint64_t k_desc = smem_descriptor(kv, 16, 1024);
        wgmma_fence();
        for_each_index([&](auto step) {
          constexpr int k = decltype(step)::value;
          constexpr uint32_t off = (k / 4) * W::kBlockBytes + (k % 4) * 32;
          wgmma_m64n64k16(s, advance(q_desc, off), advance(k_desc, off), k > 0);
        }, std::make_integer_sequence<int, kWidth / 16>{});
        wgmma_commit();
        if (tile > t0) {
          wgmma_wait<1>();  // P·V of tile - 1 done
          arrive(kStageFree);
        }
        wgmma_wait();
        fence_registers(s);
        fence_registers(acc);
      }

      // Scores in base 2, the tree mask and the valid length (tiles that reach the query tokens or the end only).
      const int tile_pos = tile * W::kTile;
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] *= p.scale_log2;
      if (tile_pos + W::kTile > min(first, valid)) {
        const int j0 = tile_pos - first;
        const int w0 = max(j0, 0) >> 5;  // a tile's 64 query indices span at most three mask words
        auto bits_of = [&](const uint32_t* mask_r, int w) { return w < p.mask_words ? __ldg(mask_r + w) : 0u; };
        const uint32_t wa[3] = {bits_of(mask_a, w0), bits_of(mask_a, w0 + 1), bits_of(mask_a, w0 + 2)};
        const uint32_t wb[3] = {bits_of(mask_b, w0), bits_of(mask_b, w0 + 1), bits_of(mask_b, w0 + 2)};
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          const int pos = tile_pos + 8 * (i / 4) + 2 * qd + (i % 2);
          const int j = pos - first;
          // j < T whenever pos < valid; j - 32 w0 is in [0, 96).
          const int bit = j - 32 * w0;
          const uint32_t word = (i % 4) < 2 ? (bit < 32 ? wa[0] : (bit < 64 ? wa[1] : wa[2]))
                                            : (bit < 32 ? wb[0] : (bit < 64 ? wb[1] : wb[2]));
          const bool visible = pos < valid && (j < 0 || ((word >> (bit & 31)) & 1u));
          if (!visible) s[i] = -INFINITY;
        }
      }

      // Online softmax of full rows (4 lanes a row).
      float tile_a = -INFINITY, tile_b = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        tile_a = fmaxf(tile_a, fmaxf(s[4 * j], s[4 * j + 1]));
        tile_b = fmaxf(tile_b, fmaxf(s[4 * j + 2], s[4 * j + 3]));
      }
#pragma unroll
      for (int o = 1; o < 4; o *= 2) {
        tile_a = fmaxf(tile_a, __shfl_xor_sync(0xffffffffu, tile_a, o));
        tile_b = fmaxf(tile_b, __shfl_xor_sync(0xffffffffu, tile_b, o));
      }
      const float new_a = fmaxf(m_a, tile_a), new_b = fmaxf(m_b, tile_b);
      // A row that has seen nothing yet keeps max -inf; subtract 0 then so that exp2(-inf) = 0, not NaN.
      const float base_a = new_a == -INFINITY ? 0.f : new_a, base_b = new_b == -INFINITY ? 0.f : new_b;
      const float sc_a = fast_exp2(m_a - base_a), sc_b = fast_exp2(m_b - base_b);
      m_a = new_a;
      m_b = new_b;
      float sum_a = 0.f, sum_b = 0.f;
      uint32_t packed[16];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[4 * j] = fast_exp2(s[4 * j] - base_a);
        s[4 * j + 1] = fast_exp2(s[4 * j + 1] - base_a);
        s[4 * j + 2] = fast_exp2(s[4 * j + 2] - base_b);
        s[4 * j + 3] = fast_exp2(s[4 * j + 3] - base_b);
        sum_a += s[4 * j] + s[4 * j + 1];
        sum_b += s[4 * j + 2] + s[4 * j + 3];
        packed[2 * j] = pack_bf16(s[4 * j], s[4 * j + 1]);
        packed[2 * j + 1] = pack_bf16(s[4 * j + 2], s[4 * j + 3]);
      }
      l_a = l_a * sc_a + sum_a;
      l_b = l_b * sc_b + sum_b;

      if (tile > t0) wait(kPFree);  // the output warpgroup's P·V of tile - 1 is done with P
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        // P[row][8 j + 2 qd]: 16-byte chunk j of the row, swizzled (row_a % 8 == row_b % 8 == g).
        const uint32_t chunk = (j ^ g) * 16 + 4 * qd;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_row_a + chunk), "r"(packed[2 * j]));
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(p_row_b + chunk), "r"(packed[2 * j + 1]));
      }
      if (qd == 0) {
        scale_s[row_a] = sc_a;
        scale_s[row_b] = sc_b;
      }
      fence_proxy_async();
      arrive(kPReady);

      rescale(acc, sc_a, sc_b);
      wgmma_fence();
      output_mma(acc, p_desc, kv, 0);
      wgmma_commit();  // waited for behind the next tile's scores
    }
    wgmma_wait();
    fence_registers(acc);
  }
  cp_async_wait<0>();

  // Epilogue: the scores warpgroup publishes each row's max and denominator; both normalise their columns.
  if (wg == 0) {
#pragma unroll
    for (int o = 1; o < 4; o *= 2) {
      l_a += __shfl_xor_sync(0xffffffffu, l_a, o);
      l_b += __shfl_xor_sync(0xffffffffu, l_b, o);
    }
    if (qd == 0) {
      stat_s[row_a] = m_a;
      stat_s[row_b] = m_b;
      stat_s[W::kRowsBlock + row_a] = l_a;
      stat_s[W::kRowsBlock + row_b] = l_b;
    }
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rl = h == 0 ? row_a : row_b, r = row0 + rl;
    if (r >= p.rows) continue;
    const float m = stat_s[rl], sum = stat_s[W::kRowsBlock + rl];
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const float lse_row = sum > 0.f ? (m + log2f(sum)) * kLn2 : -INFINITY;
    const int64_t row_index = direct ? static_cast<int64_t>(b) * p.rows + r
                                     : (static_cast<int64_t>(b) * p.num_splits + split) * p.rows + r;
    const int col0 = 256 * wg + 2 * qd;
    if (direct) {
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
__global__ void __launch_bounds__(W::kThreads, 1) verify_attention_hopper_kernel(const Params p) {
#if KDTREE_HOPPER_DEVICE_CODE
  extern __shared__ __align__(1024) unsigned char smem[];
  wait_for_previous_grid();
  allow_dependent_launch();
  hopper_body<kDirect>(p, smem);
#endif
}

}  // namespace

cudaError_t hopper_kernel_setup() {
  for (const void* fn : {reinterpret_cast<const void*>(verify_attention_hopper_kernel<true>),
                         reinterpret_cast<const void*>(verify_attention_hopper_kernel<false>)}) {
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, W::kSmemBytes);
    if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

void launch_hopper_kernel(const Params& p, int64_t batch, cudaStream_t stream, bool pdl) {
  const dim3 grid(static_cast<unsigned>((p.rows + W::kRowsBlock - 1) / W::kRowsBlock), static_cast<unsigned>(p.num_splits),
                  static_cast<unsigned>(batch));
  launch_kernel(p.num_splits == 1 ? verify_attention_hopper_kernel<true> : verify_attention_hopper_kernel<false>, grid,
                dim3(W::kThreads), W::kSmemBytes, stream, pdl, p);
}

int hopper_kernel_smem_bytes() { return W::kSmemBytes; }

}  // namespace kdtree::verify
