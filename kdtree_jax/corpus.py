"""The training corpus of the embedded default pair: text every Python installation already has.

Sources (no download):

* the `.py` files of the running interpreter's standard library (`sysconfig.get_paths()["stdlib"]`),
* the topic texts of `pydoc_data.topics` (the help() pages of the language reference).

Rules, applied to paths relative to the stdlib directory, all deterministic (sorted paths):

* excluded: anything under `site-packages/` or `dist-packages/`; any path with a directory component
  named `test`, `tests`, `idle_test` or `__pycache__` (the test suites: large, repetitive, and full of
  deliberately odd code); `pydoc_data/topics.py` as a file (its texts come in as topic documents
  instead); files larger than `MAX_FILE_BYTES` (generated tables);
* held out for evaluation, never trained on (the tokenizer neither): the modules in `HELD_OUT`
  (those present in this interpreter);
* training split: every other remaining file, plus every pydoc topic (sorted by topic name), each topic
  a document of its own.

Files are read as UTF-8 (undecodable files are skipped) with newlines as stored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from typing import Iterator

# The default pair's end-of-document token: the tokenizer's one special token, appended after every
# document of a split (train.encode_split) and the stop token of evaluations on the held-out files.
EOS = "<|endoftext|>"

# Held out for evaluation (paths relative to the stdlib). Spread over the library: argument parsing,
# text, numbers, data formats, networking, email, json, concurrency.
HELD_OUT = (
    "argparse.py",
    "bisect.py",
    "calendar.py",
    "csv.py",
    "difflib.py",
    "fnmatch.py",
    "fractions.py",
    "getopt.py",
    "glob.py",
    "gzip.py",
    "heapq.py",
    "hmac.py",
    "netrc.py",
    "queue.py",
    "sched.py",
    "shlex.py",
    "statistics.py",
    "textwrap.py",
    "uuid.py",
    "wave.py",
    "email/quoprimime.py",
    "json/encoder.py",
)

EXCLUDED_DIRS = ("test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages")
MAX_FILE_BYTES = 400_000
TOPICS_FILE = "pydoc_data/topics.py"


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # stdlib-relative path, or "pydoc_data.topics:<topic>"
    text: str


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _eligible(rel: str, size: int) -> bool:
    parts = rel.split("/")
    if any(p in EXCLUDED_DIRS for p in parts[:-1]):
        return False
    if rel == TOPICS_FILE or not rel.endswith(".py"):
        return False
    return size <= MAX_FILE_BYTES


def source_files(root: str | None = None) -> list[str]:
    """Every eligible stdlib `.py` file (relative paths, sorted), both splits."""
    root = root or stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for f in filenames:
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if _eligible(rel, os.path.getsize(full)):
                out.append(rel)
    return sorted(out)


def _read(root: str, rel: str) -> str | None:
    try:
        with open(os.path.join(root, rel), encoding="utf-8", newline="") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return None


def topic_documents() -> list[Document]:
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [Document(f"pydoc_data.topics:{k}", topics[k]) for k in sorted(topics)]


def documents(split: str, root: str | None = None) -> list[Document]:
    """'train' or 'eval' documents, in a fixed order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval'; got {split!r}")
    root = root or stdlib_dir()
    held = set(HELD_OUT)
    docs = []
    for rel in source_files(root):
        if (rel in held) != (split == "eval"):
            continue
        text = _read(root, rel)
        if text:
            docs.append(Document(rel, text))
    if split == "train":
        docs.extend(topic_documents())
    return docs


def iter_texts(split: str) -> Iterator[str]:
    for d in documents(split):
        yield d.text


def fingerprint(docs: list[Document]) -> str:
    """A short hash of the names and texts (identifies the corpus in checkpoint metadata)."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode())
        h.update(b"\0")
        h.update(d.text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def summary() -> dict:
    train, ev = documents("train"), documents("eval")
    return {
        "stdlib": stdlib_dir(),
        "train_documents": len(train),
        "train_chars": sum(len(d.text) for d in train),
        "eval_documents": len(ev),
        "eval_files": [d.name for d in ev],
        "eval_chars": sum(len(d.text) for d in ev),
        "train_fingerprint": fingerprint(train),
        "eval_fingerprint": fingerprint(ev),
    }


if __name__ == "__main__":
    import json
    print(json.dumps(summary(), indent=2))
