"""The server at the loop's speed (issue 45, item 3): the server against the decode loop on the same prompts, in one
call, and where the decode thread's time goes.

    python benchmarks/serve_host.py                       # CPU defaults (the embedded pair, the server's defaults)
    python benchmarks/serve_host.py --no-http             # in-process only (no server subprocess, no HTTP client)
    python benchmarks/serve_host.py --smoke               # tiny: seconds, a temporary directory
    python benchmarks/serve_host.py --stream-ab 8         # the single stream alone, interleaved A/B in one process

Three comparisons, each against the same engine in the same process:

1. A single stream: `python -m kdtree_jax.generate` (a subprocess, --json: its decode tok/s) and the scheduler
   in-process (kdtree_jax.serve.scheduler, the server's settings) and, unless --no-http, a `python -m kdtree_jax.serve`
   subprocess over HTTP, all on the same prompt and token count, greedy. A stream's tok/s: (tokens - 1) / (last token
   - first token), as the CLI's decode tok/s leaves out its prefill.
2. Concurrency C (default 16): the load test's seeded request list (benchmarks/serve_load.py: prompts of 8-64
   held-out tokens, max_tokens 16-96, greedy), C in flight at a time, through the scheduler in-process (and over
   HTTP), against `spec_decode.refill_pass` (the loop of `spec_decode.py --refill`: the same prompts through a batch
   of --max-batch rows, a row refilled as soon as the chunk that finished it is read, nothing else on the host) with
   the greedy program spec_decode compiles. Throughput = completion tokens / wall time; TTFT p50 of the scheduler's
   requests against a chunk's time (the loop's mean).
3. The decode thread's profile (scheduler.HostSpans: seconds by phase, /metrics' decode_thread_seconds_total) for
   each scheduler run.

`--load-ab N` measures only the concurrency run in-process, in N interleaved rounds: the scheduler with admission
groups against one admitting a prompt at a time (<out>/serve_host_load_ab_<device>_<commit>[_<label>].json).
`--stream-ab N` measures only the single stream, in N interleaved rounds in one process (a shared machine's load
moves between runs minutes apart): generate as the CLI calls it and with the server's chunk length, the scheduler as
it serves and without a lone row's long chunk (Settings.lone_chunk_steps = 0); it writes
<out>/serve_host_ab_<device>_<commit>[_<label>].json with each one's median ratio to the CLI call's tok/s.

Writes <out>/serve_host_<device>_<commit>[_<label>].json (default benchmarks/results/history; --smoke: a temporary
directory) and prints a summary. `--report OUT.md RUN.json ...` writes the markdown table of several runs (before /
after, alternating on a shared machine) with each run's top decode-thread spans.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)


def build_parser() -> argparse.ArgumentParser:
    from kdtree_jax.checkpoint import add_dtype_argument

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="default: the embedded pair")
    p.add_argument("--prompt", default="def fibonacci(n):", help="the single stream's prompt")
    p.add_argument("--stream-tokens", type=int, default=600, help="the single stream's max_tokens")
    p.add_argument("--requests", type=int, default=48, help="requests of the concurrency run")
    p.add_argument("--concurrency", type=int, default=16,
                   help="requests in flight at once in the load part (default 16)")
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (and the loop's batch)")
    p.add_argument("--max-len", type=int, default=1024, help="the server's --max-len")
    p.add_argument("--chunk-steps", type=int, default=None, help="default: the server's")
    p.add_argument("--prompt-len", default="8,64",
                   help="MIN,MAX prompt tokens of the load part's seeded mixed-length requests (default 8,64)")
    p.add_argument("--max-new-tokens", default="16,96",
                   help="MIN,MAX new tokens of the load part's requests (default 16,96)")
    add_dtype_argument(p, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--no-http", action="store_true", help="skip the server subprocess runs")
    p.add_argument("--lone-row-programs", action=argparse.BooleanOptionalAction, default=None,
                   help="the adaptive budget's row programs (the server's --lone-row-programs) in-process and over "
                        "HTTP, or not (default: the server's own, on a GPU)")
    p.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)),
                   help="the HTTP concurrency run's client processes (serve_load.py's --client-processes: one Python "
                        "client reads a few thousand streamed events a second)")
    p.add_argument("--engine-process", action="store_true",
                   help="the HTTP runs twice: the server as it is by default (its decode loop on a thread of the HTTP "
                        "process) and with --engine-process (the decode loop in a process of its own), in that order")
    p.add_argument("--no-cli", action="store_true", help="skip the generate subprocess (the in-process call stays)")
    p.add_argument("--label", default="", help="a name for this run in the output (before / after)")
    p.add_argument("--out", default=None, help="output directory (default: benchmarks/results/history)")
    p.add_argument("--smoke", action="store_true", help="a few short requests")
    p.add_argument("--report", nargs="+", metavar=("OUT.md", "RUN.json"), default=None,
                   help="write OUT.md from these runs' JSONs (nothing is measured)")
    p.add_argument("--title", default="", help="with --report: the title's tail")
    p.add_argument("--load-ab", type=int, default=0, metavar="N",
                   help="only the concurrency run in-process, N interleaved rounds: the scheduler with admission "
                        "groups and admitting one prompt at a time; throughput, TTFT p50 and their median ratios")
    p.add_argument("--stream-ab", type=int, default=0, metavar="N",
                   help="only the single stream, N interleaved rounds in one process: generate (the CLI's call and "
                        "chunk) and with the server's chunk, the scheduler as it serves and without a lone row's "
                        "long chunk; the median ratios to generate's tok/s")
    return p


def _stream_tps(times: list) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else float("nan")


def spans_table(snap: dict, wall: float) -> list:
    """[(phase, seconds, calls, share of wall)] largest first."""
    rows = [(k, s, n, s / wall if wall else float("nan")) for k, (s, n) in snap.items()]
    return sorted(rows, key=lambda r: -r[1])


class Driver:
    """Requests through an in-process scheduler, `concurrency` in flight: per request the time of every token."""

    def __init__(self, scheduler):
        self.s = scheduler

    def run(self, requests: list, concurrency: int) -> dict:
        from kdtree_jax.serve import scheduler as sched

        lock = threading.Condition()
        pending = list(range(len(requests)))[::-1]
        results = [None] * len(requests)
        state = {"running": 0}

        def submit(i):
            r = requests[i]
            sent = time.perf_counter()
            times, ids = [], []

            def emit(kind, value, i=i, times=times, ids=ids, sent=sent):
                if kind == "tokens":
                    now = time.perf_counter()
                    ids.extend(value)
                    times.extend([now] * len(value))
                    return
                with lock:
                    results[i] = {"sent": sent, "times": times, "ids": ids, "end": kind}
                    state["running"] -= 1
                    lock.notify()

            state["running"] += 1
            self.s.submit(sched.Request(prompt=list(r["prompt"]), max_tokens=r["max_tokens"], emit=emit))

        t0 = time.perf_counter()
        with lock:
            while pending or state["running"]:
                while pending and state["running"] < concurrency:
                    submit(pending.pop())
                lock.wait(1.0)
        wall = time.perf_counter() - t0
        tokens = sum(len(r["ids"]) for r in results)
        ttft = [r["times"][0] - r["sent"] for r in results if r["times"]]
        return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                "ttft_p50_ms": 1e3 * float(np.median(ttft)), "ttft_p90_ms": 1e3 * float(np.percentile(ttft, 90)),
                "outputs": [r["ids"] for r in results],
                "stream_tps": [_stream_tps(r["times"]) for r in results]}


def loop_refill(target, drafter, requests: list, batch: int, max_len: int, chunk_steps: int) -> dict:
    """spec_decode.py --refill's loop on these requests (each its own max_tokens), greedy, the refusal's
    autoregressive program or the fixed budget the server runs: -> tok/s, chunks, a chunk's ms. spec_decode.run_refill
    warms every program the timed pass runs (each prefill bucket's admission included) before the clock."""
    from spec_decode import run_refill

    stats, tokens = run_refill(target, None, [r["prompt"] for r in requests], batch=batch, tree="ar", budget=0, topk=4,
                               temperature=0.0, top_k=0, top_p=1.0, seed=0, impl="auto", chunk_steps=chunk_steps,
                               max_new_tokens=[r["max_tokens"] for r in requests], max_len=max_len)
    wall, chunks = stats["timed_seconds"], stats["chunks"]
    return {"wall_s": wall, "tokens": stats["new_tokens"], "tokens_per_s": stats["tokens_per_second"],
            "chunks": chunks, "steps": stats["target_forwards"], "chunk_ms": 1e3 * wall / chunks,
            "admission_host_s": stats["admission_host_seconds"], "outputs": tokens}


def group_sizes(batch: int) -> tuple:
    """The server's admission group sizes at this --max-batch (scheduler.admit_group_sizes; (1,) before it)."""
    from kdtree_jax.serve import scheduler as sched

    return sched.admit_group_sizes(batch) if hasattr(sched, "admit_group_sizes") else (1,)


def cli_stream(args, checkpoint: str) -> dict:
    cmd = [sys.executable, "-m", "kdtree_jax.generate", "--prompt", args.prompt, "--max-new-tokens",
           str(args.stream_tokens), "--temperature", "0", "--repetition-penalty", "1", "--json",
           "--checkpoint", checkpoint]  # plain greedy, as serve_load's requests ask: not the checkpoint's settings
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"generate failed: {out.stderr[-2000:]}")
    stats = json.loads(out.stdout.strip().splitlines()[-1])["stats"]
    return {"command": " ".join(cmd[1:]), "tokens_per_s": stats["tokens_per_second"], "tokens": stats["new_tokens"],
            "decoding": stats["decoding"], "steps_without_drafter": stats.get("budget_policy", {}).get(
                "steps_without_drafter")}


