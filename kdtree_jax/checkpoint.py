"""Save / restore a target (+ drafter, + tokenizer) as a self-describing Orbax checkpoint directory.

Layout of a checkpoint directory:

    kdtree_checkpoint.json   format version, configs, dtypes, tokenizer kind and files, the pieces below
    target/<piece>/          Orbax checkpoints (orbax.checkpoint.v1 `save`); each holds some of the
    drafter/<piece>/         model's parameters as a nested dict keyed like nnx.state(model)
    tokenizer/               copies of the tokenizer files (tokenizer.json, or tiktoken.model + config)

`save_checkpoint` writes one piece per model. The HF converter writes one piece per parameter, so it
never holds more than one parameter in memory (an Orbax save holds its whole tree). Restoring builds the
abstract model with `nnx.eval_shape` (no allocation), attaches the requested sharding to every abstract
array and lets Orbax read each piece straight into those shardings: no host copy of the whole model and
no restore-then-reshard. The metadata file is written last: a directory without it is incomplete.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import sys
import threading
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from orbax.checkpoint import v1 as ocp

from kdtree_jax.config import ModelConfig
from kdtree_jax.model.drafter import Drafter, DrafterConfig
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.sharding import attach_mesh, check_layout, pad_vocab, placement_shardings
from kdtree_jax import tokenizer as tokenizer_lib
from kdtree_jax import weight_storage

METADATA_FILE = "kdtree_checkpoint.json"
FORMAT = "kdtree-jax checkpoint"
FORMAT_VERSION = 1

ShardingFn = Callable[[nnx.Module], Any]


# Paths and trees ------------------------------------------------------------------------------------
def _key(path: tuple) -> tuple:
    """Orbax trees are keyed by strings; NNX paths hold ints for list entries (layers)."""
    return tuple(str(p) for p in path)


def _nest(flat: dict) -> dict:
    """{('layers', '0', 'w'): x} -> {'layers': {'0': {'w': x}}}."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return tree


def _flatten(tree, prefix=()) -> dict:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, prefix + (str(k),)))
        return out
    return {prefix: tree}


def _leaf_paths(tree) -> dict:
    """{string path: leaf} of a pytree such as nnx.state(module) or a sharding tree shaped like it.

    NNX Variables are pytree nodes holding their value under the attribute 'value'; that level is dropped
    so the path of a parameter is the same in a State, in a pure dict and in our Orbax pieces.
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))[0]
    out = {}
    for path, leaf in leaves:
        keys = []
        for k in path:
            if isinstance(k, jax.tree_util.GetAttrKey) and k.name in ("value", "raw_value"):
                continue
            keys.append(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))))
        out[tuple(keys)] = leaf
    return out


def _dtype_name(dtype) -> str:
    return np.dtype(dtype).name


# Writing ---------------------------------------------------------------------------------------------
class CheckpointWriter:
    """Writes a checkpoint directory piece by piece; `finish` writes the metadata that makes it valid."""

    def __init__(self, path: str, target_cfg: ModelConfig, dtype, drafter_cfg: Optional[DrafterConfig] = None,
                 drafter_dtype=None, tokenizer=None, weights: str = "plain"):
        self.path = os.path.abspath(os.fspath(path))
        self.weights = weights
        weight_storage.describe(weights)  # an unknown format fails before anything is written
        if os.path.exists(self.path) and (not os.path.isdir(self.path) or os.listdir(self.path)):
            raise ValueError(f"checkpoint path {self.path} exists and is not an empty directory; choose a new one")
        # Checked before anything is written; copied by finish().
        self.tokenizer_kind, self.tokenizer_files = _tokenizer_files(tokenizer)
        self.created = not os.path.exists(self.path)  # abort() removes the directory only if this writer made it
        os.makedirs(self.path, exist_ok=True)
        self.target_cfg, self.dtype = target_cfg, dtype
        self.drafter_cfg, self.drafter_dtype = drafter_cfg, drafter_dtype if drafter_dtype is not None else dtype
        self.pieces: dict[str, list[str]] = {"target": [], "drafter": []}

    def _write(self, model: str, name: str, flat: dict) -> None:
        rel = f"{model}/{name}"
        stored = weight_storage.encode({_key(p): v for p, v in flat.items()}, self.weights)
        ocp.save(os.path.join(self.path, rel), _nest(stored))
        self.pieces[model].append(rel)

    def write_target_piece(self, flat: dict, name: Optional[str] = None) -> None:
        """Write parameters {nnx path: array} of the target as one piece (named after its first path)."""
        self._write("target", name or ".".join(_key(next(iter(flat)))), flat)

    def write_drafter_piece(self, flat: dict, name: Optional[str] = None) -> None:
        if self.drafter_cfg is None:
            raise ValueError("this writer was made without a drafter_cfg")
        self._write("drafter", name or ".".join(_key(next(iter(flat)))), flat)

    def abort(self) -> None:
        """Remove what this writer wrote (after a failure or an interrupt): the directory if it made it, else the
        directory's contents (it was empty), so that no half-written checkpoint is left behind."""
        if not os.path.isdir(self.path):
            return
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for name in os.listdir(self.path):
            full = os.path.join(self.path, name)
            shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)

    def finish(self, extra_metadata: Optional[dict] = None) -> None:
        if self.tokenizer_files:
            os.makedirs(os.path.join(self.path, "tokenizer"))
        for f in self.tokenizer_files:
            shutil.copy(f, os.path.join(self.path, "tokenizer", os.path.basename(f)))
        tok = {"kind": self.tokenizer_kind, "files": [os.path.basename(f) for f in self.tokenizer_files]}
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "target": {"config": self.target_cfg.to_dict(), "dtype": _dtype_name(self.dtype),
                       "pieces": self.pieces["target"], "weights": weight_storage.describe(self.weights)},
            "drafter": None if self.drafter_cfg is None else {
                "config": self.drafter_cfg.to_dict(), "dtype": _dtype_name(self.drafter_dtype),
                "pieces": self.pieces["drafter"], "weights": weight_storage.describe(self.weights)},
            "tokenizer": tok,
            "extra": extra_metadata or {},
        }
        with open(os.path.join(self.path, METADATA_FILE), "w") as f:
            json.dump(meta, f, indent=2)


