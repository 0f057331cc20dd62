// CUDA handler of the grouped expert MLP (semantics: moe_experts.h).
//
// Why a kernel of our own.  At decode-sized token counts (a verify step of T = 9..64 tokens × top-8) each
// active expert sees one or two rows, so the op is a grouped GEMV: its cost is reading the weights of the
// experts that are actually used, once.  XLA's ragged_dot runs far from that floor there.  Here:
//   table,    one block:                         items = (expert, first row, count <= R) of each chunk of R rows
//                                                of each expert with rows (R = rows_per_item, a static attr)
//   kernel 1, grid (I-tiles, H-splits, items): partial[s, r, 0|1, tile] = x_r[split s]·Wg|Wu[e][split s, tile]
//   finish,   grid-stride over rows x I:         hidden[r, c] = silu(sum_s gate part) * (sum_s up part)
//   kernel 2, grid (H-tiles, items):             out[r, tile] = hidden_r·Wd[e][:, tile]
// Kernel 1 splits the hidden (reduction) dim over blocks because it has few blocks otherwise: K2 at T = 9
// under 4-way EP has ~18 active experts x 32 I-tiles = 576 blocks of 1.8 MB each, barely more than one
// wave on an H200 (132 SMs x 4 blocks), so the second, nearly empty wave would cost as much as the first.
// Blocks of ~256 KB (kernel 2's size too) make several waves and keep every SM streaming to the end.
// A work item is one active expert with up to R of its rows (an expert with n rows gives ceil(n / R) items,
// which run in different blocks, side by side: the expert's weight tile comes from DRAM once and from L2 for
// the others).  Before items, a block took a whole expert: with few experts and many rows each (the default
// pair's 8 experts x ~68 rows at batch-16 DDTree 16) the grid had 32 blocks on 132 SMs, each walking 17 chunks
// of 4 rows one after the other.  The grid has a static number of item slots, the most that M rows can fill,
// min(M, (M + min(M, E) (R - 1)) / R) (= min(M, E) slots when R >= M: one item per expert, as before); slots
// past the device-side count of items exit at once, so inactive experts' weights are never touched and
// nothing depends on a host-side copy of the routing.  The item axis of each grid is the slot count capped
// at max(min(M, E), ~8 blocks per SM) (item_blocks); blocks loop over items with the grid's stride.
//
// Inside a block: the GEMV loops of moe_device.cuh (shared with moe_pairs.cu, the op for few pairs).
//
// A block processes its item's rows in chunks of up to kMaxRows (with R > kMaxRows each chunk streams the
// expert's tile again, from L2 when it is still there): the chunk size is picked per block from the
// device-side row count (1, 2 or 4 accumulator rows), so an item of one row does not pay for four.  At large row counts this CUDA-core
// GEMV loses to a tensor-core GEMM; the Python side switches to ragged_dot above a static row threshold.
//
// Portable (sm_80 / sm_90 / sm_120: plain loads and FMAs, 8 KB of static shared memory); the handler only
// launches (no host sync, no allocation), so it is safe inside CUDA graphs (kCmdBufferCompatible).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "moe_device.cuh"
#include "pdl.cuh"
#include "moe_experts.h"

namespace ffi = xla::ffi;

