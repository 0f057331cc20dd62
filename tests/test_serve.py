"""`python -m kdtree_jax.serve` (issue 27): one server for the whole module (a subprocess on a free loopback port, the
embedded default pair in float32, speculative with the default adaptive budget, --budget auto), driven by the `openai`
client and by raw HTTP.

What it checks: completions streamed and whole give the same text; 10 concurrent greedy requests over 4 batch rows
(continuous batching: rows retire and are refilled mid-run) give exactly the outputs each prompt gets alone, with no
compile under that load; a request's sampling fields left out take the checkpoint's generation_config.json (the
greedy tests pass plain greedy explicitly); every bad request is an OpenAI-style 400/404/429 and the server keeps serving; a client that
disconnects mid-stream gets its KV slots freed; SIGTERM lets the stream in flight finish and exits 0. The adaptive
budget: /metrics and /health report the steps per budget and the predicted vs observed tau, greedy output equals a
fixed-budget server's, and --calibrate measures the cost model again instead of taking the cached one.

The module's server takes its cost model from a cache the fixture writes (costs of a device where speculation pays,
so that the policy speculates whatever this CPU's timings are, and the start-up measures nothing); the --calibrate
test measures one for real. Every cost model lives in a temporary $KDTREE_JAX_CACHE.

Budget: ~2 min on 2 CPU cores, most of it the servers' starts (load + compile, ~30 s each; the --calibrate one also
measures, ~20 s). The --budget 16 reference server starts (--no-warmup) and compiles for its requests while the
module's server starts, side by side: each start is mostly one core's compiling. Prompts stay under 16 tokens so
that one prefill program serves every request (the servers' warm-ups compile that prompt bucket's admission alone).
The --calibrate server and the cached-costs one (their tests' own) start side by side too."""

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

MAX_BATCH, MAX_LEN, MAX_QUEUE, CHUNK_STEPS = 4, 256, 6, 2
# The cost model the module's server finds cached: ms a step of the whole batch (an autoregressive step; each menu
# entry's step, the drafter included), a device where verifying more nodes costs little, so that speculation pays.
SEEDED_STEP_MS = {"ar": 10.0, 0: 11.0, 1: 11.5, 2: 12.0, 3: 13.0, 4: 15.0, 5: 19.0}
# Plain greedy, set explicitly: a request that leaves its settings out gets the embedded pair's
# generation_config.json (repetition penalty 1.2), and these tests compare unpenalised greedy outputs.
GREEDY = {"temperature": 0, "repetition_penalty": 1}
# The servers' warm-up compiles row admission for prompts up to this many tokens (--warmup-prompt-tokens): the 16-token
# prompt bucket, which every prompt here and the warm-up's and calibration's own take (each of them is shorter), not
# every bucket up to MAX_LEN (~8 programs more a start that no test here uses; tests/test_serve_admission.py checks
# that a whole warm-up compiles every bucket's admission).
WARMUP_PROMPT_TOKENS = 16
PROMPTS = ["def fibonacci(n):", "import os\n", "class Foo:\n    def", "for i in range(", "x = [", "while True:\n",
           "def main():\n    args =", "return self.", "try:\n    import", "with open("]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_server(*flags) -> dict:
    """A server subprocess with this module's settings and these flags, started (not yet serving: _wait_ready):
    {url, proc, log}. It runs as a user runs it: without conftest's eight forced host devices (for the sharding
    tests); its cost models go to $KDTREE_JAX_CACHE (the caller's temporary directory)."""
    assert os.environ.get("KDTREE_JAX_CACHE"), "set KDTREE_JAX_CACHE to a temporary directory first"
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="serve_test_", suffix=".log", delete=False)
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                              if "xla_force_host_platform_device_count" not in f))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdtree_jax.serve", "--port", str(port), "--max-batch", str(MAX_BATCH),
         "--max-len", str(MAX_LEN), "--max-queue", str(MAX_QUEUE), "--chunk-steps", str(CHUNK_STEPS),
         "--drain-timeout", "20", "--warmup-prompt-tokens", str(WARMUP_PROMPT_TOKENS), *flags],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    return {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log.name}


