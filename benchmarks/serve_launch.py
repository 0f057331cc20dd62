"""The host time of a chunk's launch (`scheduler.Bucket.launch`), split into its parts (issue 45, item 3).

    python benchmarks/serve_launch.py                          # the embedded pair, float32, --max-batch 16
    python benchmarks/serve_launch.py --kinds ar --chunks 40   # only the server's CPU program, fewer chunks

On an H100 a 16-row chunk of 4 steps takes 1.9 ms and its launch 1.2-1.3 ms of the decode thread's time
(serve_host_h100_2e5f396_engine_ab.md). The Python and JAX part of that host time is the same on any backend and is
measured here on whatever JAX runs on (the runtime's own part of a program's call is the backend's). A warmed-up
scheduler (not started: this thread is its decode thread) with --live rows holding greedy requests; per chunk the host
time of `launch()` with the device idle before it (the chunk is waited for and read after the clock stops), and the
time inside it of: the chunk program's call (its Python, the arguments' flattening, the C++ dispatch and the runtime's
enqueue), the host view's (`scheduler.host_view`), the retired rows' reset, the rest (the pick of a program, an
adaptive loop's chain of calls). Also the leaves of the program's arguments and,
from a few more launches under cProfile, the eager (op-by-op) calls a launch makes (jax.numpy / lax functions, array
indexing and operators, device_put; a numpy argument's copy inside a program's call is not one of them).

Kinds: `ar`, what the server runs on a CPU (its cost model refuses every budget: the autoregressive program, its row
programs); `adaptive`, what it runs on a GPU (budget "auto" with given costs, so nothing is measured; the adaptive row
programs); `fixed`, a fixed DDTree budget (8). Prints a table; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PARTS = ("program", "host_view", "reset_rows")
PROFILED = 10  # launches profiled after the timed ones


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="default: the embedded pair")
    p.add_argument("--max-batch", type=int, default=16, help="the bucket's batch rows, as the server's (default 16)")
    p.add_argument("--max-len", type=int, default=256, help="pool positions per row, as the server's (default 256)")
    p.add_argument("--chunks", type=int, default=60, help="launches timed per kind (default 60)")
    p.add_argument("--kinds", default="ar,adaptive,fixed", help="comma-separated: ar, adaptive, fixed")
    p.add_argument("--live", default="16,1",
                   help="comma-separated live rows (greedy requests; at most --max-batch) to launch with; 1: a lone "
                        "stream's chunk (default 16,1)")
    p.add_argument("--rounds", type=int, default=1, help="the kinds measured this many times, interleaved")
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions of each kind's launches")
    p.add_argument("--json", default=None, help="write the numbers here")
    return p


class _Timed:
    """A callable's wall time added to `acc[part]` (attributes go to the wrapped object)."""

    def __init__(self, inner, acc: dict, part: str):
        self._inner, self._acc, self._part = inner, acc, part

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._acc[self._part] += time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _settings(kind: str, args, sched):
    base = dict(max_batch=args.max_batch, max_len=args.max_len, warmup_prompt_tokens=16, max_queue=1000)
    if kind == "ar":
        return sched.Settings(budget=0, **base)
    if kind == "fixed":
        return sched.Settings(budget=8, **base)
    menu = (0, 8)  # two programs per row count (the host's work per launch does not grow with the menu)
    costs = dict(cost_ar=1.0, cost_draft=0.0, cost_verify=[1.0, 1.05])  # drafting about an AR step: it drafts
    return sched.Settings(budget="auto", menu=menu, costs=costs, adaptive_row_programs=True, **base)


def _eager_calls(stats: pstats.Stats) -> dict:
    """Calls in a profile that dispatch op by op or copy to the device: jax.numpy / lax functions, array indexing and
    operators, device_put, numpy arrays turned into device arrays."""
    out = {"jnp/lax": 0, "array ops": 0, "device_put": 0}
    for (path, _, name), (_, ncalls, *_rest) in stats.stats.items():
        if "jax/_src/numpy/" in path or "jax/_src/lax/" in path:
            out["jnp/lax"] += ncalls
        elif path.endswith("jax/_src/array.py") and name.startswith("__") and name not in ("__init__", "__int__"):
            out["array ops"] += ncalls
        elif name in ("device_put", "_device_put_impl"):
            out["device_put"] += ncalls
    return out


