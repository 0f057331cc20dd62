"""Helpers shared by the benchmark scripts: medians of jitted calls, jitted loops that run one component
of the verify step alone (attention of every layer, the MoE layers), and the commit stamp of results.

Modules are always jit *arguments* here, never closed over: a closure bakes the weights into the
program as constants (tens of GB for K2 layers).
"""

from __future__ import annotations

import os
import subprocess
import time

import jax
import numpy as np


def git_commit(root: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) -> str:
    """The commit results belong to: $KDTREE_COMMIT when set (a copy of the tree on a device machine can
    carry stale git metadata, so pass the real one in), else git's HEAD, "+dirty" with uncommitted changes."""
    if os.environ.get("KDTREE_COMMIT"):
        return os.environ["KDTREE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return (head.stdout.strip() or "unknown") + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def median_seconds(fn, *args, reps: int = 5):
    """(median wall seconds of fn(*args) after one warm-up call, the warm-up's output)."""
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out


def attention_loop(batch, impl: str, iters: int):
    """jit(q, pages, model): `iters` rounds of every layer's verify-attention op (each round's q depends
    on the last output, so nothing is hoisted)."""

    @jax.jit
    def run(q, pages, model):
        def body(i, q):
            for layer, block in enumerate(model.layers):
                out = block.self_attn.attend(q, pages, layer, batch, impl)
                q = q.at[..., :1].add(out[..., :1].astype(q.dtype) * 1e-3)
            return q
        return jax.lax.fori_loop(0, iters, body, q)

    return run


def moe_loop(iters: int):
    """jit(x, model): `iters` rounds of every MoE layer (routing, routed and shared experts)."""

    @jax.jit
    def run(x, model):
        def body(i, x):
            for block in model.layers:
                if block.is_moe:
                    out, _ = block.mlp(x)
                    x = x + out * 1e-3
            return x
        return jax.lax.fori_loop(0, iters, body, x)

    return run
