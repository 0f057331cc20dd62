// CUDA handler of the verify-attention op: split-KV flash-decode over slot-indirected latent rows.
//
// Geometry (K2/DeepSeek absorbed MLA): a latent row is 576 bf16 = [c_kv 512 | rope 64]; scores use all 576
// dims, the output is the softmax-weighted sum of the first 512.  Query rows of one sequence are the T*H
// pairs (t, h) flattened as r = t*H + h (q's own memory order).
//
// Work split.  Grid (row tiles, KV splits, batch); a block owns one contiguous range of KV positions, and its
// warps share every KV tile that lands in shared memory.  Two kernels:
//   * T*H <= 16 (decode): verify_attention_kernel<.., 1>, one row group of 4 warps on 16 query rows (one m16
//     MMA tile), 16-position tiles in a 5-slot ring, two blocks per SM.  S = Q·Kᵀ: warp w multiplies its
//     144-dim slice of the 576 dims (its Q fragments stay in registers) and the four partial score blocks are
//     summed through shared memory; every warp runs the online softmax; O += P·V: warp w owns output dims
//     [128w, 128w+128).  (verify_attention_kernel<.., 2>, two such groups on 32 rows, is kept for A/B runs:
//     KDTREE_VERIFY_VARIANT=0.)
//   * T*H > 16: verify_attention_wide_kernel, 32 rows per block, 8 warps that all work on all 32 rows (two m16
//     tiles): each K/V fragment read from shared memory feeds twice the MMAs, the softmax runs once per row
//     (see the comment above the kernel).  verify_attention_ws_kernel (KDTREE_VERIFY_VARIANT=2, opt-in) splits
//     the same work between score warps and value warps that run one tile apart (1.03-1.14x slower on an H200,
//     benchmarks/results/verify_kernel_variants_h200.md; kept for A/B runs).
// KV tiles arrive by cp.async (16 B per copy, every thread of the block copies, a row's copies from one base
// address with immediate offsets).  The slots of a tile come through a small shared ring filled by cp.async in
// the commit group of an earlier tile, so no index load is left in the loop (ncu, 2026-11-29: the in-loop slot
// load's scoreboard stalled the first MMA of every tile, 25-45% of the stall samples), and the rows a few tiles
// ahead are prefetched into L2.  A row is padded to 1168 B so that the 8 row addresses of an ldmatrix fall in
// distinct banks.  The O rescale is skipped (warp vote) when no row max moved.  Shared memory <= 99 KB per
// block (sm_120's limit).
//
// Splits write (out / l, lse) partials that a second kernel merges by LSE weights; with one split the main
// kernel writes the final result itself.  Tiles are split evenly over the splits from the *device* kv_len,
// so the split count is static (a launch parameter) while the work per split follows the real length.
//
// No host synchronisation, no allocation: the handler only launches, so it is safe inside CUDA graphs
// (XLA command buffers); the partial buffers are outputs of the custom call (see kdtree_jax/ops/ffi.py).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "verify_attention.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLatent = 512;
constexpr int kRope = 64;
constexpr int kWidth = kLatent + kRope;     // 576
constexpr int kRows = 16;                   // query rows per row group (one m16 MMA tile)
constexpr int kWarps = 4;                   // warps per row group
constexpr int kRowBytes = kWidth * 2 + 16;  // 1168: padded shared-memory row
constexpr int kKSlice = kWidth / kWarps;    // 144 dims of Q·Kᵀ per warp
constexpr int kKSteps = kKSlice / 16;       // 9 MMA k-steps
constexpr int kOutCols = kLatent / kWarps;  // 128 output dims per warp
constexpr int kOutBlocks = kOutCols / 8;    // 16 n8 blocks
constexpr int kChunksPerRow = kWidth * 2 / 16;  // 72 16-byte chunks per latent row

// A block has kGroups row groups of 4 warps (16 query rows each) that share every KV tile: one group
// (2 blocks per SM) for decode-sized row counts, two (32 rows, 1 block per SM) otherwise, which halves
// how often each KV tile is read from L2 when T*H is large.  Every thread of the block issues copies:
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
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Params {
  const uint16_t* q;          // [B, rows, 576] bf16 bits
  const uint16_t* kv_pool;    // [num_layers, num_slots, 576]
  const int32_t* layer;       // []
  const int32_t* kv_slots;    // [B, max_len]
  const int32_t* kv_lens;     // [B]
  const uint32_t* tree_mask;  // [B, T, mask_words]
  uint16_t* out;              // [B, rows, 512] bf16
  float* lse;                 // [B, rows]
  float* out_part;            // [B, splits, rows, 512]   (splits > 1 only)
  float* lse_part;            // [B, splits, rows]
  int num_queries, num_heads, rows, mask_words, max_len, num_layers, num_splits;
  int64_t num_slots;
  float scale_log2;           // softmax_scale * log2(e): the softmax runs in base 2 (ex2.approx)
#if defined(KDTREE_VERIFY_BLOCK_CLOCK)
  // [blocks][2]: %globaltimer (ns) when each block of the main kernel starts and ends, for the benchmark harness's
  // block timeline (bench_verify_block_times); nullptr in the op. A diagnostic build only: with this member, even
  // unused, ptxas scheduled the wide kernel's main loop differently (495 -> 521 SASS instructions on sm_90).
  unsigned long long* block_clock;
#endif
};

// Stamp this block's start (which = 0) or end (1) into p.block_clock when the harness asks for it (a diagnostic
// build, KDTREE_JAX_BLOCK_CLOCK=1 at install; a no-op otherwise).
__device__ __forceinline__ void stamp_block([[maybe_unused]] const Params& p, [[maybe_unused]] int which) {
#if defined(KDTREE_VERIFY_BLOCK_CLOCK)
  if (p.block_clock != nullptr && threadIdx.x == 0) {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    const int64_t block = (static_cast<int64_t>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    p.block_clock[2 * block + which] = now;
  }
#endif
}

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx: 2 ulp, exp2(-inf) = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// D = A·B + D, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 4-byte async copy (a slot index into the shared slot ring); src_bytes = 0 writes a zero.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

// 16-byte async copies of one row chunk; the chunk offsets are immediates of the instruction, so a thread
// computes its two row addresses once per tile instead of one 64-bit address per copy.  src_bytes = 0 writes
// zeros (positions past the end never hold stale data: a zero row times a zero probability stays zero,
// whereas garbage could be NaN).
template <int kOffset>
__device__ __forceinline__ void cp_async_16_at(uint32_t dst, const char* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0+%3], [%1+%3], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes),
               "n"(kOffset));
}
template <int kThreadsPerRow, int... kChunk>
__device__ __forceinline__ void copy_row_chunks(uint32_t dst, const char* src, int src_bytes,
                                                std::integer_sequence<int, kChunk...>) {
  (cp_async_16_at<kChunk * kThreadsPerRow * 16>(dst, src, src_bytes), ...);
}

// f(std::integral_constant<int, k>{}) for k = 0, 1, ...: a loop whose index is a compile-time constant.
template <class F, int... k>
__device__ __forceinline__ void for_each_index(F&& f, std::integer_sequence<int, k...>) {
  (f(std::integral_constant<int, k>{}), ...);
}

__device__ __forceinline__ int64_t clamp_slot(int32_t raw, int64_t num_slots) {  // never out of bounds
  return raw < 0 ? 0 : (raw >= num_slots ? num_slots - 1 : raw);
}

// One thread's share of a KV tile copy: its row's source and destination and its byte count (0: zeros past the
// end).  Computed before any copy is issued and issued chunk by chunk, so that a kernel can interleave the
// chunks with its MMAs (see the wide kernel).
struct KvCopy {
  const char* src;
  uint32_t dst;
  int bytes;
};
template <int kThreadsPerRow>
__device__ __forceinline__ KvCopy plan_kv_copy(int64_t num_slots, const uint16_t* layer_rows, int32_t raw, bool ok,
                                               uint32_t stage_base) {
  const int64_t slot = clamp_slot(raw, num_slots);
  const int lane_chunk = threadIdx.x % kThreadsPerRow;
  return KvCopy{reinterpret_cast<const char*>(layer_rows + slot * kWidth) + lane_chunk * 16,
                stage_base + (threadIdx.x / kThreadsPerRow) * kRowBytes + lane_chunk * 16, ok ? 16 : 0};
}
template <int kThreadsPerRow, int kChunk>
__device__ __forceinline__ void issue_kv_chunk(const KvCopy& c) {
  cp_async_16_at<kChunk * kThreadsPerRow * 16>(c.dst, c.src, c.bytes);
}

// Issue this thread's copies of its row of a KV tile into stage buffer `stage_base` (zeros past the end).
template <int kThreadsPerRow, int kChunksPerThread>
__device__ __forceinline__ void load_kv_tile(int64_t num_slots, const uint16_t* layer_rows, int32_t raw, bool ok,
                                             uint32_t stage_base) {
  const KvCopy c = plan_kv_copy<kThreadsPerRow>(num_slots, layer_rows, raw, ok, stage_base);
  copy_row_chunks<kThreadsPerRow>(c.dst, c.src, c.bytes, std::make_integer_sequence<int, kChunksPerThread>{});
}

// Prefetch this thread's share of its row of a KV tile into L2: 128-byte lines, 9 per 1152-byte row
// (kThreadsPerRow == 8: line c for thread c of the row, and line 8 for thread 0).
// Each row is prefetched by one block of the split: the blocks of a split's row tiles read the same rows at about
// the same time, so more prefetches would only add L2 requests (ncu, 2026-11-29, 64k T = 16: L2 throughput 31% ->
// 50% of peak with every block prefetching every row, for an 8% shorter kernel).  Row r of a tile goes to row tile
// r % gridDim.x, so that no block carries all of it (ncu, 2026-11-30: when the first row tile prefetched every
// row, its blocks, the kernel's critical path, waited on the slot reads for 3% of all samples).
template <int kThreadsPerRow>
__device__ __forceinline__ void prefetch_kv_row(int64_t num_slots, const uint16_t* layer_rows, int32_t raw, bool ok) {
  static_assert(kThreadsPerRow == 8, "9 lines over 8 threads");
  if (!ok) return;
  const int lane_chunk = threadIdx.x % kThreadsPerRow;
  const char* row = reinterpret_cast<const char*>(layer_rows + clamp_slot(raw, num_slots) * kWidth);
  prefetch_l2(row + lane_chunk * 128);
  if (lane_chunk == 0) prefetch_l2(row + 8 * 128);
}