def _wait_ready(server: dict, timeout=240.0) -> dict:
    """The server, once /health answers (a failure if it exits or does not answer within `timeout` s)."""
    import httpx

    proc, url = server["proc"], server["url"]
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{_log(server)[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start within {timeout:.0f} s")
        time.sleep(0.5)
    return server


def _stop_server(server: dict) -> None:
    proc = server["proc"]
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    os.unlink(server["log"])


def _log(server: dict) -> str:
    with open(server["log"]) as f:
        return f.read()


def _greedy_cost_model():
    """(the cost model the server's bucket loads, the context its calibration runs at), computed as the server
    computes them: the same models (float32 on a CPU), settings and calibration prompt."""
    from kdtree_jax.generate import load_models
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics

    target, drafter, tokenizer, _, _ = load_models(DEFAULT, "float32")
    s = sched.Scheduler(target, drafter, sched.Settings(
        max_batch=MAX_BATCH, max_len=MAX_LEN, chunk_steps=CHUNK_STEPS,
        calibration_prompt=tuple(tokenizer.encode(sched.CALIBRATION_TEXT))), Metrics())
    return s.cost_model(), float(len(s.calibration_prompt())), s.menu


def _seed_cost_model(step_ms: dict, expected=None) -> dict:
    """Write a calibration point with these step times (and acceptance prior) into the cache the server will read:
    -> the point."""
    from kdtree_jax.speculative import cost_model

    model, context, menu = _greedy_cost_model()
    point = cost_model.make_point(MAX_BATCH, context, menu, step_ms, expected=expected)
    model.add(point)
    model.save()
    return point


# The --budget 16 reference of test_auto_budget_metrics_and_greedy_output_equal_the_fixed_budget_servers: its
# prompts and lengths, and (below) its server, started with --no-warmup (only the reference for the greedy text: a
# warm-up would compile every row count's programs and every prompt bucket's admission, ~80 s on 2 cores, for four
# one-row requests) while the module's server starts, its requests (its one compile) sent during that start-up.
FIXED_PROMPTS, FIXED_LENGTHS = PROMPTS[:4], [40, 24, 33, 17]


@pytest.fixture(scope="module")
def server_and_fixed(tmp_path_factory):
    """(the module's server, the --budget 16 server's {health, metrics text, completions of FIXED_PROMPTS}): the
    two start side by side (each start is mostly one core's compiling), the fixed one stopped once it answered."""
    import httpx

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDTREE_JAX_CACHE", str(tmp_path_factory.mktemp("kdtree_jax_cache")))
        _seed_cost_model(SEEDED_STEP_MS)
        server = _launch_server()
        try:
            # A numeric budget has no cost model (a cache of its own all the same: nothing lands at home).
            mp.setenv("KDTREE_JAX_CACHE", str(tmp_path_factory.mktemp("kdtree_jax_cache_fixed")))
            fixed = _wait_ready(_launch_server("--budget", "16", "--no-warmup"))
            try:
                import openai

                fixed_client = openai.OpenAI(base_url=fixed["url"] + "/v1", api_key="unused", max_retries=0,
                                             timeout=240)
                reference = {"health": httpx.get(fixed["url"] + "/health").json(),
                             "completions": [_complete(fixed_client, p, n)
                                             for p, n in zip(FIXED_PROMPTS, FIXED_LENGTHS)],
                             "metrics": httpx.get(fixed["url"] + "/metrics").text}
            finally:
                _stop_server(fixed)
            yield _wait_ready(server), reference
        finally:
            _stop_server(server)


@pytest.fixture(scope="module")
def server(server_and_fixed):
    return server_and_fixed[0]


@pytest.fixture(scope="module")
def fixed_budget_reference(server_and_fixed):
    return server_and_fixed[1]


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(url) -> dict:
    import httpx

    from kdtree_jax.serve.metrics import parse

    return parse(httpx.get(url + "/metrics", timeout=10).text)


def _complete(client, prompt, max_tokens, stream=False, **kw):
    kw = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": GREEDY["temperature"],
          "extra_body": {"repetition_penalty": GREEDY["repetition_penalty"]}, **kw}  # not an openai argument
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
    assert health["status"] == "ok" and health["decoding"] == "speculative" and health["budget"] == "auto"
    assert health["budget_menu"] == [0, 4, 8, 16, 32, 64]
    # The start-up took the fixture's cached cost model (it measured nothing).
    greedy = health["budget_policy"]["buckets"]["batch"]
    assert greedy["calibrated"] is False and greedy["costs_ms"]["ar"] == SEEDED_STEP_MS["ar"]
    assert "(cost model from the cache)" in _log(server)
    m = _metrics(url)
    for name in ("requests_total{outcome=\"ok\"}", "generated_tokens_total", "tau", "batch_occupancy", "pool_usage",
                 "pool_slots_free", "queue_length", "compiles_total", "steps_without_drafter_total", "predicted_tau",
                 "observed_tau", "drafted_sequence_steps_total"):
        assert name in m, name
    assert [k for k in m if k.startswith("budget_steps_total")] == [
        f'budget_steps_total{{budget="{b}"}}' for b in health["budget_menu"]]
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


def test_unset_sampling_fields_take_the_checkpoints_generation_config(server):
    """A request that leaves its sampling settings out gets checkpoints/default/generation_config.json's, not OpenAI's
    temperature 1 nor plain greedy (the server's /health says which); a field the request sets wins over the file's."""
    import httpx

    from kdtree_jax import generation_config
    from kdtree_jax.serve.api import request_defaults

    recommended = generation_config.load(DEFAULT)
    assert recommended.get("temperature", 1) != 1 and recommended != {"temperature": 0}, recommended
    url = server["url"]
    assert httpx.get(url + "/health").json()["sampling_defaults"] == request_defaults(recommended)

    def text(**settings):
        body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": 32, "seed": 5, **settings}
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    # A greedy request takes the file's other fields (its repetition penalty changes the text); the request's fields
    # win. Greedy, so that the texts compare token for token: a sampled row's tokens depend on the trees its steps
    # verify, which the adaptive budget picks from what the server ran before.
    plain = text(**GREEDY, top_p=1)
    penalised = text(temperature=0)
    assert penalised == text(temperature=0, **{k: v for k, v in recommended.items() if k != "temperature"})
    assert penalised != plain
    assert text(**GREEDY) == plain


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
    ({"model": "default", "prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"model": "default", "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": "default", "prompt": "x", "n": 2}, 400, "n"),
    ({"model": "default", "prompt": "x", "logprobs": 3}, 400, "logprobs"),
    ({"model": "default", "prompt": "x", "bogus": 1}, 400, "bogus"),
    ({"model": "default", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "default", "prompt": ""}, 400, "prompt"),
    ({"model": "default", "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": "default", "prompt": [1, 10 ** 6]}, 400, "prompt"),
    ({"model": "default", "prompt": [5] * 5000}, 400, "prompt"),  # over the model's context (4096)
    ({"model": "default", "prompt": [5] * 200}, 400, "prompt"),  # fits the context, not a pool row
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
    body = {"model": "default", "prompt": "import sys\n", "max_tokens": 120, **GREEDY}  # rows stay busy
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
    body = {"model": "default", "prompt": "def f(x):", "max_tokens": 150, **GREEDY, "stream": True}
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
    body = {"model": "default", "prompt": "def h(z):", "max_tokens": 150, **GREEDY}
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
    for flag in ("--checkpoint", "--host", "--port", "--max-batch", "--budget", "--no-speculative", "--max-queue",
                 "--calibrate"):
        assert flag in text
    budget = next(a for a in parser._actions if "--budget" in a.option_strings)
    assert budget.default == "auto" and "'auto'" in budget.help and "cost model" in budget.help
    calibrate = next(a for a in parser._actions if "--calibrate" in a.option_strings)
    assert "--budget auto" in calibrate.help and "cached" in calibrate.help
    assert parser.parse_args([]).budget == "auto" and parser.parse_args(["--budget", "24"]).budget == 24


@pytest.mark.parametrize("flags", [["--calibrate", "--budget", "16"], ["--calibrate", "--no-speculative"],
                                   ["--budget", "-1"], ["--menu", "0,8", "--budget", "16"],
                                   ["--menu", "0,8", "--no-speculative"], ["--lone-row-programs", "--budget", "8"]])
def test_budget_flags_that_contradict_each_other_are_refused(flags, capsys):
    from kdtree_jax.serve.__main__ import build_parser, check_flags

    with pytest.raises(SystemExit) as e:
        check_flags(build_parser().parse_args(flags))
    assert e.value.code == 2 and "--budget" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--budget", "many"])
    for menu in ("0,x", "8,-4"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--menu", menu])
    assert build_parser().parse_args(["--menu", "0,8,32"]).menu == (0, 8, 32)


def test_the_command_line_reaches_the_schedulers_settings():
    """Each serving flag lands in the Settings the scheduler gets, and without them the Settings' defaults hold."""
    from kdtree_jax.serve.__main__ import build_parser, scheduler_settings
    from kdtree_jax.serve.scheduler import Settings

    args = build_parser().parse_args(["--menu", "0,8", "--lone-row-programs", "--calibrate", "--max-batch", "3",
                                      "--max-len", "96", "--topk", "2", "--tree-temperature", "0.5",
                                      "--chunk-steps", "2", "--max-queue", "7", "--warmup-prompt-tokens", "16"])
    s = scheduler_settings(args, "auto", (1, 2), 0.9)
    assert (s.menu, s.adaptive_row_programs, s.calibrate, s.max_batch, s.max_len, s.topk, s.tree_temperature,
            s.chunk_steps, s.max_queue, s.budget, s.calibration_prompt, s.warmup_prompt_tokens) == (
        (0, 8), True, True, 3, 96, 2, 0.5, 2, 7, "auto", (1, 2), 16)
    s = scheduler_settings(build_parser().parse_args([]), 0, (1,), 0.9)
    assert (s.menu, s.adaptive_row_programs, s.calibrate, s.tree_temperature, s.chunk_steps, s.budget,
            s.warmup_prompt_tokens) == (None, None, False, 0.9, Settings.chunk_steps, 0, None)
    assert scheduler_settings(build_parser().parse_args(["--no-lone-row-programs"]), "auto", (1,), 0.9
                              ).adaptive_row_programs is False


def test_adaptive_row_programs_default_to_on_a_gpu_only():
    """Settings.adaptive_row_programs None: a lone row's programs on a GPU, not on a CPU; a given value holds."""
    from kdtree_jax.serve.scheduler import adaptive_row_programs

    assert [adaptive_row_programs(None, b) for b in ("gpu", "cpu", "tpu")] == [True, False, False]
    assert [adaptive_row_programs(v, b) for v in (True, False) for b in ("gpu", "cpu")] == [True, True, False, False]


def test_metrics_render_the_adaptive_budget():
    """The Prometheus lines and the JSON of the adaptive budget, from chunks' policy counters (no server)."""
    from kdtree_jax.serve.metrics import Metrics, parse

    m = Metrics()
    assert "budget_steps_total" not in m.render() and m.budget_policy() is None  # a fixed budget: none of it
    m.set_menu((0, 4, 16))
    summary = {"costs_ms": {"ar": 1.0, "draft": 0.5, "verify": [1.0, 1.2, float("inf")]}, "calibration": [1.0]}
    m.add_policy("batch", (0, 4, 16), [1, 5, 2, 3], [30.0, 27.0, 9.0], summary)  # 8 drafted steps of 9 rows
    m.add_policy("batch", (0, 4, 16), [0, 1, 0, 4], [3.0, 4.0, 1.0], summary)  # the next chunk
    values = parse(m.render())
    assert {k: v for k, v in values.items() if k.startswith("budget_steps_total")} == {
        'budget_steps_total{budget="0"}': 1, 'budget_steps_total{budget="4"}': 6, 'budget_steps_total{budget="16"}': 2}
    assert values["steps_without_drafter_total"] == 7 and values["drafted_sequence_steps_total"] == 10
    assert values["predicted_tau"] == pytest.approx(3.3) and values["observed_tau"] == pytest.approx(3.1)
    text = m.render()
    assert "# TYPE kdtree_serve_budget_steps_total counter" in text and "# TYPE kdtree_serve_observed_tau gauge" in text
    policy = m.budget_policy()
    json.dumps(policy, allow_nan=False)  # strict JSON: the infinite cost is null
    assert policy["buckets"]["batch"]["costs_ms"]["verify"] == [1.0, 1.2, None]
    assert set(policy["buckets"]) == {"batch"}  # one bucket for every sampling setting
    m.reset_counts()  # the warm-up's steps are forgotten with the rest
    assert parse(m.render())['budget_steps_total{budget="4"}'] == 0 and parse(m.render())["predicted_tau"] == 0


def test_auto_budget_metrics_and_greedy_output_equal_the_fixed_budget_servers(server, client,
                                                                             fixed_budget_reference):
    """The module's server (--budget auto) reports the budgets its policy chose, and its greedy completions equal a
    --budget 16 server's, token for token (greedy speculative decoding is lossless whatever tree each step verifies;
    float32 on a CPU)."""
    import httpx

    url = server["url"]
    before = _metrics(url)
    prompts, lengths = FIXED_PROMPTS, FIXED_LENGTHS
    adaptive = [_complete(client, p, n) for p, n in zip(prompts, lengths)]
    after = _metrics(url)
    menu = httpx.get(url + "/health").json()["budget_menu"]

    def delta(name):
        return after[name] - before[name]

    by_budget = {b: delta(f'budget_steps_total{{budget="{b}"}}') for b in menu}
    steps = sum(by_budget.values()) + delta("steps_without_drafter_total")
    assert steps > 0 and all(n >= 0 for n in by_budget.values())
    assert sum(n for b, n in by_budget.items() if b > 0) > 0  # with the cached costs speculation pays: it drafted
    assert delta("drafted_sequence_steps_total") > 0
    assert after["predicted_tau"] > 1 and after["observed_tau"] > 1  # drafted steps kept drafted tokens
    health = httpx.get(url + "/health").json()["budget_policy"]
    assert health["budget_steps"] == {str(b): int(after[f'budget_steps_total{{budget="{b}"}}']) for b in menu}
    assert health["observed_tau"] == pytest.approx(after["observed_tau"], rel=1e-5)

    # The --budget 16 server (the fixture's, see FIXED_PROMPTS): the same greedy text, and no adaptive budget there.
    assert fixed_budget_reference["health"]["budget"] == 16
    assert fixed_budget_reference["completions"] == adaptive
    assert "budget_steps_total" not in fixed_budget_reference["metrics"]


# The servers of the next two tests (--calibrate over a stale cached point; a cached point where no budget pays), each
# with its own $KDTREE_JAX_CACHE: launched together, when the first of the two tests asks, so that they start side by
# side (each start is mostly one core's compiling; one after the other they took ~65 s of the module's time).
STALE_STEP_MS = {"ar": 1000.0, 0: 1001.0, 1: 1002.0, 2: 1003.0, 3: 1004.0, 4: 1005.0, 5: 1006.0}


@pytest.fixture(scope="module")
def side_servers(server, tmp_path_factory):
    """{"calibrated": (server, its cache directory, the stale point seeded there), "plain": (server, its cache
    directory)}: launched, not yet serving (_wait_ready)."""
    servers = []
    with pytest.MonkeyPatch.context() as mp:
        try:
            calibrate_cache = tmp_path_factory.mktemp("kdtree_jax_cache_calibrate")
            mp.setenv("KDTREE_JAX_CACHE", str(calibrate_cache))
            stale = _seed_cost_model(STALE_STEP_MS)
            servers.append(_launch_server("--calibrate"))
            plain_cache = tmp_path_factory.mktemp("kdtree_jax_cache_plain")
            mp.setenv("KDTREE_JAX_CACHE", str(plain_cache))
            _, _, menu = _greedy_cost_model()
            _seed_cost_model({"ar": 1.0, **{i: 20.0 + i for i in range(len(menu))}},
                             expected=[1.0] + [2.0] * (len(menu) - 1))
            servers.append(_launch_server("--engine-process"))
            yield {"calibrated": (servers[0], calibrate_cache, stale), "plain": (servers[1], plain_cache)}
        finally:
            for s in servers:
                if os.path.exists(s["log"]):  # not stopped by its test
                    _stop_server(s)


def test_calibrate_measures_the_cost_model_again(side_servers, monkeypatch):
    """--calibrate: the start-up measures the cost model although the cache holds one for these settings, and the
    measurement replaces it in the cache. (The module's settings: the chunk program and row admission come from the
    session's compilation cache, so the start-up is mostly the measurement.)"""
    import httpx

    from kdtree_jax.speculative import cost_model

    calibrated, tmp_path, stale = side_servers["calibrated"]
    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path))
    try:
        _wait_ready(calibrated)
        log = _log(calibrated)
        assert "[measuring the tree-budget cost model: batch 4 (" in log and "(cost model measured now)" in log
        greedy = httpx.get(calibrated["url"] + "/health").json()["budget_policy"]["buckets"]["batch"]
        assert greedy["calibrated"] is True and greedy["costs_ms"]["ar"] < 1000
        model, context, _ = _greedy_cost_model()
        assert [p["batch"] for p in model.points] == [MAX_BATCH]  # the stale point replaced, not added to
        point = model.lookup(MAX_BATCH, context)
        assert point["cost_ar"] == pytest.approx(greedy["costs_ms"]["ar"], rel=1e-6) and point["measured_ms"]
        assert point["cost_ar"] != stale["cost_ar"]
        body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": 12, **GREEDY}
        assert httpx.post(calibrated["url"] + "/v1/completions", json=body, timeout=60).status_code == 200
        m = _metrics(calibrated["url"])
        steps = sum(v for k, v in m.items() if k.startswith("budget_steps_total")) + m["steps_without_drafter_total"]
        if "(batch 4, measured now): serving autoregressively" in log:  # no budget pays here (this CPU): the plain
            assert greedy["decision"] == "autoregressive" and steps == 0  # autoregressive program, as a restart's
        else:
            assert steps > 0
        assert cost_model.cache_dir() == tmp_path
    finally:
        _stop_server(calibrated)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry))
    return kids


