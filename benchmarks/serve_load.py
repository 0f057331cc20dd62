"""A bounded load test of `python -m kdtree_jax.serve`: speculative vs autoregressive serving under concurrency.

    python benchmarks/serve_load.py                                  # CPU defaults: 32 requests at 1, 4, 16, 64
    python benchmarks/serve_load.py --requests 128 --concurrency 1,8,32,128 --max-batch 16
    python benchmarks/serve_load.py --smoke                          # 4 requests at 1 and 2; a temp dir

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

The client runs in this process on the same machine: on a 2-core CPU it takes some of the server's CPU time (more
at high concurrency). Writes <out>/serve_load_<device>.{json,md,png} (--smoke: a temporary directory) with the date,
device and commit.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="the server's --checkpoint (default: the embedded pair)")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level (the same list each time)")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated requests in flight at once")
    p.add_argument("--modes", default="speculative,autoregressive",
                   help="comma-separated: speculative (the server's defaults), autoregressive (--no-speculative)")
    p.add_argument("--prompt-len", default="8,64", help="LO,HI: prompt lengths in tokens, uniform")
    p.add_argument("--max-new-tokens", default="16,96", help="LO,HI: max_tokens per request, uniform")
    p.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch")
    p.add_argument("--max-len", type=int, default=256, help="the server's --max-len (positions a row)")
    p.add_argument("--budget", type=int, default=None, help="the speculative server's --budget (default: its own)")
    p.add_argument("--chunk-steps", type=int, default=None, help="the server's --chunk-steps (default: its own)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request list (prompts and lengths)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"),
                   help="directory for serve_load_<device>.{json,md,png}")
    p.add_argument("--smoke", action="store_true", help="4 requests at concurrency 1 and 2, short outputs; writes to a "
                                                        "temporary directory")
    return p


def _pair(text: str, name: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise SystemExit(f"error: {name} must be LO,HI with 1 <= LO <= HI; got {text}")
    return lo, hi


def make_requests(count: int, prompt_len, new_tokens, seed: int, tokenizer_dir: str) -> list[dict]:
    """The seeded request list: token-id prompts cut from the held-out corpus files, and max_tokens."""
    from kdtree_jax import corpus
    from kdtree_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    docs = [np.asarray(tokenizer.encode(d.text), np.int32) for d in corpus.documents("eval")]
    docs = [d for d in docs if len(d) > prompt_len[1] + 1]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        doc = docs[int(rng.integers(len(docs)))]
        n = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        start = int(rng.integers(0, len(doc) - n))
        out.append({"prompt": doc[start:start + n].tolist(), "max_tokens": int(rng.integers(new_tokens[0],
                                                                                           new_tokens[1] + 1))})
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(mode: str, args, log_path: str):
    """A server subprocess for this mode; returns (process, url) once /health answers."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "kdtree_jax.serve", "--port", str(port), "--max-batch", str(args.max_batch),
           "--max-len", str(args.max_len), "--max-queue", "100000"]
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    if args.chunk_steps is not None:
        cmd += ["--chunk-steps", str(args.chunk_steps)]
    if mode == "autoregressive":
        cmd += ["--no-speculative"]
    elif args.budget is not None:
        cmd += ["--budget", str(args.budget)]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"error: the {mode} server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"error: the {mode} server did not start within 600 s; see {log_path}")


def metrics(url: str) -> dict:
    import httpx

    from kdtree_jax.serve.metrics import parse

    return parse(httpx.get(url + "/metrics", timeout=30).text)


async def one_request(client, url: str, req: dict, model: str) -> dict:
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    text, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            first = first if first is not None else now
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
                continue
            last = now
            text.append(event["choices"][0]["text"])
    return {"ttft": first - t0, "end": last - t0, "tokens": tokens, "text": "".join(text),
            "tpot": (last - first) / (tokens - 1) if tokens > 1 else float("nan")}


async def run_level(url: str, requests: list[dict], concurrency: int, model: str):
    """Every request, `concurrency` in flight at a time; a poller samples the batch occupancy meanwhile."""
    import httpx

    from kdtree_jax.serve.metrics import parse

    results = [None] * len(requests)
    occupancy = []
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def poll():
            while not done.is_set():
                m = parse((await client.get(url + "/metrics")).text)
                occupancy.append(m["batch_occupancy"])
                try:
                    await asyncio.wait_for(done.wait(), 0.25)
                except asyncio.TimeoutError:
                    pass

        queue = list(enumerate(requests))[::-1]

        async def worker():
            while queue:
                i, req = queue.pop()
                results[i] = await one_request(client, url, req, model)

        poller = asyncio.create_task(poll())
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
        wall = time.perf_counter() - t0
        done.set()
        await poller
    return results, wall, occupancy