// What a loop iteration's refill issues (see KvPipeline::begin_refill).
struct KvRefill {
  KvCopy copy;
  bool do_copy;
  int32_t fetch_raw;
  bool fetch_ok;
};

// A split's share of sequence b's KV positions, in whole tiles, from the *device* kv_len: valid positions,
// the position of query token 0, and the split's tiles [tile_begin, tile_end).
struct SplitTiles {
  int valid, first, tile_begin, tile_end;
};
template <int kTile>
__device__ __forceinline__ SplitTiles split_tiles(const Params& p, int b, int split) {
  const int kv_len = p.kv_lens[b];
  const int valid = min(max(kv_len, 0), p.max_len);
  const int num_tiles = (valid + kTile - 1) / kTile;
  const int tiles_per_split = (num_tiles + p.num_splits - 1) / p.num_splits;
  const int tile_begin = min(split * tiles_per_split, num_tiles);
  return SplitTiles{valid, kv_len - p.num_queries, tile_begin, min(tile_begin + tiles_per_split, num_tiles)};
}

// This call's layer of the KV pool (clamped into range) and sequence b's slot table.
__device__ __forceinline__ const uint16_t* layer_rows_of(const Params& p) {
  const int layer = static_cast<int>(kdtree::clamp_layer(*p.layer, p.num_layers));
  return p.kv_pool + static_cast<int64_t>(layer) * p.num_slots * kWidth;
}
__device__ __forceinline__ const int32_t* slot_table_of(const Params& p, int b) {
  return p.kv_slots + static_cast<int64_t>(b) * p.max_len;
}

// Q fragments (the A operand of m16n8k16) of one m16 row tile, rows r0 + g and r0 + g + 8, over the 144-dim
// slice ds; zeros past the last row.
__device__ __forceinline__ void load_q_fragments(const Params& p, int b, int r0, int ds, int g, int qd,
                                                 uint32_t (&qf)[kKSteps][4]) {
  const int ra = r0 + g, rb = r0 + g + 8;
  const uint32_t* qa = reinterpret_cast<const uint32_t*>(p.q + (static_cast<int64_t>(b) * p.rows + ra) * kWidth);
  const uint32_t* qb = reinterpret_cast<const uint32_t*>(p.q + (static_cast<int64_t>(b) * p.rows + rb) * kWidth);
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const int k2 = (ds * kKSlice + ks * 16) / 2 + qd;  // in 32-bit words
    qf[ks][0] = ra < p.rows ? __ldg(qa + k2) : 0u;
    qf[ks][1] = rb < p.rows ? __ldg(qb + k2) : 0u;
    qf[ks][2] = ra < p.rows ? __ldg(qa + k2 + 4) : 0u;
    qf[ks][3] = rb < p.rows ? __ldg(qb + k2 + 4) : 0u;
  }
}

// One thread's part of a kernel's KV copy pipeline over its split: where the rows come from (this layer of the
// pool, the sequence's slot table), the shared slot ring, and the row of a tile this thread copies (kThreadsPerRow
// threads a row, kChunksPerThread 16-byte chunks each).
//   * start: the first kLead tiles in flight (one commit group each, empty ones too, so that the group count in
//     the loop's wait is the same for every block), the next kPrefetch tiles prefetched into L2, and the slots of
//     the tiles after those requested into the ring (in the first group: the loop's first iteration reads
//     them).  The slots the prologue itself needs are loaded directly, all before the first copy: one memory
//     round trip.
//   * each iteration, once `tile` has landed: begin_refill reads the ring slots of tile + kLead (copied into the
//     stage just freed) and of tile + kLead + kPrefetch (prefetched into L2), both before any copy (a shared load
//     queued behind the copies waits for all of them); the kernel issues the copy one chunk per Q·Kᵀ k-step
//     between its MMAs (issue_kv_chunk); finish_refill prefetches, requests the slots of tile + kSlotAhead,
//     commits (one group, empty or not) and advances the ring's read and write offsets.
// The slot ring: entry (tile % kSlotRing) holds the kTile slots of a tile; threads 0 .. kTile - 1 copy them
// (cp.async, 4 bytes each, zeros past the valid positions); it holds tiles t + kLead .. t + kSlotAhead at once.
template <class Cfg>
struct KvPipeline {
  static_assert(Cfg::kSlotRing >= Cfg::kSlotAhead - Cfg::kLead + 1, "slot ring too small for the lead and prefetch");
  const uint16_t* layer_rows;
  const int32_t* slots;
  const int32_t* slot_ring;
  uint32_t slot_ring_smem, kv_smem;
  int64_t num_slots;
  int valid, tile_end, my_row;
  bool prefetcher;  // whether this thread's row of a tile is this block's to prefetch (see prefetch_kv_row)

  __device__ __forceinline__ void request_slots(int t) const {
    if (threadIdx.x < Cfg::kTile && t < tile_end) {
      const int pos = t * Cfg::kTile + static_cast<int>(threadIdx.x);
      const bool ok = pos < valid;
      cp_async_4(slot_ring_smem + ((t & (Cfg::kSlotRing - 1)) * Cfg::kTile + threadIdx.x) * 4, slots + (ok ? pos : 0),
                 ok ? 4 : 0);
    }
  }

  __device__ __forceinline__ void start(int tile_begin) const {
    constexpr int kLead = Cfg::kLead, kFirst = kLead + Cfg::kPrefetch;
    int32_t raw[kFirst];
    bool ok[kFirst];
#pragma unroll
    for (int st = 0; st < kFirst; ++st) {
      const int pos = (tile_begin + st) * Cfg::kTile + my_row;
      ok[st] = tile_begin + st < tile_end && pos < valid;
      raw[st] = ok[st] ? __ldg(slots + pos) : 0;
    }
#pragma unroll
    for (int st = kLead; st < Cfg::kSlotAhead; ++st) request_slots(tile_begin + st);
#pragma unroll
    for (int st = 0; st < kLead; ++st) {
      if (tile_begin + st < tile_end) {
        load_kv_tile<Cfg::kThreadsPerRow, Cfg::kChunksPerThread>(num_slots, layer_rows, raw[st], ok[st],
                                                                 kv_smem + st * Cfg::kStageBytes);
      }
      cp_async_commit();
    }
#pragma unroll
    for (int st = kLead; st < kFirst; ++st) {
      prefetch_kv_row<Cfg::kThreadsPerRow>(num_slots, layer_rows, raw[st], ok[st] && prefetcher);
    }
  }

  __device__ __forceinline__ KvRefill begin_refill(int tile, uint32_t write_off) const {
    constexpr int kTile = Cfg::kTile;
    const int t_copy = tile + Cfg::kLead, t_fetch = tile + Cfg::kLead + Cfg::kPrefetch;
    // Ring entries of tiles past the split's end hold stale slots: read, never used.
    const int32_t copy_raw = slot_ring[(t_copy & (Cfg::kSlotRing - 1)) * kTile + my_row];
    const int32_t fetch_raw = slot_ring[(t_fetch & (Cfg::kSlotRing - 1)) * kTile + my_row];
    return KvRefill{plan_kv_copy<Cfg::kThreadsPerRow>(num_slots, layer_rows, copy_raw, t_copy * kTile + my_row < valid,
                                                      kv_smem + write_off),
                    t_copy < tile_end, fetch_raw, prefetcher && t_fetch < tile_end && t_fetch * kTile + my_row < valid};
  }

  __device__ __forceinline__ void finish_refill(const KvRefill& r, int tile, uint32_t& read_off,
                                                uint32_t& write_off) const {
    prefetch_kv_row<Cfg::kThreadsPerRow>(num_slots, layer_rows, r.fetch_raw, r.fetch_ok);
    request_slots(tile + Cfg::kSlotAhead);
    cp_async_commit();
    read_off = read_off + Cfg::kStageBytes == Cfg::kKvBytes ? 0 : read_off + Cfg::kStageBytes;
    write_off = write_off + Cfg::kStageBytes == Cfg::kKvBytes ? 0 : write_off + Cfg::kStageBytes;
  }
};

// The pipeline of block (split, b) over `range`, its slot ring at byte `slot_off` of shared memory.  Whether a
// thread's row is this block's to prefetch (row % row tiles == this row tile) is loop-invariant: decided here.
template <class Cfg>
__device__ __forceinline__ KvPipeline<Cfg> make_kv_pipeline(const Params& p, int b, const SplitTiles& range,
                                                             const unsigned char* smem, uint32_t kv_smem, int slot_off) {
  const int my_row = static_cast<int>(threadIdx.x) / Cfg::kThreadsPerRow;
  return KvPipeline<Cfg>{layer_rows_of(p), slot_table_of(p, b), reinterpret_cast<const int32_t*>(smem + slot_off),
                         kv_smem + static_cast<uint32_t>(slot_off), kv_smem, p.num_slots, range.valid, range.tile_end,
                         my_row, my_row % static_cast<int>(gridDim.x) == static_cast<int>(blockIdx.x)};
}

