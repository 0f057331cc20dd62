"""What the adaptive budget's program costs per step against the fixed-budget programs, budget by budget.

    python benchmarks/adaptive_overhead.py --batch 1,16,64          # the default pair, H200: ~1 minute
    python benchmarks/adaptive_overhead.py --smoke                  # random tiny pair, CPU, seconds

The adaptive loop (budget "auto") compiles every budget of its menu into one program and picks one per step on the
device; `PolicyState.force` makes it take one entry every step (what its calibration times). For each batch size this
times, in the engine's chunked loop, a step of: the fixed autoregressive program (no drafter), the adaptive program
forced to an autoregressive step (the gate closed: no drafter pass), forced to the drafter and a root-only verify (a
probe), and, per menu budget b, the fixed DDTree-b program and the adaptive one forced to b. A step's time is the
difference of a long and a short run over the difference of their steps (engine.calibrate's method: a call's fixed
cost drops out), the best of --repeats. The gap between a fixed row and its adaptive twin is the price of choosing:
the gate, the policy's bookkeeping, the lazily extended drafter context and one at-most-once loop per menu entry.

Writes <out>/adaptive_overhead_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import kdtree_jax.runtime  # noqa: E402

kdtree_jax.runtime.configure()

import jax.numpy as jnp  # noqa: E402

from kdtree_jax.speculative import engine  # noqa: E402
from spec_decode import base_meta, device_slug, greedy_loop_state, heldout_prompts, load_pair  # noqa: E402


def step_ms(loop: engine.ChunkedLoop, state, repeats: int) -> float:
    """Per-step milliseconds of `loop` from `state` (not consumed): (3 chained chunks - 1 chunk) / their steps."""
    engine.time_calls(loop, state)  # warm-up (a GPU program's first call)
    return min(engine.step_ms_between(engine.time_calls(loop, state, 1), engine.time_calls(loop, state, 3))
               for _ in range(repeats))


def measure(target, drafter, prompts, *, menu, max_new_tokens: int, chunk_steps: int, repeats: int) -> list:
    rows = []
    fixed = {}
    for budget in menu:
        spec = engine.SpecConfig(budget=budget, max_new_tokens=max_new_tokens)
        state, loop_drafter = greedy_loop_state(target, drafter, prompts, spec)
        loop = engine.ChunkedLoop(target, loop_drafter, spec, chunk_steps)
        loop.compile(state)
        fixed[budget] = step_ms(loop, state, repeats)
    spec = engine.SpecConfig(budget=max(menu), max_new_tokens=max_new_tokens, menu=tuple(menu))
    state, loop_drafter = greedy_loop_state(target, drafter, prompts, spec)
    state = engine.with_costs(state, spec, {"cost_ar": 1.0})
    loop = engine.ChunkedLoop(target, loop_drafter, spec, chunk_steps)
    loop.compile(state)

    def forced(entry):
        return state._replace(policy=state.policy._replace(force=jnp.int32(entry)))

    auto_ar = step_ms(loop, forced(len(menu)), repeats)
    rows.append({"step": "autoregressive (no drafter)", "budget": 0, "fixed_ms": fixed[0], "adaptive_ms": auto_ar})
    for i, budget in enumerate(menu):
        ms = step_ms(loop, forced(i), repeats)
        name = "drafter + root-only verify (a probe)" if budget == 0 else f"DDTree {budget}"
        rows.append({"step": name, "budget": budget, "fixed_ms": fixed[budget] if budget else None,
                     "adaptive_ms": ms})
    return rows


def render(meta: dict, results: dict) -> str:
    lines = [f"# The adaptive budget's step against the fixed programs ({meta['device']})", "",
             f"{meta['date']} · commit {meta['commit']} · {meta['pair']} · {meta['dtype']} · greedy · "
             f"{meta['max_new_tokens']} new tokens · chunked loop of {meta['chunk_steps']} steps · per-step ms = "
             "(3 chained chunks - 1 chunk) / their steps, best of "
             f"{meta['repeats']}", ""]
    for batch, rows in results.items():
        lines += [f"## Batch {batch}", "", "| step | fixed program (ms) | adaptive program, forced (ms) | overhead |",
                  "|---|---|---|---|"]
        for r in rows:
            fixed = r["fixed_ms"]
            over = f"{(r['adaptive_ms'] / fixed - 1) * 100:+.1f}%" if fixed else "-"
            lines.append(f"| {r['step']} | {fixed:.4f} |" if fixed else f"| {r['step']} | - |")
            lines[-1] += f" {r['adaptive_ms']:.4f} | {over} |"
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"),
                   help="the pair (default: the embedded checkpoints/default)")
    p.add_argument("--dtype", default="auto", help="the pair's dtype (auto: float32 on a CPU, as saved on a GPU)")
    p.add_argument("--batch", default="1,16,64", help="batch sizes, comma-separated")
    p.add_argument("--menu", default="0,4,8,16,32,64", help="the adaptive menu (and the fixed budgets timed)")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each held-out prompt (the context)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="the loop's output length (sizes its KV pool)")
    p.add_argument("--chunk-steps", type=int, default=8, help="steps per call of the chunked loop")
    p.add_argument("--repeats", type=int, default=3, help="timings per row; the best is kept")
    p.add_argument("--out", default=None, help="directory of the results (default benchmarks/results; --smoke: a "
                                               "temporary directory)")
    p.add_argument("--smoke", action="store_true", help="random tiny pair on the CPU, small sizes")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    target, drafter, tokenizer, pair = load_pair(args)
    if args.smoke:
        args.batch, args.menu, args.max_new_tokens, args.prompt_len, args.repeats = "2", "0,2,4", 16, 12, 1
    menu = [int(b) for b in args.menu.split(",")]
    if 0 not in menu:
        menu = [0] + menu
    results = {}
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = [p.tolist() for p in heldout_prompts(tokenizer, batch, args.prompt_len)[0]]
        print(f"batch {batch} ...", file=sys.stderr, flush=True)
        results[batch] = measure(target, drafter, prompts, menu=menu, max_new_tokens=args.max_new_tokens,
                                 chunk_steps=args.chunk_steps, repeats=args.repeats)
    meta = {**base_meta(args, target, drafter, pair), "max_new_tokens": args.max_new_tokens,
            "chunk_steps": args.chunk_steps, "repeats": args.repeats, "menu": menu,
            "date": datetime.date.today().isoformat()}
    meta["dtype"] = str(target.dtype)
    meta["commit"] = os.environ.get("KDTREE_COMMIT") or meta.get("commit")
    out = args.out or (tempfile.mkdtemp(prefix="adaptive_overhead_") if args.smoke else
                       os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    os.makedirs(out, exist_ok=True)
    name = f"adaptive_overhead_{'smoke_' if args.smoke else ''}{device_slug()}"
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump({"meta": meta, "results": {str(k): v for k, v in results.items()}}, f, indent=1)
    text = render(meta, results)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {os.path.join(out, name)}.{{md,json}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
