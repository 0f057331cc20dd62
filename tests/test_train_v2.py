"""Recipe v2 of the default pair (issue 26) at a tiny size on the CPU: the corpus pack (build, read, the
held-out leak filter), the source mixture, and a few steps of `train target` then `train drafter` with
KL distillation over the target's greedy and sampled continuations, through the CLI's own code path."""

import json
import os

import numpy as np
import pytest

from kdtree_jax import corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pack_round_trip_and_leak_filter(tmp_path):
    lib = tmp_path / "lib"
    (lib / "pkg").mkdir(parents=True)
    held = "\n".join(f"def held_out_function_number_{i}(argument):  # distinctive line {i}" for i in range(40)) + "\n"
    (lib / "glob.py").write_text(held)  # a held-out module (corpus.HELD_OUT)
    (lib / "ordinary.py").write_text("\n".join(f"value_{i} = compute_something_else({i}, 'abc')" for i in range(40)))
    (lib / "pkg" / "__init__.py").write_text("from .part import *  # a package of the training split\n")
    (lib / "pkg" / "part.py").write_text("def part_of_the_training_split():\n    return 'training split text'\n")
    site = tmp_path / "site"
    (site / "tqdm").mkdir(parents=True)
    (site / "tqdm" / "copied_glob.py").write_text(held)  # a vendored copy of the held-out file: must be dropped
    (site / "tqdm" / "own.py").write_text("def own_code_of_the_package(x):\n    return x * 2  # own code\n")
    (site / "tqdm" / "own_again.py").write_text("def own_code_of_the_package(x):\n    return x * 2  # own code\n")
    out = str(tmp_path / "pack.jsonl.xz")
    header = corpus.build_pack(out, site_packages=str(site), stdlib_root=str(lib), verbose=False)
    names = {d.name for d in corpus.documents("train", pack=out)}
    assert "packages:tqdm/copied_glob.py" in header["dropped_heldout_overlap"]
    assert "stdlib:ordinary.py" in names and "stdlib:pkg/part.py" in names
    own = {"packages:tqdm/own.py", "packages:tqdm/own_again.py"} & names
    assert len(own) == 1 and header["dropped_duplicates"] >= 1  # exact duplicates: the first one stays
    assert not any(n.endswith("glob.py") for n in names)
    ev = corpus.documents("eval", pack=out)
    assert [d.name for d in ev] == ["glob.py"] and ev[0].text == held and ev[0].source == "eval"
    assert corpus.pack_header(out)["eval_fingerprint"] == corpus.fingerprint(ev)
    summary = corpus.summary(out)
    assert summary["train_by_source"]["packages"]["documents"] == 1


def test_window_sampler_mix():
    from kdtree_jax.train import WindowSampler, parse_mix

    arrays = {"a": np.zeros(1000, np.int32), "b": np.ones(1000, np.int32)}
    rng = np.random.default_rng(0)
    x = WindowSampler(arrays, parse_mix("a=0.9,b=0.1"))(rng, 400, 8)
    assert x.shape == (400, 8) and 0.8 < (x[:, 0] == 0).mean() < 0.97
    assert np.allclose(WindowSampler(arrays).weights, [0.5, 0.5])  # default: proportional to tokens
    with pytest.raises(SystemExit):
        WindowSampler(arrays, {"c": 1.0})


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    d = tmp_path_factory.mktemp("pack")
    train = [doc for doc in corpus.documents("train") if 2000 < len(doc.text) < 20000][:24]
    train = [corpus.Document(doc.name, doc.text, "stdlib" if i % 2 else "packages") for i, doc in enumerate(train)]
    path = str(d / "pack.jsonl.xz")
    corpus.write_pack(path, train, corpus.documents("eval")[:3])
    return path


