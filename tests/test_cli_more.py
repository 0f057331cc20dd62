"""`python -m kdtree_jax.generate`: --stop, --batch-file, --no-echo, streaming read as it arrives (issue 25 item 6)."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kdtree_jax.generate import DEFAULT_BUDGET, TokenStream, build_parser, check_flags, main as cli_main
from kdtree_jax.tokenizer import ByteTokenizer

# Plain greedy decoding whatever the checkpoint's generation_config.json recommends: what the texts below were read from.
BASE = ["--prompt", "def f(x):", "--max-new-tokens", "40", "--budget", "8", "--temperature", "0", "--top-p", "1",
        "--repetition-penalty", "1"]


def _json(capsys, argv):
    assert cli_main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_stop_string_cuts_the_text_and_ends_the_row(capsys, monkeypatch):
    plain = _json(capsys, BASE)
    assert "return" in plain["text"] and plain["finish_reason"] == "length"
    cut = plain["text"][:plain["text"].index("return")]
    stopped = _json(capsys, BASE + ["--stop", "return", "--stop", "no such text"])
    assert stopped["text"] == cut and stopped["finish_reason"] == "stop"
    # The tokens are cut with the text: the fewest of the run's tokens whose text covers it, not what the loop ran
    # past the stop (up to a chunk).
    from kdtree_jax import default_checkpoint
    from kdtree_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(os.path.join(default_checkpoint(), "tokenizer"))
    n = len(stopped["tokens"])
    assert stopped["tokens"] == plain["tokens"][:n]
    assert tokenizer.decode(stopped["tokens"]).startswith(cut) and len(tokenizer.decode(stopped["tokens"][:-1])) < len(cut)
    # Streamed without the prompt: the same cut text, the stop string never shown; the progress bar is fed the
    # prefill and the compile (generate's on_progress).
    import kdtree_jax.generate as cli

    calls = []

    class Recorder(cli.ProgressBar):
        def __call__(self, *a):
            calls.append(a)
            return super().__call__(*a)
    monkeypatch.setattr(cli, "ProgressBar", Recorder)
    assert cli_main(BASE + ["--stop", "return", "--no-echo"]) == 0
    assert capsys.readouterr().out == cut + "\n"
    assert calls[0][0] == "prefill" and calls[-3][0] == "prefill" and calls[-2:] == [("compile", 0, 1), ("compile", 1, 1)]
    # A stop in the first token ends the row before the decode loop runs a step (generate's on_tokens -> True);
    # '\n' is one token, so it is also a stop id the loop checks on the device.
    assert plain["text"].startswith("\n")
    first = _json(capsys, BASE + ["--stop", "\\n"])
    assert first["text"] == "" and first["tokens"] == [] and first["finish_reason"] == "stop"  # the stop is not kept


def test_token_stream_holds_back_what_may_start_a_stop():
    out = io.StringIO()
    stream = TokenStream(ByteTokenizer(), "P:", out=out, stops=["END"])
    assert not stream(0, list(b"abc E"))
    assert out.getvalue() == "P:abc "  # 'E' may begin 'END'
    assert not stream(0, list(b"Nx"))
    assert out.getvalue() == "P:abc ENx"  # it did not
    assert not stream(0, list(b" EN"))
    assert out.getvalue() == "P:abc ENx "  # 'EN' held back
    assert stream(0, list(b"D tail"))  # the stop: the row ends, nothing from it on is shown
    assert out.getvalue() == "P:abc ENx " and stream.stopped
    assert stream(0, list(b"more"))
    stream.finish("abc ENx ")
    assert out.getvalue() == "P:abc ENx \n"


def test_batch_file_jsonl_in_jsonl_out(tmp_path, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "def f(x):"}) + "\n\n" + json.dumps({"prompt": "class Parser:"}) + "\n")
    assert cli_main(["--batch-file", str(path), "--max-new-tokens", "12", "--budget", "0", "--stop", "return"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["index"] for r in records] == [0, 1]
    assert [r["prompt"] for r in records] == ["def f(x):", "class Parser:"]
    for r in records:
        assert "return" not in r["text"] and r["finish_reason"] in ("stop", "length")
        assert r["stats"]["batch_size"] == 2 and r["stats"]["new_tokens"] == len(r["tokens"]) <= 12
        assert r["stats"]["tau"] >= 1
        # --budget 0: the stats say what ran (the loop decodes autoregressively, whatever --tree says).
        assert r["stats"]["decoding"] == "autoregressive" and r["stats"]["tree"] == "autoregressive"
    # Bad files are one-line errors naming the line.
    path.write_text('{"prompt": "a"}\nnot json\n')
    assert cli_error(capsys, ["--batch-file", str(path)]).startswith(f"error: --batch-file {path} line 2: not JSON")
    path.write_text('{"text": "a"}\n')
    assert 'line 1: expected an object with a string "prompt"' in cli_error(capsys, ["--batch-file", str(path)])
    path.write_text("\n")
    assert "holds no prompt" in cli_error(capsys, ["--batch-file", str(path)])


def test_default_budget_is_auto():
    """Without --budget a single prompt and a --batch-file both get the adaptive budget; a number or 'auto' given
    explicitly wins; anything else is a one-line usage error; --calibrate goes with auto only."""
    def budget(argv):
        args = build_parser().parse_args(argv)
        check_flags(args, "ddtree")
        return args.budget
    assert DEFAULT_BUDGET == "auto"
    assert budget(["--prompt", "x"]) == "auto"
    assert budget(["--batch-file", "prompts.jsonl"]) == "auto"
    assert budget(["--batch-file", "prompts.jsonl", "--budget", "32"]) == 32
    assert budget(["--prompt", "x", "--budget", "AUTO"]) == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prompt", "x", "--budget", "big"])
    with pytest.raises(SystemExit):
        budget(["--prompt", "x", "--budget", "8", "--calibrate"])


def cli_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_streamed_output_arrives_before_the_process_ends():
    """Read the CLI's stdout as it arrives: the first text comes while the process still runs (the first token is
    handed over after the prefill, before the loop's compile), and the whole of it is the prompt-less text.

    The prompt, lengths and the session's matmul precision (conftest.py) are those of test_chunked_loop.py's
    in-process CLI run, so in a full run the child reads its prefill and loop programs from the session's
    compilation cache instead of compiling them (on a CPU the precision setting does not change a float32 product)."""
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")
    proc = subprocess.Popen([sys.executable, "-m", "kdtree_jax.generate", "--prompt", "def f(x):", "--no-echo",
                             "--max-new-tokens", "40", "--budget", "0", "--stop", "no such text"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        first = os.read(proc.stdout.fileno(), 1 << 16)
        assert first and proc.poll() is None  # text before the end
        rest = proc.stdout.read()
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read().decode()
    assert proc.returncode == 0, err
    text = (first + rest).decode()
    assert not text.startswith("def f(x):") and text.endswith("\n") and len(text) > 10
    assert "tau" in err


# Issue 25 item 7: no silent fallbacks.

def test_no_tokenizer_and_no_drafter_are_notices(tmp_path, capsys, monkeypatch):
    import kdtree_jax
    from kdtree_jax.speculative import engine

    from flax import nnx

    from kdtree_jax.tokenizer import ByteTokenizer

    # A checkpoint with no drafter and no tokenizer (load_checkpoint's answer for one; abstract weights: the checks
    # and notices need only shapes).
    target = nnx.eval_shape(lambda: kdtree_jax.init_model(kdtree_jax.ModelConfig.preset("tiny"), seed=0))
    monkeypatch.setattr(kdtree_jax, "load_checkpoint", lambda path, dtype=None: (target, None, ByteTokenizer()))
    path = str(tmp_path)

    def stop_here(*a, **k):  # the notices come before any device work; the run itself is not needed here
        raise ValueError("stopped before the device work")
    monkeypatch.setattr(engine, "generate", stop_here)
    assert cli_error(capsys, ["--prompt", "abc", "--checkpoint", path]) == "error: stopped before the device work"
    # (cli_error consumed the output; run again to read the notices)
    with pytest.raises(SystemExit):
        cli_main(["--prompt", "abc", "--checkpoint", path, "--json"])
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("notice: ")]
    assert len(notices) == 2
    assert "has no tokenizer" in notices[0] and "UTF-8 bytes" in notices[0]
    assert "no drafter: decoding autoregressively" in notices[1]
    # --budget 0 asks for autoregressive decoding: no notice about the drafter.
    with pytest.raises(SystemExit):
        cli_main(["--prompt", "abc", "--checkpoint", path, "--budget", "0"])
    assert "no drafter" not in capsys.readouterr().err


def test_budget_with_a_chain_or_static_tree_is_an_error_and_top_p_whatever_the_temperature(capsys):
    assert cli_error(capsys, ["--prompt", "x", "--tree", "chain", "--budget", "8"]) == (
        "error: --budget sizes a DDTree only; --tree chain verifies the drafter's top-1 path (block_size - 1 drafted "
        "nodes): drop --budget")
    assert "--tree 2,1 verifies the static shape given" in cli_error(capsys, ["--prompt", "x", "--tree", "2,1",
                                                                              "--budget", "0"])
    for temperature in ("0", "0.7"):
        assert "--top-p must be in (0, 1]" in cli_error(capsys, ["--prompt", "x", "--top-p", "1.5",
                                                                 "--temperature", temperature])


# Issue 25 item 8: nits.

def test_benchmark_help_and_one_flag_name_per_concept():
    """components.py --help prints help; every benchmark flag has help text; --max-new-tokens, --topk (drafter
    candidates) and --top-k (sampling) everywhere, the old spellings hidden aliases."""
    import ast
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "components.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:") and "helper module" in proc.stdout
    flags = set()
    for path in sorted(glob.glob(os.path.join(root, "benchmarks", "*.py"))) + [os.path.join(root, "kdtree_jax",
                                                                                           "generate.py")]:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                names = [a.value for a in node.args if isinstance(a, ast.Constant)]
                assert any(k.arg == "help" for k in node.keywords), f"{path}: {names} has no help"
                hidden = any(k.arg == "help" and isinstance(k.value, ast.Attribute) and k.value.attr == "SUPPRESS"
                             for k in node.keywords)
                if not hidden:
                    flags.update(names)
    assert not flags & {"--max-new", "--topks", "--top-k-sampling"}
    assert {"--max-new-tokens", "--topk", "--top-k"} <= flags


def test_an_empty_prompt_of_a_batch_is_named_and_top_k_keeps_its_old_spelling():
    from flax import nnx

    import kdtree_jax

    cfg = kdtree_jax.ModelConfig.preset("tiny")
    target = nnx.eval_shape(lambda: kdtree_jax.init_model(cfg, seed=0))
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        kdtree_jax.generate(target, None, [[1, 2], []])
    from kdtree_jax.generate import build_parser

    assert build_parser().parse_args(["--prompt", "x", "--top-k-sampling", "3"]).top_k_sampling == 3  # old spelling
    assert build_parser().parse_args(["--prompt", "x", "--top-k", "5"]).top_k_sampling == 5
    assert build_parser().parse_args(["--prompt", "x"]).top_k_sampling is None  # the checkpoint's, else 0


def test_progress_hook_counts_prefill_chunks(monkeypatch):
    """prefill(on_progress=): ("prefill", done, total) after each chunk has run (generate passes its on_progress
    down; the compile's calls are checked through the CLI in test_stop_string_...); the CLI's bar takes them."""
    import kdtree_jax
    from kdtree_jax import kv_pool
    from kdtree_jax.decode import prefill
    from kdtree_jax.generate import ProgressBar

    cfg = kdtree_jax.ModelConfig.preset("tiny")
    target = kdtree_jax.init_model(cfg, seed=0)
    calls = []
    ids = np.zeros((1, 48), np.int32)
    ids[0, :40] = np.arange(1, 41)
    prefill(target, kv_pool.init_cache(cfg, 1, 64), ids, np.array([40]), chunk_size=16,
            on_progress=lambda *a: calls.append(a))
    assert calls == [("prefill", 16, 40), ("prefill", 32, 40), ("prefill", 40, 40)]
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = ProgressBar()
    for call in calls + [("compile", 0, 1), ("compile", 1, 1)]:
        bar(*call)
    assert bar.bar is not None and not bar.enabled  # closed after the compile (no terminal: tqdm drew nothing)
