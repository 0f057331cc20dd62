"""The benchmark scripts' --smoke modes, in-process: they run on the random tiny pair and write results
that parse, with the expected columns. (Correctness only: nothing here looks at a timing.)

spec_decode runs with --batch 2 so that its greedy autoregressive / chain / DDTree loops have the shapes
tree_shapes uses (all prompts in one batch): the second script then finds them compiled already.
"""

import csv
import json
import os
import sys

import numpy as np
import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import spec_decode  # noqa: E402
import tree_shapes  # noqa: E402
import verify_kernel  # noqa: E402

NO_CACHE = ["--cache-dir", ""]  # no persistent compilation cache from inside the test session


def _one(path, pattern):
    found = sorted(path.glob(pattern))
    assert len(found) == 1, (pattern, [p.name for p in path.iterdir()])
    return found[0]


def test_spec_decode_smoke(tmp_path):
    # One DDTree budget: every decoder kind (autoregressive, chain, DDTree) at both temperatures, 6 decode loops instead
    # of 8 (the sweep over several budgets is tree_shapes' below, whose DDTree 4 loop this run compiles for it).
    # --smoke adds the refill mode (--refill 5 at --batch 2): each decoder right after its static run, on its loop.
    assert spec_decode.main(["--smoke", "--out", str(tmp_path), "--batch", "2", "--profile", "--budgets", "4"]
                            + NO_CACHE) == 0
    data = json.loads(_one(tmp_path, "spec_decode_smoke_*.json").read_text())
    assert _one(tmp_path, "spec_decode_smoke_*.md").read_text().startswith("# Speculative decoding")
    meta = data["meta"]
    rows = [r for r in data["rows"] if r["mode"] == "static"]
    refill = [r for r in data["rows"] if r["mode"] == "refill"]
    for key in ("date", "commit", "device", "backend", "prompts", "max_new_tokens", "batch", "topk", "block_size"):
        assert key in meta
    assert meta["prompts"] == 2 and meta["max_new_tokens"] == 8 and meta["budgets"] == [4]
    assert {(r["decoder"], r["temperature"]) for r in rows} == {
        (d, t) for d in ("autoregressive", "chain", "DDTree 4") for t in (0.0, 0.7)}
    depth = meta["block_size"] - 1
    for r in rows:
        for key in ("tau", "tokens_per_second", "speedup_vs_ar", "acceptance_by_depth", "num_nodes",
                    "target_forwards", "compile_seconds", "decode_seconds", "new_tokens"):
            assert key in r, key
        assert 1.0 <= r["tau"] <= depth + 1
        assert r["new_tokens"] == 2 * 8
        assert len(r["acceptance_by_depth"]) == (0 if r["tree"] == "ar" else depth)
        if r["temperature"] == 0:
            assert r["mismatches_vs_ar"] == 0  # greedy speculative decoding is lossless
    assert [r["num_nodes"] for r in rows if r["temperature"] == 0] == [1, depth + 1, 5]
    # --profile: each decoder's warm-up call split by part; the drafter's share is there except autoregressively.
    assert all(r["step_profile"]["kernels_per_step"] > 0 for r in rows)
    assert all((r["step_profile"]["components_ms"]["drafter"] > 0) == (r["tree"] != "ar") for r in rows)
    assert "Where a step goes" in _one(tmp_path, "spec_decode_smoke_*.md").read_text()
    # Refill: 5 prompts through the 2 rows, every decoder and temperature, nothing compiled after the warm-up, and
    # greedy outputs equal to the autoregressive refill run's (tests/test_chunked_loop.py checks them against each
    # prompt decoded alone).
    assert meta["refill"] == 5 and len(meta["refill_prompt_cuts"]) == 5
    assert [(r["decoder"], r["temperature"]) for r in refill] == [(r["decoder"], r["temperature"]) for r in rows]
    for r in refill:
        assert r["compiles_after_warmup"] == 0 and r["new_tokens"] == 5 * 8 and r["batch"] == 2
        assert 1.0 <= r["tau"] <= depth + 1 and 0 < r["occupancy"] <= 1 and r["tokens_per_second"] > 0
        assert r["target_forwards"] >= 3 * 7  # three waves of 2 rows, 7 steps each (the first token is the prefill's)
        if r["temperature"] == 0:
            assert r["mismatches_vs_ar"] == 0
    assert "## Refill (continuous batching)" in _one(tmp_path, "spec_decode_smoke_*.md").read_text()


