"""How a checkpoint stores its weights: as the model's dtype ("plain"), or as int8 with one scale per block.

"int8": every floating matrix of at least MIN_ELEMENTS elements is stored as int8 values q and float32 scales s,
one scale per BLOCK consecutive elements of its last axis (the edge block shorter), w = q * s with s = max |w| of
the block / 127 (symmetric, round to nearest). Half the bytes of bfloat16: the embedded default pair may hold twice
the parameters in the same 30 MB (issue 47). Vectors (norms, biases, the router's correction bias) and small
matrices stay plain: they are few bytes and some (the router's bias) must stay float32.

Why int8 rather than FP8 e4m3 (which the HF converter reads): with a block's absmax mapped to 127, int8's rounding
error is at most 1/254 of the block's largest weight everywhere, where e4m3's 3 mantissa bits give up to 1/16 of each
weight. The loaded model computes in its own dtype (the weights are dequantized once, when the checkpoint is read).

Stored layout (an Orbax piece): a quantized parameter at path (..., name) becomes two leaves (..., name + VALUES)
and (..., name + SCALES); the metadata records {"kind": "int8", "block": BLOCK} as the model's "weights".
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 128
MIN_ELEMENTS = 4096
VALUES, SCALES = "::int8", "::scale"
FORMATS = ("plain", "int8")


def describe(kind: str) -> Optional[dict]:
    """The metadata entry of a storage format (None for "plain")."""
    if kind not in FORMATS:
        raise ValueError(f"weight storage {kind!r}: choose one of {', '.join(FORMATS)}")
    return None if kind == "plain" else {"kind": kind, "block": BLOCK}


def quantizes(value) -> bool:
    """Whether "int8" storage quantizes this parameter (a floating matrix of at least MIN_ELEMENTS elements)."""
    shape, dtype = np.shape(value), getattr(value, "dtype", None)
    return len(shape) >= 2 and int(np.prod(shape)) >= MIN_ELEMENTS and dtype is not None and jnp.issubdtype(
        dtype, jnp.floating)


def _blocked(x: np.ndarray, block: int) -> np.ndarray:
    """x [..., n] as [..., ceil(n / block), block], zero-padded."""
    n = x.shape[-1]
    pad = (-n) % block
    if pad:
        x = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(*x.shape[:-1], -1, block)


def quantize(w, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [..., n], scales float32 [..., ceil(n / block)]) of a floating array w [..., n] (on the host)."""
    x = np.asarray(jax.device_get(w), np.float32)
    blocks = _blocked(x, block)
    scale = np.abs(blocks).max(-1) / 127.0
    safe = np.where(scale > 0, scale, 1.0)
    q = np.clip(np.rint(blocks / safe[..., None]), -127, 127).astype(np.int8)
    return q.reshape(*q.shape[:-2], -1)[..., :x.shape[-1]], scale.astype(np.float32)


def dequantize(q, scale, dtype, block: int = BLOCK) -> np.ndarray:
    """w = q * scale (block-wise along the last axis) in `dtype`, on the host. (A jitted form compiles once per
    parameter shape: reading the int8 default pair took 9.5 s that way on the 2-core CPU, against 1.2 s for bfloat16.)"""
    q, scale = np.asarray(q), np.asarray(scale, np.float32)
    per = np.repeat(scale, block, axis=-1)[..., :q.shape[-1]]
    return (q.astype(np.float32) * per).astype(np.dtype(dtype))


def encode(flat: dict, kind: str) -> dict:
    """{path: array} as stored in format `kind`: each parameter that `quantizes` split into its values and scales
    leaves; the rest as given."""
    describe(kind)
    if kind == "plain":
        return dict(flat)
    out = {}
    for path, value in flat.items():
        if quantizes(value):
            q, s = quantize(value)
            out[path[:-1] + (path[-1] + VALUES,)] = q
            out[path[:-1] + (path[-1] + SCALES,)] = s
        else:
            out[path] = value
    return out


def stored_paths(path: tuple) -> tuple[tuple, tuple]:
    """The (values, scales) leaf paths of a quantized parameter's path."""
    return path[:-1] + (path[-1] + VALUES,), path[:-1] + (path[-1] + SCALES,)


def parameter_path(stored: tuple) -> tuple:
    """The parameter a stored leaf belongs to (itself for a plain leaf)."""
    for suffix in (VALUES, SCALES):
        if stored[-1].endswith(suffix):
            return stored[:-1] + (stored[-1][:-len(suffix)],)
    return stored