// Partial scores of 32 query rows (two m16 tiles) x 16 positions over one 144-dim slice: K fragments by ldmatrix
// from k_addr, and the next tile's copy chunks issued one per k-step between the MMAs (issued back to back they
// filled the load/store queue and the ldmatrix loads behind them waited: ncu, 2026-11-30).
template <int kThreadsPerRow>
__device__ __forceinline__ void score_slice(uint32_t k_addr, const uint32_t (&qf)[2][kKSteps][4], const KvRefill& refill,
                                            float (&s)[2][2][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) s[mt][nb][0] = s[mt][nb][1] = s[mt][nb][2] = s[mt][nb][3] = 0.f;
  for_each_index([&](auto step) {
    constexpr int ks = decltype(step)::value;
    uint32_t kb[4];
    ldmatrix_x4(k_addr + ks * 32, kb);
    if (refill.do_copy) issue_kv_chunk<kThreadsPerRow, ks>(refill.copy);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      mma_bf16(s[mt][0], qf[mt][ks], kb[0], kb[1]);
      mma_bf16(s[mt][1], qf[mt][ks], kb[2], kb[3]);
    }
  }, std::make_integer_sequence<int, kKSteps>{});
}

// Stores score_slice's partial scores: rows 16 mt + g (+ 8), columns col0 + 8 nb + 2 qd (+ 1) of my_part.
template <int kPartStride>
__device__ __forceinline__ void store_partials(float* my_part, int col0, int g, int qd, const float (&s)[2][2][4]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      const int col = col0 + nb * 8 + 2 * qd;
      *reinterpret_cast<float2*>(my_part + (mt * 16 + g) * kPartStride + col) = make_float2(s[mt][nb][0], s[mt][nb][1]);
      *reinterpret_cast<float2*>(my_part + (mt * 16 + g + 8) * kPartStride + col) = make_float2(s[mt][nb][2], s[mt][nb][3]);
    }
}

// Four scores of one row at positions tile_pos + pp .. + 3, summed over the four dim slices' partial scores
// (rows kPartStride floats apart, slices kRowsPerSlice rows apart) and scaled to base 2; then -inf where the tree
// mask or the valid length hides a position.  Only tiles that reach the query tokens or the end need the mask:
// the query indices of a tile (<= 32 positions) span at most two mask words, loaded together.
template <int kTile, int kPartStride, int kRowsPerSlice>
__device__ __forceinline__ void row_scores(const Params& p, const float* part, const uint32_t* mask_r, int row,
                                           int tile_pos, int pp, int first, int valid, float (&x)[4]) {
  x[0] = x[1] = x[2] = x[3] = 0.f;
#pragma unroll
  for (int sl = 0; sl < kWarps; ++sl) {
    const float4 t = *reinterpret_cast<const float4*>(part + (sl * kRowsPerSlice + row) * kPartStride + pp);
    x[0] += t.x; x[1] += t.y; x[2] += t.z; x[3] += t.w;
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] *= p.scale_log2;
  if (tile_pos + kTile > min(first, valid)) {
    const int j0 = tile_pos - first;
    const int w0 = max(j0, 0) >> 5;
    const uint32_t lo = w0 < p.mask_words ? __ldg(mask_r + w0) : 0u;
    const uint32_t hi = w0 + 1 < p.mask_words ? __ldg(mask_r + w0 + 1) : 0u;
    const uint64_t bits = (static_cast<uint64_t>(hi) << 32) | lo;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int pos = tile_pos + pp + i;
      const int j = pos - first;
      // j < T whenever pos < valid (valid <= kv_len = first + T); bit j - 32*w0 is in [0, 63).
      const bool visible = pos < valid && (j < 0 || ((bits >> (j - 32 * w0)) & 1u));
      if (!visible) x[i] = -INFINITY;
    }
  }
}

// Online softmax of one row whose tile positions are spread over kLanes adjacent lanes (4 each): updates the
// row's running max (base 2) and this lane's share of the denominator, turns x into probabilities, and returns
// the factor by which the row's output must be rescaled.
template <int kLanes>
__device__ __forceinline__ float online_softmax(float (&x)[4], float& m_run, float& l_run) {
  float tile_max = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
#pragma unroll
  for (int o = 1; o < kLanes; o *= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
  const float new_max = fmaxf(m_run, tile_max);
  // A row that has seen nothing yet keeps max -inf; subtract 0 then so that exp2(-inf) = 0, not NaN.
  const float base = new_max == -INFINITY ? 0.f : new_max;
  const float sc = fast_exp2(m_run - base);
  m_run = new_max;
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = fast_exp2(x[i] - base);
  l_run = l_run * sc + ((x[0] + x[1]) + (x[2] + x[3]));
  return sc;
}

// The epilogue of the 32-row kernels: rows row0 + 16 mt + g (+ 8) of the accumulators, output columns col0 +
// 8 nb + 2 qd (+ 1), normalised by the row sums in stat_s ([max (base 2) | sum] per row), as final rows or per-split
// partials; `writes_lse`: this thread also writes the rows' lse.
template <bool kDirect, int kBlocks>
__device__ __forceinline__ void write_rows(const Params& p, const float (&acc)[2][kBlocks][4], const float* stat_s,
                                           int row0, int b, int split, int col0, int g, int qd, bool writes_lse) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rl = mt * 16 + g + 8 * h, r = row0 + rl;
      if (r >= p.rows) continue;
      const float sum = stat_s[32 + rl];
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const float lse_row = sum > 0.f ? (stat_s[rl] + log2f(sum)) * kLn2 : -INFINITY;
      const int64_t row_index = kDirect ? static_cast<int64_t>(b) * p.rows + r
                                        : (static_cast<int64_t>(b) * p.num_splits + split) * p.rows + r;
      if (kDirect) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(p.out + row_index * kLatent + col0 + 2 * qd);
#pragma unroll
        for (int nb = 0; nb < kBlocks; ++nb) dst[nb * 4] = pack_bf16(acc[mt][nb][2 * h] * inv, acc[mt][nb][2 * h + 1] * inv);
        if (writes_lse) p.lse[row_index] = lse_row;
      } else {
        float2* dst = reinterpret_cast<float2*>(p.out_part + row_index * kLatent + col0 + 2 * qd);
#pragma unroll
        for (int nb = 0; nb < kBlocks; ++nb) dst[nb * 4] = make_float2(acc[mt][nb][2 * h] * inv, acc[mt][nb][2 * h + 1] * inv);
        if (writes_lse) p.lse_part[row_index] = lse_row;
      }
    }
  }
}

template <bool kDirect, int kGroups>
__global__ void __launch_bounds__(Config<kGroups>::kThreads, Config<kGroups>::kMinBlocksPerSm)
verify_attention_kernel(const Params p) {
  using C = Config<kGroups>;
  constexpr int kTile = C::kTile, kSub = C::kSub, kBlocksN = C::kBlocksN, kScoreStride = C::kScoreStride;
  stamp_block(p, 0);
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
  stamp_block(p, 1);
}

// ---------------------------------------------------------------------------------------------------------
// The decode kernel (T*H <= 8: T = 1 with up to 8 heads a device): scores transposed, S^T = K·Q^T, so that a
// tile's 16 positions are the MMA's M and the (at most 8) query rows its N. The one-group kernel puts the rows on
// M: half of each m16 tile is padding at 8 rows, every warp holds a 144-dim slice of the scores, the slices meet in
// shared memory behind two block barriers a tile, and all four warps repeat the softmax (524 SASS instructions per
// warp and tile, H200 block timelines at be75f7b: ~0.64 us per tile and SM with two blocks, the rate the B = 8 rows
// stream at). Here each warp streams its own tiles (tile_begin + warp, + kWarps, ...) with nothing shared in the
// loop: Q·Kᵀ is 36 MMAs (K by ldmatrix as the A operand, Q^T's B fragments from shared memory), the softmax runs on
// the warp's own 16 x 8 scores (a row's 16 positions are 8 lanes x 2), P goes through a 384-byte buffer of the
// warp to become P·V's B operand, and O^T += V^T·P^T is 32 MMAs (V^T by transposed ldmatrix): O^T, 512 dims x 8
// rows, is 128 accumulators a lane. Copies: one stage a warp (a 16-row tile, 18,688 B), refilled once the warp
// has read it, the tile after that prefetched into L2 so that the refill is an L2 round trip; four warps a block,
// two blocks an SM on an H200 (85,632 B of shared memory a block, within sm_120's 99 KB for one). At the end the
// warps meet once: each writes (max, sum, O^T) into its own stage, and the block combines the four.
// Opt-in (KDTREE_VERIFY_DECODE=1): correct (GPU tests and compute-sanitizer at 0de4c51), but 1.5x slower than the
// one-group kernel on an H200 (64k, B = 1: 50.3 vs 33.5 us a call; B = 8: 296 vs 181 us). Fewer instructions a
// tile do not help when an SM holds 8 warps (241 registers a thread), two a scheduler, and each waits for its
// single stage to be refilled after every tile: a warp's copy and compute never overlap (~9.4 us a tile a warp at
// B = 8; the L2 prefetch distance, 3 or 1 tiles, changed it by < 5%: benchmarks/results/verify_kernel_decode_ab_h200.md).
struct DecodeConfig {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kTile = 16;
  static constexpr int kRows = 8;                           // query rows (the MMA's N)
  static constexpr int kStageBytes = kTile * kRowBytes;     // 18,688: one warp's tile
  static constexpr int kQOff = kWarps * kStageBytes;        // Q: kRows rows of 576, padded like the KV rows
  static constexpr int kPStride = 48;                       // bytes a P row (16 bf16 + 16): conflict-free ldmatrix
  static constexpr int kPOff = kQOff + kRows * kRowBytes;   // P: per warp kRows x 16 bf16
  static constexpr int kPBytes = kRows * kPStride;
  static constexpr int kSmemBytes = kPOff + kWarps * kPBytes;  // 85,632
  static constexpr int kOStride = kLatent + 4;              // floats a row of a warp's O in the epilogue
  static_assert(kRows * kOStride * 4 + 2 * kRows * 4 <= kStageBytes, "a warp's O, max and sum fit its stage");
  static_assert(kSmemBytes <= 99 * 1024, "shared memory must fit sm_120's 99 KB per block");
};

