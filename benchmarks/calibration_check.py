"""Does the adaptive budget's calibration measure what its decode pays? One batch, one menu, per menu entry:

- `calibrate`: engine.calibrate's step ms for the entry (the cost model's point, measured as generate measures it);
- `chained`: (3 chained chunk calls - 1 call) / their steps on the adaptive loop forced to the entry (calibrate's
  method without its state changes), with a warm-up call per entry, the median of 3;
- `decode`: the adaptive loop forced to the entry decoding the batch to the end through ChunkedLoop.run (one chunk
  in flight, as generate decodes): wall ms / steps;
- `fixed decode`: the same for the fixed program of that budget (autoregressive for "ar");
- `generate`: engine.generate of the same prompts as spec_decode.py's static rows call it (warmed up, no stop ids), the
  fixed budget's ms per step, and `auto` (the policy free, its cost model calibrated by the warm-up call) with the
  steps it gave each entry: whether the adaptive decode pays what the calibration and the forced decode measured.
  Every decoder is warmed up first, then --generate-passes calls go round robin over them (the median call).

    python benchmarks/calibration_check.py --batch 16 --menu 0,8,16       # the default pair, GPU
    python benchmarks/calibration_check.py --smoke                        # random tiny pair, CPU
"""

from __future__ import annotations

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

import kdtree_jax.runtime  # noqa: E402

kdtree_jax.runtime.configure()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kdtree_jax.speculative import engine  # noqa: E402
from spec_decode import base_meta, device_slug, greedy_loop_state, heldout_prompts, load_pair  # noqa: E402


