"""The server's faults (issue 45 item 4): a port in use is one line and status 2 before the model loads; SIGTERM lets
a stream run for --drain-timeout, then ends it with a final SSE error event, no traceback, status 0; a corrupt or
truncated checkpoint file is one line naming it, status 1, in `python -m kdtree_jax.generate` and the server, an
invalid generation_config.json one line, status 2; a whole (non-streamed) request whose client went away frees its
row within a chunk or so while its tokens keep arriving (it used to be noticed only after a 1 s pause in its tokens,
so a long answer ran to its end for nobody).

A random-init tiny pair saved as a checkpoint (seconds to load and compile), served autoregressively."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
missing = [m for m in ("fastapi", "uvicorn", "httpx", "jinja2") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(missing), reason=f"the 'serve' extra is not installed ({', '.join(missing)})")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    # as a user runs it: without conftest's eight forced host devices
    return dict(os.environ, XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                               if "xla_force_host_platform_device_count" not in f))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> str:
    import kdtree_jax
    from kdtree_jax.model.drafter import DrafterConfig, init_drafter

    cfg = kdtree_jax.ModelConfig.preset("tiny")
    path = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    kdtree_jax.save_checkpoint(path, kdtree_jax.init_model(cfg, seed=0),
                               init_drafter(cfg, DrafterConfig(block_size=4), seed=1))
    return path


def _truncated_copy(src: str, dst: str) -> str:
    """A copy of the checkpoint whose target data file is cut to a third: -> that file."""
    import shutil

    shutil.copytree(src, dst)
    data = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(dst, "target")) for f in names
            if os.path.basename(d) == "d"]
    big = max(data, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.truncate(os.path.getsize(big) // 3)
    return big


def test_a_port_in_use_is_one_line_before_the_model_loads(tiny_checkpoint):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "kdtree_jax.serve", "--checkpoint", tiny_checkpoint, "--port",
                            str(port)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"error: cannot listen on 127.0.0.1:{port}: already in use (another "
                                             "server? pick one with --port)"]
    assert "loading" not in r.stderr and time.time() - t0 < 20  # nothing loaded (a JAX start-up takes longer)


@pytest.mark.parametrize("command", [["kdtree_jax.generate", "--prompt", "x"], ["kdtree_jax.serve"]])
def test_a_truncated_checkpoint_file_is_one_line_naming_it(tiny_checkpoint, tmp_path, command):
    bad = _truncated_copy(tiny_checkpoint, str(tmp_path / "bad"))
    extra = ["--port", str(_free_port())] if command[0] == "kdtree_jax.serve" else []
    r = subprocess.run([sys.executable, "-m", *command, "--checkpoint", str(tmp_path / "bad"), *extra], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if line != "[loading the model ...]"]
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith(f"error: {bad} (target piece params) is truncated: "), lines[0]


def test_a_bad_generation_config_is_one_line_before_the_model_loads(tiny_checkpoint, tmp_path):
    """The server reads the checkpoint's generation_config.json (its requests' sampling defaults) before the weights:
    a value that is not valid is one line naming the file, status 2."""
    import shutil

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint, ckpt)
    path = os.path.join(ckpt, "generation_config.json")
    with open(path, "w") as f:
        json.dump({"temperature": 0.7, "top_p": 1.5}, f)
    r = subprocess.run([sys.executable, "-m", "kdtree_jax.serve", "--checkpoint", ckpt, "--port", str(_free_port())],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"error: {path}: top_p must be in (0, 1] (1: off); got 1.5"]


def test_corrupt_checkpoint_helper_quiets_the_readers_threads(tiny_checkpoint, tmp_path, capsys):
    """After a failed read, what TensorStore's own threads print (the abandoned reads' tracebacks) is kept out of
    stderr; the main program's lines still pass."""
    import _thread

    import kdtree_jax
    from kdtree_jax.checkpoint import CorruptCheckpoint, checked_load

    bad = _truncated_copy(tiny_checkpoint, str(tmp_path / "bad"))
    stream = sys.stderr
    try:
        with pytest.raises(CorruptCheckpoint, match="is truncated") as e:
            checked_load(kdtree_jax.load_checkpoint, str(tmp_path / "bad"))
        assert bad in str(e.value) and "\n" not in str(e.value)
        done = threading.Event()

        def foreign():  # a thread Python did not start, as TensorStore's are (threading._DummyThread)
            print("Traceback (most recent call last): RuntimeError: Event loop is closed", file=sys.stderr)
            done.set()

        _thread.start_new_thread(foreign, ())
        assert done.wait(10)
        print("the main program's line", file=sys.stderr)
        err = capsys.readouterr().err
        assert "Event loop is closed" not in err and "the main program's line" in err
    finally:
        sys.stderr = stream


# --- a whole request whose client goes away (in process: the scheduler's request is visible) ---------------------
WHOLE = [("/v1/completions", {"prompt": "def f(x):"}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "def f(x):"}]})]