// This lane's share of a decode tile: row lane / 2 of the 16, bytes [16 (lane % 2) + 32 c] for c < 36.
__device__ __forceinline__ void decode_copy_tile(int64_t num_slots, const uint16_t* layer_rows, int32_t raw, bool ok,
                                                 uint32_t stage, int lane) {
  const char* src = reinterpret_cast<const char*>(layer_rows + clamp_slot(raw, num_slots) * kWidth) + (lane % 2) * 16;
  copy_row_chunks<2>(stage + (lane / 2) * kRowBytes + (lane % 2) * 16, src, ok ? 16 : 0,
                     std::make_integer_sequence<int, kChunksPerRow / 2>{});
}
// ... and its share of the tile's 9 lines of 128 bytes a row into L2 (lines 0-4 or 5-8 of row lane / 2).
__device__ __forceinline__ void decode_prefetch_tile(int64_t num_slots, const uint16_t* layer_rows, int32_t raw,
                                                     bool ok, int lane) {
  if (!ok) return;
  const char* row = reinterpret_cast<const char*>(layer_rows + clamp_slot(raw, num_slots) * kWidth);
  for (int line = (lane % 2) * 5; line < ((lane % 2) ? 9 : 5); ++line) prefetch_l2(row + line * 128);
}

template <bool kDirect>
__global__ void __launch_bounds__(DecodeConfig::kThreads, 2) verify_attention_decode_kernel(const Params p) {
  using C = DecodeConfig;
  stamp_block(p, 0);
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t smem_base = smem_addr(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, qd = lane % 4;  // MMA fragment coordinates
  const int split = blockIdx.y, b = blockIdx.z;
  const SplitTiles range = split_tiles<C::kTile>(p, b, split);
  const int valid = range.valid, first = range.first, tile_end = range.tile_end;
  const uint16_t* layer_rows = layer_rows_of(p);
  const int32_t* slots = slot_table_of(p, b);
  const uint32_t stage = smem_base + warp * C::kStageBytes;
  const uint32_t q_smem = smem_base + C::kQOff;
  const uint32_t p_smem = smem_base + C::kPOff + warp * C::kPBytes;

  // Q rows (zeros past the last row), this warp's first tile and the slots of the next three, one round trip.
  for (int c = threadIdx.x; c < C::kRows * kChunksPerRow; c += C::kThreads) {
    const int r = c / kChunksPerRow, chunk = c % kChunksPerRow;
    const bool ok = r < p.rows;
    const uint16_t* src = p.q + (static_cast<int64_t>(b) * p.rows + (ok ? r : 0)) * kWidth + chunk * 8;
    cp_async_16_at<0>(q_smem + r * kRowBytes + chunk * 16, reinterpret_cast<const char*>(src), ok ? 16 : 0);
  }
  auto tile_of = [&](int i) { return range.tile_begin + warp + i * C::kWarps; };  // this warp's i-th tile
  auto slot_ok = [&](int t) { return t < tile_end && t * C::kTile + lane / 2 < valid; };
  auto load_slot = [&](int t) { return slot_ok(t) ? __ldg(slots + t * C::kTile + lane / 2) : 0; };
  // One tile of L2 prefetch ahead of the copy: with a stream per warp (1,056 on an H200) two or three tiles ahead
  // put 40-60 MB of prefetched rows in flight, as much as the L2 holds (0de4c51: 3 ahead, 2 TB/s).
  int32_t raw_next = load_slot(tile_of(1)), raw_after = load_slot(tile_of(2));
  if (tile_of(0) < tile_end) decode_copy_tile(p.num_slots, layer_rows, load_slot(tile_of(0)), slot_ok(tile_of(0)), stage, lane);
  cp_async_commit();
  decode_prefetch_tile(p.num_slots, layer_rows, raw_next, slot_ok(tile_of(1)), lane);
  cp_async_wait<0>();
  __syncthreads();  // Q, copied by every thread, is read by every warp

  // Tree-mask rows of this lane's two query rows 2qd, 2qd + 1 (clamped: rows past the end are computed, not stored).
  const uint32_t* mask_r[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int tq = min(2 * qd + h, p.rows - 1) / p.num_heads;
    mask_r[h] = p.tree_mask + (static_cast<int64_t>(b) * p.num_queries + tq) * p.mask_words;
  }
  float acc[kLatent / 16][4];  // O^T: m16 tile i = dims 16i .. 16i + 15; c0, c1 rows 2qd, 2qd + 1 of dim 16i + g
#pragma unroll
  for (int i = 0; i < kLatent / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // base 2, rows 2qd and 2qd + 1
  float row_sum[2] = {0.f, 0.f};              // this lane's positions' share

  // ldmatrix lane addresses. K as A (16 positions x 16 dims): matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15).
  const uint32_t k_lane = stage + ((lane % 8) + ((lane / 8) % 2) * 8) * kRowBytes + (lane / 16) * 16;
  // Q^T as B for two k-steps: matrix m = dims 8m .. 8m + 7 of query rows 0-7.
  const uint32_t q_lane = q_smem + (lane % 8) * kRowBytes + (lane / 8) * 16;
  // V^T as A (16 dims x 16 positions), transposed: matrix m = positions 8 (m / 2) .. + 7, dims 8 (m % 2) .. + 7.
  const uint32_t v_lane = stage + ((lane % 8) + (lane / 16) * 8) * kRowBytes + ((lane / 8) % 2) * 16;
  // P^T as B: matrix m = positions 8m .. 8m + 7 of query rows 0-7 (lanes 0-15 give the addresses).
  const uint32_t pb_lane = p_smem + (lane % 8) * C::kPStride + ((lane / 8) % 2) * 16;

  for (int i = 0;; ++i) {
    const int tile = tile_of(i);
    if (tile >= tile_end) break;
    cp_async_wait<0>();
    __syncwarp();  // every lane's copies of this tile have landed
    // S^T = K·Q^T over 576 dims: four accumulators (k-steps mod 4) so that no chain is longer than 9 MMAs.
    float s4[4][4];
#pragma unroll
    for (int c = 0; c < 4; ++c) s4[c][0] = s4[c][1] = s4[c][2] = s4[c][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kWidth / 16; ks += 2) {
      uint32_t qb[4], ka[4], kb[4];
      ldmatrix_x4(q_lane + ks * 32, qb);
      ldmatrix_x4(k_lane + ks * 32, ka);
      ldmatrix_x4(k_lane + (ks + 1) * 32, kb);
      mma_bf16(s4[ks % 4], ka, qb[0], qb[1]);
      mma_bf16(s4[(ks + 1) % 4], kb, qb[2], qb[3]);
    }
    // c0, c1: position g, rows 2qd, 2qd + 1; c2, c3: position g + 8.
    float s[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) s[e] = (s4[0][e] + s4[1][e] + s4[2][e] + s4[3][e]) * p.scale_log2;
    const int tile_pos = tile * C::kTile;
    if (tile_pos + C::kTile > min(first, valid)) {  // the same rule as the other kernels, per (position, row)
      const int j0 = tile_pos - first, w0 = max(j0, 0) >> 5;
      uint64_t bits[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t lo = w0 < p.mask_words ? __ldg(mask_r[h] + w0) : 0u;
        const uint32_t hi = w0 + 1 < p.mask_words ? __ldg(mask_r[h] + w0 + 1) : 0u;
        bits[h] = (static_cast<uint64_t>(hi) << 32) | lo;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int pos = tile_pos + g + (e / 2) * 8, j = pos - first;
        const bool visible = pos < valid && (j < 0 || ((bits[e % 2] >> (j - 32 * w0)) & 1u));
        if (!visible) s[e] = -INFINITY;
      }
    }
    // Online softmax of rows 2qd (s[0], s[2]) and 2qd + 1 (s[1], s[3]); a row's 16 positions are the 8 lanes of
    // this qd, two each.
    float scale[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = fmaxf(s[h], s[h + 2]);
#pragma unroll
      for (int o = 4; o < 32; o *= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, o));
      const float new_max = fmaxf(row_max[h], tile_max);
      const float base = new_max == -INFINITY ? 0.f : new_max;  // exp2(-inf - 0) = 0, not NaN
      scale[h] = fast_exp2(row_max[h] - base);
      row_max[h] = new_max;
      s[h] = fast_exp2(s[h] - base);
      s[h + 2] = fast_exp2(s[h + 2] - base);
      row_sum[h] = row_sum[h] * scale[h] + s[h] + s[h + 2];
    }
    if (__any_sync(0xffffffffu, scale[0] != 1.f || scale[1] != 1.f)) {
#pragma unroll
      for (int t = 0; t < kLatent / 16; ++t) {
        acc[t][0] *= scale[0]; acc[t][1] *= scale[1]; acc[t][2] *= scale[0]; acc[t][3] *= scale[1];
      }
    }
    // P (bf16) into the warp's buffer as [row][position], read back as P^T's B fragments.
    {
      unsigned char* pbuf = smem + C::kPOff + warp * C::kPBytes;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 2 * qd + e % 2, pos = g + (e / 2) * 8;
        const uint32_t bits = pack_bf16(s[e], 0.f);
        *reinterpret_cast<uint16_t*>(pbuf + row * C::kPStride + pos * 2) = static_cast<uint16_t>(bits & 0xffffu);
      }
    }
    __syncwarp();
    uint32_t pb0, pb1;
    ldmatrix_x2(pb_lane, pb0, pb1);
    // O^T += V^T·P^T: one k16 step (the tile's 16 positions) for each of the 32 m16 tiles of dims.
#pragma unroll
    for (int t = 0; t < kLatent / 16; ++t) {
      uint32_t va[4];
      ldmatrix_x4_trans(v_lane + t * 32, va);
      mma_bf16(acc[t], va, pb0, pb1);
    }
    __syncwarp();  // every lane is done with the stage and the P buffer
    const int next = tile_of(i + 1);
    if (next < tile_end) decode_copy_tile(p.num_slots, layer_rows, raw_next, slot_ok(next), stage, lane);
    cp_async_commit();
    decode_prefetch_tile(p.num_slots, layer_rows, raw_after, slot_ok(tile_of(i + 2)), lane);
    raw_next = raw_after;
    raw_after = load_slot(tile_of(i + 3));  // its latency hides behind the next tile's compute
  }
  cp_async_wait<0>();

  // Each warp's rows: the sums over the 8 lanes of a qd; then (max, sum, O^T) into the warp's own stage.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int o = 4; o < 32; o *= 2) row_sum[h] += __shfl_xor_sync(0xffffffffu, row_sum[h], o);
  }
  __syncwarp();
  float* o_warp = reinterpret_cast<float*>(smem + warp * C::kStageBytes);  // [row][kOStride], then max[8], sum[8]
  float* stat = o_warp + C::kRows * C::kOStride;
