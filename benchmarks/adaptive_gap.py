"""Where an adaptive decode's time goes beside the fixed budget's program (issue 42: auto against the best fixed budget).

    python benchmarks/adaptive_gap.py --batch 1,16                 # generate calls, the default pair (H100: ~80 s)
    python benchmarks/adaptive_gap.py --batch 16 --chained         # chained chunks and their host events (~40 s)
    python benchmarks/adaptive_gap.py --smoke                      # random tiny pair, CPU

Two views of DDTree b (fixed) against budget "auto" made to run the same tree every chunk (its costs, or a forced
entry: the adaptive program, the same steps):

- generate calls (the default): for each batch size, blocks of generate calls alternate, fixed then auto, each block
  after a warm-up call. Each call's decode seconds are split on the host into: the compiled program's calls, the
  pick's copy to the host, the first chunk's pick (`_entry_for`: a state no call has made asks its own policy), the
  reads of each chunk's tokens (jax.device_get) and the rest. --frozen: auto without its chunk-end policy work
  (end_of_chunk and next_entry replaced by the entry), what that work costs.
- --trace: after the timed blocks, --traced generate calls of each kind under jax.profiler: per call, the host time of
  each part of generate (annotated here: setup, compile, the costs' preparation, the chunks' run, the stats) and
  its largest host events, and in the decode's window (ChunkedLoop.run) the device's busy and idle time and its
  largest idle gaps with the host part that ran across each.
- --chained: --calls chained chunk calls of each program on one long decode (no generate around them: every row
  active throughout), as ChunkedLoop.run chains them, the wall ms a chunk, then the same calls under jax.profiler and
  the host's events with the largest time a call (CUDA driver calls, XLA's thunks, PJRT's execute).

Writes <out>/adaptive_gap[_frozen|_chained]_<device>.json.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import sys
import tempfile
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import kdtree_jax.runtime  # noqa: E402

kdtree_jax.runtime.configure()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kdtree_jax  # noqa: E402
from kdtree_jax import profiling  # noqa: E402
from kdtree_jax.speculative import budget_policy, engine  # noqa: E402
from spec_decode import device_slug, greedy_loop_state, heldout_prompts, smoke_pair  # noqa: E402

TIMERS: dict = {}  # name -> host seconds (name + "#": calls) within one generate call


def install_timers() -> None:
    """Wrap the host's parts of a decode (module docstring) so that each call adds its time to TIMERS."""
    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                TIMERS[name] = TIMERS.get(name, 0.0) + time.perf_counter() - t0
                TIMERS[name + "#"] = TIMERS.get(name + "#", 0) + 1
        return wrapper

    engine.ChunkedLoop.__call__ = timed("call", engine.ChunkedLoop.__call__)
    engine.ChunkedLoop._entry_for = timed("entry_for", engine.ChunkedLoop._entry_for)
    jax.device_get = timed("device_get", jax.device_get)
    jax.stages.Compiled.__call__ = timed("program", jax.stages.Compiled.__call__)
    array = type(jnp.zeros(()))
    array.copy_to_host_async = timed("copy_async", array.copy_to_host_async)


# generate's parts, annotated in --trace (module, attribute): each call shows as "kd:<attribute>" on the host.
PARTS = (("engine", "setup"), ("engine", "_run_loop"), ("engine", "_prepare_costs"), ("engine", "first_entry"),
         ("engine", "generate_stats"), ("engine", "_host_driven_loops"), ("engine", "chunked_loop"),
         ("ChunkedLoop", "compile"), ("ChunkedLoop", "run"), ("ChunkedLoop", "__call__"), ("ChunkedLoop", "begin"),
         ("kv_pool", "check_overflow"))


def annotate_parts() -> None:
    def annotated(name, fn):
        def wrapper(*a, **k):
            with jax.profiler.TraceAnnotation(f"kd:{name}"):
                return fn(*a, **k)
        return wrapper

    for owner, name in PARTS:
        obj = {"engine": engine, "ChunkedLoop": engine.ChunkedLoop, "kv_pool": engine.kv_pool}[owner]
        setattr(obj, name, annotated(name, getattr(obj, name)))


