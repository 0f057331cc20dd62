"""Which XLA settings let the adaptive budget's loop keep its control flow inside a CUDA graph and stay correct.

    python benchmarks/adaptive_command_buffers.py                 # the default pair, GPU: ~2 minutes
    python benchmarks/adaptive_command_buffers.py --smoke         # random tiny pair, CPU (the settings do not apply)

The adaptive loop (kdtree_jax/speculative/step.py) has loops of zero or one trip inside the decode loop. Written as
a flag that the body sets to False (until 928cff5), they ran wrongly inside a CUDA graph on an H200 (jaxlib 0.11.2):
wrong tokens and pool overflow with WHILE and CONDITIONAL captured, a hang with WHILE alone, correct only with the
loops run from the host (a host round trip each, the step ~2x the fixed program's). This runs one greedy batch
through the adaptive loop, forced to every menu entry and then free to choose, under each setting:

- `kernels`: command buffers for kernels only, the loops run from the host;
- `graphs`: WHILE and CONDITIONAL captured too (runtime.configure()'s setting, the engine's);

and checks each forced run's tokens against the fixed-budget program's (same tree, so the same tokens, in any
dtype), and times a step (3 chained chunks - 1 chunk, as engine.calibrate). Writes <out>/adaptive_command_buffers_
<device>.{md,json}.
"""

from __future__ import annotations

import argparse
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
import numpy as np  # noqa: E402

from kdtree_jax.speculative import engine  # noqa: E402
from spec_decode import base_meta, device_slug, greedy_loop_state, heldout_prompts, load_pair  # noqa: E402

# name: XLA options of the adaptive loop's program
SETTINGS = {
    "kernels": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL"},  # loops run from the host
    "graphs": {"xla_gpu_enable_command_buffer": ",".join(kdtree_jax.runtime.COMMAND_BUFFER_TYPES)},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=os.path.join(ROOT, "checkpoints", "default"),
                   help="the pair (default: the embedded checkpoints/default)")
    p.add_argument("--dtype", default="auto", help="the pair's dtype (auto: float32 on a CPU, as saved on a GPU)")
    p.add_argument("--batch", type=int, default=16, help="rows of the batch")
    p.add_argument("--menu", default="0,4,16", help="the adaptive menu")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each held-out prompt")
    p.add_argument("--max-new-tokens", type=int, default=96, help="the loop's output length")
    p.add_argument("--chunk-steps", type=int, default=8, help="steps per call of the chunked loop")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"which of {list(SETTINGS)}, comma-separated")
    p.add_argument("--out", default=None, help="results directory (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="random tiny pair on the CPU, small sizes")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    target, drafter, tokenizer, pair = load_pair(args)
    if args.smoke:
        args.batch, args.menu, args.max_new_tokens, args.prompt_len = 2, "0,2,4", 16, 12
    menu = tuple(sorted({0, *(int(b) for b in args.menu.split(","))}))
    prompts = [q.tolist() for q in heldout_prompts(tokenizer, args.batch, args.prompt_len)[0]]
    reference = {}
    for budget in menu:
        spec = engine.SpecConfig(budget=budget, max_new_tokens=args.max_new_tokens)
        state, loop_drafter = greedy_loop_state(target, drafter, prompts, spec)
        loop = engine.ChunkedLoop(target, loop_drafter, spec, args.chunk_steps)
        loop.compile(state)
        _, steps, final = engine.time_calls(loop, state, 3)
        reference[budget] = (np.asarray(final.out)[:, :args.max_new_tokens], steps)

    spec = engine.SpecConfig(budget=max(menu), max_new_tokens=args.max_new_tokens, menu=menu)
    state, loop_drafter = greedy_loop_state(target, drafter, prompts, spec)
    state = engine.with_costs(state, spec, {"cost_ar": 1.0, "cost_draft": 0.2,
                                            "cost_verify": [1.0 + 0.02 * b for b in menu]})
    loop = engine.ChunkedLoop(target, loop_drafter, spec, args.chunk_steps)
    rows = []
    for name in args.settings.split(","):
        options = SETTINGS[name] if jax.default_backend() == "gpu" else None
        lowered = loop.lower(state)
        t0 = time.perf_counter()
        compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        compile_s = time.perf_counter() - t0
        host_loops = kdtree_jax.runtime.host_driven_loops(compiled.as_text() or "") if jax.default_backend() == \
            "gpu" else None

        def call(s, compiled=compiled):
            return compiled(loop.leaves, loop.loop_weights, s)

        for entry, budget in list(enumerate(menu)) + [(None, "auto")]:
            forced = state if entry is None else state._replace(
                policy=state.policy._replace(force=jnp.int32(entry)))
            engine.time_calls(call, forced)  # warm-up
            short, long = engine.time_calls(call, forced, 1), engine.time_calls(call, forced, 3)
            ms, s3, final = engine.step_ms_between(short, long), long[1], long[2]
            out = np.asarray(final.out)[:, :args.max_new_tokens]
            if entry is None:
                same = int((out == reference[menu[-1]][0]).all(axis=1).sum())  # greedy: any tree, the same tokens?
            else:
                same = int((out == reference[budget][0]).all(axis=1).sum())
            chosen = np.asarray(final.policy.chosen).tolist()
            rows.append({"setting": name, "entry": str(budget), "step_ms": ms, "identical_rows": same,
                         "rows": len(prompts), "steps": s3, "chosen": chosen, "compile_s": compile_s,
                         "host_driven_loops": host_loops, "overflow": bool(final.cache.overflow)})
            print(f"{name:13s} {str(budget):>5s}: {ms:.4f} ms/step, identical {same}/{len(prompts)}, steps {s3}, "
                  f"chosen {chosen}, overflow {bool(final.cache.overflow)}", file=sys.stderr, flush=True)
    meta = {**base_meta(args, target, drafter, pair), "menu": list(menu), "batch": args.batch,
            "commit": os.environ.get("KDTREE_COMMIT") or base_meta(args, target, drafter, pair)["commit"],
            "date": datetime.date.today().isoformat(), "fixed_steps": {str(b): r[1] for b, r in reference.items()}}
    out_dir = args.out or tempfile.mkdtemp(prefix="adaptive_command_buffers_")
    os.makedirs(out_dir, exist_ok=True)
    name = f"adaptive_command_buffers_{'smoke_' if args.smoke else ''}{device_slug()}"
    lines = [f"# The adaptive loop under XLA command-buffer settings ({meta['device']})", "",
             f"{meta['date']} · commit {meta['commit']} · {pair} · batch {args.batch} · greedy · menu {list(menu)} · "
             "identical: rows whose tokens equal the fixed-budget program's (auto: budget "
             f"{menu[-1]}'s)", "", "| setting | entry | ms/step | identical | host-driven loops | overflow | compile s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['entry']} | {r['step_ms']:.4f} | {r['identical_rows']}/{r['rows']} | "
                     f"{r['host_driven_loops']} | {r['overflow']} | {r['compile_s']:.1f} |")
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
