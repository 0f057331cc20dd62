"""The compiled verify-attention op: loads the nanobind extension, registers its XLA FFI targets and calls them.

One target name, two handlers: `kdtree_verify_attention` on "cpu" (register-tiled flash-style loops over
XLA's intra-op thread pool, float32 accumulation, any dims, float32/bfloat16; faster than the pure-JAX
reference on a CPU, `benchmarks/results/verify_attention_cpu.md`) and on "CUDA" (the split-KV flash-decode kernel, bf16 with Dc=512, Dr=64).
`jax.lax.platform_dependent` picks the branch when the program is lowered, so one traced function runs on
either platform. On a GPU with other dtypes/dims the CUDA branch falls back to the pure-JAX reference (with
a one-time warning) because the kernel is specialised to the 576-wide K2/DeepSeek latent row.

Scratch for the split-KV partials (out, lse per split) is returned by the CUDA call as two extra outputs
rather than taken from the FFI scratch allocator: outputs are part of XLA's buffer assignment, so their
addresses are fixed before the program runs and stay valid when a CUDA graph (XLA command buffer) that
captured the call is replayed; a scratch allocation made while a graph is being captured would be freed
after capture and its memory reused by the replayed graph's neighbours.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.ops.reference import verify_attention_reference

try:  # the extension is optional: a pure-Python checkout still works through the reference
    from kdtree_jax import _verify_attention_ext as _ext
except ImportError:  # pragma: no cover - exercised only without a build
    _ext = None

TARGET = "kdtree_verify_attention"

# The CUDA kernels' geometry (ffi/verify/); the split heuristic below needs the same numbers.
CUDA_LATENT_DIM = 512
CUDA_ROPE_DIM = 64
CUDA_ROWS_PER_GROUP = 16  # one m16 MMA tile of query rows
CUDA_KV_TILE = 16         # the split heuristic's unit: a split covers at least four of these (64 positions)
CUDA_MAX_SPLITS = 256     # the heuristic's cap
CUDA_SPLIT_LIMIT = 1024   # what the merge kernel accepts (kMaxSplits)
CPU_DTYPES = (jnp.float32, jnp.bfloat16)


@functools.cache
def _register() -> bool:
    if _ext is None:
        return False
    jax.ffi.register_ffi_target(TARGET, _ext.cpu_handler(), platform="cpu")
    if _ext.with_cuda:
        jax.ffi.register_ffi_target(TARGET, _ext.cuda_handler(), platform="CUDA")
    return True


def available() -> bool:
    """True when the compiled extension is importable (its CPU handler is always built)."""
    return _register()


def use_extension(path: str) -> None:
    """Run the op on the handlers of another build of the extension (the `_verify_attention_ext` shared library
    at `path`) instead of the installed one, to time two builds against each other
    (benchmarks/verify_attention_cpu.py --extension). Only before the op's first call: XLA keeps the handlers
    registered first."""
    global _ext
    if _register.cache_info().currsize:
        raise RuntimeError("use_extension must run before the first verify-attention call (handlers are registered)")
    spec = importlib.util.spec_from_file_location("kdtree_jax._verify_attention_ext", path)
    if spec is None:
        raise ValueError(f"{path} is not a Python extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _ext = module


def cuda_built() -> bool:
    return _ext is not None and bool(_ext.with_cuda)


@functools.cache
def register_cuda_handler(target: str, handler: str) -> bool:
    """Register the extension's CUDA handler `handler` (a function of the module returning its capsule) as the FFI
    target `target`, once; False when the extension was built without CUDA or without that handler. The other CUDA
    ops of the extension (ops/moe.py, ops/topk.py) register theirs through this on first use."""
    if not cuda_built() or not hasattr(_ext, handler):
        return False
    jax.ffi.register_ffi_target(target, getattr(_ext, handler)(), platform="CUDA")
    return True


@functools.cache
def sm_count(device: int = 0) -> int:
    """Multiprocessors of CUDA device `device`, queried once (132 when no GPU answers, e.g. while tracing
    the CUDA branch on a CPU-only machine: the branch is then never lowered)."""
    if cuda_built():
        count = int(_ext.sm_count(device))
        if count > 0:
            return count
    return 132


# Kernel variants, as the handler's `variant` attribute (ffi/verify/params.h, Variant). "auto" lets the handler pick
# from the device, for every T: "hopper" (wgmma, sm_90a machine code: compute capability 9.0), else "pipelined" (213 KB
# of shared memory: sm_90-class parts), else "wide" (within sm_120's 99 KB). Benchmarks and tests name one explicitly.
VARIANTS = {"auto": 0, "wide": 1, "pipelined": 2, "hopper": 3}
_VARIANT_NAMES = {v: k for k, v in VARIANTS.items()}
# Query rows a block holds (one block per SM): two m16 tiles in the portable kernels, one wgmma M in the Hopper one.
ROWS_PER_BLOCK = {"wide": 2 * CUDA_ROWS_PER_GROUP, "pipelined": 2 * CUDA_ROWS_PER_GROUP, "hopper": 64}


def resolve_variant(variant: str, rows: int, device: int = 0) -> str | None:
    """The kernel `variant` runs as on CUDA device `device` for T*H = `rows` query rows ("auto" resolved), or None
    where it cannot run there (or no GPU answers)."""
    _check_variant(variant)
    if not cuda_built():
        return None
    resolved = int(_ext.resolve_variant(VARIANTS[variant], rows, device))
    return _VARIANT_NAMES.get(resolved) if resolved > 0 else None


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}; got {variant!r}")


# The CPU handler's SIMD variants, as its `isa` attribute (ffi/verify_attention_cpu.cc). "auto" runs the best one
# the CPU supports (found once per process); benchmarks and tests name one explicitly. A named variant the CPU
# cannot run fails the call (InvalidArgument from the handler), it does not fall back.
CPU_ISAS = {"auto": 0, "baseline": 1, "avx2": 2, "avx512": 3}


def _check_cpu_isa(cpu_isa: str) -> None:
    if cpu_isa not in CPU_ISAS:
        raise ValueError(f"cpu_isa must be one of {sorted(CPU_ISAS)}; got {cpu_isa!r}")


def choose_num_splits(batch: int, num_queries: int, num_heads: int, max_len: int, num_sms: int,
                      rows_per_block: int = 2 * CUDA_ROWS_PER_GROUP) -> int:
    """KV splits from static shapes only: as many as fit one wave of resident blocks, each split at least four
    KV tiles long (its work must outweigh its partial write and the merge). When one wave would leave more
    than a tenth of the resident slots idle (a split's blocks fill 50-90% of them: B = 8, T = 33, H = 8 is 72
    of 132), the fewest splits whose waves fill at least 90% (5 there: 360 blocks in three waves of 132), or
    the best filling count the four-tile minimum allows, since a block's time shrinks with its split's length.
    Except that a short table whose one split already fills a quarter of the slots is not split: its splits would be
    under SHORT_SPLIT_POSITIONS long and the merge of its many rows costs more than they save (the default pair's
    batch-16 DDTree-32 pass, 16 x 33 x 4 rows over 320 positions, Hopper kernel on an H200: 19.4 us in one split,
    22.1 in 2, 28.8 in the 5 the fill rule gave; its 16 x 17 x 4 rows, 32 blocks a split (under a quarter of 132),
    still gain from 4: 17.2 vs 19.4 us; benchmarks/results/verify_splits_short_h200.json)."""
    slots = num_sms  # one block per SM
    per_split = math.ceil(num_queries * num_heads / rows_per_block) * batch
    if 4 * per_split >= slots and max_len < 2 * SHORT_SPLIT_POSITIONS:
        return 1
    cap = max(1, min(math.ceil(max_len / CUDA_KV_TILE) // 4, CUDA_MAX_SPLITS))
    splits = min(max(1, slots // per_split), cap)

    def fill(n):
        return per_split * n / (math.ceil(per_split * n / slots) * slots)

    if fill(splits) < 0.9:  # else the best fill the cap allows
        more = range(splits, cap + 1)
        splits = next((n for n in more if fill(n) >= 0.9), max(more, key=lambda n: (fill(n), -n)))
    return int(splits)


# How the op picks its KV split count (the op's `split_policy` argument):
#   "occupancy" (the default): choose_num_splits for the call's own T and width: the fewest partials that fill the
#       device, so a T-row pass writes and merges far fewer partials than it would at the one-token call's count;
#   "invariant" (issue 24, for row-invariant decoding: greedy speculative == autoregressive bit for bit): the
#       partition's count from B and H only (choose_num_splits at T = 1, uncapped by the length), the grid's count
#       that partition capped by the table width (SPLIT_UNIT positions a split at least); the kernels cut the root
#       row's positions by the partition count alone (ffi/verify/device.cuh, split_plan), so neither T nor the width
#       (the engine's loops size their tables differently) changes a row's splits. It costs the verify pass +26% to
#       +70% of the op's device time at 64k, T = 9-64 (benchmarks/results/verify_variants_h200.md), which is why it
#       is opt-in (SpecConfig.row_invariant) and not the default.
SPLIT_UNIT = 64  # positions: device.cuh's kSplitUnit, the partition's granule and a split's least length
# device.cuh's kShortSplitUnits x kSplitUnit positions; choose_num_splits keeps a table under twice this whole.
SHORT_SPLIT_POSITIONS = 256
SPLIT_POLICIES = ("occupancy", "invariant")  # the two above


def _check_split_policy(policy: str) -> None:
    if policy not in SPLIT_POLICIES:
        raise ValueError(f"split_policy must be one of {SPLIT_POLICIES}; got {policy!r}")


def partition_splits(batch: int, num_heads: int, num_sms: int, rows_per_block: int = 2 * CUDA_ROWS_PER_GROUP) -> int:
    """The "invariant" policy's partition count: the one-token call's occupancy count (choose_num_splits at T = 1)
    without the length cap, from B, H and the device alone."""
    return choose_num_splits(batch, 1, num_heads, 4 * CUDA_KV_TILE * CUDA_MAX_SPLITS, num_sms, rows_per_block)


def split_counts(batch: int, num_queries: int, num_heads: int, max_len: int, variant: str = "auto",
                 num_splits: int = 0, policy: str = "occupancy") -> tuple[int, int]:
    """(grid splits, partition splits) of a call: the grid's count sizes the partial buffers and the launch; the
    partition's count cuts each sequence's positions (device.cuh, split_plan). `num_splits` > 0 forces both."""
    _check_split_policy(policy)
    if num_splits > 0:
        return int(num_splits), int(num_splits)
    kernel = resolve_variant(variant, num_queries * num_heads) or "pipelined"
    rows_per_block = ROWS_PER_BLOCK[kernel]
    if policy == "occupancy":
        splits = choose_num_splits(batch, num_queries, num_heads, max_len, sm_count(), rows_per_block)
        return splits, splits
    parts = partition_splits(batch, num_heads, sm_count(), rows_per_block)
    return max(1, min(parts, math.ceil(max_len / SPLIT_UNIT))), parts


def splits_for(batch: int, num_queries: int, num_heads: int, max_len: int, variant: str = "auto",
               policy: str = "occupancy") -> tuple[int, int]:
    """(KV splits, query rows a block) the op uses for these shapes with `variant`: the grid's split count
    (split_counts) and the rows a block holds, which the kernel the handler will run decides ("auto" is resolved on
    device 0 while tracing; without a GPU, the portable kernels' 32)."""
    kernel = resolve_variant(variant, num_queries * num_heads) or "pipelined"
    return split_counts(batch, num_queries, num_heads, max_len, variant, policy=policy)[0], ROWS_PER_BLOCK[kernel]


def _check_ffi_args(q, kv_pool, rope_dim, softmax_scale, num_splits):
    if q.dtype not in CPU_DTYPES or kv_pool.dtype not in CPU_DTYPES:
        raise ValueError(f"the FFI op takes float32 or bfloat16 q and kv_pool; got {q.dtype} and {kv_pool.dtype}")
    if not math.isfinite(float(softmax_scale)):
        raise ValueError(f"softmax_scale must be finite; got {softmax_scale}")
    if int(num_splits) != num_splits or not 0 <= num_splits <= CUDA_SPLIT_LIMIT:
        raise ValueError(f"num_splits must be an int in [0, {CUDA_SPLIT_LIMIT}] (0 = automatic); got {num_splits}")
    if q.shape[-1] - rope_dim <= 0:
        raise ValueError(f"rope_dim ({rope_dim}) must leave a positive latent width (q's last dim {q.shape[-1]})")


def cuda_fast_path(q, kv_pool, rope_dim) -> bool:
    """Whether the CUDA kernel handles these inputs (else the GPU branch uses the reference)."""
    return (cuda_built() and q.dtype == jnp.bfloat16 and kv_pool.dtype == jnp.bfloat16
            and rope_dim == CUDA_ROPE_DIM and q.shape[-1] == CUDA_LATENT_DIM + CUDA_ROPE_DIM)


@functools.cache
def _warn_fallback_once(reason: str) -> None:
    warnings.warn(f"verify_attention: the CUDA kernel does not handle {reason}; using the XLA reference on GPU",
                  stacklevel=3)


def _call_cpu(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, *, softmax_scale, rope_dim, cpu_isa="auto"):
    batch, num_queries, num_heads, width = q.shape
    out_types = (jax.ShapeDtypeStruct((batch, num_queries, num_heads, width - rope_dim), q.dtype),
                 jax.ShapeDtypeStruct((batch, num_queries, num_heads), jnp.float32))
    call = jax.ffi.ffi_call(TARGET, out_types, vmap_method="sequential")
    return call(q, kv_pool, layer, kv_slots, kv_lens, tree_mask,
                softmax_scale=np.float32(softmax_scale), rope_dim=np.int64(rope_dim), isa=np.int64(CPU_ISAS[cpu_isa]))


def _call_cuda(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, *, softmax_scale, rope_dim, num_splits, variant,
               split_policy):
    batch, num_queries, num_heads, width = q.shape
    rows = num_queries * num_heads
    num_splits, split_parts = split_counts(batch, num_queries, num_heads, kv_slots.shape[1], variant, num_splits,
                                           split_policy)
    # With one split the kernel writes the final result directly and the partial buffers are unused.
    part_rows = batch * num_splits * rows if num_splits > 1 else 1
    out_types = (jax.ShapeDtypeStruct((batch, num_queries, num_heads, width - rope_dim), q.dtype),
                 jax.ShapeDtypeStruct((batch, num_queries, num_heads), jnp.float32),
                 jax.ShapeDtypeStruct((part_rows, CUDA_LATENT_DIM), jnp.float32),  # per-split out
                 jax.ShapeDtypeStruct((part_rows,), jnp.float32))                  # per-split lse
    call = jax.ffi.ffi_call(TARGET, out_types, vmap_method="sequential")
    out, lse, _, _ = call(q, kv_pool, layer, kv_slots, kv_lens, tree_mask,
                          softmax_scale=np.float32(softmax_scale), rope_dim=np.int64(rope_dim),
                          num_splits=np.int64(num_splits),
                          # 0: the partition is the grid's count, and the merge may pick its instance by the call's
                          # rows (ffi/verify/merge.cu); the invariant policy names its partition's count.
                          split_parts=np.int64(split_parts if split_policy == "invariant" else 0),
                          variant=np.int64(VARIANTS[variant]))
    return out, lse


def verify_attention_ffi(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, *, softmax_scale: float,
                         rope_dim: int = 64, num_splits: int = 0, variant: str = "auto", cpu_isa: str = "auto",
                         split_policy: str = "occupancy"):
    """The FFI op (shapes already validated by `kdtree_jax.ops.validate_verify_args`). `variant` names the CUDA
    kernel (VARIANTS; "auto" everywhere but benchmarks and tests); the CPU handler ignores it. `cpu_isa` names the
    CPU handler's SIMD variant (CPU_ISAS; "auto" everywhere but benchmarks and tests: the best the CPU runs; a
    variant the CPU cannot run is an error); the CUDA branch ignores it. `split_policy` (SPLIT_POLICIES) picks the
    CUDA kernel's KV split count; the CPU handler's partition never depends on T (its splits are cheap), so it
    ignores it."""
    if not available():
        raise ValueError("the compiled verify-attention extension is not built; reinstall with `pip install -e .`")
    _check_ffi_args(q, kv_pool, rope_dim, softmax_scale, num_splits)
    _check_variant(variant)
    _check_cpu_isa(cpu_isa)
    _check_split_policy(split_policy)
    layer = jnp.asarray(layer, jnp.int32)
    kwargs = dict(softmax_scale=float(softmax_scale), rope_dim=int(rope_dim))

    def reference(*args):
        return verify_attention_reference(*args, **kwargs)

    def on_cpu(*args):
        return _call_cpu(*args, **kwargs, cpu_isa=cpu_isa)

    def on_cuda(*args):
        if cuda_fast_path(q, kv_pool, rope_dim):
            return _call_cuda(*args, **kwargs, num_splits=int(num_splits), variant=variant,
                              split_policy=split_policy)
        if cuda_built() and _has_gpu():
            _warn_fallback_once(f"q {q.dtype}/kv_pool {kv_pool.dtype} with width {q.shape[-1]} and rope_dim {rope_dim} "
                                f"(fast path: bfloat16, {CUDA_LATENT_DIM}+{CUDA_ROPE_DIM})")
        return reference(*args)

    return jax.lax.platform_dependent(q, kv_pool, layer, kv_slots, kv_lens, tree_mask,
                                      cpu=on_cpu, cuda=on_cuda, default=reference)


@functools.cache
def _has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def bench_module():
    """The benchmark target (`kdtree_jax._kernel_bench`: ceilings, the kernels timed outside XLA), or None where
    the CUDA part was not built. Never used by the op."""
    try:
        from kdtree_jax import _kernel_bench
    except ImportError:
        return None
    return _kernel_bench


__all__ = ["available", "cuda_built", "verify_attention_ffi", "choose_num_splits", "ROWS_PER_BLOCK", "VARIANTS",
           "CPU_ISAS", "resolve_variant", "splits_for", "split_counts", "partition_splits", "SPLIT_POLICIES",
           "sm_count", "cuda_fast_path", "bench_module", "use_extension"]
