"""A/B of the verify kernel's split count by CUDA events (GPU only; seconds): for each shape, the main kernel,
the merge and the whole call (plain launches and as a CUDA graph) at the automatic split count and at each
count in --splits, through the extension's event harness (`bench_verify_attention` in ffi/verify_attention.cu),
so XLA's per-call overhead is out of the picture. The question it answers: would fewer, longer splits (less
prologue per byte streamed, smaller partials to merge) beat the automatic choice at T = 1 and T = 16?

    python ffi/tools/splits_ab.py [--splits 64,96,128,192,256] [--out $OUT/splits_ab] "1 1 8 65536" "1 16 8 65536" ...
"""
import argparse
import json
import os

from kdtree_jax.ops import ffi as vffi

DEFAULT_SHAPES = ["1 1 8 65536", "1 1 8 200000", "8 1 8 65536", "1 9 8 65536", "1 16 8 65536", "1 16 8 200000",
                  "1 1 8 4096", "1 16 8 4096"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="*", default=DEFAULT_SHAPES, help='"B T H L" (default: the decode and verify '
                   'rows the targets name)')
    p.add_argument("--splits", default="32,64,96,128,192,256", help="split counts to try besides the automatic one")
    p.add_argument("--iters", type=int, default=20, help="calls per timing in the harness")
    p.add_argument("--contiguous", action="store_true", help="contiguous slots (default: scattered)")
    p.add_argument("--out", default=None, help="write <out>.json")
    args = p.parse_args(argv)
    if not vffi.cuda_built():
        raise SystemExit("the extension was built without CUDA: this A/B needs a GPU build")
    sms = vffi.sm_count()
    rows = []
    for shape in args.shapes:
        batch, num_queries, heads, length = map(int, shape.split())
        groups = vffi.choose_row_groups(num_queries, heads)
        variant = vffi.choose_variant(num_queries, heads)
        auto = vffi.choose_num_splits(batch, num_queries, heads, length, sms)
        for splits in sorted({auto, *(int(s) for s in args.splits.split(",") if s)}):
            plain, graph, main_us, merge_us = (float(v) for v in vffi._ext.bench_verify_attention(
                batch, num_queries, heads, length, splits, groups, variant, not args.contiguous, args.iters))
            row = dict(B=batch, T=num_queries, H=heads, L=length, splits=splits, auto=splits == auto,
                       plain_us=plain, graph_us=graph, main_us=main_us, merge_us=merge_us,
                       gbps_graph=batch * length * 576 * 2 / graph / 1e3 if graph > 0 else None)
            rows.append(row)
            mark = " (auto)" if row["auto"] else ""
            print(f"B{batch} T{num_queries} H{heads} L{length} splits {splits:4d}{mark:7s} graph {graph:8.1f} us  "
                  f"main {main_us:8.1f}  merge {merge_us:6.1f}", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"sm_count": sms, "scattered": not args.contiguous, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
