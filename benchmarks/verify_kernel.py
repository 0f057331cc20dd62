"""Verify-attention kernel sweep on one GPU, with the ceilings measured in the same run.

    python benchmarks/verify_kernel.py [--plan full|priority|issue20|...] [--variants auto,wide,...] [--resume]
                                       [--commit SHA] [--out benchmarks/results/verify_kernel_h200]
    python benchmarks/verify_kernel.py --smoke        # the script's whole path on any backend, in seconds (temp dir)

Rows: L in {4k, 16k, 64k, 128k, 200k} x T in {1, 9, 16, 33, 64, 128, 257} x H = 8 x B in {1, 8}, contiguous
and scattered slot tables (kv_lens = L for every sequence). Columns: time per call of each kernel variant
(--variants, passed to `kdtree_jax.ops.ffi.verify_attention_ffi(..., variant=NAME)`), KV GB/s, TFLOP/s, the
fraction of the portable roofline max(KV bytes / copy BW, FLOPs / mma.sync rate) with
FLOPs = 2*B*T*H*L*(576+512), and the XLA baseline with the speed-up over it.

The baseline (what every speed-up is quoted against): the XLA formulation a skilled JAX user writes,
kdtree_jax/ops/xla.py (bf16 rows gathered from the pool, einsums with float32 accumulation, float32 softmax),
in both of its forms, dense over L and chunked over L (--xla-chunk positions a step, online softmax), each timed
exactly as the kernel is; the faster by device time is the row's baseline (`xla_kind`, both times kept). The
float32-HIGHEST reference (ops/reference.py) is a correctness oracle and is never timed here.

Timing: the device time per call (and the in-loop time per call, below). One jitted program of k calls (each on
its own layer of a pool sized well past the 60 MB L2, as a model's layers are; every output returned, so no call is dropped) runs once under the
profiler; a call's time is the span from its first kernel's start to its last kernel's end over the k calls,
divided by k (CUPTI's device timestamps: the calls run back to back in the CUDA graph XLA's default command
buffers make of the program). The program's wall time per call is recorded as well ("wall µs"): it adds the host's
launch of a k-call graph, a cost that grows with k (output allocation, a graph of 2k nodes: ~10-25 µs per
call on an H200) and that a model's loop pays once per step, not per attention call.
In-loop time per call ("loop µs"): n calls inside one jitted `lax.fori_loop` (static trip count, so no host
round trip per iteration), each on the layer the previous call's lse selects (nothing can be hoisted), its
whole out and lse carried (nothing can be dropped); the program's wall time / n, median of 5, n chosen so the
loop runs a few ms (its one launch spread over n calls).
Ceilings: device-to-device cudaMemcpy (bytes read + written), XLA's bf16 dot on random 8192^3 operands, and
an mma.sync m16n8k16 bf16 micro-benchmark compiled into the extension.
A second figure: 64 calls inside one jitted `lax.while_loop` with XLA command buffers incl. WHILE (run in a
child process that sets XLA_FLAGS): the call's cost per iteration (the loop's wall-time slope minus that of the
same loop without the call; the profiler does not see kernels inside the loop's conditional graph node) against
its device time alone.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time

COMMAND_BUFFER_FLAGS = ("--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL "
                        "--xla_gpu_graph_min_graph_size=1")

if "--command-buffers" in sys.argv:  # XLA reads its flags once, when the backend starts: set them before jax loads
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFER_FLAGS).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kdtree_jax import profiling  # noqa: E402
from kdtree_jax.ops import verify_attention  # noqa: E402
from kdtree_jax.ops import ffi as vffi  # noqa: E402
from kdtree_jax.ops.masks import ancestor_mask  # noqa: E402
from kdtree_jax.ops.xla import DEFAULT_CHUNK, verify_attention_xla  # noqa: E402

H = 8
WIDTH, LATENT = 576, 512
SCALE = 192 ** -0.5
ROW_BYTES = WIDTH * 2
LS = [4096, 16384, 65536, 131072, 200000]
TS = [1, 9, 16, 33, 64, 128, 257]
BS = [1, 8]
POOL_MAX_BYTES = 12 << 30       # per (B, L) pool
MAX_LAYERS = 21                 # calls per timed program <= layers - 1: no two calls are identical
REF_FEW_CALLS_SCORES = 1 << 28  # above 2^28 scores (1 GiB of float32 per temporary) the XLA baseline runs 2 calls, not 4
XLA_CHUNK = DEFAULT_CHUNK       # --xla-chunk: positions a step of the chunked XLA baseline
LOOP_TARGET_S = 4e-3            # an in-loop program runs about this long (n calls)


MAX_WARM_S = float("inf")  # --smoke: 0 (no SM clock to ramp up; a smoke run checks the code path, not the figures)


def median_wall(fn, args, reps: int, warm_s: float) -> float:
    """Median seconds of `reps` runs of fn(*args), after one run (the compile) and `warm_s` seconds of
    back-to-back runs (the SM clock ramps up after the idle compile time)."""
    jax.block_until_ready(fn(*args))
    t_end = time.perf_counter() + min(warm_s, MAX_WARM_S)
    while time.perf_counter() < t_end:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def wall_per_call(make_fn, args, k1: int, k2: int, reps: int = 7, warm_s: float = 0.1) -> float:
    """Seconds per call: slope between programs of k1 and k2 calls (`median_wall` of each)."""
    medians = [median_wall(make_fn(k), args, reps, warm_s) for k in (k1, k2)]
    return max((medians[1] - medians[0]) / (k2 - k1), 1e-9)


OWN_KERNEL = re.compile(r"verify_attention|merge_splits")


def device_per_call(make_fn, args, k: int, reps: int = 5, warm_s: float = 0.1, compiled_cache=None) -> dict:
    """One program of k calls: device µs per call (first kernel start to last kernel end, over k), its wall µs
    per call (`median_wall`, host launch included), and the µs per call of each kernel family.
    compiled_cache: a dict that keeps the compiled program by k and the arguments' shapes, for a caller whose
    make_fn is the same for every row (the XLA reference: its compile and autotuning are most of a sweep's time,
    and the contiguous row of a shape reuses the scattered row's program)."""
    key = (k, tuple((a.shape, str(a.dtype)) for a in args))
    compiled = compiled_cache.get(key) if compiled_cache is not None else None
    t0 = time.perf_counter()
    if compiled is None:
        compiled = make_fn(k).lower(*args).compile()
        if compiled_cache is not None:
            compiled_cache[key] = compiled
    compile_s = time.perf_counter() - t0
    wall = median_wall(compiled, args, reps, warm_s)
    _, events, _ = profiling.trace_kernels(compiled, args)
    span_ns = max(e[2] for e in events) - min(e[1] for e in events)
    # Per kernel type, the time after its predecessor on the stream ended: under programmatic dependent launch the
    # merge's recorded span starts while the main kernel still runs (profiling.clip_to_streams).
    events = profiling.clip_to_streams(events)
    families = {}
    for e in events:
        name = profiling.kernel_family(e[3])
        families[name] = families.get(name, 0.0) + (e[2] - e[1]) / k / 1e3
    return dict(us=span_ns / k / 1e3, wall_us=wall / k * 1e6, kernels=families,
                kernels_per_call=len(events) / k, compile_s=compile_s)


def split_main_merge(kernels: dict) -> tuple:
    """(main kernel µs, merge µs) per call from `device_per_call`'s kernel families."""
    merge = sum(v for name, v in kernels.items() if "merge_splits" in name)
    main = sum(v for name, v in kernels.items() if OWN_KERNEL.search(name) and "merge_splits" not in name)
    if not main and not merge:  # a CPU trace: the op is one custom-call thunk, named after its instruction
        main = sum(kernels.values())
    return main, merge


def unrolled(op, num_layers: int):
    """A jitted program of k calls on layers 0, 1, ... (mod num_layers); all outputs are returned, so no
    call can be dropped, and no extra kernels sit between the calls."""
    def make(k):
        @jax.jit
        def run(q, kv_pool, kv_slots, kv_lens, tree_mask):
            return [op(q, kv_pool, jnp.int32(i % num_layers), kv_slots, kv_lens, tree_mask) for i in range(k)]
        return run
    return make


def make_pool(key, batch, length):
    """The latent pool of one (B, L): enough layers that the calls of one timed program all read different
    layers (XLA would merge identical calls) and that they span several times the L2."""
    num_slots = batch * length
    layer_bytes = num_slots * ROW_BYTES
    num_layers = max(4, min(MAX_LAYERS, POOL_MAX_BYTES // layer_bytes))
    return jax.random.normal(key, (num_layers, num_slots, WIDTH), jnp.bfloat16)


def make_inputs(key, kv_pool, batch, num_queries, length, scattered: bool, heads: int = H):
    num_slots = batch * length
    k = jax.random.split(key, 2)
    q = jax.random.normal(k[0], (batch, num_queries, heads, WIDTH), jnp.bfloat16)
    if scattered:
        kv_slots = jax.random.permutation(k[1], num_slots).astype(jnp.int32).reshape(batch, length)
    else:
        kv_slots = jnp.arange(num_slots, dtype=jnp.int32).reshape(batch, length)
    kv_lens = jnp.full((batch,), length, jnp.int32)
    # A random tree over the T query tokens (the mask only touches the last tile, so its shape barely matters).
    rng = np.random.default_rng(num_queries)
    parents = np.array([[-1] + [rng.integers(0, i) for i in range(1, num_queries)] for _ in range(batch)], np.int32)
    tree_mask = ancestor_mask(jnp.asarray(parents))
    return q, kv_pool, kv_slots, kv_lens, tree_mask


def measure_ceilings(ext):
    copy_gbps = ext.bench_copy_gbps(0, 2 << 30, 20)
    mma_tflops = ext.bench_mma_sync_tflops(0)
    n = 8192
    ka, kb = jax.random.split(jax.random.PRNGKey(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    bs = [jax.random.normal(jax.random.fold_in(kb, i), (n, n), jnp.bfloat16) for i in range(8)]

    def make(k):  # k distinct products (identical ones would be merged by XLA)
        return jax.jit(lambda a, *bs: [jnp.dot(a, bs[i], preferred_element_type=jnp.bfloat16) for i in range(k)])

    per_dot = wall_per_call(make, (a, *bs), 2, 8, reps=5)
    return {"copy_gbps": copy_gbps, "mma_sync_tflops": mma_tflops, "xla_dot_tflops": 2 * n ** 3 / per_dot / 1e12}


def measure_cpu_ceilings():
    """--smoke on a CPU: a jitted copy (bytes read + written) and XLA's f32 dot; no mma.sync there, so the dot's
    rate stands in for it. Only to exercise the script: a CPU's figures mean nothing for the kernel (so the copy is of
    4 MB, not of a size that would measure memory rather than cache: it runs in every smoke call)."""
    x = jnp.ones((1 << 20,), jnp.float32)
    per_copy = wall_per_call(lambda k: jax.jit(lambda x: [x + i for i in range(k)]), (x,), 1, 4, reps=3)
    n = 512
    a = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    bs = [a + i for i in range(4)]
    per_dot = wall_per_call(lambda k: jax.jit(lambda a, *bs: [a @ bs[i] for i in range(k)]), (a, *bs), 1, 4, reps=3)
    dot_tflops = 2 * n ** 3 / per_dot / 1e12
    return {"copy_gbps": 2 * x.nbytes / per_copy / 1e9, "mma_sync_tflops": dot_tflops, "xla_dot_tflops": dot_tflops}


def smoke_plan():
    """--smoke: two tiny rows (scattered with the XLA baseline, contiguous without)."""
    return [(1, 1000, True, [1, 9], [1]), (1, 1000, False, [1], [])]


# ---- the ops: kernel variants (before and after the ffi's `variant` keyword) and the XLA baseline


def ffi_takes_variant() -> bool:
    return "variant" in inspect.signature(vffi.verify_attention_ffi).parameters


def known_variants():
    """The names `verify_attention_ffi(variant=...)` takes (kdtree_jax.ops.ffi.VARIANTS), or ("auto",) before it."""
    names = getattr(vffi, "VARIANTS", None)
    return tuple(names) if names is not None and ffi_takes_variant() else ("auto",)


def check_variants(names) -> list:
    """--variants, validated before any device work."""
    names = [n.strip() for n in names.split(",") if n.strip()]
    allowed = known_variants()
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        sys.exit(f"--variants: {', '.join(bad) or 'none given'} not among this build's {', '.join(allowed)}")
    return list(dict.fromkeys(names))


def kernel_op(variant: str = "auto", num_splits: int = 0):
    if variant == "auto" and not ffi_takes_variant():
        return lambda *a: verify_attention(*a, softmax_scale=SCALE, num_splits=num_splits, impl="ffi")
    return lambda *a: vffi.verify_attention_ffi(*a, softmax_scale=SCALE, num_splits=num_splits, variant=variant)


def xla_op(chunk):
    """The XLA baseline: dense (chunk None) or chunked over L."""
    return functools.partial(verify_attention_xla, softmax_scale=SCALE, rope_dim=WIDTH - LATENT, chunk=chunk)


def variant_splits(batch, num_queries, heads, length, variant):
    """(KV splits, query rows a block) of a variant, from the op's own heuristics."""
    return vffi.splits_for(batch, num_queries, heads, length, variant)


T_START = time.perf_counter()
DEVICE_TIMING = False  # --device-timing: also time each row's kernels with CUDA events outside XLA


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T_START:7.1f} s] {msg}", flush=True)


def device_timing(batch, num_queries, heads, length, scattered, splits, variant):
    """The benchmark target's CUDA-event harness: µs per call with plain launches and as a CUDA graph, and of the
    main kernel and the merge alone; None where it failed."""
    ext = vffi.bench_module()
    code = vffi.VARIANTS[variant] if isinstance(getattr(vffi, "VARIANTS", None), dict) else 0
    try:
        res = ext.bench_verify_attention(batch, num_queries, heads, length, splits, code, scattered, 20)
    except TypeError:  # the older harness: (..., splits, row_groups, variant, scattered, iters)
        res = ext.bench_verify_attention(batch, num_queries, heads, length, splits,
                                         vffi.choose_row_groups(num_queries, heads), 0, scattered, 20)
    keys = ("device_us", "device_graph_us", "device_main_us", "device_merge_us")
    return {k: (float(v) if v >= 0 else None) for k, v in zip(keys, res)}


def loop_per_call(op, num_layers: int, args, iters: int, reps: int = 5) -> tuple:
    """(µs per call inside a jitted fori_loop of `iters` calls, compile s): each call on the layer that the previous
    call's lse picks, its whole output carried (so no call can be hoisted, merged or cut down). op None: the same
    loop without the call (its out carried through, its lse bumped by a tiny kernel): the loop's own cost."""
    q, kv_pool, kv_slots, kv_lens, tree_mask = args

    @jax.jit
    def run(q, kv_pool, kv_slots, kv_lens, tree_mask):
        batch, num_queries, heads, _ = q.shape
        out0, lse0 = (jax.ShapeDtypeStruct((batch, num_queries, heads, LATENT), q.dtype),
                      jax.ShapeDtypeStruct((batch, num_queries, heads), jnp.float32)) if op is None else \
            jax.eval_shape(op, q, kv_pool, jnp.int32(0), kv_slots, kv_lens, tree_mask)

        def body(i, carry):
            out, lse = carry
            layer = (i + (lse[0, 0, 0] > 1e30).astype(jnp.int32)) % num_layers
            if op is None:
                return out, lse + (layer < 0).astype(jnp.float32)
            return op(q, kv_pool, layer, kv_slots, kv_lens, tree_mask)

        init = (jnp.zeros(out0.shape, out0.dtype), jnp.zeros(lse0.shape, lse0.dtype))
        return jax.lax.fori_loop(0, iters, body, init)

    t0 = time.perf_counter()
    compiled = run.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    return median_wall(compiled, args, reps, 0.1) / iters * 1e6, compile_s


def loop_iters(device_us: float) -> int:
    """Calls in an in-loop program: about LOOP_TARGET_S of work, 8 to 64 calls."""
    return int(min(64, max(8, round(LOOP_TARGET_S * 1e6 / max(device_us, 1.0)))))


def row_key(batch, length, num_queries, heads, slots):
    return (int(batch), int(length), int(num_queries), int(heads), slots)


def row_variants(row) -> dict:
    """A row's per-variant figures; a row of an older run (one kernel, no `variants`) as its "auto" entry."""
    if "variants" in row:
        return row["variants"]
    return {"auto": {k: row.get(k) for k in ("us", "main_us", "merge_us", "wall_us", "num_splits")}}


def remaining_plan(plan, rows, variants=("auto",)):
    """The plan without what `rows` (an earlier run's) already have: a T stays where its row is missing, lacks one
    of `variants`, or where the plan asks for the XLA baseline and the row lacks it. Entries left with no T are
    dropped."""
    by_key = {row_key(r["B"], r["L"], r["T"], r.get("H", H), r["slots"]): r for r in rows}
    out = []
    for batch, length, scattered, ts, ref_ts, *rest in plan:
        heads = rest[0] if rest else H
        slots = "scattered" if scattered else "contiguous"
        olds = {t: by_key.get(row_key(batch, length, t, heads, slots)) for t in ts}
        left = [t for t in ts if olds[t] is None or (t in ref_ts and olds[t].get("xla_us") is None)
                or any(v not in row_variants(olds[t]) for v in variants)]
        if left:
            out.append((batch, length, scattered, left, ref_ts, *rest))
    return out


def sweep(ceilings, plan, on_row=lambda rows: None, rows=None, known_refs=None, tag="unknown", variants=("auto",),
          xla_chunk=XLA_CHUNK, deadline_s=0.0):
    """plan: list of (B, L, scattered, [T...], [T with the XLA baseline...][, H]); on_row(rows) after each row.
    rows: rows measured before (--resume): their kernel times are kept, and only a variant or a baseline the plan
    asks for and they lack is measured. known_refs: row key -> a row of an earlier run whose XLA baseline is taken
    instead of measured (--refs-from: the baseline does not change when the kernels do). tag: "commit, date" of
    this run, kept with each baseline it measures (`xla_from`), so that a table joined from several runs says where
    each one came from. variants: the kernel variants timed (the first is the row's headline `us`). deadline_s: no
    row starts after this many seconds of the run (0: none); the rows done are written."""
    rows = list(rows or [])
    by_key = {row_key(r["B"], r["L"], r["T"], r.get("H", H), r["slots"]): r for r in rows}
    known_refs = known_refs or {}
    pools = {}
    for batch, length, scattered, ts, ref_ts, *rest in remaining_plan(plan, rows, variants):
        heads = rest[0] if rest else H
        slots = "scattered" if scattered else "contiguous"
        if (batch, length) not in pools:
            pools.clear()  # one pool at a time on the device
            pools[(batch, length)] = make_pool(jax.random.PRNGKey(length), batch, length)
        kv_pool = pools[(batch, length)]
        num_layers = kv_pool.shape[0]
        for num_queries in ts:
            if deadline_s and time.perf_counter() - T_START > deadline_s:
                log(f"deadline ({deadline_s:.0f} s): B={batch} L={length} T={num_queries} H={heads} and later rows not run")
                return rows
            t_row = time.perf_counter()
            log(f"row B={batch} L={length} T={num_queries} H={heads} {slots}: start")
            args = make_inputs(jax.random.PRNGKey(length + num_queries), kv_pool, batch, num_queries, length,
                               scattered, heads)
            row = by_key.get(row_key(batch, length, num_queries, heads, slots))
            if row is None:
                row = dict(B=batch, L=length, T=num_queries, H=heads, slots=slots, xla_us=None, speedup=None)
                rows.append(row)
            elif row.get("xla_us") is None and num_queries in ref_ts:
                row["xla_filled_later"] = True  # a baseline added to a row of an earlier call
            if "variants" not in row and "us" in row:
                row["variants"] = row_variants(row)
            row.setdefault("variants", {})
            for variant in variants:
                if variant not in row["variants"]:
                    row["variants"][variant] = measure_variant(ceilings, args, batch, length, num_queries, heads,
                                                               slots, num_layers, variant)
            headline(row, ceilings, variants)
            if "empty_loop_us" not in row:
                try:
                    row["empty_loop_us"], _ = loop_per_call(None, num_layers, args, 64)
                except Exception as e:  # noqa: BLE001
                    log(f"  empty loop failed: {type(e).__name__}: {str(e)[:200]}")
            if num_queries in ref_ts and row.get("xla_us") is None:
                ref = xla_row(args, batch, num_queries, heads, length, num_layers,
                              known_refs.get(row_key(batch, length, num_queries, heads, slots)), xla_chunk,
                              row.get("us"))
                row.update(dict(xla_from=tag) | ref)  # a baseline taken from an earlier run keeps its origin
            speedups(row)
            row["elapsed_s"] = round(time.perf_counter() - T_START, 1)
            row["row_s"] = round(time.perf_counter() - t_row, 1)
            log(f"row B={batch} L={length} T={num_queries} H={heads} {slots}: done in {row['row_s']:.1f} s: "
                + summary(row))
            print(json.dumps(row), flush=True)
            on_row(rows)
            del args
    return rows


def summary(row) -> str:
    parts = [f"{v} {fmt(d.get('us'), '.1f')} µs (loop {fmt(d.get('loop_us'), '.1f')})"
             for v, d in row_variants(row).items()]
    if row.get("xla_kind"):
        parts.append(f"XLA dense {fmt(row.get('xla_dense_us'), '.1f')} / chunked {fmt(row.get('xla_chunked_us'), '.1f')} "
                     f"µs (loop {fmt(row.get('xla_loop_us'), '.1f')}), baseline {row['xla_kind']}, "
                     f"speed-up {fmt(row.get('speedup'), '.2f')}x")
    return "; ".join(parts)


def measure_variant(ceilings, args, batch, length, num_queries, heads, slots, num_layers, variant) -> dict:
    """One kernel variant on one row: device µs per call (k-call program), wall µs per call, in-loop µs per call,
    the main and merge kernels, compile times; {"error": ...} where the variant does not take the shape or fails."""
    kv_bytes = batch * length * ROW_BYTES
    flops = 2 * batch * num_queries * heads * length * (WIDTH + LATENT)
    roof = max(kv_bytes / (ceilings["copy_gbps"] * 1e9), flops / (ceilings["mma_sync_tflops"] * 1e12))
    # Fewer calls per program for the slow rows: the sweep must fit a few device calls.
    k = min(8 if roof < 2e-3 else 3, num_layers - 1)
    try:
        op = kernel_op(variant)
        jax.eval_shape(op, args[0], args[1], jnp.int32(0), *args[2:])  # a variant that rejects the shape: ValueError
        timed = device_per_call(unrolled(op, num_layers), args, k)
        iters = loop_iters(timed["us"])
        loop_us, loop_compile_s = loop_per_call(op, num_layers, args, iters)
    except Exception as e:  # noqa: BLE001 -- recorded, the sweep goes on
        log(f"  kernel {variant} failed: {type(e).__name__}: {str(e)[:300]}")
        return dict(error=f"{type(e).__name__}: {str(e)[:200]}")
    main_us, merge_us = split_main_merge(timed["kernels"])
    splits, block_rows = variant_splits(batch, num_queries, heads, length, variant)
    out = dict(us=timed["us"], main_us=main_us, merge_us=merge_us, wall_us=timed["wall_us"], loop_us=loop_us,
               loop_calls=iters, num_splits=splits, rows_per_block=block_rows, calls_per_program=k,
               kernels_per_call=timed["kernels_per_call"], compile_s=round(timed["compile_s"], 2),
               loop_compile_s=round(loop_compile_s, 2), roofline_frac=roof / (timed["us"] * 1e-6))
    log(f"  kernel {variant}: {out['us']:.1f} µs device, {out['wall_us']:.1f} wall, {loop_us:.1f} in-loop "
        f"(compile {out['compile_s']:.1f} + {out['loop_compile_s']:.1f} s)")
    if DEVICE_TIMING:
        out.update(device_timing(batch, num_queries, heads, length, slots == "scattered", splits, variant))
    return out


def headline(row, ceilings, variants) -> None:
    """The row's top-level kernel columns (us, GB/s, TFLOP/s, roofline, ...): those of the first variant asked for
    that ran (the JSON's older readers and --merge use them); `best_variant`: the fastest by device time."""
    ran = {v: d for v, d in row["variants"].items() if d.get("us")}
    if not ran:
        row.update(us=None, roofline_frac=None)
        return
    first = next((v for v in variants if v in ran), next(iter(ran)))
    d = ran[first]
    batch, length, num_queries, heads = row["B"], row["L"], row["T"], row.get("H", H)
    kv_bytes = batch * length * ROW_BYTES
    flops = 2 * batch * num_queries * heads * length * (WIDTH + LATENT)
    c = row.get("ceilings", ceilings)
    roof = max(kv_bytes / (c["copy_gbps"] * 1e9), flops / (c["mma_sync_tflops"] * 1e12))
    t = d["us"] * 1e-6
    row.update(variant=first, us=d["us"], main_us=d.get("main_us"), merge_us=d.get("merge_us"),
               wall_us=d.get("wall_us"), loop_us=d.get("loop_us"), num_splits=d.get("num_splits"),
               rows_per_block=d.get("rows_per_block"), gbps=kv_bytes / t / 1e9, tflops=flops / t / 1e12,
               roofline_us=roof * 1e6, roofline_frac=roof / t,
               bound="memory" if kv_bytes / (c["copy_gbps"] * 1e9) >= roof else "mma",
               best_variant=min(ran, key=lambda v: ran[v]["us"]))


def speedups(row) -> None:
    """Every variant's speed-up over the row's XLA baseline: device time over device time, in-loop over in-loop."""
    xla, xla_loop = row.get("xla_us"), row.get("xla_loop_us")
    for d in row_variants(row).values():
        if d.get("us"):
            d["speedup"] = xla / d["us"] if xla else None
            d["speedup_loop"] = xla_loop / d["loop_us"] if xla_loop and d.get("loop_us") else None
    row["speedup"] = xla / row["us"] if xla and row.get("us") else None
    row["speedup_loop"] = xla_loop / row["loop_us"] if xla_loop and row.get("loop_us") else None


def xla_row(args, batch, num_queries, heads, length, num_layers, known, chunk, kernel_us) -> dict:
    """The XLA baseline's columns of a row: both formulations (dense; chunked over L, `chunk` positions a step)
    timed like the kernel (device µs from the k-call program, wall µs, in-loop µs), the faster by device time is the
    baseline (`xla_kind`). Taken from `known` (a row of an earlier run) when it has them. A formulation that fails
    (e.g. out of memory) is recorded, not raised, so the sweep goes on."""
    if known is not None and known.get("xla_us") is not None:
        return {k: v for k, v in known.items() if k.startswith("xla_")} | dict(xla_from=known.get("xla_from",
                                                                                                 "earlier run"))
    big = batch * num_queries * heads * length > REF_FEW_CALLS_SCORES
    k = min(2 if big else 4, num_layers - 1)
    out = dict(xla_chunk=int(min(chunk, length)))
    for kind, c in (("dense", None), ("chunked", chunk)):
        try:
            timed = device_per_call(unrolled(xla_op(c), num_layers), args, k, reps=3)
            iters = loop_iters(timed["us"])
            loop_us, loop_compile_s = loop_per_call(xla_op(c), num_layers, args, iters)
        except Exception as e:  # noqa: BLE001 -- XLA raises its own runtime error type; the row keeps the message
            log(f"  XLA {kind} failed at B={batch} T={num_queries} H={heads} L={length}: {e}"[:400])
            out[f"xla_{kind}_error"] = str(e)[:200]
            continue
        out.update({f"xla_{kind}_us": timed["us"], f"xla_{kind}_wall_us": timed["wall_us"],
                    f"xla_{kind}_loop_us": loop_us, f"xla_{kind}_loop_calls": iters,
                    f"xla_{kind}_compile_s": round(timed["compile_s"], 2),
                    f"xla_{kind}_loop_compile_s": round(loop_compile_s, 2),
                    f"xla_{kind}_kernels_per_call": timed["kernels_per_call"]})
        log(f"  XLA {kind}: {timed['us']:.1f} µs device, {timed['wall_us']:.1f} wall, {loop_us:.1f} in-loop "
            f"(compile {timed['compile_s']:.1f} + {loop_compile_s:.1f} s)")
    kinds = [kd for kd in ("dense", "chunked") if out.get(f"xla_{kd}_us") is not None]
    if not kinds:
        return out | dict(xla_us=None, xla_kind=None, xla_error=out.get("xla_dense_error"))
    best = min(kinds, key=lambda kd: out[f"xla_{kd}_us"])
    return out | dict(xla_kind=best, xla_us=out[f"xla_{best}_us"], xla_wall_us=out[f"xla_{best}_wall_us"],
                      xla_loop_us=out[f"xla_{best}_loop_us"])


def full_plan():
    """The issue's sweep: every (B, L, slots, T) with the XLA reference (its compile and autotuning take ~20 s a
    shape on an H200, the contiguous row reuses the scattered row's program: run the kernels first with --no-ref,
    then the references with --resume, --shard over GPUs and calls). Ordered by what matters most (B = 1
    scattered first, then contiguous, then B = 8), so that a run cut short keeps the key rows."""
    plan = [(b, length, scattered, TS, TS)
            for b in BS for scattered in (True, False) for length in LS]
    # After B = 1 scattered: the 4-way tensor-parallel K2 shapes (H = 16 heads per device, T in {9, 33}).
    plan[len(LS):len(LS)] = [(1, length, True, [9, 33], [9, 33], 16) for length in (4096, 16384, 65536)]
    return plan


def shard_plan(plan, index: int, count: int):
    """The plan entries of shard `index` of `count` (--shard, one process per GPU): whole (B, L, H) groups, so
    a shape's scattered and contiguous rows share one compiled reference, dealt round robin (pass the remaining
    plan, so that only groups with work left are dealt)."""
    groups = sorted({(e[0], e[1], e[5] if len(e) > 5 else H) for e in plan})
    mine = set(groups[index::count])
    return [e for e in plan if (e[0], e[1], e[5] if len(e) > 5 else H) in mine]


def merged_from(paths):
    """Where a merged table's rows came from: each file's commit, date and shard."""
    out = []
    for path in paths:
        with open(path) as f:
            m = json.load(f)["meta"]
        for part in m.get("merged_from") or [{k: m.get(k) for k in ("commit", "date", "shard", "plan")}]:
            if part not in out:  # a merged file stands for its parts
                out.append(part)
    return out


def merge_results(paths):
    """--merge: one table from the JSON files of several shards or calls. A row measured in several keeps the
    latest measurement of the kernel, and a reference from whichever file has one."""
    merged, meta, ceilings, loop_rows = {}, None, None, []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        meta = meta or data["meta"]
        ceilings = ceilings or data["ceilings"]
        loop_rows = loop_rows or data.get("while_loop", [])
        for r in data["rows"]:
            r.setdefault("ceilings", data["ceilings"])
            key = row_key(r["B"], r["L"], r["T"], r.get("H", H), r["slots"])
            old = merged.get(key)
            if old is not None and r.get("xla_us") is None and old.get("xla_us") is not None:
                r = dict(r, **{k: v for k, v in old.items() if k.startswith("xla_")})
                speedups(r)
            merged[key] = r
    return meta, ceilings, list(merged.values()), loop_rows


def budget_plan():
    """What fits a few device minutes: B = 1 scattered over every (L, T); contiguous slots at T in {1, 16};
    B = 8 at two lengths; the XLA reference for T in {1, 16} (B = 1) and a few more."""
    plan = []
    for length in LS:
        plan.append((1, length, True, TS, [1, 16, 64] if length <= 65536 else [1, 16]))
        plan.append((1, length, False, [1, 16], []))
    for length in (16384, 65536):
        plan.append((8, length, True, [1, 16, 64], [1, 16]))
    return plan


def key_plan():
    """A one-minute check of the rows that matter most: B = 1 scattered at 4k and 64k over T in {1..64} (H = 8),
    and the 4-way tensor-parallel K2 shapes (H = 16, T in {9, 33}); no XLA reference, no while-loop figure."""
    plan = [(1, length, True, [1, 9, 16, 33, 64], []) for length in (4096, 65536)]
    plan += [(1, length, True, [9, 33], [], 16) for length in (4096, 16384, 65536)]
    return plan


def priority_plan():
    """The issue's sweep reordered for a device call that may be cut short (results are rewritten after every
    row): first the rows the targets name (4k T = 16, 64k T in {1, 16} scattered and contiguous), then
    L >= 16k over every T, the tensor-parallel H = 16 shapes, B = 8, and the rest.  The XLA reference runs
    where the issue gives its reference points (B = 1, scattered, T in {1, 16}, L in {4k, 16k, 64k, 128k})."""
    plan = [(1, 4096, True, [1, 16], [1, 16]), (1, 65536, True, [1, 9, 16, 33, 64], [1, 16]),
            (1, 65536, False, [1, 16], []), (1, 16384, True, TS, [1, 16]), (1, 131072, True, [1, 16, 64], [1, 16]),
            (1, 65536, True, [128, 257], []),
            (1, 4096, True, [9, 33, 64, 128, 257], [])]
    plan += [(1, length, True, [9, 33], [], 16) for length in (4096, 16384, 65536)]
    plan += [(8, 16384, True, [1, 16], []), (8, 16384, False, [1, 16], []), (1, 200000, True, TS, []),
             (1, 131072, True, [9, 33, 128, 257], []), (1, 16384, False, [1, 16, 64], []), (1, 4096, False, [1, 16], []),
             (8, 65536, True, [1, 16, 64], []), (8, 4096, True, [1, 16, 64], [])]
    return plan


def issue20_plan():
    """Issue 20's sweep against the fair XLA baseline, scattered slots only, every row with the baseline, ordered so
    that a run cut short keeps the rows that matter most: B = 1, H = 8 at 64k over T in {1, 9, 16, 33, 64}; H = 16
    at 64k (T in {1, 16, 64}); then 4k, 16k, 128k over the same T; T in {128, 257} at 64k; B = 8 at 64k."""
    ts = [1, 9, 16, 33, 64]
    plan = [(1, 65536, True, ts, ts), (1, 65536, True, [1, 16, 64], [1, 16, 64], 16)]
    plan += [(1, length, True, ts, ts) for length in (4096, 16384, 131072)]
    plan += [(1, 65536, True, [128, 257], [128, 257]), (8, 65536, True, [1, 16, 64], [1, 16, 64])]
    return plan


def decode_plan():
    """Every T = 1 row of the full sweep (B, L, slots; H = 8) with the XLA reference: the rows of the decode kernel,
    to rerun when only it changed (--refs-from keeps the references, --merge joins the table)."""
    return [(b, length, scattered, [1], [1]) for b in BS for scattered in (True, False) for length in LS]


def mini_plan():
    """Four rows (B = 1, scattered, L in {4k, 64k}, T in {1, 16}): an A/B of timing modes or builds."""
    return [(1, length, True, [1, 16], []) for length in (4096, 65536)]


def quick_plan():
    return [(b, length, scattered, [1, 16, 64], [1, 16] if scattered else [])
            for b in BS for length in LS[:3] for scattered in (False, True)]


def while_loop_figure(cases):
    """64 calls inside one jitted while loop (command buffers incl. WHILE on in this process) against the same
    call back to back in the unrolled program (device time). CUPTI does not see the kernels inside the loop's
    conditional graph node, so the op's cost per iteration is a wall-time slope (programs of 16 and 64
    iterations: fixed launch costs cancel) of the loop with the op minus that of the same loop without it."""
    out = []
    for batch, length, num_queries in cases:
        kv_pool = make_pool(jax.random.PRNGKey(length), batch, length)
        num_layers = kv_pool.shape[0]
        args = make_inputs(jax.random.PRNGKey(7), kv_pool, batch, num_queries, length, True)
        op = kernel_op()

        def make(k, with_op=True):
            @jax.jit
            def run(q, kv_pool, kv_slots, kv_lens, tree_mask):
                def body(i, acc):  # the next call's layer depends on the carry: nothing can be hoisted
                    layer = (i + (acc > 1e30).astype(jnp.int32)) % num_layers
                    if not with_op:
                        return acc + kv_lens[0].astype(jnp.float32) * layer.astype(jnp.float32)
                    o, lse = op(q, kv_pool, layer, kv_slots, kv_lens, tree_mask)
                    return acc + lse[0, 0, 0]
                return jax.lax.fori_loop(0, k, body, jnp.float32(0))
            return run

        with_op = wall_per_call(make, args, 16, 64, reps=7)
        empty = wall_per_call(lambda k: make(k, with_op=False), args, 16, 64, reps=7)
        single = device_per_call(unrolled(op, num_layers), args, min(8, num_layers - 1))
        in_loop = (with_op - empty) * 1e6
        out.append(dict(B=batch, L=length, T=num_queries, single_call_us=single["us"], loop_iteration_us=with_op * 1e6,
                        empty_loop_iteration_us=empty * 1e6, op_in_loop_us=in_loop, ratio=in_loop / single["us"]))
        print(json.dumps(out[-1]), flush=True)
    return out


def fmt(x, spec):
    return "–" if x is None else format(x, spec)


def kernel_name(row) -> str:
    """Which kernel a row's headline column ran: the variant name it was called with (and the query rows a block
    holds); rows of older runs carry the handler's row_groups and numeric variant instead."""
    variant = row.get("variant")
    if isinstance(variant, str):
        return variant + (f" ({row['rows_per_block']} rows a block)" if row.get("rows_per_block") else "")
    if row.get("row_groups") == 2:
        return {0: "two-group", 1: "wide", 2: "warp-specialised"}.get(variant, f"variant {variant}")
    return "decode (T·H <= 8)" if variant == 3 else "one-group (T·H <= 16)"


def kernel_counts(rows) -> dict:
    counts = {}
    for r in rows:
        counts[kernel_name(r)] = counts.get(kernel_name(r), 0) + 1
    return counts


def table_row(r, variants) -> str:
    """One line of the main table (rows of older runs, without `variants`, show their one kernel as "auto")."""
    per = row_variants(r)
    cells = []
    for v in variants:
        d = per.get(v) or {}
        cells += [fmt(d.get("us"), ".1f"), fmt(d.get("loop_us"), ".1f"), fmt(d.get("speedup"), ".2f"),
                  fmt(d.get("speedup_loop"), ".2f")]
    dense, chunked = fmt(r.get("xla_dense_us"), ".1f"), fmt(r.get("xla_chunked_us"), ".1f")
    if r.get("xla_kind") == "dense":
        dense = f"**{dense}**"
    elif r.get("xla_kind") == "chunked":
        chunked = f"**{chunked}**"
    elif r.get("xla_us") is not None:  # an older run's float32 reference
        dense = f"{r['xla_us']:.1f} †"
    ran = {v: d for v, d in per.items() if d.get("us")}
    best = min(ran, key=lambda v: ran[v]["us"]) if ran else None
    if best is not None:
        t = ran[best]["us"] * 1e-6
        flops = 2 * r["B"] * r["T"] * r.get("H", H) * r["L"] * (WIDTH + LATENT)
        kv_bytes = r["B"] * r["L"] * ROW_BYTES
        perf = [f"{100 * r['roofline_us'] * 1e-6 / t:.0f}%" if r.get("roofline_us") else "–",
                f"{flops / t / 1e12:.1f}", f"{kv_bytes / t / 1e9:.0f}"]
    else:
        perf = ["–", "–", "–"]
    return (f"| {r['B']} | {r['L']} | {r['T']} | {r.get('H', H)} | {r['slots']} | {fmt(r.get('num_splits'), 'd')} | "
            + " | ".join(cells) + f" | {dense} | {chunked} | {fmt(r.get('xla_loop_us'), '.1f')} | "
            f"{fmt(r.get('empty_loop_us'), '.1f')} | {best or '–'} | "
            + " | ".join(perf) + f" | {fmt(r.get('roofline_us'), '.1f')} | {r.get('bound', '–')} |")


def write_results(path, meta, ceilings, rows, loop_rows):
    with open(path + ".json.tmp", "w") as f:  # then renamed: a run killed by its time limit leaves a whole file
        json.dump(dict(meta=meta, ceilings=ceilings, rows=rows, while_loop=loop_rows), f, indent=1)
    os.replace(path + ".json.tmp", path + ".json")
    variants = meta.get("variants") or list(dict.fromkeys(v for r in rows for v in row_variants(r))) or ["auto"]
    lines = [f"# Verify-attention kernel on {meta['device']}", "",
             f"Date {meta['date']}, commit `{meta['commit']}`, jax {meta['jax']}, H = {H}, kv_lens = L, "
             f"split count automatic ({meta['sm_count']} SMs), plan `{meta['plan']}`, "
             f"timing: {meta.get('timing', 'plain launches')}. "
             + (f"Kernel variants: {', '.join(variants)}; XLA baseline chunk {meta['xla_chunk']} positions. "
                if meta.get("xla_chunk") else "")
             + "Generated by `benchmarks/verify_kernel.py`.", "",
             f"Ceilings measured in the same run: copy {ceilings['copy_gbps']:.0f} GB/s (read + write), "
             f"XLA bf16 dot {ceilings['xla_dot_tflops']:.0f} TFLOP/s, mma.sync m16n8k16 bf16 "
             f"{ceilings['mma_sync_tflops']:.0f} TFLOP/s." + (f" {meta['ceilings_note']}" if meta.get("ceilings_note") else ""), "",
             "Kernel µs: device time per call, first kernel start to last kernel end over k calls back to back in one "
             "XLA program (a CUDA graph), from a CUPTI profile; loop µs: wall time per call of n calls inside one jitted "
             "`fori_loop` (each on the layer the previous call's lse picks, whole outputs carried); empty loop µs: the "
             "same loop without the call, its own cost an iteration, which every loop µs includes. "
             "× XLA: the XLA baseline's time over the variant's (device over device; in-loop over in-loop). "
             "XLA baseline = kdtree_jax/ops/xla.py (bf16 gather from the pool, einsums with float32 accumulation, "
             "float32 softmax), dense over L and chunked over L (online softmax), both timed like the kernel; the faster "
             "by device time is the baseline (in bold); the float32-HIGHEST reference is never timed. "
             "Roofline = max(KV bytes / copy BW, FLOPs / mma.sync rate), FLOPs = 2·B·T·H·L·1088; "
             "% roofline, TFLOP/s, GB/s: of the fastest variant (device time). – where not measured, the reason in the JSON."
             + (" †: an XLA column taken from an older run's float32 reference (not the baseline)."
                if any(r.get("xla_us") is not None and not r.get("xla_kind") for r in rows) else ""), "",
             "Kernels (headline variant of each row): "
             + "; ".join(f"{k}: {n} rows" for k, n in sorted(kernel_counts(rows).items())) + ".", "",
             "| B | L | T | H | slots | splits | " + " | ".join(f"{v} µs | {v} loop µs | {v} × XLA | {v} × XLA loop"
                                                               for v in variants)
             + " | XLA dense µs | XLA chunked µs | XLA loop µs | empty loop µs | fastest | % roofline | TFLOP/s | GB/s | "
             "roofline µs | bound |",
             "|" + "---|" * (6 + 4 * len(variants) + 10)]
    if meta.get("resumed_from"):
        earlier = meta["resumed_from"]
        lines[4:4] = [f"Rows measured over several device calls (`--resume`): the earlier ones at {earlier['date']} "
                      f"(commit `{earlier['commit']}`), each row's ceilings in the JSON.", ""]
    if meta.get("merged_from"):
        parts = "; ".join(f"`{m['commit']}` at {m['date']}" + (f" (shard {m['shard']})" if m.get("shard") else "")
                          for m in meta["merged_from"])
        lines[4:4] = [f"Joined (`--merge`) from the results of several calls or GPUs: {parts}. A row keeps the latest "
                      "kernel measurement and the XLA baseline of whichever call measured it.", ""]
    origins = {}
    for r in rows:
        if r.get("xla_us") is not None and r.get("xla_from"):
            origins[r["xla_from"]] = origins.get(r["xla_from"], 0) + 1
    if origins:
        lines[4:4] = ["Where the XLA baseline columns were measured (`xla_from` in the JSON; `--refs-from` reuses an "
                      "earlier run's, since the baseline does not depend on the kernels): "
                      + "; ".join(f"{n} rows at {o}" for o, n in sorted(origins.items())) + ".", ""]
    # The table in a reading order (B, slots, H, L, T); the JSON keeps the order of measurement.
    rows = sorted(rows, key=lambda r: (r["B"], r["slots"] != "scattered", r.get("H", H), r["L"], r["T"]))
    for r in rows:
        lines.append(table_row(r, variants))
    timed_outside = [(r, v, d) for r in rows for v, d in row_variants(r).items() if "device_us" in d]
    timed_outside += [(r, r.get("variant", "auto"), r) for r in rows if "device_us" in r and "variants" not in r]
    if timed_outside:
        lines += ["", "## The same rows timed with CUDA events outside XLA (`--device-timing`, µs per call, 20 calls)", "",
                  "| B | L | T | H | slots | variant | XLA program, device µs | plain launches | CUDA graph | main kernel alone | merge alone |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r, v, d in timed_outside:
            lines.append(f"| {r['B']} | {r['L']} | {r['T']} | {r.get('H', H)} | {r['slots']} | {v} | {fmt(d.get('us'), '.1f')} | "
                         f"{fmt(d['device_us'], '.1f')} | {fmt(d['device_graph_us'], '.1f')} | "
                         f"{fmt(d['device_main_us'], '.1f')} | {fmt(d['device_merge_us'], '.1f')} |")
    if loop_rows:
        lines += ["", "## Inside a jitted while loop (64 calls, XLA command buffers incl. WHILE/CONDITIONAL)", "",
                  "Alone: the call's device time in the unrolled program. In the loop: wall time per iteration "
                  "(slope over 16 and 64 iterations) of the loop with the call and of the same loop without it; "
                  "the call in the loop is their difference (the profiler does not see kernels inside the loop's "
                  "conditional graph node).", "",
                  *([f"From a later call ({meta['while_loop_from']['commit']}, {meta['while_loop_from']['date']}): "
                     f"{meta['while_loop_from']['note']}.", ""] if meta.get("while_loop_from") else []),
                  "| B | L | T | alone µs | loop iteration µs | empty loop iteration µs | call in loop µs | ratio |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in loop_rows:
            if "op_in_loop_us" not in r:
                continue  # a figure of the older format (resumed rows)
            lines.append(f"| {r['B']} | {r['L']} | {r['T']} | {r['single_call_us']:.1f} | {r['loop_iteration_us']:.1f} | "
                         f"{r['empty_loop_iteration_us']:.1f} | {r['op_in_loop_us']:.1f} | {r['ratio']:.2f} |")
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", choices=["full", "priority", "budget", "quick", "key", "mini", "decode", "issue20"],
                        default="full",
                        help="full: the issue's whole sweep; priority: the same, the targets' rows first; "
                             "budget: B=1 over all (L, T) plus a few rows; quick, key, mini: a few rows on the GPU; "
                             "decode: every T = 1 row; issue20: 28 scattered rows, each against the XLA baseline "
                             "(about 8 device minutes)")
    parser.add_argument("--variants", default="auto",
                        help="comma list of kernel variants (kdtree_jax.ops.ffi.VARIANTS), each timed in its own "
                             "columns; the first is the row's headline")
    parser.add_argument("--xla-chunk", type=int, default=XLA_CHUNK,
                        help="positions a step of the chunked XLA baseline (the dense one is timed beside it)")
    parser.add_argument("--deadline-s", type=float, default=0,
                        help="start no row after this many seconds of the run (0: none); what was measured is written")
    parser.add_argument("--no-while-loop", action="store_true",
                        help="skip the command-buffer while-loop figure (a child process; every row has its in-loop "
                             "time anyway)")
    parser.add_argument("--commit", default=os.environ.get("KDTREE_COMMIT", "unknown"), help="commit recorded in the results (default: $KDTREE_COMMIT)")
    parser.add_argument("--out", default="benchmarks/results/verify_kernel_h200", help="results path without extension")
    parser.add_argument("--no-ref", action="store_true", help="skip the XLA baseline (its compiles dominate a sweep)")
    parser.add_argument("--command-buffers", action="store_true",
                        help="time with XLA command buffers on (the timed program replays as a CUDA graph, as inside "
                             "the engine's while loop): no host dispatch per call; default: plain launches")
    parser.add_argument("--device-timing", action="store_true",
                        help="also time each row's kernels with CUDA events outside XLA (plain launches, CUDA graph, "
                             "main kernel alone, merge alone)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows (and while-loop figure) already in OUT.json and measure only the missing "
                             "ones: a sweep longer than one device call runs in several")
    parser.add_argument("--smoke", action="store_true",
                        help="a check of the script itself on any backend (seconds on a CPU): two tiny rows through the "
                             "op (the FFI's CPU handler on a CPU), the XLA baseline on one (chunk 256), the while-loop "
                             "figure in-process; ceilings from a jitted copy and XLA's dot; OUT defaults to a new "
                             "temporary directory (never the repository)")
    parser.add_argument("--shard", metavar="I/N", help="measure only shard I of N of the plan's (B, L) groups (one process "
                        "per GPU: CUDA_VISIBLE_DEVICES=I); --merge joins the shards' tables")
    parser.add_argument("--refs-from", metavar="JSON", help="take the XLA baseline of a row from this earlier "
                        "result where it has one, instead of measuring it (the kernels changed, the baseline did not); "
                        "rows of runs that timed the float32 reference instead are not taken")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="measure nothing: write OUT from these results "
                        "(shards or calls), later files' kernel rows first, references from any")
    parser.add_argument("--while-loop-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.merge:
        meta, ceilings, rows, loop_rows = merge_results(args.merge)
        meta = {k: v for k, v in meta.items() if k != "shard"} | dict(merged_from=merged_from(args.merge))
        write_results(args.out, meta, ceilings, rows, loop_rows)
        print(f"{len(rows)} rows ({sum(r.get('xla_us') is not None for r in rows)} with the XLA baseline) -> {args.out}.json")
        return 0
    global DEVICE_TIMING, MAX_WARM_S
    DEVICE_TIMING = args.device_timing and not args.smoke
    MAX_WARM_S = 0.0 if args.smoke else float("inf")
    variants = check_variants(args.variants)
    if args.xla_chunk < 1:
        parser.error(f"--xla-chunk must be positive; got {args.xla_chunk}")
    if args.smoke:
        if args.out == parser.get_default("out"):  # a smoke run writes nothing into the repository
            args.out = os.path.join(tempfile.mkdtemp(prefix="verify_kernel_smoke_"), "verify_kernel_smoke")
            print(f"smoke run: results under {os.path.dirname(args.out)}", flush=True)
        if args.xla_chunk == XLA_CHUNK:
            args.xla_chunk = 256  # smaller than the smoke rows' L = 1000: the chunked path runs several steps
        if not vffi.available():
            sys.exit("the compiled extension is not built; `pip install -e .` builds it")
    elif not (vffi.available() and vffi.cuda_built()) or jax.default_backend() != "gpu":
        sys.exit("needs a GPU and the extension built with CUDA (--smoke runs anywhere)")
    loop_cases = [(1, 1000, 1)] if args.smoke else [(1, 4096, 1), (1, 65536, 16)]
    if args.while_loop_only:
        print("WHILE_LOOP_JSON " + json.dumps(while_loop_figure(loop_cases)))
        return 0

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    ext = vffi.bench_module()
    meta = dict(variants=variants, xla_chunk=args.xla_chunk, device=jax.devices()[0].device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="minutes"), commit=args.commit, jax=jax.__version__, sm_count=vffi.sm_count(),
        timing=("XLA command buffers incl. WHILE/CONDITIONAL" if args.command_buffers
                else "XLA's default flags (its command buffers make each timed program one CUDA graph)"))
    if args.smoke and jax.default_backend() != "gpu":
        ceilings = measure_cpu_ceilings()
        meta["ceilings_note"] = ("(A CPU smoke run: a jitted f32 copy, and XLA's f32 dot standing in for both rates; "
                                 "the times are of XLA:CPU thunks, not kernels.)")
    else:
        if ext is None:
            sys.exit("the benchmark target (kdtree_jax._kernel_bench: copy and mma.sync ceilings) is not built")
        ceilings = measure_ceilings(ext)
    print(json.dumps(ceilings), flush=True)
    loop_rows, old_rows = [], []
    if args.resume and os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            previous = json.load(f)
        old_rows, loop_rows = previous["rows"], previous.get("while_loop", [])
        meta["resumed_from"] = {k: previous["meta"].get(k) for k in ("date", "commit")}
        # Each row keeps the ceilings of the run that measured it: a row's roofline used those.
        for r in old_rows:
            r.setdefault("ceilings", previous["ceilings"])
        print(f"resuming: {len(old_rows)} rows from {args.out}.json ({previous['meta'].get('commit')})", flush=True)
    if args.plan in ("key", "mini"):
        plan = key_plan() if args.plan == "key" else mini_plan()
        sweep(ceilings, plan, on_row=lambda rows: write_results(args.out, dict(meta, plan=args.plan), ceilings, rows, []),
              variants=variants, xla_chunk=args.xla_chunk, deadline_s=args.deadline_s)
        print(open(args.out + ".md").read())
        return 0

    # The command-buffer figure runs in a child: XLA_FLAGS are read once, at backend start. It goes first
    # (it is short) and without preallocation, since this process already holds most of the memory.
    if not loop_rows and args.smoke and not args.no_while_loop:  # in-process: the smoke run checks the code path, not the flags
        loop_rows = while_loop_figure(loop_cases)
    if not loop_rows and not args.no_while_loop:
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFER_FLAGS).strip(),
                   XLA_PYTHON_CLIENT_PREALLOCATE="false")
        child = subprocess.run([sys.executable, __file__, "--while-loop-only"], env=env, capture_output=True, text=True)
        for line in child.stdout.splitlines():
            if line.startswith("WHILE_LOOP_JSON "):
                loop_rows = json.loads(line[len("WHILE_LOOP_JSON "):])
        if not loop_rows:
            print("while-loop figure failed:\n" + child.stdout[-2000:] + child.stderr[-4000:], flush=True)

    plan = {"full": full_plan, "priority": priority_plan, "budget": budget_plan, "quick": quick_plan,
            "decode": decode_plan, "issue20": issue20_plan, "smoke": smoke_plan}["smoke" if args.smoke else args.plan]()
    meta["plan"] = ("smoke" if args.smoke else args.plan) + (" (no XLA baseline)" if args.no_ref else "")
    if args.no_ref:
        plan = [(b, length, scattered, ts, [], *rest) for b, length, scattered, ts, _, *rest in plan]
    if args.shard:
        index, count = (int(x) for x in args.shard.split("/"))
        plan = shard_plan(remaining_plan(plan, old_rows, variants), index, count)
        meta["shard"] = args.shard
        old_rows = [r for r in old_rows if any((r["B"], r["L"], r.get("H", H)) == (e[0], e[1], e[5] if len(e) > 5 else H)
                                               for e in plan)]
    known_refs = {}
    if args.refs_from:
        with open(args.refs_from) as f:
            earlier = json.load(f)
        for r in earlier["rows"]:
            if r.get("xla_us") is not None and r.get("xla_kind"):  # the bf16 baseline, not the float32 oracle
                known_refs[row_key(r["B"], r["L"], r["T"], r.get("H", H), r["slots"])] = dict(
                    r, xla_from=r.get("xla_from", f"{earlier['meta'].get('commit')}, {earlier['meta'].get('date')}"))
    # Results are rewritten after every row, so a run cut short still leaves its table.
    rows = sweep(ceilings, plan, on_row=lambda rows: write_results(args.out, meta, ceilings, rows, loop_rows),
                 rows=old_rows, known_refs=known_refs, tag=f"{meta['commit']}, {meta['date']}", variants=variants,
                 xla_chunk=args.xla_chunk, deadline_s=args.deadline_s)
    write_results(args.out, meta, ceilings, rows, loop_rows)  # also when there was nothing left to measure
    print(open(args.out + ".md").read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