def decode_ms(loop, state):
    """Wall ms per step of decoding `state` (a copy) to the end, one chunk in flight: (ms/step, steps)."""
    copy = jax.tree.map(jnp.copy, state)
    jax.block_until_ready(copy)
    start = int(copy.step)
    t0 = time.perf_counter()
    final, _ = loop.run(copy)
    steps = int(final.step) - start
    return (time.perf_counter() - t0) * 1e3 / max(steps, 1), steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"),
                   help="the pair (default: the embedded checkpoints/default)")
    p.add_argument("--dtype", default="auto", help="the pair's dtype (auto: float32 on a CPU, as saved on a GPU)")
    p.add_argument("--batch", default="16", help="batch sizes, comma-separated (default 16)")
    p.add_argument("--menu", default="0,8,16", help="the adaptive menu, also the fixed budgets timed (default 0,8,16)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each held-out prompt (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens decoded per row (default 96)")
    p.add_argument("--chunk-steps", type=int, default=8, help="steps per call of the chunked loop (default 8)")
    p.add_argument("--generate-passes", type=int, default=3,
                   help="timed generate calls per decoder, round robin over the decoders after every warm-up; the "
                        "median is reported (default 3)")
    p.add_argument("--out", default=None, help="results directory (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="random tiny pair on the CPU, small sizes")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    target, drafter, tokenizer, pair = load_pair(args)
    if args.smoke:
        args.batch, args.menu, args.max_new_tokens, args.prompt_len = "2", "0,2,4", 16, 12
    menu = tuple(sorted({0, *(int(b) for b in args.menu.split(","))}))
    results = {}
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = [q.tolist() for q in heldout_prompts(tokenizer, batch, args.prompt_len)[0]]

        rows = {}
        for budget in menu:
            spec = engine.SpecConfig(budget=budget, max_new_tokens=args.max_new_tokens)
            state, loop_drafter = greedy_loop_state(target, drafter, prompts, spec)
            loop = engine.ChunkedLoop(target, loop_drafter, spec, args.chunk_steps)
            loop.compile(state)
            decode_ms(loop, state)  # warm-up
            rows["ar" if budget == 0 else str(budget)] = {"fixed_decode": decode_ms(loop, state)}
        spec = engine.SpecConfig(budget=max(menu), max_new_tokens=args.max_new_tokens, menu=menu)
        state, loop_drafter = greedy_loop_state(target, drafter, prompts, spec)
        state = engine.with_costs(state, spec, {"cost_ar": 1.0, "cost_draft": 0.2,
                                                "cost_verify": [1.0 + 0.02 * b for b in menu]})
        loop = engine.ChunkedLoop(target, loop_drafter, spec, args.chunk_steps)
        loop.compile(state)
        point = engine.calibrate(loop, state, spec, depth=drafter.cfg.depth)
        measured = point["measured_ms"]
        for name, force in [("ar", len(menu))] + [(str(b), i) for i, b in enumerate(menu)]:
            forced = state._replace(policy=state.policy._replace(force=jnp.int32(force)))
            engine.time_calls(loop, forced)  # warm-up
            chained = statistics.median(engine.step_ms_between(engine.time_calls(loop, forced, 1),
                                                               engine.time_calls(loop, forced, 3))
                                        for _ in range(3))
            key = "ar" if name == "ar" else str(menu.index(int(name)))
            row = rows.setdefault(name if name != "0" else "probe (drafter + root)", {})
            row.update(calibrate=measured.get(key), chained=chained, decode=decode_ms(loop, forced))
            print(f"B={batch} {name:>5s}: {json.dumps(row)}", file=sys.stderr, flush=True)
        decoders = {}
        for name, budget in [(("ar" if b == 0 else str(b)), b) for b in menu] + [("auto", "auto")]:
            kw = dict(max_new_tokens=args.max_new_tokens, budget=budget, chunk_steps=args.chunk_steps, temperature=0.0)
            if budget == "auto":
                kw["menu"] = menu
            engine.generate(target, drafter, prompts, calibrate=budget == "auto", **kw)  # compile (and calibrate)
            decoders[name] = kw
        # Round robin over the decoders, pass after pass (as budget_sweep.py times them), so that the device's drift
        # falls on all of them; each keeps its own compiled loop (engine.LOOPS_KEPT). The median pass per decoder.
        passes = {name: [] for name in decoders}
        for _ in range(args.generate_passes):
            for name, kw in decoders.items():
                res = engine.generate(target, drafter, prompts, **kw)
                passes[name].append(res)
        for name, results_ in passes.items():
            ms = [1e3 * r.stats["decode_seconds"] / max(r.stats["steps"], 1) for r in results_]
            median = statistics.median_low(ms)
            res = results_[ms.index(median)]
            row = rows.setdefault(name, {})
            row["generate"] = (median, res.stats["steps"])
            if name == "auto":
                policy = res.stats["budget_policy"]
                row["budget_steps"] = {**policy["budget_steps"], "ar": policy["steps_without_drafter"]}
            print(f"B={batch} generate {name:>5s}: {json.dumps(row)}", file=sys.stderr, flush=True)
        results[batch] = rows
    meta = {**base_meta(args, target, drafter, pair), "menu": list(menu),
            "commit": os.environ.get("KDTREE_COMMIT") or base_meta(args, target, drafter, pair)["commit"]}
    lines = [f"# Calibration against the decode ({meta['device']})", "",
             f"commit {meta['commit']} · {pair} · greedy · menu {list(menu)} · {args.max_new_tokens} new tokens · "
             f"chunks of {args.chunk_steps} steps · ms per step (decode: wall / steps, steps in brackets)", "",
             "| batch | entry | calibrate | chained | decode (adaptive, forced) | decode (fixed program) | generate |",
             "|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else (f"{v[0]:.4f} ({v[1]})" if isinstance(v, (tuple, list)) else f"{v:.4f}")  # noqa: E731
    for batch, rows in results.items():
        for name, r in rows.items():
            lines.append(f"| {batch} | {name} | {fmt(r.get('calibrate'))} | {fmt(r.get('chained'))} | "
                         f"{fmt(r.get('decode'))} | {fmt(r.get('fixed_decode'))} | {fmt(r.get('generate'))} |")
        auto = rows.get("auto", {}).get("budget_steps")
        if auto:
            lines += ["", f"batch {batch}, generate auto: steps per budget {auto} (ar: without the drafter)", ""]
    out_dir = args.out or tempfile.mkdtemp(prefix="calibration_check_")
    os.makedirs(out_dir, exist_ok=True)
    name = f"calibration_check_{'smoke_' if args.smoke else ''}{device_slug()}"
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"meta": meta, "results": {str(k): v for k, v in results.items()}}, f, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
