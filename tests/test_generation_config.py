"""A checkpoint's generation_config.json (kdtree_jax/generation_config.py): read, checked, overridden by the user."""

import json

import pytest

from kdtree_jax import generation_config
from kdtree_jax.speculative.sampling import SamplingParams


def write(tmp_path, body):
    (tmp_path / generation_config.FILENAME).write_text(json.dumps(body) if not isinstance(body, str) else body)
    return str(tmp_path)


def test_load_and_resolve(tmp_path):
    assert generation_config.load(str(tmp_path)) == {}  # no file: the defaults
    assert generation_config.resolve({}) == SamplingParams()
    path = write(tmp_path, {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1,
                            "max_length": 20, "eos_token_id": 2})
    rec = generation_config.load(path)
    assert rec == {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}
    assert generation_config.resolve(rec) == SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1)
    # The user's values win; None means "not given".
    got = generation_config.resolve(rec, temperature=0.0, top_p=None, repetition_penalty=1.0)
    assert got == SamplingParams(temperature=0.0, top_p=0.9, repetition_penalty=1.0)
    # do_sample false is greedy, as in Hugging Face.
    assert generation_config.load(write(tmp_path, {"do_sample": False, "temperature": 0.7}))["temperature"] == 0.0


@pytest.mark.parametrize("body, match", [("{not json", "JSON"), ([1, 2], "object"),
                                         ({"temperature": -1}, "temperature"), ({"top_p": 2}, "top_p"),
                                         ({"repetition_penalty": 0}, "repetition_penalty")])
def test_bad_files_are_one_line_errors(tmp_path, body, match):
    with pytest.raises(ValueError, match=match):
        generation_config.load(write(tmp_path, body))