namespace {

using namespace kdtree::moe;

struct Params {
  const uint16_t* rows;   // [M, H] bf16 bits
  const uint16_t* gate;   // [E, H, I]
  const uint16_t* up;     // [E, H, I]
  const uint16_t* down;   // [E, I, H]
  const int32_t* group_sizes;  // [E]
  int32_t* groups;        // [3, G]: the work items moe_group_table_kernel writes (scratch)
  int32_t* num_active;    // items in use
  uint16_t* out;          // [M, H]
  float* partial;         // [splits, M, 2, I]: kernel 1's per-split gate / up sums
  float* hidden;          // [M, I]
  int64_t M, H, I, E;
  int G;                  // item slots
  int64_t rows_per_item;  // R: rows of one expert per work item (the table kernel's chunking)
  int splits;             // hidden-dim splits of kernel 1
  int64_t split_rows;     // hidden rows per split (a multiple of kStep)
};

struct Group {
  int64_t expert, start, count;
};

// The table entry of item slot g (a group: an expert and some of its rows), clamped so that bad data can only
// shrink it.
__device__ __forceinline__ Group read_group(const Params& p, int g) {
  Group grp{p.groups[g], p.groups[p.G + g], p.groups[2 * p.G + g]};
  if (grp.expert < 0 || grp.expert >= p.E || grp.start < 0 || grp.start >= p.M || grp.count < 0) grp.count = 0;
  if (grp.count > p.M - grp.start) grp.count = p.M - grp.start;
  return grp;
}

__device__ __forceinline__ int active_groups(const Params& p) {
  const int n = *p.num_active;
  return n < 0 ? 0 : (n > p.G ? p.G : n);
}

// Rows [0, covered) belong to groups (groups are consecutive from row 0); the rest belong to none.
__device__ __forceinline__ int64_t covered_rows(const Params& p, int active) {
  if (active <= 0) return 0;
  const Group last = read_group(p, active - 1);
  return last.start + last.count;
}

// Kernel 1, one chunk of kRows rows (n of them real) of one group: the partial sums x·Wg and x·Wu over
// hidden rows [h_begin, h_end) for the block's 64 columns of the intermediate dim.
template <bool kVec, int kRows>
__device__ void gate_up_chunk(const Params& p, const Group& grp, int64_t row0, int n, int tile, int split,
                              int64_t h_begin, int64_t h_end, Reduction<2>& red) {
  const int64_t col0 = int64_t{tile} * kTileCols;
  gate_up_sums<kVec, kRows>(p.rows + row0 * p.H, p.H, n, p.gate + grp.expert * p.H * p.I,
                            p.up + grp.expert * p.H * p.I, p.I, col0, h_begin, h_end, red);
  for (int idx = threadIdx.x; idx < kRows * kTileCols; idx += kThreads) {
    const int r = idx / kTileCols, c = idx % kTileCols;
    const int64_t out_col = col0 + c;
    if (r >= n || out_col >= p.I) continue;
    float* part = p.partial + ((split * p.M + row0 + r) * 2) * p.I + out_col;
    part[0] = column_sum(red, 0, r, c);
    part[p.I] = column_sum(red, 1, r, c);
  }
  __syncthreads();  // `red` is reused by the next chunk
}

// kMinBlocks: 1 lets ptxas take ~200 registers (2 blocks per SM), 4 caps them at 128 (4 blocks, 16 warps
// per SM: more loads in flight, a few bytes of spill); the Python side picks (the
// `blocks_per_sm` argument of kdtree_jax/ops/moe.py, default 4).
template <bool kVec, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) moe_gate_up_kernel(Params p) {
  __shared__ Reduction<2> red;
  kdtree::wait_for_previous_grid();
  kdtree::allow_dependent_launch();
  const int g = blockIdx.z, split = blockIdx.y;
  const int active = active_groups(p);  // blocks past it exit before touching any weight
  const int64_t h_begin = split * p.split_rows;
  const int64_t h_end = h_begin + p.split_rows < p.H ? h_begin + p.split_rows : p.H;
  for (int item = g; item < active; item += gridDim.z) {
    const Group grp = read_group(p, item);
    for (int64_t c0 = 0; c0 < grp.count; c0 += kMaxRows) {
      const int n = static_cast<int>(grp.count - c0 < kMaxRows ? grp.count - c0 : kMaxRows);
      if (n == 1) {
        gate_up_chunk<kVec, 1>(p, grp, grp.start + c0, n, blockIdx.x, split, h_begin, h_end, red);
      } else if (n == 2) {
        gate_up_chunk<kVec, 2>(p, grp, grp.start + c0, n, blockIdx.x, split, h_begin, h_end, red);
      } else {
        gate_up_chunk<kVec, 4>(p, grp, grp.start + c0, n, blockIdx.x, split, h_begin, h_end, red);
      }
    }
  }
}