def test_spec_decode_smoke_adaptive_budget(tmp_path, monkeypatch):
    """--budgets auto: the adaptive budget next to autoregressive, static and --refill (greedy only, one decode loop
    besides the autoregressive one): its rows carry the steps per budget (every step counted once, with the drafter or
    without), predicted and observed tau, and the cost model, which the static run measures (a fresh cache) and the
    refill run takes from the cache; greedy outputs equal the autoregressive ones."""
    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path / "cache"))  # the cost model: never the user's cache
    assert spec_decode.main(["--smoke", "--out", str(tmp_path), "--batch", "2", "--budgets", "auto",
                             "--temperatures", "0", "--no-chain"] + NO_CACHE) == 0
    data = json.loads(_one(tmp_path, "spec_decode_smoke_*.json").read_text())
    assert data["meta"]["budgets"] == ["auto"]
    rows = [r for r in data["rows"] if r["decoder"] == "DDTree auto"]
    assert [r["mode"] for r in rows] == ["static", "refill"]
    for r in rows:
        p = r["budget_policy"]
        # 1 node: the cached cost model said no budget pays on this CPU, and the call ran the autoregressive program
        assert r["budget"] == "auto" and r["num_nodes"] in (1, max(p["menu"]) + 1) and p["menu"][0] == 0
        assert sum(p["budget_steps"].values()) + p["steps_without_drafter"] == r["target_forwards"]
        assert {"predicted_tau", "observed_tau", "costs_ms", "calibration"} <= set(p)
        drafted = sum(p["budget_steps"].values()) > 0
        assert (p["observed_tau"] is not None) == drafted  # NaN (null) without a drafted step
        assert r["mismatches_vs_ar"] == 0 and 1.0 <= r["tau"]
    assert rows[0]["budget_policy"]["calibrated"] and not rows[1]["budget_policy"]["calibrated"]
    assert rows[0]["budget_policy"]["cost_model"] == rows[1]["budget_policy"]["cost_model"]
    assert rows[0]["budget_policy"]["cost_model"].startswith(str(tmp_path / "cache"))
    assert "Adaptive budget (`auto`)" in _one(tmp_path, "spec_decode_smoke_*.md").read_text()


def test_refill_with_a_max_tokens_per_prompt():
    """run_refill / refill_pass with one max_tokens per prompt (serve_load.py's loop baseline: each request its own):
    each prompt gets exactly its own count, the first tokens of what it gets with the largest count for all (the same
    loop: the pool's room is the largest's), and a prompt bucket first seen after the rows' first fill compiles in the
    warm-up, not in the timed pass."""
    target, drafter, _ = spec_decode.smoke_pair()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, n).tolist() for n in (5, 9, 12, 7, 20, 6)]  # 20: the 32-token bucket, row 4
    counts = [1, 5, 2, 7, 3, 4]
    kwargs = dict(batch=2, tree="ar", budget=0, topk=4, temperature=0.0, top_k=0, top_p=1.0, seed=0, impl="auto",
                  chunk_steps=2)
    stats, each = spec_decode.run_refill(target, drafter, prompts, max_new_tokens=counts, **kwargs)
    _, longest = spec_decode.run_refill(target, drafter, prompts, max_new_tokens=max(counts), **kwargs)
    assert [len(t) for t in each] == counts and stats["new_tokens"] == sum(counts)
    assert each == [t[:n] for t, n in zip(longest, counts)]
    assert stats["compiles_after_warmup"] == 0


