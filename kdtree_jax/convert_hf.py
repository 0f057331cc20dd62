"""Load and convert HF DeepSeek-V3 / Kimi K2 checkpoints (config.json + *.safetensors).

    python -m kdtree_jax.convert_hf HF_DIR OUT_DIR [--dtype bf16] [--layers N]

Parameter names mirror HF's, so each model parameter maps to one HF key (routed experts: one key per
expert, stacked here). Linear weights are stored [out, in] by HF and [in, out] by Flax. The rope part of
q and of k_pe is stored interleaved in HF weights; we permute those output rows once at load time so the
forward pass uses rotate-half rope without any per-token permutation.

Three storage formats of a linear weight `X.weight` are understood, per tensor:

* plain: `X.weight` in float32 / bfloat16 / float16.
* FP8 block (DeepSeek-V3, Kimi K2 Instruct): `X.weight` float8_e4m3fn [out, in] and `X.weight_scale_inv`
  float32 [ceil(out/128), ceil(in/128)]; w = fp8 * scale_inv, one scale per 128x128 block (the edge
  blocks are partial when out or in is not a multiple of 128). Despite its name, `scale_inv` multiplies.
  The block size comes from config.json's `quantization_config.weight_block_size`.
* INT4 compressed-tensors `pack-quantized` (Kimi K2 Thinking / K2.5 / K2.6 routed experts):
  `X.weight_packed` int32 [out, ceil(in/8)], `X.weight_scale` [out, ceil(in/group)], `X.weight_shape`
  int32 [2] = (out, in). Layout, as compressed-tensors' `pack_to_int32` / `unpack_from_int32` write and
  read it: each int32 holds 8 consecutive input columns, column 8k+i in bits [4i, 4i+4) (low nibble
  first); a nibble is the *unsigned* value q + 8 of the signed 4-bit quantized weight q in [-8, 7]
  (an offset, not two's complement); w = q * scale[row, col // group] (symmetric: no zero point).
  The group size comes from `quantization_config.config_groups.*.weights.group_size` (32 in Kimi's files).

The K2.5 / K2.6 multimodal wrappers prefix the language model's keys with `language_model.` and carry
vision tensors (ignored here); their config.json nests the text model's config in `text_config`.

Reading is tensor by tensor from memory-mapped files (our own few-line safetensors reader: numpy alone
cannot read bf16 / fp8 through the safetensors package, and we want host arrays, not device ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import mmap
import os
import re
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from kdtree_jax.config import ModelConfig
from kdtree_jax.model.layers import deinterleave_permutation
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.tokenizer import TOKENIZER_FILES, tokenizer_kind

# Wrappers (Kimi K2.5 / K2.6) nest the language model under a prefix.
KEY_PREFIXES = ("language_model.",)
# Present in some checkpoints, not parameters of ours: rope buffers, and the vision half of multimodal
# wrappers.
IGNORED_KEYS = re.compile(r"(.*rotary_emb\.inv_freq$)|(^(vision_tower|vision_model|mm_projector|multi_modal_projector)\.)")
LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")

# safetensors dtype names -> numpy dtypes (ml_dtypes provides bf16 and fp8).
_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))


# Reading safetensors -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _TensorEntry:
    file: str
    raw_key: str
    dtype: np.dtype
    shape: tuple
    start: int  # absolute byte offsets in the file
    end: int


def _read_safetensors_header(path: str) -> dict:
    """The tensors of one safetensors file, checked against the file's size: a corrupt or truncated file is a
    ValueError naming it (not a struct, JSON or mmap error later, mid-conversion)."""

    def bad(why: str):
        from kdtree_jax.checkpoint import CorruptCheckpoint  # a ValueError the command lines exit 1 on

        return CorruptCheckpoint(f"{path} is not a valid safetensors file ({why}); re-download or re-copy it")

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", prefix)
            if n > size - 8:
                raise bad(f"its header claims {n} bytes but the file has {size}: truncated or not safetensors")
            raw = f.read(n)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise bad(f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    header.pop("__metadata__", None)
    base = 8 + n
    entries = {}
    for key, info in header.items():
        try:
            dtype_name, shape, (start, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            start, end = int(start), int(end)
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {key!r} has a malformed entry {str(info)[:100]}") from None
        if dtype_name not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {dtype_name}, which we cannot read")
        dtype = np.dtype(_ST_DTYPES[dtype_name])
        if any(d < 0 for d in shape) or not 0 <= start <= end or end - start != math.prod(shape) * dtype.itemsize:
            raise bad(f"tensor {key!r}: offsets [{start}, {end}) do not hold {dtype_name} {list(shape)}")
        if base + end > size:
            raise bad(f"tensor {key!r} ends at byte {base + end} but the file has {size}: truncated")
        entries[key] = _TensorEntry(path, key, dtype, shape, base + start, base + end)
    return entries


class SafetensorsDir:
    """Lazy access to every tensor of a checkpoint directory, one tensor at a time.

    Keys are normalised (the `language_model.` wrapper prefix removed). `get` returns a read-only numpy
    view of the memory-mapped file: nothing is read until it is used, and what is read can be paged out.
    """

    def __init__(self, path: str):
        self.path = path
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {path}")
        self.entries: dict[str, _TensorEntry] = {}
        for f in files:
            for raw_key, entry in _read_safetensors_header(f).items():
                key = self._normalise(raw_key)
                if key in self.entries:
                    raise ValueError(f"tensor {key!r} appears twice: in {self.entries[key].file} and {f}")
                self.entries[key] = entry

    @staticmethod
    def _normalise(key: str) -> str:
        for prefix in KEY_PREFIXES:
            if key.startswith(prefix):
                return key[len(prefix):]
        return key

    def keys(self) -> Iterable[str]:
        return self.entries.keys()

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def shape(self, key: str) -> tuple:
        return self.entries[key].shape

    def dtype(self, key: str) -> np.dtype:
        return self.entries[key].dtype

    def get(self, key: str) -> np.ndarray:
        e = self.entries[key]
        if e.end == e.start:  # mmap cannot map zero bytes
            return np.empty(e.shape, e.dtype)
        # A fresh mapping of just this tensor's bytes: it is unmapped (and its pages leave our resident
        # memory) as soon as the caller drops the array, so reading a whole checkpoint never keeps it all.
        page = mmap.ALLOCATIONGRANULARITY
        offset = e.start - e.start % page
        try:
            raw = np.memmap(e.file, dtype=np.uint8, mode="r", offset=offset, shape=(e.end - offset,))
        except (OSError, ValueError) as err:  # the file changed or shrank since its header was read
            raise ValueError(f"{e.file}: cannot read tensor {e.raw_key!r} ({err})") from None
        return raw[e.start - offset:].view(e.dtype).reshape(e.shape)


# Quantization formats ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Quantization:
    """What config.json says about quantized weights (each tensor's own keys say whether it is)."""

    fp8_block: tuple[int, int] = (128, 128)
    int4_group_size: Optional[int] = None  # None: inferred from each tensor's scale shape

    @classmethod
    def from_hf_config(cls, raw: dict) -> "Quantization":
        qc = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
        if not qc:
            return cls()
        method = qc.get("quant_method")
        if method == "fp8":
            if qc.get("fmt", "e4m3") != "e4m3":
                raise ValueError(f"quantization_config.fmt {qc.get('fmt')!r}: only FP8 e4m3 is supported")
            return cls(fp8_block=tuple(int(b) for b in qc.get("weight_block_size", (128, 128))))
        if method == "compressed-tensors":
            if qc.get("format") != "pack-quantized":
                raise ValueError(f"quantization_config.format {qc.get('format')!r}: only compressed-tensors "
                                 "'pack-quantized' (INT4) is supported")
            groups = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
            sizes = set()
            for w in groups:
                if int(w.get("num_bits", 4)) != 4 or w.get("type", "int") != "int" or not w.get("symmetric", True):
                    raise ValueError(f"quantization_config weights {w}: only symmetric 4-bit int is supported")
                if w.get("group_size"):
                    sizes.add(int(w["group_size"]))
            if len(sizes) > 1:
                raise ValueError(f"quantization_config has several INT4 group sizes {sorted(sizes)}; one is supported")
            return cls(int4_group_size=sizes.pop() if sizes else None)
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported "
                         "(supported: 'fp8' block, 'compressed-tensors' pack-quantized INT4)")


