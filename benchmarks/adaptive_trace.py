"""Host-side events of chained chunk calls, the fixed program against the adaptive one (issue 42's per-call gap).

    python benchmarks/adaptive_trace.py --batch 16 --out DIR       # the default pair (H100: ~40 s a batch size)
    python benchmarks/adaptive_trace.py --smoke                     # random tiny pair, CPU

Traces --calls chained calls of each program (one chunk in flight, as ChunkedLoop.run runs them, rows kept active)
under jax.profiler and prints, per program, the host events (CUDA driver calls, XLA's thunks, PJRT's execute) with
the largest total time per call, and the wall ms per call. Writes <out>/adaptive_trace_<device>.json.
"""
import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
import kdtree_jax.runtime
kdtree_jax.runtime.configure()
import jax
import jax.numpy as jnp
import kdtree_jax
from kdtree_jax.speculative import engine
from spec_decode import device_slug, greedy_loop_state, heldout_prompts, smoke_pair  # noqa: E402


# The host's waits for a chunk's tokens and this script's own frames: not dispatch work.
SKIP = ("device_get", "asarray", "_value", "__array__", "adaptive_trace.py", "tree_map", "genexpr", "wrapper",
        "block_until_ready")


def host_events(path):
    data = jax.profiler.ProfileData.from_file(path)
    totals = collections.defaultdict(lambda: [0.0, 0])
    for plane in data.planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for ev in line.events:
                if any(w in ev.name for w in SKIP):
                    continue
                key = f"{line.name[:24]} | {ev.name[:90]}"
                totals[key][0] += (ev.end_ns - ev.start_ns) / 1e6
                totals[key][1] += 1
    return totals


def run(loop, state, calls):
    state = jax.tree.map(jnp.copy, state)
    state = state._replace(active=jnp.ones_like(state.active))
    current = loop(state)
    t0 = time.perf_counter()
    for _ in range(calls):
        following = loop(current.state)
        jax.device_get((current.tokens, current.num_out))
        current = following
    jax.block_until_ready(current.state)
    return (time.perf_counter() - t0) * 1e3 / calls


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="batch rows")
    p.add_argument("--budget", type=int, default=8, help="the fixed budget, and the adaptive entry forced")
    p.add_argument("--calls", type=int, default=20, help="chained chunk calls timed and traced")
    p.add_argument("--top", type=int, default=25, help="host events listed per program")
    p.add_argument("--out", default=None, help="directory of the json (default benchmarks/results; --smoke: a "
                                               "temporary directory)")
    p.add_argument("--smoke", action="store_true", help="random tiny pair on the CPU, small sizes")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.budget, args.calls, args.top = 2, 4, 2, 5
        target, drafter, tok = smoke_pair()
    else:
        target, drafter, tok = kdtree_jax.load_checkpoint(os.path.join(ROOT, "checkpoints", "default"), dtype="auto")
    out = args.out or (tempfile.mkdtemp(prefix="adaptive_trace_") if args.smoke else os.path.join(ROOT, "benchmarks",
                                                                                                   "results"))
    prompts = [q.tolist() for q in heldout_prompts(tok, args.batch, 16 if args.smoke else 128)[0]]
    # A long output so that no row runs out within the traced calls.
    max_new = args.calls * 8 * 17 + 64
    result = {}
    for name, menu in (("fixed", ()), ("adaptive", (0, args.budget))):
        spec = engine.SpecConfig(budget=args.budget, max_new_tokens=max_new, menu=menu)
        state, d = greedy_loop_state(target, drafter, prompts, spec, 8)
        if menu:
            state = engine.with_costs(state, spec, {"cost_ar": 1.0})
            state = state._replace(policy=state.policy._replace(force=1))
        loop = engine.ChunkedLoop(target, d, spec, 8)
        loop.compile(state)
        run(loop, state, 3)  # warm-up
        wall = min(run(loop, state, args.calls) for _ in range(2))
        trace_dir = tempfile.mkdtemp(prefix="adaptive_trace_")
        jax.profiler.start_trace(trace_dir)
        traced = run(loop, state, args.calls)
        jax.profiler.stop_trace()
        totals = host_events(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
        top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:args.top]
        result[name] = {"wall_ms_per_call": wall, "traced_ms_per_call": traced,
                        "host_events_ms_per_call": [(k, round(v[0] / args.calls, 4), round(v[1] / args.calls, 2))
                                                    for k, v in top]}
        print(f"== {name}: {wall:.3f} ms a call ({traced:.3f} traced)")
        for k, ms, n in result[name]["host_events_ms_per_call"]:
            print(f"  {ms:8.4f} ms {n:7.2f}x  {k}")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"adaptive_trace_{device_slug()}.json")
    with open(path, "w") as f:
        json.dump({"commit": os.environ.get("KDTREE_COMMIT"), "device": device_slug(), "batch": args.batch, **result},
                  f, indent=1)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
