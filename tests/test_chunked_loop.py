"""The device-resident loop in chunks (issue 23, deliverable 1): k steps per host iteration, output handed to the
host after each chunk (streaming, issue 25), a batch row replaced between chunks without compiling anything, prompts
streamed through a batch's rows (spec_decode.py --refill), and what `kdtree_jax.runtime` sets before JAX starts. CPU,
the embedded default pair in float32."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import runtime
from kdtree_jax.speculative import admission, engine, validation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "checkpoints", "default")
if os.path.join(ROOT, "benchmarks") not in sys.path:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import spec_decode  # noqa: E402 - benchmarks/spec_decode.py: its --refill loop

needs_default = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                                   reason="checkpoints/default is not there")
LENGTH = 16  # every prompt is cut to this many tokens: a replaced row then has the shapes of the batch's prompts


@pytest.fixture(scope="module")
def pair():
    from kdtree_jax import load_checkpoint

    return load_checkpoint(DEFAULT, dtype="auto")


@pytest.fixture(scope="module")
def prompts(pair):
    from kdtree_jax import corpus

    tokenizer = pair[2]
    docs = [tokenizer.encode(d.text) for d in corpus.documents("eval")]
    docs = [ids for ids in docs if len(ids) > 200]
    return [docs[i][100 + 7 * i:100 + 7 * i + LENGTH] for i in range(3)]  # held-out text, three files


def _generate(pair, prompts, **kwargs):
    target, drafter, _ = pair
    kwargs = {"max_new_tokens": 24, "budget": 16, "tree_temperature": 0.6, **kwargs}
    return engine.generate(target, drafter, prompts, **kwargs)


@needs_default
@pytest.mark.parametrize("budget,k", [(16, 3), (0, 1)])
def test_chunked_output_equals_whole_loop_and_streams_it(pair, prompts, budget, k):
    """Greedy output is the same whether the loop runs whole (chunk_steps 0) or in chunks (of 3 DDTree steps; of 1
    autoregressive step: a host read per step), and the on_tokens calls of each row concatenate to its output
    (first token first, nothing past max_new_tokens)."""
    batch = [prompts[0], prompts[1][:11]]  # ragged
    whole = _generate(pair, batch, budget=budget, chunk_steps=0)
    assert whole.stats["host_syncs"] == 1
    if True:
        streamed = {0: [], 1: []}
        calls = []

        def on_tokens(row, ids):
            calls.append(row)
            streamed[row].extend(ids)

        res = _generate(pair, batch, budget=budget, chunk_steps=k, on_tokens=on_tokens)
        assert res.tokens == whole.tokens, k
        assert res.stats["tau"] == whole.stats["tau"] and res.stats["steps"] == whole.stats["steps"]
        assert [streamed[0], streamed[1]] == res.tokens
        assert all(len(t) == 24 for t in res.tokens)
        assert calls.count(0) >= 2  # the first token, then the chunks
        # one read per chunk of k steps, and one more for the chunk that found every sequence done
        assert res.stats["chunk_steps"] == k
        assert -(-res.stats["steps"] // k) <= res.stats["host_syncs"] <= -(-res.stats["steps"] // k) + 1
        assert res.stats["host_driven_loops"] is None  # reported on a GPU only


@needs_default
def test_replace_a_row_between_chunks_without_compiling(pair, prompts):
    """Row 1 gets a new prompt after the first chunk: no trace (= no compile) of the chunk program, the row's
    output is the one the new prompt gets from the start (same batch shapes), row 0 goes on unaffected."""
    target, drafter, _ = pair
    k = 3
    kwargs = dict(max_new_tokens=24, budget=16, tree_temperature=0.6, chunk_steps=k)
    ref_ab = engine.generate(target, drafter, [prompts[0], prompts[1]], **kwargs).tokens
    ref_ac = engine.generate(target, drafter, [prompts[0], prompts[2]], **kwargs).tokens

    spec = engine.SpecConfig(budget=16, tree_temperature=0.6, max_new_tokens=24)
    req = validation.validate(target, drafter, [prompts[0], prompts[1]], max_new_tokens=24, budget=16, topk=4,
                              tree_temperature=0.6, temperature=0.0, stop_ids=(), tree="ddtree")
    state, loop_drafter, _ = engine.setup(target, drafter, req, spec, seed=0, chunk_size=64, kv_dtype=None,
                                          num_moe=sum(layer.is_moe for layer in target.layers),
                                          slots=next(layer.mlp.num_slots for layer in target.layers if layer.is_moe))
    loop = engine.ChunkedLoop(target, loop_drafter, spec, steps=k)  # the jitted path: its cache shows compiles
    out = loop(loop(state).state)  # two chunks: the second call's arguments are the steady state's (committed)
    traces, programs = engine._TRACES["decode_chunk"], engine._decode_chunk._cache_size()
    first_out = np.asarray(out.state.out[0])
    state = admission.replace_row(target, loop_drafter, out.state, 1, prompts[2], spec=spec)
    admit_programs = admission._admit._cache_size()
    while True:
        out = loop(state)
        state = out.state
        if not bool(out.any_active):
            break
    assert engine._TRACES["decode_chunk"] == traces and engine._decode_chunk._cache_size() == programs
    final_out, num_out = np.asarray(state.out), np.asarray(state.num_out)
    assert final_out[0, :min(num_out[0], 24)].tolist() == ref_ab[0]
    assert final_out[1, :min(num_out[1], 24)].tolist() == ref_ac[1]
    assert (first_out == final_out[0])[first_out >= 0].all()
    assert not bool(state.cache.overflow)
    # A second replacement (another row) reuses the admission program; the pool's accounting holds.
    state = admission.replace_row(target, loop_drafter, state, 0, prompts[1], spec=spec)
    assert admission._admit._cache_size() == admit_programs
    live = int(np.asarray(state.cache.seq_lens).sum())
    assert int(state.cache.num_free) == state.cache.num_slots - live
    state = admission.reset_row(state, 0)
    assert int(state.cache.num_free) == state.cache.num_slots - int(np.asarray(state.cache.seq_lens).sum())
    assert not bool(state.active[0]) and int(state.num_out[0]) == 0
    # Rows reset together (the server's every row a chunk retired, one dispatch) end as when reset one at a time: the
    # same state, the same free slots (the free list's order may differ), every slot back.
    state = admission.replace_row(target, loop_drafter, state, 0, prompts[1], spec=spec)
    one_by_one = admission.reset_row(admission.reset_row(jax.tree.map(jnp.copy, state), 1), 0)
    together = admission.reset_rows(state, np.array([True, True]))
    num_free = int(together.cache.num_free)
    assert num_free == int(one_by_one.cache.num_free) == together.cache.num_slots
    assert sorted(np.asarray(together.cache.free_slots)[:num_free]) == list(range(num_free))
    for a, b in zip(*(jax.tree.leaves(s._replace(cache=s.cache._replace(free_slots=None)))
                      for s in (together, one_by_one))):
        np.testing.assert_array_equal(_host(a), _host(b))


def _host(x) -> np.ndarray:
    """An array's values on the host (a random key's data)."""
    return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)


@needs_default
def test_refill_gives_each_prompt_its_tokens_alone_without_compiling(pair, prompts):
    """spec_decode.py --refill's loop: 5 prompts stream through 2 DDTree rows, a row that is done taking the next
    prompt between chunks (ChunkedLoop.admit, one chunk in flight). The rows finish at different steps,
    so prompts are admitted mid-run, in different chunks; each prompt gets exactly the greedy tokens it gets decoded
    alone at batch 1 (float32), and nothing compiles after the warm-up. The settings and shapes of the replacement
    test's loop above (its chunk program is compiled: engine.chunked_loop reuses it)."""
    target, drafter, _ = pair
    five = prompts + [prompts[0][:11], prompts[2][3:]]
    kwargs = dict(max_new_tokens=24, budget=16, topk=4, tree_temperature=0.6, temperature=0.0)
    stats, tokens = spec_decode.run_refill(target, drafter, five, batch=2, tree="ddtree", top_k=0, top_p=1.0,
                                           seed=0, impl="auto", chunk_steps=3, **kwargs)
    # Alone: autoregressively, the cheaper loop to compile (greedy speculative output is autoregressive output: in
    # float32 on the CPU, token for token, tests/test_engine.py).
    alone = [engine.generate(target, None, p, max_new_tokens=24, budget=0, chunk_steps=0).tokens[0] for p in five]
    assert tokens == alone
    assert stats["compiles_after_warmup"] == 0
    assert stats["new_tokens"] == 5 * 24 and stats["tau"] > 1.5
    assert stats["sequence_steps"] < 2 * stats["target_forwards"]  # some row steps idle: the rows finished apart


