"""Where an adaptive decode's time goes beside the fixed program's, call by call (issue 42's 8-16% gap).

    python benchmarks/adaptive_gap.py --batch 1,16 --out DIR      # the default pair (H100: ~80 s)
    python benchmarks/adaptive_gap.py --smoke                       # random tiny pair, CPU

For each batch size, blocks of generate calls alternate: DDTree b (fixed) and budget "auto" with costs that make
every chunk pick entry b (generate(costs=...): the same tree, the adaptive program). Each generate's decode seconds
are split on the host into: ChunkedLoop.__call__ (dispatch, per call; of it the compiled program's call and the pick's
copy to the host), the entry lookup (_entry_for: a state of no earlier call waits for its policy's pick on the
device), the reads of each chunk (jax.device_get) and the rest.
Prints and writes <out>/adaptive_gap_<device>.json.
"""
import argparse
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
import kdtree_jax.runtime
kdtree_jax.runtime.configure()
import jax
import kdtree_jax
from kdtree_jax.speculative import engine
from spec_decode import device_slug, heldout_prompts, smoke_pair  # noqa: E402

TIMERS = {}


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
engine.ChunkedLoop._pick = timed("pick", engine.ChunkedLoop._pick)
jax.device_get = timed("device_get", jax.device_get)
jax.stages.Compiled.__call__ = timed("program", jax.stages.Compiled.__call__)
_array = type(jax.numpy.zeros(()))
_array.copy_to_host_async = timed("copy_async", _array.copy_to_host_async)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,16", help="batch sizes, comma-separated")
    p.add_argument("--budget", type=int, default=8, help="the fixed budget, and the entry auto is made to pick")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts of 128 tokens (whole batches of them)")
    p.add_argument("--rounds", type=int, default=2, help="alternating blocks of fixed and auto calls")
    p.add_argument("--chunk-steps", type=int, default=8, help="steps a chunk")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens each call decodes")
    p.add_argument("--out", default=None, help="directory of the json (default benchmarks/results; --smoke: a "
                                               "temporary directory)")
    p.add_argument("--frozen", action="store_true",
                   help="auto without its chunk-end policy work (end_of_chunk and next_entry replaced by the forced "
                        "entry): what that work costs, against the fixed program of the same process")
    p.add_argument("--smoke", action="store_true", help="random tiny pair on the CPU, small sizes")
    args = p.parse_args()
    if args.smoke:
        args.batch, args.budget, args.prompts, args.rounds, args.max_new_tokens = "2", 4, 2, 1, 12
    if args.frozen:
        from kdtree_jax.speculative import budget_policy
        budget_policy.end_of_chunk = lambda policy, menu, entry, context: policy
        budget_policy.next_entry = lambda policy, menu, *a, **k: jax.numpy.int32(1)
    if args.smoke:
        target, drafter, tok = smoke_pair()
    else:
        target, drafter, tok = kdtree_jax.load_checkpoint(os.path.join(ROOT, "checkpoints", "default"), dtype="auto")
    out = args.out or (tempfile.mkdtemp(prefix="adaptive_gap_") if args.smoke else os.path.join(ROOT, "benchmarks",
                                                                                                 "results"))
    menu = (0, args.budget)
    entry = menu.index(args.budget)
    verify = [1.0] * len(menu)
    for i in range(1, len(menu)):
        verify[i] = 1.05 if i == entry else 50.0
    costs = dict(cost_ar=1.0, cost_draft=0.05, cost_verify=verify, expected=[1.0, 3.0])
    results = {}
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = [p.tolist() for p in heldout_prompts(tok, max(args.prompts, batch), 16 if args.smoke else 128)[0]]
        batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        rows = []
        for rnd in range(args.rounds):
            for kind in ("fixed", "auto"):
                kw = dict(max_new_tokens=args.max_new_tokens, chunk_steps=args.chunk_steps)
                kw.update(budget=args.budget) if kind == "fixed" else kw.update(budget="auto", menu=menu, costs=costs)
                engine.generate(target, drafter, batches[0], **kw)  # warm-up (its programs' first calls)
                for b in batches:
                    TIMERS.clear()
                    t0 = time.perf_counter()
                    res = engine.generate(target, drafter, b, **kw)
                    wall = time.perf_counter() - t0
                    s = res.stats
                    rows.append(dict(kind=kind, round=rnd, decode_ms=s["decode_seconds"] * 1e3, wall_ms=wall * 1e3,
                                     steps=s["steps"], tokens=sum(len(t) for t in res.tokens),
                                     prefill_ms=s.get("prefill_seconds", 0) * 1e3,
                                     **{k: (v * 1e3 if not k.endswith("#") else v) for k, v in TIMERS.items()},
                                     picks=(s.get("budget_policy") or {}).get("budget_steps")))
        summary = {}
        for kind in ("fixed", "auto"):
            rs = [r for r in rows if r["kind"] == kind]
            med = lambda key: statistics.median(r.get(key, 0.0) for r in rs)
            summary[kind] = {k: med(k) for k in ("decode_ms", "wall_ms", "steps", "call", "call#", "entry_for",
                                                 "pick", "program", "copy_async", "device_get", "device_get#",
                                                 "prefill_ms")}
            summary[kind]["tok_s"] = sum(r["tokens"] - len(r.get("picks") or []) * 0 for r in rs) / (
                sum(r["decode_ms"] for r in rs) / 1e3)
        results[batch] = {"rows": rows, "summary": summary}
        print(f"batch {batch}:", json.dumps(summary, indent=1), flush=True)
    name = f"adaptive_gap_{'frozen_' if args.frozen else ''}{device_slug()}.json"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump({"commit": os.environ.get("KDTREE_COMMIT"), "device": device_slug(), "budget": args.budget,
                   "frozen": args.frozen, "results": results}, f, indent=1)
    print(f"wrote {os.path.join(out, name)}", file=sys.stderr)


if __name__ == "__main__":
    main()
