"""Tokenizers: Kimi-style tiktoken models (a tiny BPE file written here), HF tokenizer.json, the byte fallback."""

import base64
import json
import os
import sys

import pytest

import kdtree_jax
from kdtree_jax import tokenizer as tk

# A few merges on top of the 256 single bytes; each merged token is reachable from lower-ranked pairs.
MERGES = [b"th", b"the", b" the", b"in", b"ing", b"er", b" t"]
SPECIAL = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>"}  # offsets from the first special id


def make_tiktoken_dir(directory) -> int:
    """tiktoken.model (base64 token + rank per line) + tokenizer_config.json; returns the number of ranks."""
    ranks = [bytes([i]) for i in range(256)] + MERGES
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "tiktoken.model"), "w") as f:
        for rank, token in enumerate(ranks):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    n = len(ranks)
    config = {"added_tokens_decoder": {str(n + i): {"content": name, "special": True} for i, name in SPECIAL.items()},
              "tokenizer_class": "TikTokenTokenizer"}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return n


TEXTS = ["the thing is rather interesting", "  indented\n\tlines\r\n", "数字 123456 和汉字", "émigré's café, naïve!", ""]


def test_tiktoken_model_file(tmp_path):
    pytest.importorskip("tiktoken")
    n = make_tiktoken_dir(tmp_path)
    tok = tk.load_tokenizer(str(tmp_path))
    assert isinstance(tok, tk.TiktokenTokenizer)
    assert tok.vocab_size == n + tk.TiktokenTokenizer.NUM_RESERVED_SPECIAL_TOKENS
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    # Merges apply inside a pre-tokenized word, and " the" is one word of the pattern.
    assert tok.encode(" the") == [256 + MERGES.index(b" the")]
    assert tok.encode("thing") == [256 + MERGES.index(b"th"), 256 + MERGES.index(b"ing")]
    # Special tokens: named by tokenizer_config.json, the rest reserved; encoded when written in the text.
    assert tok.special_tokens["<|im_end|>"] == n + 2
    assert tok.special_tokens[f"<|reserved_token_{n + 7}|>"] == n + 7
    assert tok.encode("the<|im_end|>") == [256 + MERGES.index(b"the"), n + 2]
    assert tok.decode([n + 2]) == "<|im_end|>"


def test_tiktoken_long_runs_are_split(tmp_path):
    pytest.importorskip("tiktoken")
    make_tiktoken_dir(tmp_path)
    tok = tk.load_tokenizer(str(tmp_path))
    text = "a" * (tk.TiktokenTokenizer.MAX_RUN * 2 + 7) + " b"
    assert len(list(tok._runs(text))) == 3
    assert tok.decode(tok.encode(text)) == text


def test_tiktoken_missing_gives_a_clear_error(tmp_path, monkeypatch):
    make_tiktoken_dir(tmp_path)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` fail
    with pytest.raises(ImportError, match="pip install tiktoken"):
        tk.load_tokenizer(str(tmp_path))


def test_choice_of_tokenizer(tmp_path):
    assert isinstance(tk.load_tokenizer(None), tk.ByteTokenizer)
    assert isinstance(tk.load_tokenizer(str(tmp_path)), tk.ByteTokenizer)
    assert tk.tokenizer_kind(["a/tiktoken.model", "a/tokenizer_config.json"]) == "tiktoken"
    assert tk.tokenizer_kind(["tokenizer.json", "tiktoken.model"]) == "hf"
    with pytest.raises(ValueError, match="tokenizer kind 'hf'"):
        tk.load_tokenizer(str(tmp_path), kind="hf")
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        tk.load_tokenizer(str(tmp_path), kind="sentencepiece")
    byte = tk.ByteTokenizer()
    assert byte.decode(byte.encode("héllo")) == "héllo"


def test_checkpoint_carries_a_tiktoken_tokenizer(tmp_path):
    pytest.importorskip("tiktoken")
    make_tiktoken_dir(tmp_path / "tok")
    cfg = kdtree_jax.ModelConfig.preset("tiny").replace(num_hidden_layers=1)
    target = kdtree_jax.init_model(cfg, seed=3)
    kdtree_jax.save_checkpoint(str(tmp_path / "ckpt"), target, tokenizer_dir_or_files=tk.load_tokenizer(str(tmp_path / "tok")))
    assert sorted(os.listdir(tmp_path / "ckpt" / "tokenizer")) == ["tiktoken.model", "tokenizer_config.json"]
    _, drafter, tok = kdtree_jax.load_checkpoint(str(tmp_path / "ckpt"))
    assert drafter is None and isinstance(tok, tk.TiktokenTokenizer)
    assert tok.encode("the thing<|im_end|>") == tk.load_tokenizer(str(tmp_path / "tok")).encode("the thing<|im_end|>")
