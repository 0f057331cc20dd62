"""Nsight Compute helper for the routed MoE at decode sizes: one `routed_experts` call (sort, gather, the CUDA
grouped expert MLP, weighted sum back into tokens) on one device's slice of a K2 layer, uniform random top-8 routing,
run once between cuProfilerStart/Stop so that `ncu --profile-from-start off` sees exactly that call's kernels.
Plain jax.jit on arrays, like probe_verify.py (an nnx.jit probe of the whole MoE block segfaulted under ncu).
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes_read.sum \\
        python3 ffi/tools/probe_moe.py 9 33                  # the K2 TP8-rank slice: 384 experts x 7168 x 256
"""
import argparse
import ctypes
import time

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.model.moe import routed_experts
from kdtree_jax.ops import moe as moe_ops

parser = argparse.ArgumentParser()
parser.add_argument("tokens", nargs="+", type=int)
parser.add_argument("--experts", type=int, default=384)
parser.add_argument("--hidden", type=int, default=7168)
parser.add_argument("--inter", type=int, default=256)
parser.add_argument("--top-k", type=int, default=8)
parser.add_argument("--impl", default="cuda")
parser.add_argument("--splits", type=int, default=None,
                    help="impl pairs: kernel 1's hidden-dim splits (default: the op's; the pairs op alone, no routing)")
args = parser.parse_args()

e, h, inter = args.experts, args.hidden, args.inter
kg, ku, kd = jax.random.split(jax.random.key(0), 3)
gate = (jax.random.normal(kg, (e, h, inter), jnp.bfloat16) * h ** -0.5).astype(jnp.bfloat16)
up = (jax.random.normal(ku, (e, h, inter), jnp.bfloat16) * h ** -0.5).astype(jnp.bfloat16)
down = (jax.random.normal(kd, (e, inter, h), jnp.bfloat16) * inter ** -0.5).astype(jnp.bfloat16)
if args.splits is not None:  # the pairs op as routed_experts runs it (every id held here), at a given split count
    call = jax.jit(lambda x, i, w, g, u, d: moe_ops.pair_expert_mlp(x, i, w, g, u, d, splits=args.splits))
else:
    call = jax.jit(lambda x, i, w, g, u, d: routed_experts(x, i, w, g, u, d, impl=args.impl))
try:
    cuda = ctypes.CDLL("libcuda.so.1")
    start, stop = cuda.cuProfilerStart, cuda.cuProfilerStop
except OSError:  # no GPU driver: still runs (a CPU check of the script)
    start = stop = lambda: None

rng = np.random.default_rng(0)
for tokens in args.tokens:
    indices = jnp.asarray(np.stack([rng.permutation(e)[:args.top_k] for _ in range(tokens)]).astype(np.int32))
    weights = jnp.asarray(rng.uniform(0.05, 0.3, (tokens, args.top_k)).astype(np.float32))
    x = jax.random.normal(jax.random.key(tokens), (tokens, h), jnp.bfloat16)
    fargs = (x, indices, weights, gate, up, down)
    for _ in range(5):
        jax.block_until_ready(call(*fargs))
    ts = []
    for _ in range(20):
        t0 = time.perf_counter(); jax.block_until_ready(call(*fargs)); ts.append(time.perf_counter() - t0)
    active = len(np.unique(np.asarray(indices)))
    floor_us = active * 3 * h * inter * 2 / 4.28e12 * 1e6
    print(f"T={tokens}: {np.median(ts) * 1e6:.1f} us per call (wall, one call), {active} experts active, "
          f"floor {floor_us:.1f} us at 4.28 TB/s", flush=True)
    start()
    jax.block_until_ready(call(*fargs))
    stop()
    print(f"profiled T={tokens}", flush=True)
