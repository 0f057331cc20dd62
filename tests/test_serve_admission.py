"""Batched admission (issue 45, item 3): the server admits the waiting prompts of one length bucket together, in
groups of a few fixed sizes (admission.admit_group: one prefill of k rows and k adoptions, one dispatch), and each
request's tokens are the ones it gets admitted alone; a request the admission's checks refuse gets its own one-line
error while the others of its group are admitted and the server keeps serving.

CPU, the embedded default pair in float32, DDTree budget 4 (the drafter's context is prefilled in the group too),
four batch rows, the one chunk program (row_programs=False: fewer compiles). Two schedulers for the module: groups of
1 and 4 (the default for four rows), and every prompt alone. Budget: ~60 s on 2 CPU cores, most of it the compiles."""

from __future__ import annotations

import os
import threading

import pytest
from test_serve_programs import drive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "checkpoints", "default")

pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                                reason="checkpoints/default is not there")

SETTINGS = dict(max_batch=4, max_len=96, budget=4, chunk_steps=2, row_programs=False)
# Four prompts of the 16-token bucket (different lengths), then one of the 32-token bucket.
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32, 33, 34, 35],
           list(range(40, 60))]


@pytest.fixture(scope="module")
def schedulers():
    """{True: admission groups (1, 4), False: every prompt alone}, both warmed up, not started."""
    from kdtree_jax.generate import load_models
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics

    target, drafter, _, _, _ = load_models(DEFAULT, "float32")
    out = {}
    for groups in (True, False):
        s = sched.Scheduler(target, drafter, sched.Settings(**SETTINGS, admit_groups=groups), Metrics())
        assert s.warmup()
        out[groups] = s
    yield out
    for s in out.values():
        s.stop(drain=False, timeout=30)


def _run(s, jobs):
    """Each job (prompt, settings) submitted at once, the scheduler's loop driven on this thread until all are done:
    -> [(tokens, how it ended)]."""
    from kdtree_jax.serve import scheduler as sched

    results, dones = [], []
    for prompt, settings in jobs:
        result, done = {"tokens": [], "end": None}, threading.Event()

        def emit(kind, value, result=result, done=done):
            if kind == "tokens":
                result["tokens"].extend(value)
            else:
                result["end"] = (kind, value)
                done.set()

        s.submit(sched.Request(prompt=prompt, max_tokens=settings.pop("max_tokens", 8), emit=emit, **settings))
        results.append(result)
        dones.append(done)
    drive(s, dones)
    return [(r["tokens"], r["end"]) for r in results]


def test_group_sizes():
    from kdtree_jax.serve.scheduler import admit_group_sizes

    assert admit_group_sizes(16) == (1, 4, 16) and admit_group_sizes(8) == (1, 4) and admit_group_sizes(2) == (1,)
    assert admit_group_sizes(64) == (1, 4, 16, 64) and admit_group_sizes(16, False) == (1,)
    assert admit_group_sizes(8, (2, 8)) == (1, 2, 8)
    with pytest.raises(ValueError, match=r"in \[1, 8\]"):
        admit_group_sizes(8, (16,))


def test_a_group_admission_gives_each_request_what_it_gets_alone(schedulers):
    """Four prompts of one bucket admitted in one dispatch (greedy, and one seeded sampled row among them), then the
    fifth: the tokens equal one-at-a-time admission's, and each prompt's alone."""
    from kdtree_jax.speculative import admission

    jobs = [(p, {}) for p in PROMPTS]
    jobs[1] = (PROMPTS[1], dict(temperature=1.0, seed=7))
    out = {}
    for groups, s in schedulers.items():
        runs = s.bucket.admit_runs.copy()
        traced = admission._TRACES.get("admit_group", 0)
        out[groups] = _run(s, [(p, dict(kw)) for p, kw in jobs])
        used = s.bucket.admit_runs - runs
        if groups:
            assert used == {(4, 16): 1, (1, 32): 1}  # one dispatch for the first four
            assert admission._TRACES.get("admit_group", 0) == traced  # the warm-up compiled the (1, 32) program
        else:
            assert used == {(1, 16): 4, (1, 32): 1}
    assert out[True] == out[False]
    assert all(end == ("done", "length") and len(tokens) == 8 for tokens, end in out[True])
    alone = [_run(schedulers[True], [(p, dict(kw))])[0] for p, kw in jobs[:2]]
    assert alone == out[True][:2]


@pytest.mark.parametrize("fault", ["token id", "too long"])
def test_a_fault_in_one_prompt_of_a_group_is_its_own_one_line_error(schedulers, fault):
    """One of five requests fails the admission's checks: it gets a one-line error and no row; the other four are
    admitted together with the tokens they get alone, and the scheduler keeps serving."""
    s = schedulers[True]
    vocab = s.target.cfg.vocab_size
    bad = [5, vocab + 3, 7] if fault == "token id" else [5] * (SETTINGS["max_len"] + 1)
    good = PROMPTS[:4]
    bucket, runs = s.bucket, s.bucket.admit_runs.copy()
    out = _run(s, [(good[0], {}), (bad, {}), *[(p, {}) for p in good[1:]]])
    tokens, (kind, message) = out[1]
    assert kind == "error" and tokens == [] and "\n" not in message
    assert ("vocab_size" in message) if fault == "token id" else ("does not fit" in message)
    assert s.bucket is bucket and s.error is None  # nothing else failed
    assert s.bucket.admit_runs - runs == {(4, 16): 1}
    assert [o for i, o in enumerate(out) if i != 1] == _run(schedulers[False], [(p, {}) for p in good])
    assert s.bucket.busy() == 0 and _run(s, [(good[0], {})])[0][1] == ("done", "length")


def test_the_warm_up_compiles_every_prompt_buckets_admission(schedulers):
    """After the warm-up, a prompt of any length a row takes is admitted (alone or in a group) by a program compiled
    then: nothing compiles while serving, and the tokens are those of the same prompt admitted
    by the jitted program (the scheduler that admits every prompt alone, warmed up the same way, is its reference)."""
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.speculative import admission

    grouped = schedulers[True]
    longest = grouped.longest_prompt()
    assert grouped.max_tokens_for(longest) >= 1 > grouped.max_tokens_for(longest + 1)
    bucket = grouped.bucket
    max_len = bucket.state.cache.max_len
    buckets = {admission.prompt_bucket(n, max_len) for n in range(1, longest + 1)}
    assert len(buckets) >= 3
    assert set(bucket.admit_programs) == {(k, b) for b in buckets - {16} for k in bucket.group_sizes}
    compiles = sched.compile_count()  # XLA's compiles (a trace the warm-up's lowering made is not one)
    long_prompts = [list(range(100, 100 + n)) for n in (40, 41, 42, 43, longest)]
    jobs = [(p, {"max_tokens": 4}) for p in long_prompts]
    together = _run(grouped, [(p, dict(s)) for p, s in jobs])
    assert sched.compile_count() == compiles
    assert bucket.admit_runs[(4, admission.prompt_bucket(40, max_len))] >= 1
    alone = _run(schedulers[False], [(p, dict(s)) for p, s in jobs])
    assert together == alone and all(end[0] == "done" for _, end in together)
