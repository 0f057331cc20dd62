"""`python -m kdtree_jax.serve --mesh N` (issue 45): the target split over N devices, the drafter, the KV pool and the
loop state (the adaptive budget's policy too) replicated on them, gives the greedy outputs of an unsharded server.

One sharded server for the module: a subprocess on eight forced host devices (conftest's flag, kept for it), the
embedded default pair in float32 split over 4 of them (the pair's 4 attention heads allow 1, 2 or 4) in the tp
layout, with the adaptive budget (--budget auto) taking a cost model this module writes into its cache, so that the
policy speculates whatever this CPU's timings are (--topk 1 keeps the menu at four programs to compile). The
reference is the unsharded scheduler in this process (what the server runs behind its HTTP routes) with a fixed
budget: greedy output is the target's whatever the tree, and in float32 the split target's logits differ from the
whole one's by reduction order only (~1e-6), far below the gaps between these prompts' top two logits.

The sharded server compiles at XLA's default LLVM optimisation, unlike the rest of the suite (conftest's -O0): at -O0
a sharded chunk of this pair ran 1.6 s against 0.1 s (2 steps, 4 host devices), which made the requests cost more than
the compile saved. Budget: ~40 s on 2 CPU cores, most of it the server's start (load, four chunk programs)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "checkpoints", "default")

missing = [m for m in ("fastapi", "uvicorn", "httpx") if __import__("importlib.util").util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(bool(missing), reason=f"the 'serve' extra is not installed ({', '.join(missing)} missing): "
                                             "pip install -e \".[serve]\""),
    pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                       reason="checkpoints/default is not there"),
]

MESH, LAYOUT = 4, "tp"
MAX_BATCH, MAX_LEN, CHUNK_STEPS, TOPK, MAX_TOKENS = 2, 96, 2, 1, 8
# Token ids (under 16: one prefill program), more prompts than rows: rows retire and are refilled mid-run.
PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42, 42, 42, 42, 42], [1000, 17, 4000, 256, 9, 77]]
# ms a step (the autoregressive one, then each drafting menu entry's): verifying more nodes costs little here.
SEEDED_STEP_MS = {"ar": 10.0, 1: 11.5, 2: 12.0, 3: 13.0}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_env(cache_dir: str) -> dict:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_backend_optimization_level")]
    if not any("xla_force_host_platform_device_count" in f for f in flags):
        flags.append("--xla_force_host_platform_device_count=8")
    return dict(os.environ, XLA_FLAGS=" ".join(flags), KDTREE_JAX_CACHE=cache_dir)


def _run_cli(*flags, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kdtree_jax.serve", "--port", str(_free_port()), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=_server_env(tempfile.gettempdir()))


@pytest.fixture(scope="module")
def pair():
    from kdtree_jax.generate import load_models

    target, drafter, tokenizer, _, _ = load_models(DEFAULT, "float32")
    return target, drafter, tokenizer


def _seed_cost_model(target, drafter, tokenizer, cache_dir: str) -> None:
    """The cost model the server will look up (its fingerprint holds the mesh's size), written into its cache."""
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.sharding import make_mesh, shard_model
    from kdtree_jax.speculative import cost_model

    os.environ["KDTREE_JAX_CACHE"] = cache_dir  # restored by the caller's MonkeyPatch
    sharded = shard_model(target, make_mesh(MESH), LAYOUT)
    s = sched.Scheduler(sharded, drafter, sched.Settings(
        max_batch=MAX_BATCH, max_len=MAX_LEN, chunk_steps=CHUNK_STEPS, topk=TOPK,
        calibration_prompt=tuple(tokenizer.encode(sched.CALIBRATION_TEXT))), Metrics())
    assert len(s.menu) == len(SEEDED_STEP_MS)
    model = s.cost_model()
    model.add(cost_model.make_point(MAX_BATCH, float(len(s.calibration_prompt())), s.menu, SEEDED_STEP_MS))
    model.save()


@pytest.fixture(scope="module")
def sharded_server(pair, tmp_path_factory):
    """The sharded server, started (its start overlaps the reference's decode in this process): {url, proc, log}."""
    import httpx

    cache_dir = str(tmp_path_factory.mktemp("kdtree_jax_cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KDTREE_JAX_CACHE", cache_dir)
        _seed_cost_model(*pair, cache_dir)
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="serve_mesh_test_", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kdtree_jax.serve", "--port", str(port), "--mesh", str(MESH), "--layout", LAYOUT,
         "--dtype", "float32", "--max-batch", str(MAX_BATCH), "--max-len", str(MAX_LEN), "--chunk-steps",
         str(CHUNK_STEPS), "--topk", str(TOPK)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=_server_env(cache_dir))
    server = {"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log.name}

    def wait_ready(timeout=240.0):
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the sharded server exited with {proc.returncode}:\n{_log(server)[-3000:]}")
            try:
                if httpx.get(server["url"] + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"the sharded server did not start within {timeout:.0f} s:\n{_log(server)[-3000:]}")
            time.sleep(0.5)

    server["wait_ready"] = wait_ready
    try:
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(log.name)


def _log(server: dict) -> str:
    with open(server["log"]) as f:
        return f.read()


def _scheduler_outputs(target, drafter, budget, prompts, costs=None) -> list:
    """Greedy tokens of each prompt from an in-process scheduler with this module's batch settings."""
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics

    s = sched.Scheduler(target, drafter, sched.Settings(max_batch=MAX_BATCH, max_len=MAX_LEN, budget=budget,
                                                        chunk_steps=CHUNK_STEPS, topk=TOPK, costs=costs), Metrics())
    s.start()
    jobs = []
    try:
        for prompt in prompts:
            done, out = threading.Event(), []
            s.submit(sched.Request(prompt=prompt, max_tokens=MAX_TOKENS, emit=lambda kind, v, out=out, done=done: (
                out.extend(v) if kind == "tokens" else done.set())))
            jobs.append((done, out))
        for done, _ in jobs:
            assert done.wait(300)
        assert s.error is None, s.error
    finally:
        s.stop(drain=False, timeout=60)
    return [out for _, out in jobs]


@pytest.fixture(scope="module")
def reference(pair, sharded_server):
    """The unsharded scheduler's greedy tokens of PROMPTS (fixed budget 4), computed while the server starts."""
    target, drafter, _ = pair
    outputs = _scheduler_outputs(target, drafter, 4, PROMPTS)
    assert all(len(o) == MAX_TOKENS for o in outputs) and len({tuple(o) for o in outputs}) == len(PROMPTS)
    return outputs


def _metrics(url) -> dict:
    import httpx

    from kdtree_jax.serve.metrics import parse

    return parse(httpx.get(url + "/metrics", timeout=10).text)


def test_sharded_server_greedy_outputs_equal_the_unsharded(pair, sharded_server, reference):
    import httpx

    tokenizer = pair[2]
    sharded_server["wait_ready"]()
    url = sharded_server["url"]
    health = httpx.get(url + "/health").json()
    assert health["mesh"] == MESH and health["layout"] == LAYOUT and health["budget"] == "auto", health
    assert f"{LAYOUT} over {MESH} cpu devices" in _log(sharded_server)
    # The compiles of the start-up, as its last line counts them (/metrics refreshes its count between chunks only).
    compiles = int(re.search(r"ready in [\d.]+ s, (\d+) compiles\)\]", _log(sharded_server)).group(1))

    def complete(prompt):
        r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: more requests than batch rows
        got = list(pool.map(complete, PROMPTS))
    # The API answers text: the reference's tokens, decoded as the server decodes them.
    assert got == [(tokenizer.decode(o), MAX_TOKENS) for o in reference]
    m = _metrics(url)
    assert m["compiles_total"] == compiles  # serving compiled nothing
    # The adaptive policy ran drafted steps on the mesh (its state replicated there), not only autoregressive ones.
    assert sum(v for k, v in m.items() if k.startswith("budget_steps_total") and 'budget="0"' not in k) > 0, m


@pytest.mark.parametrize("flags, says", [
    (["--mesh", "16"], "--mesh 16: only 8 cpu devices visible; pick N in [1, 8] or 'all' (on a CPU, "
                       "XLA_FLAGS=--xla_force_host_platform_device_count=16 makes 16 host devices)"),
    (["--mesh", "3"], "--mesh 3 with --layout tp: 3 does not divide num_attention_heads (4), shared expert "
                      "intermediate (256), moe_intermediate_size (256); with 8 visible devices --mesh may be 1, 2, 4"),
    (["--mesh", "--layout", "ep"], "--mesh all (8 devices) with --layout ep: 8 does not divide num_attention_heads "
                                   "(4); with 8 visible devices --mesh may be 1, 2, 4"),
], ids=["too-many", "not-dividing", "all-not-dividing"])
def test_mesh_errors_are_one_line_before_loading(flags, says):
    proc = _run_cli(*flags)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {says}"], proc.stderr
