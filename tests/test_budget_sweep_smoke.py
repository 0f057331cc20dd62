"""benchmarks/budget_sweep.py (the adaptive budget against the fixed ones) and benchmarks/k2_budget_picks.py (the
policy's picks on a cost table), in-process as tests/test_benchmark_smoke.py runs the benchmark scripts.
Correctness only: nothing here looks at a timing."""

import heapq
import json
import os
import sys
import types

import numpy as np
import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import budget_sweep  # noqa: E402
import k2_budget_picks  # noqa: E402

NO_CACHE = ["--cache-dir", ""]  # no persistent compilation cache of the script's own (the session's is there)


def _one(path, pattern):
    found = sorted(path.glob(pattern))
    assert len(found) == 1, (pattern, [p.name for p in path.iterdir()])
    return found[0]


def test_budget_sweep_smoke(tmp_path, monkeypatch):
    """The random tiny pair, one cell: autoregressive, budget 4 and auto, 1 prompt x 8 tokens, with a fresh cost-model
    cache (so auto calibrates in this run)."""
    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path / "cost_cache"))
    out = tmp_path / "out"
    assert budget_sweep.main(["--smoke", "--out", str(out), "--batch", "1", "--temperatures", "0",
                              "--budgets", "0,4", "--max-new-tokens", "8", "--prompts", "1"] + NO_CACHE) == 0
    data = json.loads(_one(out, "budget_sweep_smoke_*.json").read_text())
    md = _one(out, "budget_sweep_smoke_*.md").read_text()
    assert _one(out, "budget_sweep_smoke_*.png").read_bytes()[:4] == b"\x89PNG"
    assert md.startswith("# Adaptive DDTree budget vs fixed budgets") and "| auto | auto / AR | auto / best |" in md
    meta = data["meta"]
    for key in ("date", "commit", "device", "backend", "jax", "batch_sizes", "temperatures", "contexts", "budgets",
                "max_new_tokens", "calibrate", "cost_model_cache", "xla_flags"):
        assert key in meta, key
    assert meta["budgets"] == [0, 4] and meta["max_new_tokens"] == 8 and meta["cost_model_cache"] == str(
        tmp_path / "cost_cache")
    [cell] = data["cells"]
    assert cell["batch"] == 1 and cell["temperature"] == 0 and cell["prompts"] == 1
    assert [d["decoder"] for d in cell["decoders"]] == ["autoregressive", "DDTree 4", "auto"]
    for d in cell["decoders"]:
        assert d["tokens_per_second"] > 0 and d["new_tokens"] == 8 and 1.0 <= d["tau"]
        assert d["identical_to_ar"] == 1  # greedy speculative decoding is lossless (float32 on the CPU)
    policy = cell["auto_policy"]
    hist = policy["budget_steps"]
    assert set(hist) == {"0", "4", "ar"} and sum(hist.values()) == policy["steps"] > 0
    assert policy["calibrated"] is True and policy["calibration_seconds"] > 0  # a fresh cache: measured here
    assert policy["timed_calls_calibrated"] == 0  # the timed pass used the point the warm-up cached
    assert cell["auto_equals_budget16"] is None  # no budget 16 in this run
    assert cell["best_fixed"] in ("autoregressive", "DDTree 4")
    assert cell["auto_speedup_vs_ar"] == pytest.approx(
        cell["auto_tokens_per_second"] / cell["decoders"][0]["tokens_per_second"])
    assert os.listdir(tmp_path / "cost_cache" / "cost_models")  # the point went to the cache the test set


class _FakeResult(types.SimpleNamespace):
    pass