def _fp8_to_float32(weight: np.ndarray) -> np.ndarray:
    """FP8 -> float32 through a 256-entry table: 4-5x faster than ml_dtypes' element-wise cast."""
    table = np.arange(256, dtype=np.uint8).view(weight.dtype).astype(np.float32)
    return np.take(table, weight.view(np.uint8))


def _scale_blocks(x: np.ndarray, scales: np.ndarray, block) -> np.ndarray:
    """x [out, in] float32 times one scale per (block[0] x block[1]) block, edge blocks partial; in place
    when the shape is a whole number of blocks."""
    out, inn = x.shape
    bo, bi = block
    pad_o, pad_i = -out % bo, -inn % bi
    if pad_o or pad_i:
        x = np.pad(x, ((0, pad_o), (0, pad_i)))
    blocks = x.reshape(scales.shape[0], bo, scales.shape[1], bi)
    blocks *= scales.astype(np.float32)[:, None, :, None]
    return blocks.reshape(out + pad_o, inn + pad_i)[:out, :inn]


def dequantize_fp8_block(weight: np.ndarray, scale_inv: np.ndarray, block=(128, 128)) -> np.ndarray:
    """FP8 [out, in] with one float32 scale per block (edge blocks partial) -> float32 [out, in]."""
    out, inn = weight.shape
    bo, bi = block
    expected = (math.ceil(out / bo), math.ceil(inn / bi))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"FP8 scale shape {tuple(scale_inv.shape)} does not fit weight {weight.shape} "
                         f"with {bo}x{bi} blocks (expected {expected})")
    return _scale_blocks(_fp8_to_float32(weight), scale_inv, block)


