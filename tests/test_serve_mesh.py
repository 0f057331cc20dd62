"""`python -m kdtree_jax.serve --mesh N` (issue 45): the target split over N devices, the drafter, the KV pool and the
loop state (the adaptive budget's policy too) replicated on them, gives the greedy outputs of an unsharded server.

One sharded server for the module: a subprocess on eight forced host devices (conftest's flag, kept for it), the
embedded default pair in float32 split over 4 of them (the pair's 4 attention heads allow 1, 2 or 4) in the tp
layout, with the adaptive budget (--budget auto) taking a cost model this module writes into its cache, so that the
policy speculates whatever this CPU's timings are (--topk 1 keeps the menu at four programs to compile). The
reference is the unsharded scheduler in this process (what the server runs behind its HTTP routes) with a fixed
budget: greedy output is the target's whatever the tree. Exact equality holds by margin, not by luck: along these
outputs the split target's float32 logits (its partial sums meet in an all-reduce, another summation order) differ
from the whole one's by at most 1.1e-5, tp or ep, and the smallest gap between a position's top two logits is 0.038.
A second test runs the scheduler in this process on an ep split, with a fixed budget (one compiled chunk program, which
refuses a state placed otherwise than it was compiled for), and checks where its state lives.

The sharded programs compile at XLA's default LLVM optimisation, unlike the rest of the suite (conftest's -O0): at -O0
a sharded chunk of this pair ran 1.6 s against 0.1 s (2 steps, 4 host devices), which made the requests cost more than
the compile saved. Budget: ~35 s on 2 CPU cores, most of it the server's start (load, four chunk programs)."""

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


@pytest.fixture(scope="module")
def pair():
    from kdtree_jax.generate import load_models

    target, drafter, tokenizer, _, _ = load_models(DEFAULT, "float32")
    return target, drafter, tokenizer


def _seed_cost_model(target, drafter, tokenizer) -> None:
    """The cost model the server will look up (its fingerprint holds the mesh's size), written into $KDTREE_JAX_CACHE."""
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.sharding import make_mesh, shard_model
    from kdtree_jax.speculative import cost_model

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
        _seed_cost_model(*pair)
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


def _outputs(scheduler, prompts) -> list:
    """Greedy tokens of each prompt, submitted at once to this scheduler (started here, stopped after)."""
    from kdtree_jax.serve import scheduler as sched

    scheduler.start()
    jobs = []
    try:
        for prompt in prompts:
            done, out = threading.Event(), []
            scheduler.submit(sched.Request(prompt=prompt, max_tokens=MAX_TOKENS, emit=lambda kind, v, out=out,
                                           done=done: out.extend(v) if kind == "tokens" else done.set()))
            jobs.append((done, out))
        for done, _ in jobs:
            assert done.wait(300)
        assert scheduler.error is None, scheduler.error
    finally:
        scheduler.stop(drain=False, timeout=60)
    return [out for _, out in jobs]


def _scheduler(target, drafter, budget):
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics

    return sched.Scheduler(target, drafter, sched.Settings(max_batch=MAX_BATCH, max_len=MAX_LEN, budget=budget,
                                                           chunk_steps=CHUNK_STEPS, topk=TOPK), Metrics())


@pytest.fixture(scope="module")
def reference(pair):
    """The unsharded scheduler's greedy tokens of PROMPTS (fixed budget 4), computed while the server starts."""
    target, drafter, _ = pair
    outputs = _outputs(_scheduler(target, drafter, 4), PROMPTS)
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

    def complete(prompt):  # plain greedy as the reference, not the pair's generation_config.json (a penalty)
        r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "repetition_penalty": 1}, timeout=300)
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


def test_mesh_larger_than_the_visible_devices_is_one_line_before_loading(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kdtree_jax.serve", "--port", str(_free_port()), "--mesh", "16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=_server_env(str(tmp_path)))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --mesh 16: only 8 cpu devices visible; pick N in [1, 8] or 'all' (on a CPU, "
        "XLA_FLAGS=--xla_force_host_platform_device_count=16 makes 16 host devices)"], proc.stderr


@pytest.mark.parametrize("mesh, layout, says", [
    (3, "tp", "--mesh 3 with --layout tp: 3 does not divide num_attention_heads (4), shared expert intermediate (256), "
              "moe_intermediate_size (256); with 8 visible devices --mesh may be 1, 2, 4"),
    ("all", "ep", "--mesh all (8 devices) with --layout ep: 8 does not divide num_attention_heads (4); with 8 visible "
                  "devices --mesh may be 1, 2, 4"),
], ids=["not-dividing", "all-not-dividing"])
def test_mesh_the_layout_cannot_split_names_the_sizes_it_can(mesh, layout, says, capsys):
    """Checked from the checkpoint's config alone (this process has conftest's eight devices, as the CLI would)."""
    from kdtree_jax.serve.__main__ import build_parser, serving_mesh

    args = build_parser().parse_args(["--mesh"] + ([] if mesh == "all" else [str(mesh)]) + ["--layout", layout])
    with pytest.raises(SystemExit) as e:
        serving_mesh(args.mesh, args.layout, DEFAULT)
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [f"error: {says}"]
    assert serving_mesh(4, layout, DEFAULT).size == 4 and serving_mesh(1, layout, DEFAULT) is None


@pytest.mark.xla_optimized  # at conftest's -O0 a sharded chunk runs ~15x slower (the module docstring)
def test_sharded_scheduler_ep_keeps_its_state_replicated(pair, reference):
    """The scheduler on an expert-parallel target (a fixed budget: one compiled chunk program, which refuses a state
    placed otherwise than it was compiled for) gives the reference's tokens, and every array of its loop state stays
    whole on every device of the mesh through admissions, chunks and row resets."""
    import jax

    from kdtree_jax.sharding import make_mesh, shard_model

    target, drafter, _ = pair
    mesh = make_mesh(MESH)
    s = _scheduler(shard_model(target, mesh, "ep"), drafter, 4)
    assert s.warmup()
    # One prompt a row (the warm-up's request has already been through a row and out again).
    assert _outputs(s, PROMPTS[:MAX_BATCH]) == reference[:MAX_BATCH]
    devices = set(mesh.devices.flat)
    for path, leaf in jax.tree_util.tree_leaves_with_path((s.bucket.state, s.drafter)):
        assert leaf.sharding.device_set == devices and leaf.sharding.is_fully_replicated, jax.tree_util.keystr(path)
