"""HF checkpoints in every storage format we read (bf16, FP8 block, INT4 pack-quantized, with and without the
K2.5 `language_model.` prefix, over several shards) convert to the model the unquantized weights give.

The quantized checkpoints are written here from the tiny HF fixture, by this file's own quantizer and
packer (written from the format descriptions, independently of kdtree_jax.convert_hf). Two checks each:
tight against a float32 checkpoint holding the very values our quantizer dequantizes to (proves the
converter's dequantization and layout exact), loose against the unquantized model (the quantization error).
"""

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import kdtree_jax
from kdtree_jax import convert_hf

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_tiny_k2")
FP8_BLOCK = [16, 16]  # the real files use 128; small blocks give several partial edge blocks on tiny weights
INT4_GROUP = 16


def _rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _mean_rel_err(a, b):
    """Mean error relative to the mean magnitude: the tiny fixture's routing margins are ~1e-3, so any
    quantization flips a few expert choices and the *max* error says little about the weights."""
    return float(np.abs(a - b).mean() / np.abs(b).mean())


# The test's own quantizers ---------------------------------------------------------------------------
def fp8_block_quantize(w, block):
    """-> (fp8 weight, float32 scale_inv per block, the float32 values they stand for)."""
    bo, bi = block
    out, inn = w.shape
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    scales = np.empty((math.ceil(out / bo), math.ceil(inn / bi)), np.float32)
    deq = np.empty(w.shape, np.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi)
            s = np.float32(max(np.abs(w[rows, cols]).max(), 1e-12) / 448.0)  # e4m3's largest finite value
            q[rows, cols] = (w[rows, cols] / s).astype(ml_dtypes.float8_e4m3fn)
            scales[i, j] = s
            deq[rows, cols] = q[rows, cols].astype(np.float32) * s
    return q, scales, deq


