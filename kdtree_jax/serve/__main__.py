"""`python -m kdtree_jax.serve`: an OpenAI-compatible completions and chat server with continuous batching.

    python -m kdtree_jax.serve                                   # the embedded default pair on 127.0.0.1:8000
    python -m kdtree_jax.serve --checkpoint DIR --port 8080 --max-batch 16 --budget 32
    python -m kdtree_jax.serve --calibrate                       # --budget auto, its cost model measured afresh
    python -m kdtree_jax.serve --no-speculative                  # autoregressive, for comparison
    python -m kdtree_jax.serve --checkpoint DIR --mesh 8 --layout ep   # the target split over 8 devices

    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "default", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'
    curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'

A request's sampling fields that it leaves out take the checkpoint's generation_config.json values (as the command
line's flags do, and as vLLM and Hugging Face do), else OpenAI's defaults (temperature 1): api.request_defaults.

Start-up: bind the port (a port in use is a one-line error, status 2, before anything loads), load the
checkpoint (a corrupt or truncated file is one line naming it, status 1), compile the greedy batch's programs on a short request (a minute or less on a CPU),
with --budget auto (the default) take the tree budget's step cost model from the cache or measure it (seconds, once
per model pair, device and --max-batch; --calibrate measures it again), then serve. SIGINT / SIGTERM
stop accepting connections, let the requests in flight finish (up to --drain-timeout seconds), end the rest (a stream
with a final error event, a whole request with a 503: api.py), wait for the decode thread to leave (after the compile or chunk it is running returns: XLA's native code is never torn
down under it) and exit 0. A signal during the start-up (load, warm-up compile, cost-model measurement) stops there,
also with status 0. A second SIGINT while waiting exits at once with status 130.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import socket
import sys
import time

from kdtree_jax.generate import budget_argument
from kdtree_jax.serve.startup import (SWITCH_INTERVAL_S, StartupStopped, _fail, budget_notice,  # noqa: F401
                                      scheduler_settings, serving_mesh, start_engine)


def _embedded_defaults() -> str:
    """' (the embedded pair's: ...)', the settings its generation_config.json holds, for --help ('' without one)."""
    from kdtree_jax import generation_config
    from kdtree_jax.generate import DEFAULT_CHECKPOINT

    try:
        values = generation_config.load(DEFAULT_CHECKPOINT)
    except ValueError:  # the server's start-up reports a bad file
        return ""
    return f" (the embedded pair's: {_settings(values)})" if values else ""


