"""Row-invariant forward passes: each token's row computed as it would be with no other rows (issue 24).

Greedy speculative decoding equals plain greedy decoding token for token only if a T-row verify pass computes
each row bit for bit as the one-token step does (tests/test_greedy_equality.py). Three things vary with the row
count: the attention op's KV split count (the op's `split_policy="invariant"` fixes it), the matmul kernel XLA picks
by the row count M (GPU: cuBLAS algorithm, Triton tiling, split-K; CPU: YNNPACK/Eigen blockings), and where XLA fuses
and so where it keeps bfloat16 intermediates in float32 ("excess precision"), which depends on the shapes. Measured
on an H200 (ffi/tools/dense_row_invariance.py at 7a23dd2, benchmarks/results/history/dense_row_invariance_h200.md): with XLA_FLAGS
`--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0` and the rows zero-padded to a multiple of 64, every
product gave the M = 1 row's bits at M = 1..528 for single products; in the whole target the padded row count itself
(64 at a one-token step, 192 at B = 4 x 33) still changed layer 0's rows (H200, e95f8b0). On a CPU, products in fixed
16-row blocks with `--xla_allow_excess_precision=false` made the root rows exact (tests/test_greedy_equality.py).

So a row-invariant pass (`RowLayout` with `padded`) runs its hidden stream as [P, hidden] rows, P = max(128,
ceil(B·T / 64) · 64), and computes every row-wise part (the norms, the projections with rope, the MLPs with the
residual adds after them, the router's product, the routed and shared experts, the head) by `map`: over blocks of
64 rows, one at a time, so each product, norm and add has the same [64, ...] shape and the same neighbours in every
pass, whatever B and T are. At least two blocks, because XLA inlines a one-block loop and then fuses its products
with what surrounds them (a dot with the add after it: one rounding instead of two), which a loop body never does.
Only the attention op sees the real rows ([B, T] back from the rows); the routed experts' padding rows choose no
expert, and their grouped MLP takes the "row_invariant" formulation (ops/moe.py). On this repository's CPU (jax
0.10.2, the default pair in bfloat16) that made a verify pass's rows equal the one-token steps' bit for bit: root rows
at B x T = 1 x 17, 4 x 33, 16 x 17 and every row of 1 x 16 and 4 x 16 chains, through every layer
(tests/test_greedy_equality.py; ffi/tools/root_row_layers.py at 7a23dd2). On an H200 (745bb64) the root rows of those passes are
exact too and so is every row of a 1 x 16 chain, but rows 12-15 of a 4 x 16 chain are not: the attention op's invariant
split partition is cut from the root row's length, so a non-root row's KV splits differ from the one-token call's at
its position. End to end 12-14 of 16 greedy outputs equal autoregressive ones, and the step costs 4.5-7.8x the
default's: on a GPU each `lax.map` is a while loop the host drives
(benchmarks/results/history/spec_decode_row_invariant_h200.md). A partition of fixed position chunks (every row's splits then
those of its own one-token call) and loops the device runs itself are what this form lacks there.
runtime.configure(row_invariant=True) sets the XLA flags (Triton GEMMs, GEMM autotuning and excess precision off).
Off (the default: `padded` None), `flat`, `unflat` and `map` are the identity and the traced program is exactly the
plain one.

Meshes: the rows ("batch", "seq") are replicated in every layout of kdtree_jax/sharding.py and only the rows are
padded, sliced and blocked, so the feature dims keep their shardings.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

ROW_BLOCK = 64  # rows per block of a row-invariant pass; the rows are padded to a multiple, at least two blocks


def padded_row_count(rows: int) -> int:
    """max(128, ceil(rows / 64) * 64): whole blocks, at least two (a one-block loop is inlined; module docstring)."""
    return max(2 * ROW_BLOCK, -(-rows // ROW_BLOCK) * ROW_BLOCK)


class RowLayout(NamedTuple):
    """How a forward pass of B x T tokens lays out its rows: as [B, T, ...] (padded None) or as [P, ...] with the
    B·T real rows first and zero rows after (padded = P); `invariant`: the pass is row-invariant (its attention
    op then takes the T-independent split policy, on any backend)."""

    batch: int
    seq: int
    padded: int | None = None
    invariant: bool = False

    @staticmethod
    def of(batch: int, seq: int, row_invariant: bool) -> "RowLayout":
        padded = padded_row_count(batch * seq) if row_invariant else None
        return RowLayout(batch, seq, padded, bool(row_invariant))

    @property
    def split_policy(self) -> str:
        """The attention op's split policy for this pass (kdtree_jax/ops/ffi.py)."""
        return "invariant" if self.invariant else "occupancy"

    @property
    def rows(self) -> int:
        return self.batch * self.seq

    def flat(self, x):
        """[B, T, ...] -> the pass's layout ([P, ...], zero rows after the real ones; or as it is)."""
        if self.padded is None:
            return x
        x = x.reshape((self.rows,) + x.shape[2:])
        return jnp.pad(x, ((0, self.padded - self.rows),) + ((0, 0),) * (x.ndim - 1))

    def unflat(self, x):
        """The pass's layout -> [B, T, ...] (the real rows)."""
        if self.padded is None:
            return x
        return x[: self.rows].reshape((self.batch, self.seq) + x.shape[1:])

    def real(self, x2d):
        """[rows of the layout, ...] -> the real rows [B·T, ...] (a flattened [B, T] layout is all real)."""
        return x2d if self.padded is None else x2d[: self.rows]

    def map(self, fn, *xs):
        """fn(*xs) for a row-wise fn (each output row a function of its input rows) on the layout's rows: as it is
        unpadded; padded, over blocks of ROW_BLOCK rows one at a time (jax.lax.map), so that every product inside
        fn has the [ROW_BLOCK, ...] shape in every pass. Returns fn's output (an array or a tuple of them) with the
        layout's leading dim."""
        if self.padded is None:
            return fn(*xs)
        blocks = self.padded // ROW_BLOCK
        parts = tuple(x.reshape((blocks, ROW_BLOCK) + x.shape[1:]) for x in xs)
        out = jax.lax.map(lambda block: fn(*block), parts)
        return jax.tree.map(lambda y: y.reshape((self.padded,) + y.shape[2:]), out)

    def no_experts(self, slots):
        """[rows of the layout, k] expert slots with the padding rows' set to -1 (no expert: the routed experts sort
        them past every group, where they add zeros), so that the experts' combine runs at the layout's shapes
        while the experts compute the real rows only."""
        if self.padded is None:
            return slots
        real = jnp.arange(self.padded)[:, None] < self.rows
        return jnp.where(real, slots, -1)


__all__ = ["RowLayout", "padded_row_count", "ROW_BLOCK"]
