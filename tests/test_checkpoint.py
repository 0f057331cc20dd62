"""Orbax checkpoints: bit-exact round trip, restore straight into a mesh's shardings, the generate CLI on one."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import kdtree_jax
from kdtree_jax import checkpoint
from kdtree_jax.model.drafter import DrafterConfig, init_drafter
from kdtree_jax.tokenizer import HFTokenizer


def make_hf_tokenizer(directory) -> str:
    """A small byte-level BPE tokenizer.json (ids < 300, fits the tiny model's vocab of 512)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"])
    tok.train_from_iterator(["def fibonacci(n): return n if n < 2 else fibonacci(n - 1)"] * 4, trainer)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    return path


def _leaves(module):
    return jax.tree_util.tree_flatten_with_path(nnx.state(module))[0]


def _assert_same(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        # Compared on the host (numpy's exact bf16 -> f32 cast): an on-device astype compiles a program per leaf shape.
        np.testing.assert_array_equal(np.asarray(x).astype(np.float32), np.asarray(y).astype(np.float32),
                                      err_msg=str(path))


def spread_shardings(mesh):
    """load_checkpoint's shardings: the embedding split along the vocab, expert stacks along the experts, everything
    else replicated."""
    def shardings(abstract):
        def one(path, leaf):
            names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
            if "embedding" in names:
                return NamedSharding(mesh, P("x", None))
            if "experts" in names:
                return NamedSharding(mesh, P("x", None, None))
            return NamedSharding(mesh, P())
        return jax.tree_util.tree_map_with_path(one, nnx.state(abstract))
    return shardings


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny random target (bf16) + drafter (f32) + HF tokenizer, saved once."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = kdtree_jax.ModelConfig.preset("tiny")
    seed = int(np.random.default_rng().integers(1 << 30))  # fresh weights every run
    target = kdtree_jax.init_model(cfg, seed=seed, dtype=jnp.bfloat16)
    drafter = init_drafter(cfg, DrafterConfig(block_size=4, num_layers=1), seed=seed + 1, dtype=jnp.float32)
    tok_file = make_hf_tokenizer(str(root / "tok"))
    path = str(root / "pair")
    kdtree_jax.save_checkpoint(path, target, drafter, str(root / "tok"), extra_metadata={"note": "test"})
    return path, target, drafter, tok_file


def test_round_trip_is_bit_exact(saved):
    path, target, drafter, tok_file = saved
    target2, drafter2, tokenizer = kdtree_jax.load_checkpoint(path)
    assert target2.cfg == target.cfg and drafter2.cfg == drafter.cfg
    assert target2.dtype == jnp.bfloat16 and drafter2.dtype == jnp.float32
    _assert_same(target, target2)
    _assert_same(drafter, drafter2)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.encode("def fibonacci(n)") == HFTokenizer(tok_file).encode("def fibonacci(n)")

    with open(os.path.join(path, checkpoint.METADATA_FILE)) as f:
        meta = json.load(f)
    assert meta["format_version"] == checkpoint.FORMAT_VERSION and meta["extra"] == {"note": "test"}
    assert meta["target"]["dtype"] == "bfloat16" and meta["tokenizer"] == {"kind": "hf", "files": ["tokenizer.json"]}


def test_restore_into_mesh_shardings_and_dtype(saved, tmp_path):
    path, target, drafter, _ = saved
    mesh = jax.make_mesh((8,), ("x",))
    target2, drafter2, _ = kdtree_jax.load_checkpoint(path, shardings=spread_shardings(mesh), dtype=jnp.float32)
    assert target2.embed_tokens.embedding.sharding == NamedSharding(mesh, P("x", None))
    assert target2.layers[1].mlp.experts.up_proj.sharding == NamedSharding(mesh, P("x", None, None))
    assert target2.layers[0].self_attn.kv_b_proj.kernel.sharding == NamedSharding(mesh, P())
    assert drafter2.fc.kernel.sharding == NamedSharding(mesh, P())
    assert len(target2.embed_tokens.embedding.addressable_shards) == 8
    assert target2.layers[1].mlp.experts.up_proj.addressable_shards[0].data.shape[0] == target.cfg.n_routed_experts // 8
    # Cast to float32 while reading: the values are the bf16 ones, exactly.
    assert target2.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(target2.layers[1].mlp.experts.up_proj),
                                  np.asarray(target.layers[1].mlp.experts.up_proj.astype(jnp.float32)))
    # A sharded model saves as it is (each shard written once) and comes back equal.
    kdtree_jax.save_checkpoint(str(tmp_path / "resaved"), target2, drafter2)
    target3, drafter3, _ = kdtree_jax.load_checkpoint(str(tmp_path / "resaved"))
    _assert_same(target2, target3)
    _assert_same(drafter2, drafter3)


def test_clear_errors(saved, tmp_path):
    path, target, _, _ = saved
    with pytest.raises(ValueError, match="not an empty directory"):
        kdtree_jax.save_checkpoint(path, target)
    with pytest.raises(ValueError, match="kdtree_checkpoint.json"):
        kdtree_jax.load_checkpoint(str(tmp_path))
    mesh = jax.make_mesh((8,), ("x",))
    with pytest.raises(ValueError, match="no sharding for"):
        kdtree_jax.load_checkpoint(path, shardings=lambda m: {"embed_tokens": {"embedding": NamedSharding(mesh, P())}})
    with pytest.raises(ValueError, match="tokenizer file"):
        kdtree_jax.save_checkpoint(str(tmp_path / "new"), target, tokenizer_dir_or_files=[str(tmp_path / "nope.json")])
    assert not os.path.exists(tmp_path / "new")  # checked before anything is written


def test_generate_cli_runs_on_a_saved_pair(saved, capsys):
    from kdtree_jax.generate import main as cli_main

    path, _, _, tok_file = saved
    prompt = "def fibonacci(n):"
    assert cli_main(["--prompt", prompt, "--checkpoint", path, "--max-new-tokens", "3", "--budget", "2",
                         "--topk", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) == 3
    assert out["text"] == HFTokenizer(tok_file).decode(out["tokens"])
    assert out["stats"]["tree_temperature"] == 1.0  # this checkpoint recommends none


def test_recommended_tree_temperature(saved, tmp_path):
    from kdtree_jax.checkpoint import recommended_tree_temperature

    path, target, drafter, _ = saved
    assert recommended_tree_temperature(path) == 1.0 and recommended_tree_temperature(str(tmp_path)) == 1.0
    tuned = str(tmp_path / "tuned")
    kdtree_jax.save_checkpoint(tuned, target, drafter, extra_metadata={"decoding": {"tree_temperature": 0.4}})
    assert recommended_tree_temperature(tuned) == 0.4