def traced_calls(target, drafter, batch, kw, calls: int, top: int) -> dict:
    """`calls` generate calls under the profiler (module docstring, --trace)."""
    trace_dir = tempfile.mkdtemp(prefix="adaptive_gap_trace_")
    jax.profiler.start_trace(trace_dir)
    for _ in range(calls):
        with jax.profiler.TraceAnnotation("kd:generate"):
            engine.generate(target, drafter, batch, **kw)
    jax.profiler.stop_trace()
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    host, parts, runs = collections.defaultdict(float), collections.defaultdict(float), []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for ev in line.events:
                if ev.name.startswith("kd:"):
                    parts[ev.name] += (ev.end_ns - ev.start_ns) / 1e6 / calls
                    if ev.name == "kd:run":
                        runs.append((ev.start_ns, ev.end_ns))
                elif not any(w in ev.name for w in SKIP):
                    host[f"{line.name[:20]} | {ev.name[:80]}"] += (ev.end_ns - ev.start_ns) / 1e6 / calls
    annotations = [(ev.start_ns, ev.end_ns, ev.name) for plane in jax.profiler.ProfileData.from_file(path).planes
                   if not plane.name.startswith("/device:") for line in plane.lines for ev in line.events
                   if ev.name.startswith("kd:") and ev.name not in ("kd:generate", "kd:run", "kd:_run_loop")]
    kernels, _ = profiling.kernel_events(path)
    on_device = bool(kernels) and jax.default_backend() == "gpu"
    windows = []
    for lo, hi in runs:
        inside = [(k[0], max(k[1], lo), min(k[2], hi)) for k in kernels if k[2] > lo and k[1] < hi]
        gaps, end = [], lo
        for _, start, stop in sorted(inside, key=lambda e: e[1]):
            if start > end:
                gaps.append((start - end, end, start))
            end = max(end, stop)
        if hi > end:
            gaps.append((hi - end, end, hi))

        def during(t0, t1):  # the innermost annotated host part overlapping the gap's middle
            mid = (t0 + t1) / 2
            names = [(e - s, n) for s, e, n in annotations if s <= mid <= e]
            return min(names)[1] if names else "-"
        windows.append({"run_ms": (hi - lo) / 1e6,
                        "busy_ms": profiling.busy_ns(inside) / 1e6 if on_device else None,
                        "gaps_over_20us": sum(1 for g in gaps if g[0] > 2e4),
                        "largest_gaps": [(round(g / 1e6, 3), during(t0, t1), round((t0 - lo) / 1e6, 3))
                                         for g, t0, t1 in sorted(gaps, reverse=True)[:8]]})
    return {"parts_ms_per_call": dict(sorted(parts.items(), key=lambda kv: -kv[1])),
            "host_events_ms_per_call": sorted(((k, round(v, 4)) for k, v in host.items()), key=lambda kv: -kv[1])[:top],
            "decode_windows": windows}


