"""What the adaptive budget's program costs per step against the fixed-budget programs, budget by budget.

    python benchmarks/adaptive_overhead.py --batch 1,16,64          # the default pair, H200: ~1 minute
    python benchmarks/adaptive_overhead.py --smoke                  # random tiny pair, CPU, seconds

The adaptive loop (budget "auto") compiles one chunk program per menu entry and picks one per chunk
(budget_policy.py); `PolicyState.force` makes it take one entry every chunk (what its calibration times). For each
batch size this times, in the engine's chunked loop, a step of: the fixed autoregressive program (no drafter) beside
the adaptive loop's autoregressive entry (which keeps the drafter's context: the ring append, a flush a chunk), and,
per drafting menu budget b, the fixed DDTree-b program beside the adaptive entry b (the same tree, plus the policy's
observations). A step's time is the difference of a long and a short run over the difference of their steps (a call's
fixed cost drops out), the best of --repeats; beside it, a step as `ChunkedLoop.run` decodes (one chunk in flight while
the host reads the one before: what the calibration stores) and the host's ms to dispatch one call (when that exceeds
a chunk's device time the GPU waits). The gap between a fixed row and its adaptive twin is the price of choosing.
--profile adds each row's kernels from a profiled one-step call.

Writes <out>/adaptive_overhead_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
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

from kdtree_jax import profiling  # noqa: E402

from kdtree_jax.speculative import engine  # noqa: E402
from spec_decode import base_meta, device_slug, greedy_loop_state, heldout_prompts, load_pair  # noqa: E402


def step_ms(loop: engine.ChunkedLoop, state, repeats: int) -> float:
    """Per-step milliseconds of `loop` from `state` (not consumed): (3 chained chunks - 1 chunk) / their steps."""
    engine.time_calls(loop, state)  # warm-up (a GPU program's first call)
    # A repeat whose 3 chunks took less than its 1 (the host-bound autoregressive program at batch 16, whose calls'
    # host time varies more than its steps' device time) measured nothing: step_ms_between clamps it to 1e-6 ms, which
    # the best of the repeats then reported as 0.0000 (the H200 and the H100, session 38). The best of the others.
    times = [engine.step_ms_between(engine.time_calls(loop, state, 1), engine.time_calls(loop, state, 3))
             for _ in range(repeats)]
    return min((t for t in times if t > 1e-6), default=float("nan"))


def decode_and_host_ms(loop: engine.ChunkedLoop, state, chunks: int = 6, entry=None) -> tuple:
    """(a step's ms as ChunkedLoop.run decodes, one chunk in flight while the host reads the one before: what the
    calibration stores, engine.decode_ms; the host's ms to dispatch one call, its Python work, the device idle when
    a chunk's device time is shorter). entry: an adaptive loop's menu entry, registered with `begin` outside the
    timing as generate does: a state of no call would make the timed call flatten the state and wait for the
    device's pick (~0.5 ms of host time a call on the CPU, session 37), which no decode pays."""
    decode = min(engine.decode_ms(loop, state, chunks)[0] for _ in range(2))
    times = []
    for _ in range(5):
        copy = jax.tree.map(jnp.copy, state)
        jax.block_until_ready(copy)
        if entry is not None:
            copy = loop.begin(copy, entry)
        t0 = time.perf_counter()
        out = loop(copy)
        times.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready(out.state)
    return decode, sorted(times)[len(times) // 2]


def kernel_profile(loop: engine.ChunkedLoop, state, chunk_steps: int) -> dict:
    """A one-step call of `loop`'s program on a copy of `state` under the profiler (engine.one_step_left, as
    spec_decode.py --profile takes it: where a command buffer replays the chunk's loop the trace holds about one of its
    iterations, so a whole chunk divided by its steps read ~8x low: 32 kernels and 0.065 ms a DDTree-8 step at batch 16
    on the H100 at 8b7e9be, whose body has 238 kernels), its set-up outside the loop counted once a chunk: kernel time
    per part of the step, the union of the kernel intervals (busy), kernels per step, and the largest kernels of the
    parts a step adds to the verify pass (profiling.profile_call). The state has run the program before (a replay)."""
    args = (loop.leaves, loop.loop_weights, engine.one_step_left(jax.tree.map(jnp.copy, state)))
    prof = profiling.profile_call(loop.program(state), args, steps_of=lambda out: out.state.step,
                                  call_steps=chunk_steps)  # the entry the state is forced to
    keep = ("drafter", "tree_accept_commit", "other")
    return {"busy_ms": prof["busy_ms"], "kernels_per_step": prof["kernels_per_step"],
            "components_ms": prof["components_ms"], "idle_gaps": prof["idle_gaps"][:6],
            "top_ops": {c: rows[:8] for c, rows in prof["top_ops"].items() if c in keep}}


def measure(target, drafter, prompts, *, menu, max_new_tokens: int, chunk_steps: int, repeats: int,
            profile: bool = False, hlo_dir=None) -> list:
    rows = []
    fixed, fixed_profiles, fixed_run = {}, {}, {}
    loops = {}
    for budget in menu:
        spec = engine.SpecConfig(budget=budget, max_new_tokens=max_new_tokens)
        state, loop_drafter = greedy_loop_state(target, drafter, prompts, spec, chunk_steps)
        loops[budget] = (engine.ChunkedLoop(target, loop_drafter, spec, chunk_steps), state)
    adaptive_spec = engine.SpecConfig(budget=max(menu), max_new_tokens=max_new_tokens, menu=tuple(menu))
    adaptive_state, adaptive_drafter = greedy_loop_state(target, drafter, prompts, adaptive_spec, chunk_steps)
    adaptive_state = engine.with_costs(adaptive_state, adaptive_spec, {"cost_ar": 1.0})
    adaptive = engine.ChunkedLoop(target, adaptive_drafter, adaptive_spec, chunk_steps)
    # Every program compiled at once (XLA compiles outside the GIL): on a GPU a program takes ~20-40 s.
    with concurrent.futures.ThreadPoolExecutor(len(loops) + 1) as pool:
        list(pool.map(lambda ls: ls[0].compile(ls[1]), list(loops.values()) + [(adaptive, adaptive_state)]))
    for budget in menu:
        loop, state = loops[budget]
        fixed[budget] = step_ms(loop, state, repeats)
        fixed_run[budget] = decode_and_host_ms(loop, state)
        if profile:
            fixed_profiles[budget] = kernel_profile(loop, state, chunk_steps)
    loop, state = adaptive, adaptive_state
    if hlo_dir:
        with open(os.path.join(hlo_dir, f"adaptive_b{len(prompts)}.hlo.txt"), "w") as f:
            f.write(loop.compiled.as_text() or "")

    def forced(entry):
        return state._replace(policy=state.policy._replace(force=jnp.int32(entry)))

    def row(name, budget, entry, fixed_ms, fixed_profile=None):
        r = {"step": name, "budget": budget, "fixed_ms": fixed_ms, "adaptive_ms": step_ms(loop, forced(entry), repeats)}
        r["fixed_decode_ms"], r["fixed_host_ms"] = fixed_run[budget]
        r["adaptive_decode_ms"], r["adaptive_host_ms"] = decode_and_host_ms(loop, forced(entry), entry=entry)
        if profile:
            r["adaptive_profile"] = kernel_profile(loop, forced(entry), chunk_steps)
            r["fixed_profile"] = fixed_profile
        return r

    rows.append(row("autoregressive (no drafter)", 0, len(menu), fixed[0], fixed_profiles.get(0)))
    for i, budget in enumerate(menu):
        if budget:
            rows.append(row(f"DDTree {budget}", budget, i, fixed[budget], fixed_profiles.get(budget)))
    return rows


def render(meta: dict, results: dict) -> str:
    lines = [f"# The adaptive budget's step against the fixed programs ({meta['device']})", "",
             f"{meta['date']} · commit {meta['commit']} · {meta['pair']} · {meta['dtype']} · greedy · "
             f"{meta['max_new_tokens']} new tokens · chunked loop of {meta['chunk_steps']} steps · per-step ms = "
             "(3 chained chunks - 1 chunk) / their steps, best of "
             f"{meta['repeats']}", ""]
    for batch, rows in results.items():
        lines += [f"## Batch {batch}", "", "| step | fixed program (ms) | adaptive program, forced (ms) | overhead | "
                  "decoding as run() does: fixed / adaptive (ms a step) | host ms a call: fixed / adaptive |",
                  "|---|---|---|---|---|---|"]
        for r in rows:
            fixed = r["fixed_ms"]
            over = f"{(r['adaptive_ms'] / fixed - 1) * 100:+.1f}%" if fixed else "-"
            lines.append(f"| {r['step']} | {fixed:.4f} |" if fixed else f"| {r['step']} | - |")
            lines[-1] += f" {r['adaptive_ms']:.4f} | {over} |"
            if "fixed_decode_ms" in r:
                lines[-1] += (f" {r['fixed_decode_ms']:.4f} / {r['adaptive_decode_ms']:.4f} |"
                              f" {r['fixed_host_ms']:.3f} / {r['adaptive_host_ms']:.3f} |")
        lines.append("")
        if any("adaptive_profile" in r for r in rows):
            lines += ["Kernels (a profiled one-step call of each program, its set-up outside the loop counted once a chunk; ms a "
                      "step): busy = union of the kernel intervals; the parts a step "
                      "adds to the verify pass.", "",
                      "| step | program | busy | kernels | drafter | tree, accept, commit | other |", "|---|---|---|---|---|---|---|"]
            for r in rows:
                for which in ("fixed", "adaptive"):
                    prof = r.get(f"{which}_profile")
                    if prof:
                        c = prof["components_ms"]
                        lines.append(f"| {r['step']} | {which} | {prof['busy_ms']:.4f} | {prof['kernels_per_step']:.0f} | "
                                     f"{c.get('drafter', 0):.4f} | {c.get('tree_accept_commit', 0):.4f} | "
                                     f"{c.get('other', 0):.4f} |")
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
    p.add_argument("--profile", action="store_true",
                   help="also profile one chunk of every row (kernels per step, busy time, parts; in the json)")
    p.add_argument("--dump-hlo", action="store_true", help="write each batch's adaptive program (HLO text) to --out")
    p.add_argument("--smoke", action="store_true", help="random tiny pair on the CPU, small sizes")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    target, drafter, tokenizer, pair = load_pair(args)
    if args.smoke:
        args.batch, args.menu, args.max_new_tokens, args.prompt_len, args.repeats = "2", "0,2,4", 16, 12, 1
    menu = [int(b) for b in args.menu.split(",")]
    if 0 not in menu:
        menu = [0] + menu
    out = args.out or (tempfile.mkdtemp(prefix="adaptive_overhead_") if args.smoke else
                       os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    os.makedirs(out, exist_ok=True)
    results = {}
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = [p.tolist() for p in heldout_prompts(tokenizer, batch, args.prompt_len)[0]]
        print(f"batch {batch} ...", file=sys.stderr, flush=True)
        results[batch] = measure(target, drafter, prompts, menu=menu, max_new_tokens=args.max_new_tokens,
                                 chunk_steps=args.chunk_steps, repeats=args.repeats, profile=args.profile,
                                 hlo_dir=out if args.dump_hlo else None)
    meta = {**base_meta(args, target, drafter, pair), "max_new_tokens": args.max_new_tokens,
            "chunk_steps": args.chunk_steps, "repeats": args.repeats, "menu": menu,
            "date": datetime.date.today().isoformat()}
    meta["dtype"] = str(target.dtype)
    meta["commit"] = os.environ.get("KDTREE_COMMIT") or meta.get("commit")
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