def pct(values, q) -> float:
    values = [v for v in values if v == v]
    return float(np.percentile(values, q)) if values else float("nan")


def measure_level(mode: str, url: str, model: str, requests: list[dict], c: int) -> dict:
    """One concurrency level against one server: the row of the table."""
    before = metrics(url)
    results, wall, occupancy = asyncio.run(run_level(url, requests, c, model))
    after = metrics(url)
    steps = after["decode_steps_total"] - before["decode_steps_total"]
    emitted = after["tau"] * after["decode_steps_total"] - before["tau"] * before["decode_steps_total"]
    tokens = sum(r["tokens"] for r in results)
    row = {
        "mode": mode, "concurrency": c, "requests": len(results), "wall_s": wall, "tokens": tokens,
        "tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall,
        "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in results], 50),
        "ttft_p90_ms": 1e3 * pct([r["ttft"] for r in results], 90),
        "ttft_p99_ms": 1e3 * pct([r["ttft"] for r in results], 99),
        "tpot_p50_ms": 1e3 * pct([r["tpot"] for r in results], 50),
        "tpot_p90_ms": 1e3 * pct([r["tpot"] for r in results], 90),
        "tpot_p99_ms": 1e3 * pct([r["tpot"] for r in results], 99),
        "latency_p50_s": pct([r["end"] for r in results], 50),
        "mean_occupancy": float(np.mean(occupancy)) if occupancy else float("nan"),
        "tau": emitted / steps if steps else float("nan"),
        "compiles_during": int(after["compiles_total"] - before["compiles_total"]),
        "texts": [r["text"] for r in results],
    }
    print(f"  {mode:>14} c={c:<3} {row['tokens_per_s']:7.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:7.1f} ms  "
          f"TPOT p50 {row['tpot_p50_ms']:6.2f} ms  occupancy {row['mean_occupancy']:.2f}  tau "
          f"{row['tau']:.2f}  compiles {row['compiles_during']}", file=sys.stderr, flush=True)
    return row