def generate_calls(target, drafter, tokenizer, args) -> dict:
    menu = (0, args.budget)
    # Entry 1 (the budget) every chunk: far cheaper than autoregressive per predicted token, and a 5% margin keeps it.
    costs = dict(cost_ar=1.0, cost_draft=0.05, cost_verify=[1.0, 1.05], expected=[1.0, 3.0])
    install_timers()
    results = {}
    for batch in args.batches:
        prompts = [p.tolist() for p in heldout_prompts(tokenizer, max(args.prompts, batch), args.prompt_len)[0]]
        batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        rows = []
        for rnd in range(args.rounds):
            for kind in ("fixed", "auto"):
                kw = dict(max_new_tokens=args.max_new_tokens, chunk_steps=args.chunk_steps)
                kw.update(budget=args.budget) if kind == "fixed" else kw.update(budget="auto", menu=menu, costs=costs)
                engine.generate(target, drafter, batches[0], **kw)  # warm-up: its programs' first calls
                for b in batches:
                    TIMERS.clear()
                    res = engine.generate(target, drafter, b, **kw)
                    rows.append(dict(kind=kind, round=rnd, decode_ms=res.stats["decode_seconds"] * 1e3,
                                     steps=res.stats["steps"], tokens=sum(len(t) for t in res.tokens),
                                     **{k: v if k.endswith("#") else v * 1e3 for k, v in TIMERS.items()}))
        summary = {}
        for kind in ("fixed", "auto"):
            rs = [r for r in rows if r["kind"] == kind]
            summary[kind] = {k: statistics.median(r.get(k, 0.0) for r in rs)
                             for k in ("decode_ms", "steps", "call", "call#", "program", "copy_async", "entry_for",
                                       "device_get", "device_get#")}
        results[batch] = {"rows": rows, "summary": summary}
        print(f"batch {batch}: " + json.dumps(summary), flush=True)
        if args.trace:
            results[batch]["traced"] = {}
            for kind in ("fixed", "auto"):
                kw = dict(max_new_tokens=args.max_new_tokens, chunk_steps=args.chunk_steps)
                kw.update(budget=args.budget) if kind == "fixed" else kw.update(budget="auto", menu=menu, costs=costs)
                traced = results[batch]["traced"][kind] = traced_calls(target, drafter, batches[0], kw, args.traced,
                                                                      args.top)
                print(f"== batch {batch}, {kind}, traced: parts ms a call {json.dumps(traced['parts_ms_per_call'])}")
                for w in traced["decode_windows"]:
                    print(f"  decode window {w['run_ms']:.3f} ms, device busy {w['busy_ms']}, "
                          f"{w['gaps_over_20us']} gaps > 20 us; largest (ms, host part, at ms): {w['largest_gaps']}")
                for k, ms in traced["host_events_ms_per_call"][:12]:
                    print(f"  {ms:8.4f} ms  {k}")
    return results


# The host's waits for a chunk's tokens and this script's own frames: not dispatch work.
SKIP = ("device_get", "asarray", "_value", "__array__", "adaptive_gap.py", "tree_map", "genexpr",
        "block_until_ready", "stop_trace", "threading.py")


def host_events(path: str) -> dict:
    """{"line | event": [ms, count]} of a trace's host planes."""
    totals = collections.defaultdict(lambda: [0.0, 0])
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for ev in line.events:
                if not any(w in ev.name for w in SKIP):
                    totals[f"{line.name[:24]} | {ev.name[:90]}"][0] += (ev.end_ns - ev.start_ns) / 1e6
                    totals[f"{line.name[:24]} | {ev.name[:90]}"][1] += 1
    return totals


def chain(loop, state, calls: int) -> float:
    """ms a call of `calls` chained calls from a copy of `state`, one chunk in flight while the host reads the last."""
    current = loop(jax.tree.map(jnp.copy, state))
    t0 = time.perf_counter()
    for _ in range(calls):
        following = loop(current.state)
        jax.device_get((current.tokens, current.num_out))
        current = following
    jax.block_until_ready(current.state)
    return (time.perf_counter() - t0) * 1e3 / calls


