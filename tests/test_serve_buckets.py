"""The server's one bucket: requests with different sampling settings share one batch and one compiled chunk program
(each row's settings and random stream are data in the loop state), and a greedy request's tokens do not depend on
the sampled rows beside it. CPU, the embedded default pair in float32, a small fixed DDTree budget."""

from __future__ import annotations

import os
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "checkpoints", "default")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                    reason="checkpoints/default is not there")
def test_mixed_sampling_settings_share_one_program_and_greedy_rows_keep_their_tokens():
    from kdtree_jax.generate import load_models
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.speculative import engine

    target, drafter, _, _, _ = load_models(DEFAULT, "float32")
    # The warm-up compiles admission for the 16-token prompt bucket alone (the prompt below is 4 tokens; a whole
    # warm-up's admission is tests/test_serve_admission.py's).
    s = sched.Scheduler(target, drafter, sched.Settings(max_batch=3, max_len=64, budget=4, chunk_steps=2,
                                                        warmup_prompt_tokens=16), Metrics())
    traced = engine._TRACES.get("decode_chunk", 0)
    s.warmup()
    # The warm-up compiled the chunk programs: the one for every row and setting, and those of fewer rows and of
    # greedy rows only (serve/programs.py), none of them per setting.
    programs = 1 + len(s.bucket.programs._compiled)
    assert engine._TRACES.get("decode_chunk", 0) == traced + programs
    s.start()
    prompt = [5, 6, 7, 8]

    def submit(**settings):
        done, out = threading.Event(), []
        s.submit(sched.Request(prompt=prompt, max_tokens=10, emit=lambda kind, v: (
            out.extend(v) if kind == "tokens" else done.set()), **settings))
        return done, out

    def wait(*jobs):
        for done, _ in jobs:
            assert done.wait(300)
        return [out for _, out in jobs]

    try:
        [solo] = wait(submit(temperature=0.0))
        # Three settings at once, sharing the batch (whichever chunk admits each).
        greedy, hot, filtered = wait(submit(temperature=0.0), submit(temperature=1.0, seed=3),
                                     submit(temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3, seed=4))
        assert greedy == solo
        assert len(hot) == len(filtered) == 10 and hot != solo
        [hot_alone] = wait(submit(temperature=1.0, seed=3))
        assert hot_alone == hot  # a seeded row's stream is its own, whatever the batch it joined
        assert engine._TRACES.get("decode_chunk", 0) == traced + programs  # no program per setting
        assert s.bucket is not None and s.error is None
    finally:
        s.stop(drain=False, timeout=30)