#pragma unroll
  for (int t = 0; t < kLatent / 16; ++t) {
    const int d = t * 16 + g;
    o_warp[(2 * qd) * C::kOStride + d] = acc[t][0];
    o_warp[(2 * qd + 1) * C::kOStride + d] = acc[t][1];
    o_warp[(2 * qd) * C::kOStride + d + 8] = acc[t][2];
    o_warp[(2 * qd + 1) * C::kOStride + d + 8] = acc[t][3];
  }
  if (g == 0) {
    stat[2 * qd] = row_max[0]; stat[2 * qd + 1] = row_max[1];
    stat[C::kRows + 2 * qd] = row_sum[0]; stat[C::kRows + 2 * qd + 1] = row_sum[1];
  }
  __syncthreads();
  // The block's rows: thread t combines row t / 16, columns 32 (t % 16) .. + 31, over the four warps.
  const int row = threadIdx.x / 16, col0 = (threadIdx.x % 16) * 32;
  if (row >= p.rows) {
    stamp_block(p, 1);
    return;
  }
  float m_w[C::kWarps], w_w[C::kWarps], m = -INFINITY, total = 0.f;
#pragma unroll
  for (int w = 0; w < C::kWarps; ++w) {
    const float* st = reinterpret_cast<const float*>(smem + w * C::kStageBytes) + C::kRows * C::kOStride;
    m_w[w] = st[row];
    m = fmaxf(m, m_w[w]);
  }
#pragma unroll
  for (int w = 0; w < C::kWarps; ++w) {
    const float* st = reinterpret_cast<const float*>(smem + w * C::kStageBytes) + C::kRows * C::kOStride;
    w_w[w] = m == -INFINITY ? 0.f : fast_exp2(m_w[w] - m);
    total += w_w[w] * st[C::kRows + row];
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const int64_t row_index = kDirect ? static_cast<int64_t>(b) * p.rows + row
                                    : (static_cast<int64_t>(b) * p.num_splits + split) * p.rows + row;
#pragma unroll
  for (int c = 0; c < 32; c += 4) {
    float v[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < C::kWarps; ++w) {
      const float4 o = *reinterpret_cast<const float4*>(
          reinterpret_cast<const float*>(smem + w * C::kStageBytes) + row * C::kOStride + col0 + c);
      v[0] += w_w[w] * o.x; v[1] += w_w[w] * o.y; v[2] += w_w[w] * o.z; v[3] += w_w[w] * o.w;
    }
    if (kDirect) {
      uint2 packed;
      packed.x = pack_bf16(v[0] * inv, v[1] * inv);
      packed.y = pack_bf16(v[2] * inv, v[3] * inv);
      *reinterpret_cast<uint2*>(p.out + row_index * kLatent + col0 + c) = packed;
    } else {
      *reinterpret_cast<float4*>(p.out_part + row_index * kLatent + col0 + c) =
          make_float4(v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv);
    }
  }
  if (col0 == 0) {
    const float lse = total > 0.f ? (m + log2f(total)) * kLn2 : -INFINITY;
    (kDirect ? p.lse : p.lse_part)[row_index] = lse;
  }
  stamp_block(p, 1);
}

// ---------------------------------------------------------------------------------------------------------
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
  stamp_block(p, 0);
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

  const SplitTiles range = split_tiles<kTile>(p, b, split);
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
  write_rows<kDirect>(p, acc, stat_s, row0, b, split, warp * 64, g, qd, warp == 0 && qd == 0);
  stamp_block(p, 1);
}

// ---------------------------------------------------------------------------------------------------------
// The warp-specialised kernel (T*H > 16; opt-in, KDTREE_VERIFY_VARIANT=2): 32 query rows per block and 8 warps in
// two roles that work on different KV tiles at the same time, so that one role's waits (the softmax's shared-memory
// round trips and shuffles, its barriers, the copies) hide behind the other role's MMAs.  The wide kernel runs
// Q·Kᵀ, softmax and P·V one after the other on every warp between block-wide barriers (ncu, 2026-11-30: 0.30
// instructions issued per cycle and scheduler; a 32-position tile took ~2,870 cycles for ~830 of MMA issue).
//   * Score warps 0-3 (one per scheduler): Q·Kᵀ of tile i over dim slice w (144 dims; Q fragments of both m16
//     tiles in registers) for the tile's 16 positions, the four slices' partial scores summed through shared
//     memory, then the softmax of tile i (thread t: row t / 4, positions 4 (t % 4) .. + 3), writing P (bf16) and
//     each row's rescale factor into one of two buffers.  They also run the copy pipeline: a 4-stage ring of
//     16-position tiles, tile i + 2 copied while tile i is computed (one chunk per k-step, as in the wide
//     kernel), slots through the slot ring, L2 prefetch.
//   * Value warps 4-7: O += P·V of tile i over output dims [128 (w - 4), + 128) of all 32 rows (128 fp32
//     accumulators a thread), one tile behind the score warps.
// Hand-offs are named barriers, each with at most one phase outstanding: the score warps arrive on "P full" of
// buffer i % 2 when P(i) is written; the value warps arrive on "P empty" of that buffer and "stage empty" (two ids
// by tile parity) when P·V(i) is done, and the score warps wait for those before they overwrite P (at tile i + 2)
// or refill the stage (with tile i + 4, at tile i + 2).  Arrivals and waits are matched one for one, including at
// the end of a split.  Shared memory 91,136 B.
struct WsConfig {
  static constexpr int kThreads = 256, kRowsW = 32, kScoreThreads = 128;
  static constexpr int kTile = 16, kRing = 4, kLead = 2;  // tile i + 2 is copied while tile i is computed
  static constexpr int kThreadsPerRow = kScoreThreads / kTile;             // 8
  static constexpr int kChunksPerThread = kChunksPerRow / kThreadsPerRow;  // 9
  static constexpr int kPrefetch = 4;
  static constexpr int kSlotAhead = 2 * kLead + kPrefetch;
  static constexpr int kSlotRing = 8;
  static constexpr int kStageBytes = kTile * kRowBytes;
  static constexpr int kKvBytes = kRing * kStageBytes;                  // 74,752
  static constexpr int kPartStride = kTile + 8;                         // floats per row of a slice's partial scores
  static constexpr int kPartBytes = kWarps * kRowsW * kPartStride * 4;  // 12,288
  static constexpr int kPStride = kTile + 8;                            // bf16 per row of P (48 B: ldmatrix conflict-free)
  static constexpr int kPBufBytes = kRowsW * kPStride * 2;              // 1,536 per buffer, two buffers
  static constexpr int kScaleBytes = 2 * kRowsW * 4;                    // rescale factor per row, per buffer
  static constexpr int kStatBytes = 2 * kRowsW * 4;                     // final max and sum per row
  static constexpr int kSlotBytes = kSlotRing * kTile * 4;
  static constexpr int kPartOff = kKvBytes, kPOff = kPartOff + kPartBytes, kScaleOff = kPOff + 2 * kPBufBytes;
  static constexpr int kStatOff = kScaleOff + kScaleBytes, kSlotOff = kStatOff + kStatBytes;
  static constexpr int kSmemBytes = kSlotOff + kSlotBytes;              // 91,136 B
  static_assert(kSmemBytes <= 99 * 1024, "shared memory must fit sm_120's 99 KB per block");
  static_assert(kPOff % 16 == 0 && kSlotOff % 16 == 0, "alignment");
  static_assert(kChunksPerThread == kKSteps, "one copy chunk per k-step");
  // Named barrier ids (0 is __syncthreads).
  static constexpr int kBarScoreLanded = 1, kBarScorePart = 2, kBarPFull = 3, kBarPEmpty = 5, kBarStageEmpty = 7;
};

