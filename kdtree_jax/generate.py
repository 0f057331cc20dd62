"""`python -m kdtree_jax.generate`: speculative decoding from the command line.

    python -m kdtree_jax.generate --prompt "def fibonacci(n):" --max-new-tokens 64
    python -m kdtree_jax.generate --prompt "..." --budget 32 --topk 4 --temperature 0.7 --json
    python -m kdtree_jax.generate --prompt-file long_prompt.txt      # or: ... | python -m kdtree_jax.generate --prompt -
    python -m kdtree_jax.generate --prompt "def f(x):" --stop "\n\n" --no-echo
    python -m kdtree_jax.generate --batch-file prompts.jsonl > out.jsonl   # {"prompt": ...} a line in, a record a line out

Every argument is checked before any device work (the context, the tree's size, the memory a run needs): a bad one
is a one-line `error: ...` on stderr and exit status 2. Progress (load, prefill + compile) goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import types
import warnings

import jax.numpy as jnp

from kdtree_jax import generation_config
from kdtree_jax.checkpoint import add_dtype_argument
from kdtree_jax.embedded import default_checkpoint
from kdtree_jax.speculative import engine, validation
from kdtree_jax.speculative.sampling import SamplingParams

DEFAULT_CHECKPOINT = default_checkpoint(required=False)  # None where this install carries no default pair


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default in its help, except None (a default that help text describes in words)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


_FROM_CONFIG = "default: the checkpoint's generation_config.json, else "


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kdtree_jax.generate",
        description="Generate text with DDTree speculative decoding: a block drafter proposes a tree of "
                    "candidate continuations, the target verifies all of it in one pass, and the longest "
                    "agreeing path is kept. Greedy output is plain greedy decoding's (token for token in "
                    "float32; in bfloat16 a T-node verify pass can round a near-tie differently from a "
                    "1-token step); sampled output is an exact sample of the target.",
        formatter_class=_DefaultsFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue; '-' reads it from standard input")
    source.add_argument("--prompt-file", metavar="PATH", help="read the text to continue from this file (UTF-8)")
    source.add_argument("--batch-file", metavar="PATH",
                        help="a batch of prompts, one JSON object a line ({\"prompt\": \"...\"}; '-': standard "
                             "input), decoded together; prints one JSON record a line (index, prompt, text, tokens, "
                             "finish_reason, stats) on stdout")
    p.add_argument("--stop", action="append", default=[], metavar="STRING",
                   help="end a sequence when its generated text contains STRING; the output is cut before it "
                        "(repeatable; escapes such as \\n are read as Python string escapes)")
    p.add_argument("--no-echo", action="store_true", help="print only the generated text, not the prompt before it")
    p.add_argument("--checkpoint", default=None,
                   help="model directory: a kdtree_jax checkpoint (Orbax: target, drafter, tokenizer; made by "
                        "save_checkpoint, `python -m kdtree_jax.convert_hf` or `python -m kdtree_jax.train`) or an HF "
                        "checkpoint (config.json + safetensors; target only, decoded autoregressively). Default: the "
                        "embedded pair (kdtree_jax.default_checkpoint(); checkpoints/default in a checkout)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate; prompt + these must fit the model's context (max_position_embeddings)")
    p.add_argument("--budget", type=budget_argument, default=None,
                   help="DDTree nodes per step besides the root. 'auto' (default): each chunk of steps picks its budget "
                        "from {0, 4, 8, 16, 32, 64} by the drafter's own probabilities and a cost model of this device "
                        "(0: autoregressive steps that skip the drafter), measured once per model, device and batch "
                        "size in a few seconds and cached (see --calibrate); a number: that budget every step (0: plain "
                        f"autoregressive decoding; at most {validation.MAX_TREE_NODES - 1}; a warning when the cached cost "
                        "model says its step cannot beat an autoregressive one); --tree ddtree only: a chain or static "
                        "tree has its own size")
    p.add_argument("--calibrate", action="store_true",
                   help="with --budget auto: measure the step cost model again instead of using the cached one "
                        "(after a driver, library or hardware change)")
    p.add_argument("--topk", type=int, default=4, help="drafter candidates per depth the tree may branch into")
    p.add_argument("--tree-temperature", type=float, default=None,
                   help="DDTree ranks prefixes by the drafter's probabilities at this temperature; < 1 trusts the "
                        "drafter's top choices deeper (a drafter distilled on greedy text with soft labels can be "
                        "under-confident for greedy verification); 1.0: its probabilities as they are. Default: the "
                        "checkpoint's recommendation (kdtree_checkpoint.json extra.decoding; 1.0 for the embedded pair), "
                        "else 1.0")
    p.add_argument("--tree", default="ddtree",
                   help="'ddtree' (best-first, dynamic), 'chain' (DFlash: the drafter's top-1 path) or a static "
                        "shape as comma-separated branching per depth, e.g. 4,2,1")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"0: greedy; > 0: sample the target ({_FROM_CONFIG}0)")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus filter of the target distribution (sampling; 1: off; {_FROM_CONFIG}1)")
    p.add_argument("--top-k", dest="top_k_sampling", type=int, default=None,
                   help=f"top-k filter of the target distribution (sampling; 0: off; {_FROM_CONFIG}0); --topk is the "
                        "drafter's")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="divide a positive logit (multiply a negative one) by this for every token already in the "
                        f"prompt or the output (greedy or sampled; 1: off; {_FROM_CONFIG}1)")
    p.add_argument("--presence-penalty", type=float, default=None,
                   help=f"subtract this from the logit of every token already in the prompt or the output (0: off; "
                        f"{_FROM_CONFIG}0)")
    p.add_argument("--frequency-penalty", type=float, default=None,
                   help="subtract this times its count from the logit of every token in the prompt or the output "
                        f"(0: off; {_FROM_CONFIG}0)")
    p.add_argument("--top-k-sampling", dest="top_k_sampling", type=int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old spelling
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    add_dtype_argument(p, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--impl", default="auto", choices=["auto", "reference", "ffi"],
                   help="verify-attention implementation")
    p.add_argument("--row-invariant", action="store_true",
                   help="compute every verify row bit for bit as plain one-token decoding would, so that greedy "
                        "speculative output equals autoregressive output token for token in bfloat16 (much slower: "
                        "every row-wise part in fixed 64-row blocks; on a GPU also untuned cuBLAS GEMMs)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed decode, profile one step of the loop (on a copy of its starting state) and "
                        "print where a step's time goes: "
                        "kernel time per part (drafter, tree + accept + commit, the verify pass's attention, MoE and "
                        "dense layers, lm head) and the device's idle time (stats.profile with --json)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile every program afresh: by default compiled programs are kept in JAX's persistent "
                        "cache under ~/.cache/kdtree_jax/jax_compilation_cache ($KDTREE_JAX_CACHE; "
                        "$JAX_COMPILATION_CACHE_DIR wins) and the next run reads them back")
    return p


def _parse_tree(value: str):
    if value in ("ddtree", "chain"):
        return value
    try:
        shape = tuple(int(x) for x in value.split(","))
    except ValueError:
        _fail(f"--tree must be 'ddtree', 'chain' or comma-separated integers; got {value!r}")
    return shape


def notice(message: str) -> None:
    """A one-line notice on stderr: something the run does that the flags did not say."""
    print(f"notice: {message}", file=sys.stderr, flush=True)


def checkpoint_dir(checkpoint: str | None) -> str:
    """--checkpoint, else the embedded pair, else an error saying it is missing: never untrained weights' noise."""
    if checkpoint is not None:
        return checkpoint
    try:
        return DEFAULT_CHECKPOINT or default_checkpoint()
    except FileNotFoundError as e:
        _fail(str(e))


