// Grouped SwiGLU expert MLP for decode-sized token counts (ffi/moe_experts.cu; Python side:
// kdtree_jax/ops/moe.py).
//
// Semantics (those of `routed_experts` in kdtree_jax/model/moe.py, bf16 in and out, fp32 accumulation):
//   rows   [M, H]      bf16  the (token, k) pairs' inputs, sorted by local expert
//   gate   [E, H, I]   bf16, up [E, H, I], down [E, I, H]
//   groups [3, G]      int32 the active groups: row 0 expert id, row 1 first row, row 2 row count;
//                            groups are consecutive from row 0 (as the sort by expert leaves them)
//   num_active []      int32 how many of the G columns of `groups` are used
//   out    [M, H]      bf16  out[r] = (silu(rows[r]·gate[e]) * (rows[r]·up[e]))·down[e] for r in a group,
//                            0 for every row past the last group (pairs of experts held elsewhere)
//   hidden [M, I]      f32   scratch (the SwiGLU activations), an output so that its address is fixed by
//                            XLA's buffer assignment and stays valid when a CUDA graph replays the call
// Bad table entries never read or write out of bounds: an expert id outside [0, E) makes its group empty,
// row ranges are clamped into [0, M), num_active into [0, G].
#pragma once

#include "xla/ffi/api/ffi.h"

#if defined(KDTREE_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(kdtree_moe_experts_cuda);
#endif