def _settings(values: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in values.items())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kdtree_jax.serve",
        description="Serve /v1/completions and /v1/chat/completions (OpenAI-compatible; streamed as server-sent "
                    "events or whole; chat messages rendered through the tokenizer's chat template, else a plain "
                    "'role: content' one), /v1/models, /health and /metrics (Prometheus) with DDTree speculative decoding and continuous batching: "
                    "one background thread runs the decode loop in chunks of steps and admits waiting requests "
                    "into free batch rows between chunks. A request's sampling fields that it leaves out "
                    "(temperature, top_p, top_k, repetition_penalty, presence_penalty, frequency_penalty) take the "
                    f"values of the checkpoint's generation_config.json{_embedded_defaults()}, else OpenAI's "
                    "defaults (temperature 1, no penalties); a field the request sets wins. /health lists the "
                    "defaults in force.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", default=None,
                   help="model directory (a kdtree_jax checkpoint: target, drafter, tokenizer; or an HF checkpoint, "
                        "served autoregressively); its generation_config.json, if any, gives requests their "
                        "default sampling settings. Default: the embedded pair in checkpoints/default, as "
                        "`python -m kdtree_jax.generate` uses")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the checkpoint directory's name)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="batch rows decoded together, whatever each request's sampling settings (the warm-up "
                        "compiles every program the batch runs: with a fixed budget one per power of two of rows up "
                        "to this, greedy-only and any-settings, with --budget auto one per menu budget; nothing "
                        "compiles after it); more rows: more throughput, more memory")
    p.add_argument("--max-len", type=int, default=1024,
                   help="KV pool positions per row: a request's prompt + max_tokens + one verify tree (budget + 1 "
                        "nodes and the drafter's depth; with --budget auto the menu's largest budget, 64) must fit "
                        "(larger requests get a 400); the pool holds max-batch x max-len positions, and the warm-up "
                        "compiles admission for every power-of-two prompt length up to it")
    p.add_argument("--budget", type=budget_argument, default="auto",
                   help="DDTree nodes a step verifies besides the root. 'auto': the adaptive budget: every decode "
                        "step picks its budget from {0, 4, 8, 16, 32, 64} (capped at what the drafter's depth and "
                        "--topk allow; 0 verifies the root only, and the policy may also skip the drafter for a plain "
                        "autoregressive step) by the drafter's own probabilities and a cost model of this device: "
                        "what a step of each budget costs at --max-batch rows, measured at start-up (a few seconds, "
                        "after the compile) once per model pair, device and batch size and cached "
                        "($KDTREE_JAX_CACHE, else $XDG_CACHE_HOME/kdtree_jax or ~/.cache/kdtree_jax; see "
                        "--calibrate). /metrics and /health then report the "
                        "steps of each budget, the steps without the drafter and the predicted vs observed tau. "
                        "A number: that budget every step (0: autoregressive, as --no-speculative; a warning at "
                        "start-up when the cached cost model says such a step cannot beat an autoregressive one)")
    p.add_argument("--menu", type=menu_argument, default=None, metavar="B,B,...",
                   help="with --budget auto: the budgets a step picks from (default 0,4,8,16,32,64; 0 is always in "
                        "it): each one is a program per row count the warm-up compiles, so a shorter menu starts "
                        "sooner")
    p.add_argument("--lone-row-programs", action=argparse.BooleanOptionalAction, default=None,
                   help="with --budget auto: a lone request runs one-row programs priced at one row's measured step "
                        "costs (and all-greedy batches a greedy program), instead of the full batch's. Default: on "
                        "a GPU, off elsewhere (a CPU serves autoregressively). They double the start-up compiles; "
                        "without them a lone request ran 0.61x the autoregressive server on an H100")
    p.add_argument("--calibrate", action="store_true",
                   help="with --budget auto: measure the step cost model again at start-up instead of using the "
                        "cached one, and cache the new measurement; for after a "
                        "driver, library, hardware or flag change that alters step times")
    p.add_argument("--topk", type=int, default=4, help="drafter candidates per depth the tree may branch into")
    p.add_argument("--tree-temperature", type=float, default=None,
                   help="DDTree ranks prefixes by the drafter's probabilities at this temperature (default: the "
                        "checkpoint's recommendation (its kdtree_checkpoint.json; 1.0 for the embedded pair), else 1.0)")
    p.add_argument("--no-speculative", action="store_true",
                   help="decode autoregressively (one target pass a token; the drafter is not run): the baseline")
    p.add_argument("--chunk-steps", type=int, default=None,
                   help="decode steps per chunk: tokens reach clients and new requests join the batch between chunks "
                        "(smaller: sooner; larger: less host work per token; default 4, "
                        "engine.default_chunk_steps(continuous=True))")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests allowed to wait beyond those the free batch rows will take; more get 429")
    p.add_argument("--mesh", type=mesh_argument, nargs="?", const="all", default=1, metavar="N|all",
                   help="split the target over N devices (a 1-D mesh, sharding.py); 'all' (or --mesh alone): every "
                        "visible device; 1: one device, unsharded. The drafter, the KV pool and the decode loop's state "
                        "are replicated on every device. N must divide what --layout splits (attention heads, and the "
                        "MLP widths or the routed experts); a start-up error names the sizes that do. On a CPU, "
                        "XLA_FLAGS=--xla_force_host_platform_device_count=N makes N host devices")
    p.add_argument("--layout", default="tp", choices=["tp", "ep"],
                   help="with --mesh: tp splits attention heads and every MLP's and expert's intermediate dimension "
                        "(partial sums meet in an all-reduce); ep splits the heads likewise but places routed experts "
                        "whole, n_routed_experts / N on each device")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="parameter dtype (auto: float32 on a CPU, as saved on a GPU)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGINT/SIGTERM lets the requests in flight run on; then each one still running ends "
                        "(a stream with a final error event whose code is 'shutting_down', a whole request with a "
                        "503) and the server exits 0")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip compiling before serving (the first request pays the compile instead)")
    p.add_argument("--warmup-prompt-tokens", type=int, default=None, metavar="N",
                   help="the warm-up compiles row admission only for prompts up to N tokens (default: every prompt "
                        "length a row takes); a longer prompt's admission compiles on its first use, which stalls "
                        "the requests behind it. A faster start-up where prompts are known to be short")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="compile every program afresh at start-up: by default compiled programs are kept in JAX's "
                        "persistent cache under ~/.cache/kdtree_jax/jax_compilation_cache ($KDTREE_JAX_CACHE; "
                        "$JAX_COMPILATION_CACHE_DIR wins) and the next start reads them back")
    p.add_argument("--engine-process", action="store_true",
                   help="run the decode loop (the models, every JAX call) in a process of its own, the HTTP side "
                        "(tokenizing, detokenizing, the streams) in this one: their Python then never waits for the "
                        "other's (one process shares one interpreter lock, and a chunk's launch waits behind the "
                        "streams' work)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request)")
    return p


