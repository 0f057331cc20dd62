"""The server at the loop's speed (issue 45, item 3): a fixed-budget bucket runs the smallest chunk program that holds
its live rows, greedy-only while every live row is greedy (serve/programs.py), and a request's tokens are the ones the
one any-settings program gives; one chunk stays in flight while a row is live, free rows or not, and first tokens
are read after the next chunk is launched.

CPU, the embedded default pair in float32, DDTree budget 4 (the drafter's cache is gathered and scattered too), two
batch rows (programs of 1 and 2 rows). One scheduler of each kind for the module. Budget: ~40 s on 2 CPU cores, most
of it the compiles."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "checkpoints", "default")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                                reason="checkpoints/default is not there")

# The warm-ups compile row admission for the 16-token prompt bucket alone (every prompt here is shorter; the longer
# buckets' programs served no request; tests/test_serve_admission.py checks a whole warm-up's).
SETTINGS = dict(max_batch=2, max_len=64, budget=4, chunk_steps=2, warmup_prompt_tokens=16)
LONE = 8  # Settings.lone_chunk_steps' default: a lone row's chunk while nothing waits
GREEDY, SAMPLED = [5, 6, 7, 8], [9, 10, 11]
MENU = (0, 8)  # the adaptive bucket's: two programs per row count to compile
ADAPTIVE_LONE = 4  # its lone row's chunk


@pytest.fixture(scope="module")
def pair():
    from kdtree_jax.generate import load_models

    target, drafter, _, _, _ = load_models(DEFAULT, "float32")
    return target, drafter


def _scheduler(pair, **settings):
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics

    s = sched.Scheduler(*pair, sched.Settings(**{**SETTINGS, **settings}), Metrics())
    assert s.warmup()
    return s


@pytest.fixture(scope="module")
def schedulers(pair):
    """{True: row programs (the default), False: the one program}, both warmed up, not started. The row programs'
    scheduler first serves two rows at once, then a lone row, and "compiles" holds what compiled meanwhile (here, before
    any test's own calls of the engine can have compiled it in this process)."""
    from kdtree_jax.serve import scheduler as sched

    out = {True: _scheduler(pair)}
    compiles = sched.compile_count()
    _run(out[True], (GREEDY, {}), (SAMPLED, dict(temperature=1.0, seed=3)))
    _run(out[True], (GREEDY, {}))
    out["compiles"] = sched.compile_count() - compiles
    out[False] = _scheduler(pair, row_programs=False)
    yield out
    for key in (True, False):
        out[key].stop(drain=False, timeout=30)


def test_nothing_compiles_while_serving_after_the_warm_up(schedulers):
    """The warm-up compiles every program a load runs, the host's view of each chunk width included (the warm-up's
    own request runs only a lone row's long chunk): two rows at once, then a lone row, compile nothing."""
    assert schedulers["compiles"] == 0


def _request(prompt, out, done, max_tokens=10, **settings):
    from kdtree_jax.serve import scheduler as sched

    return sched.Request(prompt=prompt, max_tokens=max_tokens, emit=lambda kind, v: (
        out.extend(v) if kind == "tokens" else done.set()), **settings)


def _run(s, *jobs):
    """Each job (prompt, settings) submitted at once; the scheduler's loop driven on this thread until all are done:
    -> their tokens."""
    outs, dones = [], []
    for prompt, settings in jobs:
        out, done = [], threading.Event()
        s.submit(_request(prompt, out, done, **settings))
        outs.append(out)
        dones.append(done)
    drive(s, dones)
    return outs


def drive(s, dones, max_steps: int = 500):
    """The scheduler's loop on this thread (admission, then a step) until every event in `dones` is set, then its
    chunks in flight collected. A request that never ends (a row emptied under it) fails after max_steps."""
    waiting = list(s._waiting)
    s._waiting.clear()
    for _ in range(max_steps):
        if all(d.is_set() for d in dones):
            break
        waiting = s._admit_waiting(waiting)
        s._step()
    else:
        raise AssertionError(f"requests still running after {max_steps} scheduler steps")
    while s.bucket.inflight:
        s.bucket.collect()


def test_rows_taken_and_put_back_are_the_state(pair, schedulers):
    import jax

    from kdtree_jax.serve.programs import put_rows, take_rows

    s = schedulers[True]
    bucket = s.bucket
    state, _ = bucket.loop.admit(bucket.state, GREEDY, 1, max_tokens=10)
    rows = np.array([1], np.int32)
    sub = take_rows(state, rows)
    assert sub.bonus.shape == (1,) and sub.dcache.k.shape[1] == 1 and sub.cache.pages is state.cache.pages
    back = put_rows(state, sub, rows)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(
            a.dtype, jax.dtypes.prng_key) else a), np.asarray(jax.random.key_data(b) if jax.dtypes.issubdtype(
            b.dtype, jax.dtypes.prng_key) else b))
    bucket.state = bucket.loop.reset_row(back, 1)


