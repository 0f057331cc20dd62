"""Building blocks shared by the target and the drafter: RMSNorm, yarn rope, the SwiGLU MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax.config import ModelConfig, RopeScaling, yarn_get_mscale


def dense_init(fan_in: int):
    """N(0, 1/fan_in) keeps activations O(1) through random-weight test models."""
    return nnx.initializers.normal(stddev=1.0 / math.sqrt(fan_in))


def logical_axes(variable: nnx.Variable, *axes: str | None) -> nnx.Variable:
    """Name each dimension of a parameter (Flax sharding metadata); sharding.py maps names to the mesh
    per layout. Eager sharding stays off: the model is built unsharded and placed by `shard_model`."""
    if len(axes) != variable.ndim:
        raise ValueError(f"{len(axes)} axis names for a {variable.ndim}-d parameter")
    variable.set_metadata(out_sharding=axes, eager_sharding=False)
    return variable


def linear(rngs: nnx.Rngs, d_in: int, d_out: int, dtype, *, bias: bool = False,
           axes: tuple[str | None, str | None] = (None, None)) -> nnx.Linear:
    """A Linear layer whose kernel [d_in, d_out] (and bias [d_out]) carry logical axis names."""
    layer = nnx.Linear(d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype,
                       kernel_init=dense_init(d_in), rngs=rngs)
    logical_axes(layer.kernel, *axes)
    if bias:
        logical_axes(layer.bias, axes[1])
    return layer


def dot_transposed(x, w, preferred_element_type=None):
    """x [..., K] times w.T, for a weight stored [N, K] (a tied embedding used as the lm head, a router in HF's
    layout) -> [..., N].

    XLA:CPU (jaxlib 0.10, YNNPACK fusions off: runtime.CPU_FLAGS) runs x @ w.T several times slower than w @ x.T once
    x has more than one row, and at one row too where K is wide (2 cores, float32: a tied head 8192 x 256 at 5 rows
    3.1 ms against 0.55, a Kimi-K2 router 384 x 7168 at 1 row 2.2 ms against 0.15; history/cpu_dot_transposed.md).
    On a CPU the product is therefore taken as w @ x.T and transposed after an optimization barrier (without it XLA
    folds the transpose back into the slow form); elsewhere it is left as written: cuBLAS takes either layout."""
    def as_written(x, w):
        return jnp.dot(x, w.T, preferred_element_type=preferred_element_type)

    def on_cpu(x, w):
        rows = x.reshape(-1, x.shape[-1])
        out = jnp.dot(w, rows.T, preferred_element_type=preferred_element_type)  # [N, rows]
        return jax.lax.optimization_barrier(out).T.reshape(*x.shape[:-1], w.shape[0])

    return jax.lax.platform_dependent(x, w, cpu=on_cpu, default=as_written)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs, axis: str | None = "embed"):
        self.eps = eps
        self.weight = logical_axes(nnx.Param(jnp.ones((dim,), dtype)), axis)

    def __call__(self, x):
        # Normalise in float32 and cast back before the weight, as HF does.
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). Dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = linear(rngs, hidden, intermediate, dtype, axes=("embed", "mlp"))
        self.up_proj = linear(rngs, hidden, intermediate, dtype, axes=("embed", "mlp"))
        self.down_proj = linear(rngs, intermediate, hidden, dtype, axes=("mlp", "embed"))

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


# Rope -------------------------------------------------------------------------------------------
def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale ("attention factor"), HF's yarn formula."""
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if scaling is None or scaling.factor == 1.0 and not scaling.mscale_all_dim:
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    factor = scaling.factor
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(num_rotations):
        return (dim * math.log(scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight

    if scaling.attention_factor is not None:
        attention_factor = scaling.attention_factor
    elif scaling.mscale and scaling.mscale_all_dim:
        attention_factor = yarn_get_mscale(factor, scaling.mscale) / yarn_get_mscale(factor, scaling.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(factor)
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(cfg: ModelConfig, positions):
    """cos, sin [..., rope_dim] (float32) for integer positions [...] (rotate-half layout)."""
    inv_freq, attention_factor = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x, cos, sin):
    """Rotate-half rope on the last dim; cos/sin broadcast over x's head axis by the caller."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


def deinterleave_permutation(dim: int) -> np.ndarray:
    """Index order that turns HF's interleaved rope features (x0 y0 x1 y1 ...) into rotate-half's
    (x0 x1 ... y0 y1 ...). Applied to weight rows at load time, so the forward pass never permutes."""
    return np.concatenate([np.arange(0, dim, 2), np.arange(1, dim, 2)])