def _tokenizer_files(tokenizer) -> tuple[str, list[str]]:
    """(kind, files) of a tokenizer given as None (byte tokenizer), a directory, a list of files, or a loaded
    tokenizer object; raises ValueError if the files are missing or are no tokenizer we read."""
    if tokenizer is None or isinstance(tokenizer, tokenizer_lib.ByteTokenizer):
        return "byte", []
    if isinstance(tokenizer, (str, os.PathLike)) and os.path.isdir(tokenizer):
        files = [os.path.join(tokenizer, f) for f in tokenizer_lib.TOKENIZER_FILES
                 if os.path.exists(os.path.join(tokenizer, f))]
        if not files:
            raise ValueError(f"tokenizer directory {tokenizer} holds none of {tokenizer_lib.TOKENIZER_FILES}")
    elif isinstance(tokenizer, (list, tuple)):
        files = [os.fspath(f) for f in tokenizer]
    elif hasattr(tokenizer, "files"):
        files = list(tokenizer.files)
    else:
        raise ValueError(f"tokenizer_dir_or_files must be a directory, a list of files, a tokenizer or None; "
                         f"got {tokenizer!r}")
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"tokenizer file {f} does not exist")
    kind = tokenizer_lib.tokenizer_kind(files)
    if kind == "byte":
        raise ValueError(f"tokenizer files {files} hold neither tokenizer.json nor tiktoken.model")
    return kind, files


