"""A bounded load test of `python -m kdtree_jax.serve`: speculative vs autoregressive serving under concurrency.

    python benchmarks/serve_load.py                                  # CPU defaults: 32 requests at 1, 4, 16, 64
    python benchmarks/serve_load.py --requests 128 --concurrency 1,8,32,128 --max-batch 16
    python benchmarks/serve_load.py --smoke                          # 4 requests at 1 and 2; a temp dir
    python benchmarks/serve_load.py --leak-requests 1000 --disconnect-fraction 0.1   # + the slot-leak check
    python benchmarks/serve_load.py --no-loop-baseline                # without the engine's loop on the same requests

For each mode (speculative: the checkpoint's DDTree settings; autoregressive: `--no-speculative`) the script starts
a local server on a free loopback port and warms it up (one request per prompt-length bucket, so that the measurement
compiles nothing: the server's compile counter is read before and after); then, for each concurrency c, each server
in turn gets the same fixed, seeded list of requests with c of them in flight at a time (a new one as soon as one
ends), greedy and streamed. Requests: prompts are windows of the held-out corpus files (kdtree_jax/corpus.py, split "eval") sent as
token ids, their lengths uniform in --prompt-len, output lengths uniform in --max-new-tokens (max_tokens; greedy
decoding has no end-of-text token here, so each request generates exactly that many).

Per concurrency: throughput (completion tokens / wall time of the batch of requests, and requests/s), time to first
token (TTFT: from sending to the first streamed event) and per-token latency (TPOT: (last event - first event) /
(tokens - 1), a request's decode pace) at p50/p90/p99, end-to-end latency p50, the server's mean batch occupancy
(sampled from /metrics) and tau over the run. Greedy outputs of the two modes are compared request by request (on a
CPU in float32 speculative decoding is lossless token for token).

Leak check (--leak-requests N): after the levels, each server gets N more requests (another seeded list) with a
fraction of them (--disconnect-fraction) closing the connection after their first few streamed events; once the
server is idle again, /metrics must show every KV pool slot free and no busy row (leaked slots: free slots before
the check less free slots after). Compiles are counted from the end of the warm-up to the end of the run (levels and
leak check): a server that compiles nothing under load has 0.

Loop baseline (on unless --no-loop-baseline; issue 45 item 3: the server at the loop's speed): once the servers have
stopped (on a GPU they hold its memory), a subprocess (so that this process never takes device memory) loads the same
checkpoint and dtype and runs the same request list through the engine's own decode loop: spec_decode.run_refill
(continuous batching, --max-batch rows refilled between chunks of the server's --chunk-steps, --max-len positions a
row, each request its own max_tokens, greedy; per mode the program its server ran: autoregressive, or speculative with
the server's budget, autoregressive too where the server's cached cost model refused speculation), then the first
--loop-stream-requests requests each alone through engine.generate, as the CLI decodes them. Warm-ups are untimed;
the report counts the compiles in the timed parts. The report's section: per mode, server / loop throughput at each
level (target >= 0.85 from --target-concurrency up), the server's concurrency-1 requests against generate alone on
the same requests (target >= 0.90), and TTFT p50 at --target-concurrency in the loop's chunks (wall / chunks; target
<= 2). Tokens are completion tokens, the first included, on every side.

Bounded: each request has a timeout (--request-timeout; a request that fails or times out is counted as an error,
not waited for), the servers a start-up limit (--start-timeout), and --deadline-s stops starting levels (keeping
--leak-reserve-s for the leak check and --loop-reserve-s for the loop baseline) and leak requests (keeping
--loop-reserve-s) once it has passed; the loop baseline is skipped with less than half its reserve left and stopped at
the deadline (keeping the parts it finished); SIGTERM (`timeout`) ends the run early. Either way the rows measured so
far are written, and the servers are stopped.

The client runs in this process on the same machine: on a 2-core CPU it takes some of the server's CPU time (more
at high concurrency). On a GPU the client keeps JAX from reserving device memory in its own process; the servers,
which run at once, each reserve XLA's usual share unless XLA_PYTHON_CLIENT_MEM_FRACTION (inherited) is below 0.5.
Writes <out>/serve_load_<device>.{json,md,png} (--smoke: a temporary directory) with the date, device and commit
($KDTREE_COMMIT when set), and the servers' and the loop baseline's logs to --log-dir (default: a temporary
directory, never --out).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kdtree_jax.generate import budget_argument  # noqa: E402


class Interrupted(BaseException):
    """SIGTERM (`timeout` sends it): stop measuring, write what was measured, stop the servers. A BaseException, so
    that the per-request error handling lets it through."""


def _on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up that follows is not interrupted again
    raise Interrupted(f"signal {signum}")


# The servers' environment: the caller's, before the client changed its own (main() sets it).
_SERVER_ENV: dict = {}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="the server's --checkpoint (default: the embedded pair)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="the server's --dtype")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level (the same list each time)")
    p.add_argument("--concurrency", default="1,4,16,64",
                   help="comma-separated requests in flight at once, measured in this order (reported sorted)")
    p.add_argument("--modes", default="speculative,autoregressive",
                   help="comma-separated: speculative (the server's defaults), autoregressive (--no-speculative)")
    p.add_argument("--prompt-len", default="8,64", help="LO,HI: prompt lengths in tokens, uniform")
    p.add_argument("--max-new-tokens", default="16,96", help="LO,HI: max_tokens per request, uniform")
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    p.add_argument("--max-len", type=int, default=256, help="the server's --max-len (positions a row)")
    p.add_argument("--budget", type=budget_argument, default=None,
                   help="the speculative server's --budget: 'auto' (the adaptive budget, the server's default; each "
                        "level's row then has the steps per budget and the predicted vs observed tau from its "
                        "/metrics) or a number (default: the server's own)")
    p.add_argument("--calibrate", action="store_true",
                   help="pass --calibrate to the speculative server (--budget auto: measure its cost model at start-up "
                        "instead of using the cached one)")
    p.add_argument("--lone-row-programs", action=argparse.BooleanOptionalAction, default=None,
                   help="pass --lone-row-programs / --no-lone-row-programs to the speculative server (--budget auto: "
                        "a lone request runs one-row programs priced at one row's costs; default: the server's own, "
                        "on a GPU)")
    p.add_argument("--engine-process", action="store_true",
                   help="pass --engine-process to both servers (the decode loop in a process of its own)")
    p.add_argument("--chunk-steps", type=int, default=None, help="the server's --chunk-steps (default: its own)")
    p.add_argument("--client-processes", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 4)),
                   help="the load client's processes, the concurrency split among them (one Python client reads a "
                        "few thousand streamed events a second; default: a quarter of the cores, at most 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request list (prompts and lengths)")
    p.add_argument("--leak-requests", type=int, default=0,
                   help="after the levels, this many more requests per server with --disconnect-fraction of them "
                        "dropping the connection mid-stream; then every KV slot must be free again (0: no leak check)")
    p.add_argument("--disconnect-fraction", type=float, default=0.1,
                   help="the leak check's share of requests that disconnect after their first 1-3 streamed events")
    p.add_argument("--leak-concurrency", type=int, default=None,
                   help="requests in flight during the leak check (default: the highest --concurrency)")
    p.add_argument("--target-concurrency", type=int, default=16,
                   help="the level the targets are read at (speculative >= 1.5x autoregressive throughput at equal or "
                        "better p50 per-token latency)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds one request may take, end to end; a slower one is counted as an error")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to load, compile and answer /health")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds from the start after which no level starts (--leak-reserve-s earlier) and the leak "
                        "check sends no more requests; what was measured is written")
    p.add_argument("--leak-reserve-s", type=float, default=0.0,
                   help="seconds before --deadline-s kept for the leak check: levels stop starting then")
    p.add_argument("--no-loop-baseline", action="store_true",
                   help="skip the loop baseline: after the levels and the leak check, with the servers stopped, the "
                        "same requests through the engine's own decode loop in a subprocess (spec_decode.run_refill "
                        "at --max-batch rows; engine.generate of the first --loop-stream-requests alone), each mode's "
                        "server against it")
    p.add_argument("--loop-stream-requests", type=int, default=4,
                   help="the loop baseline's single streams: the first N requests, each through engine.generate alone "
                        "as the CLI decodes it (a loop compiled per max_tokens, untimed: hence a few)")
    p.add_argument("--loop-reserve-s", type=float, default=120.0,
                   help="seconds before --deadline-s kept for the loop baseline: levels (with --leak-reserve-s before "
                        "it) and leak requests stop that much earlier; with less than half of it left the baseline is "
                        "skipped, and it is stopped at the deadline (its finished parts are kept)")
    p.add_argument("--loop-worker", default=None, help=argparse.SUPPRESS)  # the loop baseline's subprocess
    p.add_argument("--stand-in-port", type=int, default=None, help=argparse.SUPPRESS)  # client_ceiling's server
    p.add_argument("--no-client-ceiling", action="store_true",
                   help="skip the client's ceiling (before the servers start: the request list at the highest "
                        "concurrency against the real app over a stand-in decode with no model, 96k tok/s at 16 rows)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"),
                   help="directory for serve_load_<device>.{json,md,png}")
    p.add_argument("--log-dir", default=None, help="directory for the servers' and the loop baseline's logs (default: a temporary one)")
    p.add_argument("--smoke", action="store_true", help="4 requests at concurrency 1 and 2, short outputs; writes to a "
                                                        "temporary directory")
    return p


def _pair(text: str, name: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise SystemExit(f"error: {name} must be LO,HI with 1 <= LO <= HI; got {text}")
    return lo, hi


def corpus_docs(tokenizer_dir: str, min_len: int) -> list:
    """The held-out corpus files as token ids, those longer than min_len."""
    from kdtree_jax import corpus
    from kdtree_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    docs = [np.asarray(tokenizer.encode(d.text), np.int32) for d in corpus.documents("eval")]
    return [d for d in docs if len(d) > min_len]


def make_requests(count: int, prompt_len, new_tokens, seed: int, docs: list, disconnect_fraction: float = 0.0
                  ) -> list[dict]:
    """The seeded request list: token-id prompts cut from the held-out corpus files, and max_tokens; with
    disconnect_fraction, that share of them (their own random stream: the list is the same either way) carry
    disconnect_after = the streamed events after which the client drops the connection (1-3)."""
    rng = np.random.default_rng(seed)
    drop = np.random.default_rng([seed, 1])
    out = []
    for i in range(count):
        doc = docs[int(rng.integers(len(docs)))]
        n = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        start = int(rng.integers(0, len(doc) - n))
        req = {"prompt": doc[start:start + n].tolist(), "max_tokens": int(rng.integers(new_tokens[0],
                                                                                       new_tokens[1] + 1))}
        if disconnect_fraction > 0 and drop.random() < disconnect_fraction:
            req["disconnect_after"] = int(drop.integers(1, 4))
        out.append(req)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandInScheduler:
    """The decode thread's part of the server's contract (submit, cancel, emit) with no model: every `chunk_s` each of
    `rows` rows gets its next `tokens` tokens of `pattern` (repeated), its request ending at max_tokens. Behind the
    real FastAPI app it measures what the HTTP path and this script's client can carry (client_ceiling), and tests
    the client without a decode."""

    def __init__(self, rows: int, chunk_s: float, tokens: int, pattern: list[int], vocab_size: int = 1 << 20):
        import threading
        import types

        self.target = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=vocab_size,
                                                                      max_position_embeddings=1 << 20))
        self.settings = types.SimpleNamespace(max_len=1 << 20)
        self.rows, self.chunk_s, self.tokens, self.pattern = rows, chunk_s, tokens, list(pattern)
        self.error, self.live, self.waiting, self.lock = None, [], collections.deque(), threading.Lock()
        threading.Thread(target=self._loop, daemon=True).start()

    def max_tokens_for(self, prompt_len: int) -> int:
        return 1 << 20

    def submit(self, job) -> None:
        job.sent = 0
        with self.lock:
            self.waiting.append(job)

    def cancel(self, job, reason: str = "cancelled") -> None:
        job.cancelled = True

    def _loop(self) -> None:
        while True:
            t = time.perf_counter()
            with self.lock:
                while self.waiting and len(self.live) < self.rows:
                    self.live.append(self.waiting.popleft())
                live = list(self.live)
            for job in live:
                k = min(self.tokens, job.max_tokens - job.sent)
                job.emit("tokens", [self.pattern[(job.sent + i) % len(self.pattern)] for i in range(k)])
                job.sent += k
                if job.sent >= job.max_tokens or job.cancelled:
                    job.emit("done", "length")
                    with self.lock:
                        self.live.remove(job)
            time.sleep(max(0.0, self.chunk_s - (time.perf_counter() - t)))


STAND_IN_TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


def stand_in_app(tokenizer, rows: int, chunk_s: float, tokens: int):
    """The server's FastAPI app (kdtree_jax.serve.api) over a StandInScheduler that answers STAND_IN_TEXT's tokens."""
    from kdtree_jax.serve.api import create_app
    from kdtree_jax.serve.metrics import Metrics

    return create_app(StandInScheduler(rows, chunk_s, tokens, tokenizer.encode(STAND_IN_TEXT)), tokenizer, Metrics(),
                      model_name="stand-in", info={})


# The client ceiling's stand-in: 12 tokens a row every 2 ms (16 rows: 96k tok/s), beyond any server measured here.
CEILING_CHUNK_S, CEILING_TOKENS = 0.002, 12


def client_ceiling(args, requests: list[dict], concurrency: int) -> dict:
    """The request list at `concurrency` through this script's client against the real app over a stand-in decode
    (a subprocess, as a server is): the most tok/s the client and the HTTP path carry here, to read the servers'
    rows against."""
    port = _free_port()
    os.makedirs(args.log_dir, exist_ok=True)
    log_path = os.path.join(args.log_dir, "serve_load_stand_in_server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--stand-in-port", str(port),
                                 "--max-batch", str(args.max_batch)] + (["--checkpoint", args.checkpoint]
                                                                        if args.checkpoint else []),
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready("stand-in", proc, url, log_path, 60)
        except SystemExit as e:  # the ceiling is a reading aid: the servers are measured without it
            return {"error": str(e).removeprefix("error: ")}
        requests = (requests * -(-256 // len(requests)))[:max(256, len(requests))]  # long enough to time
        results, wall, _ = drive(url, requests, concurrency, "stand-in", args.request_timeout,
                                 processes=args.client_processes)
        tokens = sum(r.get("tokens", 0) for r in results if r)
        return {"concurrency": concurrency, "tokens_per_s": tokens / wall, "wall_s": wall,
                "errors": sum(1 for r in results if r and "error" in r), "rows": args.max_batch,
                "stand_in_tokens_per_s": args.max_batch * CEILING_TOKENS / CEILING_CHUNK_S}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def stand_in_server(args) -> int:
    """--stand-in-port: serve stand_in_app until terminated (client_ceiling's subprocess)."""
    import uvicorn

    from kdtree_jax.generate import DEFAULT_CHECKPOINT
    from kdtree_jax.tokenizer import load_tokenizer

    app = stand_in_app(load_tokenizer(os.path.join(args.checkpoint or DEFAULT_CHECKPOINT, "tokenizer")),
                       args.max_batch, CEILING_CHUNK_S, CEILING_TOKENS)
    uvicorn.run(app, host="127.0.0.1", port=args.stand_in_port, log_level="warning")
    return 0


def launch_server(mode: str, args, log_path: str):
    """A server subprocess for this mode on a free loopback port: -> (process, url). wait_ready() waits for it."""
    port = _free_port()
    cmd = [sys.executable, "-m", "kdtree_jax.serve", "--port", str(port), "--max-batch", str(args.max_batch),
           "--max-len", str(args.max_len), "--max-queue", "100000", "--dtype", args.dtype, "--drain-timeout", "5"]
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    if args.chunk_steps is not None:
        cmd += ["--chunk-steps", str(args.chunk_steps)]
    if getattr(args, "engine_process", False):
        cmd += ["--engine-process"]
    if mode == "autoregressive":
        cmd += ["--no-speculative"]
    else:
        if args.budget is not None:
            cmd += ["--budget", str(args.budget)]
        if args.calibrate:
            cmd += ["--calibrate"]
        if args.lone_row_programs is not None:
            cmd += ["--lone-row-programs" if args.lone_row_programs else "--no-lone-row-programs"]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=_SERVER_ENV or None)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(mode: str, proc, url: str, log_path: str, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the {mode} server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"error: the {mode} server did not start within {timeout:.0f} s; see {log_path}")