def http_runs(args, checkpoint: str, stream_ids: list, requests: list, engine_process: bool = False) -> dict:
    """The server subprocess (engine_process: with --engine-process): the single stream, then the concurrency run,
    and its decode thread's spans."""
    import httpx

    import serve_load
    from kdtree_jax.serve.metrics import parse

    ns = argparse.Namespace(max_batch=args.max_batch, max_len=args.max_len, dtype=args.dtype, checkpoint=checkpoint,
                            chunk_steps=args.chunk_steps, budget=None, calibrate=False,
                            lone_row_programs=args.lone_row_programs, engine_process=engine_process)
    log = tempfile.mktemp(prefix="serve_host_", suffix=".log")
    proc, url = serve_load.launch_server("speculative", ns, log)
    out = {}
    try:
        serve_load.wait_ready("speculative", proc, url, log, 600)
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        from kdtree_jax.speculative.admission import prompt_bucket
        seen = {}
        for r in requests + [{"prompt": stream_ids}]:
            seen.setdefault(prompt_bucket(len(r["prompt"]), args.max_len), r)
        for r in seen.values():  # every prefill bucket and its admission groups
            for k in group_sizes(args.max_batch):
                asyncio.run(serve_load.run_level(url, [{"prompt": r["prompt"], "max_tokens": 4}] * k, k, model))

        def spans():
            m = parse(httpx.get(url + "/metrics", timeout=30).text)
            sec = {k.split('"')[1]: v for k, v in m.items() if k.startswith("decode_thread_seconds_total")}
            calls = {k.split('"')[1]: v for k, v in m.items() if k.startswith("decode_thread_calls_total")}
            return {k: (sec[k], calls.get(k, 0)) for k in sec}, m

        before, m0 = spans()
        res, wall, _ = asyncio.run(serve_load.run_level(url, [{"prompt": stream_ids,
                                                                "max_tokens": args.stream_tokens}], 1, model))
        after, _ = spans()
        r = res[0]
        out["stream"] = {"tokens": r["tokens"], "tokens_per_s": (r["tokens"] - 1) / (r["end"] - r["ttft"]),
                         "ttft_ms": 1e3 * r["ttft"], "wall_s": wall,
                         "spans": {k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1])
                                   for k, v in after.items()}}
        before = after
        # The concurrency run's client in several processes (serve_load.drive): one Python client reads a few thousand
        # streamed events a second, under a GPU server's rate at concurrency 16.
        res, wall, occupancy = serve_load.drive(url, requests, args.concurrency, model,
                                                processes=args.client_processes)
        after, m1 = spans()
        ok = [r for r in res if "error" not in r]
        tokens = sum(r["tokens"] for r in ok)
        out["concurrent"] = {"tokens": tokens, "tokens_per_s": tokens / wall, "wall_s": wall,
                             "errors": len(res) - len(ok),
                             "ttft_p50_ms": 1e3 * float(np.median([r["ttft"] for r in ok])),
                             "mean_occupancy": float(np.mean(occupancy)) if occupancy else float("nan"),
                             "compiles": int(m1["compiles_total"] - m0["compiles_total"]),
                             "spans": {k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1])
                                       for k, v in after.items()}}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.report:
        out, *paths = args.report
        runs = []
        for path in paths:
            with open(path) as f:
                runs.append(json.load(f))
        write_report(out, runs, args.title)
        print(f"wrote {out}", file=sys.stderr)
        return 0
    if args.smoke:
        args.stream_tokens, args.requests, args.concurrency = 24, 6, 3
        args.max_batch, args.max_len, args.max_new_tokens, args.prompt_len = 2, 128, "4,8", "8,16"
        args.no_cli = True
    from kdtree_jax import runtime
    runtime.configure()  # before JAX starts, as the server and the CLI do: on a GPU the loop stays on the device
    from kdtree_jax.serve.__main__ import SWITCH_INTERVAL_S

    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as the server's process: its decode thread shares the GIL
    import jax

    import serve_load
    from kdtree_jax import provenance
    from kdtree_jax.generate import DEFAULT_CHECKPOINT, load_models
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.speculative import engine

    checkpoint = args.checkpoint or DEFAULT_CHECKPOINT
    target, drafter, tokenizer, _, recommended = load_models(checkpoint, args.dtype)
    settings = sched.Settings(max_batch=args.max_batch, max_len=args.max_len,
                              calibration_prompt=tuple(tokenizer.encode(sched.CALIBRATION_TEXT)),
                              tree_temperature=recommended,
                              chunk_steps=args.chunk_steps or sched.Settings.chunk_steps, max_queue=100000,
                              adaptive_row_programs=args.lone_row_programs)
    stream_ids = tokenizer.encode(args.prompt)
    docs = serve_load.corpus_docs(os.path.join(checkpoint, "tokenizer"), serve_load._pair(args.prompt_len, "")[1] + 1)
    requests = serve_load.make_requests(args.requests, serve_load._pair(args.prompt_len, ""),
                                        serve_load._pair(args.max_new_tokens, ""), 0, docs)
    result = {"meta": {"date": datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"),
                       "device": jax.devices()[0].platform, "commit": provenance.git_commit(),
                       "command": "python benchmarks/serve_host.py " + " ".join(argv if argv is not None
                                                                                else sys.argv[1:]),
                       "label": args.label, "max_batch": args.max_batch, "max_len": args.max_len,
                       "chunk_steps": settings.chunk_steps, "requests": args.requests,
                       "concurrency": args.concurrency, "stream_tokens": args.stream_tokens,
                       "client_processes": args.client_processes,
                       "loadavg_before": os.getloadavg()[0]}}
    print(f"[serve_host {args.label}: {result['meta']['commit']}]", file=sys.stderr, flush=True)

    if args.stream_ab:
        result["stream_ab"] = stream_ab(args, target, drafter, settings, stream_ids, recommended)
        return _write(args, result, "ab")
    if args.load_ab:
        result["load_ab"] = load_ab(args, target, drafter, settings, requests)
        return _write(args, result, "load_ab")

    # -- the scheduler in-process ------------------------------------------------------------------------------
    metrics = Metrics()
    s = sched.Scheduler(target, drafter, settings, metrics)
    fits = s.max_tokens_for(len(stream_ids))
    if args.stream_tokens > fits:  # before the warm-up: the server would refuse the stream, and no token would be timed
        raise SystemExit(f"serve_host: --stream-tokens {args.stream_tokens} does not fit --max-len {args.max_len} after "
                         f"the prompt's {len(stream_ids)} tokens; at most {fits}")
    t = time.perf_counter()
    s.start(warmup=True)
    s.ready.wait()
    if s.warmup_error is not None:
        raise s.warmup_error
    drv = Driver(s)
    seen = {}
    from kdtree_jax.speculative.admission import prompt_bucket
    for r in requests + [{"prompt": stream_ids}]:
        seen.setdefault(prompt_bucket(len(r["prompt"]), args.max_len), r)
    drv.run([{"prompt": r["prompt"], "max_tokens": 4} for r in seen.values()], 1)  # every prefill bucket
    for r in seen.values():  # and its admission groups (a burst of k is admitted together)
        for k in group_sizes(args.max_batch):
            drv.run([{"prompt": r["prompt"], "max_tokens": 4}] * k, k)
    drv.run([{"prompt": stream_ids, "max_tokens": 4}] * (args.max_batch + 1), args.max_batch + 1)
    result["meta"]["scheduler_warmup_s"] = time.perf_counter() - t
    compiles = sched.compile_count()
    try:
        s.spans.reset()
        one = drv.run([{"prompt": stream_ids, "max_tokens": args.stream_tokens}], 1)
        result["stream_scheduler"] = {"tokens": one["tokens"], "tokens_per_s": one["stream_tps"][0],
                                      "ttft_ms": one["ttft_p50_ms"], "wall_s": one["wall_s"],
                                      "spans": s.spans.snapshot()}
        print(f"  scheduler single stream: {one['stream_tps'][0]:.1f} tok/s", file=sys.stderr, flush=True)
        s.spans.reset()
        many = drv.run(requests, args.concurrency)
        result["concurrent_scheduler"] = {k: many[k] for k in ("wall_s", "tokens", "tokens_per_s", "ttft_p50_ms",
                                                               "ttft_p90_ms")}
        result["concurrent_scheduler"]["spans"] = s.spans.snapshot()
        result["concurrent_scheduler"]["compiles"] = sched.compile_count() - compiles
        print(f"  scheduler c={args.concurrency}: {many['tokens_per_s']:.1f} tok/s, TTFT p50 "
              f"{many['ttft_p50_ms']:.0f} ms", file=sys.stderr, flush=True)
    finally:
        s.stop(drain=False, timeout=60)

    # -- the loop (spec_decode --refill's) and generate on the same inputs ---------------------------------------
    ref = loop_refill(target, drafter, requests, args.max_batch, args.max_len, settings.chunk_steps)
    result["concurrent_loop"] = {k: ref[k] for k in ("wall_s", "tokens", "tokens_per_s", "chunks", "steps",
                                                     "chunk_ms", "admission_host_s")}
    result["concurrent_identical"] = sum(a == b for a, b in zip(many["outputs"], ref["outputs"]))
    print(f"  loop refill: {ref['tokens_per_s']:.1f} tok/s, a chunk {ref['chunk_ms']:.1f} ms; outputs identical "
          f"{result['concurrent_identical']} of {len(requests)}", file=sys.stderr, flush=True)
    gen = engine.generate(target, drafter, [stream_ids], max_new_tokens=args.stream_tokens,
                          tree_temperature=recommended)
    gen = engine.generate(target, drafter, [stream_ids], max_new_tokens=args.stream_tokens,
                          tree_temperature=recommended)
    result["stream_generate"] = {"tokens_per_s": gen.stats["tokens_per_second"], "decoding": gen.stats["decoding"]}
    for _ in range(2):  # the autoregressive stream through the same engine (the second call: compiled)
        ar = engine.generate(target, drafter, [stream_ids], max_new_tokens=args.stream_tokens, budget=0,
                             tree_temperature=recommended)
    result["stream_generate_ar"] = {"tokens_per_s": ar.stats["tokens_per_second"], "decoding": ar.stats["decoding"]}
    print(f"  generate: {gen.stats['tokens_per_second']:.1f} tok/s, autoregressive "
          f"{ar.stats['tokens_per_second']:.1f} tok/s", file=sys.stderr, flush=True)
    result["stream_identical"] = gen.tokens[0] == one["outputs"][0]
    if not args.no_cli:
        result["stream_cli"] = cli_stream(args, checkpoint)
        print(f"  CLI: {result['stream_cli']['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    if not args.no_http:
        result["http"] = http_runs(args, checkpoint, stream_ids, requests)
        print(f"  HTTP: stream {result['http']['stream']['tokens_per_s']:.1f} tok/s, c={args.concurrency} "
              f"{result['http']['concurrent']['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        if args.engine_process:
            result["http_engine"] = http_runs(args, checkpoint, stream_ids, requests, engine_process=True)
            print(f"  HTTP, engine process: stream {result['http_engine']['stream']['tokens_per_s']:.1f} tok/s, "
                  f"c={args.concurrency} {result['http_engine']['concurrent']['tokens_per_s']:.1f} tok/s",
                  file=sys.stderr, flush=True)
    return _write(args, result)


def _write(args, result: dict, kind: str = "") -> int:
    result["meta"]["loadavg_after"] = os.getloadavg()[0]
    out_dir = args.out or (tempfile.mkdtemp(prefix="serve_host_smoke_") if args.smoke
                           else os.path.join(ROOT, "benchmarks", "results", "history"))
    os.makedirs(out_dir, exist_ok=True)
    name = f"serve_host{'_' + kind if kind else ''}_{result['meta']['device']}_"
    name += result["meta"]["commit"].replace("+", "_") + (f"_{args.label}" if args.label else "")
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    print(ab_summary(result["stream_ab"]) if kind == "ab" else load_ab_summary(result["load_ab"]) if kind == "load_ab"
          else summary(result))
    print(f"wrote {os.path.join(out_dir, name)}.json", file=sys.stderr)
    return 0


def stream_ab(args, target, drafter, settings, stream_ids: list, recommended: float) -> dict:
    """The single stream, `args.stream_ab` interleaved rounds in this process (a shared machine's load moves between
    runs minutes apart, less within a round): engine.generate as the CLI calls it (on_tokens: its 8-step chunks) and
    with the server's chunk, the scheduler as it serves (a lone row's long chunk) and with lone_chunk_steps=0 (every
    chunk the server's short one). -> tok/s per variant and round, the median ratio of each to the CLI call's."""
    import dataclasses

    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.speculative import engine

    n = args.stream_tokens

    def gen(steps=None):
        return engine.generate(target, drafter, [stream_ids], max_new_tokens=n, tree_temperature=recommended,
                               chunk_steps=steps, on_tokens=lambda row, ids: None).stats["tokens_per_second"]

    drivers = {}
    for name, lone in (("scheduler", settings.lone_chunk_steps), ("scheduler, short chunks only", 0)):
        s = sched.Scheduler(target, drafter, dataclasses.replace(settings, lone_chunk_steps=lone), Metrics())
        s.start(warmup=True)
        s.ready.wait()
        if s.warmup_error is not None:
            raise s.warmup_error
        drivers[name] = Driver(s)
        drivers[name].run([{"prompt": stream_ids, "max_tokens": 4}], 1)
    short = f"generate, {settings.chunk_steps}-step chunks"
    gen(), gen(settings.chunk_steps)  # their compiles
    runs: dict = {}
    try:
        for r in range(args.stream_ab):
            row = {"generate (the CLI's call)": gen()}
            for name, drv in drivers.items():
                row[name] = drv.run([{"prompt": stream_ids, "max_tokens": n}], 1)["stream_tps"][0]
            row[short] = gen(settings.chunk_steps)
            for k, v in row.items():
                runs.setdefault(k, []).append(v)
            print(f"  round {r}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()), file=sys.stderr, flush=True)
    finally:
        for drv in drivers.values():
            drv.s.stop(drain=False, timeout=60)
    cli = np.array(runs["generate (the CLI's call)"])
    return {"rounds": args.stream_ab, "tokens": n, "chunk_steps": settings.chunk_steps,
            "lone_chunk_steps": settings.lone_chunk_steps, "tokens_per_s": runs,
            "median_tokens_per_s": {k: float(np.median(v)) for k, v in runs.items()},
            "median_ratio": {k: float(np.median(np.array(v) / cli)) for k, v in runs.items()}}


def load_ab(args, target, drafter, settings, requests: list) -> dict:
    """The concurrency run in-process, `args.load_ab` interleaved rounds: the scheduler with admission groups (as it
    serves) and admitting one prompt at a time (Settings.admit_groups=False), each warmed up on every prompt bucket
    and group. -> per variant and round: tok/s, TTFT p50 / p90 ms, group dispatches; the median ratios (groups / one
    at a time) of the paired rounds."""
    import dataclasses

    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.speculative.admission import prompt_bucket

    seen = {}
    for r in requests:
        seen.setdefault(prompt_bucket(len(r["prompt"]), args.max_len), r)
    drivers = {}
    for name, groups in (("groups", True), ("one at a time", False)):
        s = sched.Scheduler(target, drafter, dataclasses.replace(settings, admit_groups=groups), Metrics())
        s.start(warmup=True)
        s.ready.wait()
        if s.warmup_error is not None:
            raise s.warmup_error
        drv = drivers[name] = Driver(s)
        for r in seen.values():
            for k in sched.admit_group_sizes(args.max_batch, groups):
                drv.run([{"prompt": r["prompt"], "max_tokens": 4}] * k, k)
    runs: dict = {}
    try:
        for i in range(args.load_ab):
            for name, drv in drivers.items():
                before = drv.s.bucket.admit_runs.copy()
                compiles = sched.compile_count()
                res = drv.run(requests, args.concurrency)
                row = runs.setdefault(name, {"tokens_per_s": [], "ttft_p50_ms": [], "ttft_p90_ms": [], "compiles": [],
                                             "admissions": []})
                for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p90_ms"):
                    row[k].append(res[k])
                row["compiles"].append(sched.compile_count() - compiles)
                row["admissions"].append({f"{k}x{b}": n for (k, b), n in (drv.s.bucket.admit_runs - before).items()})
            print(f"  round {i}: " + ", ".join(f"{name} {runs[name]['tokens_per_s'][-1]:.0f} tok/s TTFT p50 "
                                               f"{runs[name]['ttft_p50_ms'][-1]:.0f} ms" for name in drivers),
                  file=sys.stderr, flush=True)
    finally:
        for drv in drivers.values():
            drv.s.stop(drain=False, timeout=60)
    a, b = runs["groups"], runs["one at a time"]
    return {"rounds": args.load_ab, "concurrency": args.concurrency, "runs": runs,
            "median": {name: {k: float(np.median(v[k])) for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p90_ms")}
                       for name, v in runs.items()},
            "median_ratio": {k: float(np.median(np.array(a[k]) / np.array(b[k])))
                             for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p90_ms")}}


def load_ab_summary(ab: dict) -> str:
    lines = [f"{name}: median {m['tokens_per_s']:.1f} tok/s, TTFT p50 {m['ttft_p50_ms']:.0f} ms, p90 "
             f"{m['ttft_p90_ms']:.0f} ms" for name, m in ab["median"].items()]
    r = ab["median_ratio"]
    lines.append(f"groups / one at a time (paired rounds, median): tok/s {r['tokens_per_s']:.3f}x, TTFT p50 "
                 f"{r['ttft_p50_ms']:.3f}x, p90 {r['ttft_p90_ms']:.3f}x")
    return "\n".join(lines)


def ab_summary(ab: dict) -> str:
    return "\n".join(f"{k}: median {ab['median_tokens_per_s'][k]:.1f} tok/s, {ab['median_ratio'][k]:.3f}x the CLI "
                     f"call's" for k in ab["tokens_per_s"])


def write_report(path: str, runs: list, title: str = "") -> None:
    """A markdown table of serve_host runs (their JSONs, e.g. before / after, alternating) and each run's top
    decode-thread spans."""
    import statistics

    def ratio(a, b):
        return a / b if b else float("nan")

    lines = [f"# The server at the loop's speed (`benchmarks/serve_host.py`){': ' + title if title else ''}", ""]
    metas = [r["meta"] for r in runs]
    lines += ["Runs (in the order they ran; `before`: the code at the first commit, `after`: this one):", ""]
    for m in metas:
        lines.append(f"- {m['label']}: {m['date']}, device {m['device']}, commit {m['commit']}, `{m['command']}`, "
                     f"load average (1 min) {m['loadavg_before']:.1f} before / {m['loadavg_after']:.1f} after")
    m = metas[0]
    lines += ["", f"Server settings: --max-batch {m['max_batch']}, --max-len {m['max_len']}, --chunk-steps "
              f"{m['chunk_steps']}, the default --budget auto"
              + (" (on this CPU the cached cost model refuses every budget: autoregressive)" if m["device"] == "cpu"
                 else "") + f". Single stream: {m['stream_tokens']} greedy tokens of one prompt; "
              f"concurrency {m['concurrency']}: the load test's {m['requests']} seeded requests (prompts of 8-64 "
              "held-out tokens, max_tokens 16-96), greedy.", "",
              "| run | CLI tok/s | scheduler stream tok/s (x CLI) | HTTP stream tok/s (x CLI) | loop refill tok/s | "
              "scheduler c tok/s (x loop) | HTTP c tok/s (x loop) | loop chunk ms | scheduler TTFT p50 ms (chunks) | "
              "HTTP TTFT p50 ms (chunks) | outputs = loop's | compiles |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    engine_rows = []
    for r in runs:
        cli = r.get("stream_cli", r["stream_generate"])["tokens_per_s"]
        st, lp, c = r["stream_scheduler"], r["concurrent_loop"], r["concurrent_scheduler"]
        h = r.get("http", {})
        hs, hc = h.get("stream"), h.get("concurrent")
        chunk = lp["chunk_ms"]
        lines.append(
            f"| {r['meta']['label']} | {cli:.0f} | {st['tokens_per_s']:.0f} ({ratio(st['tokens_per_s'], cli):.2f}) | "
            + (f"{hs['tokens_per_s']:.0f} ({ratio(hs['tokens_per_s'], cli):.2f})" if hs else "-") + " | "
            f"{lp['tokens_per_s']:.0f} | {c['tokens_per_s']:.0f} ({ratio(c['tokens_per_s'], lp['tokens_per_s']):.2f}) | "
            + (f"{hc['tokens_per_s']:.0f} ({ratio(hc['tokens_per_s'], lp['tokens_per_s']):.2f})" if hc else "-")
            + f" | {chunk:.1f} | {c['ttft_p50_ms']:.0f} ({c['ttft_p50_ms'] / chunk:.1f}) | "
            + (f"{hc['ttft_p50_ms']:.0f} ({hc['ttft_p50_ms'] / chunk:.1f})" if hc else "-")
            + f" | {r['concurrent_identical']} of {m['requests']} | {c['compiles']}"
            + (f" / {hc['compiles']}" if hc else "") + " |")
        e = r.get("http_engine")
        if e:
            es, ec = e["stream"], e["concurrent"]
            engine_rows.append(
                f"| {r['meta']['label']} | {es['tokens_per_s']:.0f} ({ratio(es['tokens_per_s'], cli):.2f}) | "
                f"{ec['tokens_per_s']:.0f} ({ratio(ec['tokens_per_s'], lp['tokens_per_s']):.2f}) | "
                f"{ec['ttft_p50_ms']:.0f} ({ec['ttft_p50_ms'] / chunk:.1f}) | {ec['compiles']} |")
    if engine_rows:
        lines += ["", "The same server with --engine-process (the decode loop in a process of its own), run after "
                  "the one above:", "",
                  "| run | HTTP stream tok/s (x CLI) | HTTP c tok/s (x loop) | HTTP TTFT p50 ms (chunks) | compiles |",
                  "|---|---|---|---|---|", *engine_rows]
    lines += ["", "The decode thread's time by phase (scheduler.HostSpans; seconds, calls, share of the run's wall "
              "time; a read includes its wait for the device: on a CPU that is the decode itself; `reset_rows`: "
              "the rows retired since the last dispatch, reset together; up to c0fbc86, `retire.reset_row`, a "
              "dispatch a row, inside `collect.deliver`):", ""]
    for r in runs:
        for key, what in (("stream_scheduler", "single stream, in-process"),
                          ("concurrent_scheduler", f"concurrency {m['concurrency']}, in-process")):
            wall = r[key]["wall_s"]
            spans = sorted(r[key]["spans"].items(), key=lambda kv: -kv[1][0])
            lines.append(f"- {r['meta']['label']}, {what} (wall {wall:.2f} s): " + ", ".join(
                f"{k} {s:.3f} s / {int(n)} ({s / wall:.0%})" for k, (s, n) in spans[:6]))
        for key, what in (("stream", "single stream, HTTP"), ("concurrent", f"concurrency {m['concurrency']}, HTTP")):
            if key in r.get("http", {}):
                wall = r["http"][key]["wall_s"]
                spans = sorted(r["http"][key]["spans"].items(), key=lambda kv: -kv[1][0])
                lines.append(f"- {r['meta']['label']}, {what} (wall {wall:.2f} s): " + ", ".join(
                    f"{k} {s:.3f} s / {int(n)} ({s / wall:.0%})" for k, (s, n) in spans[:6]))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def summary(r: dict) -> str:
    ref = r.get("stream_cli", r["stream_generate"])["tokens_per_s"]
    lines = [f"single stream: scheduler {r['stream_scheduler']['tokens_per_s']:.1f} tok/s "
             f"({r['stream_scheduler']['tokens_per_s'] / ref:.0%} of the CLI's {ref:.1f}; generate in-process "
             f"{r['stream_generate']['tokens_per_s']:.1f}; identical {r['stream_identical']})"]
    c, lp = r["concurrent_scheduler"], r["concurrent_loop"]
    lines.append(f"concurrency {r['meta']['concurrency']}: scheduler {c['tokens_per_s']:.1f} tok/s "
                 f"({c['tokens_per_s'] / lp['tokens_per_s']:.0%} of the loop's {lp['tokens_per_s']:.1f}), TTFT p50 "
                 f"{c['ttft_p50_ms']:.0f} ms = {c['ttft_p50_ms'] / lp['chunk_ms']:.1f} loop chunks of "
                 f"{lp['chunk_ms']:.1f} ms; compiles {c['compiles']}")
    if "http" in r:
        h = r["http"]
        lines.append(f"HTTP: stream {h['stream']['tokens_per_s']:.1f} tok/s ({h['stream']['tokens_per_s'] / ref:.0%}"
                     f" of the CLI's); concurrency {r['meta']['concurrency']} {h['concurrent']['tokens_per_s']:.1f} "
                     f"tok/s ({h['concurrent']['tokens_per_s'] / lp['tokens_per_s']:.0%} of the loop's), TTFT p50 "
                     f"{h['concurrent']['ttft_p50_ms']:.0f} ms, compiles {h['concurrent']['compiles']}")
    if "http_engine" in r:
        h = r["http_engine"]
        lines.append(f"HTTP, engine process: stream {h['stream']['tokens_per_s']:.1f} tok/s "
                     f"({h['stream']['tokens_per_s'] / ref:.0%} of the CLI's); concurrency {r['meta']['concurrency']} "
                     f"{h['concurrent']['tokens_per_s']:.1f} tok/s ({h['concurrent']['tokens_per_s'] / lp['tokens_per_s']:.0%}"
                     f" of the loop's), TTFT p50 {h['concurrent']['ttft_p50_ms']:.0f} ms, compiles "
                     f"{h['concurrent']['compiles']}")
    for key, title in (("stream_scheduler", "single stream"), ("concurrent_scheduler", "concurrency")):
        wall = r[key]["wall_s"]
        lines.append(f"decode thread, {title} (wall {wall:.2f} s): " + ", ".join(
            f"{k} {s:.3f} s / {int(n)} ({share:.0%})" for k, s, n, share in spans_table(r[key]["spans"], wall)))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
