"""`python -m kdtree_jax.generate`: speculative decoding from the command line.

    python -m kdtree_jax.generate --prompt "def fibonacci(n):" --max-new-tokens 64
    python -m kdtree_jax.generate --prompt "..." --budget 32 --topk 4 --temperature 0.7 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types

import jax.numpy as jnp

from kdtree_jax.checkpoint import add_dtype_argument
from kdtree_jax.speculative import engine

DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "default")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kdtree_jax.generate",
        description="Generate text with DDTree speculative decoding: a block drafter proposes a tree of "
                    "candidate continuations, the target verifies all of it in one pass, and the longest "
                    "agreeing path is kept. Greedy output is plain greedy decoding's (token for token in "
                    "float32; in bfloat16 a T-node verify pass can round a near-tie differently from a "
                    "1-token step); sampled output is an exact sample of the target.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--checkpoint", default=None,
                   help="model directory: a kdtree_jax checkpoint (Orbax: target, drafter, tokenizer; made by "
                        "save_checkpoint, `python -m kdtree_jax.convert_hf` or `python -m kdtree_jax.train`) or an HF "
                        "checkpoint (config.json + safetensors; target only, decoded autoregressively). Default: the "
                        "embedded pair in checkpoints/default if present, else a random-init tiny pair (noise)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate")
    p.add_argument("--budget", type=int, default=16,
                   help="DDTree nodes per step besides the root (0: plain autoregressive decoding)")
    p.add_argument("--topk", type=int, default=4, help="drafter candidates per depth the tree may branch into")
    p.add_argument("--tree-temperature", type=float, default=None,
                   help="DDTree ranks prefixes by the drafter's probabilities at this temperature; < 1 trusts the "
                        "drafter's top choices deeper (a soft-label-distilled drafter is under-confident for greedy "
                        "verification); 1.0: its probabilities as they are. Default: the checkpoint's recommendation "
                        "(0.6 for the embedded pair), else 1.0")
    p.add_argument("--tree", default="ddtree",
                   help="'ddtree' (best-first, dynamic), 'chain' (DFlash: the drafter's top-1 path) or a static "
                        "shape as comma-separated branching per depth, e.g. 4,2,1")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample the target")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus filter of the target distribution (sampling)")
    p.add_argument("--top-k-sampling", type=int, default=0, help="top-k filter of the target distribution (0: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    add_dtype_argument(p, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--impl", default="auto", choices=["auto", "reference", "ffi"],
                   help="verify-attention implementation")
    p.add_argument("--profile", action="store_true",
                   help="first run the decode loop once under the profiler and print where a step's time goes: "
                        "kernel time per part (drafter, tree + accept + commit, the verify pass's attention, MoE and "
                        "dense layers, lm head) and the device's idle time (stats.profile with --json)")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, tokens, stats) instead")
    return p


def _parse_tree(value: str):
    if value in ("ddtree", "chain"):
        return value
    try:
        shape = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise SystemExit(f"--tree must be 'ddtree', 'chain' or comma-separated integers; got {value!r}")
    return shape


def load_models(checkpoint: str | None, dtype: str = "auto"):
    """(target, drafter or None, tokenizer, description, the checkpoint's recommended tree temperature)."""
    import kdtree_jax
    from kdtree_jax.checkpoint import recommended_tree_temperature
    from kdtree_jax.model.drafter import DrafterConfig, init_drafter
    from kdtree_jax.tokenizer import ByteTokenizer, load_tokenizer

    if checkpoint is None and os.path.isdir(DEFAULT_CHECKPOINT):
        checkpoint = DEFAULT_CHECKPOINT
    if checkpoint is None:
        cfg = kdtree_jax.ModelConfig.preset("tiny")
        target = kdtree_jax.init_model(cfg, seed=0)
        drafter = init_drafter(cfg, DrafterConfig(block_size=8), seed=1)
        return (target, drafter, ByteTokenizer(),
                "random-init tiny pair (no trained checkpoint found: the text is noise)", 1.0)
    if not os.path.isdir(checkpoint):
        raise SystemExit(f"--checkpoint {checkpoint!r} is not a directory")
    if os.path.exists(os.path.join(checkpoint, "config.json")):
        cfg, target = kdtree_jax.load_hf(checkpoint, dtype=jnp.bfloat16)
        return (target, None, load_tokenizer(checkpoint), f"HF checkpoint {checkpoint} (no drafter: autoregressive)",
                1.0)
    try:
        target, drafter, tokenizer = kdtree_jax.load_checkpoint(checkpoint, dtype=dtype)
    except ValueError as e:
        raise SystemExit(f"--checkpoint {checkpoint!r}: {e}")
    return (target, drafter, tokenizer, f"checkpoint {checkpoint} ({jnp.dtype(target.dtype).name})",
            recommended_tree_temperature(checkpoint))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    tree = _parse_tree(args.tree)
    target, drafter, tokenizer, description, recommended = load_models(args.checkpoint, args.dtype)
    if args.tree_temperature is None:
        args.tree_temperature = recommended
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise SystemExit("--prompt encodes to no tokens")
    if not args.json:
        print(f"[{description}]", file=sys.stderr)
    try:
        res = engine.generate(target, drafter, ids, max_new_tokens=args.max_new_tokens, budget=args.budget,
                              topk=args.topk, tree_temperature=args.tree_temperature, temperature=args.temperature,
                              top_k=args.top_k_sampling, top_p=args.top_p, seed=args.seed, tree=tree, impl=args.impl,
                              profile=args.profile)
    except ValueError as e:
        raise SystemExit(f"error: {e}")
    tokens = res.tokens[0]
    text = tokenizer.decode(tokens)
    stats = res.stats
    if args.json:
        print(json.dumps({"prompt": args.prompt, "text": text, "tokens": tokens, "model": description, "stats": stats}))
        return 0
    print(args.prompt + text)
    print(f"tau {stats['tau']:.2f} tokens/step · {stats['tokens_per_second']:.1f} tok/s · {stats['steps']} steps · "
          f"{stats['new_tokens']} tokens · tree {stats['tree']} budget {stats['budget']}"
          f"{' tree temperature %g' % stats['tree_temperature'] if stats['tree'] == 'ddtree' and stats['budget'] else ''} "
          f"(compile {stats['compile_seconds']:.1f} s, not counted)", file=sys.stderr)
    if args.profile:
        print(profile_line(stats["profile"]), file=sys.stderr)
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


class _CallableModule(types.ModuleType):
    """`kdtree_jax.generate` names both this CLI module (`python -m kdtree_jax.generate`) and the public
    function (`kdtree_jax.generate(target, drafter, ...)`). Importing a submodule rebinds the package
    attribute to the module, so the module itself forwards calls to the engine's `generate`."""

    def __call__(self, *args, **kwargs):
        return engine.generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
