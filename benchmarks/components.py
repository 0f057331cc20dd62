"""Timing helpers shared by the benchmark scripts: medians of jitted calls, and jitted loops that run
one component of the verify step alone (attention of every layer, the MoE layers, every layer's other work).

Modules are always jit *arguments* here, never closed over: a closure bakes the weights into the
program as constants (tens of GB for K2 layers).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
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


def attention_loop(impl: str, iters: int):
    """jit(q, pages, model, batch): `iters` rounds of every layer's verify-attention op (each round's q
    depends on the last output, so nothing is hoisted). The model, pages and batch are jit arguments,
    not closed over: a closure would bake them into the program as constants."""

    @jax.jit
    def run(q, pages, model, batch):
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


def dense_loop(iters: int):
    """jit(x, model, absorbed, cos, sin): `iters` rounds of every layer's work outside its attention op and its
    MoE block: the two norms, MLA's projections (the token's latent row, the queries, the absorbed up- and down-
    projections, o_proj) and the dense layers' MLP. `absorbed`: each layer's absorbed_weights(), computed once
    outside the loop as a decode loop does. The attention op's output is replaced by the queries' latent part
    plus the token's latent row: the same shapes, and every projection stays live."""

    @jax.jit
    def run(x, model, absorbed, cos, sin):
        def body(i, x):
            for block, (w_uk, w_uv) in zip(model.layers, absorbed):
                mla = block.self_attn
                h = block.input_layernorm(x)
                rows = mla.latent_rows(h, cos, sin)
                q_nope, q_pe = mla.queries(h, cos, sin)
                q_latent = jnp.einsum("bthn,hcn->bthc", q_nope, w_uk)
                stand_in = q_latent + rows[:, :, None, :q_latent.shape[-1]] + q_pe[..., :1]
                out = jnp.einsum("bthc,hvc->bthv", stand_in.astype(x.dtype), w_uv)
                x = x + mla.o_proj(out.reshape(*x.shape[:-1], -1))
                normed = block.post_attention_layernorm(x)
                x = x + (normed * 1e-3 if block.is_moe else block.mlp(normed))
            return x
        return jax.lax.fori_loop(0, iters, body, x)

    return run
