"""The decode loop in a process of its own (`python -m kdtree_jax.serve --engine-process`).

Why: in one process the scheduler's decode thread and uvicorn's event loop share the GIL, and a chunk's launch and
read take and release it many times; beside a thread that runs Python all the time, the launch-and-read cycle took
17 ms against 2.8 ms alone on an H100 (docs/design.md, "The server's decode thread and the GIL"). Here the engine
process owns JAX, the models and the `Scheduler`; the HTTP process (api.py: tokenizing, detokenizing, the streams)
never touches a device, and its Python no longer delays a launch.

The two talk over one duplex pipe (multiprocessing, "spawn": a forked JAX runtime is not safe). HTTP -> engine:

    ("submit", call, rid, prompt, max_tokens, sampling, seed, submitted)   answered ("reply", call, None | error)
    ("cancel", rid, reason)        ("count", name, n)     ("query", call, what)   answered ("reply", call, value)
    ("stop", drain)

engine -> HTTP: ("started", summary) once the warm-up is over (or ("exit", status) if the start-up failed: the
engine printed why on the shared stderr), then ("events", [(rid, kind, value), ...]) with what the decode thread
emitted in one iteration of its loop (a chunk's tokens for every row, the rows done), and the replies. The engine's
commands are read by one thread of its own; its events are written by the decode thread itself, one write an
iteration (Scheduler.on_iteration), so no third thread there competes for the GIL.

A submit waits for the engine's answer, so that a full queue is still a 429 before a stream starts; /metrics and
/health ask the engine for its counters. The engine ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the
whole process group): the HTTP process decides when it stops, and an engine whose pipe closes (the HTTP process
died) stops at once. An engine that dies while serving fails the requests it had and stops the HTTP process, with
status 1 (`EngineClient.on_lost`): a server that can no longer decode should not answer /health.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import signal
import sys
import threading
import types
from typing import Callable, Optional

from kdtree_jax.serve import scheduler as sched
from kdtree_jax.serve.startup import StartupStopped, Summary, start_engine

START_METHOD = "spawn"


class RemoteMetrics:
    """The HTTP process's handle on the engine's `metrics.Metrics`: what api.py calls (add, budget_policy, render)."""

    def __init__(self, engine: "EngineClient"):
        self._engine = engine

    def add(self, name: str, n: int = 1) -> None:
        self._engine.send(("count", name, n))

    def budget_policy(self):
        return self._engine.query("budget_policy")

    def render(self) -> str:
        return self._engine.query("render")


class EngineClient:
    """The scheduler's surface for api.py (submit, cancel, error, the limits), over the engine process.

        engine = EngineClient.spawn(args)      # the process starts, loads the models and warms up
        summary = engine.wait_started(stop_asked)  # None: the start-up failed or was stopped (engine.exitcode says)
        app = api.create_app(engine, tokenizer, engine.metrics, ...)
        engine.stop()                          # drain=False: what runs is cancelled; joins the process
    """

    def __init__(self, process, conn):
        self.process, self._conn = process, conn
        self._send_lock = threading.Lock()
        self._calls = itertools.count()
        self._replies: dict = {}
        self._reply_ready = threading.Condition()
        self._jobs: dict = {}  # rid -> the HTTP side's sched.Request (its emit feeds the request's handler)
        self._started = threading.Event()
        self._summary: Optional[Summary] = None
        self.exitcode: Optional[int] = None
        self.metrics = RemoteMetrics(self)
        self.on_lost: Optional[Callable[[], None]] = None  # called (on the reader thread) if the engine dies serving
        self._stopping = False
        self.lost = False  # whether the engine died while serving
        self._reader = threading.Thread(target=self._read, name="kdtree-serve-engine-reader", daemon=True)
        self._reader.start()

    @classmethod
    def spawn(cls, args) -> "EngineClient":
        ctx = multiprocessing.get_context(START_METHOD)
        ours, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(target=engine_main, args=(theirs, args), name="kdtree-serve-engine", daemon=False)
        process.start()
        theirs.close()
        return cls(process, ours)

    # -- the pipe --------------------------------------------------------------------------------------------------
    def send(self, message) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the engine is gone: its requests get their error from _read's end
                pass

    def _call(self, message_of: Callable[[int], tuple], timeout: float = 60.0):
        call = next(self._calls)
        self.send(message_of(call))
        with self._reply_ready:
            if not self._reply_ready.wait_for(lambda: call in self._replies or not self._reader.is_alive(), timeout):
                raise RuntimeError(f"the engine process did not answer within {timeout:g} s")
            if call not in self._replies:
                raise RuntimeError("the engine process is gone")
            return self._replies.pop(call)

    def query(self, what: str):
        return self._call(lambda call: ("query", call, what))

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "events":
                    for rid, event, value in message[1]:
                        job = self._jobs.get(rid)
                        if job is None:
                            continue
                        if event != "tokens":
                            self._jobs.pop(rid, None)
                        job.emit(event, value)
                elif kind == "reply":
                    with self._reply_ready:
                        self._replies[message[1]] = message[2]
                        self._reply_ready.notify_all()
                elif kind == "started":
                    self._summary = message[1]
                    self._started.set()
                elif kind == "exit":
                    self.exitcode = message[1]
                    self._started.set()
        except (EOFError, OSError):
            pass
        finally:  # the engine is gone: nobody will answer these
            self._started.set()
            with self._reply_ready:
                self._reply_ready.notify_all()
            for job in list(self._jobs.values()):
                job.emit("error", "the engine process ended")
            self._jobs.clear()
            if self._summary is not None and not self._stopping:
                self.lost = True
                if self.on_lost is not None:
                    self.on_lost()

    # -- start and stop --------------------------------------------------------------------------------------------
    def wait_started(self, stop_asked: Callable[[], bool] = lambda: False) -> Optional[Summary]:
        """The engine's Summary once its warm-up is over; None if it failed (exitcode: its status) or stop_asked()
        turned true first (the engine is then stopped)."""
        while not self._started.wait(0.1):
            if stop_asked():
                self.stop()
                return None
        if self._summary is None:
            while self.process.is_alive():  # it closed the pipe on its way out
                self.process.join(0.1)
                if stop_asked():
                    self.process.kill()
            if self.exitcode is None:
                self.exitcode = self.process.exitcode if self.process.exitcode else 1
        return self._summary

    def stop(self, drain: bool = False, timeout: Optional[float] = None) -> None:
        """Stop the engine (drain: finish what it accepted first) and wait for its process (after the compile or
        chunk in flight; timeout None: however long that takes)."""
        self._stopping = True
        self.send(("stop", drain))
        self.process.join(timeout)

    def alive(self) -> bool:
        return self.process.is_alive()

    # -- what api.py uses ------------------------------------------------------------------------------------------
    @property
    def target(self):
        s = self._summary
        return types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=s.vocab_size,
                                                               max_position_embeddings=s.context))

    @property
    def settings(self) -> sched.Settings:
        return self._summary.settings

    def max_tokens_for(self, prompt_len: int) -> int:
        s = self._summary
        return sched.max_tokens_for(prompt_len, max_len=s.settings.max_len, num_nodes=s.num_nodes, depth=s.depth,
                                    context=s.context)

    @property
    def error(self) -> Optional[str]:
        if not self.alive():
            return "the engine process ended"
        return self.query("error")

    def submit(self, job: sched.Request) -> None:
        self._jobs[job.id] = job
        sampling = dataclasses.asdict(job.sampling)
        answer = self._call(lambda call: ("submit", call, job.id, list(job.prompt), job.max_tokens, sampling,
                                          job.seed, job.submitted))
        if answer is not None:
            self._jobs.pop(job.id, None)
            kind, message = answer
            raise (sched.QueueFull if kind == "queue_full" else sched.NotAccepting)(message)

    def cancel(self, job: sched.Request, reason: str = "cancelled") -> None:
        if job.id in self._jobs:
            self.send(("cancel", job.id, reason))


# -- the engine process -------------------------------------------------------------------------------------------
def engine_main(conn, args) -> None:
    """The engine process: start the scheduler as `python -m kdtree_jax.serve` would in-process
    (startup.start_engine), report, then serve the pipe's commands until told to stop or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            try:
                conn.send(message)
            except (OSError, ValueError):  # the HTTP process is gone; the command thread stops the scheduler
                pass

    stopping = threading.Event()

    def watch_pipe() -> None:  # during the start-up: a stop, or the HTTP process gone, ends it at a safe point
        try:
            while not stopping.is_set():
                if conn.poll(0.1):
                    message = conn.recv()
                    if message[0] == "stop":
                        stopping.set()
        except (EOFError, OSError):
            stopping.set()

    watcher = threading.Thread(target=watch_pipe, daemon=True)
    watcher.start()
    try:
        started = start_engine(args, stop_asked=stopping.is_set)
    except StartupStopped:
        send(("exit", 0))
        return
    except SystemExit as e:
        send(("exit", e.code if isinstance(e.code, int) else 1))
        return
    except BaseException as e:  # noqa: BLE001 - the start-up's own failure, on the shared stderr
        import traceback

        traceback.print_exc()
        send(("exit", 1))
        return
    scheduler = started.scheduler
    stopping.set()
    watcher.join()
    try:
        _serve_pipe(conn, scheduler, started.summary, send)
    except BaseException:  # noqa: BLE001 - this process's own fault: said on the shared stderr, the thread stopped
        import traceback

        traceback.print_exc()
        scheduler.stop(drain=False, timeout=None)
    finally:
        conn.close()
    sys.stderr.flush()
    os._exit(0)  # the decode thread has left; skip the interpreter's teardown of JAX's native threads


