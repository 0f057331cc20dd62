"""Tokenizers: whatever a checkpoint carries, or raw bytes as a fallback.

* `HFTokenizer`: a `tokenizers` tokenizer.json (DeepSeek-V3 and most Hub models).
* `TiktokenTokenizer`: Kimi K2's `tiktoken.model` (base64 BPE ranks) + `tokenizer_config.json` (its
  special tokens). Needs the optional `tiktoken` package.
* `ByteTokenizer`: UTF-8 bytes, no files.
"""

from __future__ import annotations

import json
import os
from typing import Optional, Protocol, Sequence

# Files a tokenizer may consist of, in the order `load_tokenizer` prefers them.
TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer_config.json", "special_tokens_map.json")


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: needs no files, fits any vocab >= 256."""

    vocab_size = 256
    files: tuple = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers` tokenizer.json (byte-level BPE and friends)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tokenizer

        self.path = path
        self._tok = _Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()
        config = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        self.files = (path,) + ((config,) if os.path.exists(config) else ())

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class TiktokenTokenizer:
    """Kimi's tokenizer: a tiktoken BPE (`tiktoken.model`) with Kimi's split pattern and special tokens.

    As in Kimi's own `tokenization_kimi.py`: the ids right after the BPE ranks, [n, n + 258), are special
    tokens, named by `tokenizer_config.json`'s `added_tokens_decoder` (others `<|reserved_token_{id}|>`);
    special tokens written in the text are encoded as such.
    """

    NUM_RESERVED_SPECIAL_TOKENS = 256 + 2
    # Kimi K2's pre-tokenizer pattern (tokenization_kimi.py): Han runs, words with case/contractions,
    # 1-3 digit numbers, punctuation runs, newlines, whitespace.
    PATTERN = "|".join([
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ])
    # tiktoken panics on very long runs without whitespace changes; Kimi splits them at this length.
    MAX_RUN = 25_000

    def __init__(self, model_file: str, config_file: Optional[str] = None):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise ImportError("this checkpoint's tokenizer is a tiktoken model (Kimi K2): `pip install tiktoken`") from e
        if not os.path.isfile(model_file):
            raise ValueError(f"tiktoken model file {model_file} does not exist")
        ranks = load_tiktoken_bpe(model_file)
        names = {}
        if config_file and os.path.exists(config_file):
            with open(config_file) as f:
                for i, tok in (json.load(f).get("added_tokens_decoder") or {}).items():
                    names[int(i)] = tok["content"] if isinstance(tok, dict) else str(tok)
        n = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i
                               for i in range(n, n + self.NUM_RESERVED_SPECIAL_TOKENS)}
        self._enc = tiktoken.Encoding(name=os.path.basename(model_file), pat_str=self.PATTERN,
                                      mergeable_ranks=ranks, special_tokens=self.special_tokens)
        self.vocab_size = self._enc.n_vocab
        self.files = (model_file,) + ((config_file,) if config_file and os.path.exists(config_file) else ())

    def _runs(self, text: str):
        """Pieces of `text` none of which has more than MAX_RUN consecutive (non-)whitespace characters."""
        start, run, space = 0, 0, text[:1].isspace()
        for i, ch in enumerate(text):
            if ch.isspace() != space:
                run, space = 1, ch.isspace()
            else:
                run += 1
                if run > self.MAX_RUN:
                    yield text[start:i]
                    start, run = i, 1
        yield text[start:]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._runs(text):
            ids.extend(self._enc.encode(piece, allowed_special="all"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")


def tokenizer_kind(file_names: Sequence[str]) -> str:
    """'hf', 'tiktoken' or 'byte' from the names of a tokenizer's files (tokenizer.json preferred)."""
    names = {os.path.basename(f) for f in file_names}
    if "tokenizer.json" in names:
        return "hf"
    if "tiktoken.model" in names:
        return "tiktoken"
    return "byte"


def load_tokenizer(directory: str | None, kind: Optional[str] = None):
    """The tokenizer stored in `directory`: tokenizer.json, else tiktoken.model, else the byte tokenizer.

    `kind` ('hf', 'tiktoken', 'byte') forces one, and then its files must be there.
    """
    present = [f for f in TOKENIZER_FILES if directory and os.path.exists(os.path.join(directory, f))]
    if kind is None:
        kind = tokenizer_kind(present)
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        path = os.path.join(directory or "", "tokenizer.json")
        if not os.path.exists(path):
            raise ValueError(f"tokenizer kind 'hf' but no {path}")
        return HFTokenizer(path)
    if kind == "tiktoken":
        return TiktokenTokenizer(os.path.join(directory or "", "tiktoken.model"),
                                 os.path.join(directory or "", "tokenizer_config.json"))
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'hf', 'tiktoken' or 'byte'")