__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <bool kDirect>
__global__ void __launch_bounds__(WsConfig::kThreads, 1) verify_attention_ws_kernel(const Params p) {
  using S = WsConfig;
  constexpr int kTile = S::kTile, kAll = S::kThreads, kScorers = S::kScoreThreads;
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t kv_smem = smem_addr(smem);
  float* part = reinterpret_cast<float*>(smem + S::kPartOff);      // [slice][row][kPartStride]
  uint16_t* pbuf = reinterpret_cast<uint16_t*>(smem + S::kPOff);   // [buffer][row][kPStride] bf16
  const uint32_t p_smem = kv_smem + S::kPOff;
  float* scale_s = reinterpret_cast<float*>(smem + S::kScaleOff);  // [buffer][row]
  float* stat_s = reinterpret_cast<float*>(smem + S::kStatOff);    // [2][row]: max (base 2), sum

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, qd = lane % 4, mat = lane / 8;
  const bool scorer = warp < kWarps;
  const int split = blockIdx.y, b = blockIdx.z;
  const int row0 = blockIdx.x * S::kRowsW;

  const SplitTiles range = split_tiles<kTile>(p, b, split);
  const int valid = range.valid, first = range.first, tile_begin = range.tile_begin, tile_end = range.tile_end;
  const int n = tile_end - tile_begin;

  if (scorer) {
    const int ds = warp;  // dim slice
    uint32_t qf[2][kKSteps][4];
    load_q_fragments(p, b, row0, ds, g, qd, qf[0]);
    load_q_fragments(p, b, row0 + 16, ds, g, qd, qf[1]);
    const KvPipeline<S> kv = make_kv_pipeline<S>(p, b, range, smem, kv_smem, S::kSlotOff);
    kv.start(tile_begin);

    // Softmax role: row rr of the block (4 threads a row), positions pp .. pp + 3 of each tile.
    const int rr = threadIdx.x / 4, pp = (threadIdx.x % 4) * 4;
    const uint32_t* mask_r = p.tree_mask + (static_cast<int64_t>(b) * p.num_queries + min(row0 + rr, p.rows - 1) / p.num_heads) * p.mask_words;
    float m_run = -INFINITY, l_run = 0.f;
    const uint32_t k_lane = ((lane % 8) + (mat / 2) * 8) * kRowBytes + (ds * kKSlice + (mat % 2) * 8) * 2;
    float* my_part = part + ds * S::kRowsW * S::kPartStride;

    uint32_t read_off = 0, write_off = S::kLead * S::kStageBytes;
    for (int i = 0; i < n; ++i) {
      const int tile = tile_begin + i;
      cp_async_wait<S::kLead - 1>();
      named_barrier_sync(S::kBarScoreLanded, kScorers);  // tile i landed (every score thread's copies)
      const uint32_t stage_base = kv_smem + read_off;
      // The stage refilled now (with tile i + 2) held tile i - 2: wait until the value warps are done with it.
      if (i >= S::kRing - S::kLead) named_barrier_sync(S::kBarStageEmpty + (i & 1), kAll);
      const KvRefill refill = kv.begin_refill(tile, write_off);
      float s[2][2][4];
      score_slice<S::kThreadsPerRow>(stage_base + k_lane, qf, refill, s);
      kv.finish_refill(refill, tile, read_off, write_off);
      store_partials<S::kPartStride>(my_part, 0, g, qd, s);
      named_barrier_sync(S::kBarScorePart, kScorers);  // partial scores written

      // Softmax of row rr, positions pp .. pp + 3 (as in the wide kernel, 4 threads a row).
      float x[4];
      row_scores<kTile, S::kPartStride, S::kRowsW>(p, part, mask_r, rr, tile * kTile, pp, first, valid, x);
      const float sc = online_softmax<4>(x, m_run, l_run);
      const int buf = i & 1;
      if (i >= 2) named_barrier_sync(S::kBarPEmpty + buf, kAll);  // the value warps are done with P(i - 2)
      *reinterpret_cast<uint2*>(pbuf + (buf * S::kRowsW + rr) * S::kPStride + pp) =
          make_uint2(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]));
      if (threadIdx.x % 4 == 0) scale_s[buf * S::kRowsW + rr] = sc;
      named_barrier_arrive(S::kBarPFull + buf, kAll);  // P(i) and its rescale factors are written
    }
    cp_async_wait<0>();
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    if (threadIdx.x % 4 == 0) {
      stat_s[rr] = m_run;
      stat_s[S::kRowsW + rr] = l_run;
    }
  }

  float acc[2][16][4];  // value warps: O rows 16 mt + g (+8), dims 128 vw + 8 nb + 2 qd (+1)
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nb = 0; nb < 16; ++nb) acc[mt][nb][0] = acc[mt][nb][1] = acc[mt][nb][2] = acc[mt][nb][3] = 0.f;
  const int vw = warp - kWarps;
  if (!scorer) {
    const uint32_t v_lane = ((lane % 8) + (mat % 2) * 8) * kRowBytes + (vw * 128 + (mat / 2) * 8) * 2;
    const uint32_t p_lane = p_smem + ((lane % 8) + (mat % 2) * 8) * (S::kPStride * 2) + (mat / 2) * 16;
    uint32_t read_off = 0;
    for (int i = 0; i < n; ++i) {
      const int buf = i & 1;
      named_barrier_sync(S::kBarPFull + buf, kAll);  // P(i) written; tile i landed before it
      const uint32_t stage_base = kv_smem + read_off;
      const float* f_s = scale_s + buf * S::kRowsW;
      const float f[2][2] = {{f_s[g], f_s[g + 8]}, {f_s[16 + g], f_s[24 + g]}};
      if (__any_sync(0xffffffffu, f[0][0] != 1.f || f[0][1] != 1.f || f[1][0] != 1.f || f[1][1] != 1.f)) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nb = 0; nb < 16; ++nb) {
            acc[mt][nb][0] *= f[mt][0]; acc[mt][nb][1] *= f[mt][0];
            acc[mt][nb][2] *= f[mt][1]; acc[mt][nb][3] *= f[mt][1];
          }
      }
      uint32_t pa[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(p_lane + buf * S::kPBufBytes + mt * 16 * (S::kPStride * 2), pa[mt]);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        uint32_t vb[4];
        ldmatrix_x4_trans(stage_base + v_lane + j * 32, vb);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_bf16(acc[mt][2 * j], pa[mt], vb[0], vb[1]);
          mma_bf16(acc[mt][2 * j + 1], pa[mt], vb[2], vb[3]);
        }
      }
      // Matched one for one with the score warps' waits at tile i + 2 (none past the split's end).
      if (i + 2 < n) {
        named_barrier_arrive(S::kBarPEmpty + buf, kAll);
        named_barrier_arrive(S::kBarStageEmpty + buf, kAll);
      }
      read_off = read_off + S::kStageBytes == S::kKvBytes ? 0 : read_off + S::kStageBytes;
    }
  }
  __syncthreads();  // the score warps' final max and sum
  if (!scorer) write_rows<kDirect>(p, acc, stat_s, row0, b, split, vw * 128, g, qd, vw == 0 && qd == 0);
}

// Merge the splits of one query row: weights exp(lse_s - max), out = sum w_s out_s / sum w_s.
// For more than 16 splits (few query rows: T*H <= 16 with B = 1 runs 256 splits): a 256-thread block per
// (row, column chunk); kLanesPerSplit lanes cover the chunk's columns of one split (4 floats each), so a block
// reads 256 / kLanesPerSplit splits per pass. Each thread keeps 8 16-byte loads in flight, and the first round is
// issued before the weights are known (every split writes its partial, empty ones zeros). The chunk is narrow
// when there are few rows: at T = 1, H = 8, B = 1 a (row, quarter) block had to read 128 KB (32 blocks for the
// whole GPU, 3.9 us at 64k, H200, 5353a84); 32-column chunks give 128 blocks of 32 KB, one round trip each.
constexpr int kMergeThreads = 256;
constexpr int kMergeWarps = kMergeThreads / 32;
constexpr int kMergeUnroll = 8;
constexpr int kMaxSplits = 1024;

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
  const int col = (chunk * kLanesPerSplit + vec) * 4;
  auto load_part = [&](int s) {
    return s < p.num_splits ? *reinterpret_cast<const float4*>(p.out_part + (part_row0 + static_cast<int64_t>(s) * p.rows) * kLatent + col)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
  };
  float4 v[kMergeUnroll];
#pragma unroll
  for (int u = 0; u < kMergeUnroll; ++u) v[u] = load_part(grp + u * kSplitsPerPass);  // round 0, in flight now

  float local_max = -INFINITY;
  for (int s = threadIdx.x; s < p.num_splits; s += kMergeThreads) {
    weight[s] = p.lse_part[part_row0 + static_cast<int64_t>(s) * p.rows];
    local_max = fmaxf(local_max, weight[s]);
  }
  const float m = block_reduce(local_max, scratch, true);
  float local_sum = 0.f;
  for (int s = threadIdx.x; s < p.num_splits; s += kMergeThreads) {
    weight[s] = m == -INFINITY ? 0.f : __expf(weight[s] - m);
    local_sum += weight[s];
  }
  const float total = block_reduce(local_sum, scratch, false);  // (its barrier also publishes weight[])

  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = grp;; ) {
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      const int s = s0 + u * kSplitsPerPass;
      const float w = s < p.num_splits ? weight[s] : 0.f;
      sum.x += w * v[u].x; sum.y += w * v[u].y; sum.z += w * v[u].z; sum.w += w * v[u].w;
    }
    s0 += kSplitsPerPass * kMergeUnroll;
    if (s0 >= p.num_splits) break;
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
void launch_block_merge(const Params& p, int64_t batch, cudaStream_t stream) {
  merge_splits_kernel<kLanesPerSplit><<<dim3(static_cast<unsigned>(p.rows * kMergeChunks<kLanesPerSplit>),
                                             static_cast<unsigned>(batch)), kMergeThreads, 0, stream>>>(p);
}

