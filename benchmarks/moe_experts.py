"""Routed MoE of one K2-width layer slice: XLA's ragged_dot against the CUDA grouped GEMV (ops/moe.py).

Two per-device slices of one K2 layer (hidden 7168, moe_intermediate 2048, 384 experts, top-8):
  ep: 96 whole experts (4-way expert parallelism; pairs routed to the other 288 experts contribute 0 here)
  tp: all 384 experts, a quarter (512) of each one's intermediate dim (4-way tensor parallelism)
for T tokens (batch-1 verify steps) with uniformly random top-8 routing.  Each impl runs routed_experts
(sort, gather, grouped MLP, weighted sum back into tokens) `--iters` times inside a jitted fori_loop whose input
depends on the carry; the time per call is the median over --reps of loop time / iters.  The floor is the
bytes of the weights of the experts active on this device (3 matrices each) at 4.3 TB/s: reading each
used expert once and nothing else.

  python benchmarks/moe_experts.py                 # H200: writes results/moe_experts_h200.{md,json}
  python benchmarks/moe_experts.py --smoke  # CPU, tiny widths, checks the script runs (writes to a temp dir)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kdtree_jax.model.moe import routed_experts  # noqa: E402
from kdtree_jax.ops import moe as moe_ops  # noqa: E402
from kdtree_jax.provenance import git_commit, smoke_dir  # noqa: E402

FLOOR_BYTES_PER_S = 4.3e12
K2 = dict(hidden=7168, inter=2048, experts=384, top_k=8)
SMOKE = dict(hidden=64, inter=32, experts=16, top_k=4)
# (impl, blocks_per_sm) variants; "cuda" is the CUDA op at either register budget.
IMPLS = [("xla", None), ("cuda", "4"), ("cuda", "1")]


def median_per_call(run, args, iters, reps):
    """(median seconds per call, the loop's output)."""
    out = jax.block_until_ready(run(*args))  # compile + warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - t) / iters)
    return float(np.median(times)), out


def make_loop(impl, iters):
    """jit(x, routing, weights): `iters` routed_experts calls, each input depending on the last output
    (nothing is hoisted); the weights are arguments, never closed-over constants."""
    @jax.jit
    def run(x, indices, weights, gate, up, down):
        def body(i, x):
            out = routed_experts(x, indices, weights, gate, up, down, impl=impl)
            return x + out * jnp.asarray(1e-3, x.dtype)
        return jax.lax.fori_loop(0, iters, body, x)
    return run


def bench_layout(layout, widths, n_dev, tokens_list, iters, reps, log):
    h, i_full, e_all, k = widths["hidden"], widths["inter"], widths["experts"], widths["top_k"]
    e_local, inter = (e_all // n_dev, i_full) if layout == "ep" else (e_all, i_full // n_dev)
    key = jax.random.key(0)
    kg, ku, kd = jax.random.split(key, 3)
    gate = (jax.random.normal(kg, (e_local, h, inter), jnp.bfloat16) * h ** -0.5).astype(jnp.bfloat16)
    up = (jax.random.normal(ku, (e_local, h, inter), jnp.bfloat16) * h ** -0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(kd, (e_local, inter, h), jnp.bfloat16) * inter ** -0.5).astype(jnp.bfloat16)
    expert_bytes = 3 * h * inter * 2
    rows = []
    rng = np.random.default_rng(0)
    for tokens in tokens_list:
        indices = np.stack([rng.permutation(e_all)[:k] for _ in range(tokens)]).astype(np.int32)
        weights = rng.uniform(0.05, 0.3, (tokens, k)).astype(np.float32)
        local = indices[(indices >= 0) & (indices < e_local)]  # ep: this device holds experts [0, e_local)
        active = len(np.unique(local))
        local_pairs = int(local.size)
        floor = active * expert_bytes / FLOOR_BYTES_PER_S
        x = jax.random.normal(jax.random.key(tokens), (tokens, h), jnp.float32).astype(jnp.bfloat16)
        args = (x, jnp.asarray(indices), jnp.asarray(weights), gate, up, down)
        row = dict(layout=layout, tokens=tokens, top_k=k, experts_local=e_local, inter_local=inter, hidden=h,
                   local_pairs=local_pairs, active_experts=active, active_bytes=active * expert_bytes,
                   floor_us=floor * 1e6)
        ref = None  # ragged_dot's final x
        for impl, bps in IMPLS:
            name = impl if bps is None else f"{impl}_bps{bps}"
            if bps is not None:
                os.environ["KDTREE_MOE_BLOCKS_PER_SM"] = bps
            run = make_loop(impl, iters)
            seconds, final = median_per_call(run, args, iters, reps)
            # The loop's final x, against ragged_dot's: a cheap end-to-end agreement check (tests check more).
            final = final.astype(jnp.float32)
            if ref is None:
                ref = final
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_gbps"] = active * expert_bytes / seconds / 1e9
            row[f"{name}_of_floor"] = floor / seconds
            row[f"{name}_max_diff_vs_xla"] = float(jnp.max(jnp.abs(final - ref)))
        os.environ.pop("KDTREE_MOE_BLOCKS_PER_SM", None)
        log(json.dumps(row))
        rows.append(row)
    del gate, up, down
    return rows


def markdown(meta, rows):
    lines = [f"# Routed MoE, one K2 layer slice: ragged_dot vs the CUDA grouped GEMV ({meta['device']})", "",
             f"{meta['date']}, commit {meta['commit']}, jax {meta['jax']}. routed_experts (sort, gather, grouped "
             f"SwiGLU, weighted sum back into tokens) per call, median of {meta['reps']} runs of a jitted fori_loop of "
             f"{meta['iters']} calls. Floor = bytes of the experts active on this device / 4.3 TB/s. "
             f"`cuda bps4` / `bps1`: the CUDA op at 128 registers (4 blocks/SM) / ~200 registers (2 blocks/SM); "
             f"auto dispatch uses the CUDA op up to {meta['cuda_max_rows']} rows (pairs) per device. Last column: "
             f"largest |difference| of the loop's final x (≈ unit scale) between the CUDA op and ragged_dot.", "",
             "| layout | T | local pairs | active experts | floor µs | ragged_dot µs | cuda bps4 µs | cuda bps1 µs "
             "| speed-up | floor / cuda | max diff of x |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        best = min(r["cuda_bps4_us"], r["cuda_bps1_us"])
        lines.append(f"| {r['layout']} ({r['experts_local']}×{r['hidden']}×{r['inter_local']}) | {r['tokens']} "
                     f"| {r['local_pairs']} | {r['active_experts']} | {r['floor_us']:.0f} | {r['xla_us']:.0f} "
                     f"| {r['cuda_bps4_us']:.0f} | {r['cuda_bps1_us']:.0f} | {r['xla_us'] / best:.1f}× "
                     f"| {r['floor_us'] / best:.0%} | {max(r['cuda_bps4_max_diff_vs_xla'], r['cuda_bps1_max_diff_vs_xla']):.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny widths, 2 iterations (CPU check of the script)")
    p.add_argument("--tokens", default="1,9,33,64,256", help="tokens per MoE call (tree sizes x batch), comma-separated")
    p.add_argument("--layouts", default="ep,tp", help="expert layouts to time: ep (experts split), tp (each expert split)")
    p.add_argument("--devices", type=int, default=4, help="the EP / TP degree the slices stand for")
    p.add_argument("--iters", type=int, default=10, help="MoE calls per timed loop")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (the median is reported)")
    p.add_argument("--out", default=None, help="output directory (default: benchmarks/results; --smoke: a temp dir)")
    p.add_argument("--name", default=None, help="results file stem (default moe_experts_h200, or _smoke)")
    args = p.parse_args(argv)
    widths = SMOKE if args.smoke else K2
    tokens_list = [1, 9] if args.smoke else [int(t) for t in args.tokens.split(",")]
    iters, reps = (2, 2) if args.smoke else (args.iters, args.reps)

    def log(msg):
        print(msg, flush=True)

    commit = git_commit()
    meta = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(),
                date=datetime.date.today().isoformat(), commit=commit, jax=jax.__version__, iters=iters,
                reps=reps, ep_tp_degree=args.devices, widths=widths, cuda_max_rows=moe_ops.CUDA_MAX_ROWS,
                cuda_op_built=moe_ops.cuda_built(), floor_bytes_per_s=FLOOR_BYTES_PER_S)
    log(json.dumps(meta))
    rows = []
    for layout in args.layouts.split(","):
        rows += bench_layout(layout, widths, args.devices, tokens_list, iters, reps, log)
    name = args.name or ("moe_experts_smoke" if args.smoke else "moe_experts_h200")
    if args.out is None:
        args.out = smoke_dir("moe_experts") if args.smoke else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                           "results")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name + ".json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(args.out, name + ".md"), "w") as f:
        f.write(markdown(meta, rows))
    log(markdown(meta, rows))
    log(f"wrote {os.path.join(args.out, name)}.{{json,md}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
