"""The host's cost of each dispatch the server's decode thread makes (issue 45, item 3).

    python benchmarks/serve_dispatch.py                 # the embedded pair; float32 on a CPU, bfloat16 on a GPU
    python benchmarks/serve_dispatch.py --smoke         # a few repeats, a temporary directory

On the H200 (benchmarks/results/history/serve_host_h200_c0fbc86.md) the scheduler's decode thread was busy all the
time at concurrency 16 and ran 0.48x the engine's own loop: per chunk ~2.1 ms launching it, 0.8 ms per row reset,
3.5 ms per admission group, where the device's chunk took ~1.9 ms. This times each of those calls alone, on a
warmed-up scheduler (a fixed budget, every row holding a request), as the host's wall time of the call with the
device idle before it (the call returns once its work is enqueued; a chunk's launch also with the chunk before it in
flight, as the server launches), beside the floors of a dispatch with the same
arguments: a jitted function of the state returning a scalar, of the models and the state, and of the state donated.
A row reset is timed as the server makes it (`ChunkedLoop.reset_rows`, one and four rows), with a device scalar
made eagerly (how it was up to c0fbc86), and compiled without command buffers (`xla_gpu_enable_command_buffer=""`
and a large `xla_gpu_graph_min_graph_size`: whether updating a CUDA graph's arguments is what a small program's
launch costs). Then what the server's mix adds: a chunk's launch right after a row reset or an admission, the launch
and the launch-and-read cycle while another thread runs Python (the HTTP server's event loop holds the GIL up to the
switch interval), and a fresh executable's first calls (its command buffer recorded).

Writes <out>/serve_dispatch_<device>_<commit>.json (default benchmarks/results/history; --smoke: a temporary
directory) and prints each call's median and minimum ms.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build_parser() -> argparse.ArgumentParser:
    from kdtree_jax.checkpoint import add_dtype_argument

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="default: the embedded pair")
    p.add_argument("--max-batch", type=int, default=16, help="the server's --max-batch (default 16)")
    p.add_argument("--max-len", type=int, default=256, help="the server's --max-len (default 256)")
    p.add_argument("--budget", type=int, default=8, help="a fixed DDTree budget (default 8; 0: autoregressive)")
    p.add_argument("--repeats", type=int, default=30, help="calls timed per measurement (default 30)")
    p.add_argument("--switch-ms", type=lambda v: [float(x) for x in v.split(",")], default=[5, 0.5, 0.1, 0.02],
                   help="interpreter switch intervals (ms) to time the calls at beside a busy thread (default 5,0.5,0.1,0.02)")
    p.add_argument("--busy-duty", type=lambda v: [float(x) for x in v.split(",")], default=[1.0, 0.3],
                   help="shares of the time the other thread runs Python (default 1,0.3)")
    add_dtype_argument(p, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--out", default=None, help="output directory (default: benchmarks/results/history)")
    p.add_argument("--smoke", action="store_true", help="a small batch, a few repeats, a temporary directory")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.max_batch, args.max_len, args.repeats = 2, 64, 3
    from kdtree_jax import runtime

    runtime.configure()  # as the server does: on a GPU the chunk's loop is a command buffer
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kdtree_jax import provenance
    from kdtree_jax.generate import DEFAULT_CHECKPOINT, load_models
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.speculative import admission

    target, drafter, tokenizer, _, recommended = load_models(args.checkpoint or DEFAULT_CHECKPOINT, args.dtype)
    batch = args.max_batch
    settings = sched.Settings(max_batch=batch, max_len=args.max_len, budget=args.budget, tree_temperature=recommended,
                              row_programs=False, admit_groups=False, warmup_prompt_tokens=16, max_queue=1000)
    s = sched.Scheduler(target, drafter, settings, Metrics())
    t = time.perf_counter()
    if not s.warmup():
        raise SystemExit("serve_dispatch: the warm-up stopped")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform,
            "commit": provenance.git_commit(),
            "command": "python benchmarks/serve_dispatch.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "max_batch": batch, "max_len": args.max_len, "budget": args.budget, "dtype": str(target.dtype),
            "warmup_s": time.perf_counter() - t}
    b = s.bucket
    prompt = tokenizer.encode("def fibonacci(n):")
    meta["arguments"] = {"models": len(b.loop.leaves), "loop_weights": len(jax.tree.leaves(b.loop.loop_weights)),
                         "state": len(jax.tree.leaves(b.state))}
    rows = {}

    def fill():
        """Every row holding a fresh request (the state idle on the device)."""
        b.inflight.clear()
        b.owner = [None] * batch
        b.admit([sched.Request(prompt=prompt, max_tokens=s.max_tokens_for(len(prompt)), emit=lambda *a: None)
                 for _ in range(batch)])
        b.firsts = []
        jax.block_until_ready(b.state)

    def timed(name, call, idle=True):
        """call()'s host wall time (or the seconds it returns), `args.repeats` times, the device idle before each
        (idle=False: as it comes)."""
        times = []
        for _ in range(args.repeats):
            if idle:
                jax.block_until_ready(b.state)
            t0 = time.perf_counter()
            part = call()
            times.append(part if isinstance(part, float) else time.perf_counter() - t0)
        jax.block_until_ready(b.state)
        rows[name] = {"median_ms": 1e3 * float(np.median(times)), "min_ms": 1e3 * float(min(times))}
        print(f"{name:52s} {rows[name]['median_ms']:8.3f} ms (min {rows[name]['min_ms']:.3f})", flush=True)

    def launch_dropped():
        b.launch()
        b.inflight.clear()

    def launch_and_wait():
        b.launch()
        jax.block_until_ready(b.inflight.pop()[0].tokens)

    def launch_pipelined():
        """The server's cycle (launch chunk i + 1, then read chunk i): -> the launch's seconds. Its outputs live beside
        the chunk before's, so their buffers are not the last call's (a CUDA graph's arguments then change)."""
        t0 = time.perf_counter()
        b.launch()
        seconds = time.perf_counter() - t0
        while len(b.inflight) > 1:
            jax.device_get(b.inflight.popleft()[0].tokens)
        return seconds

    def drain():
        while b.inflight:
            jax.device_get(b.inflight.popleft()[0].tokens)

    def cycle():
        """The server's cycle as a whole: launch chunk i + 1, read chunk i (its wait for the device included)."""
        b.launch()
        while len(b.inflight) > 1:
            jax.device_get(b.inflight.popleft()[0].tokens)

    fill()
    timed(f"launch a chunk ({batch} rows)", launch_dropped)
    fill()
    timed("launch a chunk and wait for it", launch_and_wait)
    fill()
    timed("launch a chunk with one in flight (the launch alone)", launch_pipelined, idle=False)
    fill()
    timed("a chunk's cycle (launch, read the one before)", cycle, idle=False)
    fill()
    b.launch()
    last_out = b.inflight.pop()[0]
    timed("the chunk's host view (one packed array, scheduler.host_view)", lambda: sched.host_view(last_out))
    view = sched.host_view(last_out)
    timed("read a chunk's tokens, start and num_out (three arrays, up to 08038bc)",
          lambda: jax.device_get((last_out.tokens, last_out.start, last_out.num_out)))
    timed("read a chunk's host view (one array)", lambda: jax.device_get(view))
    last = batch - 1
    timed("reset_rows, one row (the server's)", lambda: setattr(b, "state", b.loop.reset_rows(b.state, [last])))
    four = list(range(max(0, batch - 4), batch))
    timed(f"reset_rows, {len(four)} rows (one dispatch)",
          lambda: setattr(b, "state", b.loop.reset_rows(b.state, four)))
    one_row = jax.jit(admission._reset_row_state, donate_argnums=0)  # up to c0fbc86: a row index on the device
    timed("reset a row, the row an eager device scalar (up to c0fbc86)",
          lambda: setattr(b, "state", one_row(b.state, jnp.int32(last))))
    timed("reset a row, the row a numpy scalar", lambda: setattr(b, "state", one_row(b.state, np.int32(last))))
    mask = np.arange(batch) == last
    for label, options in (("min_graph_size 1e6", {"xla_gpu_graph_min_graph_size": 1000000}),
                           ("no command buffers", {"xla_gpu_enable_command_buffer": ""})):
        plain = jax.jit(admission._reset_rows_state, donate_argnums=0, compiler_options=options)
        b.state = jax.block_until_ready(plain(b.state, mask))  # its compile, untimed
        timed(f"reset_rows, one row, compiled with {label}", lambda: setattr(b, "state", plain(b.state, mask)))
    scalar_of_state = jax.jit(lambda state: state.step + 1)
    timed("floor: jit(state) -> scalar", lambda: scalar_of_state(b.state))
    scalar_of_all = jax.jit(lambda leaves, weights, state: state.step + 1)
    timed("floor: jit(models, weights, state) -> scalar",
          lambda: scalar_of_all(b.loop.leaves, b.loop.loop_weights, b.state))
    donated = jax.jit(lambda state: state._replace(step=state.step + 1), donate_argnums=0)
    timed("floor: jit(state donated) -> state", lambda: setattr(b, "state", donated(b.state)))

    def admit_one():
        b.owner[last] = None
        b.admit([sched.Request(prompt=prompt, max_tokens=8, emit=lambda *a: None)])
        b.firsts = []

    timed("admit one prompt (its row's reset included)", admit_one)

    # What the server's mix of programs costs a chunk's launch: the launch right after another program ran on the
    # state (a row reset, an admission), with the chunk before in flight as the server runs it, and the first call
    # of a program against its repeats (a command buffer recorded, then only updated or replayed).
    def launch_after(between):
        def between_then_launch():
            between()
            return launch_pipelined()
        return between_then_launch

    fill()
    timed("launch with one in flight, after a reset_rows", launch_after(
        lambda: setattr(b, "state", b.loop.reset_rows(b.state, [last]))), idle=False)
    fill()
    timed("launch with one in flight, after an admission", launch_after(admit_one), idle=False)
    drain()
    # The HTTP server's event loop shares the GIL with the decode thread: the launch, a read of a chunk already done,
    # and the whole cycle while another thread runs Python all the time or a share of it (work, then a sleep), at the
    # interpreter's default switch interval (5 ms: a thread that asked for the GIL may wait that long) and shorter.
    busy = threading.Event()

    def python_work(duty):
        while not busy.is_set():
            t_work = time.perf_counter()
            while time.perf_counter() - t_work < 0.001:
                json.dumps({"id": 1, "choices": [{"text": "x" * 32, "index": 0}]})
            if duty < 1:
                time.sleep(0.001 * (1 - duty) / duty)

    def read_done():
        """The server's read of a chunk already done (its host view)."""
        b.launch()
        view = b.inflight.pop()[1]
        jax.block_until_ready(view)
        t0 = time.perf_counter()
        jax.device_get(view)
        return time.perf_counter() - t0

    default_interval = sys.getswitchinterval()
    for duty in args.busy_duty:
        for interval_ms in args.switch_ms:
            sys.setswitchinterval(interval_ms / 1e3)
            busy.clear()
            worker = threading.Thread(target=python_work, args=(duty,), daemon=True)
            worker.start()
            label = f"a thread busy {duty:.0%} of the time, switch {interval_ms:g} ms"
            fill()
            timed(f"launch with one in flight, {label}", launch_pipelined, idle=False)
            fill()
            timed(f"read a finished chunk's host view, {label}", read_done)
            fill()
            timed(f"a chunk's cycle, {label}", cycle, idle=False)
            busy.set()
            worker.join()
    sys.setswitchinterval(default_interval)
    drain()
    fill()
    fresh = b.loop.lower(b.state).compile()  # the same chunk program, a new executable: nothing recorded yet
    firsts = []
    for _ in range(3):
        jax.block_until_ready(b.state)
        t0 = time.perf_counter()
        out = fresh(b.loop.leaves, b.loop.loop_weights, b.state)
        firsts.append(1e3 * (time.perf_counter() - t0))
        b.state = out.state
    jax.block_until_ready(b.state)
    rows["a fresh chunk executable's calls 1, 2, 3 (device idle)"] = {"calls_ms": firsts}
    print(f"{'a fresh chunk executable: calls 1, 2, 3':52s} " + ", ".join(f"{x:.3f}" for x in firsts) + " ms",
          flush=True)
    out_dir = args.out or (provenance.smoke_dir("serve_dispatch") if args.smoke
                           else os.path.join(ROOT, "benchmarks", "results", "history"))
    os.makedirs(out_dir, exist_ok=True)
    device = meta["device"].lower().replace(" ", "_") if meta["platform"] == "gpu" else "cpu"
    path = os.path.join(out_dir, f"serve_dispatch_{device}_{meta['commit'].replace('+', '_')}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "calls": rows}, f, indent=1)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
