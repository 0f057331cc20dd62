// CUDA handler of the routed experts on the router's (token, choice) pairs in place (semantics: moe_experts.h,
// "moe_pairs"; Python side: kdtree_jax/ops/moe.py, pair_expert_mlp).
//
// Why a second op.  At a handful of pairs (an autoregressive step, T = 1 x top-k; a short verify pass) nearly every
// pair has an expert of its own, so sorting the pairs by expert buys nothing, and the sorted op's bookkeeping
// around its two GEMV kernels (the sort, the row gather, the counts, the group table, the finish kernel, the
// gather back and the weighted sum: ~10 launches) costs more than the GEMVs: K2's TP8-rank slice at T = 1 took
// 71-77 us against a 20 us weight-read floor.  Here the pairs are read where the router left them:
//   kernel 0  zeroes the arrival counters (a kernel, not cudaMemsetAsync: in a CUDA graph a small memset became a
//             memset node, and the node -> kernel hand-over left the GPU idle ~4.8 us a layer in the Kimi-K2 rank's
//             T = 1 step on an H200, 2bc58a7)
//   kernel 1  grid (I-tiles, H-splits, pairs): partial[s, pair, 0|1, tile] = x[pair / K][split s]·Wg|Wu[e][split s,
//             tile]; the last of a (pair, tile)'s split blocks to finish adds the splits in order and writes
//             hidden[pair, tile] = silu(g) * u
//   kernel 2  grid (H-tiles, pairs): pair_out[pair, tile] = bf16(hidden[pair]·Wd[e][:, tile]); the last of a
//             (token, tile)'s K blocks to finish writes out[t, tile] = bf16(sum over k, in order, of
//             w[t, k] * pair_out[t K + k, tile]) in float32
// A pair's expert output is the sorted op's row bit for bit at the same split count (the same loops,
// moe_device.cuh, the same split order and SwiGLU); the weighted sum rounds as routed_experts' XLA combine does
// (each pair's output rounded to bf16, products and sums in float32, one rounding at the end).  A pair whose
// expert is not held here (expert parallelism: its id outside [0, E)) adds nothing.  A pair reads its expert's
// weights even when another pair of the call shares them (from L2 while they are still there), which is why
// the Python side takes this op for few pairs only.  "Last to arrive": every block publishes its writes with a
// fence before one atomic increment of the counter; the block that takes it to the total reads the others'
// writes past L1.  Deterministic: every sum runs in a fixed order.  No host sync, no allocation: graph-safe.
// With the shared expert ("moe_pairs_shared", issue 46): one more pair per token after the P routed ones, pair P + t
// = token t through the shared expert's [H, I] / [I, H] weights (an MLP of the routed experts' width), weight 1,
// added after the routed choices in the same float32 sum.  At decode sizes the shared expert is one more GEMV per
// token, which XLA ran as split-K reductions at ~1 TB/s in launches of their own (and, under tensor parallelism,
// behind an all-reduce of its own); here it streams beside the routed pairs.
// On compute capability 9.0+ the three kernels are programmatic dependents (pdl.cuh): each waits for the one before
// it before it reads or writes anything, so only the launches overlap.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "moe_device.cuh"
#include "moe_experts.h"
#include "pdl.cuh"

namespace ffi = xla::ffi;

namespace {

using namespace kdtree::moe;

constexpr int kBatch = 8;  // the last blocks' loads of partial sums / pair outputs issued together

struct PairParams {
  const uint16_t* x;        // [T, H] bf16 bits
  const int32_t* experts;   // [T, K] local expert of each pair; outside [0, E): held elsewhere
  const float* weights;     // [T, K]
  const uint16_t* gate;     // [E, H, I]
  const uint16_t* up;       // [E, H, I]
  const uint16_t* down;     // [E, I, H]
  const uint16_t* shared_gate;  // [H, I] or null: no shared-expert pairs
  const uint16_t* shared_up;    // [H, I]
  const uint16_t* shared_down;  // [I, H]
  uint16_t* out;            // [T, H]
  float* partial;           // [splits, A, 2, I]: kernel 1's per-split gate / up sums
  float* hidden;            // [A, I]
  uint16_t* pair_out;       // [A, H]: each pair's expert output, rounded to bf16
  int32_t* arrivals;        // [A * i_tiles] then [T * h_tiles]: zero before kernel 1
  int64_t T, K, P, H, I, E;
  int64_t A;                // all pairs: the P routed ones, then T shared-expert pairs when shared_gate is set
  int splits;
  int64_t split_rows;       // hidden rows per split (a multiple of kStep)
  int64_t i_tiles, h_tiles;
};

__device__ __forceinline__ int64_t held_expert(const PairParams& p, int64_t pair) {
  const int64_t e = p.experts[pair];
  return e >= 0 && e < p.E ? e : -1;
}

// A pair's token and weights: a routed pair's expert slice (null where its expert is held elsewhere), or the shared
// expert's for the pairs past the routed ones.
struct PairWeights {
  int64_t token;
  const uint16_t* gate;
  const uint16_t* up;
  const uint16_t* down;
};

__device__ __forceinline__ PairWeights pair_weights(const PairParams& p, int64_t pair) {
  if (pair >= p.P) return {pair - p.P, p.shared_gate, p.shared_up, p.shared_down};
  const int64_t e = held_expert(p, pair);
  if (e < 0) return {pair / p.K, nullptr, nullptr, nullptr};
  return {pair / p.K, p.gate + e * p.H * p.I, p.up + e * p.H * p.I, p.down + e * p.I * p.H};
}

// Whether this block is the last of `expected` blocks to arrive at *counter; all threads call it.  Every thread's
// earlier global writes are fenced before the block arrives, and the last block fences again before it reads.
__device__ __forceinline__ bool last_to_arrive(int32_t* counter, int expected) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(counter, 1) == expected - 1;
  __syncthreads();
  if (last) __threadfence();
  return last;
}