def test_budget_sweep_cell_bookkeeping(monkeypatch):
    """run_cell's arithmetic on a fake generate: speed-ups, the best fixed decoder, the histogram summed over a pass's
    calls, predicted / observed tau weighted by drafted steps, the greedy comparisons."""
    speeds = {0: 100.0, 4: 150.0, 16: 180.0, "auto": 200.0}

    def fake_generate(target, drafter, prompts, **kw):
        budget = kw["budget"]
        batch = len(prompts)
        tokens = [[int(p[0]) + i for i in range(kw["max_new_tokens"])] for p in prompts]
        if budget == "auto":  # one token off budget 16's in the second prompt of each call
            tokens[-1][-1] += 1
        decoded = batch * (kw["max_new_tokens"] - 1)
        stats = {"sequence_steps": 10 * batch, "new_tokens": batch * kw["max_new_tokens"], "tau": 2.0,
                 "decode_seconds": decoded / speeds[budget], "acceptance_by_depth": [0.5, 0.25],
                 "steps": 10, "prefill_seconds": 0.0, "num_nodes": 1 + (16 if budget == "auto" else budget),
                 "compile_seconds": 0.0, "decoding": "speculative"}
        if budget == "auto":
            seed = kw["seed"]  # 0, 1: two calls with different policies
            stats["budget_policy"] = {
                "menu": [0, 4, 16], "budget_steps": {"0": 0, "4": 2 + seed, "16": 6}, "steps_without_drafter": 1,
                "predicted_tau": 3.0 + seed, "observed_tau": 2.5, "calibrated": kw["calibrate"],
                "calibration_seconds": 1.5 if kw["calibrate"] else 0.0, "costs_ms": {"ar": 1.0}}
        return _FakeResult(tokens=tokens, stats=stats)

    monkeypatch.setattr(budget_sweep, "generate", fake_generate)
    args = types.SimpleNamespace(budgets=[0, 4, 16], max_new_tokens=5, topk=4, tree_temperature=1.0, top_k=0,
                                 top_p=0.95, seed=0, impl="auto", chunk_steps=8, calibrate=True, repeats=1)
    prompts = [[10], [20], [30], [40]]
    cell = {"context": 16, "temperature": 0.0, "top_p": 1.0, "batch": 2, "prompts": 4, "prompt_cuts": [],
            "batches": [prompts[:2], prompts[2:]]}
    rec = budget_sweep.run_cell(None, object(), cell, args, [0, 4, 16])
    assert rec["auto_speedup_vs_ar"] == pytest.approx(2.0)
    assert rec["best_fixed"] == "DDTree 16" and rec["best_fixed_budget"] == 16
    assert rec["auto_vs_best_fixed"] == pytest.approx(200 / 180)
    pol = rec["auto_policy"]
    assert pol["budget_steps"] == {"0": 0, "4": 5, "16": 12, "ar": 2} and pol["steps"] == 19
    assert pol["predicted_tau"] == pytest.approx((3.0 * 8 + 4.0 * 9) / 17) and pol["observed_tau"] == 2.5
    assert pol["calibrated"] and pol["calibration_seconds"] == 1.5 and pol["timed_calls_calibrated"] == 0
    assert rec["auto_equals_budget16"] is False and rec["auto_identical_to_budget16"] == 2
    assert rec["auto_first_differences_vs_budget16"] == [None, 4, None, 4]
    by = {d["decoder"]: d for d in rec["decoders"]}
    assert by["DDTree 16"]["identical_to_ar"] == 4 and by["auto"]["identical_to_ar"] == 2
    assert budget_sweep.histogram_text(pol).startswith("4: 26%")

    # A decoder that raises is recorded, and the cell, its report and its figure go on without it.
    def failing(target, drafter, prompts, **kw):
        if kw["budget"] in (4, "auto"):
            raise RuntimeError("pool exhausted")
        return fake_generate(target, drafter, prompts, **kw)

    monkeypatch.setattr(budget_sweep, "generate", failing)
    rec = budget_sweep.run_cell(None, object(), cell, args, [0, 4, 16])
    assert rec["errors"] == {"DDTree 4": "RuntimeError: pool exhausted", "auto": "RuntimeError: pool exhausted"}
    assert rec["best_fixed"] == "DDTree 16" and rec["auto_policy"] is None and rec["auto_equals_budget16"] is None
    meta = {"budgets": [0, 4, 16], "device": "fake", "date": "today", "commit": "x", "jax": "0", "backend": "gpu",
            "pair": "fake", "target_dtype": "bf16", "target": {"num_hidden_layers": 1, "hidden_size": 8},
            "block_size": 4, "topk": 4, "tree_temperature": 1.0, "top_p": 0.95, "max_new_tokens": 5, "prompts": 4,
            "chunk_steps": 8, "repeats": 1, "command": "budget_sweep.py", "seconds": 1.0, "cost_model_cache": "c",
            "calibrate": False}
    md = budget_sweep.render({"meta": meta, "cells": [rec]})
    assert "## Errors" in md and "RuntimeError: pool exhausted" in md


