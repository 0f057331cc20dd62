"""In-process A/B of a chunk's launch (Bucket.launch) before and after c17be7c's host-side cuts, alternating per chunk on
one warmed-up bucket (a shared machine's load moves between processes minutes apart): `before` is the launch as it was
at 93f30a4 (each request's sampled/penalised properties read per launch, a numpy row index array handed to a
sub-batch chunk's program, the policy's counters as a dict), `after` the current code. The device is idle before
each launch; the chunk is waited for and read after the clock stops.

    python benchmarks/results/history/serve_launch_ab_cpu_c17be7c.py [CHUNKS]   # from the repository root
"""
import functools
import os
import sys
import time

ROOT = os.getcwd()
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from kdtree_jax import runtime

runtime.configure()
import jax
import jax.numpy as jnp
import numpy as np

import serve_launch
from kdtree_jax.generate import DEFAULT_CHECKPOINT, load_models
from kdtree_jax.serve import scheduler as sched
from kdtree_jax.serve.metrics import Metrics
from kdtree_jax.speculative import budget_policy


@jax.jit
def _old_host_view_jit(tokens, start, num_out, hist, num_free, policy):
    parts = [tokens.ravel(), start, num_out, hist, num_free[None]]
    if policy is not None:
        parts += [policy[k] for k in budget_policy.SUMMARY_FIELDS]
    return jnp.concatenate([sched._as_int32(x) for x in parts])


def old_host_view(out):
    state = out.state
    policy = None if state.policy is None else {k: getattr(state.policy, k) for k in budget_policy.SUMMARY_FIELDS}
    return _old_host_view_jit(out.tokens, out.start, out.num_out, state.accepted_hist, state.cache.num_free, policy)


def old_programs_call(self, state, live_rows, greedy, lone=False):
    k, greedy, steps = key = self.pick(len(live_rows), greedy, lone)
    self.runs[key] += 1
    if k == self.batch and not greedy and steps == self.full.steps:
        return self.full(state)
    counts = state.counts
    rows = None
    if k < self.batch:
        rows = list(live_rows)
        taken = set(rows)
        rows += [r for r in range(self.batch) if r not in taken][:k - len(rows)]
        rows = np.asarray(rows, np.int32)

    def run(entry):
        given = state._replace(counts=None) if greedy else state
        program = self._compiled[key + (entry,)]
        if rows is None:
            return program(self.full.leaves, self.full.loop_weights, given)
        return program(self.full.leaves, self.full.loop_weights, given, rows, self._costs(state))

    out = self.full.call_entry(state, lambda _, entry: run(entry)) if self.adaptive else run(None)
    if greedy:
        out = out._replace(state=out.state._replace(counts=counts))
    return out


def old_launch(self):
    self.reset_retired()
    t = time.perf_counter()
    if self.programs is not None:
        live = [r for r, req in enumerate(self.owner) if req is not None]
        greedy = all(not (req.sampling.sampled or req.sampling.penalised) for req in self.owner if req is not None)
        out = old_programs_call(self.programs, self.state, live, greedy, lone=not self.sched._waiting)
    else:
        out = self.loop(self.state)
    self.state = out.state
    self.inflight.append((out, old_host_view(out), list(self.owner)))
    self.last_used = self.sched.spans.add("launch", t)


def main():
    chunks = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    target, drafter, tokenizer, _, _ = load_models(DEFAULT_CHECKPOINT, "float32")
    prompt = tokenizer.encode("def fibonacci(n):")
    args = type("A", (), {"max_batch": 16, "max_len": 256})
    results = {}
    for kind in ("ar", "adaptive"):
        s = sched.Scheduler(target, drafter, serve_launch._settings(kind, args, sched), Metrics())
        assert s.warmup()
        b = s.bucket
        for live in (16, 1):
            b.inflight.clear()
            b.retired = [r for r, req in enumerate(b.owner) if req is not None]
            b.owner = [None] * 16
            b.reset_retired()
            b.admit([sched.Request(prompt=prompt, max_tokens=s.max_tokens_for(len(prompt)), emit=lambda *a: None)
                     for _ in range(live)])
            b.firsts = []
            times = {"before": ([], []), "after": ([], [])}
            arms = {"before": functools.partial(old_launch, b), "after": b.launch}
            for i in range(chunks + 4):
                for name in (("before", "after") if i % 2 else ("after", "before")):
                    jax.block_until_ready(b.state)
                    t, c = time.perf_counter(), time.thread_time()
                    arms[name]()
                    wall, cpu = time.perf_counter() - t, time.thread_time() - c
                    jax.block_until_ready(b.inflight[-1][0])
                    b.collect()
                    if i >= 4:
                        times[name][0].append(wall)
                        times[name][1].append(cpu)
            row = {name: {"wall_median_ms": 1e3 * float(np.median(w)), "wall_mean_ms": 1e3 * float(np.mean(w)),
                          "cpu_median_ms": 1e3 * float(np.median(c))} for name, (w, c) in times.items()}
            row["after/before wall median"] = row["after"]["wall_median_ms"] / row["before"]["wall_median_ms"]
            wins = sum(a < bb for a, bb in zip(times["after"][0], times["before"][0]))
            row["after faster, pairs"] = f"{wins} of {len(times['after'][0])}"
            results[f"{kind}, {live} live rows"] = row
            print(f"{kind}, {live} live rows: {row}", flush=True)
        s.stop(drain=False, timeout=30)
    import json
    print(json.dumps({"loadavg": os.getloadavg(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