def test_the_smallest_program_runs_and_tokens_do_not_depend_on_it(schedulers):
    from kdtree_jax.speculative import engine

    results = {}
    for key, s in ((k, schedulers[k]) for k in (True, False)):
        traced = engine._TRACES.get("decode_chunk", 0)
        runs = s.bucket.programs.runs.copy() if s.bucket.programs is not None else None
        alone = _run(s, (GREEDY, {}))
        pair_out = _run(s, (GREEDY, {}), (SAMPLED, dict(temperature=1.0, seed=3)))
        sampled_alone = _run(s, (SAMPLED, dict(temperature=1.0, seed=3)))
        penalised = _run(s, (SAMPLED, dict(repetition_penalty=1.5)))
        results[key] = (alone, pair_out, sampled_alone, penalised)
        assert engine._TRACES.get("decode_chunk", 0) == traced  # every program was compiled at warm-up
        if key:
            used = s.bucket.programs.runs - runs
            # alone: the greedy one-row program, a lone row's long chunk (nothing waits); the pair: the full batch's
            # any-settings one; the sampled and the penalised request alone: one row of the any-settings program.
            lone, short = LONE, SETTINGS["chunk_steps"]
            assert used[(1, True, lone)] > 0 and used[(2, False, short)] > 0 and used[(1, False, lone)] > 0
            assert used[(2, True, short)] == 0
    assert results[True] == results[False]
    alone, (greedy, sampled), sampled_alone, penalised = results[True]
    assert alone == [greedy] and sampled_alone == [sampled]  # a row's tokens whatever the batch and program
    assert len(penalised[0]) == 10 and penalised != sampled_alone


def test_a_live_row_keeps_a_chunk_in_flight_and_its_first_token_comes_after_the_launch(schedulers):
    s = schedulers[True]
    bucket = s.bucket
    out, done = [], threading.Event()
    req = _request(GREEDY, out, done)
    assert s._admit_waiting([req]) == []
    assert bucket.firsts and not out  # admitted: its prefill queued, nothing read yet
    launched = len(bucket.inflight)
    s._step()
    assert out and not bucket.firsts  # the first token, read after the chunk's launch
    assert launched == 0 and len(bucket.inflight) == 1  # a free row, and still a chunk in flight
    assert bucket.busy() == 1 < bucket.batch
    while not done.is_set():
        s._step()
    while bucket.inflight:
        bucket.collect()
    assert len(out) == 10


def test_rows_a_chunk_retires_are_reset_together_before_the_next_dispatch(schedulers):
    """Two requests that end in the same chunk free their rows at once; their KV slots go back to the pool in one
    dispatch, before anything else runs on the state, and every slot is free once both are done."""
    s = schedulers[True]
    bucket = s.bucket
    outs = _run(s, (GREEDY, dict(max_tokens=6)), (SAMPLED, dict(max_tokens=6)))
    assert [len(o) for o in outs] == [6, 6]
    assert sorted(bucket.retired) == [0, 1] and bucket.owner == [None, None]  # freed, their slots not back yet
    s.spans.reset()
    s._update_gauges()  # nothing in flight: the pool's gauge resets them first
    assert bucket.retired == [] and s.spans.snapshot()["reset_rows"][1] == 1
    state = bucket.state
    assert int(state.cache.num_free) == state.cache.num_slots and not np.asarray(state.active).any()
    assert not np.asarray(state.cache.seq_lens).any()


def test_a_row_cancelled_between_chunks_is_reset_before_the_next_chunk(schedulers):
    """A request cancelled while the other row decodes: its row is reset before the next chunk is launched (else that
    chunk would decode it, its slots held), and the other request gets all its tokens."""
    s = schedulers[True]
    bucket = s.bucket
    (a, a_done), (b, b_done) = ([], threading.Event()), ([], threading.Event())
    ra, rb = _request(GREEDY, a, a_done, max_tokens=40), _request(SAMPLED, b, b_done, max_tokens=12)
    assert s._admit_waiting([ra, rb]) == [] and not bucket.retired
    s._step()
    s.cancel(ra)
    row = bucket.owner.index(ra)
    s._step()  # sweeps the cancelled row, launches the next chunk
    assert bucket.owner[row] is None and bucket.retired == []
    state = bucket.inflight[-1][0].state
    assert not bool(state.active[row]) and int(state.cache.seq_lens[row]) == 0
    drive(s, [b_done])
    assert len(b) == 12 and a_done.is_set()