def load_models(checkpoint: str | None, dtype: str = "auto", mesh=None, layout: str = "tp"):
    """(target, drafter or None, tokenizer, description, the checkpoint's recommended tree temperature).

    mesh: a jax Mesh (sharding.make_mesh) to split the target over by `layout` ("tp" or "ep"), the drafter replicated
    on it; None: one device. A checkpoint without tokenizer files is read and written as UTF-8 bytes (token ids 0-255):
    a notice says so."""
    import kdtree_jax
    from kdtree_jax.checkpoint import load_sharded, recommended_tree_temperature
    from kdtree_jax.tokenizer import load_tokenizer

    checkpoint = checkpoint_dir(checkpoint)
    if not os.path.isdir(checkpoint):
        _fail(f"--checkpoint {checkpoint!r} is not a directory")
    from kdtree_jax.checkpoint import CorruptCheckpoint, checked_load

    try:  # checked_load: a damaged file is one CorruptCheckpoint line, with none of the readers' tracebacks
        if os.path.exists(os.path.join(checkpoint, "config.json")):
            cfg, target = checked_load(kdtree_jax.load_hf, checkpoint, dtype=jnp.bfloat16)
            if mesh is not None:  # load_hf builds the model on one device; kdtree checkpoints load straight onto the mesh
                target = kdtree_jax.shard_model(target, mesh, layout)
            tokenizer = load_tokenizer(checkpoint)
            _byte_notice(checkpoint, tokenizer, target)
            return (target, None, tokenizer, f"HF checkpoint {checkpoint} (no drafter: autoregressive)", 1.0)
        if mesh is None:
            target, drafter, tokenizer = checked_load(kdtree_jax.load_checkpoint, checkpoint, dtype=dtype)
        else:
            target, drafter, tokenizer = checked_load(load_sharded, checkpoint, mesh, layout, dtype=dtype)
        _byte_notice(checkpoint, tokenizer, target)
    except CorruptCheckpoint as e:  # the data is bad, not the command: status 1
        print(f"error: {_one_line(e, 1000)}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    except (ValueError, OSError) as e:
        _fail(f"--checkpoint {checkpoint!r}: {_one_line(e)}")
    except Exception as e:  # noqa: BLE001 - an HF directory's tokenizer files, read by their own library
        _fail(f"--checkpoint {checkpoint!r} could not be read ({type(e).__name__}: {_one_line(e)})")
    return (target, drafter, tokenizer, f"checkpoint {checkpoint} ({jnp.dtype(target.dtype).name})",
            recommended_tree_temperature(checkpoint))


def load_tokenizer_of(checkpoint: str | None):
    """The tokenizer load_models gives for this checkpoint, without the models (the server's HTTP process, whose engine
    process loaded and checked the checkpoint)."""
    from kdtree_jax.checkpoint import load_checkpoint_tokenizer
    from kdtree_jax.tokenizer import load_tokenizer

    checkpoint = checkpoint_dir(checkpoint)
    if os.path.exists(os.path.join(checkpoint, "config.json")):
        return load_tokenizer(checkpoint)
    return load_checkpoint_tokenizer(checkpoint)


def _byte_notice(checkpoint, tokenizer, target) -> None:
    from kdtree_jax.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        notice(f"{checkpoint} has no tokenizer (tokenizer.json or tiktoken.model): text is encoded and decoded as "
               f"UTF-8 bytes, token ids 0-255 of the model's {target.cfg.vocab_size}")


ECHO_LIMIT = 2000  # characters of the prompt echoed to stdout; a longer prompt's echo is cut to its end
_FLAGS = {"max_new_tokens": "--max-new-tokens", "tree_temperature": "--tree-temperature", "budget": "--budget",
          "topk": "--topk", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
          "repetition_penalty": "--repetition-penalty", "presence_penalty": "--presence-penalty",
          "frequency_penalty": "--frequency-penalty", "prompt_ids": "the prompt", "stop_ids": "the stop ids",
          "tree": "--tree"}


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (library errors can span many), cut to `limit` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fail(message: str):
    """A one-line error on stderr, exit status 2 (argparse's for a bad argument), no traceback."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _as_flags(message: str) -> str:
    """An API error message in the CLI's words: Python argument names become the flags that set them."""
    return re.sub(r"(?<![\w-])(" + "|".join(sorted(_FLAGS, key=len, reverse=True)) + r")(?![\w])",
                  lambda m: _FLAGS[m.group(1)], message)


def read_prompt(args) -> str:
    """The prompt text from --prompt TEXT, --prompt - (standard input) or --prompt-file PATH."""
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            _fail(f"--prompt-file {args.prompt_file}: {e.strerror if isinstance(e, OSError) else e}")
    elif args.prompt == "-":
        text = sys.stdin.read()
    else:
        text = args.prompt
    if not text:
        _fail("the prompt is empty" + (f" ({args.prompt_file})" if args.prompt_file else ""))
    return text


def read_batch(path: str) -> list[str]:
    """The prompts of --batch-file PATH ('-': standard input): one JSON object a line with a string "prompt";
    blank lines are skipped."""
    try:
        if path == "-":
            lines = sys.stdin.read().splitlines()
        else:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"--batch-file {path}: {e.strerror if isinstance(e, OSError) else e}")
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            _fail(f"--batch-file {path} line {n}: not JSON ({e.msg})")
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            _fail(f"--batch-file {path} line {n}: expected an object with a string \"prompt\"")
        if not record["prompt"]:
            _fail(f"--batch-file {path} line {n}: the prompt is empty")
        prompts.append(record["prompt"])
    if not prompts:
        _fail(f"--batch-file {path} holds no prompt")
    return prompts


