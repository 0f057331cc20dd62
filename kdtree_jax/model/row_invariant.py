"""The target's dense products with rows that do not depend on how many rows share the product (issue 24).

Greedy speculative decoding is lossless only if a T-row verify pass computes each row as the one-token step does
(tests/test_greedy_equality.py). On a GPU, XLA picks a GEMM (cuBLAS algorithm, Triton tiling, split-K) from the
row count M, so row 0 of an M-row bfloat16 product differs from the same row computed with M = 1. Measured on an
H200 (jax 0.11.2, ffi/tools/dense_row_invariance.py; /work/.device/2/dense_row_invariance_nvidia_h200.md): with
XLA_FLAGS `--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0` (kdtree_jax.runtime.configure() sets
them) AND the rows padded with zeros to a multiple of 64 (at least 64) before the product, every shape tried (the
default pair's projections, router and head, K2's 7168 x 2048) at every M in {1 .. 528} gave bit-identical rows,
bfloat16 and float32-accumulated alike. Neither the flags alone nor the padding alone did.

`rowwise(fn, *xs, pad=...)` is that padding: it flattens the leading (row) dims of its inputs to M rows, pads
them with zeros to `padded_row_count(M)`, runs `fn` (which must be row-wise: each output row a function of its
input rows only, like a projection, an MLP, a norm or rope), slices the M rows back and restores the leading
dims. The target's modules call it around their products with `pad=pads_rows(self.row_invariant)`: padding only
on a GPU (decided at trace time from the default backend) and only while the module's `row_invariant` switch is
on (on by construction; `set_row_invariance(target, False)` turns it off, e.g. benchmarks/spec_decode.py's
--no-row-invariance to measure the cost). On a CPU it never pads (XLA:CPU needs another scheme, see
tests/test_greedy_equality.py's docstring): the traced program is exactly the plain one.

Meshes: the rows ("batch", "seq") are replicated in every layout of kdtree_jax/sharding.py, and only the rows are
padded and sliced, so the feature dims keep their shardings (heads, mlp, vocab_out) and GSPMD partitions the
products as before. If a layout ever splits the rows, this stays correct (a pad and slice of a split dim), but
XLA would re-shard around it: pad per shard then, inside a shard_map.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

ROW_BLOCK = 64  # rows padded to a multiple of this, at least this many


def padded_row_count(rows: int) -> int:
    """max(64, ceil(rows / 64) * 64)."""
    return max(ROW_BLOCK, -(-rows // ROW_BLOCK) * ROW_BLOCK)


def pads_rows(row_invariant: bool) -> bool:
    """Whether a module with this switch pads its products' rows: on a GPU only (read when the program is traced)."""
    return bool(row_invariant) and jax.default_backend() == "gpu"


def rowwise(fn: Callable, *xs, pad: bool, row_dims: int | None = None):
    """fn(*xs) with the rows padded to `padded_row_count` first when `pad` (else exactly fn(*xs)).

    The first `row_dims` dims of every x are its rows (default: all but the first x's last dim), the same leading
    shape in every x; fn must be row-wise. Returns fn's output (an array or a tree of arrays) with those leading
    dims restored."""
    if not pad:
        return fn(*xs)
    row_dims = xs[0].ndim - 1 if row_dims is None else row_dims
    lead = xs[0].shape[:row_dims]
    if any(x.shape[:row_dims] != lead for x in xs):
        raise ValueError(f"rowwise: leading dims differ: {[x.shape for x in xs]} (row_dims {row_dims})")
    rows = 1
    for d in lead:
        rows *= d
    extra = padded_row_count(rows) - rows

    def flat(x):
        x = x.reshape((rows,) + x.shape[row_dims:])
        return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1))

    out = fn(*(flat(x) for x in xs))
    return jax.tree.map(lambda y: y[:rows].reshape(lead + y.shape[1:]), out)


def dense(x, kernel, *, pad: bool, preferred_element_type=None):
    """x [..., K] @ kernel [K, N] through `rowwise` (the product of tests and probes; the model wraps its own)."""
    return rowwise(lambda r: jnp.dot(r, kernel, preferred_element_type=preferred_element_type), x, pad=pad)


def set_row_invariance(model: nnx.Module, enabled: bool) -> nnx.Module:
    """In place (and returned): every module of `model` with a `row_invariant` switch (the target's Transformer,
    decoder layers, MLA and MoE) set to `enabled`. Set it before the model's programs are traced: the switch is a
    static attribute, read at trace time, like MLA.placement (sharding.attach_mesh)."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and hasattr(module, "row_invariant"):
            module.row_invariant = bool(enabled)
    return model


def row_invariance(model: nnx.Module) -> bool:
    """Whether every module of `model` with a `row_invariant` switch has it on (False when none has one)."""
    switches = [module.row_invariant for _, module in nnx.iter_graph(model)
                if isinstance(module, nnx.Module) and hasattr(module, "row_invariant")]
    return bool(switches) and all(switches)