def mesh_argument(text: str):
    """--mesh: a device count >= 1, or 'all'."""
    if text == "all":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a device count >= 1 or 'all'; got {text!r}")
    return n


def menu_argument(text: str) -> tuple:
    """--menu's comma-separated budgets (argparse type)."""
    try:
        menu = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of budgets >= 0, e.g. 0,8,16; got {text!r}")
    if any(b < 0 for b in menu):
        raise argparse.ArgumentTypeError(f"budgets must be >= 0; got {text!r}")
    return menu


def check_flags(args) -> None:
    if not 0 < args.port < 65536:
        _fail(f"--port must be in [1, 65535]; got {args.port}")
    for name in ("max_batch", "max_len", "chunk_steps", "max_queue"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.budget != "auto" and args.budget < 0:
        _fail(f"--budget must be 'auto' or >= 0; got {args.budget}")
    if args.menu is not None and (args.budget != "auto" or args.no_speculative):
        _fail("--menu lists the budgets of --budget auto; drop it with a numeric --budget or --no-speculative")
    if args.lone_row_programs and (args.budget != "auto" or args.no_speculative):
        _fail("--lone-row-programs is for --budget auto (a fixed budget has its row programs always); drop it with a "
              "numeric --budget or --no-speculative")
    if args.calibrate and (args.budget != "auto" or args.no_speculative):
        _fail("--calibrate measures the cost model of --budget auto; drop it with a numeric --budget or "
              "--no-speculative")
    if args.topk < 1:
        _fail(f"--topk must be >= 1; got {args.topk}")
    if args.tree_temperature is not None and not args.tree_temperature > 0:
        _fail(f"--tree-temperature must be > 0; got {args.tree_temperature}")
    if args.drain_timeout < 0:
        _fail(f"--drain-timeout must be >= 0; got {args.drain_timeout}")


def bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound now, before the model loads: a port in use (or an address this machine lacks) is a
    one-line error, status 2, at once rather than after the load and compile. uvicorn listens on this very socket,
    so no other process can take the port in between."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        _fail(f"--host {host!r} is not an address of this machine ({e.strerror})")
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a restart need not wait
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = ("already in use (another server? pick one with --port)" if e.errno == errno.EADDRINUSE else
               e.strerror or str(e))
        _fail(f"cannot listen on {host}:{port}: {why}")
    return sock


def _say(line: str) -> None:
    """One line on stderr, safe inside a signal handler (no buffered stream that the handler may have interrupted)."""
    os.write(2, (line + "\n").encode())


class _Signals:
    """SIGINT/SIGTERM outside uvicorn's own handlers (start-up, and after the server returns): the first one asks to
    stop, which the main thread acts on at its next check (between load and warm-up, while it waits for the warm-up
    on the decode thread) or hands to the server once it exists. Nothing is raised into the code running then (a
    KeyboardInterrupt in the middle of JAX's start-up is a traceback, not a clean exit). A second SIGINT exits at
    once with status 130, without waiting for a compile in flight."""

    def __init__(self):
        self.received: "int | None" = None
        self.server = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle)

    def handle(self, sig, frame):
        name = signal.Signals(sig).name
        if self.received is None:
            self.received = sig
            if self.server is not None:
                self.server.should_exit = True
            return
        if sig == signal.SIGINT:
            _say(f"[{name} again: exiting without waiting for the decode thread]")
            os._exit(128 + sig)
        _say(f"[{name}: already stopping; waiting for the compile or chunk in flight (SIGINT again to force)]")

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""


# What uvicorn may still take after --drain-timeout, once the app has ended the requests still running, before it
# cancels their tasks (a cancelled stream would drop its connection and log a traceback).
END_GRACE_S = 5.0