def _serve_pipe(conn, scheduler: sched.Scheduler, summary: Summary, send) -> None:
    """The started engine: the HTTP process's commands until "stop" or the pipe's end (then what runs is cancelled)."""
    requests: dict = {}  # rid -> the engine's sched.Request
    requests_lock = threading.Lock()
    events: list = []  # what the decode thread emitted in this iteration, sent at its end (one write, not one a row)

    def emitter(rid: int):
        def emit(kind, value):  # on the decode thread
            with requests_lock:
                if kind != "tokens":
                    requests.pop(rid, None)
                events.append((rid, kind, value))
        return emit

    def flush() -> None:
        with requests_lock:
            batch = events[:]
            events.clear()
        if batch:
            send(("events", batch))

    scheduler.on_iteration = flush

    send(("started", summary))
    try:
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "submit":
                _, call, rid, prompt, max_tokens, sampling, seed, submitted = message
                req = sched.Request(prompt=prompt, max_tokens=max_tokens, emit=emitter(rid), seed=seed,
                                    submitted=submitted, **sampling)
                with requests_lock:
                    requests[rid] = req
                try:
                    scheduler.submit(req)
                    answer = None
                except sched.QueueFull as e:
                    answer = ("queue_full", str(e))
                except sched.NotAccepting as e:
                    answer = ("not_accepting", str(e))
                if answer is not None:
                    with requests_lock:
                        requests.pop(rid, None)
                send(("reply", call, answer))
            elif kind == "cancel":
                with requests_lock:
                    req = requests.get(message[1])
                if req is not None:
                    scheduler.cancel(req, message[2])
            elif kind == "count":
                scheduler.metrics.add(message[1], message[2])
            elif kind == "query":
                _, call, what = message
                value = {"render": scheduler.metrics.render, "budget_policy": scheduler.metrics.budget_policy,
                         "error": lambda: scheduler.error}[what]()
                send(("reply", call, value))
            elif kind == "stop":
                scheduler.stop(drain=message[1], timeout=None)
                break
    except (EOFError, OSError):  # the HTTP process is gone: nobody is listening
        scheduler.stop(drain=False, timeout=None)
