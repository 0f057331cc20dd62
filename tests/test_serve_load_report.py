"""benchmarks/serve_load.py's bookkeeping, without a model: the seeded request lists (the leak check's disconnects
do not change the prompts), issue 27's targets read off the rows, the report of a full and of a cut-short run, and
the load client split over processes (against the real app over a stand-in decode thread)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _serve_load():
    spec = importlib.util.spec_from_file_location("serve_load", os.path.join(ROOT, "benchmarks", "serve_load.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(mode, c, tok_s, tpot, compiles=0):
    return {"mode": mode, "concurrency": c, "requests": 8, "errors": 0, "wall_s": 1.0, "tokens": 100,
            "tokens_per_s": tok_s, "requests_per_s": 8.0, "ttft_p50_ms": 10, "ttft_p90_ms": 20, "ttft_p99_ms": 30,
            "tpot_p50_ms": tpot, "tpot_p90_ms": tpot * 2, "tpot_p99_ms": tpot * 3, "latency_p50_s": 0.5,
            "mean_occupancy": 0.5, "tau": 3.0, "compiles_during": compiles, "texts": ["a"] * 8}


def _data(rows_spec, rows_ar, leak=True):
    meta = {"date": "2026-12-01", "device": "NVIDIA H200", "commit": "abc1234", "command": "x", "requests": 8,
            "concurrency": [1, 16], "prompt_len": (8, 64), "max_new_tokens": (16, 96), "max_batch": 16, "max_len": 256,
            "dtype": "bfloat16", "cpu_count": 16, "loadavg_before": 0.1, "loadavg_after": 0.2, "leak_requests": 100,
            "disconnect_fraction": 0.1}
    modes = [{"mode": "speculative", "startup_s": 30.0, "rows": rows_spec, "compiles_after_warmup": 0,
              "server_exit": 0},
             {"mode": "autoregressive", "startup_s": 20.0, "rows": rows_ar, "compiles_after_warmup": 0,
              "server_exit": 0}]
    if leak:
        for m in modes:
            m["leak"] = {"mode": m["mode"], "concurrency": 32, "requests": 100, "sent": 100, "wall_s": 3.0,
                         "disconnected": 10, "completed": 90, "errors": 0, "server_cancelled": 9,
                         "pool_slots": 4096, "pool_slots_free_before": 4096, "pool_slots_free_after": 4096,
                         "leaked_slots": 0, "busy_rows_after": 0, "queue_after": 0, "compiles_during": 0}
    return {"meta": meta, "modes": modes, "notes": [], "compared_outputs": 16, "identical_outputs": 16}


def test_request_lists_are_seeded_and_disconnects_leave_the_prompts_alone():
    sl = _serve_load()
    docs = [np.arange(i, i + 300, dtype=np.int32) for i in range(5)]
    plain = sl.make_requests(200, (8, 64), (16, 96), 3, docs)
    dropping = sl.make_requests(200, (8, 64), (16, 96), 3, docs, disconnect_fraction=0.1)
    assert plain == sl.make_requests(200, (8, 64), (16, 96), 3, docs)
    assert [{k: r[k] for k in ("prompt", "max_tokens")} for r in dropping] == plain
    drops = [r["disconnect_after"] for r in dropping if "disconnect_after" in r]
    assert 8 <= len(drops) <= 35 and set(drops) <= {1, 2, 3}
    assert all(8 <= len(r["prompt"]) <= 64 and 16 <= r["max_tokens"] <= 96 for r in plain)


def test_targets_and_report(tmp_path):
    sl = _serve_load()
    data = _data([_row("speculative", 1, 300, 2.0), _row("speculative", 16, 3000, 3.0)],
                 [_row("autoregressive", 1, 250, 2.5), _row("autoregressive", 16, 1800, 3.5)])
    data["targets"] = t = sl.targets(data, 16)
    assert abs(t["throughput_ratio"] - 3000 / 1800) < 1e-9 and t["throughput_met"]
    assert t["compiles_after_warmup"] == {"speculative": 0, "autoregressive": 0}
    assert t["leaked_slots"] == {"speculative": 0, "autoregressive": 0}
    data["modes"][0]["rows"][1]["tpot_p50_ms"] = 4.0  # faster, but slower per token: not met
    assert not sl.targets(data, 16)["throughput_met"]
    sl.write_markdown(str(tmp_path / "r.md"), data)
    text = (tmp_path / "r.md").read_text()
    assert "Targets (issue 27; concurrency 16)" in text and "1.67x (target >= 1.5x)" in text
    assert "| speculative | 32 | 100 of 100 | 10 | 9 | 0 | 4096 -> 4096 (4096) | 0 | 0 | 0 | 3.0 |" in text
    assert "![throughput and latency](r.png)" in text
    assert "client's ceiling" not in text  # not measured: nothing said
    data["client_ceiling"] = {"concurrency": 16, "tokens_per_s": 25000.0, "wall_s": 1.0, "errors": 0, "rows": 16,
                              "stand_in_tokens_per_s": 96000.0}
    sl.write_markdown(str(tmp_path / "r.md"), data)
    assert "The client's ceiling: 25000 tok/s" in (tmp_path / "r.md").read_text()
    data["client_ceiling"] = {"error": "the stand-in server did not start"}
    sl.write_markdown(str(tmp_path / "r.md"), data)
    assert "not measured (the stand-in server did not start)" in (tmp_path / "r.md").read_text()


def test_report_of_a_run_cut_short_before_any_level(tmp_path):
    sl = _serve_load()
    data = _data([], [], leak=False)
    data["modes"][0].update(startup_s=float("nan"), compiles_after_warmup=None, server_exit=-6)
    data["notes"] = ["Interrupted (signal 15): the rows above are what was measured before it."]
    data["targets"] = sl.targets(data, 16)
    assert "throughput_ratio" not in data["targets"]
    sl.write_markdown(str(tmp_path / "r.md"), data)
    text = (tmp_path / "r.md").read_text()
    assert "not measured at concurrency 16" in text and "speculative unknown" in text
    assert "Server exit codes (0: stopped cleanly): speculative -6, autoregressive 0." in text
    assert "Interrupted (signal 15)" in text and ".png" not in text


def test_a_levels_adaptive_budget_from_two_scrapes(tmp_path):
    """--budget auto: each level's steps per budget and predicted vs observed tau are the difference of two /metrics
    scrapes (the tau gauges are since start: tau x drafted sequence steps); a fixed budget's scrapes have none."""
    sl = _serve_load()
    before = {'budget_steps_total{budget="0"}': 1, 'budget_steps_total{budget="16"}': 4,
              "steps_without_drafter_total": 10, "drafted_sequence_steps_total": 20, "predicted_tau": 3.0,
              "observed_tau": 2.5}
    after = {'budget_steps_total{budget="0"}': 2, 'budget_steps_total{budget="16"}': 10,
             "steps_without_drafter_total": 13, "drafted_sequence_steps_total": 60, "predicted_tau": 3.5,
             "observed_tau": 3.0}
    policy = sl.budget_policy_delta(before, after)
    assert policy["budget_steps"] == {"0": 1, "16": 6} and policy["steps_without_drafter"] == 3
    assert abs(policy["predicted_tau"] - (3.5 * 60 - 3.0 * 20) / 40) < 1e-9
    assert abs(policy["observed_tau"] - (3.0 * 60 - 2.5 * 20) / 40) < 1e-9
    assert sl.budget_policy_delta({"tau": 1.0}, {"tau": 1.0}) == {}
    assert sl.build_parser().parse_args(["--budget", "auto"]).budget == "auto"
    assert sl.build_parser().parse_args(["--budget", "8"]).budget == 8
    data = _data([dict(_row("speculative", 1, 300, 2.0), budget_policy=policy)], [_row("autoregressive", 1, 250, 2.5)])
    data["targets"] = sl.targets(data, 1)
    sl.write_markdown(str(tmp_path / "r.md"), data)
    assert "- speculative, concurrency 1: {0: 1, 16: 6}, 3 without the drafter, tau predicted 3.75 observed 3.25" in (
        tmp_path / "r.md").read_text()