def chained_calls(target, drafter, tokenizer, args) -> dict:
    results = {}
    for batch in args.batches:
        prompts = [q.tolist() for q in heldout_prompts(tokenizer, batch, args.prompt_len)[0]]
        # Room for every timed call's tokens (at most D + 1 a step), within the model's context.
        limit = target.cfg.max_position_embeddings - args.prompt_len - 2 * (drafter.cfg.depth + 1) - 64
        max_new = min((args.calls * 2 + 8) * args.chunk_steps * (drafter.cfg.depth + 1), limit)
        per_program = {}
        for name, menu in (("fixed", ()), ("adaptive", (0, args.budget))):
            spec = engine.SpecConfig(budget=args.budget, max_new_tokens=max_new, menu=menu)
            state, loop_drafter = greedy_loop_state(target, drafter, prompts, spec, args.chunk_steps)
            if menu:
                state = engine.with_costs(state, spec, {"cost_ar": 1.0})
                state = state._replace(policy=state.policy._replace(force=1))
            loop = engine.ChunkedLoop(target, loop_drafter, spec, args.chunk_steps)
            loop.compile(state)
            chain(loop, state, 3)  # warm-up
            wall = min(chain(loop, state, args.calls) for _ in range(2))
            trace_dir = tempfile.mkdtemp(prefix="adaptive_gap_trace_")
            jax.profiler.start_trace(trace_dir)
            traced = chain(loop, state, args.calls)
            jax.profiler.stop_trace()
            totals = host_events(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
            top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:args.top]
            per_program[name] = {"wall_ms_per_call": wall, "traced_ms_per_call": traced,
                                 "host_events_ms_per_call": [(k, round(v[0] / args.calls, 4),
                                                              round(v[1] / args.calls, 2)) for k, v in top]}
            print(f"== batch {batch}, {name}: {wall:.3f} ms a call ({traced:.3f} traced)")
            for k, ms, n in per_program[name]["host_events_ms_per_call"]:
                print(f"  {ms:8.4f} ms {n:7.2f}x  {k}")
        results[batch] = per_program
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,16", help="batch sizes, comma-separated")
    p.add_argument("--budget", type=int, default=8, help="the fixed budget, and the entry auto runs")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts (whole batches of them)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each held-out prompt")
    p.add_argument("--rounds", type=int, default=2, help="alternating blocks of fixed and auto calls")
    p.add_argument("--chunk-steps", type=int, default=8, help="steps a chunk")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens each generate call decodes")
    p.add_argument("--frozen", action="store_true",
                   help="auto without its chunk-end policy work (end_of_chunk and next_entry replaced by the entry)")
    p.add_argument("--trace", action="store_true",
                   help="also trace --traced generate calls of each kind: host parts, device idle gaps in the decode")
    p.add_argument("--traced", type=int, default=3, help="--trace: generate calls traced per kind")
    p.add_argument("--chained", action="store_true",
                   help="chained chunk calls of each program and their host events, instead of generate calls")
    p.add_argument("--calls", type=int, default=20, help="--chained: chunk calls timed and traced")
    p.add_argument("--top", type=int, default=25, help="--chained: host events listed per program")
    p.add_argument("--out", default=None, help="directory of the json (default benchmarks/results; --smoke: a "
                                               "temporary directory)")
    p.add_argument("--smoke", action="store_true", help="random tiny pair on the CPU, small sizes")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.budget, args.prompts, args.prompt_len = "2", 4, 2, 16
        args.rounds, args.max_new_tokens, args.calls, args.top = 1, 12, 2, 5
        target, drafter, tokenizer = smoke_pair()
    else:
        target, drafter, tokenizer = kdtree_jax.load_checkpoint(os.path.join(ROOT, "checkpoints", "default"),
                                                                dtype="auto")
    args.batches = [int(b) for b in args.batch.split(",")]
    if args.trace:
        annotate_parts()
    if args.frozen:
        budget_policy.end_of_chunk = lambda policy, menu, entry, context: policy
        budget_policy.next_entry = lambda policy, menu, *a, **k: jnp.int32(1)
    results = (chained_calls if args.chained else generate_calls)(target, drafter, tokenizer, args)
    out = args.out or (tempfile.mkdtemp(prefix="adaptive_gap_") if args.smoke else
                       os.path.join(ROOT, "benchmarks", "results"))
    os.makedirs(out, exist_ok=True)
    mode = "_chained" if args.chained else "_frozen" if args.frozen else "_traced" if args.trace else ""
    path = os.path.join(out, f"adaptive_gap{mode}_{device_slug()}.json")
    with open(path, "w") as f:
        json.dump({"commit": os.environ.get("KDTREE_COMMIT"), "device": device_slug(), "budget": args.budget,
                   "frozen": args.frozen, "results": {str(k): v for k, v in results.items()}}, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