def save_checkpoint(path, target: Transformer, drafter: Optional[Drafter] = None, tokenizer_dir_or_files=None, *,
                    extra_metadata: Optional[dict] = None, weights: str = "plain") -> None:
    """Write `target` (and `drafter`, and the tokenizer's files) as a checkpoint directory at `path`.

    `path` must not exist or be an empty directory. Arrays may be sharded; Orbax writes each shard.
    `tokenizer_dir_or_files`: a directory holding tokenizer.json or tiktoken.model (+ tokenizer_config.json),
    a list of such files, a loaded tokenizer, or None (the byte tokenizer).
    `weights`: "plain" (the models' dtypes) or "int8" (block-scaled int8 matrices, half bfloat16's bytes;
    weight_storage.py); a load dequantizes them to the dtype it asks for.
    """
    if not isinstance(target, Transformer):
        raise ValueError(f"target must be a kdtree_jax Transformer; got {type(target).__name__}")
    if drafter is not None and not isinstance(drafter, Drafter):
        raise ValueError(f"drafter must be a kdtree_jax Drafter or None; got {type(drafter).__name__}")
    writer = CheckpointWriter(path, target.cfg, target.dtype, drafter.cfg if drafter is not None else None,
                              drafter.dtype if drafter is not None else None, tokenizer_dir_or_files, weights=weights)
    params = _leaf_paths(nnx.state(target))
    head = params.get(("lm_head", "kernel"))
    if head is not None and head.shape[-1] != target.cfg.vocab_size:  # a vocabulary padded for a mesh (sharding.py)
        params[("lm_head", "kernel")] = head[:, :target.cfg.vocab_size]
    try:
        writer.write_target_piece(params, name="params")
        if drafter is not None:
            writer.write_drafter_piece(_leaf_paths(nnx.state(drafter)), name="params")
        writer.finish(extra_metadata)
    except BaseException:
        writer.abort()
        raise


# Reading ---------------------------------------------------------------------------------------------
def read_json_object(file, note: str = "") -> dict:
    """The JSON object in `file` (a checkpoint's metadata, an HF config.json). A file that cannot be read or
    parsed, or holds something other than an object, is a one-line ValueError naming it (`note` appended)."""
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpoint(f"{file} cannot be read as JSON ({e}){note}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} is not a JSON object{note}")
    return data


def read_metadata(path) -> dict:
    """The checkpoint directory's metadata (configs, dtypes, tokenizer, pieces), validated."""
    file = os.path.join(os.fspath(path), METADATA_FILE)
    if not os.path.exists(file):
        raise ValueError(f"{path} is not a kdtree-jax checkpoint (no {METADATA_FILE}; an interrupted save or "
                         "conversion leaves none)")
    meta = read_json_object(file, ": a corrupt checkpoint")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{file}: format {meta.get('format')!r} version {meta.get('format_version')!r}; "
                         f"this code reads {FORMAT!r} version {FORMAT_VERSION}")
    return meta


def recommended_tree_temperature(path, default: float = 1.0) -> float:
    """The DDTree tree temperature the checkpoint's maker measured best for its pair
    (metadata extra["decoding"]["tree_temperature"]), else `default`. It depends on how the drafter was
    trained, so it belongs to the checkpoint rather than to the code."""
    try:
        meta = read_metadata(path)
    except (ValueError, OSError):
        return default
    value = (meta.get("extra") or {}).get("decoding", {}).get("tree_temperature")
    return float(value) if value is not None else default


def _shardings_by_path(shardings, abstract_module, flat_abstract: dict) -> dict:
    """Map the caller's sharding pytree (or a callable making it) onto our parameter paths."""
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return {p: device for p in flat_abstract}
    tree = shardings(abstract_module) if callable(shardings) else shardings
    if tree is None:
        return _shardings_by_path(None, abstract_module, flat_abstract)
    if isinstance(tree, jax.sharding.Sharding):
        return {p: tree for p in flat_abstract}
    by_path = _leaf_paths(tree)
    missing = [".".join(p) for p in flat_abstract if p not in by_path]
    if missing:
        raise ValueError(f"shardings: no sharding for {len(missing)} parameter(s), e.g. {missing[:4]}; the tree must "
                         "match nnx.state(module)")
    bad = [".".join(p) for p in flat_abstract if not isinstance(by_path[p], jax.sharding.Sharding)]
    if bad:
        raise ValueError(f"shardings: leaves must be jax.sharding.Sharding; not so for {bad[:4]}")
    return {p: by_path[p] for p in flat_abstract}


