"""When each block of the verify kernel starts and ends (GPU, a diagnostic build): what a call's time beyond its
blocks' streaming is made of (issue 3: at T = 1, B = 1 a block's time fits ~10 µs + 1.37 µs per tile).

    KDTREE_JAX_BLOCK_CLOCK=1 pip install --no-build-isolation --no-deps -e .    # stamps compiled in
    python ffi/tools/block_skew.py [--out DIR] "B T H L [splits]" ...

Per shape, one call after three warm-up calls on other layers (the extension's harness, its inputs and kernels;
split count automatic unless given): every block's start and end by %globaltimer. Printed: the kernel's span, when
the blocks start (the launch ramp), how long they run and when they end (the skew the slowest block sets), and the
share of block-time the SMs' slots sit idle before the kernel ends.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from kdtree_jax.ops import ffi as vffi


def timeline(batch, num_queries, heads, length, splits=0):
    row_groups = vffi.choose_row_groups(num_queries, heads)
    splits = splits or vffi.choose_num_splits(batch, num_queries, heads, length, vffi.sm_count(), row_groups)
    variant = vffi.choose_variant(num_queries, heads)
    stamps = vffi._ext.bench_verify_block_times(batch, num_queries, heads, length, splits, row_groups, variant, True, 3)
    if not stamps:
        sys.exit("no block times: install a diagnostic build (KDTREE_JAX_BLOCK_CLOCK=1 pip install ... -e .) on a GPU")
    t = np.asarray(stamps).reshape(-1, 2)
    start, end = t[:, 0], t[:, 1]
    span, dur = end.max(), end - start
    pct = lambda x: {q: round(float(np.percentile(x, q)), 2) for q in (0, 10, 50, 90, 100)}  # noqa: E731
    steps = np.diff(np.unique(t.ravel()))
    return dict(B=batch, T=num_queries, H=heads, L=length, splits=splits, row_groups=row_groups, blocks=len(t),
                span_us=round(float(span), 2), start_us=pct(start), duration_us=pct(dur), end_us=pct(end),
                idle_share=round(float(1 - dur.sum() / (len(t) * span)), 3),
                timer_step_us=round(float(steps[steps > 0].min()), 3) if (steps > 0).any() else None,
                stamps_us=np.round(t, 3).tolist())  # [block] -> (start, end), block = x + gridDim.x * (y + gridDim.y * z)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="+", help='"B T H L" or "B T H L splits"')
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="writes block_skew.json there")
    args = parser.parse_args(argv)
    if not vffi.cuda_built():
        sys.exit("needs the extension built with CUDA and a GPU")
    rows = []
    for shape in args.shapes:
        row = timeline(*map(int, shape.split()))
        rows.append(row)
        print(f"B{row['B']} T{row['T']} H{row['H']} L{row['L']} {row['splits']} splits, {row['blocks']} blocks: "
              f"span {row['span_us']} us; starts {row['start_us']}; durations {row['duration_us']}; ends {row['end_us']}; "
              f"idle {100 * row['idle_share']:.0f}%; timer step {row['timer_step_us']} us", flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "block_skew.json"), "w") as f:  # after every shape: a cut run keeps its rows
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
