"""The verify kernel variants against the fair XLA baseline on one GPU, in one run.

Per shape (scattered slots, kv_lens = L, a causal tree mask) and kernel variant:
  * device µs a call: CUDA events outside XLA (the benchmark target `kdtree_jax._kernel_bench`): a CUDA graph of
    `iters` calls on consecutive layers of a pool larger than L2, plus the main kernel alone and the merge alone;
  * in-loop µs a call (--in-loop): `iters` calls inside one jitted `lax.fori_loop`, each on another layer of a pool
    larger than L2 chosen from the loop carry (nothing can be hoisted), wall time of the whole loop / iters, median of
    5 after warm-up; the same for the XLA baseline (kdtree_jax/ops/xla.py: bf16 gather + einsums with float32
    accumulation, dense and chunked over L; the faster is the baseline) and for an empty loop (the loop's own cost).
The split count is the op's own for the variant and --split-policy (kdtree_jax.ops.ffi.split_counts).

    python benchmarks/verify_variants.py --shapes "1 16 8 65536;1 64 8 65536" --variants pipelined,wide [--in-loop]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.ops import SPLIT_POLICIES
from kdtree_jax.ops import ffi as vffi
from kdtree_jax.ops.masks import ancestor_mask
from kdtree_jax.ops.xla import verify_attention_xla

SCALE = 192 ** -0.5
XLA_CHUNK = 8192


def make_inputs(batch, num_queries, heads, length):
    """A pool of enough layers to exceed L2 several times over, q, a shuffled slot table, a causal tree."""
    layers = int(min(40, max(4, math.ceil((1.5 * 2 ** 30) / (batch * length * 1152)))))
    keys = jax.random.split(jax.random.PRNGKey(batch * 7919 + num_queries * 31 + length), 3)
    kv_pool = jax.random.normal(keys[0], (layers, batch * length, 576), jnp.bfloat16)
    q = jax.random.normal(keys[1], (batch, num_queries, heads, 576), jnp.bfloat16)
    kv_slots = jax.random.permutation(keys[2], batch * length).astype(jnp.int32).reshape(batch, length)
    kv_lens = jnp.full((batch,), length, jnp.int32)
    parents = jnp.asarray([[-1] + list(range(num_queries - 1))] * batch, jnp.int32)
    return layers, (q, kv_pool, kv_slots, kv_lens, ancestor_mask(parents))


def in_loop_us(op, inputs, layers, iters):
    """µs a call of op(q, kv_pool, layer, ...) inside one jitted fori_loop whose layer depends on the carry."""
    @jax.jit
    def loop(q, kv_pool, kv_slots, kv_lens, tree_mask):
        def body(i, carry):
            layer = (i + (carry > 1e30).astype(jnp.int32)) % layers
            if op is None:
                return carry + q[0, 0, 0, 0].astype(jnp.float32) * layer.astype(jnp.float32)
            out, lse = op(q, kv_pool, layer, kv_slots, kv_lens, tree_mask)
            # The whole outputs feed the carry: XLA may not shrink the baseline to the elements one would read.
            return carry + jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))
    jax.block_until_ready(loop(*inputs))  # compile
    for _ in range(3):
        jax.block_until_ready(loop(*inputs))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*inputs))
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times)) / iters


def roofline_us(batch, num_queries, heads, length, copy_gbps, mma_tflops):
    flops = 2.0 * batch * num_queries * heads * length * (576 + 512)
    kv_bytes = batch * length * 1152
    return max(kv_bytes / (copy_gbps * 1e3), flops / (mma_tflops * 1e6)), flops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1 16 8 65536", help='"B T H L;..." (scattered slots, kv_lens = L)')
    parser.add_argument("--variants", default="auto", help=f"comma list of {sorted(vffi.VARIANTS)}")
    parser.add_argument("--iters", type=int, default=40, help="calls per timed graph")
    parser.add_argument("--json", help="also write the rows here (after every shape)")
    parser.add_argument("--in-loop", action="store_true", help="also time in-loop, with the XLA baseline beside")
    parser.add_argument("--split-policy", choices=SPLIT_POLICIES, default="occupancy",
                        help="the op's KV split count: 'occupancy' (the default: the fastest for the call's T) or "
                             "'invariant' (independent of T: what row-invariant decoding runs)")
    args = parser.parse_args(argv)
    bench = vffi.bench_module()
    if bench is None:
        print("verify_variants: the benchmark target is not built (needs the CUDA part: pip install -e . with nvcc)",
              file=sys.stderr)
        return 2
    copy_gbps = bench.bench_copy_gbps(0, 2 << 30, 20)
    mma_tflops = bench.bench_mma_sync_tflops(0)
    print(f"ceilings: copy {copy_gbps:.0f} GB/s, mma.sync {mma_tflops:.0f} TFLOP/s", flush=True)
    rows = []

    def save():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json + ".tmp", "w") as f:
                json.dump(dict(split_policy=args.split_policy, copy_gbps=copy_gbps, mma_tflops=mma_tflops,
                               commit=os.environ.get("KDTREE_COMMIT"), device=str(jax.devices()[0].device_kind), date=time.strftime("%Y-%m-%d"),
                               iters=args.iters, rows=rows), f, indent=1)
            os.replace(args.json + ".tmp", args.json)

    for shape in args.shapes.split(";"):
        batch, num_queries, heads, length = (int(v) for v in shape.split())
        floor_us, flops = roofline_us(batch, num_queries, heads, length, copy_gbps, mma_tflops)
        if args.in_loop:
            t0 = time.perf_counter()
            layers, inputs = make_inputs(batch, num_queries, heads, length)
            base = dict(B=batch, T=num_queries, H=heads, L=length, variant="xla", layers=layers)
            empty = in_loop_us(None, inputs, layers, args.iters)
            xla = {}
            for name, chunk in (("dense", None), ("chunked", XLA_CHUNK)):
                op = functools.partial(verify_attention_xla, softmax_scale=SCALE, chunk=chunk)
                try:
                    xla[name] = in_loop_us(op, inputs, layers, args.iters)
                except Exception as e:  # e.g. out of memory for the dense scores: recorded, not raised
                    print(f"  xla {name} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            best = min(xla, key=xla.get) if xla else None
            base.update(xla_dense_us=xla.get("dense"), xla_chunked_us=xla.get("chunked"), xla_best=best,
                        xla_us=xla.get(best), empty_loop_us=empty)
            rows.append(base)
            print(f"B={batch} T={num_queries} H={heads} L={length} XLA dense {xla.get('dense') or 0:.1f} chunked "
                  f"{xla.get('chunked') or 0:.1f} us in-loop (empty loop {empty:.1f}) [{time.perf_counter() - t0:.0f} s]",
                  flush=True)
        for variant in args.variants.split(","):
            splits, _ = vffi.splits_for(batch, num_queries, heads, length, variant, args.split_policy)
            graph_us, main_us, merge_us = (float(v) for v in bench.bench_verify_attention(
                batch, num_queries, heads, length, splits, vffi.VARIANTS[variant], True, args.iters)[1:])
            row = dict(B=batch, T=num_queries, H=heads, L=length, variant=variant, splits=splits, us=graph_us,
                       main_us=main_us, merge_us=merge_us, roofline_pct=100 * floor_us / graph_us if graph_us > 0 else None,
                       tflops=flops / graph_us / 1e6 if graph_us > 0 else None)
            if args.in_loop:
                op = functools.partial(vffi.verify_attention_ffi, softmax_scale=SCALE, variant=variant,
                                       split_policy=args.split_policy)
                row["in_loop_us"] = in_loop_us(op, inputs, layers, args.iters)
                xla_us = rows[-1]["xla_us"] if rows[-1].get("variant") == "xla" else None
                row["speedup_in_loop"] = xla_us / row["in_loop_us"] if xla_us else None
            rows.append(row)
            extra = (f" in-loop {row['in_loop_us']:.1f} us, {row['speedup_in_loop'] or 0:.2f}x XLA"
                     if args.in_loop else "")
            print(f"B={batch} T={num_queries} H={heads} L={length} {variant:16s} splits={splits:3d} "
                  f"{graph_us:8.1f} us (main {main_us:.1f}, merge {merge_us:.1f}) "
                  f"{row['roofline_pct'] or 0:5.1f}% roofline {row['tflops'] or 0:6.1f} TFLOP/s{extra}", flush=True)
        if args.in_loop:
            del inputs
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