def metrics(url: str, timeout: float = 30.0) -> dict:
    import httpx

    from kdtree_jax.serve.metrics import parse

    return parse(httpx.get(url + "/metrics", timeout=timeout).text)


def settle(url: str, timeout: float = 30.0) -> dict:
    """/metrics once the server is idle (nothing queued, no busy row, every pool slot free), or after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m["queue_length"] == 0 and m["batch_rows_busy"] == 0 and m["pool_slots_free"] == m["pool_slots"]
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


async def one_request(client, url: str, req: dict, model: str) -> dict:
    """One streamed greedy completion; with req["disconnect_after"] = k, the connection is dropped after k events."""
    # Plain greedy set in full: fields left out would take the checkpoint's generation_config.json (the embedded
    # pair's has a repetition penalty, which runs the any-settings program), and the results are greedy ones.
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
            "repetition_penalty": 1, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    text, tokens, events = [], 0, 0
    drop_after = req.get("disconnect_after", 0)
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            first = first if first is not None else now
            event = json.loads(line[6:])
            if event.get("error"):
                raise RuntimeError(f"stream error: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                continue
            last = now
            text.append(event["choices"][0]["text"])
            events += 1
            if drop_after and events >= drop_after:
                # Leaving the block closes the half-read response, and with it the connection: the server sees the
                # client go away and frees the row.
                return {"disconnected": True, "ttft": first - t0, "events": events}
    return {"ttft": first - t0, "end": last - t0, "tokens": tokens, "text": "".join(text),
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else float("nan")}


async def run_level(url: str, requests: list[dict], concurrency: int, model: str, request_timeout: float = 600.0,
                    deadline: float | None = None, poll: bool = True, ready=None):
    """Every request, `concurrency` in flight at a time; a poller (with `poll`) samples the batch occupancy
    meanwhile. A request that fails or takes longer than request_timeout gets {"error": ...}; past `deadline`
    (time.monotonic()) no new request starts (their results stay None). ready(): called once the clients exist, just
    before the clock starts (drive's barrier across client processes). -> (results, wall, occupancy)."""
    import httpx

    from kdtree_jax.serve.metrics import parse

    results = [None] * len(requests)
    occupancy = []
    done = asyncio.Event()
    timeout = httpx.Timeout(min(request_timeout, 600.0))
    async with httpx.AsyncClient(timeout=timeout) as client:  # the poller's
        async def poll_occupancy():
            while not done.is_set():
                try:
                    m = parse((await client.get(url + "/metrics")).text)
                    occupancy.append(m["batch_occupancy"])
                except httpx.HTTPError:
                    pass
                try:
                    await asyncio.wait_for(done.wait(), 0.25)
                except asyncio.TimeoutError:
                    pass

        queue = list(enumerate(requests))[::-1]

        async def worker(own):
            while queue and (deadline is None or time.monotonic() < deadline):
                i, req = queue.pop()
                try:
                    results[i] = await asyncio.wait_for(one_request(own, url, req, model), request_timeout)
                except (Exception, asyncio.TimeoutError) as e:  # noqa: BLE001 - counted, not fatal
                    results[i] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}

        # A client (one connection) of its own per worker, made before the clock starts: one client's pool shared by
        # all of them rescans every connection at every request and read (httpcore), which made this client, not the
        # server, the bottleneck past ~5-9k streamed tok/s (on a fake scheduler with no decode: 4.9k tok/s against
        # 6.9k with a client each, this client's CPU time twice the server's).
        own = [httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1))
               for _ in range(min(concurrency, len(requests)))]
        if ready is not None:
            ready()
        poller = asyncio.create_task(poll_occupancy()) if poll else None
        try:
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(c) for c in own))
            wall = time.perf_counter() - t0
        finally:
            done.set()
            if poller is not None:
                await poller
            for c in own:
                await c.aclose()
    return results, wall, occupancy


