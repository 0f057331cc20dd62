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

**The v2 pack** (`PACK`, `checkpoints/corpus_v2.jsonl.xz`): one xz-compressed JSON-lines file with both splits
frozen, so that a training run on another machine (the GPU image has another CPython and no internet) sees
exactly the documents this machine built it from. `build_pack` writes it from three sources of this machine:

* `stdlib`: the training split above (this interpreter's standard library + the pydoc topics);
* `stdlib_tests`: the standard library's own test suite (`test/`), files up to `PACK_MAX_FILE_BYTES`, except
  the tests of held-out modules (`test_<held-out module>.py`);
* `packages`: the `.py` files of the environment's site-packages (`PACK_PACKAGES`: the scientific / ML /
  tooling libraries installed next to kdtree_jax), without vendored copies (`_vendor`) and generated code;

every document deduplicated (exact text), and any document that shares more than `PACK_MAX_HELDOUT_SHARE` of
its distinctive lines (>= 24 characters, stripped) with the held-out files dropped (so a vendored copy of a
held-out module cannot leak into training). The `eval` split of the pack is this machine's held-out files,
verbatim. `documents(split, pack=PATH)` reads it; each document carries its `source`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
import os
import sysconfig
from typing import Iterator, Optional

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


# The v2 training pack, in the repository (relative to its root).
PACK = os.path.join("checkpoints", "corpus_v2.jsonl.xz")


@dataclasses.dataclass(frozen=True)
class Document:
    name: str  # stdlib-relative path, or "pydoc_data.topics:<topic>"; in a pack "<source>:<path>"
    text: str
    source: str = "stdlib"  # stdlib | stdlib_tests | packages (pack documents)


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


