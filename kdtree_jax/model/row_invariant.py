"""Row-invariant forward passes: each token's row computed as it would be with no other rows (issue 24).

Greedy speculative decoding equals plain greedy decoding token for token only if a T-row verify pass computes
each row bit for bit as the one-token step does (tests/test_greedy_equality.py). Three things vary with the row
count on a GPU: the attention op's KV split count (the op's `split_policy="invariant"` fixes it), XLA's choice of
GEMM (cuBLAS algorithm, Triton tiling, split-K) by the row count M, and where XLA fuses and so where it keeps
bfloat16 intermediates in float32 ("excess precision"), which depends on the shapes. Measured on an H200
(ffi/tools/dense_row_invariance.py, benchmarks/results/dense_row_invariance_h200.md): with XLA_FLAGS
`--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0` (runtime.configure(row_invariant=True) sets them)
and the rows zero-padded to a multiple of 64 before a product, every product gave the M = 1 row's bits at every M
in 1..528; neither alone did.

`RowLayout` pads once per forward pass instead of around each product: the hidden stream runs as [P, hidden] rows,
P = max(64, ceil(B·T / 64) · 64), so every row-wise op of a pass with B·T ≤ 64 rows (the norms, rope, the
projections, the MLPs, the residual adds, the head) has exactly the shapes of the one-token step, whatever T is,
and XLA compiles the same kernels for them. Only the attention op sees the real rows ([B, T] back from the rows);
the routed experts take every row of the layout, the padding rows choosing no expert, so their sort and combine
have the layout's shapes too while their CUDA op (row-invariant by itself) computes the real rows only. (With the
combine at the real rows' shapes, a 1-row step and a 17-row pass of one sequence still differed: H200, 153ebf9.) Off (the default,
and always on a CPU, whose XLA needs another scheme: tests/test_greedy_equality.py), `flat` and `unflat` are the
identity and the traced program is exactly the plain one.

Meshes: the rows ("batch", "seq") are replicated in every layout of kdtree_jax/sharding.py and only the rows are
padded and sliced, so the feature dims keep their shardings.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

ROW_BLOCK = 64  # rows padded to a multiple of this, at least this many


def padded_row_count(rows: int) -> int:
    """max(64, ceil(rows / 64) * 64)."""
    return max(ROW_BLOCK, -(-rows // ROW_BLOCK) * ROW_BLOCK)


def pads_rows(row_invariant: bool) -> bool:
    """Whether a row-invariant pass pads its rows: on a GPU only (decided when the program is traced)."""
    return bool(row_invariant) and jax.default_backend() == "gpu"


def _fence(x):
    """x, behind an optimization barrier: XLA's simplifier would otherwise move a slice of the padded rows into the
    product that made them (slice(dot(x, w)) -> dot(slice(x), w)) or a pad out of one, and the product would run at
    the real row count again. (H200, 456b077: without it, with the GEMM flags, a 1-row step and a 17-row pass of
    one sequence gave different root rows.)"""
    return jax.lax.optimization_barrier(x)


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
        padded = padded_row_count(batch * seq) if pads_rows(row_invariant) else None
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
        return _fence(jnp.pad(x, ((0, self.padded - self.rows),) + ((0, 0),) * (x.ndim - 1)))

    def unflat(self, x):
        """The pass's layout -> [B, T, ...] (the real rows)."""
        if self.padded is None:
            return x
        return _fence(x)[: self.rows].reshape((self.batch, self.seq) + x.shape[1:])

    def real(self, x2d):
        """[rows of the layout, ...] -> the real rows [B·T, ...] (a flattened [B, T] layout is all real)."""
        return x2d if self.padded is None else _fence(x2d)[: self.rows]

    def no_experts(self, slots):
        """[rows of the layout, k] expert slots with the padding rows' set to -1 (no expert: the routed experts sort
        them past every group, where they add zeros), so that the experts' combine runs at the layout's shapes
        while the experts compute the real rows only."""
        if self.padded is None:
            return slots
        real = jnp.arange(self.padded)[:, None] < self.rows
        return jnp.where(real, slots, -1)

    def pad_back(self, x2d):
        """The real rows [B·T, ...] -> [rows of the layout, ...] (zeros in the padding rows)."""
        if self.padded is None:
            return x2d
        return _fence(jnp.pad(x2d, ((0, self.padded - self.rows),) + ((0, 0),) * (x2d.ndim - 1)))


__all__ = ["RowLayout", "padded_row_count", "pads_rows", "ROW_BLOCK"]