def _client_process(barrier, out, share: int, args: tuple) -> None:
    """One client process of client_processes: its share of the requests; (share, results, start, wall) to `out`."""
    clock = {}

    def ready():
        barrier.wait()
        clock["start"] = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the machine

    try:
        results, wall, occupancy = asyncio.run(run_level(*args, ready=ready))
        out.put((share, results, clock["start"], wall, occupancy))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        barrier.abort()
        out.put((share, f"{type(e).__name__}: {e}", 0.0, 0.0, []))


def drive(url: str, requests: list[dict], concurrency: int, model: str, request_timeout: float = 600.0,
          deadline: float | None = None, processes: int = 1):
    """run_level through `processes` client processes started together (a barrier before their clocks): request i
    goes to process i % processes, which keeps its share of the concurrency in flight. One Python client reads at most
    a few thousand streamed events a second (httpx's per-event cost), which at the GPU server's rate would make the
    client the bottleneck being measured. -> (results in request order, wall from the first start to the last end,
    the occupancy process 0 sampled)."""
    processes = max(1, min(processes, concurrency, len(requests)))
    if processes == 1:
        return asyncio.run(run_level(url, requests, concurrency, model, request_timeout, deadline))
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    barrier, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_client_process, daemon=True,
                         args=(barrier, out, p, (url, requests[p::processes],
                                                 concurrency // processes + (p < concurrency % processes), model,
                                                 request_timeout, deadline, p == 0)))
             for p in range(processes)]
    for proc in procs:
        proc.start()
    try:
        parts = sorted(out.get() for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=30)
    failed = [r for _, r, _, _, _ in parts if isinstance(r, str)]
    if failed:
        raise RuntimeError(f"a client process failed: {failed[0]}")
    results = [None] * len(requests)
    for p, res, _, _, _ in parts:
        results[p::processes] = res
    wall = max(start + w for _, _, start, w, _ in parts) - min(start for _, _, start, _, _ in parts)
    return results, wall, parts[0][4]


def pct(values, q) -> float:
    values = [v for v in values if v == v]
    return float(np.percentile(values, q)) if values else float("nan")


