// What every verify-attention kernel, the merge, the launcher and the benchmark harness share: the latent row's
// geometry, the kernel arguments (Params) and the variant ids the FFI attribute `variant` carries.
#pragma once

#include <cstdint>

namespace kdtree::verify {

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
  int split_parts;            // the partition's split count (device.cuh, split_plan); 0: num_splits
  int64_t num_slots;
  float scale_log2;           // softmax_scale * log2(e): the softmax runs in base 2 (ex2.approx)
};

constexpr int kMaxSplits = 1024;  // what the merge accepts

// The kernel a call runs (the FFI attribute `variant`; kdtree_jax/ops/ffi.py VARIANTS names them), for every T: kAuto
// picks the Hopper kernel (wgmma, sm_90a) on compute capability 9.0 when it was built, else the pipelined kernel where
// the device's opt-in shared memory holds its 213 KB, else the wide kernel (97 KB: sm_120, sm_80). Benchmarks and tests force one. One kernel for every T also means a verify pass's
// row and the one-token step's take the same tiles and softmax steps (issue 24).
enum Variant : int64_t { kAuto = 0, kWide = 1, kPipelined = 2, kHopper = 3, kNumVariants = 4 };

}  // namespace kdtree::verify
