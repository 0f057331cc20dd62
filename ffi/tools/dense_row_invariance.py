"""Which XLA flags and/or which row padding make a dense bfloat16 product's row independent of the row count M
(issue 24), and what each costs.

Why: greedy speculative decoding equals autoregressive decoding in bfloat16 only if a T-row verify pass rounds
every row exactly as the one-token step does. The attention and MoE CUDA ops already do; XLA's dense products
(jnp.dot / einsum / nnx.Linear) on the GPU do not: XLA picks cuBLAS, cuBLASLt or a Triton GEMM, split-K, tile
sizes or a GEMV from the shape, so row 0 of an M-row product can differ from the same row computed alone
(tests/test_greedy_equality.py, test_gpu_dense_product_row_is_independent_of_the_row_count, xfail).

Run on the GPU (one command, about 8-9 minutes by default; stops itself within --deadline-s):

    python3 ffi/tools/dense_row_invariance.py --out $OUT            # KDTREE_COMMIT=<sha> to stamp the report

(--settings NAME,... and --child-budget-s for a longer second look at a few settings; the console shows only the
summary, the .md in --out has every table, the .json also the compiled kernels per product.)

and on a CPU, end to end in a minute or two (the --xla_gpu_* flags are then meaningless):

    JAX_PLATFORMS=cpu python3 ffi/tools/dense_row_invariance.py --quick --out /tmp/dri

What it measures. XLA reads XLA_FLAGS once, when the backend starts, so the parent starts one child process per
flag setting (SETTINGS below) and collects its tagged JSON lines (one per finished task, so a child killed
midway keeps what it finished); a child that aborts (an unknown flag name makes
XLA abort), crashes or runs past --child-timeout-s is recorded with the tail of its stderr. Each child, for every
(K, N) and M in ROW_COUNTS, computes x[:M] @ w (x: one random bfloat16 [max M, K] matrix, so the first rows are the
same data at every M; w: bfloat16 [K, N]) with one of VARIANTS (the plain product and the padding schemes), in two
output dtypes: "f32" (preferred_element_type=float32) and "bf16" (bfloat16 in and out, as nnx.Linear computes it),
and compares each of the first min(M, 16) rows bit for bit with the same row computed alone (the variant at M = 1:
what the one-token step would compute). A cell is "=" when all of them are equal, else the largest absolute
difference. It also records the GEMM kernels in each compiled program (cuBLAS / cuBLASLt custom call, Triton GEMM
fusion with its split_k and block_m, while loops), so the report shows what XLA picked at each M and whether the
batched 16-row blocks stayed separate products, and it times each variant: a jitted lax.fori_loop of REPS products
whose input depends on the previous product, median of 5 runs after a warm-up, divided by REPS.

Work inside a child runs in priority order until the child's time budget is spent (what was skipped is listed), and
compiles run on a thread pool (XLA compiles outside the GIL): with autotuning on, a GPU compile of one product can
take a second.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

# Candidate XLA_FLAGS, one child process each: (name, flags). Edit here.
SETTINGS = [
    ("default", ""),
    ("no_triton", "--xla_gpu_enable_triton_gemm=false"),
    ("autotune0", "--xla_gpu_autotune_level=0"),
    ("no_triton+autotune0", "--xla_gpu_enable_triton_gemm=false --xla_gpu_autotune_level=0"),
    ("no_splitk_autotune", "--xla_gpu_enable_split_k_autotuning=false"),
    ("cublaslt", "--xla_gpu_enable_cublaslt=true"),
    ("no_triton+cublaslt", "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true"),
    ("deterministic", "--xla_gpu_deterministic_ops=true"),
    # Not in the list: every GEMM through Triton with one fixed tiling (no cuBLAS, no autotuned split-K),
    # so M changes only the grid; the value is an AutotuneResult.TritonGemmKey textproto (commas: XLA_FLAGS is
    # split at spaces).
    ("triton_fixed_cfg", "--xla_gpu_cublas_fallback=false --xla_gpu_triton_gemm_any=true "
     "--xla_gpu_override_gemm_autotuner=block_m:64,block_n:64,block_k:64,split_k:1,num_stages:3,num_warps:4,num_ctas:1"),
]

BRIEF_SHAPES = [(256, 8192), (256, 768), (768, 256), (1024, 1024), (7168, 2048)]  # (K, N)
TIMING_SHAPES = [(256, 8192), (7168, 2048)]
ROW_COUNTS = [1, 2, 8, 16, 17, 33, 64, 128, 256, 528]
TIMING_ROWS = [1, 17, 33, 256, 528]
COMPARED_ROWS = 16  # rows 0 .. min(M, 16) - 1 of every product are compared with the row alone
REPS = 50
# The embedded default pair's projections, used when the checkpoint's metadata cannot be read (same list).
FALLBACK_MODEL_SHAPES = [(256, 512), (256, 576), (512, 512), (256, 256), (256, 8), (256, 128)]
QUICK_SHAPES = [(256, 768), (768, 256)]
QUICK_ROWS = [1, 2, 17, 33, 64]
QUICK_TIMING_ROWS = [1, 17, 64]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULT_TAG = "DENSE_ROW_INVARIANCE_RESULT "


# ---------------------------------------------------------------------------------------------------- shapes
def model_shapes():
    """(K, N) of every dense product of the embedded default pair, from the checkpoints' array metadata (exact
    shapes, no model code needed): the 2-D kernels [in, out] and the router's [experts, hidden] weight transposed.
    The routed experts' 3-D weights go through the CUDA MoE op and are not XLA products."""
    found = []
    for part in ("target", "drafter"):
        path = os.path.join(ROOT, "checkpoints", "default", part, "params", "state", "_METADATA")
        try:
            tree = json.load(open(path))["tree_metadata"]
        except (OSError, ValueError, KeyError):
            return list(FALLBACK_MODEL_SHAPES), "fallback list (checkpoint metadata not readable)"
        for key, meta in tree.items():
            shape = (meta.get("value_metadata") or {}).get("write_shape") or []
            if len(shape) != 2 or "embed" in key:
                continue
            if "kernel" in key:
                found.append(tuple(shape))
            elif "'gate'" in key and "'weight'" in key:
                found.append((shape[1], shape[0]))
    return sorted(set(found)), "checkpoints/default/*/params/state/_METADATA"