def test_a_lone_row_takes_the_long_chunk_only_while_nothing_waits(schedulers):
    """A lone live row runs LONE steps a chunk while the queue is empty, the short chunk while a request waits, and
    gets its tokens either way."""
    from kdtree_jax.serve import scheduler as sched

    s = schedulers[True]
    bucket = s.bucket
    out, done = [], threading.Event()
    req = _request(GREEDY, out, done, max_tokens=s.max_tokens_for(len(GREEDY)))
    assert s._admit_waiting([req]) == []
    runs, step = bucket.programs.runs.copy(), int(bucket.state.step)
    bucket.launch()
    s._waiting.append(sched.Request(prompt=SAMPLED, max_tokens=4, emit=lambda kind, v: None))
    try:
        bucket.launch()
    finally:
        s._waiting.clear()
    short = SETTINGS["chunk_steps"]
    assert bucket.programs.runs - runs == {(1, True, LONE): 1, (1, True, short): 1}
    assert int(bucket.state.step) - step == LONE + short  # the row is live throughout: every step ran
    while not done.is_set():
        s._step()
    while bucket.inflight:
        bucket.collect()
    assert len(out) == req.max_tokens and out == _run(schedulers[False], (GREEDY, dict(max_tokens=req.max_tokens)))[0]


@pytest.fixture(scope="module")
def adaptive(pair):
    """An adaptive bucket (budget "auto", given costs: every drafting entry about an autoregressive step, so the batch
    drafts), warmed up, not started."""
    from kdtree_jax.speculative import validation

    menu = validation.adaptive_menu("auto", MENU, pair[1], "ddtree", 4)
    costs = dict(cost_ar=1.0, cost_draft=0.0, cost_verify=[1.0 if b == 0 else 1.05 for b in menu])
    # Its warm-up compiles admission for prompts up to 17 tokens: the 32-token bucket's program too (ahead of time).
    s = _scheduler(pair, budget="auto", menu=MENU, costs=costs, max_len=80, lone_chunk_steps=ADAPTIVE_LONE,
                   adaptive_row_programs=True, warmup_prompt_tokens=17)
    yield s, menu, costs
    s.stop(drain=False, timeout=30)


def test_the_warm_up_compiles_admission_up_to_warmup_prompt_tokens(adaptive, schedulers):
    """Settings.warmup_prompt_tokens bounds the prompt buckets whose admission the warm-up compiles ahead (of 16, 32,
    64 and 80 positions here): up to 17 tokens, the 32-token bucket's program (the 16-token one ran in the warm-up,
    in jax's own cache); up to 16, none ahead. (A whole warm-up's, every bucket's: tests/test_serve_admission.py.)"""
    assert set(adaptive[0].bucket.admit_programs) == {(1, 32)}
    assert all(schedulers[k].bucket.admit_programs == {} for k in (True, False))