def unpack_int4(packed: np.ndarray, in_features: int) -> np.ndarray:
    """int32 [out, ceil(in/8)] -> int8 [out, in] in [-8, 7] (compressed-tensors' pack-quantized layout).

    Read as little-endian bytes, byte j of a row holds columns 2j (low nibble) and 2j+1 (high nibble):
    the same order as "8 nibbles per int32, low first", at a quarter of the memory traffic.
    """
    b = np.ascontiguousarray(packed, dtype="<i4").view(np.uint8).reshape(packed.shape[0], -1)
    nibbles = np.empty(b.shape + (2,), np.int8)
    np.bitwise_and(b, 0xF, out=nibbles[..., 0], casting="unsafe")
    np.right_shift(b, 4, out=nibbles[..., 1], casting="unsafe")
    q = nibbles.reshape(b.shape[0], -1)[:, :in_features]
    q -= 8  # stored unsigned with an offset of 8
    return q


def dequantize_int4_group(packed: np.ndarray, scale: np.ndarray, shape, group_size: Optional[int] = None) -> np.ndarray:
    """INT4 pack-quantized weight + per-group scales -> float32 [out, in]."""
    out, inn = (int(s) for s in shape)
    if group_size is None:  # no config: one scale column per group
        group_size = math.ceil(inn / scale.shape[1])
    if packed.shape != (out, math.ceil(inn / 8)) or scale.shape != (out, math.ceil(inn / group_size)):
        raise ValueError(f"INT4 tensors do not fit weight_shape {(out, inn)} with group {group_size}: "
                         f"weight_packed {packed.shape} (expected {(out, math.ceil(inn / 8))}), "
                         f"weight_scale {scale.shape} (expected {(out, math.ceil(inn / group_size))})")
    q = unpack_int4(packed, inn).astype(np.float32)
    return _scale_blocks(q, scale, (1, group_size))


class HFWeights:
    """The logical (dequantized) HF tensors of a checkpoint directory, whatever their storage format."""

    def __init__(self, path: str, quant: Quantization):
        self.files = SafetensorsDir(path)
        self.quant = quant

    def components(self, name: str) -> Optional[list[str]]:
        """The stored keys behind logical tensor `name`; None if it is absent."""
        st = self.files
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if name in st:
            if stem is not None and st.dtype(name) in _FP8_DTYPES:
                return [name, stem + ".weight_scale_inv"]
            return [name]
        if stem is not None and stem + ".weight_packed" in st:
            return [stem + ".weight_packed", stem + ".weight_scale", stem + ".weight_shape"]
        return None

    def check(self, name: str, expected_shape: tuple) -> list[str]:
        """Problems with logical tensor `name` (present, it is assumed), reading no more than its small parts."""
        st = self.files
        comps = self.components(name)
        absent = [k for k in comps if k not in st]
        if absent:
            return [f"missing: {k}" for k in absent]
        if len(comps) == 1:
            shape = st.shape(name)
        elif comps[0] == name:  # fp8
            shape = st.shape(name)
            bo, bi = self.quant.fp8_block
            want = (math.ceil(shape[0] / bo), math.ceil(shape[1] / bi)) if len(shape) == 2 else None
            if st.shape(comps[1]) != want:
                return [f"shape: {comps[1]}: checkpoint has {st.shape(comps[1])}, {bo}x{bi} blocks of {shape} need {want}"]
        else:  # int4
            shape = tuple(int(s) for s in st.get(comps[2]))
            out, inn = shape
            g = self.quant.int4_group_size or math.ceil(inn / max(st.shape(comps[1])[-1], 1))
            for key, want in ((comps[0], (out, math.ceil(inn / 8))), (comps[1], (out, math.ceil(inn / g)))):
                if st.shape(key) != want:
                    return [f"shape: {key}: checkpoint has {st.shape(key)}, weight_shape {shape} needs {want}"]
        if tuple(shape) != tuple(expected_shape):
            return [f"shape: {name}: checkpoint has {tuple(shape)}, config expects {tuple(expected_shape)}"]
        return []

    def get(self, name: str) -> np.ndarray:
        """Logical tensor `name`: dequantized to float32 if it is stored quantized, else as stored."""
        st = self.files
        comps = self.components(name)
        if len(comps) == 1:
            return st.get(name)
        if comps[0] == name:
            return dequantize_fp8_block(st.get(name), st.get(comps[1]), self.quant.fp8_block)
        return dequantize_int4_group(st.get(comps[0]), st.get(comps[1]), st.get(comps[2]), self.quant.int4_group_size)