def _restore_module(path: str, ctor: Callable[[], nnx.Module], pieces: Sequence[str], shardings, what: str,
                    weights: Optional[dict] = None):
    abstract = nnx.eval_shape(ctor)
    graphdef, state = nnx.split(abstract)
    flat = _leaf_paths(state)  # path -> ShapeDtypeStruct
    sharding = _shardings_by_path(shardings, abstract, flat)
    block = (weights or {}).get("block", weight_storage.BLOCK)
    restored: dict = {}
    for piece in pieces:
        piece_dir = os.path.join(path, piece)
        records, absl_log = _Records(), logging.getLogger("absl")
        absl_log.addHandler(records)
        try:
            tree = ocp.metadata(piece_dir).metadata
        except Exception as e:  # noqa: BLE001 - Orbax raises many kinds on a missing or corrupt piece
            raise _corrupt(f"{what} piece", piece_dir, e) from None
        finally:
            absl_log.removeHandler(records)
        if not isinstance(tree, dict) or not tree:  # Orbax logs a corrupt metadata file and returns None
            raise _corrupt(f"{what} piece", piece_dir, " ".join(records.messages) or
                           "its Orbax metadata is missing or unreadable")
        stored = _flatten(tree)
        unknown = [".".join(p) for p in stored if weight_storage.parameter_path(p) not in flat]
        if unknown:
            raise ValueError(f"{what} piece {piece}: parameter(s) {unknown[:4]} are not in the model built from "
                             "the checkpoint's config")
        want, quantized = {}, []
        for p, m in stored.items():
            param = weight_storage.parameter_path(p)
            shape = tuple(flat[param].shape)
            if p == param:
                want[p] = jax.ShapeDtypeStruct(shape, flat[p].dtype, sharding=sharding[p])
                expect = shape
            elif p == weight_storage.stored_paths(param)[0]:
                want[p] = jax.ShapeDtypeStruct(shape, jnp.int8, sharding=sharding[param])
                quantized.append(param)
                expect = shape
            else:  # the scales, small: read whole (the values and scales meet on the host, weight_storage.dequantize)
                expect = shape[:-1] + (-(-shape[-1] // block),)
                whole = sharding[param]
                if isinstance(whole, NamedSharding):
                    whole = NamedSharding(whole.mesh, P())
                want[p] = jax.ShapeDtypeStruct(expect, jnp.float32, sharding=whole)
            if tuple(m.shape) != expect:
                raise ValueError(f"{what} piece {piece}: shape mismatch {'.'.join(p)}: stored {tuple(m.shape)}, "
                                 f"model {expect}")
        try:
            loaded = _flatten(ocp.load(piece_dir, _nest(want)))
        except Exception as e:  # noqa: BLE001 - truncated or garbled array files fail inside TensorStore
            raise _corrupt(f"{what} piece", piece_dir, e) from None
        for param in quantized:
            values, scales = weight_storage.stored_paths(param)
            if scales not in loaded:
                raise ValueError(f"{what} piece {piece}: {'.'.join(param)} has int8 values but no scales")
            w = weight_storage.dequantize(loaded.pop(values), loaded.pop(scales), flat[param].dtype, block)
            loaded[param] = jax.device_put(w, sharding[param])
        restored.update(loaded)
    missing = [".".join(p) for p in flat if p not in restored]
    if missing:
        raise ValueError(f"{what}: checkpoint lacks {len(missing)} parameter(s): {missing[:8]}")
    # Put the arrays into the abstract state's Variables, in the state's own (int-keyed) structure:
    # _leaf_paths lists the leaves in tree_flatten's order.
    treedef = jax.tree_util.tree_structure(state)
    state = jax.tree_util.tree_unflatten(treedef, [restored[p] for p in flat])
    return nnx.merge(graphdef, state)


def compute_dtype_for_backend(saved_dtype, backend: str | None = None):
    """The dtype to run a checkpoint in: float32 on a CPU, the saved dtype on an accelerator.

    XLA:CPU has no native bfloat16 matmuls (it converts around them: the default pair decodes ~3x slower in
    bfloat16 than in float32 there), and in bfloat16 a T-node verify pass can round a near-tie differently
    from a one-token step, so greedy speculative output drifts from greedy autoregressive output. Upcasting
    bfloat16 weights is exact. On a GPU bfloat16 is the fast path (and the verify kernel's dtype).
    """
    backend = backend or jax.default_backend()
    return jnp.dtype(jnp.float32) if backend == "cpu" else jnp.dtype(saved_dtype)


def add_dtype_argument(parser, **kwargs) -> None:
    """`--dtype` (default "auto") for the command lines that load a checkpoint: generate and the pair benchmarks."""
    parser.add_argument("--dtype", default="auto", **kwargs,
                        help="dtype to run the checkpoint in: 'auto' is float32 on a CPU (XLA:CPU emulates bfloat16 "
                             "matmuls, so float32 is faster there, and greedy speculative output then equals greedy "
                             "autoregressive output token for token) and the checkpoint's own dtype on a GPU"
                             + ("" if "choices" in kwargs else "; or a dtype name"))


# Damaged files --------------------------------------------------------------------------------------------------------
class CorruptCheckpoint(ValueError):
    """A checkpoint file that cannot be read (corrupt or truncated). Its message is one line naming the file."""


# TensorStore's words for a file it read and for a read past a truncated file's end (the size the file has).
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')
_SHORT_READ = re.compile(r"is not valid for value of size (\d+)")


def _corrupt(what: str, piece_dir: str, error) -> CorruptCheckpoint:
    """The one line for an Orbax / TensorStore read of `piece_dir` that failed with `error` (an exception, or the
    text Orbax logged): it names the file TensorStore names, else the data file of the size it reports (a truncated
    file), else the piece's only data file, else the piece."""
    while isinstance(error, BaseException) and error.__cause__ is not None:
        error = error.__cause__  # Orbax wraps TensorStore's precise error in a generic one
    text = str(error)
    named = [f for f in _LOCAL_FILE.findall(text) if os.path.isfile(f)]
    files = [os.path.join(d, f) for d, _, names in os.walk(piece_dir) for f in names
             if os.path.basename(d) == "d"]  # TensorStore's data files: <piece>/state/[ocdbt.process_*/]d/<hash>
    short = _SHORT_READ.search(text)
    sized = [f for f in files if short and os.path.getsize(f) == int(short.group(1))]
    name = (named[0] if named else sized[0] if len(sized) == 1 else files[0] if len(files) == 1 else piece_dir)
    kind = "truncated" if short else "corrupt or truncated"
    return CorruptCheckpoint(f"{name} ({what} {os.path.basename(piece_dir)}) is {kind}: "
                             f"{_one_line(error, 200)}; re-copy or re-convert the checkpoint")


class _Records(logging.Handler):
    """What Orbax logs while reading a piece's metadata: on a damaged piece it logs TensorStore's error and returns
    None, and that error names the file."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class _QuietAfterFailedRead(io.TextIOBase):
    """sys.stderr after a failed load: what the main program writes passes; what TensorStore's threads (foreign to
    Python: threading._DummyThread) and the interpreter's teardown write is the abandoned reads' noise."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        if sys.is_finalizing() or isinstance(threading.current_thread(), threading._DummyThread):
            return len(text)
        return self.stream.write(text)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, ...
        return getattr(self.stream, name)


class _NoOrphanedTasks(logging.Filter):
    """asyncio's 'Task exception was never retrieved' for the reads Orbax abandoned (logged as they are collected)."""

    def filter(self, record):
        return not str(record.msg).startswith("Task exception was never retrieved")


def checked_load(load: Callable, *args, **kwargs):
    """`load(*args, **kwargs)` (load_checkpoint, load_sharded, load_hf) for a command line: a file that cannot be read
    is one CorruptCheckpoint (a ValueError) whose message names it, and nothing else reaches stderr; an exception that
    is not a ValueError or OSError (Orbax / TensorStore / safetensors on a damaged file) becomes one too.

    Why stderr needs care: when one TensorStore read fails, Orbax abandons the reads still in flight and closes the
    event loops they report to; they end later, on TensorStore's threads and at interpreter exit, and each prints a
    traceback (uvloop's 'Event loop is closed', asyncio's 'Task exception was never retrieved'): from none to
    thousands of lines, by timing. So sys.stderr is held during the load (replayed after a load that worked) and after
    a failed one keeps out what foreign threads and the interpreter's teardown write (_QuietAfterFailedRead)."""
    stream, held = sys.stderr, io.StringIO()
    sys.stderr = held
    try:
        result = load(*args, **kwargs)
    except (CorruptCheckpoint, KeyboardInterrupt, SystemExit, ValueError, OSError) as e:
        failed = e
    except Exception as e:  # noqa: BLE001 - a reader's own exception kinds on a damaged file
        where = os.fspath(args[0]) if args else "the checkpoint"
        failed = CorruptCheckpoint(f"{where} is corrupt or truncated ({type(e).__name__}: {_one_line(e, 200)})")
    else:
        sys.stderr = stream
        stream.write(held.getvalue())
        return result
    if isinstance(failed, CorruptCheckpoint):
        sys.stderr = _QuietAfterFailedRead(stream)
        logging.getLogger("asyncio").addFilter(_NoOrphanedTasks())
    else:  # not a damaged file (a wrong path, an interrupt): nothing to hide
        sys.stderr = stream
        stream.write(held.getvalue())
    raise failed


def load_checkpoint(path, *, dtype=None, shardings=None):
    """(target, drafter or None, tokenizer) from a checkpoint directory.

    dtype: parameter dtype of the restored models (None: as saved; "auto": `compute_dtype_for_backend`;
    otherwise Orbax casts while reading).
    shardings: None (default device), or a callable (abstract_module) -> pytree of jax.sharding.Sharding
    matching nnx.state(module) (or one Sharding for everything, or None for the default device). It is
    called for the target and for the drafter. Each array is read straight into its sharding.
    """
    path = os.path.abspath(os.fspath(path))
    meta = read_metadata(path)
    if isinstance(dtype, str) and dtype == "auto":
        dtype = compute_dtype_for_backend(meta["target"]["dtype"])
    cfg = ModelConfig.from_dict(meta["target"]["config"])
    t_dtype = jnp.dtype(dtype if dtype is not None else meta["target"]["dtype"])
    target = _restore_module(path, lambda: Transformer(cfg, t_dtype, rngs=nnx.Rngs(0)), meta["target"]["pieces"],
                             shardings, "target", meta["target"].get("weights"))
    drafter = _restore_drafter(path, meta, dtype, shardings) if meta.get("drafter") else None
    return target, drafter, load_checkpoint_tokenizer(path, meta)


def _restore_drafter(path: str, meta: dict, dtype, shardings):
    cfg = ModelConfig.from_dict(meta["target"]["config"])
    dcfg = DrafterConfig.from_dict(meta["drafter"]["config"])
    d_dtype = jnp.dtype(dtype if dtype is not None else meta["drafter"]["dtype"])
    return _restore_module(path, lambda: Drafter(cfg, dcfg, d_dtype, rngs=nnx.Rngs(0)), meta["drafter"]["pieces"],
                           shardings, "drafter", meta["drafter"].get("weights"))


def load_drafter(path, *, dtype=None, shardings=None) -> tuple[Drafter, dict]:
    """(the drafter, the checkpoint's metadata) of a checkpoint directory, without reading its target: the directory
    may hold only the metadata file and the drafter's pieces (a drafter carried apart from its target, as
    `train drafter --init-from` takes one). dtype / shardings: as load_checkpoint's."""
    path = os.path.abspath(os.fspath(path))
    meta = read_metadata(path)
    if not meta.get("drafter"):
        raise ValueError(f"{path} holds no drafter")
    return _restore_drafter(path, meta, dtype, shardings), meta


def load_checkpoint_tokenizer(path, meta: Optional[dict] = None):
    """The tokenizer of a checkpoint directory, without its models (meta: its read_metadata, if read already)."""
    path = os.path.abspath(os.fspath(path))
    tok = (meta if meta is not None else read_metadata(path)).get("tokenizer") or {"kind": "byte"}
    try:
        return tokenizer_lib.load_tokenizer(os.path.join(path, "tokenizer"), kind=tok["kind"])
    except Exception as e:  # noqa: BLE001 - tokenizers and tiktoken raise their own kinds on a corrupt file
        raise CorruptCheckpoint(f"the tokenizer in {os.path.join(path, 'tokenizer')} is corrupt ({type(e).__name__}: "
                                f"{_one_line(e)}); re-copy it") from None


def load_sharded(path, mesh: Mesh, layout: str = "tp", *, dtype=None):
    """(target, drafter, tokenizer) from a checkpoint, each array read straight into its place on the mesh
    (no host copy of the model, no reshard), ready to run sharded: the target split by `layout` ("tp" or
    "ep", sharding.py), the drafter replicated."""
    check_layout(layout)

    def shardings(abstract_module):
        if isinstance(abstract_module, Transformer):
            return placement_shardings(abstract_module, mesh, layout)
        return NamedSharding(mesh, P())  # the drafter (sharding.py says why it is replicated)

    target, drafter, tokenizer = load_checkpoint(path, dtype=dtype, shardings=shardings)
    pad_vocab(target, mesh, layout)
    attach_mesh(target, mesh, layout)
    return target, drafter, tokenizer


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (Orbax / TensorStore errors span many), cut to `limit` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."