def test_an_adaptive_lone_row_runs_one_row_priced_at_one_row(adaptive, schedulers):
    """A lone live greedy row of an adaptive bucket runs the lone row's greedy program (one row, its own entry per
    chunk, the next pick in the loop's chain), its picks priced at the lone row's costs, not the batch's; its tokens
    are the greedy decode whatever it picked; taking its row out and putting it back keeps the policy's rows and the
    batch's costs; greedy rows together run the batch's greedy program."""
    import jax

    from kdtree_jax.serve.programs import put_rows, take_rows

    s, menu, costs = adaptive
    bucket, programs = s.bucket, s.bucket.programs
    assert programs is not None and programs.adaptive and bucket.state.policy.log_scores.shape[0] >= ADAPTIVE_LONE
    assert bucket.spec.menu == menu == MENU  # Settings.menu (the server's --menu)
    reference = _run(schedulers[False], (GREEDY, dict(max_tokens=36)))[0]
    picked, outputs = {}, {}
    for name, lone_ar in (("batch costs", costs["cost_ar"]), ("autoregressive lone row", 0.02)):
        programs.set_lone_costs({**costs, "cost_ar": lone_ar})
        runs, chosen = programs.runs.copy(), np.asarray(bucket.state.policy.chosen)
        outputs[name] = _run(s, (GREEDY, dict(max_tokens=48)))[0]
        assert outputs[name][:36] == reference, name
        assert programs.runs - runs == {(1, True, ADAPTIVE_LONE): (programs.runs - runs).total()} != {}, name
        picked[name] = np.asarray(bucket.state.policy.chosen) - chosen  # steps per entry, then without the drafter
    assert outputs["batch costs"] == outputs["autoregressive lone row"]
    assert picked["batch costs"][-1] == 0  # a row costs the batch's step: every chunk drafts
    # Priced at one row, the lone row's picks are autoregressive: only its first two chunks (launched before the
    # first pick was read) run the entry the chain had.
    lone_ar = picked["autoregressive lone row"]
    assert lone_ar[-1] >= 8 and lone_ar[:-1].sum() <= 2 * ADAPTIVE_LONE
    assert float(bucket.state.policy.cost_ar) == costs["cost_ar"]  # the batch's costs stay the batch's
    # Two greedy rows: the batch's greedy program (every menu entry has one), the tokens those of the fixed budget's.
    runs = programs.runs.copy()
    assert _run(s, (GREEDY, {}), (SAMPLED, {})) == _run(schedulers[False], (GREEDY, {}), (SAMPLED, {}))
    assert set(programs.runs - runs) == {(2, True, SETTINGS["chunk_steps"])}

    state, _ = bucket.loop.admit(bucket.state, GREEDY, 1, max_tokens=10)
    rows = np.array([1], np.int32)
    sub = take_rows(state, rows, programs.lone_costs)
    assert sub.policy.row_expected.shape[0] == 1 and sub.pending.count.shape == (1,)
    assert float(sub.policy.cost_ar) == pytest.approx(0.02)
    back = put_rows(state, sub._replace(policy=sub.policy._replace(row_expected=sub.policy.row_expected + 1)), rows)
    np.testing.assert_array_equal(np.asarray(back.policy.row_expected)[0], np.asarray(state.policy.row_expected)[0])
    np.testing.assert_array_equal(np.asarray(back.policy.row_expected)[1], np.asarray(state.policy.row_expected)[1] + 1)
    for a, b in zip(jax.tree.leaves(state.pending), jax.tree.leaves(back.pending)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(back.policy.cost_ar) == costs["cost_ar"]
    bucket.state = bucket.loop.reset_row(back, 1)


def test_text_stream_decodes_a_bounded_tail_and_gives_the_whole_text():
    """Token by token, a long answer's pieces are its whole text (the checkpoint's tokenizer, and bytes with split
    UTF-8 characters and a stop string), and no feed decodes more than a few windows of tokens."""
    from kdtree_jax.serve.api import TextStream
    from kdtree_jax.tokenizer import ByteTokenizer, load_tokenizer

    class Counting:
        def __init__(self, inner):
            self.inner, self.longest = inner, 0

        def decode(self, ids):
            self.longest = max(self.longest, len(ids))
            return self.inner.decode(ids)

    text = "def f(n):\n    return [é * 2 for é in range(n)]  # ünïcødé → ok\n" * 12
    for inner in (load_tokenizer(os.path.join(DEFAULT, "tokenizer")), ByteTokenizer()):
        ids = inner.encode(text)
        tok = Counting(inner)
        stream = TextStream(tok, [])
        pieces = [stream.feed([t]) for t in ids] + [stream.finish()]
        assert "".join(pieces) == inner.decode(ids)
        assert len(ids) > 400 and tok.longest <= 3 * TextStream.WINDOW
        # Chunks of many tokens at once (a lone row's long chunk brings up to 8 steps x (D + 1)): the pieces are the
        # text whatever the feeds' sizes, one feed bringing more than WINDOW tokens past the base included.
        for sizes in ([1, 4, 7, 28], [12, 23, 2 * TextStream.WINDOW + 5, 3], [3 * TextStream.WINDOW] * 9):
            stream, pieces, at = TextStream(inner, []), [], 0
            for n in sizes * (len(ids) // sum(sizes) + 1):
                pieces.append(stream.feed(ids[at:at + n]))
                at += n
            assert "".join(pieces + [stream.finish()]) == inner.decode(ids), sizes
        stream, pieces = TextStream(inner, ["ok\ndef"]), []
        for at in range(0, len(ids), 28):
            pieces.append(stream.feed(ids[at:at + 28]))
        assert stream.stopped and "".join(pieces) == text[:text.index("ok\ndef")]
        stream = TextStream(inner, ["→ ok\n" * 2, "ok\ndef"])
        pieces = [stream.feed([t]) for t in ids]
        assert stream.stopped and "".join(pieces) == text[:text.index("ok\ndef")]


def test_the_server_calls_only_public_names_of_the_engine():
    """serve/ reaches the engine's modules through their public names (engine.decode_chunk, admission.admit_group,
    ...): a private one may change under it without notice."""
    import ast
    import glob

    modules = {"engine", "admission", "budget_policy", "cost_model", "validation", "sampling", "step", "kv_pool"}
    private = []
    for path in sorted(glob.glob(os.path.join(ROOT, "kdtree_jax", "serve", "*.py"))):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_")):
                private.append(f"{os.path.basename(path)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not private, f"serve/ uses private names: {private}"


def test_a_retired_row_a_waiting_request_takes_costs_no_reset_of_its_own(schedulers):
    """Rows retired by a chunk and taken at once by waiting requests: the admission empties them itself (no reset
    dispatch), every slot the old requests held is back, and the new requests' tokens are what they get alone."""
    s = schedulers[True]
    bucket = s.bucket
    outs = _run(s, (GREEDY, dict(max_tokens=6)), (SAMPLED, dict(max_tokens=6)))
    assert [len(o) for o in outs] == [6, 6] and sorted(bucket.retired) == [0, 1]
    held_before = bucket.state.cache.num_slots - int(bucket.state.cache.num_free)
    assert held_before > 0  # the old requests' slots, not yet back
    s.spans.reset()
    (a, a_done), (b, b_done) = ([], threading.Event()), ([], threading.Event())
    ra, rb = _request(SAMPLED, a, a_done, max_tokens=7), _request(GREEDY, b, b_done, max_tokens=9)
    assert s._admit_waiting([ra, rb]) == []
    assert bucket.retired == [] and "reset_rows" not in s.spans.snapshot()
    state = bucket.state
    held = state.cache.num_slots - int(state.cache.num_free)
    assert held == int(np.asarray(state.cache.seq_lens).sum()) == len(SAMPLED) + len(GREEDY)
    drive(s, [a_done, b_done])
    while bucket.inflight:
        bucket.collect()
    assert a == _run(schedulers[False], (SAMPLED, dict(max_tokens=7)))[0]
    assert b == _run(schedulers[False], (GREEDY, dict(max_tokens=9)))[0]


@pytest.mark.parametrize("kind", ["fixed", "adaptive"])
def test_a_chunks_host_view_is_what_the_chunk_returned(kind, schedulers, adaptive):
    """The one array the host reads of a chunk (scheduler.host_view, taken apart by ChunkRead.of) holds the chunk's
    tokens, start and num_out, the acceptance histogram, the pool's free slots and, with the adaptive budget, the
    policy's counters, each as read on its own, floats bit for bit."""
    import jax

    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.speculative import budget_policy

    s = schedulers[True] if kind == "fixed" else adaptive[0]
    bucket = s.bucket
    out_, done = [], threading.Event()
    req = _request(SAMPLED, out_, done, max_tokens=12, temperature=0.9, seed=3)
    assert s._admit_waiting([req]) == []
    bucket.launch()
    out = bucket.inflight[-1][0]
    read = sched.ChunkRead.of(jax.device_get(sched.host_view(out)), out)
    tokens, start, num_out, hist, num_free = jax.device_get((out.tokens, out.start, out.num_out,
                                                             out.state.accepted_hist, out.state.cache.num_free))
    assert (read.tokens == tokens).all() and (read.start == start).all() and (read.num_out == num_out).all()
    assert (read.tokens >= 0).any() and read.tokens.shape == tokens.shape  # the chunk emitted something
    assert (read.hist == hist).all() and read.num_free == int(num_free) < out.state.cache.num_slots
    if kind == "fixed":
        assert read.policy is None
    else:
        policy = jax.device_get(out.state.policy)
        for k in budget_policy.SUMMARY_FIELDS:
            got, want = np.asarray(getattr(read.policy, k)), np.asarray(getattr(policy, k))
            assert got.shape == want.shape and got.dtype.kind == want.dtype.kind
            assert np.array_equal(got.view(np.int32) if got.dtype == np.float32 else got,
                                  want.view(np.int32) if want.dtype == np.float32 else want), k
        menu = s.bucket.spec.menu  # (json: a summary of no drafted step has NaN taus)
        assert json.dumps(budget_policy.summary(read.policy, menu)) == json.dumps(budget_policy.summary(policy, menu))
    drive(s, [done])
    assert len(out_) == 12


def test_a_cost_model_measured_at_start_that_refuses_serves_the_autoregressive_programs(pair, schedulers, monkeypatch,
                                                                                        tmp_path):
    """A first start (no cached cost model) measures the adaptive budget's costs; where no budget pays (a CPU) the
    bucket is built again as the next start builds it from that cache: the plain autoregressive program and its row
    programs (a lone row runs one row, not the batch), saying so, its cost info marked measured. (The measurement is a
    stand-in that refuses: a real one on this CPU refuses too, but takes ~25 s.)"""
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.speculative import cost_model, engine

    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path))
    measured = []

    def refusing(loop, state, spec, **kw):  # every drafting entry 50x an autoregressive step
        measured.append(spec.menu)
        batch = state.bonus.shape[0]
        context = float(np.asarray(state.cache.seq_lens)[:batch].mean())
        return cost_model.make_point(batch, context, spec.menu,
                                     {"ar": 1.0, **{i: 50.0 for i, b in enumerate(spec.menu) if b > 0}},
                                     expected=[1.0 if b == 0 else 2.0 for b in spec.menu])

    monkeypatch.setattr(engine, "calibrate", refusing)
    said = []
    s = sched.Scheduler(*pair, sched.Settings(**{**SETTINGS, "budget": "auto", "menu": MENU}), Metrics(),
                        say=said.append)
    bucket = s._get_bucket()
    assert measured == [MENU]
    assert bucket.spec.menu == () and bucket.drafter is None and bucket.programs is not None
    assert any("measured now): serving autoregressively" in line for line in said)
    info = s.metrics.budget_policy()["buckets"]["batch"]
    assert info["calibrated"] is True and info["decision"] == "autoregressive"
    runs = bucket.programs.runs.copy()
    assert _run(s, (GREEDY, {})) == _run(schedulers[False], (GREEDY, {}))  # float32: greedy is the target's own
    assert set(bucket.programs.runs - runs) == {(1, True, LONE)}  # one row, not the batch
    s.stop(drain=False, timeout=30)


def test_a_request_runs_greedy_programs_only_without_sampling_or_penalties():
    """Request.greedy (read by every chunk's launch to pick a greedy-only program) is its settings' verdict: no
    temperature and no penalty; top-k / top-p alone leave a row greedy."""
    from kdtree_jax.serve import scheduler as sched

    def greedy(**settings):
        return sched.Request(prompt=[1], max_tokens=1, emit=lambda *a: None, **settings).greedy

    assert greedy() and greedy(top_k=5, top_p=0.5)
    assert not greedy(temperature=0.7)
    assert not any(greedy(**{k: v}) for k, v in (("repetition_penalty", 1.1), ("presence_penalty", 0.5),
                                                   ("frequency_penalty", -0.5)))


def test_a_sub_batch_chunk_takes_each_set_of_rows_copied_to_the_device_once():
    """A chunk of fewer rows than the batch gets its rows (the live ones, then free ones: distinct) as a device array
    that RowPrograms keeps per set of rows: the same set again is the same array, not a numpy array copied by the
    call. Stand-in programs record what they are given."""
    import collections
    import types

    import jax

    from kdtree_jax.serve import programs
    from kdtree_jax.speculative import engine
    from kdtree_jax.speculative.step import SpecConfig

    State = collections.namedtuple("State", "counts")
    full = types.SimpleNamespace(spec=SpecConfig(budget=0, sampled=True, penalties=True), steps=2, leaves=[],
                                 loop_weights=None)
    rp = programs.RowPrograms(full, 8, lone_steps=4)
    given = []

    def program(leaves, weights, state, rows=None, costs=None):
        given.append(rows)
        return engine.ChunkOutput(state, None, None, None, None, None)

    rp._compiled = {key + (None,): program for key in rp.keys()}
    calls = (([3], False), ([5, 1, 6], False), ([3], False), ([3], True), ([2, 7], False))
    for live, lone in calls:
        rp(State(None), live, True, lone=lone)
    want = ([3], [5, 1, 6, 0], [3], [3], [2, 7])
    assert all(isinstance(rows, jax.Array) for rows in given)
    assert [np.asarray(rows).tolist() for rows in given] == [list(w) for w in want]
    assert given[2] is given[0] and given[3] is given[0]  # k = 1 either way: the lone chunk's program, same rows
    assert set(rp.runs) == {(1, True, 2), (4, True, 2), (1, True, 4), (2, True, 2)}
