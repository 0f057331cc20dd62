"""Profiling driver for Nsight Compute (ffi/tools/probe_verify.sh): for each shape "B T H L", compiles a program of
`--calls` unrolled verify-attention calls (each on its own layer, as benchmarks/verify_kernel.py times them),
warms it up, then runs it once between cuProfilerStart/Stop, so `ncu --profile-from-start off` sees exactly
the kernels of one timed program (the verify kernel, the merge, anything XLA adds between them).

    python ffi/tools/probe_verify.py [--calls 3] [--hlo FILE] "1 16 8 65536" "1 1 8 4096" ...
"""
import argparse
import ctypes
import time

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.ops import verify_attention
from kdtree_jax.ops.masks import ancestor_mask

parser = argparse.ArgumentParser()
parser.add_argument("shapes", nargs="+")
parser.add_argument("--calls", type=int, default=3)
parser.add_argument("--hlo", default=None, help="write the optimised HLO of the first program here")
parser.add_argument("--time", action="store_true", help="also print wall time per call (slope of 1 vs --calls)")
args = parser.parse_args()
cuda = ctypes.CDLL("libcuda.so.1")

for n, shape in enumerate(args.shapes):
    batch, num_queries, heads, length = map(int, shape.split())
    layers = args.calls + 1
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    kv_pool = jax.random.normal(k[0], (layers, batch * length, 576), jnp.bfloat16)
    q = jax.random.normal(k[1], (batch, num_queries, heads, 576), jnp.bfloat16)
    kv_slots = jax.random.permutation(k[2], batch * length).astype(jnp.int32).reshape(batch, length)
    kv_lens = jnp.full((batch,), length, jnp.int32)
    rng = np.random.default_rng(num_queries)
    parents = np.array([[-1] + [rng.integers(0, i) for i in range(1, num_queries)] for _ in range(batch)], np.int32)
    mask = ancestor_mask(jnp.asarray(parents))

    def make(calls):
        @jax.jit
        def run(q, kv_pool, kv_slots, kv_lens, mask):
            return [verify_attention(q, kv_pool, jnp.int32(i), kv_slots, kv_lens, mask, softmax_scale=0.07, impl="ffi")
                    for i in range(calls)]
        return run

    fn = make(args.calls)
    fargs = (q, kv_pool, kv_slots, kv_lens, mask)
    if args.hlo and n == 0:
        with open(args.hlo, "w") as f:
            f.write(fn.lower(*fargs).compile().as_text())
    for _ in range(5):
        jax.block_until_ready(fn(*fargs))
    if args.time:
        one = make(1)
        med = []
        for f_ in (one, fn):
            jax.block_until_ready(f_(*fargs))
            ts = []
            for _ in range(20):
                t0 = time.perf_counter(); jax.block_until_ready(f_(*fargs)); ts.append(time.perf_counter() - t0)
            med.append(np.median(ts))
        print(f"wall {shape}: 1 call {med[0]*1e6:.1f} us, {args.calls} calls {med[1]*1e6:.1f} us, "
              f"slope {(med[1]-med[0])/(args.calls-1)*1e6:.1f} us/call", flush=True)
    cuda.cuProfilerStart()
    jax.block_until_ready(fn(*fargs))
    cuda.cuProfilerStop()
    print("profiled", shape, flush=True)