def measure_level(mode: str, url: str, model: str, requests: list[dict], c: int, request_timeout: float,
                  processes: int = 1) -> dict:
    """One concurrency level against one server: the row of the table."""
    before = metrics(url)
    results, wall, occupancy = drive(url, requests, c, model, request_timeout, processes=processes)
    after = metrics(url)
    steps = after["decode_steps_total"] - before["decode_steps_total"]
    emitted = after["tau"] * after["decode_steps_total"] - before["tau"] * before["decode_steps_total"]
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["tokens"] for r in ok)
    row = {
        "mode": mode, "concurrency": c, "requests": len(results), "errors": len(errors), "wall_s": wall,
        "tokens": tokens, "tokens_per_s": tokens / wall, "requests_per_s": len(ok) / wall,
        "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in ok], 50),
        "ttft_p90_ms": 1e3 * pct([r["ttft"] for r in ok], 90),
        "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in ok], 99),
        "tpot_p50_ms": 1e3 * pct([r["tpot"] for r in ok], 50),
        "tpot_p90_ms": 1e3 * pct([r["tpot"] for r in ok], 90),
        "tpot_p99_ms": 1e3 * pct([r["tpot"] for r in ok], 99),
        "latency_p50_s": pct([r["end"] for r in ok], 50),
        "mean_occupancy": float(np.mean(occupancy)) if occupancy else float("nan"),
        "tau": emitted / steps if steps else float("nan"),
        "compiles_during": int(after["compiles_total"] - before["compiles_total"]),
        "texts": [r.get("text") for r in results],
        # per request, for the loop baseline's single streams (the same requests alone through engine.generate)
        "completion_tokens": [r.get("tokens") for r in results],
        "latencies_s": [r.get("end") for r in results],
    }
    if errors:
        row["first_errors"] = errors[:3]
    policy = budget_policy_delta(before, after)
    if policy:
        row["budget_policy"] = policy
    print(f"  {mode:>14} c={c:<3} {row['tokens_per_s']:7.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:7.1f} ms  "
          f"TPOT p50 {row['tpot_p50_ms']:6.2f} ms  occupancy {row['mean_occupancy']:.2f}  tau "
          f"{row['tau']:.2f}  compiles {row['compiles_during']}" + (f"  ERRORS {len(errors)}: {errors[0]}"
                                                                    if errors else "")
          + (f"  budgets {policy_text(policy)}" if policy else ""), file=sys.stderr, flush=True)
    return row


def budget_policy_delta(before: dict, after: dict) -> dict:
    """The adaptive budget's share of a level, from two /metrics scrapes ({} for a fixed budget): batch steps per
    budget and without the drafter, and the predicted vs observed tokens per sequence step of its drafted steps."""
    keys = [k for k in after if k.startswith('budget_steps_total{budget="')]
    if not keys:
        return {}
    seq = after["drafted_sequence_steps_total"] - before.get("drafted_sequence_steps_total", 0)

    def tokens(name):  # the gauges are since start: tau x steps, as the row's own tau
        return (after[name] * after["drafted_sequence_steps_total"]
                - before.get(name, 0) * before.get("drafted_sequence_steps_total", 0))

    return {"budget_steps": {k.split('"')[1]: int(after[k] - before.get(k, 0)) for k in keys},
            "steps_without_drafter": int(after["steps_without_drafter_total"]
                                         - before.get("steps_without_drafter_total", 0)),
            "predicted_tau": tokens("predicted_tau") / seq if seq else float("nan"),
            "observed_tau": tokens("observed_tau") / seq if seq else float("nan")}


def policy_text(policy: dict) -> str:
    used = ", ".join(f"{b}: {n}" for b, n in policy["budget_steps"].items() if n)
    return (f"{{{used or '-'}}}, {policy['steps_without_drafter']} without the drafter, tau predicted "
            f"{policy['predicted_tau']:.2f} observed {policy['observed_tau']:.2f}")


def leak_check(mode: str, url: str, model: str, requests: list[dict], c: int, request_timeout: float,
               deadline: float | None, processes: int = 1) -> dict:
    """The leak check against one server: its requests (some disconnecting mid-stream), then, once it is idle, the
    KV pool's free slots against before."""
    before = settle(url)
    results, wall, _ = drive(url, requests, c, model, request_timeout, deadline, processes)
    after = settle(url)
    sent = [r for r in results if r is not None]
    cancelled = 'requests_total{outcome="cancelled"}'
    row = {
        "mode": mode, "concurrency": c, "requests": len(requests), "sent": len(sent), "wall_s": wall,
        "disconnected": sum(bool(r.get("disconnected")) for r in sent),
        "completed": sum("tokens" in r for r in sent), "errors": sum("error" in r for r in sent),
        "server_cancelled": int(after.get(cancelled, 0) - before.get(cancelled, 0)),
        "pool_slots": int(after["pool_slots"]), "pool_slots_free_before": int(before["pool_slots_free"]),
        "pool_slots_free_after": int(after["pool_slots_free"]),
        "leaked_slots": int(before["pool_slots_free"] - after["pool_slots_free"]),
        "busy_rows_after": int(after["batch_rows_busy"]), "queue_after": int(after["queue_length"]),
        "compiles_during": int(after["compiles_total"] - before["compiles_total"]),
    }
    errors = [r["error"] for r in sent if "error" in r]
    if errors:
        row["first_errors"] = errors[:3]
    print(f"  {mode:>14} leak check: {row['sent']} of {row['requests']} requests at c={c} in {wall:.1f} s, "
          f"{row['disconnected']} disconnected (server: {row['server_cancelled']} cancelled), {row['errors']} errors; "
          f"free slots {row['pool_slots_free_before']} -> {row['pool_slots_free_after']} of {row['pool_slots']}, "
          f"busy rows {row['busy_rows_after']}: leaked {row['leaked_slots']}", file=sys.stderr, flush=True)
    return row


def measure(modes: list[str], args, requests: list[dict], leak_requests: list[dict], levels: list[int],
            deadline: float | None) -> tuple[list[dict], list[str]]:
    """Every server started at once and warmed up first, then each concurrency level on each server in turn: on a
    shared machine whose load drifts, the modes of one level are measured minutes apart at most, not a whole run
    apart. (An idle server's decode thread sleeps: it takes nothing from the one measured.) Then the leak check on
    each. -> (one dict per mode, notes on what was cut short)."""
    import httpx

    from kdtree_jax.speculative.admission import prompt_bucket

    out = {mode: {"mode": mode, "startup_s": float("nan"), "server": None, "rows": []} for mode in modes}
    notes = []
    interrupted = False
    servers = {}
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="serve_load_logs_")  # server logs are not results
    os.makedirs(log_dir, exist_ok=True)
    warm = {}  # compiles_total after the warm-up
    try:
        t0 = time.perf_counter()
        for mode in modes:  # all at once: their loads and compiles overlap
            print(f"[{mode}: starting the server ...]", file=sys.stderr, flush=True)
            log = os.path.join(log_dir, f"serve_load_{mode}_server.log")
            servers[mode] = (*launch_server(mode, args, log), log)
        for mode in modes:
            proc, url, log = servers[mode]
            wait_ready(mode, proc, url, log, max(1.0, args.start_timeout - (time.perf_counter() - t0)))
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
            # Warm-up: one request per prompt-length bucket of the lists (the prefill compiles per bucket).
            seen = {}
            for req in requests + leak_requests:
                seen.setdefault(prompt_bucket(len(req["prompt"]), args.max_len), req)
            for req in seen.values():
                results, _, _ = asyncio.run(run_level(url, [{"prompt": req["prompt"], "max_tokens": 4}], 1,
                                                      model["id"], args.request_timeout))
                if "error" in results[0]:
                    raise SystemExit(f"error: the {mode} server's warm-up request failed: {results[0]['error']}")
            warm[mode] = metrics(url)["compiles_total"]
            out[mode].update(startup_s=time.perf_counter() - t0, server=model, program=served_program(url))
            print(f"[{mode}: ready (load, compile, warm-up) {out[mode]['startup_s']:.1f} s after the start]",
                  file=sys.stderr, flush=True)
        # The loop baseline runs after the leak check, which runs after the levels: each keeps its time back.
        loop_reserve = 0 if args.no_loop_baseline else args.loop_reserve_s
        leak_deadline = None if deadline is None else deadline - loop_reserve
        stop_levels = None if deadline is None else leak_deadline - (args.leak_reserve_s if leak_requests else 0)
        for c in levels:
            if stop_levels is not None and time.monotonic() > stop_levels:
                notes.append(f"Deadline: concurrency {c} and after were not measured.")
                print(f"[deadline: skipping concurrency {c} and after]", file=sys.stderr, flush=True)
                break
            for mode in modes:
                url, model = servers[mode][1], out[mode]["server"]["id"]
                out[mode]["rows"].append(measure_level(mode, url, model, requests, c, args.request_timeout,
                                                       args.client_processes))
        if leak_requests:
            c = args.leak_concurrency or max(levels)
            for mode in modes:
                url, model = servers[mode][1], out[mode]["server"]["id"]
                out[mode]["leak"] = leak_check(mode, url, model, leak_requests, c, args.request_timeout,
                                               leak_deadline, args.client_processes)
                if out[mode]["leak"]["sent"] < len(leak_requests):
                    notes.append(f"Deadline: the {mode} leak check sent {out[mode]['leak']['sent']} of "
                                 f"{len(leak_requests)} requests.")
    except Interrupted as e:
        notes.append(f"Interrupted ({e}): the rows above are what was measured before it.")
        print(f"[interrupted ({e}): writing what was measured]", file=sys.stderr, flush=True)
        interrupted = True
    finally:
        for mode, (proc, url, _) in servers.items():
            if mode in warm and proc.poll() is None:
                try:
                    out[mode]["compiles_after_warmup"] = int(metrics(url, 5)["compiles_total"] - warm[mode])
                except Exception:  # noqa: BLE001 - a server that no longer answers: unknown
                    pass
        for proc, _, _ in servers.values():
            if proc.poll() is None:
                proc.terminate()
        for mode, (proc, _, log) in servers.items():
            try:
                proc.wait(timeout=20)  # --drain-timeout 5, then the decode thread's 10 s
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out[mode]["server_exit"] = proc.returncode
            out[mode]["server_log"] = log
    for mode in modes:
        out[mode]["rows"].sort(key=lambda r: r["concurrency"])
    return [out[mode] for mode in modes], notes, interrupted