def documents(split: str, root: str | None = None, pack: Optional[str] = None) -> list[Document]:
    """'train' or 'eval' documents, in a fixed order: this interpreter's standard library, or with `pack` the
    documents of that pack file (`build_pack`)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval'; got {split!r}")
    if pack:
        return [d for d in read_pack(pack) if (d.source == "eval") == (split == "eval")]
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


def iter_texts(split: str, pack: Optional[str] = None) -> Iterator[str]:
    for d in documents(split, pack=pack):
        yield d.text


def fingerprint(docs: list[Document]) -> str:
    """A short hash of the names and texts (identifies the corpus in checkpoint metadata)."""
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode())
        h.update(b"\0")
        h.update(d.text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def summary(pack: Optional[str] = None) -> dict:
    train, ev = documents("train", pack=pack), documents("eval", pack=pack)
    out = {"pack": pack} if pack else {}
    if pack:
        by_source: dict = {}
        for d in train:
            n, c = by_source.get(d.source, (0, 0))
            by_source[d.source] = (n + 1, c + len(d.text))
        out["train_by_source"] = {k: {"documents": n, "chars": c} for k, (n, c) in sorted(by_source.items())}
    return {
        **out,
        "stdlib": pack_header(pack).get("stdlib") if pack else stdlib_dir(),
        "train_documents": len(train),
        "train_chars": sum(len(d.text) for d in train),
        "eval_documents": len(ev),
        "eval_files": [d.name for d in ev],
        "eval_chars": sum(len(d.text) for d in ev),
        "train_fingerprint": fingerprint(train),
        "eval_fingerprint": fingerprint(ev),
    }


# The v2 pack ------------------------------------------------------------------------------------------
PACK_MAX_FILE_BYTES = 200_000
PACK_MAX_HELDOUT_SHARE = 0.2
PACK_PACKAGE_MAX_CHARS = 3_000_000  # per site-packages directory
# site-packages directories taken into the pack (those present), in this order.
PACK_PACKAGES = (
    "jax", "jaxlib", "flax", "optax", "orbax", "numpy", "scipy", "matplotlib", "mpl_toolkits", "hypothesis",
    "_pytest", "pluggy", "fontTools", "PIL", "huggingface_hub", "fsspec", "rich", "click", "pygments", "pyparsing",
    "packaging", "absl", "etils", "treescope", "anyio", "httpx", "h11", "urllib3", "requests", "dateutil", "tqdm",
    "yaml", "filelock", "psutil", "setuptools", "pkg_resources", "pip", "attr", "attrs", "sortedcontainers",
    "markdown_it", "mdurl", "idna", "certifi", "charset_normalizer", "msgpack", "zipp", "tzdata", "humanize",
    "uvicorn", "starlette", "fastapi", "pydantic", "click", "jinja2", "markupsafe", "networkx", "sympy",
)
# Path components never taken from site-packages: vendored copies of other libraries, generated code.
PACK_SKIP_DIRS = ("_vendor", "vendor", "__pycache__", "_generated", "generated")
PACK_SKIP_FILES = ("_mapping.py",)  # pygments' generated lexer/formatter tables


def _distinctive_lines(text: str) -> set:
    return {ln.strip() for ln in text.splitlines() if len(ln.strip()) >= 24}


def _looks_like_code(text: str) -> bool:
    lines = text.splitlines()
    if not lines:
        return False
    long = sum(len(ln) > 200 for ln in lines)
    ascii_share = sum(c.isascii() for c in text) / len(text)
    return long / len(lines) < 0.02 and ascii_share > 0.97


def _walk_py(root: str, skip_dirs=()):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.endswith(".dist-info"))
        for f in sorted(filenames):
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def pack_candidates(site_packages: Optional[str] = None, stdlib_root: Optional[str] = None):
    """(source, name, text) of every document `build_pack` considers, before deduplication, in order."""
    root = stdlib_root or stdlib_dir()
    for d in documents("train", root):
        yield "stdlib", d.name, d.text
    held_stems = {os.path.splitext(os.path.basename(h))[0] for h in HELD_OUT}
    test_root = os.path.join(root, "test")
    for full in _walk_py(test_root, ("__pycache__",)):
        base = os.path.splitext(os.path.basename(full))[0]
        if base.startswith("test_") and base[5:] in held_stems or os.path.getsize(full) > PACK_MAX_FILE_BYTES:
            continue
        text = _read(test_root, os.path.relpath(full, test_root))
        if text and _looks_like_code(text):
            yield "stdlib_tests", "test/" + os.path.relpath(full, test_root).replace(os.sep, "/"), text
    sp = site_packages or sysconfig.get_paths()["purelib"]
    seen_pkg = set()
    for pkg in PACK_PACKAGES:
        if pkg in seen_pkg or not os.path.isdir(os.path.join(sp, pkg)):
            continue
        seen_pkg.add(pkg)
        # Files in an order fixed by a hash of their path (spread over the package's subpackages), until the
        # package's cap: no single large library dominates the source.
        files = sorted(_walk_py(os.path.join(sp, pkg), PACK_SKIP_DIRS),
                       key=lambda f: hashlib.sha256(os.path.relpath(f, sp).encode()).digest())
        taken = 0
        for full in files:
            if os.path.basename(full) in PACK_SKIP_FILES or os.path.getsize(full) > PACK_MAX_FILE_BYTES:
                continue
            rel = os.path.relpath(full, sp).replace(os.sep, "/")
            text = _read(sp, rel)
            if text and _looks_like_code(text):
                yield "packages", rel, text
                taken += len(text)
                if taken >= PACK_PACKAGE_MAX_CHARS:
                    break


def build_pack(out_path: str, max_chars: Optional[dict] = None, site_packages: Optional[str] = None,
               stdlib_root: Optional[str] = None, verbose: bool = True) -> dict:
    """Write the v2 pack (see the module docstring). max_chars: {source: cap} keeps each source's documents
    in order until its cap (None: all). Returns the summary written next to the documents (first line)."""
    root = stdlib_root or stdlib_dir()
    held = documents("eval", root)
    held_lines = set().union(*(_distinctive_lines(d.text) for d in held))
    seen, kept, dropped_dup, dropped_leak = set(), [], 0, []
    chars: dict = {}
    for source, name, text in pack_candidates(site_packages, root):
        cap = (max_chars or {}).get(source)
        if cap is not None and chars.get(source, 0) >= cap:
            continue
        h = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        if h in seen:
            dropped_dup += 1
            continue
        seen.add(h)
        lines = _distinctive_lines(text)
        if lines and len(lines & held_lines) / len(lines) > PACK_MAX_HELDOUT_SHARE:
            dropped_leak.append(f"{source}:{name}")
            continue
        kept.append(Document(f"{source}:{name}", text, source))
        chars[source] = chars.get(source, 0) + len(text)
    ev = [Document(d.name, d.text, "eval") for d in held]
    header = write_pack(out_path, kept, ev, {"stdlib": root, "by_source_chars": chars,
                                             "dropped_duplicates": dropped_dup, "dropped_heldout_overlap": dropped_leak})
    if verbose:
        print(json.dumps({k: v for k, v in header.items() if k != "dropped_heldout_overlap"}, indent=1))
        print(f"dropped for held-out overlap: {dropped_leak}")
    return header


def write_pack(out_path: str, train: list, ev: list, info: Optional[dict] = None) -> dict:
    """Write a pack: a header line, then one JSON line per document (train documents keep their source; the
    eval ones get source 'eval'). Returns the header."""
    ev = [Document(d.name, d.text, "eval") for d in ev]
    header = {"format": "kdtree_jax corpus pack v2", **(info or {}), "train_documents": len(train),
              "eval_documents": len(ev), "train_fingerprint": fingerprint(train), "eval_fingerprint": fingerprint(ev)}
    tmp = out_path + ".tmp"
    with lzma.open(tmp, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME, newline="") as f:
        f.write(json.dumps(header) + "\n")
        for d in list(train) + ev:
            f.write(json.dumps({"name": d.name, "source": d.source, "text": d.text}) + "\n")
    os.replace(tmp, out_path)
    return header


_PACK_CACHE: dict = {}


def read_pack(path: str) -> list[Document]:
    """Every document of a pack (train documents, then the eval ones, whose source is 'eval')."""
    key = (os.path.abspath(path), os.path.getmtime(path))
    if key not in _PACK_CACHE:
        docs = []
        with lzma.open(path, "rt", encoding="utf-8", newline="") as f:
            next(f)  # the header
            for line in f:
                r = json.loads(line)
                docs.append(Document(r["name"], r["text"], r["source"]))
        _PACK_CACHE.clear()
        _PACK_CACHE[key] = docs
    return _PACK_CACHE[key]


def _encode_chunk(tokenizer_file: str, texts: list) -> list:
    """Token ids of each text (a worker of encode_texts)."""
    import numpy as np
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(tokenizer_file)
    return [np.asarray(e.ids, np.int32) for e in raw.encode_batch(texts, add_special_tokens=False)]


def encode_texts(tokenizer_file: str, texts: list, workers: Optional[int] = None) -> list:
    """Token ids (int32 arrays) of every text, without special tokens. Large inputs are split over `workers`
    processes (default: the CPUs, at most 32): the tokenizers library's own batch encoding barely runs in
    parallel for this tokenizer, and the v2 pack takes about a minute on one core."""
    total = sum(len(t) for t in texts)
    if workers is None:
        try:
            workers = len(os.sched_getaffinity(0))  # the CPUs this process may use (a container's share)
        except AttributeError:  # pragma: no cover - not on Linux
            workers = os.cpu_count() or 1
        workers = min(workers, 32)
    if workers <= 1 or total < 4_000_000:
        return _encode_chunk(tokenizer_file, texts)
    import concurrent.futures
    import multiprocessing

    # Chunks of about equal characters, several per worker, in order.
    target = max(1, total // (workers * 4))
    chunks, cur, size = [], [], 0
    for t in texts:
        cur.append(t)
        size += len(t)
        if size >= target:
            chunks.append(cur)
            cur, size = [], 0
    if cur:
        chunks.append(cur)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold a GPU runtime
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        parts = list(pool.map(_encode_chunk, [tokenizer_file] * len(chunks), chunks))
    return [a for part in parts for a in part]


def pack_header(path: str) -> dict:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return json.loads(next(f))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kdtree_jax.corpus",
                                 description="Print the corpus summary, or build the v2 pack (--build-pack).")
    ap.add_argument("--pack", default=None, help="summarise this pack instead of the standard library")
    ap.add_argument("--build-pack", default=None, metavar="OUT", help="write the v2 pack to OUT")
    ap.add_argument("--max-chars", default="", help="per-source caps, e.g. stdlib_tests=8e6,packages=4e7")
    a = ap.parse_args()
    if a.build_pack:
        caps = {k: int(float(v)) for k, v in (kv.split("=") for kv in a.max_chars.split(",") if kv)}
        build_pack(a.build_pack, caps)
    else:
        print(json.dumps(summary(a.pack), indent=2))