def _gone(pid: int, timeout: float) -> bool:
    """Whether process `pid` ends (or is a zombie) within `timeout` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.2)
    return False


def test_cached_costs_where_no_budget_pays_serve_autoregressively(client, side_servers):
    """A cached point whose drafter costs more than any budget earns at its acceptance prior: the greedy bucket runs
    the plain autoregressive program (it says so at start-up, steps no budget) and answers as the module's server
    (greedy: the target's own tokens whatever the tree; its speculative program is the independent reference, and a
    --budget 0 server started for the text alone cost ~25 s).

    This server runs its decode loop in a process of its own (--engine-process): requests streamed and whole, several
    at once, answer as the module's in-process server does, /metrics comes from the engine, and SIGTERM drains the
    stream in flight, exits 0 and takes the engine process with it."""
    import httpx

    lengths = [12, 9, 15, 7, 11]
    want = [_complete(client, p, n) for p, n in zip(PROMPTS, lengths)]
    plain, _ = side_servers["plain"]
    try:
        _wait_ready(plain)
        log = _log(plain)
        assert "serving autoregressively" in log and "the decode loop in its own process" in log
        engines = _children(plain["proc"].pid)
        assert engines, "no engine process"
        import openai

        plain_client = openai.OpenAI(base_url=plain["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)
        with concurrent.futures.ThreadPoolExecutor(len(lengths)) as pool:
            got = list(pool.map(lambda a: _complete(plain_client, *a, stream=a[0] in PROMPTS[::2]),
                                zip(PROMPTS, lengths)))
        m = _metrics(plain["url"])
        assert not any(k.startswith("budget_steps_total") and v for k, v in m.items())
        assert m['requests_total{outcome="ok"}'] == len(lengths) and m["generated_tokens_total"] >= sum(lengths)
        # A full queue is still a 429 (the engine's answer to the submit, before a response starts).
        body = {"model": "default", "prompt": "import sys\n", "max_tokens": 60, **GREEDY}
        with concurrent.futures.ThreadPoolExecutor(24) as pool:
            codes = list(pool.map(lambda _: httpx.post(plain["url"] + "/v1/completions", json=body, timeout=120),
                                  range(24)))
        assert {r.status_code for r in codes} == {200, 429}, [r.status_code for r in codes]
        assert next(r for r in codes if r.status_code == 429).json()["error"]["code"] == "queue_full"
        # SIGTERM with a stream in flight: it runs to its end, the server exits 0, the engine process ends with it.
        body = {"model": "default", "prompt": "def g(y):", "max_tokens": 40, **GREEDY, "stream": True}
        lines = []
        with httpx.stream("POST", plain["url"] + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) == 1:
                        plain["proc"].send_signal(signal.SIGTERM)
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] == "length"
        assert plain["proc"].wait(timeout=60) == 0
        assert all(_gone(pid, 30) for pid in engines)
        assert "Traceback" not in _log(plain)
    finally:
        _stop_server(plain)
    assert got == want and all(text for text, _ in got)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_either_process_of_an_engine_process_server_ending_ends_the_other(tmp_path, monkeypatch):
    """--engine-process, two servers: the HTTP process killed outright (SIGKILL: no handler runs) closes the pipe, and
    the engine stops on its own instead of holding the device; the engine killed while serving makes the HTTP process
    say so on one line and exit 1 (a supervisor restarts it) instead of answering /health without a decoder."""
    import httpx

    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path))
    servers = [_launch_server("--engine-process", "--no-warmup", "--budget", "0") for _ in range(2)]
    try:
        http_killed, engine_killed = (_wait_ready(s) for s in servers)
        engines = [[pid for pid in _children(s["proc"].pid) if "spawn_main" in _cmdline(pid)] for s in servers]
        assert all(len(e) == 1 for e in engines), engines
        http_killed["proc"].kill()
        http_killed["proc"].wait()
        assert _gone(engines[0][0], 30), _log(http_killed)
        os.kill(engines[1][0], signal.SIGKILL)
        assert engine_killed["proc"].wait(timeout=30) == 1
        log = _log(engine_killed)
        assert "error: the engine process ended while serving" in log and "Traceback" not in log
        with pytest.raises(httpx.HTTPError):
            httpx.get(engine_killed["url"] + "/health", timeout=5)
    finally:
        for s in servers:
            _stop_server(s)


def test_sigterm_drains_the_stream_in_flight_then_exits_0(server):
    """Last (it stops the module's server): a stream that started before SIGTERM runs to its end, then exit 0."""
    import httpx

    url, proc = server["url"], server["proc"]
    body = {"model": "default", "prompt": "def g(y):", "max_tokens": 60, **GREEDY, "stream": True}
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
