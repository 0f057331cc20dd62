"""Timing helpers shared by the benchmark scripts: medians of jitted calls, and jitted loops that run
one component of the verify step alone (attention of every layer, the MoE layers, every layer's other work).

Modules are always jit *arguments* here, never closed over: a closure bakes the weights into the
program as constants (tens of GB for K2 layers).
"""

from __future__ import annotations

import time

import jax
import numpy as np


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


def attention_loop(impl: str, iters: int, split_policy: str = "occupancy"):
    """jit(q, pages, model, batch): `iters` rounds of every layer's verify-attention op (each round's q
    depends on the last output, so nothing is hoisted). The model, pages and batch are jit arguments,
    not closed over: a closure would bake them into the program as constants."""

    @jax.jit
    def run(q, pages, model, batch):
        def body(i, q):
            for layer, block in enumerate(model.layers):
                out = block.self_attn.attend(q, pages, layer, batch, impl, split_policy)
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


def dense_loop(iters: int):
    """jit(x, model, absorbed, cos, sin): `iters` rounds of every layer's work outside its attention op and its
    MoE block: the two norms, MLA's projections (the token's latent row, MLA.query_rows and MLA.output, as the
    model runs them) and the dense layers' MLP. `absorbed`: each layer's absorbed_weights(), computed once
    outside the loop as a decode loop does. The attention op's output is replaced by the query rows' latent
    part plus the token's latent row and the roped part's first dim: the same shapes, and every projection
    stays live."""

    @jax.jit
    def run(x, model, absorbed, cos, sin):
        def body(i, x):
            for block, (w_uk, w_uv) in zip(model.layers, absorbed):
                mla = block.self_attn
                h = block.input_layernorm(x)
                rows, q_rows = mla.latent_and_query_rows(h, cos, sin, w_uk)
                latent = w_uk.shape[1]
                stand_in = q_rows[..., :latent] + rows[:, :, None, :latent] + q_rows[..., latent:latent + 1]
                x = x + mla.output(stand_in, w_uv, x.dtype)
                normed = block.post_attention_layernorm(x)
                x = x + (normed * 1e-3 if block.is_moe else block.mlp(normed))
            return x
        return jax.lax.fori_loop(0, iters, body, x)

    return run


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        prog="benchmarks/components.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__ + "\nA helper module with no command of its own: benchmarks/decode_context.py and "
                              "benchmarks/multi_gpu.py import it.").parse_args()
    print("benchmarks/components.py is a helper module (see --help); run benchmarks/decode_context.py or "
          "benchmarks/multi_gpu.py")