__global__ void moe_pair_zero_kernel(int32_t* arrivals, int64_t n) {
  kdtree::wait_for_previous_grid();  // the scratch may still be an earlier kernel's memory until it has finished
  kdtree::allow_dependent_launch();
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    arrivals[i] = 0;
  }
}

template <bool kVec, int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks) moe_pair_gate_up_kernel(PairParams p) {
  static_assert(kThreads >= kTileCols, "a thread per column of the tile");
  __shared__ Reduction<2> red;
  kdtree::wait_for_previous_grid();
  kdtree::allow_dependent_launch();
  const int split = blockIdx.y;
  const int64_t tile = blockIdx.x, col0 = tile * kTileCols, col = col0 + threadIdx.x;
  const bool mine = threadIdx.x < kTileCols && col < p.I;
  const int64_t h_begin = split * p.split_rows;
  const int64_t h_end = h_begin + p.split_rows < p.H ? h_begin + p.split_rows : p.H;
  for (int64_t pair = blockIdx.z; pair < p.A; pair += gridDim.z) {
    const PairWeights w = pair_weights(p, pair);
    if (w.gate == nullptr) continue;
    gate_up_sums<kVec, 1>(p.x + w.token * p.H, p.H, 1, w.gate, w.up, p.I, col0, h_begin, h_end, red);
    float g = 0.f, u = 0.f;
    if (mine) {
      g = column_sum(red, 0, 0, threadIdx.x);
      u = column_sum(red, 1, 0, threadIdx.x);
    }
    if (p.splits == 1) {
      if (mine) p.hidden[pair * p.I + col] = silu_mul(g, u);
    } else {
      float* part = p.partial + (split * p.A + pair) * 2 * p.I + col;
      if (mine) {
        part[0] = g;
        part[p.I] = u;
      }
      if (last_to_arrive(p.arrivals + pair * p.i_tiles + tile, p.splits) && mine) {
        g = u = 0.f;
        // kBatch splits' loads in flight at once (a loop of one load at a time waited out an L2 round trip per
        // split), added in split order.
        for (int s0 = 0; s0 < p.splits; s0 += kBatch) {
          float gs[kBatch], us[kBatch];
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            const float* q = p.partial + ((s0 + j) * p.A + pair) * 2 * p.I + col;
            gs[j] = s0 + j < p.splits ? __ldcg(q) : 0.f;
            us[j] = s0 + j < p.splits ? __ldcg(q + p.I) : 0.f;
          }
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            if (s0 + j < p.splits) {
              g += gs[j];
              u += us[j];
            }
          }
        }
        p.hidden[pair * p.I + col] = silu_mul(g, u);
      }
    }
    __syncthreads();  // `red` is reused by the next pair
  }
}

