"""The command line's sampling settings: each flag the user gives, else the checkpoint's generation_config.json, else
greedy without penalties; the penalty flags reach the decode (the default pair on the CPU)."""

from __future__ import annotations

import json
import os

import pytest

from kdtree_jax.generate import build_parser, sampling_settings
from kdtree_jax.speculative.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "checkpoints", "default")


def _settings(tmp_path, argv, config=None):
    if config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return sampling_settings(build_parser().parse_args(["--prompt", "x", *argv]), str(tmp_path))


def test_flags_override_the_checkpoints_generation_config_key_by_key(tmp_path, capsys):
    assert _settings(tmp_path, []) == SamplingParams()  # no file: greedy, no penalties
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.2, "max_length": 99}
    assert _settings(tmp_path, [], config) == SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.2)
    assert "--temperature 0.7, --top-p 0.9, --repetition-penalty 1.2" in capsys.readouterr().err
    got = _settings(tmp_path, ["--temperature", "0", "--presence-penalty", "0.5", "--top-k", "3"], config)
    assert got == SamplingParams(top_p=0.9, top_k=3, repetition_penalty=1.2, presence_penalty=0.5)
    assert "--temperature" not in capsys.readouterr().err  # the flag's value, no notice for it
    assert _settings(tmp_path, [], {**config, "do_sample": False}).temperature == 0  # Hugging Face's greedy


def test_bad_sampling_values_are_one_line_naming_the_flag_or_the_file(tmp_path, capsys):
    for argv, message in ((["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
                          (["--presence-penalty", "nan"], "--presence-penalty must be a finite number")):
        with pytest.raises(SystemExit) as e:
            _settings(tmp_path, argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _settings(tmp_path, [], {"top_p": 2})
    assert "generation_config.json: top_p must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                    reason="checkpoints/default is not there")
def test_the_penalty_flags_reach_the_decode(capsys):
    from kdtree_jax.generate import main

    def tokens(*flags):  # greedy without penalties unless the flags say otherwise (the last of a flag wins)
        assert main(["--prompt", "def f(x):\n    return x", "--max-new-tokens", "24", "--budget", "4", "--json",
                     "--dtype", "float32", "--temperature", "0", "--top-p", "1", "--repetition-penalty", "1",
                     *flags]) == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    plain = tokens()
    assert tokens("--frequency-penalty", "0") == plain  # a neutral value changes nothing
    assert tokens("--repetition-penalty", "3", "--frequency-penalty", "2") != plain


@pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                    reason="checkpoints/default is not there")
def test_the_embedded_pair_recommends_its_measured_settings(capsys):
    """checkpoints/default/generation_config.json holds the pick of benchmarks/generation_settings.py's result (issues
    43 and 47: the best tau among the settings whose last-64 repetition is <= 0.2 on the held-out prompts and on the
    README's prompt), which is not plain greedy decoding (its text loops); the CLI starts from it and a flag overrides
    it."""
    from kdtree_jax import generation_config

    with open(os.path.join(ROOT, "benchmarks", "results", "generation_settings_cpu.json")) as f:
        result = json.load(f)
    pick = next(r for r in result["results"] if r["label"] == result["pick"])
    assert pick["heldout"]["last64"] <= 0.2 and pick["fibonacci"]["last64"] <= 0.2
    fits = [r for r in result["results"] if r["heldout"]["last64"] <= 0.2 and r["fibonacci"]["last64"] <= 0.2]
    assert pick["heldout"]["tau"] == max(r["heldout"]["tau"] for r in fits)
    greedy = next(r for r in result["results"] if SamplingParams(**r["settings"]) == SamplingParams())
    assert greedy["heldout"]["last64"] > 0.2  # why the pair recommends something else
    shipped = generation_config.resolve(generation_config.load(DEFAULT))
    assert shipped == SamplingParams(**pick["settings"]) != SamplingParams()
    assert sampling_settings(build_parser().parse_args(["--prompt", "x"]), DEFAULT) == shipped
    assert "sampling settings from generation_config.json" in capsys.readouterr().err
    plain = ["--prompt", "x", "--temperature", "0", "--top-p", "1", "--repetition-penalty", "1"]
    assert sampling_settings(build_parser().parse_args(plain), DEFAULT) == SamplingParams()