@needs_default
def test_cli_streams_text_as_chunks_arrive(monkeypatch):
    """The CLI writes the echoed prompt and the text in several pieces as the loop hands tokens over (not one write
    at the end), and what it wrote is the prompt and the final text."""
    import json

    from kdtree_jax.generate import main as cli_main

    argv = ["--prompt", "def f(x):", "--max-new-tokens", "40", "--budget", "0"]

    class Recorder(io.StringIO):
        writes = 0

        def write(self, s):
            Recorder.writes += bool(s)
            return super().write(s)

    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert cli_main(argv) == 0
    streamed = out.getvalue()
    assert Recorder.writes >= 3  # the prompt with the first token, the chunks (40 steps / 8), the end
    json_out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", json_out)
    assert cli_main(argv + ["--json"]) == 0
    record = json.loads(json_out.getvalue())
    assert streamed == record["prompt"] + record["text"] + "\n"


def test_runtime_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    # JAX is running in this process: too late to set flags, and configure() says so.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert runtime.configure() is False
    assert any("after JAX started" in str(w.message) for w in caught)
    monkeypatch.setenv(runtime.ENV_SWITCH, "0")
    assert runtime.configure() is False
    monkeypatch.delenv(runtime.ENV_SWITCH)
    assert runtime.cpu_flags("--xla_cpu_experimental_ynn_fusion_type=dot") == []  # the user's choice wins
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")  # the user's choice wins
    assert runtime.configure() is False and os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=FUSION"
    monkeypatch.setenv("XLA_FLAGS", runtime.COMMAND_BUFFER_FLAGS)
    assert runtime.command_buffers_configured() and runtime.configure() is True
    assert not runtime.row_invariant_configured()
    every = " ".join(f"--{name}={value}" for name, value in runtime.ROW_INVARIANT_FLAGS)
    monkeypatch.setenv("XLA_FLAGS", every)
    assert runtime.row_invariant_configured()
    monkeypatch.setenv("XLA_FLAGS", every + " --xla_allow_excess_precision=true")  # the last value is what XLA reads
    assert not runtime.row_invariant_configured()