void launch_many_split_merge(const Params& p, int64_t batch, cudaStream_t stream) {
  const int64_t rows = batch * p.rows;  // at least ~2 blocks per SM of an H200: 16 / 8 / 4 chunks per row
  if (rows <= 16) {
    launch_block_merge<8>(p, batch, stream);
  } else if (rows <= 64) {
    launch_block_merge<16>(p, batch, stream);
  } else {
    launch_block_merge<32>(p, batch, stream);
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
  const int col = quarter * 128 + lane * 4;
  float4 v[kWarpMergeMaxSplits];
#pragma unroll
  for (int s = 0; s < kWarpMergeMaxSplits; ++s) {
    if (s < p.num_splits) v[s] = *reinterpret_cast<const float4*>(p.out_part + (part_row0 + static_cast<int64_t>(s) * p.rows) * kLatent + col);
  }
  const float lse_s = lane < p.num_splits ? p.lse_part[part_row0 + static_cast<int64_t>(lane) * p.rows] : -INFINITY;
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
    if (s < p.num_splits) {  // uniform over the warp
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

// Raise the dynamic shared-memory limit once per device (a host-side attribute, no stream work).
constexpr int kMaxDevices = 64;
std::once_flag smem_once[kMaxDevices];
cudaError_t smem_status[kMaxDevices];

template <bool kDirect, int kGroups>
cudaError_t set_kernel_attributes() {
  const void* fn = reinterpret_cast<const void*>(verify_attention_kernel<kDirect, kGroups>);
  cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, Config<kGroups>::kSmemBytes);
  // The largest shared-memory carveout, so that two one-group blocks share a multiprocessor where it has room.
  if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
  return err;
}

cudaError_t ensure_smem_limit(int device) {
  if (device < 0 || device >= kMaxDevices) return cudaErrorInvalidDevice;
  std::call_once(smem_once[device], [device] {
    cudaError_t err = set_kernel_attributes<true, 1>();
    if (err == cudaSuccess) err = set_kernel_attributes<false, 1>();
    if (err == cudaSuccess) err = set_kernel_attributes<true, 2>();
    if (err == cudaSuccess) err = set_kernel_attributes<false, 2>();
    const std::pair<const void*, int> many_row_kernels[] = {
        {reinterpret_cast<const void*>(verify_attention_wide_kernel<true>), WideConfig::kSmemBytes},
        {reinterpret_cast<const void*>(verify_attention_wide_kernel<false>), WideConfig::kSmemBytes},
        {reinterpret_cast<const void*>(verify_attention_ws_kernel<true>), WsConfig::kSmemBytes},
        {reinterpret_cast<const void*>(verify_attention_ws_kernel<false>), WsConfig::kSmemBytes},
        {reinterpret_cast<const void*>(verify_attention_decode_kernel<true>), DecodeConfig::kSmemBytes},
        {reinterpret_cast<const void*>(verify_attention_decode_kernel<false>), DecodeConfig::kSmemBytes}};
    for (const auto& [fn, bytes] : many_row_kernels) {
      if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    }
    // The merge runs right after the main kernel: the same carveout spares the multiprocessors a shared
    // memory / L1 reconfiguration (a drain) between the two launches.
    const void* merges[] = {reinterpret_cast<const void*>(merge_splits_kernel<8>),
                            reinterpret_cast<const void*>(merge_splits_kernel<16>),
                            reinterpret_cast<const void*>(merge_splits_kernel<32>),
                            reinterpret_cast<const void*>(merge_splits_warp_kernel)};
    for (const void* fn : merges) {
      if (err == cudaSuccess) err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    }
    smem_status[device] = err;
  });
  return smem_status[device];
}

// A main kernel: with one split its kDirect instance writes the result, else the other writes partials for the merge.
void launch_main(void (*direct)(Params), void (*split)(Params), const Params& p, dim3 grid, int threads, int smem,
                 cudaStream_t stream) {
  (p.num_splits == 1 ? direct : split)<<<grid, threads, smem, stream>>>(p);
}

// kGroups 1 or 2: verify_attention_kernel; kWideKernel / kWsKernel: the wide / warp-specialised kernel (32 rows
// per block, like two groups); kDecodeKernel: the decode kernel (at most 8 rows, one block per split).
constexpr int kWideKernel = 0, kWsKernel = 3, kDecodeKernel = 4;
template <int kGroups>
void launch(const Params& p, int64_t batch, cudaStream_t stream, bool main = true, bool merge = true) {
  constexpr int kRowsPerBlock = kGroups == kWideKernel || kGroups == kWsKernel ? 32
                                : kGroups == kDecodeKernel                  ? DecodeConfig::kRows
                                                                            : kGroups * kRows;
  const dim3 grid(static_cast<unsigned>((p.rows + kRowsPerBlock - 1) / kRowsPerBlock),
                  static_cast<unsigned>(p.num_splits), static_cast<unsigned>(batch));
  if (!main) {  // (bench_verify_attention: the merge alone)
  } else if constexpr (kGroups == kWideKernel) {
    launch_main(verify_attention_wide_kernel<true>, verify_attention_wide_kernel<false>, p, grid,
                WideConfig::kThreads, WideConfig::kSmemBytes, stream);
  } else if constexpr (kGroups == kWsKernel) {
    launch_main(verify_attention_ws_kernel<true>, verify_attention_ws_kernel<false>, p, grid, WsConfig::kThreads,
                WsConfig::kSmemBytes, stream);
  } else if constexpr (kGroups == kDecodeKernel) {
    launch_main(verify_attention_decode_kernel<true>, verify_attention_decode_kernel<false>, p, grid,
                DecodeConfig::kThreads, DecodeConfig::kSmemBytes, stream);
  } else {
    launch_main(verify_attention_kernel<true, kGroups>, verify_attention_kernel<false, kGroups>, p, grid,
                Config<kGroups>::kThreads, Config<kGroups>::kSmemBytes, stream);
  }
  if (merge && p.num_splits > kWarpMergeMaxSplits) {
    launch_many_split_merge(p, batch, stream);
  } else if (merge && p.num_splits > 1) {
    const int64_t items = batch * p.rows * kMergeQuarters;
    merge_splits_warp_kernel<<<static_cast<unsigned>((items + kWarpMergeWarps - 1) / kWarpMergeWarps),
                               kWarpMergeWarps * 32, 0, stream>>>(p, items);
  }
}

// variant: for more than 16 rows (row_groups 2) 0, 1 or 2 = the two-group, wide or warp-specialised kernel; for at
// most 8 rows (row_groups 1) kDecodeVariant = the decode kernel, anything else the one-group kernel.
constexpr int64_t kDecodeVariant = 3;
void launch_any(const Params& p, int64_t batch, cudaStream_t stream, int64_t row_groups, int64_t variant,
                bool main = true, bool merge = true) {
  if (row_groups == 1 && variant == kDecodeVariant && p.rows <= DecodeConfig::kRows) {
    launch<kDecodeKernel>(p, batch, stream, main, merge);
  } else if (row_groups == 1) {
    launch<1>(p, batch, stream, main, merge);
  } else if (variant == 1) {
    launch<kWideKernel>(p, batch, stream, main, merge);
  } else if (variant == 2) {
    launch<kWsKernel>(p, batch, stream, main, merge);
  } else {
    launch<2>(p, batch, stream, main, merge);
  }
}

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("verify_attention (CUDA): ") + what + ": " + cudaGetErrorString(err));
}

using Scalar32 = ffi::Buffer<ffi::S32, 0>;
using Slots = ffi::Buffer<ffi::S32, 2>;
using Lens = ffi::Buffer<ffi::S32, 1>;
using Mask = ffi::Buffer<ffi::U32, 3>;
using Lse = ffi::Buffer<ffi::F32, 3>;
using OutPart = ffi::Buffer<ffi::F32, 2>;
using LsePart = ffi::Buffer<ffi::F32, 1>;

ffi::Error VerifyAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer kv_pool, Scalar32 layer,
                               Slots kv_slots, Lens kv_lens, Mask tree_mask, float softmax_scale, int64_t rope_dim,
                               int64_t num_splits, int64_t row_groups, int64_t variant, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<Lse> lse,
                               ffi::Result<OutPart> out_part, ffi::Result<LsePart> lse_part) {
  const auto qd = q.dimensions();
  const auto pd = kv_pool.dimensions();
  if (q.element_type() != ffi::DataType::BF16 || kv_pool.element_type() != ffi::DataType::BF16 ||
      out->element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("verify_attention (CUDA): q, kv_pool and out must be bfloat16");
  }
  if (qd.size() != 4 || pd.size() != 3 || qd[3] != kWidth || pd[2] != kWidth || rope_dim != kRope) {
    return ffi::Error::InvalidArgument("verify_attention (CUDA): rows must be 576 wide with rope_dim 64");
  }
  const int64_t batch = qd[0], num_queries = qd[1], num_heads = qd[2];
  const int64_t rows = num_queries * num_heads;
  const int64_t max_len = kv_slots.dimensions()[1];
  if (num_splits < 1 || num_splits > kMaxSplits || (row_groups != 1 && row_groups != 2) || (variant < 0 || variant > 3) || batch > 65535 || rows * batch > (int64_t{1} << 31) ||
      rows > (int64_t{1} << 26) || pd[0] < 1 || pd[1] < 1 || tree_mask.dimensions()[2] * 32 < num_queries) {
    return ffi::Error::InvalidArgument("verify_attention (CUDA): unsupported sizes or num_splits");
  }
  if (num_splits > 1 && (out_part->element_count() < batch * num_splits * rows * kLatent ||
                         lse_part->element_count() < batch * num_splits * rows)) {
    return ffi::Error::InvalidArgument("verify_attention (CUDA): partial buffers too small for num_splits");
  }
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cuda_error("cudaGetDevice", err);
  if (cudaError_t err = ensure_smem_limit(device); err != cudaSuccess) return cuda_error("shared memory limit", err);

  Params p{};
  p.q = static_cast<const uint16_t*>(q.untyped_data());
  p.kv_pool = static_cast<const uint16_t*>(kv_pool.untyped_data());
  p.layer = layer.typed_data();
  p.kv_slots = kv_slots.typed_data();
  p.kv_lens = kv_lens.typed_data();
  p.tree_mask = tree_mask.typed_data();
  p.out = static_cast<uint16_t*>(out->untyped_data());
  p.lse = lse->typed_data();
  p.out_part = out_part->typed_data();
  p.lse_part = lse_part->typed_data();
  p.num_queries = static_cast<int>(num_queries);
  p.num_heads = static_cast<int>(num_heads);
  p.rows = static_cast<int>(rows);
  p.mask_words = static_cast<int>(tree_mask.dimensions()[2]);
  p.max_len = static_cast<int>(max_len);
  p.num_layers = static_cast<int>(pd[0]);
  p.num_slots = pd[1];
  p.num_splits = static_cast<int>(num_splits);
  p.scale_log2 = softmax_scale * kLog2e;
  if (rows == 0 || batch == 0) return ffi::Error::Success();

  launch_any(p, batch, stream, row_groups, variant);  // variant 1 with two groups: the wide kernel
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_error("kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// bench_verify_attention: the kernels timed with CUDA events outside XLA (a benchmark helper; never called by the
// op).  Random bf16 inputs (uniform in [-1, 1)), a causal tree mask, kv_lens = length, a pool of several layers
// (about 512 MB, at least 2) with consecutive calls on consecutive layers, as benchmarks/verify_kernel.py does.
namespace {
__global__ void fill_random_bf16(uint16_t* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) * 0x85EBCA77u ^ seed;
    h ^= h >> 15; h *= 0x2C1B3C6Du; h ^= h >> 12; h *= 0x297A2D39u; h ^= h >> 15;
    const float x = static_cast<float>(h >> 8) * (2.f / 16777216.f) - 1.f;
    p[i] = static_cast<uint16_t>(__float_as_uint(x) >> 16);
  }
}
}  // namespace