// hidden = silu(gate) * up of the rows in groups, each sum taken over the splits in a fixed order (so the
// result is deterministic, unlike atomics).
__global__ void __launch_bounds__(256) moe_finish_kernel(Params p) {
  kdtree::wait_for_previous_grid();
  kdtree::allow_dependent_launch();
  const int64_t total = covered_rows(p, active_groups(p)) * p.I;
  for (int64_t idx = blockIdx.x * int64_t{256} + threadIdx.x; idx < total; idx += int64_t{gridDim.x} * 256) {
    const int64_t r = idx / p.I, c = idx % p.I;
    float g = 0.f, u = 0.f;
    for (int s = 0; s < p.splits; ++s) {
      const float* part = p.partial + ((s * p.M + r) * 2) * p.I + c;
      g += part[0];
      u += part[p.I];
    }
    p.hidden[idx] = silu_mul(g, u);
  }
}

// Kernel 2, one chunk: out = hidden·Wd for the block's 64 columns of the hidden dim.
template <bool kVec, int kRows>
__device__ void down_chunk(const Params& p, const Group& grp, int64_t row0, int n, int tile, Reduction<1>& red) {
  const int64_t col0 = int64_t{tile} * kTileCols;
  down_sums<kVec, kRows>(p.hidden + row0 * p.I, p.I, n, p.down + grp.expert * p.I * p.H, p.I, p.H, col0, red);
  for (int idx = threadIdx.x; idx < kRows * kTileCols; idx += kThreads) {
    const int r = idx / kTileCols, c = idx % kTileCols;
    const int64_t out_col = col0 + c;
    if (r >= n || out_col >= p.H) continue;
    p.out[(row0 + r) * p.H + out_col] = bf16_bits(column_sum(red, 0, r, c));
  }
  __syncthreads();
}

template <bool kVec, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) moe_down_kernel(Params p) {
  __shared__ Reduction<1> red;
  kdtree::wait_for_previous_grid();
  kdtree::allow_dependent_launch();
  const int g = blockIdx.y;
  const int active = active_groups(p);
  if (g == 0) {
    // Rows past the last group (pairs routed to experts held elsewhere) get zeros, as ragged_dot gives.
    const int64_t covered = covered_rows(p, active);
    const int64_t tile0 = int64_t{blockIdx.x} * kTileCols;
    for (int64_t idx = threadIdx.x; idx < (p.M - covered) * kTileCols; idx += kThreads) {
      const int64_t r = covered + idx / kTileCols, c = tile0 + idx % kTileCols;
      if (c < p.H) p.out[r * p.H + c] = 0;
    }
  }
  for (int item = g; item < active; item += gridDim.y) {
    const Group grp = read_group(p, item);
    for (int64_t c0 = 0; c0 < grp.count; c0 += kMaxRows) {
      const int n = static_cast<int>(grp.count - c0 < kMaxRows ? grp.count - c0 : kMaxRows);
      if (n == 1) {
        down_chunk<kVec, 1>(p, grp, grp.start + c0, n, blockIdx.x, red);
      } else if (n == 2) {
        down_chunk<kVec, 2>(p, grp, grp.start + c0, n, blockIdx.x, red);
      } else {
        down_chunk<kVec, 4>(p, grp, grp.start + c0, n, blockIdx.x, red);
      }
    }
  }
}