def test_configure_before_jax_starts():
    """In a fresh process configure() sets the flags (with row_invariant, those too, leaving the one the user named;
    the CPU flags where this jaxlib is one checked to know them), and XLA (here the CPU backend) accepts them."""
    code = ("import os, kdtree_jax.runtime as r; assert r.configure(row_invariant=True) is True; "
            "assert r.COMMAND_BUFFER_FLAGS in os.environ['XLA_FLAGS']; "
            "assert ('--xla_gpu_enable_pdl=true' in os.environ['XLA_FLAGS']) == (r._jaxlib_version() >= r.LAUNCH_FLAGS_SINCE); "
            "assert '--xla_gpu_autotune_level=4' in os.environ['XLA_FLAGS'] and not r.row_invariant_configured(); "
            "assert '--xla_allow_excess_precision=false' in os.environ['XLA_FLAGS']; "
            "since, before = r.CPU_FLAGS_JAXLIB; "
            "assert ('--xla_cpu_experimental_ynn_fusion_type=' in os.environ['XLA_FLAGS']) == "
            "(since <= r._jaxlib_version() < before); "
            "import jax.numpy as jnp; print(int(jnp.arange(4).sum()))")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", runtime.ENV_SWITCH)}
    env = {**env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_gpu_autotune_level=4"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "6"


def test_host_driven_loops():
    """A while loop counts unless it lives in (or under) a command-buffer computation."""
    text = """%command_buffer (p: f32[3]) -> f32[3] {
  %w = (s32[]) while(%t), condition=%c, body=%b
}

%b (x: s32[]) -> s32[] {
  %w2 = (s32[]) while(%t), condition=%c2, body=%b2
}

ENTRY %main (x: f32[3]) -> f32[3] {
  %call = f32[3] call(%x), to_apply=%command_buffer
  ROOT %w3 = (s32[]) while(%t), condition=%c3, body=%b3
}
"""
    for configured in (False, True):
        assert runtime.host_driven_loops(text, configured) == 1
        assert runtime.host_driven_loops(text.replace("  ROOT %w3 = (s32[]) while(%t), condition=%c3, body=%b3\n", ""),
                                         configured) == 0
    f = jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x)))
    compiled = f.lower(np.ones(3, np.float32)).compile().as_text()
    assert runtime.host_driven_loops(compiled, configured=False) == 1
    # Loop capture asked for, and a text without any command buffer: an XLA that converts after the HLO; unknown.
    assert runtime.host_driven_loops(compiled, configured=True) is None


@needs_default
def test_calls_that_alternate_settings_each_reuse_their_own_loop(pair, prompts, monkeypatch):
    """generate keeps the last LOOPS_KEPT chunked loops: calls that alternate two settings each find their own (no new
    loop, so no compile and no fresh executable inside the decode's time), a new loop of the same target shares the
    kept one's loop weights, and past LOOPS_KEPT settings the oldest loop goes."""
    monkeypatch.setattr(engine, "_LOOPS", [])
    first, second = dict(budget=16, chunk_steps=3), dict(budget=0, chunk_steps=1)
    _generate(pair, prompts, **first)
    loop_a = engine._LOOPS[-1]
    _generate(pair, prompts, **second)
    loop_b = engine._LOOPS[-1]
    assert loop_b is not loop_a and loop_b.loop_weights is loop_a.loop_weights
    again = _generate(pair, prompts, **first)
    assert engine._LOOPS == [loop_b, loop_a] and again.stats["compile_seconds"] < 1.0
    monkeypatch.setattr(engine, "LOOPS_KEPT", 2)
    _generate(pair, prompts, budget=16, chunk_steps=2)  # a third setting: loop_b, the oldest, goes
    assert len(engine._LOOPS) == 2 and loop_b not in engine._LOOPS and engine._LOOPS[0] is loop_a
