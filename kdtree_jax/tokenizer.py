"""Tokenizers: whatever a checkpoint carries (HF `tokenizer.json`), or raw bytes as a fallback."""

from __future__ import annotations

import os
from typing import Protocol, Sequence


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: needs no files, fits any vocab >= 256."""

    vocab_size = 256

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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(directory: str | None):
    """The tokenizer stored in `directory` (tokenizer.json), else the byte tokenizer."""
    if directory:
        path = os.path.join(directory, "tokenizer.json")
        if os.path.exists(path):
            return HFTokenizer(path)
    return ByteTokenizer()