def int4_pack(w, group):
    """-> (int32 weight_packed, bf16 weight_scale, int32 weight_shape, the float32 values they stand for).

    Symmetric per-group scales; each int32 holds 8 consecutive columns, column 8k+i in bits 4i..4i+3,
    stored as the unsigned nibble q + 8 (compressed-tensors' pack_to_int32).
    """
    out, inn = w.shape
    ngroups = math.ceil(inn / group)
    scale = np.zeros((out, ngroups), np.float32)
    for g in range(ngroups):
        scale[:, g] = np.abs(w[:, g * group:(g + 1) * group]).max(axis=1) / 7.0
    scale = np.maximum(scale, 1e-8).astype(ml_dtypes.bfloat16).astype(np.float32)  # as stored
    col_scale = scale[:, np.arange(inn) // group]
    q = np.clip(np.round(w / col_scale), -8, 7).astype(np.int64)
    padded = np.zeros((out, math.ceil(inn / 8) * 8), np.int64)  # padding packs as q = 0
    padded[:, :inn] = q
    nibbles = padded + 8
    packed = np.zeros((out, padded.shape[1] // 8), np.int64)
    for k in range(packed.shape[1]):
        for i in range(8):
            packed[:, k] |= nibbles[:, 8 * k + i] << (4 * i)
    packed = packed.astype(np.uint32).view(np.int32)
    return packed, scale.astype(ml_dtypes.bfloat16), np.array([out, inn], np.int32), q * col_scale


# Building HF directories ----------------------------------------------------------------------------
def _fixture():
    with open(os.path.join(FIXTURE, "config.json")) as f:
        config = json.load(f)
    return config, load_file(os.path.join(FIXTURE, "model.safetensors"))


def _quantized(name, fmt):
    """Which weights a format quantizes: FP8 checkpoints all linear layers but the router and lm head;
    Kimi's INT4 checkpoints only the routed experts."""
    if not name.endswith(".weight") or "norm" in name or "embed_tokens" in name or name == "lm_head.weight":
        return False
    if fmt == "fp8":
        return not name.endswith("mlp.gate.weight")
    if fmt == "int4":
        return ".experts." in name
    return False


def write_hf(path, fmt, *, prefix=False, shards=1, extra=None, edit=None):
    """An HF checkpoint of the fixture in format `fmt`; returns the float32 tensors it stands for.

    `edit(tensors)` may change the stored tensors (keys without the prefix) before they are written."""
    config, tensors = _fixture()
    os.makedirs(path)
    out, dequantized = {}, {}
    for name, w in tensors.items():
        if fmt == "bf16":
            out[name] = w.astype(ml_dtypes.bfloat16)
            dequantized[name] = out[name].astype(np.float32)
        elif _quantized(name, fmt) and fmt == "fp8":
            out[name], out[name + "_scale_inv"], dequantized[name] = fp8_block_quantize(w, FP8_BLOCK)
        elif _quantized(name, fmt) and fmt == "int4":
            stem = name[: -len(".weight")]
            out[stem + ".weight_packed"], out[stem + ".weight_scale"], out[stem + ".weight_shape"], dequantized[name] = \
                int4_pack(w, INT4_GROUP)
        else:
            out[name] = dequantized[name] = w
    out.update(extra or {})
    if edit is not None:
        edit(out)
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": FP8_BLOCK}
    if fmt == "int4":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": INT4_GROUP}}}}
    if prefix:  # K2.5 / K2.6: language model under `language_model.`, its config in text_config
        out = {(k if k.startswith("vision_tower.") else "language_model." + k): v for k, v in out.items()}
        config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": config}
    names = sorted(out)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: np.ascontiguousarray(out[k]) for k in names[s::shards]}
        save_file(part, os.path.join(path, file))
        weight_map.update({k: file for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return dequantized


def write_float32_hf(path, tensors):
    config, _ = _fixture()
    os.makedirs(path)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def write_word_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 512}, f)


@pytest.fixture(scope="module")
def reference():
    ref = np.load(os.path.join(FIXTURE, "reference.npz"))
    _, model = kdtree_jax.load_hf(FIXTURE, dtype=jnp.float32)
    return ref["input_ids"], np.asarray(kdtree_jax.forward_logits(model, ref["input_ids"]))


# (format, language_model. prefix, shards, mean relative error allowed vs the unquantized model; measured
# 0.018 / 0.17 / 0.17)
CASES = [("bf16", False, 1, 0.04), ("fp8", False, 3, 0.3), ("int4", False, 2, 0.3), ("int4", True, 3, 0.3)]


@pytest.mark.parametrize("fmt,prefix,shards,loose", CASES, ids=[f"{c[0]}{'-prefix' if c[1] else ''}" for c in CASES])
def test_converted_logits_match(tmp_path, reference, fmt, prefix, shards, loose):
    ids, logits_ref = reference
    hf = str(tmp_path / "hf")
    extra = {"vision_tower.patch_embed.proj.weight": np.ones((4, 4), np.float32),
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)} if prefix else None
    dequantized = write_hf(hf, fmt, prefix=prefix, shards=shards, extra=extra)
    if fmt == "bf16":
        write_word_tokenizer(hf)
    exact = str(tmp_path / "exact")
    write_float32_hf(exact, dequantized)
    _, exact_model = kdtree_jax.load_hf(exact, dtype=jnp.float32)
    logits_exact = np.asarray(kdtree_jax.forward_logits(exact_model, ids))

    out = str(tmp_path / "orbax")
    # One Orbax piece per parameter in one case, everything in one piece in the others.
    convert_hf.convert_checkpoint(hf, out, dtype=jnp.float32, progress=False, piece_bytes=0 if prefix else 1 << 30)
    target, drafter, tokenizer = kdtree_jax.load_checkpoint(out)
    assert drafter is None
    # The HF directory's tokenizer files travel with the checkpoint (the bf16 case has a tokenizer.json).
    assert type(tokenizer).__name__ == ("HFTokenizer" if fmt == "bf16" else "ByteTokenizer")
    with open(os.path.join(out, "kdtree_checkpoint.json")) as f:
        pieces = json.load(f)["target"]["pieces"]
    assert len(pieces) == (len(jax.tree.leaves(nnx.state(target))) if prefix else 1)
    logits = np.asarray(kdtree_jax.forward_logits(target, ids))
    assert _rel_err(logits, logits_exact) < 1e-5
    assert _mean_rel_err(logits, logits_ref) < loose

    if prefix:  # load_hf reads the quantized layout directly too
        _, direct = kdtree_jax.load_hf(hf, dtype=jnp.float32)
        assert _rel_err(np.asarray(kdtree_jax.forward_logits(direct, ids)), logits_exact) < 1e-5


def test_fp8_dequantization_with_128_blocks_and_ragged_edges():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(300, 200)).astype(np.float32)
    q, scales, deq = fp8_block_quantize(w, (128, 128))
    assert scales.shape == (3, 2)
    np.testing.assert_array_equal(convert_hf.dequantize_fp8_block(q, scales), deq)
    with pytest.raises(ValueError, match="scale shape"):
        convert_hf.dequantize_fp8_block(q, scales[:2])


