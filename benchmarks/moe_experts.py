"""Routed MoE at decode sizes: XLA's ragged_dot against the CUDA grouped GEMV (ops/moe.py), per geometry.

--geometry k2 (default): two per-device slices of one K2 layer (hidden 7168, moe_intermediate 2048, 384
experts, top-8):
  ep: 96 whole experts (4-way expert parallelism; pairs routed to the other 288 experts contribute 0 here)
  tp: all 384 experts, a quarter (512) of each one's intermediate dim (4-way tensor parallelism)
--geometry default_pair: the embedded default pair's target MoE layer (hidden 256, moe_intermediate 256,
8 experts, top-2), layout "full" (one device); tokens 16 = an autoregressive step at batch 16, 272 = a DDTree 16
step at batch 16 (16 x 17 tokens, 544 rows).
T tokens with uniformly random top-k routing.  --scope routed (default) times routed_experts (sort, gather,
grouped MLP, weighted sum back into tokens); --scope op the grouped MLP alone (grouped_expert_mlp on the
rows already sorted).  Each impl runs `--iters` calls inside a jitted fori_loop whose input depends on the
carry; the time per call is the median over --reps of loop time / iters (device time: the loop is one XLA
program, nothing returns to the host in between).  Impls: xla (ragged_dot), cuda_bps4 / cuda_bps1 (the CUDA op
at 128 / ~200 registers), dense (all_experts_mlp: every expert on every row, masked; skipped above 64 local
experts), auto (the dispatch as the model runs it).  The floor is the bytes of the weights of the experts
active on this device (3 matrices each) at 4.3 TB/s: reading each used expert once and nothing else.

  python benchmarks/moe_experts.py                 # H200: writes results/moe_experts_h200.{md,json}
  python benchmarks/moe_experts.py --geometry default_pair,k2 --tokens-k2 1,9,33 --impls xla,cuda_bps4,dense,auto \
      --out $OUT --name moe_experts_items_h200     # the work-item grid: both geometries, one process
  python benchmarks/moe_experts.py --smoke  # CPU, tiny widths, checks the script runs (writes to a temp dir)

--shared: every impl also runs a shared expert of the routed experts' width on every token (K2's one shared expert;
the tp slice's width under tp), as the model's layer does: its own XLA products added to the routed result, except
`pairs_shared`, the pairs op with the shared expert inside its kernels (MoE.folds_shared; not under ep, whose routed
experts stay whole). The floor then counts the shared expert's bytes too.
  python benchmarks/moe_experts.py --geometry k2 --layouts tp --devices 8 --tokens-k2 1,4,9 --impls pairs,pairs_shared \
      --shared --name moe_shared_fold_h200     # the K2 TP8 rank's layer, the shared expert apart vs folded
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
from kdtree_jax.model.moe import routed_experts, swiglu  # noqa: E402
from kdtree_jax.ops import moe as moe_ops  # noqa: E402
from kdtree_jax.provenance import git_commit, smoke_dir  # noqa: E402

FLOOR_BYTES_PER_S = 4.3e12
GEOMETRIES = {
    "k2": dict(hidden=7168, inter=2048, experts=384, top_k=8, layouts=("ep", "tp"), tokens="1,9,33,64,256",
               impls="xla,cuda_bps4,cuda_bps1"),
    "default_pair": dict(hidden=256, inter=256, experts=8, top_k=2, layouts=("full",), tokens="8,16,136,272,520,1040",
                         impls="xla,cuda_bps4,dense,auto"),
}
SMOKE = {"k2": dict(GEOMETRIES["k2"], hidden=64, inter=32, experts=16, top_k=4),
         "default_pair": dict(GEOMETRIES["default_pair"], hidden=32, inter=32)}
K2 = GEOMETRIES["k2"]
IMPL_NAMES = ("xla", "cuda_bps4", "cuda_bps1", "pairs", "pairs_du1", "pairs_du2", "pairs_shared", "dense", "auto")
DENSE_MAX_EXPERTS = 64  # dense does E x the grouped FLOPs: pointless (and huge) at K2's 96-384 local experts


def impl_of(name):
    """(impl, blocks_per_sm) passed to routed_experts / grouped_expert_mlp."""
    if name.startswith("cuda_bps"):
        return "cuda", int(name[len("cuda_bps"):])
    return name, moe_ops.CUDA_BLOCKS_PER_SM


def median_per_call(run, args, iters, reps):
    """(median seconds per call, the loop's output)."""
    out = jax.block_until_ready(run(*args))  # compile + warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - t) / iters)
    return float(np.median(times)), out


def make_loop(impl, iters, scope, blocks_per_sm=moe_ops.CUDA_BLOCKS_PER_SM):
    """jit(x, routing, weights, *shared): `iters` calls, each input depending on the last output (nothing is hoisted);
    the weights are arguments, never closed-over constants.  scope "op": x are the sorted rows and `indices`
    the group sizes (the grouped MLP alone).  `shared` (--shared): a shared expert's (gate, up, down), added apart
    (XLA products) or, for impl "pairs_shared", inside the pairs op."""
    @jax.jit
    def run(x, indices, weights, gate, up, down, *shared):
        def body(i, x):
            if scope == "op":
                out = moe_ops.grouped_expert_mlp(x, indices, gate, up, down, impl=impl, blocks_per_sm=blocks_per_sm)
            elif impl == "pairs_shared":
                out = routed_experts(x, indices, weights, gate, up, down, impl="pairs", blocks_per_sm=blocks_per_sm,
                                     shared=shared)
            else:
                if impl.startswith("pairs_du"):  # the pairs op at a down_unroll (A/B; the routed result exactly)
                    out = moe_ops.pair_expert_mlp(x, indices, weights, gate, up, down, blocks_per_sm=blocks_per_sm,
                                                  down_unroll=int(impl[len("pairs_du"):]))
                else:
                    out = routed_experts(x, indices, weights, gate, up, down, impl=impl, blocks_per_sm=blocks_per_sm)
                if shared:  # the shared expert apart, as XLA products
                    out = out + swiglu(x, *shared)
            return x + out * jnp.asarray(1e-3, x.dtype)
        return jax.lax.fori_loop(0, iters, body, x)
    return run


def bench_layout(geometry, layout, widths, n_dev, tokens_list, impls, scope, iters, reps, log, with_shared=False):
    h, i_full, e_all, k = widths["hidden"], widths["inter"], widths["experts"], widths["top_k"]
    e_local, inter = {"ep": (e_all // n_dev, i_full), "tp": (e_all, i_full // n_dev), "full": (e_all, i_full)}[layout]
    key = jax.random.key(0)
    kg, ku, kd = jax.random.split(key, 3)
    gate = (jax.random.normal(kg, (e_local, h, inter), jnp.bfloat16) * h ** -0.5).astype(jnp.bfloat16)
    up = (jax.random.normal(ku, (e_local, h, inter), jnp.bfloat16) * h ** -0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(kd, (e_local, inter, h), jnp.bfloat16) * inter ** -0.5).astype(jnp.bfloat16)
    expert_bytes = 3 * h * inter * 2
    shared = (gate[0] * 0.5, up[0] * 0.5, down[0] * 0.5) if with_shared else ()  # an expert of its own width
    rows = []
    rng = np.random.default_rng(0)
    for tokens in tokens_list:
        indices = np.stack([rng.permutation(e_all)[:k] for _ in range(tokens)]).astype(np.int32)
        weights = rng.uniform(0.05, 0.3, (tokens, k)).astype(np.float32)
        local = indices[(indices >= 0) & (indices < e_local)]  # ep: this device holds experts [0, e_local)
        active = len(np.unique(local))
        local_pairs = int(local.size)
        sizes = np.bincount(local, minlength=e_local).astype(np.int32)
        read = active + bool(shared)  # experts whose weights a call must read
        floor = read * expert_bytes / FLOOR_BYTES_PER_S
        x = jax.random.normal(jax.random.key(tokens), (tokens, h), jnp.float32).astype(jnp.bfloat16)
        if scope == "op":  # the rows as routed_experts hands them over: sorted by expert, others last
            flat = np.where(indices < e_local, indices, e_local).reshape(-1)
            order = np.argsort(flat, kind="stable")
            args = (x[jnp.asarray(order // k)], jnp.asarray(sizes), None, gate, up, down)
        else:
            args = (x, jnp.asarray(indices), jnp.asarray(weights), gate, up, down, *shared)
        num_rows = tokens * k
        per_item = moe_ops.rows_per_item(num_rows, e_local)
        items = int((-(-sizes // per_item)).sum())
        row = dict(geometry=geometry, layout=layout, scope=scope, tokens=tokens, top_k=k, experts_local=e_local,
                   inter_local=inter, hidden=h, rows=num_rows, local_pairs=local_pairs, active_experts=active,
                   max_rows_per_expert=int(sizes.max()), rows_per_item=per_item, items=items,
                   item_slots=moe_ops.item_slots(num_rows, e_local, per_item),
                   auto_uses_cuda=bool(moe_ops.cuda_built() and num_rows <= moe_ops.CUDA_MAX_ROWS),
                   shared_expert=bool(shared), active_bytes=read * expert_bytes, floor_us=floor * 1e6)
        ref = None  # ragged_dot's final x
        for name in impls:
            impl, bps = impl_of(name)
            if (impl == "dense" and e_local > DENSE_MAX_EXPERTS) or (impl.startswith("pairs") and scope == "op"):
                continue  # "pairs" runs on the routed pairs, never on sorted rows
            if impl == "pairs_shared" and (not shared or layout == "ep"):
                continue  # the fold needs a shared expert of the routed experts' width (not ep: MoE.folds_shared)
            if impl.startswith("pairs_du") and not moe_ops.pairs_built():
                continue  # the CUDA op called directly: nothing to time without it
            run = make_loop(impl, iters, scope, bps)
            seconds, final = median_per_call(run, args, iters, reps)
            # The loop's final x, against ragged_dot's: a cheap end-to-end agreement check (tests check more).
            final = final.astype(jnp.float32)
            if ref is None:
                ref = final
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_gbps"] = read * expert_bytes / seconds / 1e9
            row[f"{name}_of_floor"] = floor / seconds
            row[f"{name}_max_diff_vs_xla"] = float(jnp.max(jnp.abs(final - ref)))
        log(json.dumps(row))
        rows.append(row)
    del gate, up, down
    return rows


def markdown(meta, rows):
    impls = [n for n in IMPL_NAMES if any(f"{n}_us" in r for r in rows)]
    lines = [f"# Routed MoE at decode sizes: ragged_dot vs the CUDA grouped GEMV ({meta['device']})", "",
             f"{meta['date']}, commit {meta['commit']}, jax {meta['jax']}. Per call: "
             f"{'the grouped MLP alone (rows already sorted)' if meta['scope'] == 'op' else 'routed_experts (sort, gather, grouped SwiGLU, weighted sum back into tokens)'}, "
             f"median of {meta['reps']} runs of a jitted fori_loop of {meta['iters']} calls whose input depends on the "
             f"carry. Floor = bytes of the experts active on this device"
             f"{' and of the shared expert (every impl runs one: apart as XLA products, inside the pairs op for `pairs shared`)' if meta.get('shared_expert') else ''}"
             f" / 4.3 TB/s. `cuda bps4` / `bps1`: the CUDA op at "
             f"128 registers (4 blocks/SM) / ~200 registers (2 blocks/SM), R = {meta['cuda_rows_per_item']} rows of an "
             f"expert per work item (each its own blocks); `pairs`: the CUDA op on the router's pairs in place (no sort, "
             f"gather or combine launches; `auto` takes it up to {moe_ops.PAIRS_MAX} pairs; `pairs du1` / `du2`: its down kernel loading one / two steps together); `dense`: every expert on every row, masked (≤ "
             f"{DENSE_MAX_EXPERTS} local experts); `auto`: the dispatch (CUDA op up to {meta['cuda_max_rows']} rows). "
             f"Last column: largest |difference| of the loop's final x (≈ unit scale) from ragged_dot's, over the impls.",
             "", "| geometry / layout | T | rows | active experts | max rows / expert | items | floor µs | "
             + " | ".join(f"{n.replace('_', ' ')} µs" for n in impls) + " | best | best vs xla | floor / best | max diff of x |",
             "|" + "---|" * (11 + len(impls))]
    for r in rows:
        times = {n: r[f"{n}_us"] for n in impls if f"{n}_us" in r}
        best = min(times, key=times.get)
        diff = max((r[f"{n}_max_diff_vs_xla"] for n in times), default=0.0)
        cells = " | ".join(f"{times[n]:.1f}" if n in times else "–" for n in impls)
        vs_xla = f"{r['xla_us'] / times[best]:.1f}×" if "xla_us" in r else "–"
        lines.append(f"| {r['geometry']} {r['layout']} ({r['experts_local']}×{r['hidden']}×{r['inter_local']}) | "
                     f"{r['tokens']} | {r['rows']} | {r['active_experts']} | {r['max_rows_per_expert']} | {r['items']} | "
                     f"{r['floor_us']:.1f} | {cells} | {best} | {vs_xla} | {r['floor_us'] / times[best]:.0%} | {diff:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny widths, 2 iterations (CPU check of the script)")
    p.add_argument("--geometry", default="k2", help="comma-separated: k2, default_pair")
    p.add_argument("--tokens", default=None, help="tokens per MoE call of every geometry (default: per geometry)")
    p.add_argument("--tokens-k2", default=None, help="tokens of the k2 geometry (overrides --tokens)")
    p.add_argument("--tokens-default-pair", default=None, help="tokens of the default_pair geometry")
    p.add_argument("--layouts", default=None, help="k2 layouts to time: ep (experts split), tp (each expert split)")
    p.add_argument("--impls", default=None, help=f"comma-separated of {','.join(IMPL_NAMES)} (default: per geometry)")
    p.add_argument("--scope", default="routed", choices=("routed", "op"), help="routed_experts or the grouped MLP alone")
    p.add_argument("--shared", action="store_true",
                   help="add a shared expert of the routed experts' width to every impl (module docstring)")
    p.add_argument("--devices", type=int, default=4, help="the EP / TP degree the k2 slices stand for")
    p.add_argument("--iters", type=int, default=10, help="MoE calls per timed loop")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (the median is reported)")
    p.add_argument("--out", default=None, help="output directory (default: benchmarks/results; --smoke: a temp dir)")
    p.add_argument("--name", default=None, help="results file stem (default moe_experts_h200, or _smoke)")
    args = p.parse_args(argv)
    geometries = args.geometry.split(",")
    for g in geometries:
        if g not in GEOMETRIES:
            p.error(f"--geometry: unknown {g!r} (known: {', '.join(GEOMETRIES)})")
    impls_arg = args.impls.split(",") if args.impls else None
    for n in impls_arg or []:
        if n not in IMPL_NAMES:
            p.error(f"--impls: unknown {n!r} (known: {', '.join(IMPL_NAMES)})")
    iters, reps = (2, 2) if args.smoke else (args.iters, args.reps)

    def log(msg):
        print(msg, flush=True)

    name = args.name or ("moe_experts_smoke" if args.smoke else "moe_experts_h200")
    if args.out is None:
        args.out = smoke_dir("moe_experts") if args.smoke else os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                           "results")
    os.makedirs(args.out, exist_ok=True)
    commit = git_commit()
    meta = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
                jax=jax.__version__, iters=iters, reps=reps, scope=args.scope, ep_tp_degree=args.devices,
                shared_expert=args.shared,
                geometries={g: (SMOKE if args.smoke else GEOMETRIES)[g] for g in geometries},
                cuda_max_rows=moe_ops.CUDA_MAX_ROWS, cuda_rows_per_item=moe_ops.rows_per_item(1, 1),
                cuda_op_built=moe_ops.cuda_built(), floor_bytes_per_s=FLOOR_BYTES_PER_S)
    log(json.dumps(meta))
    rows = []
    t0 = time.perf_counter()
    for geometry in geometries:
        widths = (SMOKE if args.smoke else GEOMETRIES)[geometry]
        tokens = {"k2": args.tokens_k2, "default_pair": args.tokens_default_pair}[geometry] or args.tokens
        tokens_list = ([1, 9] if geometry == "k2" else [8, 16]) if args.smoke else \
            [int(t) for t in (tokens or widths["tokens"]).split(",")]
        layouts = args.layouts.split(",") if args.layouts and geometry == "k2" else widths["layouts"]
        impls = impls_arg or widths["impls"].split(",")
        if "xla" in impls:  # first: the reference of the max-diff column
            impls = ["xla"] + [n for n in impls if n != "xla"]
        for layout in layouts:
            rows += bench_layout(geometry, layout, widths, args.devices, tokens_list, impls, args.scope, iters, reps,
                                 log, with_shared=args.shared)
            # Written after every layout, so that a run cut short keeps what it measured.
            meta["seconds"] = round(time.perf_counter() - t0, 1)
            with open(os.path.join(args.out, name + ".json"), "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1)
            with open(os.path.join(args.out, name + ".md"), "w") as f:
                f.write(markdown(meta, rows))
    log(markdown(meta, rows))
    log(f"wrote {os.path.join(args.out, name)}.{{json,md}} ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
