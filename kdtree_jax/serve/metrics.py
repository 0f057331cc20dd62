"""The server's counters and gauges, rendered as Prometheus text at /metrics.

Written by hand (a dozen lines of the text format) rather than with prometheus_client: one dependency fewer, and
every number here is set by the one scheduler thread or the request handlers under one lock."""

from __future__ import annotations

import threading

import numpy as np

# name -> (type, help). The order here is the order on the page.
_DOC = {
    "requests_total": ("counter", "Completion requests by outcome: ok (length or stop), cancelled (client gone), "
                                  "error (the decode failed), rejected (400/404/429/503 before decoding)"),
    "prompt_tokens_total": ("counter", "Prompt tokens of admitted requests"),
    "generated_tokens_total": ("counter", "Tokens generated and handed to requests"),
    "decode_steps_total": ("counter", "Sequence steps of the decode loop (one verify pass for one row)"),
    "tau": ("gauge", "Mean tokens a sequence step emits (accepted drafted tokens + 1; autoregressive: 1), since start"),
    "time_to_first_token_seconds": ("summary", "From submit to the first token (queue wait + prefill)"),
    "batch_rows": ("gauge", "Batch rows of the live buckets (max_batch per bucket)"),
    "batch_rows_busy": ("gauge", "Batch rows holding a request"),
    "batch_occupancy": ("gauge", "batch_rows_busy / batch_rows"),
    "pool_slots": ("gauge", "KV pool slots (positions) of the live buckets"),
    "pool_slots_free": ("gauge", "KV pool slots free"),
    "pool_usage": ("gauge", "1 - pool_slots_free / pool_slots"),
    "queue_length": ("gauge", "Requests waiting for a batch row"),
    "buckets": ("gauge", "Live buckets (one: the batch, for any sampling settings; 0 before the first request)"),
    "compiles_total": ("counter", "XLA compiles in this process (constant under a steady load)"),
    "decode_thread_seconds_total": ("counter", "The decode thread's time by phase (scheduler.HostSpans; a phase that "
                                               "reads the device includes the wait for it)"),
    "decode_thread_calls_total": ("counter", "The decode thread's spans by phase"),
}
# The adaptive tree budget's (--budget auto): on the page only when the server runs it. A batch step is one step of
# one bucket's whole batch (the policy chooses once per chunk for every row); a sequence step one row's share of it.
_ADAPTIVE_DOC = {
    "budget_steps_total": ("counter", "Batch steps that verified each DDTree budget of the adaptive menu, by budget "
                                      "(a budget 0 entry runs as autoregressive steps, counted apart)"),
    "steps_without_drafter_total": ("counter", "Batch steps the adaptive policy ran autoregressively, without the "
                                               "drafter"),
    "drafted_sequence_steps_total": ("counter", "Sequence steps of the batch steps that ran the drafter"),
    "predicted_tau": ("gauge", "Tokens per sequence step the adaptive policy predicted for the budgets it chose, over "
                               "the steps that ran the drafter, since start (0 before the first)"),
    "observed_tau": ("gauge", "Tokens per sequence step those steps emitted (accepted drafted tokens + 1), since start "
                              "(0 before the first)"),
}
PREFIX = "kdtree_serve_"