// The work-item table from group_sizes, on the device (one block; runs first): the items of each expert with
// rows, in expert order, are its chunks of R consecutive rows (the last one shorter), slot w of the table the
// w-th item overall.  Per round of 1024 experts: two block-wide exclusive scans (rows -> each expert's first
// row; items -> its first item), then the round's items are written one per thread (stride 1024), each
// finding its expert by a binary search of the items scan in shared memory, so that one expert holding
// every row does not leave one thread writing M / R entries.  In XLA the group table was ~8 small kernels
// (cumsum, nonzero, stack), ~27 us of a ~260 us MoE layer at T = 9 on an H200; here it is one 3 us launch.
// Sizes are clamped to [0, M] and groups that would start at or past row M are dropped (the last one cut at
// row M), so bad sizes can only shrink groups.
constexpr int kTableThreads = 1024;

// Block-wide exclusive scan of v; *total gets the block's sum.  All threads must call it.
__device__ __forceinline__ int64_t block_exclusive_scan(int64_t v, int64_t* warp_sums, int64_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int64_t inc = v;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int64_t n = __shfl_up_sync(0xffffffffu, inc, off);
    if (lane >= off) inc += n;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < kTableThreads / 32 ? warp_sums[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t n = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += n;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int64_t before = warp == 0 ? 0 : warp_sums[warp - 1];
  *total = warp_sums[kTableThreads / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next scan
  return before + inc - v;
}

__global__ void __launch_bounds__(kTableThreads) moe_group_table_kernel(const int32_t* sizes, int32_t* groups,
                                                                    int32_t* num_active, int64_t E, int64_t M, int G,
                                                                    int64_t R) {
  __shared__ int64_t warp_sums[32];
  __shared__ int64_t first_item[kTableThreads];  // this round: each expert's first item, relative to the round
  __shared__ int32_t first_row[kTableThreads];
  __shared__ int32_t row_count[kTableThreads];
  kdtree::wait_for_previous_grid();
  kdtree::allow_dependent_launch();
  int64_t items_before = 0, rows_before = 0;
  for (int64_t e0 = 0; e0 < E; e0 += kTableThreads) {
    const int64_t e = e0 + threadIdx.x;
    int64_t size = e < E ? sizes[e] : 0;
    size = size < 0 ? 0 : (size > M ? M : size);
    int64_t n_items, n_rows;
    const int64_t start = rows_before + block_exclusive_scan(size, warp_sums, &n_rows);
    // Starts never decrease, so the groups that start inside [0, M) are a prefix of the active experts.
    const int64_t count = size > 0 && start < M ? (size < M - start ? size : M - start) : 0;
    const int64_t first = block_exclusive_scan((count + R - 1) / R, warp_sums, &n_items);
    // (The scans' barriers order these writes after every thread's reads of the previous round.)
    first_item[threadIdx.x] = first;
    first_row[threadIdx.x] = static_cast<int32_t>(count > 0 ? start : 0);
    row_count[threadIdx.x] = static_cast<int32_t>(count);
    __syncthreads();
    for (int64_t i = threadIdx.x; i < n_items && items_before + i < G; i += kTableThreads) {
      // The expert of item i: the last k with first_item[k] <= i (experts without items share the next
      // one's first_item, so the last such k is the one whose items contain i).
      int lo = 0, hi = kTableThreads - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first_item[mid] <= i) lo = mid; else hi = mid - 1;
      }
      const int64_t chunk = (i - first_item[lo]) * R;
      const int64_t w = items_before + i;
      groups[w] = static_cast<int32_t>(e0 + lo);
      groups[G + w] = static_cast<int32_t>(first_row[lo] + chunk);
      groups[2 * G + w] = static_cast<int32_t>(row_count[lo] - chunk < R ? row_count[lo] - chunk : R);
    }
    items_before += n_items;
    rows_before += n_rows;
  }
  const int64_t active = items_before < G ? items_before : G;
  for (int64_t g = active + threadIdx.x; g < G; g += kTableThreads) {  // unused slots: empty items
    groups[g] = 0;
    groups[G + g] = 0;
    groups[2 * G + g] = 0;
  }
  if (threadIdx.x == 0) *num_active = static_cast<int32_t>(active);
}

