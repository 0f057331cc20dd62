"""A/B of the verify kernel variants on one GPU, timed with CUDA events outside XLA (the benchmark target
`kdtree_jax._kernel_bench`): per call, a CUDA graph of `iters` calls on consecutive layers of a pool larger than L2,
the main kernel alone and the merge alone. The split count is the op's own (kdtree_jax.ops.ffi.choose_num_splits for
the variant). For the op as XLA runs it, and the XLA baseline beside it, see verify_kernel.py.

    python benchmarks/verify_variants.py --shapes "1 16 8 65536;1 64 8 65536" --variants pipelined,wide
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kdtree_jax.ops import ffi as vffi


def roofline_us(batch, num_queries, heads, length, copy_gbps, mma_tflops):
    flops = 2.0 * batch * num_queries * heads * length * (576 + 512)
    kv_bytes = batch * length * 1152
    return max(kv_bytes / (copy_gbps * 1e3), flops / (mma_tflops * 1e6)), flops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1 16 8 65536", help='"B T H L;..." (scattered slots, kv_lens = L)')
    parser.add_argument("--variants", default="auto", help=f"comma list of {sorted(vffi.VARIANTS)}")
    parser.add_argument("--iters", type=int, default=40, help="calls per timed graph")
    parser.add_argument("--json", help="also write the rows here")
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
    for shape in args.shapes.split(";"):
        batch, num_queries, heads, length = (int(v) for v in shape.split())
        floor_us, flops = roofline_us(batch, num_queries, heads, length, copy_gbps, mma_tflops)
        for variant in args.variants.split(","):
            if variant == "stream" and num_queries * heads > vffi.STREAM_MAX_ROWS:
                continue
            splits = vffi.choose_num_splits(batch, num_queries, heads, length, vffi.sm_count(), variant)
            graph_us, main_us, merge_us = (float(v) for v in bench.bench_verify_attention(
                batch, num_queries, heads, length, splits, vffi.VARIANTS[variant], True, args.iters)[1:])
            row = dict(B=batch, T=num_queries, H=heads, L=length, variant=variant, splits=splits, us=graph_us,
                       main_us=main_us, merge_us=merge_us, roofline_pct=100 * floor_us / graph_us if graph_us > 0 else None,
                       tflops=flops / graph_us / 1e6 if graph_us > 0 else None)
            rows.append(row)
            print(f"B={batch} T={num_queries} H={heads} L={length} {variant:16s} splits={splits:3d} "
                  f"{graph_us:8.1f} us (main {main_us:.1f}, merge {merge_us:.1f}) "
                  f"{row['roofline_pct'] or 0:5.1f}% roofline {row['tflops'] or 0:6.1f} TFLOP/s", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(copy_gbps=copy_gbps, mma_tflops=mma_tflops, commit=os.environ.get("KDTREE_COMMIT"),
                           rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