def served_program(url: str) -> str:
    """What the server's decode loop runs: "autoregressive" (--no-speculative, no drafter, or the adaptive budget whose
    cached cost model refused speculation on this device: /health's bucket says "decision": "autoregressive"),
    "adaptive" (--budget auto) or "budget N"."""
    import httpx

    health = httpx.get(url + "/health", timeout=30).json()
    bucket = (health.get("budget_policy") or {}).get("buckets", {}).get("batch", {})
    if health.get("decoding") == "autoregressive" or bucket.get("decision") == "autoregressive":
        return "autoregressive"
    return "adaptive" if health.get("budget") == "auto" else f"budget {health.get('budget')}"


def loop_baseline(args, requests: list[dict], results: list[dict], deadline: float | None, notes: list) -> dict:
    """The same requests through the engine's own decode loop, in a subprocess (loop_worker) started once the servers
    have stopped (on a GPU they hold its memory; this process takes none): -> its results (what it finished when the
    deadline or a signal stopped it), {} when skipped. Each mode's loop runs the program its server ran
    (served_program)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left < args.loop_reserve_s / 2:
            notes.append(f"Deadline: {max(left, 0):.0f} s left, under half of --loop-reserve-s "
                         f"{args.loop_reserve_s:.0f}: the loop baseline was skipped.")
            print("[deadline: skipping the loop baseline]", file=sys.stderr, flush=True)
            return {}
    from kdtree_jax.generate import DEFAULT_CHECKPOINT
    from kdtree_jax.serve.scheduler import Settings

    work = tempfile.mkdtemp(prefix="serve_load_loop_")
    config = {"checkpoint": args.checkpoint or DEFAULT_CHECKPOINT, "dtype": args.dtype, "max_batch": args.max_batch,
              "max_len": args.max_len, "chunk_steps": args.chunk_steps or Settings.chunk_steps,
              "budget": "auto" if args.budget is None else args.budget, "calibrate": args.calibrate,
              "topk": 4,  # the server's default: launch_server passes no --topk
              "programs": {m["mode"]: m.get("program") or m["mode"] for m in results},
              "requests": [{"prompt": r["prompt"], "max_tokens": r["max_tokens"]} for r in requests],
              "stream_requests": min(args.loop_stream_requests, len(requests)),
              "out": os.path.join(work, "loop.json")}
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(config, f)
    log_path = os.path.join(args.log_dir, "serve_load_loop.log")
    print(f"[loop baseline: the same requests through the engine's loop in a subprocess (log: {log_path}) ...]",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--loop-worker",
                                 os.path.join(work, "config.json")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=_SERVER_ENV or None)
    stopped = None
    try:
        proc.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 1.0))
    except subprocess.TimeoutExpired:
        stopped = "the deadline"
    except Interrupted as e:
        stopped = str(e)
    if stopped is not None:
        proc.kill()
        proc.wait()
        notes.append(f"The loop baseline was stopped by {stopped} after {time.perf_counter() - t0:.0f} s: the parts "
                     "it had not finished are missing.")
    elif proc.returncode != 0:
        notes.append(f"The loop baseline exited with {proc.returncode} (its log: {log_path}).")
        with open(log_path) as f:
            print("".join(f.readlines()[-15:]), file=sys.stderr, flush=True)
    result = {}
    if os.path.exists(config["out"]):
        with open(config["out"]) as f:
            result = json.load(f)
    result.update(exit=proc.returncode, wall_s=time.perf_counter() - t0, log=log_path,
                  stream_requests=config["stream_requests"], chunk_steps=config["chunk_steps"])
    return result


def loop_worker(config_path: str) -> int:
    """The loop baseline's subprocess: loads the server's checkpoint and dtype, then per mode (a) its requests through
    spec_decode.run_refill at the server's rows, pool positions, chunk steps and program (greedy; warm-up untimed,
    nothing compiles in the timed pass), and (b) the first `stream_requests` of them each alone through
    engine.generate as the CLI decodes it (each call timed once after untimed ones that compile that max_tokens' loop).
    Tokens are completion tokens, the first (the prefill's) included, as the server's usage counts them. Writes its
    JSON after each part, so a run stopped early keeps what it finished."""
    with open(config_path) as f:
        cfg = json.load(f)
    # First: it sets XLA's flags for the decode loop before JAX starts (runtime.configure), as the server and the CLI
    # do; without them a GPU's loop would run from the host.
    import spec_decode
    from kdtree_jax.generate import load_models
    from kdtree_jax.serve.scheduler import compile_count
    from kdtree_jax.speculative import engine

    target, drafter, _, description, recommended = load_models(cfg["checkpoint"], cfg["dtype"])
    prompts = [r["prompt"] for r in cfg["requests"]]
    counts = [r["max_tokens"] for r in cfg["requests"]]
    out = {"device": device_name(), "pair": description, "refill": {}, "stream": {}}

    def save():
        with open(cfg["out"] + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(cfg["out"] + ".tmp", cfg["out"])

    def say(line):
        print(line, file=sys.stderr, flush=True)

    for mode, program in cfg["programs"].items():
        t0 = time.perf_counter()
        stats, tokens = spec_decode.run_refill(
            target, drafter, prompts, batch=cfg["max_batch"], tree="ar" if program == "autoregressive" else "ddtree",
            budget=cfg["budget"], topk=cfg["topk"], temperature=0.0, top_k=0, top_p=1.0, seed=0,
            max_new_tokens=counts, impl="auto", tree_temperature=recommended, chunk_steps=cfg["chunk_steps"],
            calibrate=cfg["calibrate"] and program != "autoregressive", max_len=cfg["max_len"])
        wall = stats["timed_seconds"]
        out["refill"][mode] = {
            "program": program, "tokens": stats["new_tokens"], "wall_s": wall,
            "tokens_per_s": stats["tokens_per_second"], "chunks": stats["chunks"], "chunk_steps": stats["chunk_steps"],
            "chunk_ms": 1e3 * wall / stats["chunks"], "tau": stats["tau"], "occupancy": stats["occupancy"],
            "compiles": stats["compiles_after_warmup"], "each_its_max_tokens": [len(t) for t in tokens] == counts,
            "setup_s": time.perf_counter() - t0 - wall}
        if "budget_policy" in stats:
            policy = stats["budget_policy"]
            out["refill"][mode].update(budget_steps=policy["budget_steps"],
                                       steps_without_drafter=policy["steps_without_drafter"])
        save()
        say(f"  loop {mode} ({program}): {stats['tokens_per_second']:.1f} tok/s, a chunk "
            f"{out['refill'][mode]['chunk_ms']:.1f} ms, compiles {stats['compiles_after_warmup']}")
    for mode in cfg["programs"] if cfg["stream_requests"] else []:
        # As the CLI runs each mode (--budget 0, or the server's budget), whatever program the server's batch ran.
        use, budget = (None, 0) if mode == "autoregressive" else (drafter, cfg["budget"])
        calls = []
        for r in cfg["requests"][:cfg["stream_requests"]]:
            def call():  # on_tokens: the CLI streams, and so decodes in its chunks
                return engine.generate(target, use, [r["prompt"]], max_new_tokens=r["max_tokens"], budget=budget,
                                       topk=cfg["topk"], tree_temperature=recommended, on_tokens=lambda row, ids: False)

            # Untimed until a call compiles nothing: a call that measures the cost model can change the next one's
            # program (the cached model's verdict may then be autoregressive).
            for _ in range(3):
                compiles = compile_count()
                call()
                if compile_count() == compiles:
                    break
            compiles = compile_count()
            t = time.perf_counter()
            res = call()
            calls.append({"tokens": len(res.tokens[0]), "wall_s": time.perf_counter() - t,
                          "compiles": compile_count() - compiles, "decoding": res.stats["decoding"]})
        tokens, wall = sum(c["tokens"] for c in calls), sum(c["wall_s"] for c in calls)
        out["stream"][mode] = {"requests": len(calls), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                               "compiles": sum(c["compiles"] for c in calls), "calls": calls}
        save()
        say(f"  generate alone, {mode}: {len(calls)} requests at {tokens / wall:.1f} tok/s")
    return 0


def loop_comparison(data: dict, c: int) -> dict:
    """Issue 45 item 3's targets from the loop baseline: per mode, server / loop throughput at each level (target
    >= 0.85 at concurrency >= c), the server's single stream (concurrency 1, on the requests generate decoded alone)
    / generate's (target >= 0.90), and the server's TTFT p50 at concurrency c in the loop's chunks (target <= 2)."""
    loop = data.get("loop") or {}
    out = {}
    for mode in data["modes"]:
        name, rows = mode["mode"], {r["concurrency"]: r for r in mode["rows"]}
        t = {}
        refill = loop.get("refill", {}).get(name)
        if refill:
            t["throughput"] = [{"concurrency": k, "server_tokens_per_s": r["tokens_per_s"], "ratio":
                                r["tokens_per_s"] / refill["tokens_per_s"],
                                "met": bool(r["tokens_per_s"] >= 0.85 * refill["tokens_per_s"]) if k >= c else None}
                               for k, r in sorted(rows.items())]
            if c in rows:
                chunks = rows[c]["ttft_p50_ms"] / refill["chunk_ms"]
                t["ttft_chunks"] = {"concurrency": c, "ttft_p50_ms": rows[c]["ttft_p50_ms"],
                                    "chunk_ms": refill["chunk_ms"], "chunks": chunks, "met": bool(chunks <= 2)}
        stream = loop.get("stream", {}).get(name)
        if stream and 1 in rows:
            n = stream["requests"]
            alone = zip(rows[1].get("completion_tokens", [])[:n], rows[1].get("latencies_s", [])[:n])
            pairs = [(k, s) for k, s in alone if k is not None]
            if len(pairs) == n and n:
                server = sum(k for k, _ in pairs) / sum(s for _, s in pairs)
                t["single_stream"] = {"requests": n, "server_tokens_per_s": server,
                                      "generate_tokens_per_s": stream["tokens_per_s"],
                                      "ratio": server / stream["tokens_per_s"],
                                      "met": bool(server >= 0.9 * stream["tokens_per_s"])}
        out[name] = t
    return out


def targets(data: dict, c: int) -> dict:
    """Issue 27's targets: at concurrency c, speculative >= 1.5x autoregressive throughput at equal or better p50
    per-token latency; no compiles after the warm-up; no leaked slots after the leak check."""
    by_mode = {m["mode"]: m for m in data["modes"]}
    t = {"concurrency": c}
    spec, ar = (next((r for r in by_mode.get(k, {}).get("rows", []) if r["concurrency"] == c), None)
                for k in ("speculative", "autoregressive"))
    if spec and ar:
        t["throughput_ratio"] = spec["tokens_per_s"] / ar["tokens_per_s"]
        t["tpot_p50_ms"] = {"speculative": spec["tpot_p50_ms"], "autoregressive": ar["tpot_p50_ms"]}
        t["throughput_met"] = bool(t["throughput_ratio"] >= 1.5 and spec["tpot_p50_ms"] <= ar["tpot_p50_ms"])
    t["compiles_after_warmup"] = {m["mode"]: m.get("compiles_after_warmup") for m in data["modes"]}
    t["leaked_slots"] = {m["mode"]: m["leak"]["leaked_slots"] for m in data["modes"] if "leak" in m}
    t["busy_rows_after_leak_check"] = {m["mode"]: m["leak"]["busy_rows_after"] for m in data["modes"] if "leak" in m}
    return t


def write_markdown(path: str, data: dict) -> None:
    m = data["meta"]
    lines = [
        "# Serving under load: speculative vs autoregressive (`benchmarks/serve_load.py`)",
        "",
        f"{m['date']}, {m['device']}, commit {m['commit']}; `{m['command']}`. Load average (1 min) "
        f"{m['loadavg_before']:.1f} before and {m['loadavg_after']:.1f} after the run on {m['cpu_count']} cores.",
        "",
        f"{m['requests']} greedy streamed requests per concurrency level (the same seeded list each time: prompts of "
        f"{m['prompt_len'][0]}-{m['prompt_len'][1]} tokens from the held-out corpus, max_tokens "
        f"{m['max_new_tokens'][0]}-{m['max_new_tokens'][1]}), server `--max-batch {m['max_batch']} --max-len "
        f"{m['max_len']} --dtype {m.get('dtype', 'auto')}`, the client in the same machine "
        f"({m.get('client_processes', 1)} process{'es' if m.get('client_processes', 1) > 1 else ''}, one HTTP "
        "connection per request in flight); the modes take turns at "
        "each level. Throughput = completion tokens / wall time; TTFT from "
        "sending to the first streamed event; TPOT = a request's (last event - first event) / (tokens - 1); "
        "occupancy = busy batch rows / rows, sampled every 0.25 s; tau = tokens per sequence step on the server.",
        "",
        "| mode | concurrency | tok/s | req/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | latency p50 s | "
        "occupancy | tau | compiles | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in data["modes"]:
        for r in mode["rows"]:
            lines.append(
                f"| {r['mode']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | "
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                f"{r['tpot_p50_ms']:.2f} / {r['tpot_p90_ms']:.2f} / {r['tpot_p99_ms']:.2f} | {r['latency_p50_s']:.2f} | "
                f"{r['mean_occupancy']:.2f} | {r['tau']:.2f} | {r['compiles_during']} | {r.get('errors', 0)} |")
    lines.append("")
    adaptive = [r for mode in data["modes"] for r in mode["rows"] if r.get("budget_policy")]
    if adaptive:
        lines += ["Adaptive budget (--budget auto), per level from the server's /metrics: batch steps per budget, batch "
                  "steps without the drafter, and tokens per "
                  "sequence step of the drafted steps, predicted for the chosen budgets vs observed:", ""]
        lines += [f"- {r['mode']}, concurrency {r['concurrency']}: {policy_text(r['budget_policy'])}"
                  for r in adaptive]
        lines.append("")
    if len(data["modes"]) == 2:
        spec, ar = ({r["concurrency"]: r for r in mode["rows"]} for mode in data["modes"])
        ratios = ", ".join(f"{c}: {spec[c]['tokens_per_s'] / ar[c]['tokens_per_s']:.2f}x" for c in spec if c in ar)
        lines += [f"Speculative / autoregressive throughput by concurrency: {ratios}.", "",
                  f"Greedy outputs identical across the two modes: {data['identical_outputs']} of "
                  f"{data['compared_outputs']} requests.", ""]
    ceiling = data.get("client_ceiling")
    if ceiling and "error" not in ceiling:
        lines += [f"The client's ceiling: {ceiling['tokens_per_s']:.0f} tok/s, the same requests (repeated to 256) at "
                  f"concurrency {ceiling['concurrency']} against the server's app over a stand-in decode with no "
                  f"model ({ceiling['rows']} rows, {CEILING_TOKENS} tokens a row every {1e3 * CEILING_CHUNK_S:.0f} "
                  f"ms: {ceiling['stand_in_tokens_per_s']:.0f} tok/s offered); a server row near it measures the "
                  "client and the HTTP path, not the decode.", ""]
    elif ceiling:
        lines += [f"The client's ceiling: not measured ({ceiling['error']}).", ""]
    lines += ["Server start (load + warm-up compile, the servers starting at once): " + ", ".join(
        f"{mode['mode']} {mode['startup_s']:.1f} s" for mode in data["modes"]) + ".", ""]
    leaks = [mode["leak"] for mode in data["modes"] if "leak" in mode]
    if leaks:
        lines += [f"Leak check: {m['leak_requests']} more greedy streamed requests per server (another seeded list), "
                  f"{m['disconnect_fraction']:.0%} of them dropping the connection after 1-3 streamed events; then, "
                  "with the server idle, the KV pool's free slots against before.", "",
                  "| mode | concurrency | sent | disconnected | server cancelled | errors | free slots before -> after "
                  "(of) | busy rows after | leaked slots | compiles | wall s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for k in leaks:
            lines.append(f"| {k['mode']} | {k['concurrency']} | {k['sent']} of {k['requests']} | {k['disconnected']} | "
                         f"{k['server_cancelled']} | {k['errors']} | {k['pool_slots_free_before']} -> "
                         f"{k['pool_slots_free_after']} ({k['pool_slots']}) | {k['busy_rows_after']} | "
                         f"{k['leaked_slots']} | {k['compiles_during']} | {k['wall_s']:.1f} |")
        lines.append("")
    t = data.get("targets", {})
    if t:
        lines.append(f"Targets (issue 27; concurrency {t['concurrency']}):")
        if "throughput_ratio" in t:
            lines.append(f"- speculative / autoregressive throughput {t['throughput_ratio']:.2f}x (target >= 1.5x) at "
                         f"TPOT p50 {t['tpot_p50_ms']['speculative']:.2f} vs "
                         f"{t['tpot_p50_ms']['autoregressive']:.2f} ms (target: equal or better): "
                         f"{'met' if t['throughput_met'] else 'not met'}.")
        else:
            lines.append(f"- throughput: not measured at concurrency {t['concurrency']} in both modes.")
        lines.append("- compiles after the warm-up (levels and leak check): " + ", ".join(
            f"{k} {'unknown' if v is None else v}" for k, v in t["compiles_after_warmup"].items()) + " (target 0).")
        if t.get("leaked_slots"):
            lines.append("- leaked KV slots after the leak check: " + ", ".join(
                f"{k} {v} (busy rows {t['busy_rows_after_leak_check'][k]})" for k, v in t["leaked_slots"].items())
                + " (target 0).")
        lines.append("")
    lines += loop_lines(data)
    if data.get("notes"):
        lines += data["notes"] + [""]
    exits = {mode["mode"]: mode.get("server_exit") for mode in data["modes"]}
    if any(code not in (0, None) for code in exits.values()):
        lines += ["Server exit codes (0: stopped cleanly): " + ", ".join(f"{k} {v}" for k, v in exits.items()) + ".",
                  ""]
    if any(mode["rows"] for mode in data["modes"]):
        lines.append(f"![throughput and latency]({os.path.basename(path)[:-3]}.png)")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _verdict(met) -> str:
    return "-" if met is None else "met" if met else "not met"


def loop_lines(data: dict) -> list:
    """The report's loop-baseline section: each mode's server against the engine's own loop (loop_comparison)."""
    loop, by_mode = data.get("loop"), data.get("loop_targets")
    if not loop:
        return []
    m = data["meta"]
    c = m.get("target_concurrency", 16)
    lines = [
        "The server against the engine's own loop (issue 45 item 3): the same requests in the same call, after the "
        f"servers stopped, in a subprocess ({loop['wall_s']:.0f} s with its load and compiles): "
        f"`spec_decode.run_refill` (continuous batching: {m['max_batch']} rows refilled between chunks of "
        f"{loop['chunk_steps']} steps, {m['max_len']} positions a row, greedy, each request its own max_tokens, the "
        f"program its server ran) and the first {loop['stream_requests']} requests each alone through "
        "`engine.generate`, as the CLI decodes them (the CLI's settings for the mode). "
        "Tokens are completion tokens, the first (the prefill's) included, on every side; tok/s = tokens / wall: the "
        "loop's from its first admission to its last token read (prefills included), generate's the sum of its "
        "calls' walls (prefill included; each timed after untimed calls that compile its loop), the server's from "
        "the first request sent to the last answer (single stream: the sum of those requests' latencies at "
        "concurrency 1). A chunk's time = the loop's wall / its chunks. Compiles: XLA compiles in the timed parts.",
        "",
        "| mode | loop program | loop tok/s | loop tokens | chunk ms | compiles | concurrency | server tok/s | "
        "server tokens | server / loop | target >= 0.85 |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in data["modes"]:
        refill = loop.get("refill", {}).get(mode["mode"])
        if not refill:
            lines.append(f"| {mode['mode']} | not measured | | | | | | | | | |")
            continue
        rows = {r["concurrency"]: r for r in mode["rows"]}
        for t in by_mode[mode["mode"]]["throughput"]:
            r = rows[t["concurrency"]]
            lines.append(f"| {mode['mode']} | {refill['program']} | {refill['tokens_per_s']:.1f} | "
                         f"{refill['tokens']} | {refill['chunk_ms']:.1f} | {refill['compiles']} | {t['concurrency']} | "
                         f"{r['tokens_per_s']:.1f} | {r['tokens']} | {t['ratio']:.2f} | {_verdict(t['met'])} |")
    lines += ["", "| mode | requests | generate alone tok/s | decoding | compiles | server, concurrency 1, those "
              "requests tok/s | server / generate | target >= 0.90 |", "|---|---|---|---|---|---|---|---|"]
    for mode in data["modes"]:
        stream, t = loop.get("stream", {}).get(mode["mode"]), by_mode[mode["mode"]].get("single_stream")
        if not stream:
            lines.append(f"| {mode['mode']} | not measured | | | | | | |")
            continue
        decoding = "/".join(sorted({call["decoding"] for call in stream["calls"]}))
        server = (f"{t['server_tokens_per_s']:.1f} | {t['ratio']:.2f} | {_verdict(t['met'])}" if t else
                  "not measured | | ")
        lines.append(f"| {mode['mode']} | {stream['requests']} | {stream['tokens_per_s']:.1f} | {decoding} | "
                     f"{stream['compiles']} | {server} |")
    lines += ["", f"TTFT p50 at concurrency {c} in the loop's chunks (target <= 2):"]
    for mode in data["modes"]:
        t = by_mode[mode["mode"]].get("ttft_chunks")
        lines.append(f"- {mode['mode']}: " + (
            f"{t['ttft_p50_ms']:.0f} ms = {t['chunks']:.2f} chunks of {t['chunk_ms']:.1f} ms: {_verdict(t['met'])}."
            if t else f"not measured (no concurrency {c} level, or no loop run)."))
    return lines + [""]


def plot(path: str, data: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode, color in zip(data["modes"], ["tab:blue", "tab:orange"]):
        c = [r["concurrency"] for r in mode["rows"]]
        axes[0].plot(c, [r["tokens_per_s"] for r in mode["rows"]], "o-", color=color, label=mode["mode"])
        for ax, key in ((axes[1], "ttft"), (axes[2], "tpot")):
            ax.plot(c, [r[f"{key}_p50_ms"] for r in mode["rows"]], "o-", color=color, label=f"{mode['mode']} p50")
            ax.plot(c, [r[f"{key}_p90_ms"] for r in mode["rows"]], "o--", color=color, alpha=0.6,
                    label=f"{mode['mode']} p90")
    for ax, title in zip(axes, ["throughput (tok/s)", "time to first token (ms)", "per-token latency (ms)"]):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle(f"serve_load: {data['meta']['device']}, {data['meta']['date']}, {data['meta']['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def device_name() -> str:
    """The server's device as the results name it: the CPU (and its cores) unless JAX sees an accelerator."""
    import jax

    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return f"CPU ({os.cpu_count()} cores)"
    return str(dev.device_kind)


def main(argv=None) -> int:
    t_start = time.monotonic()
    args = build_parser().parse_args(argv)
    if args.loop_worker:
        return loop_worker(args.loop_worker)
    if args.stand_in_port:
        return stand_in_server(args)
    if args.smoke:
        args.requests, args.concurrency, args.max_new_tokens, args.prompt_len = 4, "1,2", "4,8", "8,16"
        args.loop_stream_requests = min(args.loop_stream_requests, 2)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.requests < 1 or any(c < 1 for c in levels):
        raise SystemExit("error: --requests and every --concurrency must be >= 1")
    if args.leak_requests < 0 or not 0 <= args.disconnect_fraction <= 1:
        raise SystemExit("error: --leak-requests must be >= 0 and --disconnect-fraction in [0, 1]")
    if args.loop_stream_requests < 0 or args.loop_reserve_s < 0:
        raise SystemExit("error: --loop-stream-requests and --loop-reserve-s must be >= 0")
    modes = args.modes.split(",")
    if not set(modes) <= {"speculative", "autoregressive"}:
        raise SystemExit(f"error: --modes takes speculative and/or autoregressive; got {args.modes}")
    prompt_len, new_tokens = _pair(args.prompt_len, "--prompt-len"), _pair(args.max_new_tokens, "--max-new-tokens")
    # The servers get the caller's environment; this process (which asks JAX only for the device's name) takes no
    # device memory: on a GPU, JAX would otherwise reserve 75% of it here, before the servers start.
    _SERVER_ENV.clear()
    _SERVER_ENV.update(os.environ)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    signal.signal(signal.SIGTERM, _on_sigterm)
    deadline = None if args.deadline_s is None else t_start + args.deadline_s
    out_dir = provenance_smoke_dir() if args.smoke else args.out
    os.makedirs(out_dir, exist_ok=True)
    from kdtree_jax import provenance
    from kdtree_jax.generate import DEFAULT_CHECKPOINT

    checkpoint = args.checkpoint or DEFAULT_CHECKPOINT
    docs = corpus_docs(os.path.join(checkpoint, "tokenizer"), prompt_len[1] + 1)
    requests = make_requests(args.requests, prompt_len, new_tokens, args.seed, docs)
    leak_requests = make_requests(args.leak_requests, prompt_len, new_tokens, args.seed + 1, docs,
                                  args.disconnect_fraction) if args.leak_requests else []
    device = device_name()
    slug = "smoke" if args.smoke else ("cpu" if device.startswith("CPU") else
                                       device.lower().replace("nvidia", "").strip().replace(" ", "_"))
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="serve_load_logs_")  # the loop baseline's log goes there too
    load_before = os.getloadavg()
    ceiling = None
    if not args.no_client_ceiling:
        ceiling = client_ceiling(args, requests, max(levels))
        print(f"[the client's ceiling: {ceiling.get('tokens_per_s', float('nan')):.0f} tok/s at concurrency "
              f"{max(levels)} against a stand-in decode]", file=sys.stderr, flush=True)
    results, notes, interrupted = measure(modes, args, requests, leak_requests, levels, deadline)
    loop = {}
    if not args.no_loop_baseline and not interrupted:
        try:
            loop = loop_baseline(args, requests, results, deadline, notes)
        except Interrupted as e:  # outside its wait for the subprocess (which it stops itself)
            notes.append(f"Interrupted ({e}) while starting or reading the loop baseline.")
    load_after = os.getloadavg()
    data = {
        "meta": {"date": datetime.date.today().isoformat(), "device": device, "commit": provenance.git_commit(),
                 "command": "python benchmarks/serve_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "python": platform.python_version(), "requests": args.requests, "concurrency": sorted(levels),
                 "prompt_len": prompt_len, "max_new_tokens": new_tokens, "max_batch": args.max_batch,
                 "max_len": args.max_len, "dtype": args.dtype, "seed": args.seed, "cpu_count": os.cpu_count(),
                 "client_processes": args.client_processes,
                 "budget": args.budget if args.budget is not None else "the server's default (auto)",
                 "calibrate": args.calibrate,
                 "leak_requests": args.leak_requests, "disconnect_fraction": args.disconnect_fraction,
                 "target_concurrency": args.target_concurrency, "loop_baseline": not args.no_loop_baseline,
                 "loop_stream_requests": args.loop_stream_requests, "loop_reserve_s": args.loop_reserve_s,
                 "deadline_s": args.deadline_s, "wall_s": time.monotonic() - t_start,
                 # other work on the machine takes the server's cores: the 1-minute load average around the run
                 "loadavg_before": load_before[0], "loadavg_after": load_after[0]},
        "modes": results,
        "notes": notes,
    }
    if ceiling is not None:
        data["client_ceiling"] = ceiling
    if len(results) == 2:
        rows = [{r["concurrency"]: r for r in mode["rows"]} for mode in results]
        pairs = [(x, y) for c in rows[0] if c in rows[1]
                 for x, y in zip(rows[0][c]["texts"], rows[1][c]["texts"]) if x is not None and y is not None]
        data["compared_outputs"], data["identical_outputs"] = len(pairs), sum(x == y for x, y in pairs)
    data["targets"] = targets(data, args.target_concurrency)
    if loop:
        data["loop"] = loop
        data["loop_targets"] = loop_comparison(data, args.target_concurrency)
    base = os.path.join(out_dir, f"serve_load_{slug}")
    with open(base + ".json", "w") as f:
        json.dump(data, f, indent=1)
    write_markdown(base + ".md", data)
    if any(mode["rows"] for mode in results):  # nothing to plot when no level was measured
        plot(base + ".png", data)
    print(f"wrote {base}.json, .md" + (", .png" if any(mode["rows"] for mode in results) else ""), file=sys.stderr)
    return 0


def provenance_smoke_dir() -> str:
    from kdtree_jax.provenance import smoke_dir

    return smoke_dir("serve_load")


if __name__ == "__main__":
    sys.exit(main())