template <bool kVec, int kMinBlocks, int kUnroll>
__global__ void __launch_bounds__(kThreads, kMinBlocks) moe_pair_down_kernel(PairParams p) {
  __shared__ Reduction<1> red;
  kdtree::wait_for_previous_grid();
  kdtree::allow_dependent_launch();
  const int64_t tile = blockIdx.x, col0 = tile * kTileCols, col = col0 + threadIdx.x;
  const bool mine = threadIdx.x < kTileCols && col < p.H;
  int32_t* token_arrivals = p.arrivals + p.A * p.i_tiles;
  const bool shared = p.A > p.P;
  for (int64_t pair = blockIdx.y; pair < p.A; pair += gridDim.y) {
    const PairWeights w = pair_weights(p, pair);
    const int64_t t = w.token;
    if (w.down != nullptr) {
      down_sums<kVec, 1, kUnroll>(p.hidden + pair * p.I, p.I, 1, w.down, p.I, p.H, col0, red);
      if (mine) p.pair_out[pair * p.H + col] = bf16_bits(column_sum(red, 0, 0, threadIdx.x));
    }
    // Pairs held elsewhere arrive too: every (token, tile) counts to K (+ 1 with the shared expert), written once.
    if (last_to_arrive(token_arrivals + t * p.h_tiles + tile, static_cast<int>(p.K) + shared) && mine) {
      float acc = 0.f;
      for (int64_t k0 = 0; k0 < p.K; k0 += kBatch) {  // kBatch choices' loads in flight, added in choice order
        float ys[kBatch], ws[kBatch];
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          const int64_t q = t * p.K + k0 + j;
          const bool used = k0 + j < p.K && held_expert(p, q) >= 0;
          ys[j] = used ? __uint_as_float(uint32_t{__ldcg(p.pair_out + q * p.H + col)} << 16) : 0.f;
          ws[j] = used ? p.weights[q] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          if (k0 + j < p.K) acc = __fadd_rn(acc, __fmul_rn(ws[j], ys[j]));  // a pair held elsewhere adds 0 * 0, as in XLA
        }
      }
      // The shared expert last, weight 1 (its output rounded to bf16 as every pair's is).
      if (shared) acc = __fadd_rn(acc, __uint_as_float(uint32_t{__ldcg(p.pair_out + (p.P + t) * p.H + col)} << 16));
      p.out[t * p.H + col] = bf16_bits(acc);
    }
    __syncthreads();
  }
}

template <bool kVec, int kMinBlocks>
void launch(const PairParams& p, cudaStream_t stream, int down_unroll) {
  const bool pdl = kdtree::pdl_supported();
  const int64_t counters = p.A * p.i_tiles + p.T * p.h_tiles;
  constexpr int kZeroThreads = 256;
  const int64_t zero_blocks = (counters + kZeroThreads - 1) / kZeroThreads;
  kdtree::launch_kernel(moe_pair_zero_kernel, dim3(static_cast<unsigned>(zero_blocks < 1024 ? zero_blocks : 1024)),
                        dim3(kZeroThreads), 0, stream, pdl, p.arrivals, counters);
  const unsigned pair_blocks = static_cast<unsigned>(p.A < 65535 ? p.A : 65535);
  if (p.I > 0) {
    kdtree::launch_kernel(moe_pair_gate_up_kernel<kVec, kMinBlocks>,
                          dim3(static_cast<unsigned>(p.i_tiles), static_cast<unsigned>(p.splits), pair_blocks),
                          dim3(kThreads), 0, stream, pdl, p);
  }
  auto down = down_unroll == 2 ? moe_pair_down_kernel<kVec, kMinBlocks, 2> : moe_pair_down_kernel<kVec, kMinBlocks, 1>;
  kdtree::launch_kernel(down, dim3(static_cast<unsigned>(p.h_tiles), pair_blocks), dim3(kThreads), 0, stream, pdl, p);
}

using Pairs32 = ffi::Buffer<ffi::S32, 2>;
using PairsF32 = ffi::Buffer<ffi::F32, 2>;
using Scratch = ffi::Buffer<ffi::F32, 2>;
using Arrivals = ffi::Buffer<ffi::S32, 1>;

// The shared expert's weights of "moe_pairs_shared"; null pointers for "moe_pairs".
struct SharedExpert {
  const ffi::AnyBuffer* gate = nullptr;  // [H, I]
  const ffi::AnyBuffer* up = nullptr;    // [H, I]
  const ffi::AnyBuffer* down = nullptr;  // [I, H]
};