# Parameter <-> HF key mapping ---------------------------------------------------------------------
def hf_keys_for(path: tuple, cfg: ModelConfig) -> list[str]:
    """HF key(s) of one model parameter, given its NNX path like ('layers', 3, 'mlp', 'experts', 'up_proj')."""
    parts = [str(p) for p in path]
    if parts[0] == "lm_head":
        return ["lm_head.weight"]
    if parts[-2] == "experts":  # stacked routed experts
        stem = "model." + ".".join(parts[:-1])
        return [f"{stem}.{e}.{parts[-1]}.weight" for e in range(cfg.n_routed_experts)]
    leaf = {"kernel": "weight", "embedding": "weight"}.get(parts[-1], parts[-1])
    return ["model." + ".".join(parts[:-1] + [leaf])]


def hf_shape_for(path: tuple, shape: tuple) -> tuple:
    """Shape of each HF tensor of a parameter whose shape (our layout) is `shape`."""
    if len(path) > 1 and path[-2] == "experts":  # [E, a, b] <- E tensors [b, a]
        return (shape[2], shape[1])
    if path[-1] == "kernel":
        return tuple(reversed(shape))
    return tuple(shape)


def _deinterleave_rows(w_out_in: np.ndarray, cfg: ModelConfig, per_head: bool) -> np.ndarray:
    """Permute the rope output rows of an [out, in] HF weight (or [out] bias) to rotate-half order."""
    perm = deinterleave_permutation(cfg.qk_rope_head_dim)
    if per_head:  # q: each head is [nope | rope]
        w = w_out_in.reshape(cfg.num_attention_heads, cfg.qk_head_dim, *w_out_in.shape[1:])
        w = np.concatenate([w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:][:, perm]], axis=1)
        return w.reshape(w_out_in.shape)
    # kv_a_proj_with_mqa: [c_kv (kv_lora_rank) | k_pe (rope)]
    return np.concatenate([w_out_in[: cfg.kv_lora_rank], w_out_in[cfg.kv_lora_rank:][perm]], axis=0)


def hf_to_param(path: tuple, tensors: list, cfg: ModelConfig, dtype=None) -> np.ndarray:
    """Turn the HF tensor(s) of one parameter into its Flax layout (numpy, in `dtype` if given)."""
    name = path[-1]
    module = path[-2] if len(path) > 1 else ""
    dtype = np.dtype(dtype) if dtype is not None else None
    if module == "experts":  # [I, H] per expert -> [E, H, I] (gate/up) or [E, I, H] (down)
        return np.stack([np.asarray(t).T.astype(dtype or t.dtype) for t in tensors])
    (t,) = tensors
    t = np.asarray(t)
    if cfg.rope_interleave and module in ("q_b_proj", "q_proj") and name in ("kernel", "bias"):
        t = _deinterleave_rows(t, cfg, per_head=True)
    if cfg.rope_interleave and module == "kv_a_proj_with_mqa" and name in ("kernel", "bias"):
        t = _deinterleave_rows(t, cfg, per_head=False)
    t = t.T if name == "kernel" else t
    return np.ascontiguousarray(t, dtype=dtype or t.dtype)


