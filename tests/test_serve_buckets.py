"""The server's buckets (one per sampling setting, each with its own compiled chunk program): dropping one at
--max-buckets frees its program once the process holds many memory mappings (XLA:CPU maps every executable it
loads; a long-running server that met many settings would otherwise reach vm.max_map_count: tests/conftest.py).
CPU, the embedded default pair in float32, served autoregressively (the cheapest program to compile)."""

from __future__ import annotations

import os
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "checkpoints", "default")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                    reason="checkpoints/default is not there")
def test_a_dropped_bucket_clears_jax_caches_and_the_live_one_keeps_serving(monkeypatch):
    from kdtree_jax.generate import load_models
    from kdtree_jax.serve import scheduler as sched
    from kdtree_jax.serve.metrics import Metrics
    from kdtree_jax.speculative import admission

    target, drafter, _, _, _ = load_models(DEFAULT, "float32")
    s = sched.Scheduler(target, drafter, sched.Settings(max_batch=2, max_len=64, budget=0, chunk_steps=2,
                                                        max_buckets=1), Metrics())
    s.warmup()
    s.start()

    def run(temperature):
        done, out = threading.Event(), []
        s.submit(sched.Request(prompt=[5, 6, 7, 8], max_tokens=6, temperature=temperature, seed=1,
                               emit=lambda kind, v: out.extend(v) if kind == "tokens" else done.set()))
        assert done.wait(300)
        return out

    try:
        greedy = run(0.0)
        assert s.releases == 0 and admission._admit._cache_size() >= 1  # (other tests' shapes too)
        monkeypatch.setattr(sched, "RELEASE_MAPS", 0)  # any mapping counts as many: every drop releases
        sampled = run(0.7)  # a new setting: the greedy bucket (idle) is dropped, JAX's caches cleared
        assert s.releases == 1 and list(s.buckets) == [(0.7, 1.0)]
        assert admission._admit._cache_size() == 1  # cleared: the sampled admission only (the greedy one not used since)
        assert run(0.7) == sampled  # the live bucket's own program survived the clear (and the seed holds)
        monkeypatch.setattr(sched, "RELEASE_MAPS", None)  # half of vm.max_map_count: far above this process
        assert run(0.0) == greedy and s.releases == 1 and s.error is None
    finally:
        s.stop(drain=False, timeout=30)