def measure(modes: list[str], args, requests: list[dict], levels: list[int], out_dir: str) -> list[dict]:
    """Every server started and warmed up first, then each concurrency level on each server in turn: on a shared
    machine whose load drifts, the modes of one level are measured minutes apart at most, not a whole run apart.
    (An idle server's decode thread sleeps: it takes nothing from the one measured.)"""
    import httpx

    from kdtree_jax.serve.scheduler import prompt_bucket

    servers = {}
    log_dir = tempfile.mkdtemp(prefix="serve_load_logs_")  # server logs are not results: never in --out
    try:
        for mode in modes:
            print(f"[{mode}: starting the server ...]", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            proc, url = start_server(mode, args, os.path.join(log_dir, f"serve_load_{mode}_server.log"))
            servers[mode] = (proc, url)
            model = httpx.get(url + "/v1/models").json()["data"][0]
            # Warm-up: one request per prompt-length bucket of the list (the prefill compiles per bucket).
            seen = {}
            for req in requests:
                seen.setdefault(prompt_bucket(len(req["prompt"]), args.max_len), req)
            for req in seen.values():
                asyncio.run(run_level(url, [{**req, "max_tokens": 4}], 1, model["id"]))
            servers[mode] = (proc, url, model, time.perf_counter() - t0)
        out = {mode: {"mode": mode, "startup_s": servers[mode][3], "server": servers[mode][2], "rows": []}
               for mode in modes}
        for c in levels:
            for mode in modes:
                _, url, model, _ = servers[mode]
                out[mode]["rows"].append(measure_level(mode, url, model["id"], requests, c))
        return [out[mode] for mode in modes]
    finally:
        for server in servers.values():
            server[0].terminate()
        for server in servers.values():
            try:
                server[0].wait(timeout=60)
            except subprocess.TimeoutExpired:
                server[0].kill()


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
        f"{m['max_len']}`, the client in the same machine; the modes take turns at each level. Throughput = completion tokens / wall time; TTFT from "
        "sending to the first streamed event; TPOT = a request's (last event - first event) / (tokens - 1); "
        "occupancy = busy batch rows / rows, sampled every 0.25 s; tau = tokens per sequence step on the server.",
        "",
        "| mode | concurrency | tok/s | req/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | latency p50 s | "
        "occupancy | tau | compiles |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode in data["modes"]:
        for r in mode["rows"]:
            lines.append(
                f"| {r['mode']} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.2f} | "
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
                f"{r['tpot_p50_ms']:.2f} / {r['tpot_p90_ms']:.2f} / {r['tpot_p99_ms']:.2f} | {r['latency_p50_s']:.2f} | "
                f"{r['mean_occupancy']:.2f} | {r['tau']:.2f} | {r['compiles_during']} |")
    lines.append("")
    if len(data["modes"]) == 2:
        spec, ar = ({r["concurrency"]: r for r in mode["rows"]} for mode in data["modes"])
        ratios = ", ".join(f"{c}: {spec[c]['tokens_per_s'] / ar[c]['tokens_per_s']:.2f}x" for c in spec if c in ar)
        lines += [f"Speculative / autoregressive throughput by concurrency: {ratios}.", "",
                  f"Greedy outputs identical across the two modes: {data['identical_outputs']} of "
                  f"{data['compared_outputs']} requests.", ""]
    lines += ["Server start (load + warm-up compile): " + ", ".join(
        f"{mode['mode']} {mode['startup_s']:.1f} s" for mode in data["modes"]) + ".", ""]
    if data.get("notes"):
        lines += data["notes"] + [""]
    lines.append(f"![throughput and latency]({os.path.basename(path)[:-3]}.png)")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


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
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.max_new_tokens, args.prompt_len = 4, "1,2", "4,8", "8,16"
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.requests < 1 or any(c < 1 for c in levels):
        raise SystemExit("error: --requests and every --concurrency must be >= 1")
    modes = args.modes.split(",")
    if not set(modes) <= {"speculative", "autoregressive"}:
        raise SystemExit(f"error: --modes takes speculative and/or autoregressive; got {args.modes}")
    prompt_len, new_tokens = _pair(args.prompt_len, "--prompt-len"), _pair(args.max_new_tokens, "--max-new-tokens")
    out_dir = provenance_smoke_dir() if args.smoke else args.out
    os.makedirs(out_dir, exist_ok=True)
    from kdtree_jax import provenance
    from kdtree_jax.generate import DEFAULT_CHECKPOINT

    checkpoint = args.checkpoint or DEFAULT_CHECKPOINT
    requests = make_requests(args.requests, prompt_len, new_tokens, args.seed, os.path.join(checkpoint, "tokenizer"))
    device = device_name()
    slug = "smoke" if args.smoke else ("cpu" if device.startswith("CPU") else
                                       device.lower().replace("nvidia", "").strip().replace(" ", "_"))
    load_before = os.getloadavg()
    results = measure(modes, args, requests, levels, out_dir)
    load_after = os.getloadavg()
    data = {
        "meta": {"date": datetime.date.today().isoformat(), "device": device, "commit": provenance.git_commit(),
                 "command": "python benchmarks/serve_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "python": platform.python_version(), "requests": args.requests, "concurrency": levels,
                 "prompt_len": prompt_len, "max_new_tokens": new_tokens, "max_batch": args.max_batch,
                 "max_len": args.max_len, "seed": args.seed, "cpu_count": os.cpu_count(),
                 # other work on the machine takes the server's cores: the 1-minute load average around the run
                 "loadavg_before": load_before[0], "loadavg_after": load_after[0]},
        "modes": results,
    }
    if len(results) == 2:
        a = [t for r in results[0]["rows"] for t in r["texts"]]
        b = [t for r in results[1]["rows"] for t in r["texts"]]
        data["compared_outputs"], data["identical_outputs"] = len(a), sum(x == y for x, y in zip(a, b))
    base = os.path.join(out_dir, f"serve_load_{slug}")
    with open(base + ".json", "w") as f:
        json.dump(data, f, indent=1)
    write_markdown(base + ".md", data)
    plot(base + ".png", data)
    print(f"wrote {base}.json, .md, .png", file=sys.stderr)
    return 0


def provenance_smoke_dir() -> str:
    from kdtree_jax.provenance import smoke_dir

    return smoke_dir("serve_load")


if __name__ == "__main__":
    sys.exit(main())