def test_loop_baseline_targets_and_report(tmp_path):
    """Issue 45 item 3 from the loop baseline's results: each mode's server / loop throughput by level (the target
    from --target-concurrency up), the server's concurrency-1 requests against generate alone on the same requests,
    and TTFT p50 in the loop's chunks; the report's section, and no section without a baseline."""
    sl = _serve_load()
    data = _data([_row("speculative", 1, 300, 2.0), _row("speculative", 16, 3000, 3.0)],
                 [_row("autoregressive", 1, 250, 2.5), _row("autoregressive", 16, 1800, 3.5)])
    data["meta"]["target_concurrency"] = 16
    for mode in data["modes"]:  # concurrency 1: 8 requests, 12 tokens in 0.1 s each: 120 tok/s on the first 2
        mode["rows"][0].update(completion_tokens=[12] * 8, latencies_s=[0.1] * 8)
    stream = {"requests": 2, "tokens": 24, "wall_s": 0.15, "tokens_per_s": 160.0, "compiles": 0,
              "calls": [{"tokens": 12, "wall_s": 0.075, "compiles": 0, "decoding": "speculative"}] * 2}
    data["loop"] = {"wall_s": 50.0, "chunk_steps": 4, "stream_requests": 2, "exit": 0,
                    "refill": {"speculative": {"program": "adaptive", "tokens": 100, "tokens_per_s": 3200.0,
                                               "chunk_ms": 40.0, "compiles": 0},
                               "autoregressive": {"program": "autoregressive", "tokens": 100, "tokens_per_s": 2400.0,
                                                  "chunk_ms": 20.0, "compiles": 0}},
                    "stream": {"speculative": stream}}
    data["targets"] = sl.targets(data, 16)
    data["loop_targets"] = t = sl.loop_comparison(data, 16)
    spec, ar = t["speculative"], t["autoregressive"]
    assert [(x["concurrency"], x["met"]) for x in spec["throughput"]] == [(1, None), (16, True)]
    assert abs(spec["throughput"][1]["ratio"] - 3000 / 3200) < 1e-9 and not ar["throughput"][1]["met"]  # 0.75
    assert abs(spec["single_stream"]["ratio"] - 0.75) < 1e-9 and not spec["single_stream"]["met"]
    assert "single_stream" not in ar  # generate alone was not measured for it
    assert spec["ttft_chunks"]["chunks"] == 0.25 and ar["ttft_chunks"]["met"]  # 10 ms: 0.25 and 0.5 chunks
    sl.write_markdown(str(tmp_path / "r.md"), data)
    text = (tmp_path / "r.md").read_text()
    assert "| speculative | adaptive | 3200.0 | 100 | 40.0 | 0 | 16 | 3000.0 | 100 | 0.94 | met |" in text
    assert "| autoregressive | autoregressive | 2400.0 | 100 | 20.0 | 0 | 16 | 1800.0 | 100 | 0.75 | not met |" in text
    assert "| speculative | adaptive | 3200.0 | 100 | 40.0 | 0 | 1 | 300.0 | 100 | 0.09 | - |" in text
    assert "| speculative | 2 | 160.0 | speculative | 0 | 120.0 | 0.75 | not met |" in text
    assert "| autoregressive | not measured |" in text
    assert "- speculative: 10 ms = 0.25 chunks of 40.0 ms: met." in text
    del data["loop"], data["loop_targets"]
    sl.write_markdown(str(tmp_path / "r.md"), data)
    assert "engine's own loop" not in (tmp_path / "r.md").read_text()


