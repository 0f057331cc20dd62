"""`python -m kdtree_jax.serve` (issue 27): one server for the whole module (a subprocess on a free loopback port, the
embedded default pair in float32, speculative), driven by the `openai` client and by raw HTTP.

What it checks: completions streamed and whole give the same text; 10 concurrent greedy requests over 4 batch rows
(continuous batching: rows retire and are refilled mid-run) give exactly the outputs each prompt gets alone, with no
compile under that load; every bad request is an OpenAI-style 400/404/429 and the server keeps serving; a client that
disconnects mid-stream gets its KV slots freed; SIGTERM lets the stream in flight finish and exits 0.

Budget: ~60 s on 2 CPU cores, most of it the server's start (load + compile, ~30 s). Prompts stay under 16 tokens so
that one prefill program serves every request."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "checkpoints", "default")

missing = [m for m in ("fastapi", "uvicorn", "openai", "httpx") if __import__("importlib.util").util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(bool(missing), reason=f"the 'serve' extra is not installed ({', '.join(missing)} missing): "
                                             "pip install -e \".[serve]\""),
    pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                       reason="checkpoints/default is not there"),
]

MAX_BATCH, MAX_LEN, MAX_QUEUE = 4, 192, 6
PROMPTS = ["def fibonacci(n):", "import os\n", "class Foo:\n    def", "for i in range(", "x = [", "while True:\n",
           "def main():\n    args =", "return self.", "try:\n    import", "with open("]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    import httpx

    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="serve_test_", suffix=".log", delete=False)
    # The server runs as a user runs it: without conftest's eight forced host devices (for the sharding tests).
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                              if "xla_force_host_platform_device_count" not in f))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdtree_jax.serve", "--port", str(port), "--max-batch", str(MAX_BATCH),
         "--max-len", str(MAX_LEN), "--max-queue", str(MAX_QUEUE), "--chunk-steps", "2", "--drain-timeout", "20"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail("the server did not start within 240 s")
        time.sleep(0.5)
    yield {"url": url, "proc": proc, "log": log.name}
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    os.unlink(log.name)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(url) -> dict:
    import httpx

    from kdtree_jax.serve.metrics import parse

    return parse(httpx.get(url + "/metrics", timeout=10).text)


def _complete(client, prompt, max_tokens, stream=False, **kw):
    kw = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    if not stream:
        c = client.completions.create(**kw).choices[0]
        return c.text, c.finish_reason
    text, finish = "", None
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def test_models_health_metrics(server):
    import httpx

    url = server["url"]
    models = httpx.get(url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["default"]
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["decoding"] == "speculative" and health["budget"] == 16
    m = _metrics(url)
    for name in ("requests_total{outcome=\"ok\"}", "generated_tokens_total", "tau", "batch_occupancy", "pool_usage",
                 "pool_slots_free", "queue_length", "compiles_total"):
        assert name in m, name
    assert m["pool_slots"] == MAX_BATCH * MAX_LEN


def test_openai_client_streamed_and_whole(client):
    whole, finish = _complete(client, PROMPTS[0], 24)
    assert finish == "length" and len(whole) > 10
    streamed, finish = _complete(client, PROMPTS[0], 24, stream=True)
    assert (streamed, finish) == (whole, "length")
    # A stop string inside that text: cut before it, finish_reason "stop", in both modes.
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    cut = whole[:whole.find(stop)]
    assert _complete(client, PROMPTS[0], 24, stop=[stop]) == (cut, "stop")
    assert _complete(client, PROMPTS[0], 24, stream=True, stop=stop) == (cut, "stop")


def test_concurrent_greedy_equals_alone_without_compiles(server, client):
    """10 requests with different lengths over 4 rows: each gets exactly what it gets alone, and nothing compiles."""
    lengths = [8 + 3 * i for i in range(len(PROMPTS))]
    alone = [_complete(client, p, n) for p, n in zip(PROMPTS, lengths)]
    compiles = _metrics(server["url"])["compiles_total"]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda a: _complete(client, *a, stream=a[0] in PROMPTS[::2]),
                                 zip(PROMPTS, lengths)))
    assert together == alone
    m = _metrics(server["url"])
    assert m["compiles_total"] == compiles
    assert m["tau"] > 1.5  # speculation accepted drafted tokens


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x"}, 400, "model"),
    ({"model": "default"}, 400, "prompt"),
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "default", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "default", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "default", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "default", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"model": "default", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "default", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ({"model": "default", "prompt": "x", "bogus": 1}, 400, "bogus"),
    ({"model": "default", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "default", "prompt": ""}, 400, "prompt"),
    ({"model": "default", "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": "default", "prompt": [1, 10 ** 6]}, 400, "prompt"),
    ({"model": "default", "prompt": [5] * 5000}, 400, "prompt"),  # over the model's context (4096)
    ({"model": "default", "prompt": [5] * 170}, 400, "prompt"),  # fits the context, not a pool row
    ({"model": "default", "prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),  # beyond the pool row
]


def test_bad_requests_are_openai_errors_and_the_server_keeps_serving(server, client):
    import httpx

    url = server["url"]
    for body, status, param in BAD:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (body, err)
        assert "\n" not in err["message"] and err["message"]
    import openai

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="default", prompt="x", max_tokens=1000)
    assert _complete(client, PROMPTS[1], 4)[1] == "length"  # still serving


def test_full_queue_answers_429(server):
    import httpx

    url = server["url"]
    body = {"model": "default", "prompt": "import sys\n", "max_tokens": 120, "temperature": 0}  # rows stay busy
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        codes = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(24)))
    statuses = sorted(r.status_code for r in codes)
    assert set(statuses) == {200, 429} and statuses.count(200) >= MAX_BATCH + MAX_QUEUE // 2, statuses
    err = next(r for r in codes if r.status_code == 429).json()["error"]
    assert err["code"] == "queue_full" and err["type"] == "rate_limit_exceeded"


def _settle(url, free, timeout=15.0) -> dict:
    deadline = time.time() + timeout
    while True:
        m = _metrics(url)
        if (m["pool_slots_free"] == free and m["batch_rows_busy"] == 0) or time.time() > deadline:
            return m
        time.sleep(0.1)


def test_disconnect_mid_stream_frees_the_sequence(server):
    import httpx

    url = server["url"]
    free = _settle(url, MAX_BATCH * MAX_LEN)["pool_slots_free"]
    assert free == MAX_BATCH * MAX_LEN
    cancelled = _metrics(url)['requests_total{outcome="cancelled"}']
    body = {"model": "default", "prompt": "def f(x):", "max_tokens": 150, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # held: dropping a half-read iterator closes the connection already
        events = 0
        while events < 2:
            events += next(lines).startswith("data: ")
        deadline = time.time() + 10
        while (busy := _metrics(url))["batch_rows_busy"] != 1 and time.time() < deadline:
            time.sleep(0.05)  # the gauges follow the decode thread's iterations
        assert busy["batch_rows_busy"] == 1 and busy["pool_slots_free"] < free
    # The connection is closed: the row retires and its slots go back.
    m = _settle(url, free)
    assert m["pool_slots_free"] == free and m["batch_rows_busy"] == 0
    assert m['requests_total{outcome="cancelled"}'] == cancelled + 1


def test_a_client_that_gives_up_on_a_whole_answer_frees_its_sequence_too(server):
    import httpx

    url = server["url"]
    free = _settle(url, MAX_BATCH * MAX_LEN)["pool_slots_free"]
    body = {"model": "default", "prompt": "def h(z):", "max_tokens": 150, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json=body, timeout=0.5)  # closes the connection when it times out
    m = _settle(url, free)
    assert m["pool_slots_free"] == free and m["batch_rows_busy"] == 0


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    """The streamed text never shows half a UTF-8 character or the start of a stop string that may complete."""
    from kdtree_jax.serve.api import TextStream
    from kdtree_jax.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ids = list("héllo END tail".encode())
    s = TextStream(tok, ["END"])
    pieces = [s.feed(ids[:2]), s.feed(ids[2:3]), s.feed(ids[3:8]), s.feed(ids[8:9]), s.feed(ids[9:])]
    assert pieces[0] == "h" and pieces[1] == "é"  # the second byte of 'é' completes it
    assert "".join(pieces) == "héllo " and s.stopped and s.finish() == ""
    s = TextStream(tok, ["END"])
    assert s.feed(list(b"abc EN")) == "abc " and s.finish() == "EN"  # a stop's start that never completed is text


def test_help_explains_every_flag():
    from kdtree_jax.serve.__main__ import build_parser

    parser = build_parser()
    for action in parser._actions:
        assert action.help, action.option_strings
    text = parser.format_help()
    for flag in ("--checkpoint", "--host", "--port", "--max-batch", "--budget", "--no-speculative", "--max-queue"):
        assert flag in text


def test_sigterm_drains_the_stream_in_flight_then_exits_0(server):
    """Last (it stops the module's server): a stream that started before SIGTERM runs to its end, then exit 0."""
    import httpx

    url, proc = server["url"], server["proc"]
    body = {"model": "default", "prompt": "def g(y):", "max_tokens": 60, "temperature": 0, "stream": True}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 1:
                    proc.send_signal(signal.SIGTERM)
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=30) == 0
