"""`python -m kdtree_jax.serve` stops cleanly on SIGINT/SIGTERM whatever it is doing (issue 27 item 3): while it loads
the model, inside the warm-up's compile, and inside a first compile under load. The bug this guards against: the
main thread returned while the decode thread was still in XLA's native code, the interpreter finalised, and the
thread, torn down there, aborted the process ("FATAL: exception not rethrown", status -6); a signal during the
warm-up killed it (-15) or raised a KeyboardInterrupt traceback.

The embedded default pair served autoregressively with a small pool (the cheapest programs to compile), as a user
runs it (without conftest's forced host devices); speculatively with the adaptive budget (--budget auto) for a signal
while the start-up measures the budget's cost model. ~40 s on 2 CPU cores."""

from __future__ import annotations

import os
import importlib.util
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "checkpoints", "default")
missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(bool(missing), reason=f"the 'serve' extra is not installed ({', '.join(missing)} missing)"),
    pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                       reason="checkpoints/default is not there"),
]


# The speculative server's batch, pool and chunk are tests/test_serve.py's module server's: in a suite run its
# programs come from the session's compilation cache (its warm-up compiled them), so the start-up reaches the cost
# model's measurement in ~20 s instead of ~35 s of compiling; alone it compiles them.
SPECULATIVE = ("--max-batch", "4", "--max-len", "256", "--chunk-steps", "2")
AUTOREGRESSIVE = ("--max-batch", "2", "--max-len", "64", "--chunk-steps", "2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """The server as a subprocess, its output (stdout and stderr) read line by line in the background."""

    def __init__(self, *flags, speculative: bool = False):
        self.port = _free_port()
        env = dict(os.environ, XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                                  if "xla_force_host_platform_device_count" not in f))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kdtree_jax.serve", "--port", str(self.port),
             *(() if speculative else ("--no-speculative",)), *(SPECULATIVE if speculative else AUTOREGRESSIVE),
             *flags],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.time() > deadline:
                self.proc.kill()
                pytest.fail(f"no {text!r} from the server (status {self.proc.poll()}):\n{self.output()}")
            time.sleep(0.02)

    def stop(self, sig, timeout: float = 120.0) -> int:
        self.proc.send_signal(sig)
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"the server did not stop within {timeout} s of {sig.name}:\n{self.output()}")
        self._reader.join(10)
        return status

    def output(self) -> str:
        return "".join(self.lines)[-4000:]


@pytest.mark.parametrize("sig,phase,after,says", [
    (signal.SIGINT, "[loading the model", 0.0, "SIGINT while loading the model: stopped"),
    (signal.SIGTERM, "compiling ...]", 0.3, "SIGTERM during the warm-up: stopped"),
])
def test_a_signal_during_the_start_up_exits_0(sig, phase, after, says):
    server = _Server()
    server.wait_for(phase)
    time.sleep(after)  # the warm-up's first compile is running then
    status = server.stop(sig)
    out = server.output()
    assert status == 0, out
    assert "FATAL" not in out and "Traceback" not in out, out
    assert says in out and "serving" not in out, out


def test_sigterm_while_measuring_the_cost_model_exits_0(monkeypatch, tmp_path):
    """--budget auto with no cost model cached: the start-up measures one after the compile (seconds of decode
    steps); SIGTERM then ends the measurement at its next timing and the process exits 0, serving nothing and caching
    nothing."""
    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path))  # empty: the start-up measures
    server = _Server(speculative=True)
    server.wait_for("[measuring the tree-budget cost model")
    time.sleep(1.0)
    status = server.stop(signal.SIGTERM)
    out = server.output()
    assert status == 0, out
    assert "FATAL" not in out and "Traceback" not in out, out
    assert "SIGTERM during the warm-up: stopped" in out and "serving" not in out, out
    assert not list(tmp_path.rglob("*.json")), out  # an interrupted measurement is not cached


def test_sigterm_inside_a_first_compile_under_load_exits_0():
    """No warm-up: the first request compiles every program on the decode thread; SIGTERM then, with no drain time
    left (--drain-timeout 0): the request is answered 503, the process waits for the compile and exits 0."""
    import httpx

    server = _Server("--no-warmup", "--drain-timeout", "0")
    server.wait_for("[serving")
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    body = {"model": "default", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
    answer = []
    client = threading.Thread(target=lambda: answer.append(httpx.post(url, json=body, timeout=120)))
    client.start()
    time.sleep(1.0)  # the request is in: the decode thread is compiling its programs (a few seconds)
    status = server.stop(signal.SIGTERM)
    client.join(60)
    out = server.output()
    assert status == 0, out
    assert "FATAL" not in out and "Traceback" not in out, out
    assert out.rstrip().endswith("[stopped]"), out
    assert answer and answer[0].status_code in (200, 503), (answer, out)
    if answer[0].status_code == 503:
        assert answer[0].json()["error"]["code"] == "shutting_down"
