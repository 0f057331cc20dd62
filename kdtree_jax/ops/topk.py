"""The drafter's candidates in one pass: log-softmax then top-k over the last axis, fused on a GPU.

`log_softmax_top_k(logits, k, temperature)` returns (values [..., k] float32, indices [..., k] int32) with the
semantics of

    jax.lax.top_k(jax.nn.log_softmax(logits.astype(float32) / temperature, axis=-1), k)

values descending, equal values by the lower index first (lax.top_k's order).  log_softmax(log_softmax(x) / t)
equals log_softmax(x / t), so a caller holding log-probs of x may pass the logits x and the temperature instead.

Why.  A speculative step took log_softmax as two XLA reduce fusions and an elementwise pass over the drafter's
logits, then XLA's TopK kernel: ~29 + 24 us of a ~900 us default-pair step on an H200 ([256, 8192] float32; 46 us for
TopK alone in the Kimi-K2 step), where one read of those few MB takes ~3-5 us.  On CUDA this runs one kernel
(ffi/topk.cu): one block per row keeps the running max / sum of exp and a sorted top-k list per thread in
registers, then merges them.  Elsewhere (a CPU), and where the kernel does not apply (k > MAX_K, a dtype other than
float32 / bfloat16, V >= 2^31, an extension built without CUDA), the XLA formulation above runs;
`jax.lax.platform_dependent` picks the branch when the program is lowered.

How the CUDA op differs from the XLA formulation (ffi/topk.cu says why):
  * values: the log-sum-exp is summed in another order (a few ulp);
  * selection is on the scaled logits, exact; two logits whose log-probs round to the same float keep lax.top_k's
    order inside the k (the outputs are re-ranked by (value, index)), but which of them takes the k-th place can
    differ (the kernel keeps the larger logit, XLA the lower index);
  * NaN: a NaN logit is selected as if it were -inf and makes its row's values all NaN (XLA gives NaN values too,
    its indices are not specified).  A row of -inf gives NaN values and indices 0..k-1, as XLA does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.ops.ffi import register_cuda_handler  # the CUDA op lives in the verify op's extension

TARGET = "kdtree_log_softmax_top_k"
# The largest k the kernel keeps in registers (ffi/topk.h kMaxK); "auto" runs XLA above it.
MAX_K = 32
IMPLS = ("auto", "xla", "cuda")
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MAX_VOCAB = 2 ** 31 - 1  # int32 indices


def cuda_built() -> bool:
    """True when the extension holds the CUDA handler (registered on first use)."""
    return register_cuda_handler(TARGET, "log_softmax_top_k_cuda_handler")


def xla_log_softmax_top_k(logits, k: int, temperature: float = 1.0):
    """The XLA formulation (the reference): lax.top_k of log_softmax(logits / temperature) in float32."""
    x = logits.astype(jnp.float32)
    if temperature != 1.0:
        x = x / jnp.float32(temperature)
    values, indices = jax.lax.top_k(jax.nn.log_softmax(x, axis=-1), k)
    return values, indices.astype(jnp.int32)


def cuda_log_softmax_top_k(logits, k: int, temperature: float = 1.0):
    """The CUDA op itself (ffi/topk.cu; lowers for a GPU only).  logits [..., V] float32 / bfloat16, 1 <= k <= MAX_K."""
    if not cuda_built():  # also registers the target: a first call here must find it
        raise ValueError("log_softmax_top_k: the CUDA op needs the extension built with nvcc; this one has none")
    lead = tuple(logits.shape[:-1])
    out_types = (jax.ShapeDtypeStruct(lead + (k,), jnp.float32), jax.ShapeDtypeStruct(lead + (k,), jnp.int32))
    # Every leading dim is a row to the kernel, so a vmapped call is one call on the batched array.
    call = jax.ffi.ffi_call(TARGET, out_types, vmap_method="broadcast_all")
    return call(logits, temperature=np.float32(temperature))


def validate_args(logits, k, temperature, impl: str = "auto") -> None:
    """Static checks with one-line errors that name the argument (no device work)."""
    if impl not in IMPLS:
        raise ValueError(f"log_softmax_top_k: impl must be one of {IMPLS}; got {impl!r}")
    if jnp.ndim(logits) < 1:
        raise ValueError(f"log_softmax_top_k: logits must be [..., V]; got shape {jnp.shape(logits)}")
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"log_softmax_top_k: logits must be floating point; got {logits.dtype}")
    vocab = logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"log_softmax_top_k: k must be a Python int; got {k!r}")
    if not 1 <= k <= vocab:
        raise ValueError(f"log_softmax_top_k: k must be in [1, V={vocab}]; got {k}")
    if impl == "cuda" and k > MAX_K:
        raise ValueError(f"log_softmax_top_k: impl='cuda' takes k <= {MAX_K} (the kernel's register lists); got {k}")
    if impl == "cuda" and jnp.dtype(logits.dtype) not in KERNEL_DTYPES:
        raise ValueError(f"log_softmax_top_k: impl='cuda' takes float32 or bfloat16 logits; got {logits.dtype}")
    if not isinstance(temperature, (int, float, np.floating, np.integer)) or isinstance(temperature, bool):
        raise ValueError(f"log_softmax_top_k: temperature must be a Python float; got {temperature!r}")
    if not temperature > 0:  # +inf is allowed (uniform log-probs), as the engine allows it
        raise ValueError(f"log_softmax_top_k: temperature must be > 0; got {temperature}")


def kernel_applies(logits, k: int) -> bool:
    """Whether the shapes and dtype are within the CUDA kernel's limits (and the extension has it)."""
    return (1 <= k <= MAX_K and jnp.dtype(logits.dtype) in KERNEL_DTYPES and logits.shape[-1] <= MAX_VOCAB
            and cuda_built())


def log_softmax_top_k(logits, k: int, temperature: float = 1.0, impl: str = "auto"):
    """(values [..., k] float32, indices [..., k] int32) = lax.top_k(log_softmax(logits / temperature), k).

    impl: "auto" = the CUDA op when lowered for a GPU and `kernel_applies`, the XLA formulation otherwise; "xla" = the
    XLA formulation everywhere; "cuda" = the CUDA op on a GPU (errors if k > MAX_K or the dtype is not float32 /
    bfloat16), XLA elsewhere.  See the module docstring for how the two differ."""
    validate_args(logits, k, temperature, impl)
    k, temperature = int(k), float(temperature)
    xla = functools.partial(xla_log_softmax_top_k, k=k, temperature=temperature)
    if impl == "xla" or not kernel_applies(logits, k):  # (impl="cuda" in a CPU-only build: XLA too)
        return xla(logits)
    cuda = functools.partial(cuda_log_softmax_top_k, k=k, temperature=temperature)
    return jax.lax.platform_dependent(logits, cuda=cuda, default=xla)


__all__ = ["log_softmax_top_k", "xla_log_softmax_top_k", "cuda_log_softmax_top_k", "cuda_built", "kernel_applies",
           "MAX_K", "IMPLS"]
