"""Grouped SwiGLU expert MLP: XLA's ragged_dot everywhere, a CUDA grouped GEMV on GPU at small row counts.

`grouped_expert_mlp(rows, group_sizes, gate, up, down)` computes, for rows sorted by expert (group e is the
next group_sizes[e] rows; rows past sum(group_sizes) belong to no group and give zeros),

    out[r] = (silu(rows[r] @ gate[e]) * (rows[r] @ up[e])) @ down[e]

which is what `routed_experts` (model/moe.py) runs after sorting its (token, expert) pairs.

Why two implementations.  In a decode / verify step (T = 1..64 tokens × top-8) almost every active expert
gets one or two rows, so the op is a grouped GEMV whose cost is reading the active experts' weights once.
XLA's ragged_dot is several times off that floor there; the CUDA op (ffi/moe_experts.cu) reads each
active expert's weights once and never touches inactive experts.  It runs four kernels: the table of work
items (expert id, first row, row count <= `CUDA_ROWS_PER_ITEM`: each expert's rows in chunks, each chunk
its own blocks; `group_table` in jnp) from group_sizes, gate/up partial sums over splits of the hidden
dim, their sum + SwiGLU, and the down projection.  With many rows per expert (prefill) a tensor-core GEMM wins, so "auto" keeps ragged_dot above
`CUDA_MAX_ROWS` rows.

A third path skips the sort altogether: `pair_expert_mlp` (ffi/moe_pairs.cu) takes the router's (token, choice)
pairs where they are and returns each token's weighted sum, in three kernels (one zeroes its arrival counters).  With few pairs (an
autoregressive step, a short verify pass) nearly every pair has its own expert, and the sorted op's bookkeeping (the
sort, the row gather, the counts, the table, the finish kernel, the gather back and the combine: ~10 launches) cost
more than its GEMVs: on an H200, K2's TP8-rank slice at T = 1 went from 79 to 57 us a call in-loop (kernels 38 us
against a 20.5 us floor), the default pair's autoregressive step from 200 to 170 kernels and 12-22% more tok/s
(benchmarks/results/moe_pairs_h200.md, spec_decode_moe_ab_*_h200.md).  routed_experts (model/moe.py) takes it on a
GPU up to PAIRS_MAX pairs; above that pairs share experts often enough that reading an expert's weights once per 4
rows wins (K2 T = 33: 644 vs 757 us).

The table and the count of active groups are device data, so nothing syncs with the host and the call
can sit inside `lax.while_loop` / CUDA graphs.  Its grid has a static number of item slots (`item_slots`:
the most items M rows can fill); slots past the active count exit at once.  `jax.lax.platform_dependent` picks the CUDA
branch when the program is lowered for a GPU.

On a CPU, XLA lowers ragged_dot to one dense product over every expert after transposing all expert
weights ([E, H, I] -> [H, E*I]); inside a decode loop that copies every expert's weights at every step.
For a few rows, "auto" on a CPU reads just the rows' own experts instead (a gather and three batched
products: `gathered_mlp`), whose cost grows with the gathered weights. One MoE layer of the default pair
alone (E = 8, H = I = 256, float32, 2 cores): 20 vs 152 us at 2 rows, 98 vs 329 at 18, 233 vs 527 at 34. In
the whole decode loop the gathered copies compete with everything else and the crossover comes much
earlier (median batch-1 tok/s of 4 prompts, gathered vs ragged_dot, runs on a shared 2-core VM that vary by
~20%): autoregressive, 2 rows, 663-692 vs 367-386; DDTree 8, 18 rows, 594-771 vs 719-750 (no clear
winner); the chain's 32 rows, 592 vs 690. `CPU_GATHER_*` keep it to the clear case, a few rows.
Above that, a decode loop passes the weights laid out as the dense product reads them (`dense_mlp`,
computed once before the loop: CPU float32, default pair, DDTree 16 1,066 -> 1,270 tok/s).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.ops.ffi import register_cuda_handler  # the CUDA op lives in the verify op's extension

TARGET = "kdtree_moe_experts"
PAIRS_TARGET = "kdtree_moe_pairs"
PAIRS_SHARED_TARGET = "kdtree_moe_pairs_shared"
IMPLS = ("auto", "xla", "cuda", "dense", "row_invariant")
# "auto" uses the CUDA op up to this many rows (token, expert pairs on one device) and ragged_dot above.
# Measured on an H200 (benchmarks/results/history/moe_experts_h200.md, K2 widths, 4-way ep/tp slices): the CUDA op
# wins at every size tried, 5-6x at T = 9 and still 6-8x at T = 256 (2048 rows, ~5 rows per active
# expert); rows beyond that (prefill) were not measured, so they keep ragged_dot's tensor-core GEMMs, which
# must win once each expert has many rows (the CUDA op re-reads an expert's weights per 4 rows).
CUDA_MAX_ROWS = 2048
# Kernel 1 splits the hidden dim into blocks of about this many rows (~256 KB of gate+up weights per block:
# enough blocks for several waves even when only a couple of experts are active), keeping its per-split
# partial sums (scratch) under PARTIAL_BYTES.
CUDA_SPLIT_ROWS = 1024
PARTIAL_BYTES = 64 << 20
# Rows of one expert per work item of the CUDA op: an expert with n rows runs as ceil(n / R) items in
# separate blocks, side by side.  With one item per expert (the op before), the default pair's 8 experts at
# a batch-16 DDTree 16 step (544 rows, ~68 per expert) gave 32 blocks on 132 SMs, each walking 17 chunks of 4
# rows in sequence.  4 = the kernels' accumulator rows: one chunk per block.  Tests pass other R to
# call_cuda_op (a large R gives back one item per expert).
CUDA_ROWS_PER_ITEM = 4
MAX_ITEM_SLOTS = 65535  # the kernels' grid y / z limit
# "auto" on a GPU runs routed experts on the (token, choice) pairs in place (`pair_expert_mlp`: no sort, gather,
# table or combine launches) up to this many pairs on a device, the sorted op above (where pairs share experts
# often enough that reading an expert's weights once per 4 rows wins).  72 = K2's T = 9 verify pass (9 x 8): in
# the K2 TP8-rank step (H200, 25 layers, 64k, T = 9, 01282aa) the pairs op took the step from 9.56 to 9.35 ms
# (MoE 5.72 -> 5.52 ms, 1,052 -> 836 kernels a step); at T = 33 (264 pairs) the sorted op wins (644 vs 757 us a
# layer in-loop, moe_pairs_h200.md).
PAIRS_MAX = 72
# The model runs a shared expert inside the pairs op (pair_expert_mlp(shared=...), MoE.folds_shared) up to this many
# tokens: each token's shared pair reads the shared expert's weights again, where XLA's product reads them once.  One
# K2 TP8-rank MoE layer (H100, fa0e52c, benchmarks/results/history/moe_shared_fold_h100_fa0e52c.md): pairs op + XLA
# shared expert against the fold, 78.7 -> 68.7 us at T = 1, 172.0 -> 166.1 at T = 4, 341.8 -> 360.2 at T = 9 (a repeat
# at 4d9fce1: 91.0 -> 85.5, 177.8 -> 162.7, 327.9 -> 332.3).
SHARED_FOLD_MAX_TOKENS = 4
# The pairs op's down kernel issues this many of a slice's 8-row steps' loads together (ffi/moe_device.cuh down_sums:
# 2 keeps 256 bytes in flight a thread, as the gate/up kernel does; the sums' order, and so the bits, do not change).
# One K2 TP8-rank MoE layer, the shared expert apart (H100, same run, 4d9fce1, history/moe_shared_fold_h100_4d9fce1.md):
# 1 -> 2: 91.0 -> 87.4 us at T = 1, 177.8 -> 170.2 at T = 4, 327.9 -> 320.3 at T = 9.
PAIRS_DOWN_UNROLL = 2
# "auto" on a GPU runs every held expert on every token (`all_experts_routed`: no sort, gather, table or combine
# launches, three tensor-core products) past PAIRS_MAX pairs when the pairs can be expected to reach every held expert
# (pairs >= experts held) and the products over all of them stay under this many FLOPs (~5 us of an H200's tensor
# cores): models with few experts at batch, e.g. the default pair's 8 experts at a batch-16 DDTree step (272 tokens:
# 0.9 GFLOP a layer, against ~20 launches of the sorted op). A K2 slice (48-384 experts of 7168 x 256) never takes it.
# H200, the default pair's engine, same build, this at 0 in the other arm: DDTree 16 at batch 16 0.735 vs 0.831 ms a
# step (MoE 0.121 vs 0.230 ms, 266 vs 302 kernels), DDTree 32 0.829 vs 0.986 ms
# (benchmarks/results/history/spec_decode_all_experts_ab_h200_891f4ed_{new,old}.md).
ALL_EXPERTS_MAX_FLOPS = 2e9


# "auto" on a CPU gathers the rows' experts up to this many rows per expert and while the gathered gate, up
# and down weights stay under this many bytes (the default pair: up to 10 rows; see the module docstring).
CPU_GATHER_ROWS_PER_EXPERT = 4
CPU_GATHER_MAX_BYTES = 8 << 20
# "row_invariant" gathers the rows' experts up to this many bytes of gathered weights (a 64-row block of the default
# pair: 3 MB), above it the "auto" formulation (not row-invariant on a CPU: say so where it matters).
ROW_INVARIANT_GATHER_MAX_BYTES = 256 << 20


def cuda_built() -> bool:
    """True when the extension holds the CUDA grouped-MLP handler (it is registered on first use)."""
    return register_cuda_handler(TARGET, "moe_experts_cuda_handler")


def pairs_built() -> bool:
    """True when the extension holds the CUDA pairs handler (registered on first use)."""
    return cuda_built() and register_cuda_handler(PAIRS_TARGET, "moe_pairs_cuda_handler")


def pairs_shared_built() -> bool:
    """True when the extension holds the CUDA pairs handler with the shared expert (registered on first use)."""
    return pairs_built() and register_cuda_handler(PAIRS_SHARED_TARGET, "moe_pairs_shared_cuda_handler")


# Register budget of the CUDA kernels (their `blocks_per_sm` attribute): 4 blocks per SM (128 registers), the
# default, or 1 (~200 registers, 2 fit). Benchmarks and tests pass 1 explicitly for A/B runs.
CUDA_BLOCKS_PER_SM = 4
BLOCKS_PER_SM_CHOICES = (1, 4)


def _check_blocks_per_sm(blocks_per_sm: int) -> None:
    if blocks_per_sm not in BLOCKS_PER_SM_CHOICES:
        raise ValueError(f"blocks_per_sm must be one of {BLOCKS_PER_SM_CHOICES}; got {blocks_per_sm!r}")


# Every XLA formulation below rounds where the others do (issue 24): gate and up accumulate in float32 and the
# SwiGLU runs on those float32 sums, h is rounded once to the rows' dtype, the down projection accumulates in
# float32 and is rounded once. A decode loop switches formulation with the row count (gathered for a few rows,
# dense above), so a row's result must not depend on which one ran beyond what the products themselves do.


def ragged_mlp(rows, group_sizes, gate, up, down):
    """The XLA formulation (routed_experts' original three ragged_dots)."""
    f32 = jnp.float32
    h = (jax.nn.silu(jax.lax.ragged_dot(rows, gate, group_sizes, preferred_element_type=f32))
         * jax.lax.ragged_dot(rows, up, group_sizes, preferred_element_type=f32)).astype(rows.dtype)
    return jax.lax.ragged_dot(h, down, group_sizes, preferred_element_type=f32).astype(rows.dtype)


def row_experts(group_sizes, num_rows: int):
    """[num_rows] the group (expert) of each row; E for rows past every group."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(num_rows, dtype=ends.dtype), side="right")


def gathered_mlp(rows, group_sizes, gate, up, down):
    """The same op reading only each row's own expert (see the module docstring: for a few rows on a CPU)."""
    num_experts = gate.shape[0]
    expert = row_experts(group_sizes, rows.shape[0])
    e = jnp.minimum(expert, num_experts - 1)
    f32 = jnp.float32
    h = (jax.nn.silu(jnp.einsum("mh,mhi->mi", rows, gate[e], preferred_element_type=f32))
         * jnp.einsum("mh,mhi->mi", rows, up[e], preferred_element_type=f32)).astype(rows.dtype)
    out = jnp.einsum("mi,mih->mh", h, down[e], preferred_element_type=f32)
    return jnp.where((expert < num_experts)[:, None], out, 0).astype(rows.dtype)


def dense_mlp(rows, group_sizes, gate_t, up_t, down_t):
    """The same op as one dense product per weight over every expert, with the weights laid out expert axis
    second (gate_t, up_t [H, E, I], down_t [I, E, H]): row r's input is placed in the slot of its expert,
    x_r (x) onehot(e_r) = [K * E], and multiplies the weights viewed as [K * E, N].  This is how XLA:CPU
    lowers ragged_dot, but there the weights arrive [E, K, N] and are transposed to [K, E, N] at every call:
    in a decode loop that copied every expert's weights at every step.  A loop that computes the transposed
    weights once, before its body, reads them in place here."""
    num_rows, _ = rows.shape
    num_experts = gate_t.shape[1]
    expert = row_experts(group_sizes, num_rows)
    onehot = (expert[:, None] == jnp.arange(num_experts)[None, :]).astype(rows.dtype)  # [M, E]; no group: zeros

    def expanded_dot(x, w_t):  # x [M, K] @ w_t [K, E, N] on each row's expert, accumulated in float32
        k, e, n = w_t.shape
        return jnp.dot((x[:, :, None] * onehot[:, None, :]).reshape(num_rows, k * e), w_t.reshape(k * e, n),
                       preferred_element_type=jnp.float32)

    h = (jax.nn.silu(expanded_dot(rows, gate_t)) * expanded_dot(rows, up_t)).astype(rows.dtype)
    return expanded_dot(h, down_t).astype(rows.dtype)


def all_experts_mlp(rows, group_sizes, gate, up, down):
    """The same op as dense products over every expert, on the weights as they are ([E, H, I], [E, I, H]):
    gate and up of every row under every expert ([M, E, I], E times the FLOPs of the grouped op), the SwiGLU
    zeroed outside each row's own expert, then one product [M, E * I] @ down viewed as [E * I, H].  Tensor-core
    GEMMs with no ragged bookkeeping: a candidate where experts are few and rows per expert many (the default
    pair at batch; impl="dense").  Rounds as the others do (float32 sums, h rounded once)."""
    num_rows, _ = rows.shape
    num_experts, _, inter = gate.shape
    expert = row_experts(group_sizes, num_rows)
    mine = expert[:, None] == jnp.arange(num_experts)[None, :]  # [M, E]; a row of no group: all False
    f32 = jnp.float32
    g = jnp.einsum("mh,ehi->mei", rows, gate, preferred_element_type=f32)
    u = jnp.einsum("mh,ehi->mei", rows, up, preferred_element_type=f32)
    h = jnp.where(mine[:, :, None], jax.nn.silu(g) * u, 0).astype(rows.dtype).reshape(num_rows, num_experts * inter)
    return jnp.dot(h, down.reshape(num_experts * inter, -1), preferred_element_type=f32).astype(rows.dtype)


def gathered_bytes(rows, gate) -> int:
    """Bytes of expert weights `gathered_mlp` gathers for these rows (gate, up and down: one expert's each a row)."""
    _, hidden, inter = gate.shape
    return 3 * rows.shape[0] * hidden * inter * gate.dtype.itemsize


def use_cpu_gather(rows, gate, impl: str) -> bool:
    """Whether the CPU branch of "auto" gathers the rows' experts (else ragged_dot, or dense_mlp in a decode loop)."""
    return (impl == "auto" and rows.shape[0] <= CPU_GATHER_ROWS_PER_EXPERT * gate.shape[0]
            and gathered_bytes(rows, gate) <= CPU_GATHER_MAX_BYTES)


def item_slots(num_rows: int, num_experts: int, rows_per_item: int) -> int:
    """Static item slots of the CUDA op: the most work items (chunks of <= R rows of one expert) that M rows
    can fill.  a <= min(M, E) experts with n_e >= 1 rows, sum n_e <= M, give sum ceil(n_e / R) <=
    (M + a (R - 1)) / R items, and never more than M."""
    active = min(num_rows, num_experts)
    return max(1, min(num_rows, (num_rows + active * (rows_per_item - 1)) // rows_per_item))


def rows_per_item(num_rows: int, num_experts: int, requested: int = CUDA_ROWS_PER_ITEM) -> int:
    """R of the CUDA op (`requested`, by default `CUDA_ROWS_PER_ITEM`), doubled while the item slots would
    exceed the grid limit (only at M > 65535 rows)."""
    if requested < 1:
        raise ValueError(f"rows_per_item must be >= 1; got {requested}")
    r = requested
    while item_slots(num_rows, num_experts, r) > MAX_ITEM_SLOTS and r < num_rows:
        r *= 2
    return r


def group_table(group_sizes, num_rows: int, per_item: int | None = None):
    """(items [3, W] int32: expert id / first row / row count of each work item in order, num_active []
    int32): each expert with rows gives its rows in chunks of R = per_item (the last one shorter), in
    expert order, in W = item_slots(M, E, R) static slots; unused slots are (0, 0, 0).  R defaults to the
    CUDA op's (`rows_per_item`); R >= M gives one item per active expert in min(M, E) slots.
    The CUDA op builds this table itself, in one kernel (it was ~8 small XLA kernels); this is its
    statement in jnp, which the GPU tests compare it with (sizes with sum <= M; the op also clamps bad ones)."""
    num_experts = group_sizes.shape[0]
    r = per_item if per_item is not None else rows_per_item(num_rows, num_experts)
    slots = item_slots(num_rows, num_experts, r)
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    chunks = (sizes + r - 1) // r  # items of each expert
    ends = jnp.cumsum(chunks)
    w = jnp.arange(slots, dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(ends, w, side="right"), num_experts - 1).astype(jnp.int32)
    chunk = w - (ends[expert] - chunks[expert])
    num_active = jnp.minimum(ends[-1], slots).astype(jnp.int32)
    used = w < num_active
    items = jnp.stack([jnp.where(used, expert, 0), jnp.where(used, starts[expert] + chunk * r, 0),
                       jnp.where(used, jnp.minimum(sizes[expert] - chunk * r, r), 0)]).astype(jnp.int32)
    return items, num_active


def choose_splits(num_rows: int, hidden: int, inter: int) -> int:
    """Hidden-dim splits of kernel 1, from static shapes only."""
    per_split = max(1, num_rows * 2 * inter * 4)
    return int(max(1, min(-(-hidden // CUDA_SPLIT_ROWS), PARTIAL_BYTES // per_split)))


def call_cuda_op(rows, group_sizes, gate, up, down, requested_rows_per_item: int = CUDA_ROWS_PER_ITEM,
                 blocks_per_sm: int = CUDA_BLOCKS_PER_SM):
    """The CUDA op's outputs: (out, groups, num_active), the last two the work-item table its first kernel
    built (what `group_table` computes; exposed for tests, which also vary the rows per work item).
    `blocks_per_sm`: the kernels' register budget (BLOCKS_PER_SM_CHOICES)."""
    _check_blocks_per_sm(blocks_per_sm)
    num_rows, hidden = rows.shape
    num_experts, _, inter = gate.shape
    splits = choose_splits(num_rows, hidden, inter)
    per_item = rows_per_item(num_rows, num_experts, requested_rows_per_item)
    slots = item_slots(num_rows, num_experts, per_item)
    # Scratch as outputs (fixed addresses under CUDA graphs, as in ops/ffi.py): per-split gate/up partial
    # sums, the SwiGLU activations, the work-item table.
    out_types = (jax.ShapeDtypeStruct((num_rows, hidden), rows.dtype),
                 jax.ShapeDtypeStruct((splits * num_rows * 2, inter), jnp.float32),
                 jax.ShapeDtypeStruct((num_rows, inter), jnp.float32),
                 jax.ShapeDtypeStruct((3, slots), jnp.int32),
                 jax.ShapeDtypeStruct((), jnp.int32))
    call = jax.ffi.ffi_call(TARGET, out_types, vmap_method="sequential")
    out, _, _, groups, num_active = call(rows, gate, up, down, group_sizes.astype(jnp.int32),
                                         blocks_per_sm=np.int64(blocks_per_sm), splits=np.int64(splits),
                                         rows_per_item=np.int64(per_item))
    return out, groups, num_active


def pair_expert_mlp(x2d, experts, weights, gate, up, down, splits: int | None = None,
                    blocks_per_sm: int = CUDA_BLOCKS_PER_SM, shared=None, down_unroll: int = PAIRS_DOWN_UNROLL):
    """out [T, H] = sum over k of weights[t, k] * expert_{experts[t, k]}(x2d[t]), the CUDA pairs op (a GPU, bf16).

    x2d [T, H]; experts [T, K] local expert ids (ids outside [0, E) are held elsewhere and add nothing); weights
    [T, K]; gate, up [E, H, I]; down [E, I, H].  Each pair's expert output is rounded to bf16 and the weighted sum
    runs in float32 in choice order (routed_experts' rounding).  `splits`: kernel 1's hidden-dim splits, by default
    the sorted op's (`choose_splits`), at which a pair's expert output equals the sorted op's row bit for bit, so
    a token's result does not depend on which op ran (how many pairs the call had).

    `shared`: (gate [H, I], up [H, I], down [I, H]), a shared expert of the routed experts' width run on every token in
    the same kernels (one more pair per token, weight 1, added after the routed choices in the same float32 sum:
    out[t] = bf16(routed sum + bf16(shared(x[t])))); `splits` then stays the routed pairs' choice.  `down_unroll`:
    1 or 2, PAIRS_DOWN_UNROLL (benchmarks pass it for A/B runs)."""
    _check_blocks_per_sm(blocks_per_sm)
    if down_unroll not in (1, 2):
        raise ValueError(f"pair_expert_mlp: down_unroll must be 1 or 2; got {down_unroll!r}")
    if not pairs_built():  # also registers the target: a first call here must find it
        raise ValueError("pair_expert_mlp needs the CUDA extension (built with nvcc): this one has no pairs op")
    if shared is not None and not pairs_shared_built():
        raise ValueError("pair_expert_mlp(shared=...) needs an extension with the shared-expert pairs op; rebuild it")
    num_tokens, hidden = x2d.shape
    num_experts, _, inter = gate.shape
    top_k = experts.shape[1]
    if splits is None:
        splits = choose_splits(num_tokens * top_k, hidden, inter)
    pairs = num_tokens * (top_k + (shared is not None))
    i_tiles, h_tiles = -(-inter // 64), -(-hidden // 64)
    out_types = (jax.ShapeDtypeStruct((num_tokens, hidden), x2d.dtype),
                 jax.ShapeDtypeStruct((splits * pairs * 2, inter), jnp.float32),
                 jax.ShapeDtypeStruct((pairs, inter), jnp.float32),
                 jax.ShapeDtypeStruct((pairs, hidden), jnp.bfloat16),
                 jax.ShapeDtypeStruct((pairs * i_tiles + num_tokens * h_tiles,), jnp.int32))
    target = PAIRS_TARGET if shared is None else PAIRS_SHARED_TARGET
    call = jax.ffi.ffi_call(target, out_types, vmap_method="sequential")
    return call(x2d, experts.astype(jnp.int32), weights.astype(jnp.float32), gate, up, down, *(shared or ()),
                blocks_per_sm=np.int64(blocks_per_sm), splits=np.int64(splits), down_unroll=np.int64(down_unroll))[0]


def weighted_pair_sum(pair_out, held, weights, dtype):
    """Each token's sum over its k choices of weight * expert output, in float32 in choice order, rounded once to
    `dtype`; choices not `held` here add nothing. pair_out [T, K, H] (each expert output already rounded), held and
    weights [T, K]. The combine every XLA route of routed experts shares (issue 24: a token's result must not depend on
    the route)."""
    pair_weight = jnp.where(held, weights, 0.0).astype(jnp.float32)
    return (pair_out.astype(jnp.float32) * pair_weight[:, :, None]).sum(axis=1).astype(dtype)


def all_experts_routed(x2d, experts, weights, gate, up, down):
    """out [T, H] = sum over k of weights[t, k] * expert_{experts[t, k]}(x2d[t]), as pair_expert_mlp, computed as every
    held expert on every token (E times the pairs' FLOPs) and the chosen pairs picked from the result.

    experts [T, K] local ids (ids outside [0, E) are held elsewhere and add nothing). Rounds as the sorted op and the
    pairs op do (issue 24): gate and up in float32, h rounded once, each pair's expert output rounded to x2d's dtype,
    the weighted sum in float32 in choice order."""
    num_tokens, _ = x2d.shape
    num_local = gate.shape[0]
    f32 = jnp.float32
    g = jnp.einsum("th,ehi->eti", x2d, gate, preferred_element_type=f32)
    u = jnp.einsum("th,ehi->eti", x2d, up, preferred_element_type=f32)
    h = (jax.nn.silu(g) * u).astype(x2d.dtype)
    every = jnp.einsum("eti,eih->eth", h, down, preferred_element_type=f32).astype(x2d.dtype)  # [E, T, H]
    held = (experts >= 0) & (experts < num_local)
    pair_out = every[jnp.where(held, experts, 0), jnp.arange(num_tokens)[:, None]]  # [T, K, H]
    return weighted_pair_sum(pair_out, held, weights, x2d.dtype)


def use_all_experts(num_pairs: int, x2d, gate, impl: str) -> bool:
    """Whether routed_experts' GPU branch runs `all_experts_routed` (few experts, many pairs; see ALL_EXPERTS_MAX_FLOPS)."""
    num_local, hidden, inter = gate.shape
    flops = 6.0 * x2d.shape[0] * num_local * hidden * inter
    return impl == "auto" and num_pairs > PAIRS_MAX and num_pairs >= num_local and flops <= ALL_EXPERTS_MAX_FLOPS


def use_pairs(num_pairs: int, x2d, gate, up, down, impl: str) -> bool:
    """Whether routed_experts' GPU branch runs `pair_expert_mlp` (else the experts on rows sorted by expert)."""
    if impl not in ("auto", "pairs") or not pairs_built():
        return False
    if not all(a.dtype == jnp.bfloat16 for a in (x2d, gate, up, down)):
        return False
    return impl == "pairs" or num_pairs <= PAIRS_MAX


def _call_cuda(rows, group_sizes, gate, up, down, blocks_per_sm: int = CUDA_BLOCKS_PER_SM):
    return call_cuda_op(rows, group_sizes, gate, up, down, blocks_per_sm=blocks_per_sm)[0]


def validate_args(rows, group_sizes, gate, up, down, impl: str) -> None:
    """Static shape/dtype checks with errors that name the argument (no device work)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    if rows.ndim != 2:
        raise ValueError(f"rows must be [M, H]; got shape {rows.shape}")
    hidden = rows.shape[1]
    if gate.ndim != 3 or gate.shape[1] != hidden:
        raise ValueError(f"gate must be [E, H={hidden}, I]; got shape {gate.shape}")
    num_experts, _, inter = gate.shape
    if up.shape != gate.shape:
        raise ValueError(f"up must be [E, H, I] = {list(gate.shape)}; got shape {up.shape}")
    if down.shape != (num_experts, inter, hidden):
        raise ValueError(f"down must be [E, I, H] = {[num_experts, inter, hidden]}; got shape {down.shape}")
    if group_sizes.shape != (num_experts,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be [E={num_experts}] integers; got {group_sizes.dtype} {group_sizes.shape}")
    if num_experts > 65535:
        raise ValueError(f"at most 65535 experts per device; got {num_experts}")
    if impl == "cuda" and not all(a.dtype == jnp.bfloat16 for a in (rows, gate, up, down)):
        raise ValueError("impl='cuda' takes bfloat16 rows, gate, up and down; got "
                         f"{rows.dtype}, {gate.dtype}, {up.dtype}, {down.dtype}")


def use_cuda(rows, gate, up, down, impl: str) -> bool:
    """Whether the GPU branch runs the CUDA op (else ragged_dot on every platform)."""
    if impl in ("xla", "dense") or not cuda_built():
        return False
    if not all(a.dtype == jnp.bfloat16 for a in (rows, gate, up, down)):
        return False
    return impl == "cuda" or rows.shape[0] <= CUDA_MAX_ROWS


def grouped_expert_mlp(rows, group_sizes, gate, up, down, impl: str = "auto", expert_second=None,
                       blocks_per_sm: int = CUDA_BLOCKS_PER_SM):
    """out [M, H] = per-row SwiGLU of its group's expert (see the module docstring).

    rows [M, H]; group_sizes [E] (group e = the next group_sizes[e] rows, sum <= M); gate, up [E, H, I];
    down [E, I, H].  impl: "xla" = ragged_dot everywhere; "cuda" = the CUDA op on GPU (bf16 only), ragged_dot
    elsewhere; "dense" = `all_experts_mlp` everywhere (every expert on every row, masked: for few experts); "auto" = "cuda" on GPU for bf16 with M <= CUDA_MAX_ROWS, `gathered_mlp` on CPU for a few rows
    (`use_cpu_gather`), else "xla", except that on a CPU, given `expert_second` (the same weights laid out
    expert axis second, see `dense_mlp`: what a decode loop computes once), "auto" runs `dense_mlp` on them.
    "row_invariant" (what a row-invariant pass runs, model/row_invariant.py): a row's result independent of the other
    rows and of its place among them: the CUDA op on a GPU (bf16: one GEMV chain per row), `gathered_mlp` elsewhere
    (per-row products of the gathered weights) up to ROW_INVARIANT_GATHER_MAX_BYTES, else "auto".
    `blocks_per_sm`: the CUDA op's register budget (BLOCKS_PER_SM_CHOICES; the default everywhere but
    benchmarks and tests); the other formulations ignore it.
    """
    validate_args(rows, group_sizes, gate, up, down, impl)
    _check_blocks_per_sm(blocks_per_sm)
    args = (rows, group_sizes, gate, up, down)
    if impl == "dense":
        return all_experts_mlp(*args)
    if impl == "row_invariant":
        if gathered_bytes(rows, gate) > ROW_INVARIANT_GATHER_MAX_BYTES:
            impl = "auto"
        else:
            branches = ({"cuda": functools.partial(_call_cuda, blocks_per_sm=blocks_per_sm)}
                        if use_cuda(rows, gate, up, down, impl) else {})
            return jax.lax.platform_dependent(*args, **branches, default=gathered_mlp)
    branches = {}
    if use_cuda(rows, gate, up, down, impl):
        branches["cuda"] = functools.partial(_call_cuda, blocks_per_sm=blocks_per_sm)
    if use_cpu_gather(rows, gate, impl):
        branches["cpu"] = gathered_mlp
    elif impl == "auto" and expert_second is not None:
        branches["cpu"] = lambda r, sizes, *_: dense_mlp(r, sizes, *expert_second)
    if not branches:
        return ragged_mlp(*args)
    return jax.lax.platform_dependent(*args, **branches, default=ragged_mlp)


__all__ = ["grouped_expert_mlp", "pair_expert_mlp", "use_pairs", "all_experts_routed", "use_all_experts",
           "weighted_pair_sum", "ragged_mlp", "gathered_mlp", "dense_mlp", "all_experts_mlp", "group_table",
           "item_slots", "rows_per_item", "choose_splits", "cuda_built", "CUDA_MAX_ROWS", "IMPLS", "CUDA_BLOCKS_PER_SM",
           "BLOCKS_PER_SM_CHOICES"]