def convert_param(weights: HFWeights, path: tuple, shape: tuple, dtype, cfg: ModelConfig) -> np.ndarray:
    """One parameter in our layout and `dtype`, read (and dequantized) one HF tensor at a time.

    Stacked experts are filled expert by expert into the output by a few threads (numpy releases the GIL
    while it dequantizes), so the peak is the output plus a few experts' float32 copies.
    """
    keys = hf_keys_for(path, cfg)
    if len(path) > 1 and path[-2] == "experts":
        out = np.empty(shape, np.dtype(dtype))

        def fill(e: int) -> None:  # each task writes its own slice: no result is held back
            out[e] = weights.get(keys[e]).T

        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            list(pool.map(fill, range(len(keys))))
        return out
    return hf_to_param(path, [weights.get(keys[0])], cfg, dtype)


# Whole-checkpoint helpers --------------------------------------------------------------------------
def read_hf_config(path: str) -> dict:
    from kdtree_jax.checkpoint import read_json_object

    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"no config.json in {path}")
    return read_json_object(cfg_path)


def model_config(raw: dict, num_layers: Optional[int] = None) -> ModelConfig:
    """The ModelConfig of an HF config.json, optionally cut to its first `num_layers` layers."""
    cfg = ModelConfig.from_hf_config(raw)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(f"num_layers (--layers) must be in [1, {cfg.num_hidden_layers}]; got {num_layers}")
        cfg = cfg.replace(num_hidden_layers=num_layers,
                          first_k_dense_replace=min(cfg.first_k_dense_replace, num_layers))
    return cfg