# ---------------------------------------------------------------------------------------------------- child
def child_main(args):
    import concurrent.futures as cf

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    dtypes = {"f32": jnp.float32, "bf16": None}
    fixed_rows = max(args.rows)

    def product(x, w, pet):
        return jnp.dot(x, w, preferred_element_type=pet)

    def pad_rows(x, rows):
        return jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))

    def padded(rows_of):
        def f(x, w, pet):
            m = x.shape[0]
            return product(pad_rows(x, rows_of(m)), w, pet)[:m]
        return f

    def blocks16_map(x, w, pet, rows=16):
        # A loop of [16, K] products: XLA compiles one product for every block and cannot merge them.
        m = x.shape[0]
        nb = -(-m // rows)
        xb = pad_rows(x, nb * rows).reshape(nb, rows, -1)
        return lax.map(lambda b: product(b, w, pet), xb).reshape(nb * rows, -1)[:m]

    def blocks16_batched(x, w, pet, rows=16):
        # One batched dot_general over [M/16, 16, K] with the weight broadcast over the batch: fast if XLA keeps
        # it batched, but its simplifier may fold the broadcast and make it one [M, K] GEMM again (see kernels).
        m = x.shape[0]
        nb = -(-m // rows)
        xb = pad_rows(x, nb * rows).reshape(nb, rows, -1)
        wb = jnp.broadcast_to(w, (nb,) + w.shape)
        out = lax.dot_general(xb, wb, (((2,), (1,)), ((0,), (0,))), preferred_element_type=pet)
        return out.reshape(nb * rows, -1)[:m]

    def fixed_m_barrier(x, w, pet):
        # The barrier keeps the pad out of the GEMM fusion, so every M compiles the very same GEMM.
        m = x.shape[0]
        return product(lax.optimization_barrier(pad_rows(x, fixed_rows)), w, pet)[:m]

    variants = {
        "plain": lambda x, w, pet: product(x, w, pet),
        "pad64": padded(lambda m: max(64, -(-m // 64) * 64)),
        "pad_to_bucket": padded(lambda m: max(64, 1 << (m - 1).bit_length())),
        "blocks16_map": blocks16_map,
        "blocks16_batched": blocks16_batched,
        "fixed_m": padded(lambda m: fixed_rows),
        "fixed_m_barrier": fixed_m_barrier,
    }
    schemes = [v for v in variants if v != "plain"]

    def kernels(text):
        """The GEMMs in a compiled program, compactly: which library/emitter, how many, their split_k/block_m."""
        out = []
        found = {}
        for target in re.findall(r'custom_call_target="(__cublas[^"]*|__cudnn[^"]*)"', text):
            found[target.replace("__", "")] = found.get(target.replace("__", ""), 0) + 1
        for kind in re.findall(r'"kind":"(__triton[a-z_]*|kInput)"', text):
            name = "reduce_fusion" if kind == "kInput" else kind.replace("__", "")
            found[name] = found.get(name, 0) + 1
        found["dot"] = len(re.findall(r"\sdot\(", text))
        found["while"] = len(re.findall(r"\swhile\(", text))
        out += [f"{name}x{n}" for name, n in found.items() if n]
        shapes = set()
        for line in text.splitlines():
            if "__cublas" in line or "__triton" in line or "__cudnn" in line or re.search(r"\sdot\(", line):
                s = re.search(r"=\s*\(?\s*([a-z0-9]+\[[0-9,]*\])", line)
                if s:
                    shapes.add(s.group(1))
        if shapes:
            out.append("[" + " ".join(sorted(shapes)) + "]")
        for key in ("split_k", "block_m", "block_n", "block_k", "num_warps", "selected_algorithm"):
            vals = sorted(set(re.findall(rf'"{key}":"?(-?\d+)', text)), key=int)
            if vals:
                out.append(f"{key}={'/'.join(vals)}")
        return " ".join(out)

    data_cache = {}

    def data(k, n):
        if (k, n) not in data_cache:
            rng = np.random.default_rng(1000 * k + n)
            x = rng.standard_normal((max(args.rows + args.timing_rows), k), np.float32)
            w = rng.standard_normal((k, n), np.float32) * k ** -0.5
            data_cache[(k, n)] = (np.asarray(jnp.asarray(x, jnp.bfloat16)), jnp.asarray(w, jnp.bfloat16))
        return data_cache[(k, n)]

    pool = cf.ThreadPoolExecutor(max_workers=max(1, args.jobs))

    def compile_all(jobs):
        """{key: (compiled, kernel summary) or exception}; jobs: {key: (fn, example args)}."""
        def one(fn, example):
            c = jax.jit(fn).lower(*example).compile()
            return c, kernels(c.as_text())

        futs = {key: pool.submit(one, fn, ex) for key, (fn, ex) in jobs.items()}
        res = {}
        for key, fut in futs.items():
            try:
                res[key] = fut.result()
            except Exception as e:  # one bad program must not lose the rest of the child's results
                res[key] = e
        return res

    def bits(a):
        return np.asarray(np.asarray(a).astype(np.float32)).view(np.uint32)

    def invariance(variant, dt, k, n):
        xs, w = data(k, n)
        pet = dtypes[dt]
        fn = lambda x, w_, f=variants[variant], p=pet: f(x, w_, p)  # noqa: E731
        shape = lambda m: jax.ShapeDtypeStruct((m, k), jnp.bfloat16)  # noqa: E731
        wshape = jax.ShapeDtypeStruct(w.shape, w.dtype)
        jobs = {m: (fn, (shape(m), wshape)) for m in sorted(set(args.rows) | {1})}
        comp = compile_all(jobs)
        rec = {"variant": variant, "dtype": dt, "K": k, "N": n, "by_m": {}}
        if isinstance(comp[1], Exception):
            rec["error"] = f"M=1: {type(comp[1]).__name__}: {str(comp[1])[:300]}"
            return rec
        alone_fn, rec["kernels_m1"] = comp[1]
        alone = [np.asarray(alone_fn(jnp.asarray(xs[i:i + 1]), w))[0] for i in range(min(COMPARED_ROWS, max(args.rows)))]
        for m in args.rows:
            if isinstance(comp[m], Exception):
                rec["by_m"][m] = {"error": f"{type(comp[m]).__name__}: {str(comp[m])[:300]}"}
                continue
            f, kern = comp[m]
            got = np.asarray(f(jnp.asarray(xs[:m]), w))
            rows = range(min(m, COMPARED_ROWS))
            differ = [i for i in rows if not np.array_equal(bits(got[i]), bits(alone[i]))]
            diff = max(float(np.max(np.abs(got[i].astype(np.float32) - alone[i].astype(np.float32)))) for i in rows)
            rec["by_m"][m] = {"equal": not differ, "max_abs": diff, "rows_differing": differ, "kernels": kern}
        return rec

    def timing(k, n, dt):
        xs, w = data(k, n)
        pet = dtypes[dt]

        def looped(f):
            def run(x, w_):
                def body(_, y):
                    # The input depends on the previous product, so XLA can neither hoist the product out of the
                    # loop nor run the iterations concurrently; (y * 0) is not folded for floats.
                    return f(x + (y[0, 0] * 0).astype(x.dtype), w_, pet)
                y0 = jnp.zeros((x.shape[0], w_.shape[1]), pet or x.dtype)
                return lax.fori_loop(0, REPS, body, y0)
            return run

        jobs = {(v, m): (looped(variants[v]), (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                                               jax.ShapeDtypeStruct(w.shape, w.dtype)))
                for v in variants for m in args.timing_rows}
        comp = compile_all(jobs)
        recs = []
        for (v, m), c in comp.items():
            rec = {"variant": v, "dtype": dt, "K": k, "N": n, "M": m}
            if isinstance(c, Exception):
                rec["error"] = f"{type(c).__name__}: {str(c)[:300]}"
            else:
                f, rec["kernels"] = c
                x = jnp.asarray(xs[:m])
                jax.block_until_ready(f(x, w))
                reps = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(x, w))
                    reps.append((time.perf_counter() - t0) / REPS * 1e6)
                rec["us"] = float(np.median(reps))
                rec["us_runs"] = [round(r, 2) for r in reps]
            recs.append(rec)
        return recs

    # Priority order: the plain product first (is any flag setting enough by itself?), then the schemes on a
    # timed shape and their cost, shape by shape, then everything else.
    shapes, model = args.shapes, [s for s in args.model_shapes if s not in args.shapes]
    tasks = [("inv", "plain", dt, s) for dt in ("f32", "bf16") for s in shapes]
    for s in args.timing_shapes:
        tasks += [("inv", v, "f32", s) for v in schemes] + [("time", None, args.timing_dtype, s)]
    tasks += [("inv", "plain", dt, s) for dt in ("f32", "bf16") for s in model]
    tasks += [("inv", v, "f32", s) for s in shapes + model if s not in args.timing_shapes for v in schemes]
    tasks += [("inv", v, "bf16", s) for s in shapes + model for v in schemes]

    def emit(kind, payload):
        # One tagged JSON line per finished task, so a child that crashes or is killed later keeps what it did.
        sys.stdout.write(RESULT_TAG + json.dumps({"kind": kind, "data": payload}) + "\n")
        sys.stdout.flush()

    dev = jax.devices()[0]
    emit("meta", {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform, "jax": jax.__version__,
                  "xla_flags": os.environ.get("XLA_FLAGS", ""), "budget_s": args.budget_s,
                  "start_s": round(time.perf_counter() - t_start, 1)})
    skipped = []
    for kind, variant, dt, (k, n) in tasks:
        if time.perf_counter() > deadline:
            skipped.append(f"{kind} {variant or 'all'} {dt} {k}x{n}")
            continue
        t0 = time.perf_counter()
        try:
            if kind == "inv":
                rec = invariance(variant, dt, k, n)
                rec["seconds"] = round(time.perf_counter() - t0, 2)
                emit("invariance", rec)
            else:
                emit("timing", timing(k, n, dt))
        except Exception as e:
            err = {"variant": variant, "dtype": dt, "K": k, "N": n, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            emit("invariance", err) if kind == "inv" else emit("timing", [err])
        print(f"[child] {kind} {variant or 'all'} {dt} {k}x{n}: {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
    emit("end", {"skipped": skipped, "seconds": round(time.perf_counter() - t_start, 1)})
    pool.shutdown(wait=False)


# ---------------------------------------------------------------------------------------------------- parent
def run_child(args, name, flags, budget_s):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip() if args.keep_env_flags else flags
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the products are small; start faster
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--budget-s", f"{budget_s:.0f}",
           "--jobs", str(args.jobs), "--timing-dtype", args.timing_dtype,
           "--shapes-list", json.dumps(args.shapes), "--model-shapes-list", json.dumps(args.model_shapes),
           "--timing-shapes-list", json.dumps(args.timing_shapes),
           "--rows", ",".join(map(str, args.rows)), "--timing-rows", ",".join(map(str, args.timing_rows))]
    # The child stops starting work at its budget; past that, only a task in flight or a hang keeps it alive.
    timeout_s = min(args.child_timeout_s, budget_s + 150)
    t0 = time.perf_counter()
    rec = {"name": name, "flags": env["XLA_FLAGS"]}
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        out, err, rc = text(e.stdout), text(e.stderr), None
        rec["status"] = f"timeout after {timeout_s:.0f} s"
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    rec["returncode"] = rc
    rec.update(invariance=[], timing=[])
    ended = False
    for line in out.splitlines():
        if not line.startswith(RESULT_TAG):
            continue
        try:
            msg = json.loads(line[len(RESULT_TAG):])
        except ValueError:  # a line cut by the kill
            continue
        if msg["kind"] == "meta":
            rec.update(msg["data"])
        elif msg["kind"] == "invariance":
            rec["invariance"].append(msg["data"])
        elif msg["kind"] == "timing":
            rec["timing"] += msg["data"]
        elif msg["kind"] == "end":
            rec.update(child_seconds=msg["data"]["seconds"], skipped=msg["data"]["skipped"])
            ended = True
    if "status" not in rec:
        rec["status"] = "ok" if rc == 0 and ended else f"failed (exit {rc})"
    if rc != 0 or not ended:
        rec["status"] += f", {len(rec['invariance'])} invariance + {len(rec['timing'])} timing records kept"
        rec["stderr_tail"] = "\n".join(err.splitlines()[-15:])
    return rec


def cell(r):
    if r is None:
        return ""
    if "error" in r:
        return "err"
    return "=" if r["equal"] else f"{r['max_abs']:.2g}"


def markdown(report, brief=False):
    """The report; brief: what the console shows (the run tool keeps only the tail): summary, statuses, the
    first setting's timing."""
    lines = [f"# Dense product row invariance: {report['device']}, jax {report['jax']}, {report['date']}"
             + (f", commit {report['commit']}" if report.get("commit") else ""), "",
             "Cell: `=` when rows 0 .. min(M, 16) - 1 of the M-row product equal, bit for bit, the same rows computed "
             "alone (the variant at M = 1); else the largest absolute difference. Empty: not run (budget).", ""]
    settings = report["settings"]
    # One glance: for each setting and variant/dtype, how many (shape, M) products were invariant.
    combos = sorted({(r["variant"], r["dtype"]) for s in settings for r in s.get("invariance", [])},
                    key=lambda c: (c[0] != "plain", c[0], c[1]))
    if combos:
        lines += ["## Summary: invariant (shape, M) products / products run", "",
                  "| setting | status | " + " | ".join(f"{v} {d}" for v, d in combos) + " |",
                  "|---|---|" + "---|" * len(combos)]
        for s in settings:
            cells = []
            for v, d in combos:
                rs = [m for r in s.get("invariance", []) if (r["variant"], r["dtype"]) == (v, d)
                      for m in r.get("by_m", {}).values() if "equal" in m]
                cells.append(f"{sum(m['equal'] for m in rs)}/{len(rs)}" if rs else "")
            lines.append(f"| {s['name']} | {s['status']} | " + " | ".join(cells) + " |")
        lines.append("")
    for s in settings:
        lines += [f"## {s['name']}: `XLA_FLAGS={s['flags']}`", "",
                  f"status: {s['status']}, {s['seconds']} s" + (f", device {s['device']}" if s.get("device") else "")]
        if s.get("stderr_tail"):
            lines += ["", "```", s["stderr_tail"], "```"]
        if s.get("skipped"):
            lines += ["", f"skipped (budget): {len(s['skipped'])} tasks, first: {s['skipped'][0]}"]
        inv = [] if brief else s.get("invariance", [])
        rows = sorted({m for r in inv for m in r.get("by_m", {})}, key=int)
        for v, d in combos:
            recs = [r for r in inv if (r["variant"], r["dtype"]) == (v, d)]
            if not recs:
                continue
            lines += ["", f"### {v}, {d}", "", "| K x N | " + " | ".join(f"M={m}" for m in rows) + " |",
                      "|---|" + "---|" * len(rows)]
            for r in recs:
                if "error" in r:
                    lines.append(f"| {r['K']}x{r['N']} | error: {r['error'][:120]} |")
                else:
                    lines.append(f"| {r['K']}x{r['N']} | " + " | ".join(cell(r["by_m"].get(m)) for m in rows) + " |")
        tim = [t for t in s.get("timing", []) if "us" in t or "error" in t]
        if brief and s is not next((x for x in settings if x.get("timing")), None):
            tim = []
        if tim:
            trows = sorted({t["M"] for t in tim})
            lines += ["", f"### time per product (µs), {tim[0]['dtype']}", "",
                      "| variant | K x N | " + " | ".join(f"M={m}" for m in trows) + " |", "|---|---|" + "---|" * len(trows)]
            keys = []
            for t in tim:
                if (t["variant"], t["K"], t["N"]) not in keys:
                    keys.append((t["variant"], t["K"], t["N"]))
            for v, k, n in sorted(keys, key=lambda c: (c[1], c[2])):
                by = {t["M"]: t for t in tim if (t["variant"], t["K"], t["N"]) == (v, k, n)}
                lines.append(f"| {v} | {k}x{n} | " + " | ".join(
                    (f"{by[m]['us']:.1f}" if "us" in by[m] else "err") if m in by else "" for m in trows) + " |")
        lines.append("")
    lines += ["Kernels XLA compiled for each product (cuBLAS/cuBLASLt custom calls, Triton GEMM fusions with split_k /"
              " block_m, while loops) are in the JSON, `settings[].invariance[].by_m[M].kernels`.", ""]
    return "\n".join(lines)


def parse_shapes(text):
    return [tuple(map(int, p.split("x"))) for p in text.split(",") if p]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for dense_row_invariance_<device>.json and .md")
    ap.add_argument("--quick", action="store_true", help="a CPU smoke run: 2 small shapes, 5 row counts, 2 settings")
    ap.add_argument("--shapes", default="default", help="'default' (the issue's shapes, then the default pair's "
                    "projections), 'small' (= --quick's), or KxN,KxN,...")
    ap.add_argument("--no-model-shapes", action="store_true", help="skip the default pair's projection shapes")
    ap.add_argument("--rows", default=None, help="row counts M, comma separated (default: %s)" % ROW_COUNTS)
    ap.add_argument("--timing-rows", default=None, help="M for the timing (default: %s)" % TIMING_ROWS)
    ap.add_argument("--timing-shapes", default=None, help="KxN,... to time (default: 256x8192,7168x2048)")
    ap.add_argument("--timing-dtype", default="f32", choices=("f32", "bf16"))
    ap.add_argument("--settings", default=None, help="names from SETTINGS to run, comma separated (default: all)")
    ap.add_argument("--deadline-s", type=float, default=520, help="whole run; children's budgets shrink to fit")
    ap.add_argument("--child-budget-s", type=float, default=60, help="work budget of one child (then it reports)")
    ap.add_argument("--child-timeout-s", type=float, default=240, help="kill a child after this")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="concurrent compiles in a child")
    ap.add_argument("--keep-env-flags", action="store_true", help="prepend the caller's XLA_FLAGS to each setting")
    # Internal: the child's side.
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=60, help=argparse.SUPPRESS)
    ap.add_argument("--shapes-list", help=argparse.SUPPRESS)
    ap.add_argument("--model-shapes-list", help=argparse.SUPPRESS)
    ap.add_argument("--timing-shapes-list", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        args.shapes = [tuple(s) for s in json.loads(args.shapes_list)]
        args.model_shapes = [tuple(s) for s in json.loads(args.model_shapes_list)]
        args.timing_shapes = [tuple(s) for s in json.loads(args.timing_shapes_list)]
        args.rows = [int(m) for m in args.rows.split(",")]
        args.timing_rows = [int(m) for m in args.timing_rows.split(",")]
        return child_main(args)

    if not args.out:
        ap.error("--out is required")
    quick = args.quick or args.shapes == "small"
    args.rows = [int(m) for m in args.rows.split(",")] if args.rows else (QUICK_ROWS if quick else ROW_COUNTS)
    args.timing_rows = ([int(m) for m in args.timing_rows.split(",")] if args.timing_rows
                        else (QUICK_TIMING_ROWS if quick else TIMING_ROWS))
    args.shapes = QUICK_SHAPES if quick else (BRIEF_SHAPES if args.shapes == "default" else parse_shapes(args.shapes))
    model_source = None
    if quick or args.no_model_shapes:
        args.model_shapes = []
    else:
        args.model_shapes, model_source = model_shapes()
    args.timing_shapes = (parse_shapes(args.timing_shapes) if args.timing_shapes
                          else (QUICK_SHAPES[:1] if quick else TIMING_SHAPES))
    settings = SETTINGS
    if args.settings:
        names = args.settings.split(",")
        unknown = set(names) - {n for n, _ in SETTINGS}
        if unknown:
            ap.error(f"unknown settings {sorted(unknown)}; known: {[n for n, _ in SETTINGS]}")
        settings = [s for s in SETTINGS if s[0] in names]
    elif args.quick:
        # The default, one real flag, and a made-up flag name (to see the failure path work).
        settings = [SETTINGS[0], SETTINGS[1], ("bogus_flag", "--xla_this_flag_does_not_exist=true")]

    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    try:
        from importlib.metadata import version  # not `import jax`: the parent must not start a backend
        jax_version = version("jax")
    except Exception:
        jax_version = "?"
    report = {"jax": jax_version, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "commit": os.environ.get("KDTREE_COMMIT", ""), "device": "?", "host_python": sys.version.split()[0],
              "argv": sys.argv[1:], "shapes": args.shapes, "model_shapes": args.model_shapes,
              "model_shapes_source": model_source, "rows": args.rows, "timing_rows": args.timing_rows,
              "timing_shapes": args.timing_shapes, "reps": REPS, "settings": []}
    startup_s = 20  # a child's jax import and backend start, on top of its work budget
    for i, (name, flags) in enumerate(settings):
        left = args.deadline_s - (time.perf_counter() - t0)
        budget = min(args.child_budget_s, left / (len(settings) - i) - startup_s)
        if budget < 5:
            report["settings"].append({"name": name, "flags": flags, "status": "not run (deadline)", "seconds": 0})
            continue
        print(f"[{time.perf_counter() - t0:6.1f} s] {name}: XLA_FLAGS='{flags}', budget {budget:.0f} s", flush=True)
        rec = run_child(args, name, flags, budget)
        print(f"[{time.perf_counter() - t0:6.1f} s] {name}: {rec['status']} in {rec['seconds']} s", flush=True)
        if report["device"] == "?" and rec.get("device"):
            report["device"] = rec["device"]
        report["settings"].append(rec)
        write(args.out, report)  # after every child: a run cut short still leaves its results
    report["seconds"] = round(time.perf_counter() - t0, 1)
    write(args.out, report)
    print(markdown(report, brief=True))


def write(out, report):
    tag = re.sub(r"[^a-z0-9]+", "_", report["device"].lower()).strip("_") or "unknown"
    for old in os.listdir(out):  # the device becomes known only after the first child; drop the "?" file
        if old.startswith("dense_row_invariance_unknown."):
            os.remove(os.path.join(out, old))
    path = os.path.join(out, f"dense_row_invariance_{tag}")
    with open(path + ".json", "w") as f:
        json.dump(report, f, indent=1)
    md = markdown(report)
    with open(path + ".md", "w") as f:
        f.write(md)
    return md


if __name__ == "__main__":
    main()