ffi::Error MoePairs(cudaStream_t stream, ffi::AnyBuffer x, Pairs32 experts, PairsF32 weights, ffi::AnyBuffer gate,
                    ffi::AnyBuffer up, ffi::AnyBuffer down, SharedExpert shared, int64_t blocks_per_sm, int64_t splits,
                    int64_t down_unroll,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<Scratch> partial, ffi::Result<Scratch> hidden,
                    ffi::Result<ffi::AnyBuffer> pair_out, ffi::Result<Arrivals> arrivals) {
  const ffi::AnyBuffer* bf16_inputs[] = {&x, &gate, &up, &down, shared.gate, shared.up, shared.down};
  for (const ffi::AnyBuffer* b : bf16_inputs) {
    if (b != nullptr && b->element_type() != ffi::DataType::BF16) {
      return ffi::Error::InvalidArgument("moe_pairs (CUDA): x and the expert weights must be bfloat16");
    }
  }
  if (out->element_type() != ffi::DataType::BF16 || pair_out->element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("moe_pairs (CUDA): out and pair_out must be bfloat16");
  }
  const auto xd = x.dimensions(), kd = experts.dimensions(), wd = weights.dimensions(), gd = gate.dimensions(),
             ud = up.dimensions(), dd = down.dimensions(), od = out->dimensions();
  if (xd.size() != 2 || gd.size() != 3 || ud.size() != 3 || dd.size() != 3 || od.size() != 2) {
    return ffi::Error::InvalidArgument("moe_pairs (CUDA): x/out must be 2-D, gate/up/down 3-D");
  }
  const int64_t T = xd[0], H = xd[1], K = kd[1], E = gd[0], I = gd[2], P = T * K;
  const int64_t A = shared.gate != nullptr ? P + T : P;
  if (shared.gate != nullptr) {
    const auto sg = shared.gate->dimensions(), su = shared.up->dimensions(), sd = shared.down->dimensions();
    if (sg.size() != 2 || su.size() != 2 || sd.size() != 2 || sg[0] != H || sg[1] != I || su[0] != H ||
        su[1] != I || sd[0] != I || sd[1] != H) {
      return ffi::Error::InvalidArgument(
          "moe_pairs (CUDA): the shared expert must be gate/up [H,I], down [I,H], of the routed experts' H and I");
    }
  }
  const int64_t i_tiles = (I + kTileCols - 1) / kTileCols, h_tiles = (H + kTileCols - 1) / kTileCols;
  if (kd[0] != T || wd[0] != T || wd[1] != K || gd[1] != H || ud[0] != E || ud[1] != H || ud[2] != I ||
      dd[0] != E || dd[1] != I || dd[2] != H || od[0] != T || od[1] != H || K < 1 ||
      (blocks_per_sm != 1 && blocks_per_sm != 4) || splits < 1 || splits > 65535 ||
      (down_unroll != 1 && down_unroll != 2) ||
      partial->element_count() < splits * A * 2 * I || hidden->element_count() < A * I ||
      pair_out->element_count() < A * H || arrivals->element_count() < A * i_tiles + T * h_tiles) {
    return ffi::Error::InvalidArgument(
        "moe_pairs (CUDA): inconsistent shapes (x [T,H], experts/weights [T,K>=1], gate/up [E,H,I], down [E,I,H], "
        "out [T,H], with A = T*K pairs (+ T with the shared expert): partial >= splits*A*2*I, hidden >= A*I, "
        "pair_out >= A*H, arrivals >= A*ceil(I/64) + T*ceil(H/64)), blocks_per_sm not 1/4 or down_unroll not 1/2");
  }
  if (T == 0 || H == 0) return ffi::Error::Success();

  PairParams p{};
  p.x = static_cast<const uint16_t*>(x.untyped_data());
  p.experts = experts.typed_data();
  p.weights = weights.typed_data();
  p.gate = static_cast<const uint16_t*>(gate.untyped_data());
  p.up = static_cast<const uint16_t*>(up.untyped_data());
  p.down = static_cast<const uint16_t*>(down.untyped_data());
  if (shared.gate != nullptr) {
    p.shared_gate = static_cast<const uint16_t*>(shared.gate->untyped_data());
    p.shared_up = static_cast<const uint16_t*>(shared.up->untyped_data());
    p.shared_down = static_cast<const uint16_t*>(shared.down->untyped_data());
  }
  p.out = static_cast<uint16_t*>(out->untyped_data());
  p.partial = partial->typed_data();
  p.hidden = hidden->typed_data();
  p.pair_out = static_cast<uint16_t*>(pair_out->untyped_data());
  p.arrivals = arrivals->typed_data();
  p.T = T;
  p.K = K;
  p.P = P;
  p.A = A;
  p.H = H;
  p.I = I;
  p.E = E;
  p.i_tiles = i_tiles;
  p.h_tiles = h_tiles;
  // As the sorted op splits: a multiple of kStep rows a split, none empty.
  const DimSplits cut = split_dim(H, splits);  // <= splits: none is empty
  p.split_rows = cut.rows;
  p.splits = cut.count;
  const bool vec = H % 8 == 0 && I % 8 == 0 && aligned16(p.x) && aligned16(p.gate) && aligned16(p.up) &&
                   aligned16(p.down) && aligned16(p.hidden) &&
                   (p.shared_gate == nullptr ||
                    (aligned16(p.shared_gate) && aligned16(p.shared_up) && aligned16(p.shared_down)));
  const int unroll = static_cast<int>(down_unroll);
  if (vec && blocks_per_sm == 4) {
    launch<true, 4>(p, stream, unroll);
  } else if (vec) {
    launch<true, 1>(p, stream, unroll);
  } else {
    launch<false, 1>(p, stream, unroll);
  }
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return ffi::Error::Internal(std::string("moe_pairs (CUDA): kernel launch: ") + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

ffi::Error MoePairsCuda(cudaStream_t stream, ffi::AnyBuffer x, Pairs32 experts, PairsF32 weights, ffi::AnyBuffer gate,
                        ffi::AnyBuffer up, ffi::AnyBuffer down, int64_t blocks_per_sm, int64_t splits,
                        int64_t down_unroll, ffi::Result<ffi::AnyBuffer> out, ffi::Result<Scratch> partial, ffi::Result<Scratch> hidden,
                        ffi::Result<ffi::AnyBuffer> pair_out, ffi::Result<Arrivals> arrivals) {
  return MoePairs(stream, x, experts, weights, gate, up, down, SharedExpert{}, blocks_per_sm, splits, down_unroll,
                  out, partial, hidden, pair_out, arrivals);
}

ffi::Error MoePairsSharedCuda(cudaStream_t stream, ffi::AnyBuffer x, Pairs32 experts, PairsF32 weights,
                              ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer down, ffi::AnyBuffer shared_gate,
                              ffi::AnyBuffer shared_up, ffi::AnyBuffer shared_down, int64_t blocks_per_sm,
                              int64_t splits, int64_t down_unroll, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<Scratch> partial,
                              ffi::Result<Scratch> hidden, ffi::Result<ffi::AnyBuffer> pair_out,
                              ffi::Result<Arrivals> arrivals) {
  return MoePairs(stream, x, experts, weights, gate, up, down, SharedExpert{&shared_gate, &shared_up, &shared_down},
                  blocks_per_sm, splits, down_unroll, out, partial, hidden, pair_out, arrivals);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kdtree_moe_pairs_cuda, MoePairsCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [T, H]
                                  .Arg<Pairs32>()         // experts [T, K]
                                  .Arg<PairsF32>()        // weights [T, K]
                                  .Arg<ffi::AnyBuffer>()  // gate
                                  .Arg<ffi::AnyBuffer>()  // up
                                  .Arg<ffi::AnyBuffer>()  // down
                                  .Attr<int64_t>("blocks_per_sm")  // 1 or 4: register budget
                                  .Attr<int64_t>("splits")         // hidden-dim splits of kernel 1
                                  .Attr<int64_t>("down_unroll")    // 1 or 2: kernel 2's steps loaded together
                                  .Ret<ffi::AnyBuffer>()  // out [T, H]
                                  .Ret<Scratch>()         // partial (scratch) [splits * P * 2, I]
                                  .Ret<Scratch>()         // hidden (scratch) [P, I]
                                  .Ret<ffi::AnyBuffer>()  // pair_out (scratch) [P, H] bf16
                                  .Ret<Arrivals>(),       // arrivals (scratch) [P * ceil(I/64) + T * ceil(H/64)]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kdtree_moe_pairs_shared_cuda, MoePairsSharedCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [T, H]
                                  .Arg<Pairs32>()         // experts [T, K]
                                  .Arg<PairsF32>()        // weights [T, K]
                                  .Arg<ffi::AnyBuffer>()  // gate
                                  .Arg<ffi::AnyBuffer>()  // up
                                  .Arg<ffi::AnyBuffer>()  // down
                                  .Arg<ffi::AnyBuffer>()  // shared expert gate [H, I]
                                  .Arg<ffi::AnyBuffer>()  // shared expert up [H, I]
                                  .Arg<ffi::AnyBuffer>()  // shared expert down [I, H]
                                  .Attr<int64_t>("blocks_per_sm")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("down_unroll")
                                  .Ret<ffi::AnyBuffer>()  // out [T, H]
                                  .Ret<Scratch>()         // partial (scratch) [splits * A * 2, I], A = T * (K + 1)
                                  .Ret<Scratch>()         // hidden (scratch) [A, I]
                                  .Ret<ffi::AnyBuffer>()  // pair_out (scratch) [A, H] bf16
                                  .Ret<Arrivals>(),       // arrivals (scratch) [A * ceil(I/64) + T * ceil(H/64)]
                              {ffi::Traits::kCmdBufferCompatible});
