"""The MLA layer's prologue at decode sizes as one CUDA op: q_a_proj and kv_a_proj_with_mqa as one pass over their
shared input, their RMSNorms and the latent row's rope.

`prologue(x, weights, cos, sin, eps, reference)` returns (q_a after q_a_layernorm [..., Q], the latent rows
[..., C + R]) with the semantics of `reference(x, cos, sin)` (model/mla.py's formulation, which stays the reference
and runs everywhere the kernel does not: a CPU, more than MAX_TOKENS rows, projections with a bias, an extension built
without CUDA).

Why.  At T = 1 XLA ran this part of a Kimi-K2 layer as two split-K GEMVs over the same input plus two norm reductions,
the rope and the concatenation: ~7 launches of 1-5 us around ~30 MB of weights a layer (issue 46).  ffi/mla_prologue.cu
does it in two launches (the products; the norms and rope), reading the input once.

How the CUDA op differs from the reference: the products accumulate in float32 in another (fixed) order and the
squares' sums add in another order: a few bfloat16 ulp at most.  It does not depend on how many rows a call has.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kdtree_jax.ops.ffi import register_cuda_handler, sm_count

TARGET = "kdtree_mla_prologue"
MAX_TOKENS = 16  # ffi/mla_prologue.h kMaxTokens: the weights are re-read per 4 rows, a decode-size op
MAX_WIDTH = 12288  # Q and C + R: kernel 2 holds a token's row in 48 KB of shared memory
TILE_COLS = 64  # ffi/moe_device.cuh kTileCols: output columns a block of kernel 1
BLOCKS_PER_SM = 4  # kernel 1's grid aims at this many blocks a multiprocessor (128 registers x 128 threads)
MIN_SPLIT_ROWS = 128  # a split of kernel 1 covers at least one step of its 16 slices x 8 rows
# Whether the model takes the op (`prologue`; cuda_prologue itself always runs it). Off: on an H100 (cc32e4b,
# benchmarks/gpu_k2_prologue.sh: its GPU tests pass, sanitizers included) the K2 step with it was 1.0-1.3% shorter at
# T = 1 and 1.0-1.2% longer at T = 4 / 9, 3.7 kernels a layer fewer (history/k2_prologue_h100_cc32e4b.md): the
# product kernel reads at ~78% of the copy bandwidth as XLA's split-K reductions do, the second launch costs what
# the fusion saved, and past 4 rows the weights are read once per 4 rows. decode_context --prologue cuda forces it.
MODEL_TAKES_IT = False


class PrologueWeights(NamedTuple):
    """What the op reads of one MLA layer: the two down-projections' kernels and the two norms' weights."""

    w_qa: jnp.ndarray  # [H, Q]
    w_kva: jnp.ndarray  # [H, C + R]
    q_norm: jnp.ndarray  # [Q]
    kv_norm: jnp.ndarray  # [C]


def cuda_built() -> bool:
    """True when the extension holds the CUDA handler (registered on first use)."""
    return register_cuda_handler(TARGET, "mla_prologue_cuda_handler")


def kernel_applies(rows: int, weights: PrologueWeights, x_dtype) -> bool:
    """Whether the model takes the op (MODEL_TAKES_IT) for a call of `rows` tokens within the kernel's limits (and the
    extension has it): bfloat16 input and weights, at most MAX_TOKENS rows, an even rope width."""
    q, kv, c = weights.w_qa.shape[1], weights.w_kva.shape[1], weights.kv_norm.shape[0]
    bf16 = all(jnp.dtype(a.dtype) == jnp.bfloat16 for a in weights) and jnp.dtype(x_dtype) == jnp.bfloat16
    return (MODEL_TAKES_IT and bf16 and 1 <= rows <= MAX_TOKENS and q <= MAX_WIDTH and kv <= MAX_WIDTH
            and kv > c and (kv - c) % 2 == 0 and cuda_built())


def choose_splits(hidden: int, width: int) -> int:
    """Input-dim splits of kernel 1 (static shapes only): enough blocks to fill the device BLOCKS_PER_SM deep."""
    tiles = -(-width // TILE_COLS)
    want = -(-BLOCKS_PER_SM * sm_count() // max(tiles, 1))
    return int(max(1, min(want, hidden // MIN_SPLIT_ROWS, 65535)))


def cuda_prologue(x2d, weights: PrologueWeights, cos2d, sin2d, eps: float):
    """The CUDA op itself (lowers for a GPU only): x2d [N, H] bfloat16, cos2d / sin2d [N, R] float32 ->
    (q [N, Q], latent [N, C + R]) bfloat16."""
    if not cuda_built():  # also registers the target: a first call here must find it
        raise ValueError("mla_prologue: the CUDA op needs the extension built with nvcc; this one has none")
    n, hidden = x2d.shape
    q, kv = weights.w_qa.shape[1], weights.w_kva.shape[1]
    splits = choose_splits(hidden, q + kv)
    out_types = (jax.ShapeDtypeStruct((n, q), jnp.bfloat16), jax.ShapeDtypeStruct((n, kv), jnp.bfloat16),
                 jax.ShapeDtypeStruct((splits * n * (q + kv),), jnp.float32))
    call = jax.ffi.ffi_call(TARGET, out_types, vmap_method="sequential")
    q_out, latent, _ = call(x2d.astype(jnp.float32), *weights, cos2d.astype(jnp.float32), sin2d.astype(jnp.float32),
                            eps=np.float32(eps), splits=np.int64(splits))
    return q_out, latent


def prologue(x, weights: PrologueWeights, cos, sin, eps: float, reference, mesh=None):
    """(q_a_layernorm(q_a_proj(x)), latent rows) for x [..., H] and cos / sin [..., R] with the same leading dims: by
    the CUDA op when lowered for a GPU and `kernel_applies`, else (and on every other platform) `reference(x, cos,
    sin)`; `jax.lax.platform_dependent` picks the branch at lowering. `mesh`: the model's mesh, on which every
    operand is replicated (sharding.py: no layout splits these dims); each device then runs the op whole."""
    lead, hidden = x.shape[:-1], x.shape[-1]
    rows = int(np.prod(lead)) if lead else 1
    if not kernel_applies(rows, weights, x.dtype):
        return reference(x, cos, sin)

    def op(x, cos, sin, *weights):
        q, latent = cuda_prologue(x.reshape(rows, hidden), PrologueWeights(*weights), cos.reshape(rows, -1),
                                  sin.reshape(rows, -1), eps)
        return q.reshape(*lead, -1), latent.reshape(*lead, -1)

    if mesh is not None:
        op = jax.shard_map(op, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    return jax.lax.platform_dependent(x, cos, sin, cuda=lambda x, c, s: op(x, c, s, *weights), default=reference)


__all__ = ["prologue", "cuda_prologue", "cuda_built", "kernel_applies", "choose_splits", "PrologueWeights",
           "MAX_TOKENS"]