def test_drafter_kl_step_and_sampled_metrics():
    """The v2 drafter objective on the tiny preset: KL + weighted hard labels go down on a fixed batch, and the
    eval reports the target's filtered (T = 0.7, top-p 0.95) mass on the drafter's top-1 / top-4 per depth."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kdtree_jax.config import ModelConfig
    from kdtree_jax.model.drafter import Drafter, DrafterConfig
    from kdtree_jax.model.transformer import Transformer
    from kdtree_jax.train import _make_optimizer, _set_lr, make_drafter_eval, make_drafter_step

    cfg = ModelConfig.preset("tiny")
    target = Transformer(cfg, jnp.float32, rngs=nnx.Rngs(0))
    dcfg = DrafterConfig(block_size=4, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
    graphdef, params, rest = nnx.split(Drafter(cfg, dcfg, jnp.float32, rngs=nnx.Rngs(1)), nnx.Param, ...)
    tx = _make_optimizer(0.0)
    opt_state = _set_lr(tx.init(params), 1e-2)
    step = make_drafter_step(graphdef, tx, hard_weight=0.25, kl_weight=1.0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(1, cfg.vocab_size, size=(2, 24)), jnp.int32)
    anchors = jnp.asarray(rng.integers(4, 24 - 3, size=(2, 3)), jnp.int32)
    weights = jnp.ones((3,), jnp.float32)
    losses = []
    for _ in range(4):
        params, opt_state, loss, aux = step(params, rest, opt_state, target, tokens, anchors, weights)
        losses.append(float(loss))
        assert float(aux["kl"]) >= -1e-5
    assert losses[-1] < losses[0]
    loss, aux = make_drafter_eval(graphdef, 0.25, 1.0, 0.7, 0.95)(params, rest, target, tokens, anchors, weights)
    np.testing.assert_allclose(float(loss), 0.25 * float(aux["hard"]) + float(aux["kl"]), rtol=1e-5)
    top1, top4 = np.asarray(aux["sampled_top1_mass_by_depth"]), np.asarray(aux["sampled_top4_mass_by_depth"])
    assert top1.shape == (3,) and np.all(top1 >= 0) and np.all(top1 <= top4 + 1e-6) and np.all(top4 <= 1 + 1e-5)
    assert 0 <= float(aux["sampled_chain_run"]) <= 3
    assert jax.tree.all(jax.tree.map(lambda x: bool(np.all(np.isfinite(x))), params))


@pytest.fixture(scope="module")
def trained_target(tiny_pack, tmp_path_factory):
    """`train target` once for the module (2 layers, vocab 400, 32-token windows, a source mix, 3 steps): the
    target test checks it, the slow test trains its drafter on it (one target run and compile, not two).
    -> (return code, target directory, token cache prefix, common flags of both phases)."""
    from kdtree_jax.train import main

    d = tmp_path_factory.mktemp("train_v2")
    target_dir, cache = str(d / "target"), str(d / "tokens")
    common = ["--corpus", tiny_pack, "--token-cache", cache, "--seq-len", "32", "--save-dtype", "float32",
              "--eval-every", "2"]
    code = main(["target", "--out", target_dir, "--vocab", "400", "--layers", "2", "--batch", "2", "--steps", "3",
                 "--eval-windows", "4", "--mix", "stdlib=0.7,packages=0.3", *common])
    return code, target_dir, cache, common


def check_trained_target(trained_target, tiny_pack):
    from kdtree_jax.checkpoint import read_metadata

    code, target_dir, cache, _ = trained_target
    assert code == 0
    assert os.path.exists(cache + ".train.npz") and os.path.exists(cache + ".eval.npz")
    t = read_metadata(target_dir)["extra"]["target_training"]
    assert t["steps"] == 3 and t["layers"] == 2 and np.isfinite(t["final_eval_loss"])
    assert set(t["sources"]) == {"packages", "stdlib"} and abs(t["sources"]["stdlib"]["weight"] - 0.7) < 1e-6
    assert t["corpus"]["pack"] == tiny_pack and "train_by_source" in t["corpus"]
    return t


def test_train_target_v2_tiny(trained_target, tiny_pack):
    """A few target steps through the CLI on a pack (2 layers, vocab 400, 32-token windows, a source mix)."""
    t = check_trained_target(trained_target, tiny_pack)
    assert t["compile_seconds"] > 0 and t["tokens_per_second"] > 0


@pytest.mark.slow
def test_train_v2_target_then_drafter_tiny(trained_target, tiny_pack, tmp_path):
    """A few steps of each phase (2-layer target, vocab 400, 32-token windows, block 4), through main(); the target
    phase is the module's run (`trained_target`); the pair saved with int8 weights."""
    from kdtree_jax.checkpoint import load_checkpoint, read_metadata
    from kdtree_jax.train import main

    check_trained_target(trained_target, tiny_pack)
    _, target_dir, _, common = trained_target
    pair_dir = str(tmp_path / "pair")
    assert main(["drafter", "--target", target_dir, "--out", pair_dir, "--batch", "2", "--anchors", "2",
                 "--block-size", "4", "--drafter-layers", "1", "--drafter-intermediate", "48",
                 "--target-layer-ids", "all", "--steps", "4", "--greedy-sequences", "4", "--gen-batch", "2",
                 "--gen-temperatures", "0,0.7", "--gen-top-p", "0.95", "--hard-weight", "0.25", "--kl-weight", "1",
                 "--eval-sequences", "2", "--weights", "int8", *common]) == 0
    stored = read_metadata(pair_dir)
    assert stored["target"]["weights"]["kind"] == stored["drafter"]["weights"]["kind"] == "int8"
    meta = stored["extra"]
    d = meta["drafter_training"]
    assert meta["target_training"]["steps"] == 3
    assert d["steps"] == 4 and d["gen_sequences_by_temperature"] == {"0.0": 2, "0.7": 2}
    assert d["hard_weight"] == 0.25 and d["kl_weight"] == 1.0 and d["eval_kl"] >= 0
    assert set(d["eval_by_set"]) == {"greedy", "T0.7"}
    s = d["eval_by_set"]["T0.7"]
    assert len(s["sampled_top1_mass_by_depth"]) == 3 and len(s["sampled_top4_mass_by_depth"]) == 3
    assert all(0 <= a <= b <= 1 + 1e-5 for a, b in zip(s["sampled_top1_mass_by_depth"], s["sampled_top4_mass_by_depth"]))
    assert 0 <= s["sampled_chain_run"] <= 3
    assert [h["step"] for h in d["history"]] == [2, 4] and "eval_sampled_chain_run" in d["history"][0]
    target, drafter, _ = load_checkpoint(pair_dir)
    assert drafter is not None and drafter.cfg.block_size == 4 and target.cfg.num_hidden_layers == 2
    assert (drafter.cfg.num_layers, drafter.cfg.intermediate_size, drafter.target_layer_ids) == (1, 48, (0, 1))
    assert d["drafter_config"]["num_layers"] == 1 and d["drafter_config"]["target_layer_ids"] == [0, 1]
    with open(os.path.join(pair_dir + ".work", "drafter_summary.json")) as f:
        assert json.load(f)["steps"] == 4

    # The drafter goes on training from that pair's (its config, its weights: a zero learning rate keeps them exactly).
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kdtree_jax.checkpoint import load_drafter

    with pytest.raises(SystemExit, match="differs from the options given"):
        main(["drafter", "--target", target_dir, "--out", str(tmp_path / "bad"), "--init-from", pair_dir,
              "--drafter-layers", "2", *common])
    again = str(tmp_path / "again")
    assert main(["drafter", "--target", target_dir, "--out", again, "--init-from", pair_dir, "--batch", "2",
                 "--anchors", "2", "--steps", "1", "--lr", "0", "--greedy-sequences", "2", "--gen-batch", "2",
                 "--eval-sequences", "2", "--seed", "1", *common]) == 0
    before, _ = load_drafter(pair_dir, dtype=jnp.float32)
    _, after, _ = load_checkpoint(again)
    assert after.cfg == before.cfg and after.cfg.num_layers == 1 and after.cfg.intermediate_size == 48
    for (path, x), (_, y) in zip(jax.tree_util.tree_flatten_with_path(nnx.state(before))[0],
                                 jax.tree_util.tree_flatten_with_path(nnx.state(after))[0]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
    assert read_metadata(again)["extra"]["drafter_training"]["init_from"]["drafter_training"]["steps"] == 4


def test_drafter_options_are_checked_before_the_corpus(trained_target, tmp_path):
    """A drafter option the target cannot take is one line naming it, before any corpus work."""
    from kdtree_jax.train import main

    _, target_dir, _, common = trained_target
    for options, message in ((["--target-layer-ids", "0,9"], "subset of \\[0, 2\\)"),
                             (["--target-layer-ids", "first"], "--target-layer-ids takes layer numbers"),
                             (["--drafter-heads", "3"], "multiple of num_kv_heads")):
        with pytest.raises(SystemExit, match="drafter options: .*" + message):
            main(["drafter", "--target", target_dir, "--out", str(tmp_path / "pair"), *options, *common])
