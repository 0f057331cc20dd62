"""int8 weight storage (weight_storage.py): the rounding against a float64 formulation, and a checkpoint saved that way
read back within that rounding, into a mesh too, in fewer bytes."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import kdtree_jax
from kdtree_jax import checkpoint, weight_storage
from kdtree_jax.model.drafter import DrafterConfig, init_drafter
from test_checkpoint import spread_shardings


def _reference_int8(w: np.ndarray, block: int):
    """Per block of `block` along the last axis: s = max|w| / 127 and q = round(w / s), in float64."""
    w = w.astype(np.float64)
    q, s = np.zeros(w.shape, np.int64), []
    for start in range(0, w.shape[-1], block):
        part = w[..., start:start + block]
        scale = np.abs(part).max(-1, keepdims=True) / 127.0
        q[..., start:start + block] = np.rint(part / np.where(scale > 0, scale, 1.0))
        s.append(scale)
    return q, np.concatenate(s, -1)


def test_int8_blocks_match_a_float64_rounding_and_stay_within_half_a_step():
    rng = np.random.default_rng()
    # An edge block shorter than the others, blocks of very different magnitudes, one all-zero block.
    w = rng.normal(size=(5, 3, 300)).astype(np.float32) * np.array([1e-3, 1.0, 40.0])[:, None]
    w[0, 0, 128:256] = 0.0
    q, s = weight_storage.quantize(w)
    assert q.dtype == np.int8 and q.shape == w.shape and s.shape == (5, 3, 3) and s.dtype == np.float32
    ref_q, ref_s = _reference_int8(w, weight_storage.BLOCK)
    np.testing.assert_allclose(s, ref_s, rtol=1e-6)
    assert (np.abs(q.astype(np.int64) - ref_q) <= 1).all() and (q.astype(np.int64) == ref_q).mean() > 0.999
    back = np.asarray(weight_storage.dequantize(jnp.asarray(q), jnp.asarray(s), jnp.float32))
    step = np.repeat(ref_s, weight_storage.BLOCK, -1)[..., :300]
    assert (np.abs(back - w) <= 0.5 * step * (1 + 1e-5) + 1e-12).all()
    assert (back[0, 0, 128:256] == 0).all()
    assert np.abs(q).max() == 127  # every block's largest weight maps to the end of the range


def _params(module):
    return {".".join(map(str, p)): np.asarray(x, np.float32)
            for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(module))[0]}


@pytest.fixture(scope="module")
def int8_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("int8")
    cfg = kdtree_jax.ModelConfig.preset("tiny")
    seed = int(np.random.default_rng().integers(1 << 30))
    target = kdtree_jax.init_model(cfg, seed=seed, dtype=jnp.bfloat16)
    drafter = init_drafter(cfg, DrafterConfig(block_size=4, num_layers=1), seed=seed + 1, dtype=jnp.bfloat16)
    plain, packed = str(root / "plain"), str(root / "int8")
    kdtree_jax.save_checkpoint(plain, target, drafter)
    kdtree_jax.save_checkpoint(packed, target, drafter, weights="int8")
    return target, drafter, plain, packed


def _bytes(directory):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def test_an_int8_checkpoint_reads_back_within_its_rounding_in_fewer_bytes(int8_pair):
    target, drafter, plain, packed = int8_pair
    meta = json.load(open(os.path.join(packed, checkpoint.METADATA_FILE)))
    assert meta["target"]["weights"] == {"kind": "int8", "block": weight_storage.BLOCK}
    assert meta["drafter"]["weights"] == {"kind": "int8", "block": weight_storage.BLOCK}
    assert json.load(open(os.path.join(plain, checkpoint.METADATA_FILE)))["target"]["weights"] is None
    target2, drafter2, _ = kdtree_jax.load_checkpoint(packed, dtype=jnp.float32)
    assert target2.dtype == jnp.float32
    quantized = 0
    for before, after in ((target, target2), (drafter, drafter2)):
        want, got = _params(before), _params(after)
        assert want.keys() == got.keys()
        for name, w in want.items():
            if not weight_storage.quantizes(w):
                np.testing.assert_array_equal(got[name], w, err_msg=name)
                continue
            quantized += 1
            _, ref_s = _reference_int8(w, weight_storage.BLOCK)
            step = np.repeat(ref_s, weight_storage.BLOCK, -1)[..., :w.shape[-1]]
            assert (np.abs(got[name] - w) <= 0.5 * step * (1 + 1e-5) + 1e-12).all(), name
            assert not np.array_equal(got[name], w), name  # it was rounded, so it went through the int8 path
    assert quantized >= 10
    target_bytes = _bytes(os.path.join(packed, "target")), _bytes(os.path.join(plain, "target"))
    # The tiny model's files have a fixed overhead, and OCDBT splits its data into a varying number of files: the
    # ratio came out 0.80-0.88 over seeds (0.876 failed a 0.85 bound once); an int8 stored as 16 bits would be >= 1.
    assert target_bytes[0] < 0.92 * target_bytes[1], target_bytes


def test_an_int8_checkpoint_reads_into_a_mesh_as_it_reads_onto_one_device(int8_pair):
    _, _, _, packed = int8_pair
    mesh = jax.make_mesh((8,), ("x",))
    one, _, _ = kdtree_jax.load_checkpoint(packed, dtype=jnp.float32)
    spread, _, _ = kdtree_jax.load_checkpoint(packed, dtype=jnp.float32, shardings=spread_shardings(mesh))
    assert spread.embed_tokens.embedding.sharding == NamedSharding(mesh, P("x", None))
    assert spread.layers[1].mlp.experts.up_proj.sharding == NamedSharding(mesh, P("x", None, None))
    a, b = _params(one), _params(spread)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_an_unknown_weight_format_fails_before_writing(tmp_path):
    target = kdtree_jax.init_model(kdtree_jax.ModelConfig.preset("tiny"), seed=0, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="weight storage 'fp4'"):
        kdtree_jax.save_checkpoint(str(tmp_path / "x"), target, weights="fp4")
    assert not os.path.exists(tmp_path / "x")
