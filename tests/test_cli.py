"""`python -m kdtree_jax.generate` end to end."""

import json
import subprocess
import sys

from kdtree_jax.generate import main as cli_main


def test_cli_json_in_process(capsys):
    assert cli_main(["--prompt", "def f(x):", "--max-new-tokens", "6", "--budget", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt"] == "def f(x):"
    assert len(out["tokens"]) == 6
    assert out["stats"]["steps"] >= 1 and out["stats"]["tau"] >= 1.0
    assert isinstance(out["text"], str)
    # The tree temperature defaults to the checkpoint's recommendation (the embedded pair's: 0.5).
    from kdtree_jax.checkpoint import recommended_tree_temperature
    from kdtree_jax.generate import DEFAULT_CHECKPOINT
    assert out["stats"]["tree_temperature"] == recommended_tree_temperature(DEFAULT_CHECKPOINT) == 0.5
    assert cli_main(["--prompt", "def f(x):", "--max-new-tokens", "6", "--budget", "4", "--json",
                     "--tree-temperature", "0.8"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["tree_temperature"] == 0.8


def test_cli_as_a_module_prints_text_and_summary():
    proc = subprocess.run([sys.executable, "-m", "kdtree_jax.generate", "--prompt", "hello", "--max-new-tokens", "4",
                           "--tree", "chain"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("hello")
    assert "tau" in proc.stderr and "tok/s" in proc.stderr


def test_cli_rejects_bad_arguments(capsys):
    import pytest
    with pytest.raises(SystemExit):
        cli_main(["--prompt", "x", "--budget", "-3"])
    with pytest.raises(SystemExit):
        cli_main(["--prompt", "x", "--tree", "bush"])