template <bool kVec, int kMinBlocks>
void launch(const Params& p, dim3 grid_gate_up, dim3 grid_down, cudaStream_t stream) {
  // Programmatic dependents on compute capability 9.0+ (pdl.cuh): each kernel waits for the one before it first.
  const bool pdl = kdtree::pdl_supported();
  kdtree::launch_kernel(moe_group_table_kernel, dim3(1), dim3(kTableThreads), 0, stream, pdl, p.group_sizes, p.groups,
                        p.num_active, p.E, p.M, p.G, p.rows_per_item);
  if (p.G > 0 && p.I > 0) {
    kdtree::launch_kernel(moe_gate_up_kernel<kVec, kMinBlocks>, grid_gate_up, dim3(kThreads), 0, stream, pdl, p);
    const int64_t blocks = (p.M * p.I + 255) / 256;
    kdtree::launch_kernel(moe_finish_kernel, dim3(static_cast<unsigned>(blocks < 1024 ? blocks : 1024)), dim3(256), 0,
                          stream, pdl, p);
  }
  // Always launched: it also writes the zeros of rows outside every group.
  kdtree::launch_kernel(moe_down_kernel<kVec, kMinBlocks>, grid_down, dim3(kThreads), 0, stream, pdl, p);
}

// Blocks along the item axis of a kernel with `per_item` blocks per item (its tiles x splits): every item
// slot while that stays under ~8 blocks per SM (two waves at 4 blocks/SM) or under the one-item-per-expert
// count min(M, E) (the grid before items); past that, blocks loop over items (stride = the grid), so that
// the empty slots of a loose bound (K2 under EP: M counts pairs routed elsewhere) do not add blocks.
unsigned item_blocks(const Params& p, int64_t per_item) {
  const int64_t old_slots = p.M < p.E ? p.M : p.E;
  const int64_t target = (int64_t{8} * sm_count() + per_item - 1) / per_item;
  int64_t n = old_slots > target ? old_slots : target;
  n = n < p.G ? n : p.G;
  return static_cast<unsigned>(n > 0 ? n : 1);
}

ffi::Error cuda_error(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("moe_experts (CUDA): ") + what + ": " + cudaGetErrorString(err));
}

using Sizes = ffi::Buffer<ffi::S32, 1>;
using Groups = ffi::Buffer<ffi::S32, 2>;
using Scalar32 = ffi::Buffer<ffi::S32, 0>;
using Hidden = ffi::Buffer<ffi::F32, 2>;