namespace kdtree {
namespace {
// One harness case on the device: random bf16 q and pool (several layers, about 512 MB, at least 2), the slot table
// (shuffled when `scattered`), kv_lens = length, a causal tree mask, the outputs and the split partials, and Params
// pointing at them (p.layer left for the caller: `layers` holds 0, 1, ...). `ok` is false when the sizes are out of
// range or an allocation or copy failed; the buffers are freed with the case.
struct BenchCase {
  Params p{};
  int64_t num_layers = 0;
  int32_t* layers = nullptr;
  bool ok = true;
  std::vector<void*> buffers;

  BenchCase(int64_t batch, int64_t num_queries, int64_t num_heads, int64_t length, int64_t num_splits,
            int64_t row_groups, bool scattered) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || ensure_smem_limit(device) != cudaSuccess || batch < 1 ||
        num_queries < 1 || num_heads < 1 || length < num_queries || num_splits < 1 || num_splits > kMaxSplits ||
        (row_groups != 1 && row_groups != 2)) {
      ok = false;
      return;
    }
    const int64_t rows = num_queries * num_heads, num_slots = batch * length, mask_words = (num_queries + 31) / 32;
    const int64_t layer_elems = num_slots * kWidth;
    num_layers = std::max<int64_t>(2, std::min<int64_t>(64, ((int64_t{512} << 20) / 2 + layer_elems - 1) / layer_elems));
    std::vector<int32_t> h_slots(num_slots), h_lens(batch, static_cast<int32_t>(length)), h_layers(num_layers);
    std::iota(h_slots.begin(), h_slots.end(), 0);
    if (scattered) std::shuffle(h_slots.begin(), h_slots.end(), std::mt19937(12345));
    std::iota(h_layers.begin(), h_layers.end(), 0);
    std::vector<uint32_t> h_mask(batch * num_queries * mask_words, 0u);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < num_queries; ++i)
        for (int64_t j = 0; j <= i; ++j) h_mask[(b * num_queries + i) * mask_words + j / 32] |= 1u << (j % 32);

    uint16_t* q = alloc<uint16_t>(batch * rows * kWidth);
    uint16_t* pool = alloc<uint16_t>(num_layers * layer_elems);
    int32_t* slots = alloc<int32_t>(num_slots);
    int32_t* lens = alloc<int32_t>(batch);
    uint32_t* mask = alloc<uint32_t>(static_cast<int64_t>(h_mask.size()));
    layers = alloc<int32_t>(num_layers);
    p.out = alloc<uint16_t>(batch * rows * kLatent);
    p.lse = alloc<float>(batch * rows);
    p.out_part = alloc<float>(batch * num_splits * rows * kLatent);
    p.lse_part = alloc<float>(batch * num_splits * rows);
    if (!ok) return;
    fill_random_bf16<<<1024, 256>>>(q, batch * rows * kWidth, 1u);
    fill_random_bf16<<<4096, 256>>>(pool, num_layers * layer_elems, 2u);
    ok = cudaMemcpy(slots, h_slots.data(), num_slots * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(lens, h_lens.data(), batch * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(layers, h_layers.data(), num_layers * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(mask, h_mask.data(), h_mask.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaDeviceSynchronize() == cudaSuccess;
    p.q = q; p.kv_pool = pool; p.kv_slots = slots; p.kv_lens = lens; p.tree_mask = mask;
    p.num_queries = static_cast<int>(num_queries); p.num_heads = static_cast<int>(num_heads); p.rows = static_cast<int>(rows);
    p.mask_words = static_cast<int>(mask_words); p.max_len = static_cast<int>(length); p.num_layers = static_cast<int>(num_layers);
    p.num_slots = num_slots; p.num_splits = static_cast<int>(num_splits); p.scale_log2 = 0.07f * kLog2e;
  }
  BenchCase(const BenchCase&) = delete;
  BenchCase& operator=(const BenchCase&) = delete;
  ~BenchCase() {
    for (void* ptr : buffers) cudaFree(ptr);
  }

  template <typename T>
  T* alloc(int64_t count) {
    void* ptr = nullptr;
    if (!ok || cudaMalloc(&ptr, count * static_cast<int64_t>(sizeof(T))) != cudaSuccess) {
      ok = false;
      return nullptr;
    }
    buffers.push_back(ptr);
    return static_cast<T*>(ptr);
  }
};
}  // namespace

std::vector<double> bench_verify_attention(int64_t batch, int64_t num_queries, int64_t num_heads, int64_t length,
                                           int64_t num_splits, int64_t row_groups, int64_t variant, bool scattered,
                                           int iters) {
  std::vector<double> result(4, -1.0);  // per call: plain launches, CUDA graph replay, main kernel alone, merge alone
  if (iters < 1) return result;
  BenchCase c(batch, num_queries, num_heads, length, num_splits, row_groups, scattered);
  cudaStream_t stream = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  const bool ok = c.ok && cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
                  cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess;
  Params& p = c.p;
  // Time `iters` calls (each on the next layer) with events; main/merge select the kernels.
  auto timed = [&](bool main, bool merge, bool use_graph) -> double {
    for (int i = 0; i < 3; ++i) {  // warm-up
      p.layer = c.layers + i % c.num_layers;
      launch_any(p, batch, stream, row_groups, variant, main, merge);
    }
    if (use_graph) {
      if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return -1.0;
      for (int i = 0; i < iters; ++i) {
        p.layer = c.layers + i % c.num_layers;
        launch_any(p, batch, stream, row_groups, variant, main, merge);
      }
      if (cudaStreamEndCapture(stream, &graph) != cudaSuccess || cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess ||
          cudaGraphLaunch(exec, stream) != cudaSuccess) {
        return -1.0;
      }
    }
    cudaEventRecord(e0, stream);
    if (use_graph) {
      cudaGraphLaunch(exec, stream);
    } else {
      for (int i = 0; i < iters; ++i) {
        p.layer = c.layers + i % c.num_layers;
        launch_any(p, batch, stream, row_groups, variant, main, merge);
      }
    }
    cudaEventRecord(e1, stream);
    float ms = 0.f;
    if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess ||
        cudaGetLastError() != cudaSuccess) {
      return -1.0;
    }
    return 1e3 * ms / iters;
  };
  if (ok) {
    result[0] = timed(true, true, false);
    result[1] = timed(true, true, true);
    result[2] = timed(true, false, false);
    result[3] = num_splits > 1 ? timed(false, true, false) : 0.0;
  }
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (stream) cudaStreamDestroy(stream);
  return result;
}

// The main kernel's block timeline of one call (after `warmup` calls on other layers): {start, end} of every block
// in µs since the earliest start, blocks in launch order ((split, row tile) per sequence); the kernels and inputs of
// bench_verify_attention. Empty on failure and in a build without KDTREE_VERIFY_BLOCK_CLOCK.
std::vector<double> bench_verify_block_times(int64_t batch, int64_t num_queries, int64_t num_heads, int64_t length,
                                             int64_t num_splits, int64_t row_groups, int64_t variant, bool scattered,
                                             int warmup) {
  std::vector<double> times;
#if defined(KDTREE_VERIFY_BLOCK_CLOCK)
  if (warmup < 0) return times;
  BenchCase c(batch, num_queries, num_heads, length, num_splits, row_groups, scattered);
  const int64_t rows_per_block = row_groups == 1 ? kRows : 32;
  const int64_t blocks = (num_queries * num_heads + rows_per_block - 1) / rows_per_block * num_splits * batch;
  std::vector<unsigned long long> h_clock(2 * blocks, 0);
  unsigned long long* clock = c.alloc<unsigned long long>(2 * blocks);
  if (!c.ok) return times;
  for (int i = 0; i <= warmup; ++i) {  // the last call, on a layer of its own, is the one stamped
    c.p.layer = c.layers + i % c.num_layers;
    c.p.block_clock = i == warmup ? clock : nullptr;
    launch_any(c.p, batch, nullptr, row_groups, variant);
  }
  if (cudaDeviceSynchronize() != cudaSuccess || cudaGetLastError() != cudaSuccess ||
      cudaMemcpy(h_clock.data(), clock, h_clock.size() * 8, cudaMemcpyDeviceToHost) != cudaSuccess) {
    return times;
  }
  const unsigned long long t0 = *std::min_element(h_clock.begin(), h_clock.end());
  times.reserve(h_clock.size());
  for (unsigned long long t : h_clock) times.push_back((t - t0) * 1e-3);
#else
  (void)batch, (void)num_queries, (void)num_heads, (void)length, (void)num_splits, (void)row_groups, (void)variant,
      (void)scattered, (void)warmup;  // not a diagnostic build: the kernels do not stamp
#endif
  return times;
}
}  // namespace kdtree

XLA_FFI_DEFINE_HANDLER_SYMBOL(kdtree_verify_attention_cuda, VerifyAttentionCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // q
                                  .Arg<ffi::AnyBuffer>()  // kv_pool
                                  .Arg<Scalar32>()        // layer
                                  .Arg<Slots>()           // kv_slots
                                  .Arg<Lens>()            // kv_lens
                                  .Arg<Mask>()            // tree_mask
                                  .Attr<float>("softmax_scale")
                                  .Attr<int64_t>("rope_dim")
                                  .Attr<int64_t>("num_splits")
                                  .Attr<int64_t>("row_groups")
                                  .Attr<int64_t>("variant")  // with row_groups 2: 1 = wide, 2 = warp-specialised, 0 = two groups
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<Lse>()             // lse
                                  .Ret<OutPart>()         // per-split out (scratch)
                                  .Ret<LsePart>(),        // per-split lse (scratch)
                              {ffi::Traits::kCmdBufferCompatible});