def abstract_params(cfg: ModelConfig, dtype) -> tuple:
    """(graphdef, flat state) of the model's abstract (shape-only) parameters: nothing is allocated."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    return graphdef, nnx.to_flat_state(state)


def validate(weights: HFWeights, flat, cfg: ModelConfig, where: str) -> None:
    """Every expected tensor present with the right shape, nothing unexpected; else one ValueError."""
    used, missing, mismatched = set(), [], []
    for p, var in flat:
        keys = hf_keys_for(p, cfg)
        want = hf_shape_for(p, var.shape)
        for key in keys:
            comps = weights.components(key)
            if comps is None:
                missing.append(key)
                continue
            used.update(comps)
            for problem in weights.check(key, want):
                kind, _, text = problem.partition(": ")
                (missing if kind == "missing" else mismatched).append(text)
    leftover = sorted(
        k for k in weights.files.keys() if k not in used and not IGNORED_KEYS.match(k)
        # Layers past num_hidden_layers (DeepSeek-V3's multi-token-prediction layer, or a --layers cut).
        and not (LAYER_KEY.match(k) and int(LAYER_KEY.match(k).group(1)) >= cfg.num_hidden_layers))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {preview_names(missing)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es): {preview_names(mismatched)}")
    if leftover:
        problems.append(f"{len(leftover)} unexpected tensor(s): {preview_names(leftover)}")
    if problems:
        raise ValueError(f"checkpoint {where} does not match its config.json: " + "; ".join(problems))


def preview_names(items: list, n: int = 8) -> str:
    """The first `n` names joined for an error message, and how many more there are."""
    shown = ", ".join(items[:n])
    return shown + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def load_hf(path: str, dtype=jnp.bfloat16) -> tuple[ModelConfig, Transformer]:
    """config + model from an HF checkpoint directory (plain, FP8-block or INT4 pack-quantized weights).

    The whole model is built in memory (on the default device); for models larger than that, convert
    once with `python -m kdtree_jax.convert_hf` and restore sharded with `load_checkpoint`.
    Every expected tensor must be present with the right shape; missing, mis-shaped and unexpected
    tensors are all reported in one ValueError.
    """
    raw = read_hf_config(path)
    cfg = model_config(raw)
    weights = HFWeights(path, Quantization.from_hf_config(raw))
    graphdef, flat = abstract_params(cfg, dtype)
    validate(weights, flat, cfg, path)
    for p, var in flat:
        value = jnp.asarray(convert_param(weights, p, var.shape, var.dtype, cfg))
        var.set_value(value) if hasattr(var, "set_value") else setattr(var, "value", value)
    return cfg, nnx.merge(graphdef, nnx.from_flat_state(flat))


_DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "f32": jnp.float32, "float32": jnp.float32,
           "f16": jnp.float16, "float16": jnp.float16}


def convert_checkpoint(hf_dir: str, out_dir: str, *, dtype=jnp.bfloat16, num_layers: Optional[int] = None,
                       piece_bytes: int = 1 << 30, progress: bool = True) -> ModelConfig:
    """Convert an HF checkpoint directory into our Orbax checkpoint directory, streaming.

    Parameters are read (tensor by tensor), dequantized and laid out one at a time, and written as Orbax
    pieces of at most about `piece_bytes` (a parameter larger than that is a piece of its own). An Orbax
    save holds its whole tree in memory, so the peak is max(piece_bytes, the largest parameter) plus one
    HF tensor in float32, never the model. The largest parameter of K2 is one projection of a layer's
    stacked routed experts: 384 x 7168 x 2048 in bf16 = 11 GiB. (Why not one piece per layer: a K2 MoE
    layer is ~34 GiB. Why not one Orbax checkpoint written in parts: Orbax's experimental partial saves
    slow down quadratically with their number. Small parameters are grouped because every piece costs a
    separate Orbax save and restore.)
    Everything is validated before anything is written. Returns the (possibly cut) ModelConfig.
    """
    from tqdm import tqdm

    from kdtree_jax import checkpoint

    raw = read_hf_config(hf_dir)
    cfg = model_config(raw, num_layers)
    weights = HFWeights(hf_dir, Quantization.from_hf_config(raw))
    _, flat = abstract_params(cfg, dtype)
    validate(weights, flat, cfg, hf_dir)

    tokenizer_files = [os.path.join(hf_dir, f) for f in TOKENIZER_FILES if os.path.exists(os.path.join(hf_dir, f))]
    if tokenizer_kind(tokenizer_files) == "byte":  # neither tokenizer.json nor tiktoken.model: none we read
        if tokenizer_files:
            print(f"note: {hf_dir} has no tokenizer.json or tiktoken.model; the checkpoint gets the byte tokenizer",
                  file=sys.stderr)
        tokenizer_files = []
    writer = checkpoint.CheckpointWriter(out_dir, cfg, dtype, tokenizer=tokenizer_files or None)
    total = sum(math.prod(var.shape) * np.dtype(var.dtype).itemsize for _, var in flat)
    try:  # a failed or interrupted conversion removes what it wrote: no half-written output directory
        with tqdm(total=total, unit="B", unit_scale=True, desc="converting", disable=not progress,
                  file=sys.stderr) as bar:
            pending, pending_bytes = {}, 0
            for p, var in flat:
                bar.set_postfix_str(".".join(str(x) for x in p), refresh=False)
                pending[p] = convert_param(weights, p, var.shape, var.dtype, cfg)
                pending_bytes += pending[p].nbytes
                bar.update(pending[p].nbytes)
                if pending_bytes >= piece_bytes:
                    writer.write_target_piece(pending)
                    pending, pending_bytes = {}, 0
            if pending:
                writer.write_target_piece(pending)
        writer.finish(extra_metadata={"converted_from": os.path.abspath(hf_dir),
                                      "quantization": dataclasses.asdict(weights.quant)})
    except BaseException:
        writer.abort()
        raise
    return cfg


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kdtree_jax.convert_hf",
        description="Convert a HuggingFace DeepSeek-V3 / Kimi K2 checkpoint (config.json + *.safetensors: "
                    "bf16/fp32, FP8 e4m3 with 128x128 block scales, or compressed-tensors INT4 pack-quantized "
                    "as in Kimi K2 Thinking / K2.5 / K2.6, with or without the 'language_model.' prefix) into "
                    "a kdtree-jax Orbax checkpoint directory that kdtree_jax.load_checkpoint restores straight "
                    "into a mesh's shardings. Tensors are streamed one at a time: memory stays bounded by the "
                    "largest parameter, not the model. Tokenizer files (tiktoken.model, tokenizer.json, "
                    "tokenizer_config.json) are copied along.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("hf_dir", help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("out_dir", help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="parameter dtype of the output")
    p.add_argument("--layers", type=int, default=None,
                   help="convert only the first N decoder layers (a slice of a real model that fits one GPU); "
                        "the written config has num_hidden_layers = N")
    p.add_argument("--piece-mib", type=int, default=1024,
                   help="group parameters into Orbax pieces of about this size (MiB); a larger parameter is a "
                        "piece of its own. Peak memory is about max(this, the largest parameter)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = convert_checkpoint(args.hf_dir, args.out_dir, dtype=_DTYPES[args.dtype], num_layers=args.layers,
                                 piece_bytes=args.piece_mib << 20, progress=not args.no_progress)
    except (ValueError, OSError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_dir}: {cfg.num_hidden_layers} layers, dtype {args.dtype}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