def test_int4_unpacking_with_padding():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(5, 13)).astype(np.float32)  # 13 columns: the last int32 is part padding
    packed, scale, shape, deq = int4_pack(w, 4)
    assert packed.shape == (5, 2) and packed.dtype == np.int32 and scale.shape == (5, 4)
    np.testing.assert_array_equal(convert_hf.dequantize_int4_group(packed, scale, shape, 4), deq)
    # Without a group size (no quantization_config), it is read off the scale's shape.
    np.testing.assert_array_equal(convert_hf.dequantize_int4_group(packed, scale, shape), deq)
    # A known value: nibbles 0..7 in one int32 are q = -8..-1, low nibble first.
    word = np.array([[sum(i << (4 * i) for i in range(8))]], np.uint32).view(np.int32)
    np.testing.assert_array_equal(convert_hf.unpack_int4(word, 8), [np.arange(-8, 0)])


def test_missing_scale_is_named(tmp_path):
    hf = str(tmp_path / "hf")
    write_hf(hf, "fp8", shards=2, edit=lambda t: t.pop("model.layers.1.self_attn.o_proj.weight_scale_inv"))
    out = str(tmp_path / "orbax")
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv"):
        convert_hf.convert_checkpoint(hf, out, dtype=jnp.float32, progress=False)
    assert not os.path.exists(os.path.join(out, "kdtree_checkpoint.json"))  # validated before writing


def test_misshaped_and_unexpected_tensors_are_named(tmp_path):
    hf = str(tmp_path / "hf")
    key = "model.layers.2.mlp.experts.5.down_proj.weight_packed"

    def edit(tensors):
        tensors[key] = tensors[key][:, :-1].copy()

    write_hf(hf, "int4", extra={"model.layers.0.mlp.bogus.weight": np.zeros((2, 2), np.float32)}, edit=edit)
    with pytest.raises(ValueError, match=r"shape mismatch.*experts\.5\.down_proj\.weight_packed") as err:
        kdtree_jax.load_hf(hf, dtype=jnp.float32)
    assert "unexpected tensor(s): model.layers.0.mlp.bogus.weight" in str(err.value)


def test_cli_converts_the_first_layers(tmp_path, capsys):
    out = str(tmp_path / "orbax")
    assert convert_hf.main([FIXTURE, out, "--dtype", "f32", "--layers", "2", "--no-progress"]) == 0
    target, _, tokenizer = kdtree_jax.load_checkpoint(out)
    assert target.cfg.num_hidden_layers == 2 and len(target.layers) == 2
    # The reference: the same checkpoint read by load_hf with a 2-layer config (it skips layers >= 2).
    cut = tmp_path / "cut"
    shutil.copytree(FIXTURE, cut)
    with open(cut / "config.json") as f:
        config = json.load(f)
    config["num_hidden_layers"] = 2
    with open(cut / "config.json", "w") as f:
        json.dump(config, f)
    _, ref_model = kdtree_jax.load_hf(str(cut), dtype=jnp.float32)
    ids = np.load(os.path.join(FIXTURE, "reference.npz"))["input_ids"]
    np.testing.assert_array_equal(np.asarray(kdtree_jax.forward_logits(target, ids)),
                                  np.asarray(kdtree_jax.forward_logits(ref_model, ids)))

    with pytest.raises(SystemExit):
        convert_hf.main(["--help"])
    assert "pack-quantized" in capsys.readouterr().out
    assert convert_hf.main([FIXTURE, str(tmp_path / "x"), "--layers", "9"]) == 2  # one line, exit status 2
    assert capsys.readouterr().err.startswith("error: num_layers (--layers) must be in [1, 3]")