def parse_stops(values) -> list[str]:
    """--stop values with Python string escapes read (so that a shell's '\\n' is a newline)."""
    stops = []
    for v in values:
        try:
            text = v.encode("latin-1", "backslashreplace").decode("unicode_escape")
        except UnicodeDecodeError:
            text = v
        if not text:
            _fail("--stop must not be empty")
        stops.append(text)
    return stops


def stop_token_ids(tokenizer, stops) -> list[int]:
    """The stops that are one token of their own (the loop stops on those on the device; the rest are matched in
    the text on the host after each chunk)."""
    ids = []
    for s in stops:
        enc = tokenizer.encode(s)
        if len(enc) == 1 and tokenizer.decode(enc) == s:
            ids.append(enc[0])
    return ids


def find_stop(text: str, stops) -> int | None:
    """Where the first stop string starts in text, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def cut_at_stop(text: str, stops) -> tuple[str, bool]:
    """(text cut before its first stop string, whether one was found)."""
    i = find_stop(text, stops)
    return (text, False) if i is None else (text[:i], True)


class StopWatch:
    """`generate`'s on_tokens for a batch: ends a row (returns True) once its text contains a stop string."""

    def __init__(self, tokenizer, stops):
        self.tokenizer, self.stops, self.ids = tokenizer, stops, {}

    def __call__(self, row: int, new_ids):
        ids = self.ids.setdefault(row, [])
        ids.extend(new_ids)
        return bool(self.stops) and find_stop(self.tokenizer.decode(ids), self.stops) is not None