def test_serve_host_report_of_runs(tmp_path):
    """benchmarks/serve_host.py --report: one table row per run, ratios against the same run's CLI and loop, TTFT in
    the loop's chunks, and each run's largest decode-thread spans."""
    spec = importlib.util.spec_from_file_location("serve_host", os.path.join(ROOT, "benchmarks", "serve_host.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def run(label, stream, conc):
        meta = {"date": "2026-12-04 22:00 UTC", "device": "cpu", "commit": "abc1234", "command": "x", "label": label,
                "max_batch": 16, "max_len": 1024, "chunk_steps": 4, "requests": 48, "concurrency": 16,
                "stream_tokens": 600, "loadavg_before": 2.0, "loadavg_after": 2.5}
        spans = {"collect.read": [0.8, 150], "launch": [0.1, 150], "idle": [0.001, 150]}
        return {"meta": meta, "stream_cli": {"tokens_per_s": 700.0}, "stream_generate": {"tokens_per_s": 650.0},
                "stream_scheduler": {"tokens_per_s": stream, "wall_s": 1.0, "spans": spans},
                "concurrent_scheduler": {"tokens_per_s": conc, "ttft_p50_ms": 68.0, "wall_s": 2.0, "spans": spans,
                                         "compiles": 0},
                "concurrent_loop": {"tokens_per_s": 1400.0, "chunk_ms": 34.0}, "concurrent_identical": 48,
                "http": {"stream": {"tokens_per_s": stream * 0.9, "wall_s": 1.1, "spans": spans},
                         "concurrent": {"tokens_per_s": conc * 0.9, "ttft_p50_ms": 80.0, "wall_s": 2.2,
                                        "spans": spans, "compiles": 0}}}

    out = tmp_path / "r.md"
    after = run("after", 700.0, 1400.0)
    # --engine-process: the same server with its decode loop in a process of its own, a table of its own.
    after["http_engine"] = {"stream": {"tokens_per_s": 560.0, "wall_s": 1.2, "spans": {}},
                            "concurrent": {"tokens_per_s": 1050.0, "ttft_p50_ms": 102.0, "wall_s": 2.3,
                                           "spans": {}, "compiles": 0}}
    module.write_report(str(out), [run("before", 70.0, 700.0), after], "t")
    text = out.read_text()
    assert "| before | 700 | 70 (0.10) | 63 (0.09) | 1400 | 700 (0.50) | 630 (0.45) | 34.0 | 68 (2.0) | 80 (2.4) |" \
        in text
    assert "| after | 700 | 700 (1.00) |" in text
    assert "- after, single stream, in-process (wall 1.00 s): collect.read 0.800 s / 150 (80%), launch" in text
    assert "| after | 560 (0.80) | 1050 (0.75) | 102 (3.0) | 0 |" in text
    assert text.count("with --engine-process") == 1  # one table, the before run (no engine process) not in it


def test_the_load_client_in_several_processes_keeps_every_request_in_order():
    """drive() over 3 client processes gets each request's answer back at its index, as one process does."""
    import socket
    import sys
    import threading

    import uvicorn

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import serve_load

    from kdtree_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(os.path.join(ROOT, "checkpoints", "default", "tokenizer"))
    pattern = tokenizer.encode(serve_load.STAND_IN_TEXT)
    # 3 tokens a row every 2 ms: a request of 4-14 tokens lives over several chunks
    app = serve_load.stand_in_app(tokenizer, 4, 0.002, 3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        import time

        import httpx
        for _ in range(200):
            try:
                httpx.get(url + "/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        rng = np.random.default_rng()
        requests = [{"prompt": [5] * 4, "max_tokens": int(n)} for n in rng.permutation(np.arange(4, 15))]
        for processes in (1, 3):
            results, wall, _ = serve_load.drive(url, requests, 6, "stand-in", 60.0, processes=processes)
            assert [r.get("tokens") for r in results] == [r["max_tokens"] for r in requests], results
            assert [tokenizer.decode([pattern[i % len(pattern)] for i in range(r["max_tokens"])]) == res["text"]
                    for r, res in zip(requests, results)] == [True] * len(requests)
            assert 0 < wall < 30
    finally:
        server.should_exit = True
