"""`python -m kdtree_jax.generate` end to end."""

import json
import os
import subprocess
import sys

import pytest

from kdtree_jax.generate import main as cli_main


def test_cli_json_in_process(capsys, monkeypatch):
    assert cli_main(["--prompt", "def f(x):", "--max-new-tokens", "6", "--budget", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt"] == "def f(x):"
    assert len(out["tokens"]) == 6
    assert out["stats"]["steps"] >= 1 and out["stats"]["tau"] >= 1.0
    assert isinstance(out["text"], str)
    # The tree temperature defaults to the checkpoint's recommendation (kdtree_checkpoint.json
    # extra.decoding.tree_temperature, measured per pair: checkpoints/README.md); --tree-temperature overrides it.
    from kdtree_jax.checkpoint import read_metadata, recommended_tree_temperature
    from kdtree_jax.generate import DEFAULT_CHECKPOINT
    recommended = read_metadata(DEFAULT_CHECKPOINT)["extra"]["decoding"]["tree_temperature"]
    assert out["stats"]["tree_temperature"] == recommended_tree_temperature(DEFAULT_CHECKPOINT) == recommended
    # The override reaches the decode (the tree temperature is a static setting: running it would compile another
    # loop; test_engine.py checks what the engine does with it).
    from kdtree_jax.speculative import engine

    class Given(Exception):
        pass

    def given(*args, **kwargs):
        raise Given(kwargs["tree_temperature"])

    monkeypatch.setattr(engine, "generate", given)
    other = 0.8 if recommended != 0.8 else 0.7
    with pytest.raises(Given) as e:
        cli_main(["--prompt", "def f(x):", "--max-new-tokens", "6", "--budget", "4", "--json",
                  "--tree-temperature", str(other)])
    assert e.value.args == (other,)


def test_cli_runs_in_float32_on_cpu_unless_told(capsys, tmp_path, monkeypatch):
    """The embedded pair is stored in bfloat16; on a CPU `auto` runs it in float32 (exact upcast), where
    greedy speculative decoding is token-for-token autoregressive decoding."""
    import jax
    import jax.numpy as jnp

    from kdtree_jax.checkpoint import compute_dtype_for_backend
    from kdtree_jax.generate import load_models
    from kdtree_jax.speculative import cost_model as cost_models
    from kdtree_jax.speculative.step import SpecConfig
    from kdtree_jax.speculative.validation import adaptive_menu

    assert compute_dtype_for_backend("bfloat16", "cpu") == jnp.float32
    assert compute_dtype_for_backend("bfloat16", "gpu") == jnp.bfloat16
    target, drafter, tokenizer, description, _ = load_models(None)
    if jax.default_backend() == "cpu":
        assert target.dtype == jnp.float32 and drafter.dtype == jnp.float32 and "float32" in description
        told, _, _, description, _ = load_models(None, "bfloat16")
        assert told.dtype == jnp.bfloat16 and "bfloat16" in description
    # The prompt and lengths of test_chunked_loop.py's CLI run (budget 0) and of test_cli_more.py's (budget 8): in a
    # full run their loops are read back from the session's compilation cache instead of compiled again. A fixed tree,
    # so that speculation runs: on a CPU the default budget ('auto') measures that no tree pays and runs none. Greedy
    # without penalties over the checkpoint's generation_config.json: output comparable token for token, and the
    # programs (and the cost model's key below) of plain greedy decoding.
    base = ["--prompt", "def f(x):", "--max-new-tokens", "40", "--temperature", "0", "--top-p", "1",
            "--repetition-penalty", "1", "--json"]
    assert cli_main(base + ["--budget", "8"]) == 0
    speculative = json.loads(capsys.readouterr().out)
    assert speculative["stats"]["tau"] > 1.0
    assert cli_main(base + ["--budget", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == speculative["tokens"]
    # The default budget end to end, its cost model cached as a CPU measures it (no budget pays): the call runs the
    # autoregressive program just compiled instead of measuring and compiling one program per menu budget (~12 s).
    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path))
    menu = adaptive_menu("auto", None, drafter, "ddtree", 4)
    key = cost_models.fingerprint(target, drafter, SpecConfig(budget=max(menu), topk=4, menu=menu))
    model = cost_models.CostModel.load(key)
    model.add(cost_models.make_point(1, len(tokenizer.encode("def f(x):")), menu, {"ar": 1.0, 1: 8.0},
                                     expected=[1.0] + [2.0] * (len(menu) - 1)))
    model.save()
    assert cli_main(base) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["tokens"] == speculative["tokens"]
    assert auto["stats"]["budget"] == "auto" and auto["stats"]["budget_policy"]["decision"] == "autoregressive"


def test_cli_as_a_module_prints_text_and_summary():
    proc = subprocess.run([sys.executable, "-m", "kdtree_jax.generate", "--prompt", "hello", "--max-new-tokens", "4",
                           "--tree", "chain"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("hello")
    assert "tau" in proc.stderr and "tok/s" in proc.stderr


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--prompt", "x", "--budget", "-3"])
    with pytest.raises(SystemExit):
        cli_main(["--prompt", "x", "--tree", "bush"])


def test_cli_profile_splits_the_step_by_part(capsys):
    """--profile: one profiled step of the decode loop after the timed run; the output is unchanged, the step's
    kernel time is split by part (every part of a speculative step shows up) and printed on one line. The prompt and
    lengths are test_cli_json_in_process's: the decode loop compiled there serves every run here."""
    base = ["--prompt", "def f(x):", "--max-new-tokens", "6", "--budget", "4"]
    assert cli_main(base + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main(base + ["--json", "--profile"]) == 0
    profiled = json.loads(capsys.readouterr().out)
    assert profiled["tokens"] == plain["tokens"]
    prof = profiled["stats"]["profile"]
    assert prof["steps"] == 1 and prof["kernels_per_step"] > 0  # a one-step call (engine.one_step_left)
    parts = prof["components_ms"]
    assert all(parts[k] > 0 for k in ("attention", "moe", "dense", "drafter", "head", "tree_accept_commit"))
    assert prof["step_ms"] > 0 and "idle_ms" in prof
    assert cli_main(base + ["--profile"]) == 0
    assert "per step," in capsys.readouterr().err


def test_the_cli_keeps_its_compiled_programs_in_the_users_cache(tmp_path):
    """Without JAX_COMPILATION_CACHE_DIR, `python -m kdtree_jax.generate` writes its compiled programs under
    $KDTREE_JAX_CACHE/jax_compilation_cache (a second run reads them back); --no-compile-cache writes none."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    for flag, cache in (([], tmp_path / "on"), (["--no-compile-cache"], tmp_path / "off")):
        proc = subprocess.run([sys.executable, "-m", "kdtree_jax.generate", "--prompt", "hello", "--max-new-tokens", "4",
                               "--budget", "0", *flag], capture_output=True, text=True, timeout=300,
                              env={**env, "KDTREE_JAX_CACHE": str(cache)})
        assert proc.returncode == 0, proc.stderr
        written = list((cache / "jax_compilation_cache").glob("*")) if (cache / "jax_compilation_cache").exists() else []
        assert bool(written) == (not flag), (flag, written)


def test_a_compilation_cache_the_user_chose_stays():
    """runtime.use_compilation_cache keeps a directory already configured (here the test session's own)."""
    import jax

    from kdtree_jax import runtime

    chosen = jax.config.jax_compilation_cache_dir
    assert chosen and runtime.use_compilation_cache() == chosen and jax.config.jax_compilation_cache_dir == chosen
