// Device building blocks of the verify-attention kernels: PTX wrappers (ldmatrix, mma.sync, cp.async), the KV copy
// pipeline over a split's tiles (slot ring, L2 prefetch), the Q fragments, the masked scores and the online softmax.
// Header-only: each kernel file instantiates what it uses.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "../verify_attention.h"
#include "params.h"
#include "../pdl.cuh"

namespace kdtree::verify {

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

// 16-byte async copies of one row chunk; the chunk offsets (into shared memory, and into global memory when the two
// layouts differ) are immediates of the instruction, so a thread computes its two row addresses once per tile instead
// of one 64-bit address per copy.  src_bytes = 0 writes zeros (positions past the end never hold stale data: a zero
// row times a zero probability stays zero, whereas garbage could be NaN).
template <int kDstOffset, int kSrcOffset = kDstOffset>
__device__ __forceinline__ void cp_async_16_at(uint32_t dst, const char* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0+%3], [%1+%4], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes),
               "n"(kDstOffset), "n"(kSrcOffset));
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

// The split-KV partition of sequence b's positions (issue 24: a verify pass's root row must be computed as the
// one-token step at its position computes it, bit for bit). The boundaries are anchored at the root: the root row
// (query token 0) sees positions [0, root_len) with root_len = kv_len - T + 1, whatever T, and those are cut into
// splits of whole kSplitUnit-position units; the split that holds the root's last unit also takes the query tokens
// after it (the tree's tail: positions the root row never sees, so for it they add exact zeros). The cut depends
// on root_len and the partition count p.split_parts only (a static count chosen from B and H, never from T or the
// table width), not on the grid's split count p.num_splits, which only has to be at least the splits used
// (ceil(Lmax / kSplitUnit) bounds those). A kernel processes a split's tiles in order, so the root row's online
// softmax sees the same tiles in the same order in a one-token call and in a T-row call; the merge adds the used
// splits' partials in split order (merge.cu). kSplitUnit is a multiple of every kernel's tile (32 or 64).
constexpr int kSplitUnit = 64;
constexpr int kShortSplitUnits = 4;  // occupancy policy: the longest split length kept for a short sequence (256)

struct SplitPlan {
  int valid;         // positions [0, valid) exist
  int first;         // position of query token 0 (may be negative)
  int per_split;     // units per split (the root row's positions span ceil(root_len / kSplitUnit) units)
  int used;          // splits holding positions: 0 .. used - 1
};
__device__ __forceinline__ SplitPlan split_plan(const Params& p, int b) {
  const int kv_len = p.kv_lens[b];
  const int valid = min(max(kv_len, 0), p.max_len);
  const int all_units = (valid + kSplitUnit - 1) / kSplitUnit;
  const int root_len = min(max(kv_len - p.num_queries + 1, 0), valid);
  const int root_units = max((root_len + kSplitUnit - 1) / kSplitUnit, min(all_units, 1));
  const int parts = max(p.split_parts > 0 ? p.split_parts : p.num_splits, 1);
  int per_split = max((root_units + parts - 1) / parts, 1);
  if (p.split_parts == 0) {
    // Occupancy policy: the host chose num_splits for a sequence filling the table. A shorter one keeps the split
    // length that plan gave (up to kShortSplitUnits) instead of its count: a decode table sized for the longest
    // sequence would otherwise cut 200 positions into four 64-position splits, whose partials (2 KB a query row
    // each) outweigh their KV rows (1,152 B a position) and cost a merge. A full table's plan is unchanged.
    const int table_root = max(p.max_len - p.num_queries + 1, 1);
    const int planned = ((table_root + kSplitUnit - 1) / kSplitUnit + parts - 1) / parts;
    per_split = max(per_split, min(planned, kShortSplitUnits));
  }
  int used = (root_units + per_split - 1) / per_split;  // <= parts, and <= root_units <= ceil(Lmax / kSplitUnit)
  if (used > p.num_splits) {  // a grid too small for the partition (never from kdtree_jax.ops.ffi): cover it anyway
    per_split = (root_units + p.num_splits - 1) / p.num_splits;
    used = (root_units + per_split - 1) / per_split;
  }
  return SplitPlan{valid, kv_len - p.num_queries, per_split, used};
}

// A split's share of sequence b's KV positions in the kernel's kTile-position tiles: valid positions, the position
// of query token 0, and the split's tiles [tile_begin, tile_end) (empty past the used splits).
struct SplitTiles {
  int valid, first, tile_begin, tile_end;
  int used;  // the sequence's splits holding positions (split_plan)
  // Whether this split's block writes the final rows: the grid has one split, or the sequence uses at most one
  // (the merge leaves such a sequence alone: merge.cu). A merge of one partial computes the same bits.
  __device__ __forceinline__ bool direct(bool one_split_grid) const { return one_split_grid || used <= 1; }
  // Whether a block of a many-split grid has nothing to do: a split past those used (the first one stays, to
  // write the direct rows of a sequence with no positions).
  __device__ __forceinline__ bool idle(bool one_split_grid, int split) const {
    return !one_split_grid && split >= max(used, 1);
  }
};
template <int kTile>
__device__ __forceinline__ SplitTiles split_tiles(const Params& p, int b, int split) {
  static_assert(kSplitUnit % kTile == 0, "a split unit is whole tiles");
  constexpr int kTilesPerUnit = kSplitUnit / kTile;
  const SplitPlan plan = split_plan(p, b);
  const int num_tiles = (plan.valid + kTile - 1) / kTile;
  if (split >= plan.used) return SplitTiles{plan.valid, plan.first, num_tiles, num_tiles, plan.used};
  const int unit_begin = split * plan.per_split;
  const int tile_end = split == plan.used - 1 ? num_tiles : (unit_begin + plan.per_split) * kTilesPerUnit;
  return SplitTiles{plan.valid, plan.first, unit_begin * kTilesPerUnit, tile_end, plan.used};
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
  bool prefetcher;    // whether this thread's row of a tile is this block's to prefetch (see prefetch_kv_row)
  bool copies = true;  // whether this thread copies rows at all (a kernel may have more threads than a tile's copies)

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
      if (copies && tile_begin + st < tile_end) {
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
                    copies && t_copy < tile_end, fetch_raw, prefetcher && t_fetch < tile_end && t_fetch * kTile + my_row < valid};
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
// partials (`direct`: SplitTiles::direct); `writes_lse`: this thread also writes the rows' lse.
template <int kMt, int kBlocks>
__device__ __forceinline__ void write_rows(const Params& p, bool direct, const float (&acc)[kMt][kBlocks][4],
                                           const float* stat_s, int row0, int b, int split, int col0, int g, int qd,
                                           bool writes_lse) {
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int rl = mt * 16 + g + 8 * h, r = row0 + rl;
      if (r >= p.rows) continue;
      const float sum = stat_s[32 + rl];
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      const float lse_row = sum > 0.f ? (stat_s[rl] + log2f(sum)) * kLn2 : -INFINITY;
      const int64_t row_index = direct ? static_cast<int64_t>(b) * p.rows + r
                                       : (static_cast<int64_t>(b) * p.num_splits + split) * p.rows + r;
      if (direct) {
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

}  // namespace kdtree::verify