ffi::Error MoeExpertsCuda(cudaStream_t stream, ffi::AnyBuffer rows, ffi::AnyBuffer gate, ffi::AnyBuffer up,
                          ffi::AnyBuffer down, Sizes group_sizes, int64_t blocks_per_sm, int64_t splits,
                          int64_t rows_per_item,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Result<Hidden> partial, ffi::Result<Hidden> hidden,
                          ffi::Result<Groups> groups, ffi::Result<Scalar32> num_active) {
  for (const ffi::AnyBuffer* b : {&rows, &gate, &up, &down}) {
    if (b->element_type() != ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument("moe_experts (CUDA): rows, gate, up and down must be bfloat16");
    }
  }
  if (out->element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("moe_experts (CUDA): out must be bfloat16");
  }
  const auto rd = rows.dimensions(), gd = gate.dimensions(), ud = up.dimensions(), dd = down.dimensions();
  const auto td = groups->dimensions(), sd = group_sizes.dimensions(), od = out->dimensions(), hd = hidden->dimensions();
  if (rd.size() != 2 || gd.size() != 3 || ud.size() != 3 || dd.size() != 3 || od.size() != 2) {
    return ffi::Error::InvalidArgument("moe_experts (CUDA): rows/out must be 2-D, gate/up/down 3-D");
  }
  const int64_t M = rd[0], H = rd[1], E = gd[0], I = gd[2];
  if (gd[1] != H || ud[0] != E || ud[1] != H || ud[2] != I || dd[0] != E || dd[1] != I || dd[2] != H ||
      od[0] != M || od[1] != H || sd[0] != E || td[0] != 3 || td[1] < 1 || td[1] > 65535 || hd[0] * hd[1] < M * I ||
      (blocks_per_sm != 1 && blocks_per_sm != 4) || splits < 1 || splits > 65535 || rows_per_item < 1 ||
      partial->element_count() < splits * M * 2 * I) {
    return ffi::Error::InvalidArgument("moe_experts (CUDA): inconsistent shapes (rows [M,H], gate/up [E,H,I], "
                                       "down [E,I,H], group_sizes [E], groups [3,1<=G<=65535], out [M,H], partial >= splits*M*2*I, hidden >= M*I), "
                                       "blocks_per_sm not 1/4 or rows_per_item < 1");
  }
  if (M == 0 || H == 0) return ffi::Error::Success();

  Params p{};
  p.rows = static_cast<const uint16_t*>(rows.untyped_data());
  p.gate = static_cast<const uint16_t*>(gate.untyped_data());
  p.up = static_cast<const uint16_t*>(up.untyped_data());
  p.down = static_cast<const uint16_t*>(down.untyped_data());
  p.group_sizes = group_sizes.typed_data();
  p.groups = groups->typed_data();
  p.num_active = num_active->typed_data();
  p.out = static_cast<uint16_t*>(out->untyped_data());
  p.partial = partial->typed_data();
  p.hidden = hidden->typed_data();
  p.M = M;
  p.H = H;
  p.I = I;
  p.E = E;
  p.G = static_cast<int>(td[1]);
  p.rows_per_item = rows_per_item;
  // Split rows: a multiple of kStep, so that every split but the last is whole 8-row steps.
  const DimSplits cut = split_dim(H, splits);  // <= splits: none is empty
  p.split_rows = cut.rows;
  p.splits = cut.count;
  // 16-byte loads need every weight row and input row to start on a 16-byte boundary.
  const bool vec = H % 8 == 0 && I % 8 == 0 && aligned16(p.rows) && aligned16(p.gate) && aligned16(p.up) &&
                   aligned16(p.down) && aligned16(p.hidden);
  const int64_t i_tiles = (I + kTileCols - 1) / kTileCols, h_tiles = (H + kTileCols - 1) / kTileCols;
  const dim3 grid_gate_up(static_cast<unsigned>(i_tiles), static_cast<unsigned>(p.splits),
                          item_blocks(p, i_tiles * p.splits));
  const dim3 grid_down(static_cast<unsigned>(h_tiles), item_blocks(p, h_tiles));
  if (vec && blocks_per_sm == 4) {
    launch<true, 4>(p, grid_gate_up, grid_down, stream);
  } else if (vec) {
    launch<true, 1>(p, grid_gate_up, grid_down, stream);
  } else {
    launch<false, 1>(p, grid_gate_up, grid_down, stream);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return cuda_error("kernel launch", err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kdtree_moe_experts_cuda, MoeExpertsCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // rows
                                  .Arg<ffi::AnyBuffer>()  // gate
                                  .Arg<ffi::AnyBuffer>()  // up
                                  .Arg<ffi::AnyBuffer>()  // down
                                  .Arg<Sizes>()           // group_sizes [E]
                                  .Attr<int64_t>("blocks_per_sm")  // 1 or 4: register budget (see kernels)
                                  .Attr<int64_t>("splits")         // hidden-dim splits of kernel 1
                                  .Attr<int64_t>("rows_per_item")  // R: rows of one expert per work item
                                  .Ret<ffi::AnyBuffer>()  // out
                                  .Ret<Hidden>()          // partial (scratch) [splits * M * 2, I]
                                  .Ret<Hidden>()          // hidden (scratch) [M, I]
                                  .Ret<Groups>()          // groups (scratch) [3, G]: the work items' table
                                  .Ret<Scalar32>(),       // num_active (scratch): columns of groups in use
                              {ffi::Traits::kCmdBufferCompatible});
