"""Device time of the verify kernels against the KV split count, outside XLA (the benchmark target's CUDA-event
harness): the data behind choose_num_splits. Also each shape with contiguous slots beside scattered ones at the
heuristic's split count, to tell the gather's cost from the kernel's.

    python ffi/tools/split_sweep.py --variant hopper --out $OUT/split_sweep_h200.json
"""
import argparse
import json
import math
import os
import time

import jax

from kdtree_jax.ops import ffi as vffi

SHAPES = [  # (B, T, H, L)
    (1, 1, 8, 4096), (1, 16, 8, 4096), (1, 64, 8, 4096),
    (1, 1, 8, 16384), (1, 16, 8, 16384), (1, 64, 8, 16384),
    (1, 1, 8, 65536), (1, 9, 8, 65536), (1, 16, 8, 65536), (1, 33, 8, 65536), (1, 64, 8, 65536),
    (1, 16, 8, 131072), (8, 16, 8, 65536), (8, 1, 8, 16384),
]


def candidates(heuristic: int, length: int) -> list:
    top = max(1, min(vffi.CUDA_SPLIT_LIMIT, length // 64))
    base = {1, 2, 3, 4, 6, 8, 12, 16, 22, 33, 44, 66, 88, 132, 198, 264, heuristic}
    return sorted(n for n in base if n <= top)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="auto", choices=sorted(vffi.VARIANTS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline-s", type=float, default=150, help="stop measuring after this many seconds")
    ap.add_argument("--shapes", default="", help="'B,T,H,L;B,T,H,L;...' instead of the built-in list")
    args = ap.parse_args()
    shapes = ([tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s] if args.shapes else SHAPES)
    ext = vffi.bench_module()
    if ext is None:
        raise SystemExit("the benchmark target (kdtree_jax._kernel_bench) is not built: build with CUDA")
    code = vffi.VARIANTS[args.variant]
    t0 = time.perf_counter()
    rows = []
    for (b, t, h, length) in shapes:
        if time.perf_counter() - t0 > args.deadline_s:
            break
        heuristic, rows_per_block = vffi.splits_for(b, t, h, length, args.variant)
        flops = 2.0 * b * t * h * length * (576 + 512)
        row = {"B": b, "T": t, "H": h, "L": length, "heuristic": heuristic, "rows_per_block": rows_per_block,
               "splits": {}}
        for n in candidates(heuristic, length):
            us, _, main_us, merge_us = (float(x) for x in ext.bench_verify_attention(b, t, h, length, n, code, True, 20))
            row["splits"][n] = {"us": us, "main_us": main_us, "merge_us": merge_us, "tflops": flops / us / 1e6}
        us_c, _, main_c, merge_c = (float(x) for x in ext.bench_verify_attention(b, t, h, length, heuristic, code, False, 20))
        row["contiguous"] = {"us": us_c, "main_us": main_c, "merge_us": merge_c}
        best = min(row["splits"], key=lambda n: row["splits"][n]["us"])
        row["best"] = best
        print(f"B={b} T={t:3d} H={h} L={length:6d}: heuristic {heuristic:3d} {row['splits'][heuristic]['us']:7.1f} us | "
              f"best {best:3d} {row['splits'][best]['us']:7.1f} us | contiguous {us_c:7.1f} | "
              + " ".join(f"{n}:{v['us']:.1f}" for n, v in row["splits"].items()), flush=True)
        rows.append(row)
    meta = {"date": time.strftime("%Y-%m-%d"), "device": jax.devices()[0].device_kind,
            "commit": os.environ.get("KDTREE_COMMIT", "unknown"), "variant": args.variant,
            "timing": "CUDA events, 20 calls on consecutive layers of a >= 512 MB pool, device us per call"}
    with open(args.out, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