def test_verify_kernel_smoke_and_resume(tmp_path):
    """The sweep script end to end on the FFI op (its CPU handler here), then --resume measuring only what is missing."""
    out = str(tmp_path / "vk")
    assert verify_kernel.main(["--smoke", "--out", out]) == 0
    data = json.loads((tmp_path / "vk.json").read_text())
    shapes = [(r["L"], r["T"], r["slots"]) for r in data["rows"]]
    assert shapes == [(1000, 1, "scattered"), (1000, 9, "scattered"), (1000, 1, "contiguous")]
    assert all(r["us"] > 0 and r["main_us"] > 0 and r["wall_us"] > 0 and r["loop_us"] > 0 for r in data["rows"])
    assert all(set(r["variants"]) == {"auto"} and r["variants"]["auto"]["us"] == r["us"] for r in data["rows"])
    assert data["rows"][0]["xla_us"] > 0 and data["rows"][1]["xla_us"] is None
    # The XLA baseline: both formulations timed (device, wall, in-loop), the faster by device time kept.
    base = data["rows"][0]
    assert base["xla_dense_us"] > 0 and base["xla_chunked_us"] > 0 and base["xla_chunk"] == 256
    assert base["xla_us"] == min(base["xla_dense_us"], base["xla_chunked_us"]) == base[f"xla_{base['xla_kind']}_us"]
    assert base["xla_loop_us"] > 0 and base["speedup"] == base["xla_us"] / base["us"]
    assert base["variants"]["auto"]["speedup_loop"] == base["xla_loop_us"] / base["variants"]["auto"]["loop_us"]
    assert data["while_loop"][0]["single_call_us"] > 0
    md = (tmp_path / "vk.md").read_text()
    assert md.count("\n| 1 | 1000 |") == 3 + 1 and "A CPU smoke run" in md  # the rows and the loop figure

    data["rows"] = data["rows"][:2]  # drop the contiguous row: the resumed run measures it and nothing else
    (tmp_path / "vk.json").write_text(json.dumps(data))
    assert verify_kernel.main(["--smoke", "--out", out, "--resume"]) == 0
    resumed = json.loads((tmp_path / "vk.json").read_text())
    assert [(r["L"], r["T"], r["slots"]) for r in resumed["rows"]] == shapes
    assert resumed["rows"][:2] == [dict(r, ceilings=data["ceilings"]) for r in data["rows"]]
    assert "resumed_from" in resumed["meta"] and "Rows measured over several device calls" in (tmp_path / "vk.md").read_text()

    resumed["rows"][0].update(xla_us=None, speedup=None)  # a row whose reference a later call fills in
    (tmp_path / "vk.json").write_text(json.dumps(resumed))
    assert verify_kernel.main(["--smoke", "--out", out, "--resume"]) == 0
    filled = json.loads((tmp_path / "vk.json").read_text())["rows"]
    assert filled[0]["us"] == resumed["rows"][0]["us"] and filled[0]["xla_us"] > 0 and filled[0]["xla_filled_later"]
    def without_ceilings(rs):  # each resumed row is given the ceilings of the run that measured it
        return [{k: v for k, v in r.items() if k != "ceilings"} for r in rs]
    assert without_ceilings(filled[1:]) == without_ceilings(resumed["rows"][1:])

    # Shards over GPUs and calls: --merge joins them, the later kernel rows first, a reference from any file.
    (tmp_path / "later.json").write_text(json.dumps(dict(resumed, rows=[dict(r, us=2 * r["us"]) for r in resumed["rows"]])))
    assert verify_kernel.main(["--merge", out + ".json", str(tmp_path / "later.json"), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert [r["us"] for r in merged] == [2 * r["us"] for r in resumed["rows"]]
    assert merged[0]["xla_us"] == filled[0]["xla_us"] and merged[0]["speedup"] == filled[0]["xla_us"] / merged[0]["us"]
    # The only (B, L) group is shard 0's: shard 1 of 2 measures nothing and still writes its (empty) table (without
    # the while-loop figure, which the first call covered).
    assert verify_kernel.main(["--smoke", "--out", str(tmp_path / "s1"), "--shard", "1/2", "--no-while-loop"]) == 0
    assert json.loads((tmp_path / "s1.json").read_text())["rows"] == []
    # New kernel rows, the reference taken from an earlier result instead of measured again.
    # Two kernel variants, each in its own columns.
    assert verify_kernel.main(["--smoke", "--out", str(tmp_path / "r"), "--refs-from", out + ".json", "--no-while-loop",
                               "--variants", "auto,wide"]) == 0
    reused_rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    reused = reused_rows[0]
    assert reused["xla_us"] == filled[0]["xla_us"] and reused["xla_from"].startswith("unknown")
    assert reused["variants"]["wide"]["us"] > 0 and reused["variants"]["wide"]["speedup"] > 0
    assert "| wide µs | wide loop µs |" in (tmp_path / "r.md").read_text()


def test_tree_shapes_smoke(tmp_path):
    assert tree_shapes.main(["--smoke", "--out", str(tmp_path)] + NO_CACHE) == 0
    data = json.loads(_one(tmp_path, "tree_shapes_smoke_*.json").read_text())
    with open(_one(tmp_path, "tree_shapes_smoke_*.csv"), newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == tree_shapes.CSV_COLUMNS
        table = list(reader)
    for name in ("tau", "tokens_per_second", "acceptance"):
        png = _one(tmp_path, f"tree_shapes_smoke_*_{name}.png")
        assert png.read_bytes()[:4] == b"\x89PNG"
    assert "Independence assumption" in _one(tmp_path, "tree_shapes_smoke_*.md").read_text()

    kinds = [r["kind"] for r in table]
    assert kinds[:2] == ["autoregressive", "chain"] and kinds.count("ddtree") == 2 and "static" in kinds
    assert len(table) == len(data["rows"])
    for r in table:
        assert 1.0 <= float(r["tau"]) <= 4.0
        assert float(r["tokens_per_second"]) > 0
    assert {r["shape"] for r in table if r["kind"] == "static"} >= {"(2,1,1)"}
    depth = data["meta"]["block_size"] - 1
    p = np.asarray(data["measurement"]["p"])
    assert p.shape == (depth, data["measurement"]["kmax"])
    assert np.all(p >= 0) and np.all(p.sum(1) <= 1 + 1e-6)
    assert [d["budget"] for d in data["dp"]] == [4, 8]
    for d in data["dp"]:
        assert tree_shapes.shape_nodes(d["shape"]) <= d["budget"]
        assert set(d["ddtree"]) == {"4"}
        assert d["predicted_tau_replay"] >= 1.0


def test_decode_context_smoke(tmp_path, monkeypatch):  # 17-28 s on 2 busy cores
    import decode_context

    import kdtree_jax.ops

    # The XLA attention is the fair baseline (kdtree_jax/ops/xla.py, bf16 inputs, float32 accumulation) in both its
    # forms, never the float32 oracle: tracing the oracle anywhere in the run fails it, and each form must be traced.
    def oracle(*args, **kwargs):
        raise AssertionError("decode_context traced the float32 oracle (ops/reference.py) as its XLA attention")

    chunks = []

    def xla(*args, chunk=None, **kwargs):
        chunks.append(chunk)
        return baseline(*args, chunk=chunk, **kwargs)

    baseline = kdtree_jax.ops.verify_attention_xla
    monkeypatch.setattr(kdtree_jax.ops, "verify_attention_reference", oracle)
    monkeypatch.setattr(kdtree_jax.ops, "verify_attention_xla", xla)
    decode_context.main(["--smoke", "--steps", "2", "--nodes", "9", "--impls", "xla", "--profile", "all",
                         "--out", str(tmp_path / "dc")])
    assert set(chunks) == {None, decode_context.XLA_CHUNK}, chunks  # the dense and the chunked form
    data = json.loads((tmp_path / "dc.json").read_text())
    assert data["rows"] and all("errors" not in r for r in data["rows"])
    assert [r["impl"] for r in data["rows"]] == ["xla", "xla_chunked"]
    assert data["meta"]["xla_chunk"] == decode_context.XLA_CHUNK and "float32 accumulation" in data["meta"]["xla_baseline"]
    assert f"| XLA chunked ({decode_context.XLA_CHUNK}) *" in (tmp_path / "dc.md").read_text()
    row = data["rows"][0]
    assert {"step_ms", "attention_ms", "moe_ms", "drafter_ms", "head_ms", "tree_accept_commit_ms", "tau",
            "step_over_floor", "projected_61_layer_step_ms"} <= set(row)
    # One TP rank: the vocab-parallel head slice and the drafter's heads split like the target's.
    rank = data["meta"]["rank_model"]
    assert rank["drafter_rank"]["num_heads"] * rank["tp"] == rank["drafter_full"]["num_heads"]
    assert set(row["floors"]) == {"attention_ms", "moe_ms", "drafter_ms", "head_ms", "dense_ms"}
    assert row["dense_ms"] > 0 and "unaccounted_ms" in row
    # The parts come from a profile of the step (its kernels by named scope); the loops' figures are kept.
    assert row["profile"]["kernels_per_step"] > 0 and row["attention_ms"] == row["profile"]["components_ms"]["attention"]
    assert row["attention_ms"] > 0 and row["moe_ms"] > 0 and set(row["alone_ms"]) >= {"attention_ms", "moe_ms"}
    assert "idle_ms" in row and "other_kernels_ms" in row
    # The engine's chunked loop over the state's room (4 chunks of 2 steps, tau 1 with random weights).
    assert row["engine_chunks"]["steps"] == 8 and row["engine_step_ms"] > 0 and "engine_idle_ms" in row
    assert "call_ms" in row and "engine step (chunks)" in (tmp_path / "dc.md").read_text()
    # The profile is of one step (a run with one step left: a captured loop's replay shows one iteration's kernels),
    # the timing of all of them; the idle gaps are listed by the kernels around them.
    assert row["profile"]["steps"] == 1 and row["steps"] == 2
    assert "idle_gaps" in row["profile"] and "Largest idle gaps" in (tmp_path / "dc.md").read_text()
    assert row["profile"]["top_kernels"]["attention"][0][1] > 0  # [family, ms, launches] per step
    assert "Largest kernels" in (tmp_path / "dc.md").read_text()
    # The MoE floor counts the experts the timed step activated, and the MoE component ran on inputs
    # calibrated to reach about as many.
    assert row["moe_distinct_experts_per_layer"] == row["moe_distinct_in_step"] > 0
    calibrated = data["meta"]["moe_inputs"]["9"]
    assert 1 <= calibrated["distinct_rows"] <= 9 and calibrated["steps_distinct_experts"] == row["moe_distinct_in_step"]
    assert (tmp_path / "dc.md").exists()
    # --render recomputes the derived figures from the JSON alone (no device work) and keeps reading notes.
    data["meta"]["notes"] = ["a note"]
    # A kernel row beside them: it is compared with the faster XLA step, named by its form.
    faster = min(data["rows"], key=lambda r: r["step_ms"])
    data["rows"].append(dict(row, impl="auto", step_ms=faster["step_ms"] / 2))
    (tmp_path / "dc.json").write_text(json.dumps(data))
    decode_context.main(["--render", str(tmp_path / "dc")])
    assert json.loads((tmp_path / "dc.json").read_text())["rows"][0]["step_over_floor"] == row["step_over_floor"]
    md = (tmp_path / "dc.md").read_text()
    assert "a note" in md and "Kernel vs the fair XLA baseline attention" in md and "oracle as attention" not in md
    label = decode_context.impl_label(faster["impl"], data["meta"])
    assert f"| {faster['step_ms']:.3f} | {label} | 2.00 |" in md
    # The oracle is refused as a baseline (before any device work).
    with pytest.raises(SystemExit):
        decode_context.main(["--smoke", "--impls", "auto,reference", "--out", str(tmp_path / "no")])


def test_decode_context_random_target_is_the_models_layout():
    """random_target (one jitted init per kind of layer) gives Transformer's parameters: same tree, shapes and
    dtypes, the initializers' spread, and every layer its own values."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import decode_context

    cfg, _, _, _ = decode_context.rank_configs(True, 3)
    model = decode_context.random_target(cfg, jnp.bfloat16, seed=0)
    reference = nnx.eval_shape(lambda: decode_context.Transformer(cfg, jnp.bfloat16, rngs=nnx.Rngs(0)))
    shapes = lambda m: jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(m))  # noqa: E731
    assert shapes(model) == shapes(reference)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(model)))
    kernels = [np.asarray(layer.self_attn.kv_a_proj_with_mqa.kernel[...], np.float32) for layer in model.layers]
    assert not np.array_equal(kernels[1], kernels[2])
    assert abs(kernels[1].std() * np.sqrt(cfg.hidden_size) - 1) < 0.1  # normal(1 / sqrt(fan_in))


def test_decode_context_tree_only_smoke(tmp_path):
    import decode_context

    decode_context.main(["--tree-only", "--smoke", "--nodes", "9", "--out", str(tmp_path / "tree")])
    row = json.loads((tmp_path / "tree.json").read_text())["rows"][0]
    assert {"tree_static_us", "tree_levels_us", "accept_closed_form_random_us", "accept_walk_random_us"} <= set(row)


def test_decode_context_layers_that_fit(monkeypatch):
    """--layers fit: n layers fit and n + 1 do not, counting the model's whole weights (abstract shapes), every
    context's pool and the timed run's copy of the largest pool per layer, in the device's limit less the
    reserve (a fake device reports the limit)."""
    import types

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import decode_context

    cfg, dcfg, _, _ = decode_context.rank_configs(False, 2)
    max_len_of = {65536: 66048, 200000: 200512}.get
    kv_per_layer = (66048 + 200512 + 200512) * cfg.cache_dim * 2

    def need(layers):  # bytes of a `layers`-deep model and its pools
        model = nnx.eval_shape(lambda: decode_context.Transformer(cfg.replace(num_hidden_layers=layers), jnp.bfloat16,
                                                                  rngs=nnx.Rngs(0)))
        weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model)))
        return weights + layers * kv_per_layer

    reserve = 16 << 30
    limit = 128 << 30
    device = types.SimpleNamespace(memory_stats=lambda: {"bytes_limit": limit})
    monkeypatch.setattr(decode_context.jax, "devices", lambda *a: [device])
    n = decode_context.layers_that_fit(cfg, dcfg, [65536, 200000], max_len_of, reserve_gb=16)
    assert need(n) <= limit - reserve < need(n + 1)
    device.memory_stats = lambda: {}
    with pytest.raises(SystemExit):
        decode_context.layers_that_fit(cfg, dcfg, [65536], max_len_of, reserve_gb=16)


def test_tree_temperature_smoke(tmp_path):
    """Both sampling temperatures, one tree temperature (every (sampling, tree) temperature pair is a decode loop of
    its own: the smoke's second tree temperature cost two compiles, ~11 s); --temperatures overrides the smoke's."""
    import tree_temperature

    tree_temperature.main(["--smoke", "--sampling-temperatures", "0,0.7", "--temperatures", "0.5",
                           "--out", str(tmp_path / "tt")])
    data = json.loads((tmp_path / "tt.json").read_text())
    assert data["chain_tau"] >= 1.0 and data["prompt_seed"] == 7
    assert data["prompts"] == 2 and data["max_new_tokens"] == 8  # the smoke's settings that were not given
    assert [(r["sampling_temperature"], r["budget"], r["tree_temperature"]) for r in data["rows"]] == [
        (0.0, 4, 0.5), (0.7, 4, 0.5)]
    assert set(data["chain_tau_by_sampling_temperature"]) == {"0.0", "0.7"} and set(data["best"]) == {"greedy", "T=0.7"}
    assert all(r["tau"] >= 1.0 for r in data["rows"]) and (tmp_path / "tt.md").exists()


@pytest.mark.slow
def test_multi_gpu_smoke(tmp_path):
    """The script end to end on the 8 forced CPU devices. The correctness check covers both layouts (its programs are
    tests/test_sharding.py's); the timed part runs one layout, ep (the tp layout's timing is the same code on another
    sharding, and each layout costs ~15 s of compiles here: its random model's init and its step loops)."""
    import multi_gpu

    multi_gpu.main(["--smoke", "--layers", "2", "--iters", "1", "--contexts", "64", "--nodes", "9", "--layouts", "ep",
                    "--out", str(tmp_path)])
    data = json.loads((tmp_path / "multi_gpu_smoke.json").read_text())
    assert data["rows"] and {"layout", "context", "nodes", "step_ms"} <= set(data["rows"][0])
    assert [r["layout"] for r in data["rows"]] == ["ep"]
    assert set(data["correctness"]) == {"tp", "ep"}
    assert all(v["greedy_speculative_equal"] for v in data["correctness"].values())