@pytest.fixture(scope="module")
def slow_server():
    """uvicorn on a thread over a tiny model whose tokens arrive 30 ms apart (each chunk's delivery sleeps: a slow
    model), so that a long answer takes seconds."""
    import kdtree_jax
    import uvicorn

    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.api import create_app
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.tokenizer import ByteTokenizer

    target = kdtree_jax.init_model(kdtree_jax.ModelConfig.preset("tiny"), seed=0)
    metrics = Metrics()
    # One step a chunk, also for a lone row (lone_chunk_steps=0): each delivery's sleep is then one token's.
    scheduler = sched.Scheduler(target, None, sched.Settings(max_batch=2, max_len=512, budget=0, chunk_steps=1,
                                                             lone_chunk_steps=0), metrics)
    jobs = []
    submit = scheduler.submit

    def slow_submit(job):
        emit = job.emit

        def slow_emit(kind, value):
            if kind == "tokens":
                time.sleep(0.03)
            emit(kind, value)

        job.emit = slow_emit
        jobs.append(job)
        submit(job)

    scheduler.submit = slow_submit
    scheduler.start()
    app = create_app(scheduler, ByteTokenizer(), metrics, model_name="tiny", info={})
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    import httpx

    for route, body in WHOLE:  # compile first: the timings below are of tokens, not of compiles
        r = httpx.post(f"http://127.0.0.1:{port}{route}", json={"model": "tiny", "max_tokens": 2, "temperature": 0, **body},
                       timeout=300)
        assert r.status_code == 200, r.text
    yield f"http://127.0.0.1:{port}", jobs, metrics
    server.should_exit = True
    thread.join(30)
    scheduler.stop(drain=False, timeout=60)


@pytest.mark.parametrize("route,body", WHOLE)
def test_a_whole_request_whose_client_goes_away_frees_its_row_while_tokens_arrive(slow_server, route, body):
    import httpx

    url, jobs, _ = slow_server
    max_tokens = 400  # ~12 s of tokens at 30 ms each
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + route, json={"model": "tiny", "max_tokens": max_tokens, "temperature": 0, **body},
                   timeout=1.0)  # the client gives up and closes its connection
    job = jobs[-1]
    gone = time.time()
    while not job.finished and time.time() - gone < 20:
        time.sleep(0.02)
    waited = time.time() - gone
    assert job.finished and job.cancelled and job.cancel_reason == "cancelled"
    # Freed within a chunk or so of the client leaving, long before max_tokens
    assert waited < 2.0 and job.delivered < max_tokens // 4, (waited, job.delivered)


# --- SIGTERM with a stream in flight -----------------------------------------------------------------------------
# A drain short enough that the stream outlasts it: this 2-core machine streamed the 1,000 tokens (the tiny model's
# context) within 0.5 s of the signal, so a 0.5 s drain saw the stream finish.
@pytest.mark.parametrize("drain", ["0", "0.15"])
def test_sigterm_ends_a_stream_past_the_drain_timeout_with_an_error_event(tiny_checkpoint, drain):
    import httpx

    port = _free_port()
    # --no-warmup: the warm-up would compile admission for every prompt bucket up to 1,024 positions (~40 s on 2
    # cores), none of which this test uses; its one request compiles what it runs before its first event, so the
    # drain is timed on a server with nothing left to compile.
    proc = subprocess.Popen([sys.executable, "-m", "kdtree_jax.serve", "--checkpoint", tiny_checkpoint, "--port",
                             str(port), "--no-speculative", "--max-batch", "1", "--max-len", "1024", "--chunk-steps",
                             "1", "--drain-timeout", drain, "--no-warmup"], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.time() + 240
        while not any("[serving" in line for line in lines):
            assert proc.poll() is None and time.time() < deadline, "".join(lines)
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1000, "temperature": 0, "stream": True}
        events, sent_at = [], None
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if sent_at is None:
                        proc.send_signal(signal.SIGTERM)
                        sent_at = time.time()
        ended = time.time() - sent_at
        status = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    out = "".join(lines)
    assert status == 0, out
    assert "Traceback" not in out and "CancelledError" not in out and "ERROR" not in out, out
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error" and "--drain-timeout" in error["message"]
    pieces = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert pieces and len(pieces) < 1000  # cut short: the stream had tokens and did not run to max_tokens
    assert float(drain) <= ended < float(drain) + 5, ended


def test_the_servers_process_takes_the_gil_back_sooner_than_pythons_default(tiny_checkpoint, tmp_path, monkeypatch):
    """The decode thread and the event loop share the GIL, and a thread that asks for it waits up to the switch
    interval: the server sets its own (serve.__main__.SWITCH_INTERVAL_S) before anything is loaded. Run in-process up
    to the first refusal (a bad generation_config.json), its signal handlers and XLA flags left alone."""
    import shutil
    import signal

    from kdtree_jax.serve import __main__ as serve_main

    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint, ckpt)
    with open(os.path.join(ckpt, "generation_config.json"), "w") as f:
        json.dump({"top_p": 1.5}, f)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr("kdtree_jax.runtime.configure", lambda *args, **kwargs: False)
    before = sys.getswitchinterval()
    try:
        with pytest.raises(SystemExit):
            serve_main.main(["--checkpoint", ckpt, "--port", str(_free_port())])
        assert sys.getswitchinterval() == pytest.approx(serve_main.SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(before)
    assert serve_main.SWITCH_INTERVAL_S < before  # Python's default is 5 ms