def test_budget_sweep_passes_round_robin(monkeypatch):
    """Every decoder warms up first, then the timed passes go round the decoders (pass 1 of each, pass 2 of each):
    a drift of the device's speed during a cell falls on all of them alike."""
    calls = []

    def fake_generate(target, drafter, prompts, **kw):
        calls.append(kw["budget"])
        stats = {"sequence_steps": 10, "new_tokens": 5, "tau": 1.0, "decode_seconds": 1.0, "acceptance_by_depth": [],
                 "steps": 10, "prefill_seconds": 0.0, "num_nodes": 1, "compile_seconds": 0.0, "decoding": "x"}
        if kw["budget"] == "auto":
            stats["budget_policy"] = {"menu": [0, 4], "budget_steps": {"0": 0, "4": 1}, "steps_without_drafter": 0,
                                      "predicted_tau": 1.0, "observed_tau": 1.0, "calibrated": False,
                                      "calibration_seconds": 0.0, "costs_ms": None}
        return _FakeResult(tokens=[[1] * 5 for _ in prompts], stats=stats)

    monkeypatch.setattr(budget_sweep, "generate", fake_generate)
    args = types.SimpleNamespace(budgets=[0, 4], max_new_tokens=5, topk=4, tree_temperature=1.0, top_k=0,
                                 top_p=0.95, seed=0, impl="auto", chunk_steps=8, calibrate=False, repeats=2)
    cell = {"context": 16, "temperature": 0.7, "top_p": 0.95, "batch": 1, "prompts": 2, "prompt_cuts": [],
            "batches": [[[1]], [[2]]]}
    rec = budget_sweep.run_cell(None, object(), cell, args, [0, 4])
    one_pass = [0, 0, 4, 4, "auto", "auto"]
    assert calls == [0, 4, "auto"] + one_pass + one_pass
    assert [d["decoder"] for d in rec["decoders"]] == ["autoregressive", "DDTree 4", "auto"]
    assert all(len(d["tokens_per_second_passes"]) == 2 for d in rec["decoders"])


def test_context_prompts_held_out_and_long():
    """Prompts longer than any held-out file come from the held-out files concatenated; shorter ones are
    spec_decode's."""
    from kdtree_jax.tokenizer import ByteTokenizer
    import spec_decode

    tok = ByteTokenizer()
    short, where = budget_sweep.context_prompts(tok, 3, 40)
    ref, _ = spec_decode.heldout_prompts(tok, 3, 40)
    assert all(np.array_equal(a, b) for a, b in zip(short, ref)) and len(where) == 3
    longest = max(len(tok.encode(d.text)) for d in budget_sweep.corpus.documents("eval"))
    long, where = budget_sweep.context_prompts(tok, 2, longest + 10)
    assert [p.size for p in long] == [longest + 10] * 2 and "concatenated" in where[0]


# k2_budget_picks -----------------------------------------------------------------------------------------------
def _brute_expected(p: float, depth: int, topk: int, budget: int) -> float:
    """1 + the `budget` largest path probabilities, rank r at a depth having p (1 - p)^r (heapq best-first)."""
    probs = [p * (1 - p) ** r for r in range(topk)]
    heap, total = [(-probs[0], 1, (0,))], 1.0
    for _ in range(budget):
        neg, d, path = heapq.heappop(heap)
        total += -neg
        if path[-1] + 1 < topk:  # next sibling
            heapq.heappush(heap, (neg / probs[path[-1]] * probs[path[-1] + 1], d, path[:-1] + (path[-1] + 1,)))
        if d < depth:  # first child
            heapq.heappush(heap, (neg * probs[0], d + 1, path + (0,)))
    return total


