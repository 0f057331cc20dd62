"""Issue 25: every bad input is a one-line error before any device work (API: ValueError; CLI: `error: ...` on
stderr, exit status 2, no traceback), the context is checked, prompts come from a file or stdin, and a huge
prompt is not echoed whole."""

import io
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import kdtree_jax
from kdtree_jax.generate import ECHO_LIMIT, main as cli_main
from kdtree_jax.speculative import engine

TINY = kdtree_jax.ModelConfig.preset("tiny")  # max_position_embeddings 1024, vocab 512


@pytest.fixture(scope="module")
def pair():
    """Abstract models (shapes only): the checks need no weights, and allocate nothing."""
    from flax import nnx

    target = nnx.eval_shape(lambda: kdtree_jax.init_model(TINY, seed=0))
    drafter = nnx.eval_shape(lambda: kdtree_jax.init_drafter(TINY, kdtree_jax.DrafterConfig(block_size=8), seed=1))
    return target, drafter


def _no_device_work(monkeypatch):
    """Fail loudly if a check lets the call reach the prefill or the loop."""
    def boom(*a, **k):
        raise AssertionError("device work started before the arguments were checked")
    monkeypatch.setattr(engine, "setup", boom)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_ids=[1] * 1025), r"the prompt has 1025 tokens, more than the model's context of 1024 tokens"),
    (dict(prompt_ids=[1] * 1000, max_new_tokens=100),
     r"the prompt \(1000 tokens\) \+ max_new_tokens \(100\) = 1100 tokens exceeds the model's context of 1024 "
     r"tokens \(max_position_embeddings\); max_new_tokens can be at most 24"),
    (dict(max_new_tokens=10 ** 9), r"context of 1024 tokens"),
    (dict(budget=100_000, topk=8), r"budget must be <= 4096 \(the most nodes a step may verify\); got 100000"),
    (dict(budget=300, topk=2), r"budget must be <= 254 \(the distinct prefixes of block_size 8 and topk 2\)"),
    (dict(topk=10 ** 6), r"topk must be in \[1, 512\] \(the vocabulary\)"),
    (dict(tree=(4, 4, 4, 4, 4, 4, 4), topk=4), r"the static tree \[4, 4, 4, 4, 4, 4, 4\] has more than 4097 nodes"),
    (dict(tree=(1,) * 8), r"a static tree has at most 7 levels"),
    (dict(tree=(5, 1), topk=4), r"branching factors must be in \[1, topk=4\]"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer"),
    (dict(prompt_ids=[[1, 2], []]), r"prompt_ids\[1\] is empty"),
    (dict(prompt_ids=[]), r"prompt_ids holds no prompt"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\] \(1: off\); got 1.5"),  # greedy or not
    (dict(top_p=0.0, temperature=0.7), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k must be in \[0, 512\]"),
    (dict(top_k=10 ** 6, temperature=0.7), r"top_k must be in \[0, 512\]"),
])
def test_api_rejects_in_one_line_before_device_work(pair, monkeypatch, kwargs, message):
    target, drafter = pair
    _no_device_work(monkeypatch)
    kwargs = {"prompt_ids": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=message) as e:
        kdtree_jax.generate(target, drafter, **kwargs)
    assert "\n" not in str(e.value)


def test_api_rejects_what_does_not_fit_in_memory(monkeypatch):
    """A context long enough to pass the context check but a pool larger than the machine: an error naming the
    bytes, not an out-of-memory traceback."""
    import jax
    from flax import nnx

    cfg = TINY.replace(max_position_embeddings=10 ** 12)
    target = nnx.eval_shape(lambda: kdtree_jax.init_model(cfg, seed=0))  # no weights needed to be refused
    _no_device_work(monkeypatch)
    with pytest.raises(ValueError, match=r"need about .* TB .* but the device has .* free: lower max_new_tokens"):
        engine.generate(target, None, [1, 2, 3], max_new_tokens=10 ** 10, budget=0)
    with pytest.raises(ValueError, match=r"4096 prompt\(s\)"):
        engine.generate(target, None, np.ones((4096, 8), np.int32), max_new_tokens=10 ** 6, budget=0)
    del jax


def _cli_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize("argv, message", [
    (["--budget", "100000"], "--budget must be in [0, 4096]"),
    (["--budget", "-3"], "--budget must be in [0, 4096]"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--tree", "bush"], "--tree must be 'ddtree', 'chain' or comma-separated integers"),
    (["--max-new-tokens", "1000000000"], "+ --max-new-tokens (1000000000) = 1000000001 tokens exceeds the model's "
                                         "context of 4096 tokens (max_position_embeddings); --max-new-tokens can be "
                                         "at most 4095"),
    (["--topk", "100000"], "--topk must be in [1, 8192]"),
    (["--top-k", "100000"], "--top-k must be in [0, 8192] (0: off; the vocabulary); got 100000"),
    (["--top-k-sampling", "-1"], "--top-k must be >= 0"),  # the old spelling, a hidden alias
    (["--tree", "4,4,4,4,4,4,4"], "has more than 4097 nodes"),
])
def test_cli_errors_are_one_line_exit_2(capsys, argv, message):
    assert message in _cli_error(capsys, ["--prompt", "abc"] + argv)


def test_cli_long_prompt_from_a_file_is_refused_by_the_context(tmp_path, capsys):
    path = tmp_path / "long.txt"
    path.write_text("def f(x):\n    return x\n" * 3000)
    line = _cli_error(capsys, ["--prompt-file", str(path)])
    assert "more than the model's context of 4096 tokens" in line
    assert "--prompt-file" in _cli_error(capsys, ["--prompt-file", str(tmp_path / "missing.txt")])
    (tmp_path / "empty.txt").write_text("")
    assert "the prompt is empty" in _cli_error(capsys, ["--prompt-file", str(tmp_path / "empty.txt")])


def test_cli_prompt_from_stdin_and_file_and_a_cut_echo(tmp_path, capsys, monkeypatch):
    from kdtree_jax.generate import build_parser, read_prompt

    # Longer than the echo limit in characters, short in tokens (a comment ruler: ~85 tokens, where 'x' * 2500 is ~1250
    # tokens to prefill and a pool 7 times larger for the decode loop).
    text = "# " + "=" * (ECHO_LIMIT + 500) + "\nimport os\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert read_prompt(build_parser().parse_args(["--prompt", "-"])) == text
    path = tmp_path / "p.txt"
    path.write_text(text)
    assert cli_main(["--prompt-file", str(path), "--max-new-tokens", "3", "--budget", "0"]) == 0
    out = capsys.readouterr()
    assert len(out.out) < ECHO_LIMIT and out.out.startswith("...") and "import os\n" in out.out
    assert f"the prompt has {len(text):,} characters" in out.err
    # The summary says what tau means and splits the wall time.
    assert "tokens per target pass" in out.err and "end to end" in out.err and "decoding alone" in out.err


def test_cli_as_a_process_exits_2_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "kdtree_jax.generate", "--prompt", "x", "--budget", "100000"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --budget must be in [0, 4096] (tree nodes a step verifies); "
                                                "got 100000"]