# The adaptive budget (engine.generate(budget="auto"), kdtree_jax/speculative/budget_policy.py) for a single prompt and
# for a batch alike: a fixed budget's best value depends on the batch, the context and the device (with the default
# pair on the H200, 16 at one prompt and 8 at 16 prompts), which is what the policy measures instead of guessing.
DEFAULT_BUDGET = "auto"


def budget_argument(text: str):
    """--budget (generate, serve, the benchmarks): 'auto' or an integer."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer; got {text!r}") from None


def check_flags(args, tree) -> None:
    """The checks that need no model, before loading one (the rest come from generate's own validation)."""
    if args.budget is None:
        args.budget = DEFAULT_BUDGET
    elif tree != "ddtree":
        _fail(f"--budget sizes a DDTree only; --tree {args.tree} verifies "
              + ("the drafter's top-1 path (block_size - 1 drafted nodes)" if tree == "chain" else
                 "the static shape given") + ": drop --budget")
    if args.max_new_tokens < 1:
        _fail(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    if args.calibrate and args.budget != "auto":
        _fail("--calibrate measures the cost model of --budget auto; drop it with a numeric --budget")
    if args.budget != "auto" and not 0 <= args.budget <= validation.MAX_TREE_NODES - 1:
        _fail(f"--budget must be in [0, {validation.MAX_TREE_NODES - 1}] (tree nodes a step verifies); got {args.budget}")
    if args.topk < 1:
        _fail(f"--topk must be >= 1; got {args.topk}")
    if args.temperature is not None and not args.temperature >= 0:
        _fail(f"--temperature must be >= 0 (0: greedy); got {args.temperature}")
    if args.tree_temperature is not None and not args.tree_temperature > 0:
        _fail(f"--tree-temperature must be > 0; got {args.tree_temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        _fail(f"--top-p must be in (0, 1] (1: off); got {args.top_p}")
    if args.top_k_sampling is not None and args.top_k_sampling < 0:
        _fail(f"--top-k must be >= 0 (0: off); got {args.top_k_sampling}")
    if args.repetition_penalty is not None and not args.repetition_penalty > 0:
        _fail(f"--repetition-penalty must be > 0 (1: off); got {args.repetition_penalty}")


def sampling_settings(args, checkpoint: str) -> SamplingParams:
    """The sampling flags the user gave, the checkpoint's generation_config.json for the others (a notice says which
    it recommended), else the defaults: greedy, no penalties."""
    try:
        recommended = generation_config.load(checkpoint)
    except ValueError as e:  # the file's own key names
        _fail(str(e))
    try:
        params = generation_config.resolve(
            recommended, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k_sampling,
            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty)
    except ValueError as e:
        _fail(_as_flags(str(e)))
    taken = {k: v for k, v in recommended.items() if getattr(args, "top_k_sampling" if k == "top_k" else k) is None}
    if taken and not args.json:
        notice(f"sampling settings from {generation_config.FILENAME}: "
               + ", ".join(f"{_FLAGS[k]} {v:g}" for k, v in taken.items()) + " (a flag overrides each)")
    return params


def echo_prompt(prompt: str) -> str:
    """What stdout shows of the prompt before the generated text: all of it, or the end of a long one (with a
    note on stderr)."""
    if len(prompt) <= ECHO_LIMIT:
        return prompt
    tail = prompt[-ECHO_LIMIT // 4:]
    print(f"[the prompt has {len(prompt):,} characters; echoing its last {len(tail)}]", file=sys.stderr)
    return "..." + tail


class Heartbeat:
    """While the one `generate` call runs (prefill, compile, decode), a line on stderr every `every` seconds so that
    a long prompt or a long compile is not silent."""

    def __init__(self, what: str, every: float = 10.0, enabled: bool = True):
        self.what, self.every, self.enabled = what, every, enabled
        self._done = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.enabled:
            self.t0 = time.perf_counter()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._done.wait(self.every):
            print(f"  ... {self.what}: {time.perf_counter() - self.t0:.0f} s", file=sys.stderr, flush=True)

    def stop(self):
        """No more lines (idempotent): e.g. once streamed text shows the progress itself."""
        self._done.set()

    def __exit__(self, *exc):
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        return False


class ProgressBar:
    """`generate`'s on_progress for a terminal: a tqdm bar on stderr over the prefill's prompt tokens, then the
    compile as its description; nothing when stderr is not a terminal (tqdm's disable=None), gone when done."""

    def __init__(self, enabled: bool = True):
        self.enabled, self.bar = enabled, None

    def __call__(self, phase: str, done: int, total: int):
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr, disable=None, leave=False)
        if phase == "prefill":
            self.bar.update(done - self.bar.n)
        elif phase == "calibrate" and done < total:
            self.bar.set_description(f"measuring the tree-budget cost model ({done}/{total}; once per model, device "
                                     "and batch)")
        elif done < total:
            self.bar.set_description("compiling the decode loop")
        else:
            self.close()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        self.enabled = False


class _stop_first:
    """An on_tokens callback that stops a Heartbeat (and closes a ProgressBar: no bar inside the streamed text) before
    handing the tokens on (keeps the stream's finish())."""

    def __init__(self, beat: Heartbeat, stream, progress=None):
        self.beat, self.stream, self.progress = beat, stream, progress

    def __call__(self, row, new_ids):
        self.beat.stop()
        if self.progress is not None:
            self.progress.close()
        return self.stream(row, new_ids)

    def finish(self, text: str):
        return self.stream.finish(text)


def summary_lines(stats: dict, *, load_seconds: float, wall_seconds: float) -> list[str]:
    """The run in words a newcomer reads: where the wall time went, then what speculation bought."""
    n = stats["new_tokens"]
    lines = [f"{n} tokens in {wall_seconds:.1f} s end to end ({n / wall_seconds:.1f} tok/s): load "
             f"{load_seconds:.1f} s, prefill {stats['prefill_seconds']:.2f} s (the first token), compile "
             f"{stats['compile_seconds']:.1f} s (once per shape), decode {stats['decode_seconds']:.2f} s "
             f"= {stats['tokens_per_second']:.1f} tok/s decoding alone"]
    tree = stats["tree"]
    policy = stats.get("budget_policy")
    if policy and policy.get("decision") == "autoregressive":
        lines.append(f"tau 1.00 · adaptive budget: every step autoregressive ({policy['why']}; --budget N forces a "
                     "tree)")
    elif policy:
        used = ", ".join(f"{b}: {n}" for b, n in policy["budget_steps"].items() if n)
        lines.append(f"tau {stats['tau']:.2f} tokens per target pass over {stats['steps']} steps · adaptive budget "
                     f"(DDTree, tree temperature {stats['tree_temperature']:g}): steps per budget {{{used or '-'}}}, "
                     f"{policy['steps_without_drafter']} autoregressive steps without the drafter"
                     + (f"; drafted steps predicted {policy['predicted_tau']:.2f} and kept {policy['observed_tau']:.2f} "
                        "tokens per sequence" if policy.get("drafted_sequence_steps") else "")
                     + (" · cost model measured now" if policy.get("calibrated") else ""))
    elif stats["budget"]:
        shape = (f"DDTree of {stats['budget']} drafted nodes, tree temperature {stats['tree_temperature']:g}"
                 if tree == "ddtree" else "chain" if tree == "chain" else f"static tree {tree}")
        lines.append(f"tau {stats['tau']:.2f} tokens per target pass (each of the {stats['steps']} verify passes of "
                     f"the target kept on average {stats['tau'] - 1:.2f} drafted tokens plus one of its own; "
                     f"autoregressive decoding is 1.00) · {shape}")
    else:
        lines.append(f"tau {stats['tau']:.2f} tokens per target pass (autoregressive: no drafted tokens) · "
                     f"{stats['steps']} passes")
    return lines


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = build_parser().parse_args(argv)
    tree = _parse_tree(args.tree)
    check_flags(args, tree)
    stops = parse_stops(args.stop)
    if args.batch_file is not None:
        return run_batch(args, tree, stops, t_start)
    prompt = read_prompt(args)
    if not args.json:
        print("[loading the model ...]", file=sys.stderr, flush=True)
    target, drafter, tokenizer, description, recommended = load_models(args.checkpoint, args.dtype)
    load_seconds = time.perf_counter() - t_start
    if args.tree_temperature is None:
        args.tree_temperature = recommended
    sampling = sampling_settings(args, checkpoint_dir(args.checkpoint))
    ids = tokenizer.encode(prompt)
    if not ids:
        _fail("the prompt encodes to no tokens")
    stop_ids = stop_token_ids(tokenizer, stops)
    try:  # every argument against the model (context, tree size, memory) before any device work
        validation.validate(target, drafter, ids, max_new_tokens=args.max_new_tokens, budget=args.budget,
                            topk=args.topk, tree_temperature=args.tree_temperature,
                            temperature=sampling.temperature, stop_ids=stop_ids, tree=tree, top_k=sampling.top_k,
                            top_p=sampling.top_p)
    except ValueError as e:
        _fail(_as_flags(str(e)))
    budget_notice(target, drafter, ids, args, tree, sampling)
    autoregressive_notice(drafter, args)
    if not args.json:
        print(f"[{description}; loaded in {load_seconds:.1f} s]", file=sys.stderr)
        print(f"[prefill of {len(ids):,} prompt tokens, then the decode loop's compile (once per shape) and "
              f"{args.max_new_tokens} new tokens ...]", file=sys.stderr, flush=True)
    # Text as the loop accepts it (or, with --json, only the stop strings watched)
    stream = (StopWatch(tokenizer, stops) if args.json else
              TokenStream(tokenizer, "" if args.no_echo else echo_prompt(prompt), stops=stops))
    try:
        with Heartbeat("prefill, compile and decode", enabled=not args.json) as beat:
            progress = ProgressBar(enabled=not args.json)
            if not args.json:  # the heartbeat and the bar stop at the first streamed token: the text shows progress
                stream = _stop_first(beat, stream, progress)
            res = engine.generate(target, drafter, ids, max_new_tokens=args.max_new_tokens, budget=args.budget,
                                  topk=args.topk, tree_temperature=args.tree_temperature,
                                  sampling=sampling, seed=args.seed, tree=tree, impl=args.impl, profile=args.profile,
                                  stop_ids=stop_ids, on_tokens=stream, on_progress=progress,
                                  row_invariant=args.row_invariant, calibrate=args.calibrate)
    except ValueError as e:
        _fail(_as_flags(str(e)))
    tokens = res.tokens[0]
    text, finish_reason = finished_text(tokenizer, tokens, stops, stop_ids, args.max_new_tokens)
    tokens = tokens_of_text(tokenizer, tokens, text)
    stats = res.stats
    wall_seconds = time.perf_counter() - t_start
    if args.json:
        stats = {**stats, "load_seconds": load_seconds, "wall_seconds": wall_seconds}
        print(json.dumps({"prompt": prompt, "text": text, "tokens": tokens, "finish_reason": finish_reason,
                          "model": description, "stats": stats}))
        return 0
    stream.finish(text)
    for line in summary_lines(stats, load_seconds=load_seconds, wall_seconds=wall_seconds):
        print(line, file=sys.stderr)
    if args.profile:
        print(profile_line(stats["profile"]), file=sys.stderr)
    return 0


def budget_notice(target, drafter, ids, args, tree, sampling) -> None:
    """One line on stderr when a fixed --budget is more than this device runs at a useful speed (--budget 4096 ran
    at 0.3 tok/s on a 2-core CPU): its cost by the cached cost model, else its size (validation.budget_warning)."""
    message = validation.budget_warning(target, drafter, ids, budget=args.budget, topk=args.topk, tree=tree,
                                        sampled=sampling.sampled, penalties=sampling.penalised, impl=args.impl,
                                        row_invariant=args.row_invariant)
    if message:
        print(f"warning: --{message}", file=sys.stderr, flush=True)
    # engine.generate warns a library caller the same way: the command line has said it in its own words.
    warnings.filterwarnings("ignore", category=validation.BudgetWarning)


def autoregressive_notice(drafter, args) -> None:
    """A notice when speculation was asked for but the checkpoint has no drafter (plain decoding runs)."""
    if drafter is None and not (args.tree == "ddtree" and args.budget == 0):
        notice("the checkpoint has no drafter: decoding autoregressively, one target pass a token (--tree, --budget "
               "and --topk do not apply)")


def finished_text(tokenizer, tokens, stops, stop_ids, max_new_tokens) -> tuple[str, str]:
    """A sequence's text, cut before its first stop string, and why it ended: 'stop' (a stop string; the tokens may
    run up to a chunk past it: `tokens_of_text` cuts them) or 'length' (max_new_tokens)."""
    text, stopped = cut_at_stop(tokenizer.decode(tokens), stops)
    if stopped or (tokens and tokens[-1] in stop_ids) or len(tokens) < max_new_tokens:
        return text, "stop"
    return text, "length"


def tokens_of_text(tokenizer, tokens, text: str) -> list:
    """The shortest prefix of `tokens` whose text covers `text` (a prefix of their decoding, as cut at a stop
    string): the tokens a caller gets back, not the ones the loop ran past the stop. A token that straddles the
    stop is kept (its text is cut)."""
    if len(tokenizer.decode(tokens)) <= len(text):
        return list(tokens)
    lo, hi = 0, len(tokens)  # decode(tokens[:hi]) covers text; the smallest such k (lengths grow with k)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(tokens[:mid])) >= len(text):
            hi = mid
        else:
            lo = mid + 1
    return list(tokens[:lo])


def run_batch(args, tree, stops, t_start) -> int:
    """--batch-file: every prompt of the file in one batch; one JSON record a line per prompt on stdout."""
    prompts = read_batch(args.batch_file)
    print(f"[loading the model for {len(prompts)} prompts ...]", file=sys.stderr, flush=True)
    target, drafter, tokenizer, description, recommended = load_models(args.checkpoint, args.dtype)
    load_seconds = time.perf_counter() - t_start
    if args.tree_temperature is None:
        args.tree_temperature = recommended
    sampling = sampling_settings(args, checkpoint_dir(args.checkpoint))
    ids = [tokenizer.encode(p) for p in prompts]
    for i, row in enumerate(ids):
        if not row:
            _fail(f"--batch-file prompt {i + 1} encodes to no tokens")
    stop_ids = stop_token_ids(tokenizer, stops)
    kwargs = dict(max_new_tokens=args.max_new_tokens, budget=args.budget, topk=args.topk,
                  tree_temperature=args.tree_temperature, stop_ids=stop_ids, tree=tree)
    try:
        validation.validate(target, drafter, ids, **kwargs, temperature=sampling.temperature, top_k=sampling.top_k,
                            top_p=sampling.top_p)
        budget_notice(target, drafter, ids, args, tree, sampling)
        autoregressive_notice(drafter, args)
        print(f"[{description}; loaded in {load_seconds:.1f} s; decoding {len(ids)} prompts together ...]",
              file=sys.stderr, flush=True)
        with Heartbeat("prefill, compile and decode"):
            res = engine.generate(target, drafter, ids, **kwargs, sampling=sampling, seed=args.seed, impl=args.impl,
                                  row_invariant=args.row_invariant, on_tokens=StopWatch(tokenizer, stops),
                                  calibrate=args.calibrate)
    except ValueError as e:
        _fail(_as_flags(str(e)))
    stats = {**res.stats, "load_seconds": load_seconds, "wall_seconds": time.perf_counter() - t_start,
             "batch_size": len(prompts)}
    for i, (prompt, tokens) in enumerate(zip(prompts, res.tokens)):
        text, finish_reason = finished_text(tokenizer, tokens, stops, stop_ids, args.max_new_tokens)
        tokens = tokens_of_text(tokenizer, tokens, text)
        print(json.dumps({"index": i, "prompt": prompt, "text": text, "tokens": tokens,
                          "finish_reason": finish_reason, "model": description,
                          "stats": {**stats, "new_tokens": len(tokens)}}), flush=True)
    print(f"{len(prompts)} prompts, {sum(len(t) for t in res.tokens)} tokens in {stats['wall_seconds']:.1f} s end "
          f"to end; tau {stats['tau']:.2f} tokens per target pass", file=sys.stderr)
    return 0


def profile_line(profile: dict) -> str:
    """One line: a step's kernel time by part, largest first, then (on a GPU) the device's idle time."""
    names = {"attention": "attention", "moe": "MoE", "dense": "dense", "drafter": "drafter", "head": "lm head",
             "tree_accept_commit": "tree+accept+commit", "other": "other"}
    total = profile["kernel_sum_ms"]
    parts = sorted(profile["components_ms"].items(), key=lambda kv: -kv[1])
    line = (f"per step, {profile['kernels_per_step']:.0f} kernels: "
            + " · ".join(f"{names[k]} {v:.3f} ms ({100 * v / total:.0f}%)" for k, v in parts))
    if profile["source"] == "device kernels":
        return line + f"; the timed step {profile['step_ms']:.3f} ms, of which the device sat idle {profile['idle_ms']:.3f}"
    # XLA:CPU runs thunks on several threads at once, and the profiler slows each one.
    return line + (f" (CPU: thunks overlap across threads and the profiler slows each, so the shares are a guide "
                   f"and their sum is not the step; the timed step {profile['step_ms']:.3f} ms)")


class TokenStream:
    """`generate`'s on_tokens for one sequence: writes the text to `out` as the decode loop hands over tokens (after
    the prefill, then after every chunk of steps), `prefix` (the echoed prompt) first. Each time it decodes all the
    tokens so far and writes what is new, holding back a trailing U+FFFD (the first bytes of a character whose
    last bytes are still to come); finish(text) writes the rest of the final text and a newline.

    stops: stop strings; the text is shown up to the first one and never past it (an end that could begin one is
    held back until the next tokens decide), and the call that finds one returns True (generate ends the row)."""

    def __init__(self, tokenizer, prefix: str = "", out=None, stops=()):
        self.tokenizer, self.prefix, self.out, self.stops = tokenizer, prefix, out, list(stops)
        self.ids, self.shown, self.started, self.stopped = [], "", False, False

    def _write(self, text: str):
        out = self.out or sys.stdout
        if not self.started:
            text, self.started = self.prefix + text, True
        if text:
            out.write(text)
            out.flush()

    def __call__(self, row: int, new_ids):
        if row != 0:
            return
        if self.stopped:
            return True
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")
        text, self.stopped = cut_at_stop(text, self.stops)
        if not self.stopped:  # hold back an end that may be the start of a stop string
            hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[:len(text) - hold]
        if text.startswith(self.shown) and len(text) > len(self.shown):
            self._write(text[len(self.shown):])
            self.shown = text
        return self.stopped

    def finish(self, text: str):
        self._write((text[len(self.shown):] if text.startswith(self.shown) else "") + "\n")


class _CallableModule(types.ModuleType):
    """`kdtree_jax.generate` names both this CLI module (`python -m kdtree_jax.generate`) and the public
    function (`kdtree_jax.generate(target, drafter, ...)`). Importing a submodule rebinds the package
    attribute to the module, so the module itself forwards calls to the engine's `generate`."""

    def __call__(self, *args, **kwargs):
        return engine.generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    from kdtree_jax import runtime

    # Before JAX starts: on a GPU, command buffers keep the decode loop on the device (and --row-invariant's flags).
    runtime.configure(row_invariant="--row-invariant" in sys.argv[1:])
    if "--no-compile-cache" not in sys.argv[1:]:
        runtime.use_compilation_cache()
    sys.exit(main())