def measure(bucket, s, args, prompt, sched, jax, live: int) -> dict:
    """Launch `args.chunks` chunks of `live` rows holding requests, each timed with the device idle before it; then
    PROFILED more under cProfile for the eager calls (and with --profile, its top functions)."""
    import numpy as np

    bucket.inflight.clear()
    bucket.retired = [r for r, req in enumerate(bucket.owner) if req is not None]
    bucket.owner = [None] * args.max_batch
    bucket.reset_retired()
    bucket.admit([sched.Request(prompt=prompt, max_tokens=s.max_tokens_for(len(prompt)), emit=lambda *a: None)
                  for _ in range(live)])
    bucket.firsts = []
    jax.block_until_ready(bucket.state)

    acc = {p: 0.0 for p in PARTS}
    orig = {"host_view": sched.host_view, "programs": bucket.programs, "loop": bucket.loop}
    sched.host_view = _Timed(orig["host_view"], acc, "host_view")
    bucket.reset_retired = _Timed(bucket.reset_retired, acc, "reset_rows")
    if bucket.programs is not None:
        bucket.programs = _Timed(orig["programs"], acc, "program")
    else:
        bucket.loop = _Timed(orig["loop"], acc, "program")
    launches = []
    prof = cProfile.Profile()
    try:
        for i in range(args.chunks + 3 + PROFILED):  # the first 3: each program's first calls after the fill
            if i == 3:
                acc.update({p: 0.0 for p in PARTS})
            profiled = i >= args.chunks + 3
            jax.block_until_ready(bucket.state)
            if profiled:
                prof.enable()
            t = time.perf_counter()
            bucket.launch()
            dt = time.perf_counter() - t
            if profiled:
                prof.disable()
            elif i >= 3:
                launches.append(dt)
            if i == args.chunks + 2:
                timed = dict(acc)
            jax.block_until_ready(bucket.inflight[-1][0])
            bucket.collect()
    finally:
        sched.host_view = orig["host_view"]
        del bucket.reset_retired
        bucket.programs, bucket.loop = orig["programs"], orig["loop"]
    n = len(launches)
    out = {"launch_median_ms": 1e3 * float(np.median(launches)), "launch_mean_ms": 1e3 * float(np.mean(launches)),
           "launch_min_ms": 1e3 * float(np.min(launches)), "chunks": n,
           **{f"{p}_mean_ms": 1e3 * timed[p] / n for p in PARTS}}
    out["rest_mean_ms"] = out["launch_mean_ms"] - sum(out[f"{p}_mean_ms"] for p in PARTS)
    stats = pstats.Stats(prof)
    out["eager_per_launch"] = {k: v / PROFILED for k, v in _eager_calls(stats).items()}
    if args.profile:
        text = io.StringIO()
        stats.stream = text
        stats.sort_stats("tottime").print_stats(18)
        out["profile"] = text.getvalue()
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from kdtree_jax import runtime

    runtime.configure()
    import jax

    from kdtree_jax import provenance
    from kdtree_jax.generate import DEFAULT_CHECKPOINT, load_models
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics

    target, drafter, tokenizer, _, recommended = load_models(args.checkpoint or DEFAULT_CHECKPOINT, "float32")
    prompt = tokenizer.encode("def fibonacci(n):")
    kinds = args.kinds.split(",")
    built = {}
    for kind in kinds:
        t = time.perf_counter()
        s = sched.Scheduler(target, drafter, _settings(kind, args, sched), Metrics())
        if not s.warmup():
            raise SystemExit("serve_launch: the warm-up stopped")
        b = s.bucket
        built[kind] = (s, b)
        leaves = {"models": len(b.loop.leaves), "loop_weights": len(jax.tree.leaves(b.loop.loop_weights)),
                  "state": len(jax.tree.leaves(b.state))}
        print(f"[{kind}: warm-up {time.perf_counter() - t:.1f} s; the program's argument leaves {leaves}]",
              file=sys.stderr, flush=True)
    result = {"meta": {"commit": provenance.git_commit(), "device": jax.devices()[0].platform,
                       "command": "python benchmarks/serve_launch.py " + " ".join(argv if argv is not None
                                                                                   else sys.argv[1:]),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
              "rounds": []}
    lives = [int(n) for n in args.live.split(",")]
    for r in range(args.rounds):
        row = {}
        for kind in kinds:
            for live in lives:
                s, b = built[kind]
                row[f"{kind}_{live}"] = m = measure(b, s, args, prompt, sched, jax, live)
                print(f"round {r} {kind} {live} rows: launch median {m['launch_median_ms']:.3f} ms "
                      f"(mean {m['launch_mean_ms']:.3f}, min {m['launch_min_ms']:.3f}): program "
                      f"{m['program_mean_ms']:.3f}, host_view {m['host_view_mean_ms']:.3f}, reset_rows "
                      f"{m['reset_rows_mean_ms']:.3f}, rest {m['rest_mean_ms']:.3f} (means); eager calls a launch "
                      f"{m['eager_per_launch']}", flush=True)
                if "profile" in m:
                    print(m.pop("profile"))
        result["rounds"].append(row)
    for s, _ in built.values():
        s.stop(drain=False, timeout=30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
