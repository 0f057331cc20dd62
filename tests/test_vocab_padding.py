"""Issue 25 item 4: a vocabulary the mesh does not divide is padded (as vLLM / SGLang do): the lm head gets zero
columns up to a multiple of the mesh size, the padded ids' logits are cut off, so logits, greedy output and saved
checkpoints are those of the unsharded model."""

import jax
import numpy as np
import pytest

import kdtree_jax
from kdtree_jax.checkpoint import load_sharded
from kdtree_jax.sharding import make_mesh, shard_model

CFG = kdtree_jax.ModelConfig.preset("tiny").replace(vocab_size=311)  # prime: no mesh > 1 divides it

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 (forced CPU) devices")


@pytest.fixture(scope="module")
def pair():
    return (kdtree_jax.init_model(CFG, seed=0),
            kdtree_jax.init_drafter(CFG, kdtree_jax.DrafterConfig(block_size=4, num_layers=1, head_dim=16), seed=1))


@pytest.fixture(scope="module")
def tokens():
    """One token batch for every logits check here: each forward_logits program (unsharded, tp) is compiled once."""
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 9)).astype(np.int32)


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_padded_vocab_gives_the_unsharded_logits(pair, tokens, layout):
    target, drafter = pair
    ref = np.asarray(kdtree_jax.forward_logits(target, tokens))
    sharded = shard_model(target, make_mesh(2), layout)
    assert sharded.lm_head.kernel.shape == (CFG.hidden_size, 312) and target.lm_head.kernel.shape[1] == 311
    logits = np.asarray(kdtree_jax.forward_logits(sharded, tokens))
    assert logits.shape == ref.shape and np.abs(logits - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.slow  # two compiles of the decode loop (~30 s on 2 cores)
def test_padded_vocab_gives_the_unsharded_greedy_output(pair):
    target, drafter = pair
    sharded = shard_model(target, make_mesh(2), "tp")
    prompts = [[5, 7, 11, 13], [17, 19]]
    expected = kdtree_jax.generate(target, drafter, prompts, max_new_tokens=6, budget=3).tokens
    assert kdtree_jax.generate(sharded, drafter, prompts, max_new_tokens=6, budget=3).tokens == expected


def test_padded_model_saves_unpadded_and_loads_sharded(pair, tokens, tmp_path):
    target, drafter = pair
    mesh = make_mesh(2)
    kdtree_jax.save_checkpoint(str(tmp_path / "ckpt"), shard_model(target, mesh, "tp"), drafter)
    plain, _, _ = kdtree_jax.load_checkpoint(str(tmp_path / "ckpt"))
    assert plain.lm_head.kernel.shape == (CFG.hidden_size, 311)
    np.testing.assert_array_equal(np.asarray(plain.lm_head.kernel[...]), np.asarray(target.lm_head.kernel[...]))
    sharded, _, _ = load_sharded(str(tmp_path / "ckpt"), mesh, "tp")
    assert sharded.lm_head.kernel.shape == (CFG.hidden_size, 312)
    np.testing.assert_allclose(np.asarray(kdtree_jax.forward_logits(sharded, tokens)),
                               np.asarray(kdtree_jax.forward_logits(target, tokens)), rtol=1e-5, atol=1e-5)
