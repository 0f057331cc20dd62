// Grouped SwiGLU expert MLP for decode-sized token counts (ffi/moe_experts.cu; Python side:
// kdtree_jax/ops/moe.py).
//
// Semantics (those of `routed_experts` in kdtree_jax/model/moe.py, bf16 in and out, fp32 accumulation):
//   rows   [M, H]      bf16  the (token, k) pairs' inputs, sorted by local expert
//   gate   [E, H, I]   bf16, up [E, H, I], down [E, I, H]
//   group_sizes [E]    int32 rows of each expert: expert e's rows follow those of experts < e (the sort by
//                            expert leaves them so); rows past sum(group_sizes) belong to no expert
//   out    [M, H]      bf16  out[r] = (silu(rows[r]·gate[e]) * (rows[r]·up[e]))·down[e] for r in a group,
//                            0 for every row past the last group (pairs of experts held elsewhere)
//   partial, hidden    f32   scratch (per-split gate/up sums, the SwiGLU activations), outputs so that their
//                            addresses are fixed by XLA's buffer assignment and stay valid when a CUDA graph
//                            replays the call
//   groups [3, G]      int32 scratch: the table of work items the first kernel builds from group_sizes: each
//                            expert's rows in chunks of R = attr rows_per_item (row 0 expert id, row 1 first
//                            row, row 2 row count <= R; G = ops.moe.item_slots(M, E, R) slots, the unused
//                            ones zero), the same as kdtree_jax.ops.moe.group_table
//   num_active []      int32 scratch: how many of the G columns of `groups` are used
// Bad sizes never read or write out of bounds: negative sizes count as 0, and groups are clamped into
// rows [0, M).
//
// "moe_pairs" (ffi/moe_pairs.cu): the same experts on the router's (token, choice) pairs in place, for few pairs:
//   x       [T, H]   bf16  the tokens
//   experts [T, K]   int32 each pair's local expert; ids outside [0, E) are held elsewhere and add nothing
//   weights [T, K]   f32   each pair's routing weight
//   out     [T, H]   bf16  out[t] = sum over k (in order, float32) of weights[t, k] * bf16(expert_{t,k}(x[t])),
//                          i.e. routed_experts' result; expert(x) as above, bit-identical to the sorted op's row
//                          at the same split count
//   partial, hidden, pair_out, arrivals: scratch (per-split sums, SwiGLU activations, each pair's output, the
//                          "last block" counters the op zeroes itself)
// "moe_pairs_shared": the same plus the shared expert (shared_gate, shared_up [H, I], shared_down [I, H]; the routed
//   experts' H and I) on every token, weight 1, added last: out[t] = bf16(sum over k of weights[t, k] *
//   bf16(expert_{t,k}(x[t])) + bf16(shared(x[t]))), the sums in float32; its scratch holds T more pairs
#pragma once

#include "xla/ffi/api/ffi.h"

#if defined(KDTREE_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_moe_experts_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_moe_pairs_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_moe_pairs_shared_cuda);
#endif