def _finite(obj):
    """NaN and infinities -> None, recursively (JSON answers are strict)."""
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.counts = {"requests_ok": 0, "requests_cancelled": 0, "requests_error": 0, "requests_rejected": 0,
                       "prompt_tokens": 0, "generated_tokens": 0}
        self.hist = np.zeros(0, np.int64)  # sequence steps that emitted d + 1 tokens, summed over buckets
        self.ttft_sum, self.ttft_count = 0.0, 0
        self.pools: dict = {}  # bucket key -> (free, total)
        self.gauges = {"queue_length": 0, "busy_rows": 0, "rows": 0, "buckets": 0, "compiles": 0}
        # The adaptive budget (set_menu; None: a fixed budget, no such metrics): steps per menu entry, then without
        # the drafter; predicted tokens, observed tokens and sequence steps of the drafted steps; per bucket, the
        # policy's last summary (budget_policy.summary) and its cost model's provenance.
        self.menu: "tuple | None" = None
        self.budget_steps = np.zeros(0, np.int64)
        self.policy_sums = np.zeros(3, np.float64)
        self.policies: dict = {}
        self.cost_infos: dict = {}
        self.spans = None  # the scheduler's HostSpans (read, never written, here)

    def set_menu(self, menu) -> None:
        with self._lock:
            self.menu = tuple(int(b) for b in menu)
            self.budget_steps = np.zeros(len(self.menu) + 1, np.int64)

    def add_policy(self, key, menu, chosen_delta, sums_delta, summary: dict) -> None:
        """One chunk of a bucket's adaptive budget: the steps per menu entry (then without the drafter) and the
        (predicted tokens, observed tokens, sequence steps) of drafted steps since its last chunk; its summary."""
        with self._lock:
            if self.menu is None or tuple(menu) != self.menu:
                self.menu = tuple(int(b) for b in menu)
                self.budget_steps = np.zeros(len(self.menu) + 1, np.int64)
            self.budget_steps += np.asarray(chosen_delta, np.int64)
            self.policy_sums += np.asarray(sums_delta, np.float64)
            self.policies[key] = summary

    def set_cost_info(self, key, info: dict) -> None:
        with self._lock:
            self.cost_infos[key] = dict(info)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def add_steps(self, hist_delta) -> None:
        with self._lock:
            if self.hist.size < len(hist_delta):
                self.hist = np.pad(self.hist, (0, len(hist_delta) - self.hist.size))
            self.hist[:len(hist_delta)] += hist_delta

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft_sum += seconds
            self.ttft_count += 1

    def set_pool(self, key, free: int, total: int) -> None:
        with self._lock:
            self.pools[key] = (free, total)

    def drop_pool(self, key) -> None:
        with self._lock:
            self.pools.pop(key, None)

    def set_gauges(self, **values) -> None:
        with self._lock:
            self.gauges.update(values)

    def reset_counts(self) -> None:
        """Forget the warm-up request (compiles are not reset: they are the process's)."""
        with self._lock:
            for k in self.counts:
                self.counts[k] = 0
            self.hist[:] = 0
            self.ttft_sum, self.ttft_count = 0.0, 0
            self.budget_steps[:] = 0
            self.policy_sums[:] = 0

    def snapshot(self) -> dict:
        """Every value by its metric name (without the prefix); the tests and the load benchmark read this too."""
        with self._lock:
            steps = int(self.hist.sum())
            tokens = int((self.hist * (np.arange(self.hist.size) + 1)).sum())
            free = sum(f for f, _ in self.pools.values())
            slots = sum(t for _, t in self.pools.values())
            g = self.gauges
            adaptive = {}
            if self.menu is not None:
                predicted, observed, seq_steps = self.policy_sums.tolist()
                adaptive = {
                    "budget_steps_total": {str(b): int(n) for b, n in zip(self.menu, self.budget_steps[:-1])},
                    "steps_without_drafter_total": int(self.budget_steps[-1]),
                    "drafted_sequence_steps_total": int(round(seq_steps)),
                    "predicted_tau": predicted / seq_steps if seq_steps else 0.0,
                    "observed_tau": observed / seq_steps if seq_steps else 0.0,
                }
            return {
                "requests_total": {k[len("requests_"):]: v for k, v in self.counts.items() if k.startswith("requests_")},
                "prompt_tokens_total": self.counts["prompt_tokens"],
                "generated_tokens_total": self.counts["generated_tokens"],
                "decode_steps_total": steps,
                "tau": tokens / steps if steps else 0.0,
                "time_to_first_token_seconds": (self.ttft_sum, self.ttft_count),
                "batch_rows": g["rows"],
                "batch_rows_busy": g["busy_rows"],
                "batch_occupancy": g["busy_rows"] / g["rows"] if g["rows"] else 0.0,
                "pool_slots": slots,
                "pool_slots_free": free,
                "pool_usage": 1 - free / slots if slots else 0.0,
                "queue_length": g["queue_length"],
                "buckets": g["buckets"],
                "compiles_total": g["compiles"],
                **self._spans(),
                **adaptive,
            }

    def _spans(self) -> dict:
        if self.spans is None:
            return {}
        snap = self.spans.snapshot()
        return {"decode_thread_seconds_total": {k: v[0] for k, v in snap.items()},
                "decode_thread_calls_total": {k: v[1] for k, v in snap.items()}}

    def budget_policy(self) -> "dict | None":
        """The adaptive budget as JSON (for /health; None with a fixed budget): the totals /metrics shows, and per
        bucket (the batch) its cost model (cached or measured, the step costs) and its calibration bins."""
        snap = self.snapshot()
        if "budget_steps_total" not in snap:
            return None
        with self._lock:
            buckets = {}
            for key in {**self.cost_infos, **self.policies}:
                summary = self.policies.get(key, {})
                buckets[key] = {**self.cost_infos.get(key, {}),
                                 **{k: summary[k] for k in ("costs_ms", "calibration") if k in summary}}
            menu = list(self.menu)
        return _finite({"menu": menu, "budget_steps": snap["budget_steps_total"],
                        "steps_without_drafter": snap["steps_without_drafter_total"],
                        "drafted_sequence_steps": snap["drafted_sequence_steps_total"],
                        "predicted_tau": snap["predicted_tau"], "observed_tau": snap["observed_tau"],
                        "buckets": buckets})

    def render(self) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        snap = self.snapshot()
        lines = []
        for name, (kind, help_text) in {**_DOC, **_ADAPTIVE_DOC}.items():
            if name not in snap:  # the adaptive budget's, with a fixed budget
                continue
            full = PREFIX + name
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
            value = snap[name]
            if name == "requests_total":
                lines += [f'{full}{{outcome="{k}"}} {v}' for k, v in value.items()]
            elif name == "budget_steps_total":
                lines += [f'{full}{{budget="{k}"}} {v}' for k, v in value.items()]
            elif name.startswith("decode_thread_"):
                lines += [f'{full}{{phase="{k}"}} {v:.6g}' for k, v in sorted(value.items())]
            elif kind == "summary":
                lines += [f"{full}_sum {value[0]:.6f}", f"{full}_count {value[1]}"]
            else:
                lines.append(f"{full} {value:.6g}" if isinstance(value, float) else f"{full} {value}")
        return "\n".join(lines) + "\n"


def parse(text: str) -> dict:
    """Prometheus text back into {name (without the prefix, labels kept): float}: for tests and the benchmark."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name[len(PREFIX):] if name.startswith(PREFIX) else name] = float(value)
    return out