def test_k2_budget_picks_synthetic_costs(tmp_path, capsys):
    costs = {"source": "synthetic", "contexts": {"4096": {"1": 1.0, "9": 1.2, "33": 2.0},
                                                 "65536": {"1": 1.0, "9": 20.0, "33": 60.0}}}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs))
    out = tmp_path / "picks.md"
    assert k2_budget_picks.main(["--costs", str(path), "--contexts", "4096,65536", "--geometric", "0.9",
                                 "--acceptance", "", "--drafter-ms", "0.1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_text() + "\n" == printed
    data = json.loads(out.with_suffix(".json").read_text())
    menu = data["meta"]["menu"]
    assert menu == [0, 4, 8, 16, 32, 64]
    # The rule by hand: E(b) by brute force, cost = drafter + c(T = b + 1) interpolated (and extrapolated past 33).
    pts = costs["contexts"]["4096"]
    ts, vals = [1, 9, 33], [pts["1"], pts["9"], pts["33"]]

    def c(t):
        return float(np.interp(t, ts, vals)) if t <= 33 else vals[-1] + (vals[-1] - vals[-2]) / 24 * (t - 33)

    expected = [_brute_expected(0.9, 15, 4, b) for b in menu]
    rates = [e / (0.1 + (c(b + 1) if b else c(1))) for e, b in zip(expected, menu)]
    got = data["picks"]["geometric p=0.9|4096"]
    assert got["expected"] == pytest.approx(expected, rel=1e-4)
    assert got["budget"] == menu[int(np.argmax(rates))] == 16 and got["drafts"]
    assert got["extrapolated"] == [False] * 5 + [True]
    # At 65536 every tree costs far more than its tokens: the gate keeps the steps autoregressive.
    slow = data["picks"]["geometric p=0.9|65536"]
    assert slow["budget"] is None and not slow["drafts"] and slow["speedup_vs_ar"] == pytest.approx(1.0)
    assert "| geometric p=0.9 | 16 ×" in printed and "| AR ×1.00 |" in printed


def test_k2_cost_table_estimates_missing_contexts():
    """A context without its own T = 1 point: the anchor's measured points plus the shift another file measured
    between the two contexts (T = 1's extrapolated linearly in T), the measured drafter part taken out."""
    new = dict(file="new.json", commit="b", date="2026-12-03")
    old = dict(file="old.json", commit="a", date="2026-11-30")
    rows = [dict(context=65536, nodes=t, step_ms=s, engine_step_ms=s - 0.5, drafter_ms=d, **new)
            for t, s, d in ((1, 4.0, 0.1), (9, 8.0, 0.4), (33, 14.0, 0.4))]
    rows += [dict(context=ctx, nodes=t, step_ms=s, engine_step_ms=None, drafter_ms=0.3, **old)
             for ctx, t, s in ((4096, 9, 7.0), (4096, 33, 11.0), (65536, 9, 9.0), (65536, 33, 15.0))]
    table = k2_budget_picks.cost_table(rows, [65536, 4096, 1000000])
    assert table[65536] == {"points": {1: 3.4, 9: 7.1, 33: 13.1}, "estimated": False,
                            "source": "measured: new.json (b); step: engine"}
    est = table[4096]
    assert est["estimated"] and est["anchor"] == 65536
    # shifts: T = 9: -2, T = 33: -4, so T = 1: -2 + (-4 + 2) * (1 - 9) / 24 = -4/3
    assert est["points"] == pytest.approx({1: 3.4 - 4 / 3, 9: 5.1, 33: 9.1})
    assert "missing" in table[1000000]
    assert k2_budget_picks.step_cost({1: 1.0, 9: 2.0, 33: 5.0}, 65) == (pytest.approx(9.0), True)
    assert k2_budget_picks.profile_from_acceptance([0.8, 0.4, 0.0], 4) == pytest.approx([0.8, 0.5, 1e-4, 1e-4])