def _server_class(signals: _Signals, drain_timeout: float):
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM once it has shut down (the process then dies of the signal, status 130 or
        143); a server that drained its requests exits 0 instead. A signal that came before uvicorn took over the
        handlers (between the warm-up and serving) is honoured through `should_exit`. Shutting down, the requests in
        flight run on for --drain-timeout seconds; then the app ends the rest itself (api.py: end_requests)."""

        def handle_exit(self, sig, frame):
            if signals.received is None:
                signals.received = sig
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()

        async def shutdown(self, sockets=None):
            end = getattr(getattr(self.config.app, "state", None), "end_requests", None)
            timer = asyncio.get_running_loop().call_later(drain_timeout, end) if end is not None else None
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    return Server


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_flags(args)
    try:
        import fastapi  # noqa: F401
        import jinja2  # noqa: F401 - chat templates
        import uvicorn
    except ImportError as e:
        _fail(f"the server needs the 'serve' extra ({e.name} is missing): pip install -e \".[serve]\"")
    sock = bind(args.host, args.port)
    signals = _Signals()  # from here on a signal stops the server cleanly, whatever it is doing

    from kdtree_jax import generation_config
    from kdtree_jax.generate import checkpoint_dir, load_tokenizer_of, notice

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    from kdtree_jax.serve import chat_template
    from kdtree_jax.serve.api import create_app

    t0 = time.perf_counter()
    try:  # read before the weights: a bad file is one line at once
        sampling_defaults = generation_config.load(checkpoint_dir(args.checkpoint))
    except ValueError as e:
        _fail(str(e))
    stop_asked = lambda: signals.received is not None  # noqa: E731
    engine = None
    if args.engine_process:
        from kdtree_jax.serve.engine_process import EngineClient

        server_side = engine = EngineClient.spawn(args)
        summary = engine.wait_started(stop_asked)
        if summary is None:
            if stop_asked():
                print(f"[{signals.name} during the start-up: stopped]", file=sys.stderr, flush=True)
                return 0
            return engine.exitcode  # the engine printed why
        tokenizer, metrics = load_tokenizer_of(args.checkpoint), engine.metrics

        def engine_lost() -> None:  # on the engine client's reader thread
            _say(f"error: the engine process ended while serving (status {engine.process.exitcode}); stopping")
            if signals.server is not None:
                signals.server.should_exit = True

        engine.on_lost = engine_lost
    else:
        try:
            started = start_engine(args, stop_asked)
        except StartupStopped as e:
            print(f"[{signals.name} {e}: stopped]", file=sys.stderr, flush=True)
            return 0
        server_side, tokenizer, metrics, summary = started.scheduler, started.tokenizer, started.metrics, started.summary
    try:
        try:
            template = chat_template.for_tokenizer(tokenizer)
        except ValueError as e:
            _fail(f"the checkpoint's chat template: {e}")
        app = create_app(server_side, tokenizer, metrics, model_name=summary.model_name, info=summary.info,
                         template=template, sampling_defaults=sampling_defaults)
        if sampling_defaults:
            notice(f"a request's sampling fields default to {generation_config.FILENAME}'s "
                   + _settings(sampling_defaults)
                   + " (a field the request sets overrides it)")
        print(f"[serving '{summary.model_name}' on http://{args.host}:{args.port} ({summary.serving}"
              + ("; the decode loop in its own process" if engine is not None else "")
              + f"; ready in {time.perf_counter() - t0:.1f} s, {summary.compiles} compiles)]", file=sys.stderr,
              flush=True)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.drain_timeout + END_GRACE_S)
        server = signals.server = _server_class(signals, args.drain_timeout)(config)
        if signals.received is not None or (engine is not None and engine.lost):  # since the checks above (a lost
            server.should_exit = True  # engine's on_lost found no server yet): uvicorn starts, sees it, shuts down
        server.run(sockets=[sock])  # returns after SIGINT/SIGTERM and the drain of the requests in flight
    finally:
        # Whatever is left after --drain-timeout is cancelled; the decode thread leaves after the compile or chunk in
        # flight (not bounded: tearing a thread down inside XLA aborts the process; a second SIGINT exits at once).
        if server_side.alive():
            server_side.stop(drain=False, timeout=1.0)
            if server_side.alive():
                _say("[waiting for the decode thread's compile or chunk in flight ...]")
                server_side.stop(drain=False, timeout=None)
    print("[stopped]", file=sys.stderr, flush=True)
    return 1 if engine is not None and engine.lost else 0


if __name__ == "__main__":
    sys.exit(main())
