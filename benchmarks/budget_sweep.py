"""The adaptive DDTree budget (budget="auto") against every fixed budget of its menu, cell by cell.

    python benchmarks/budget_sweep.py                                  # checkpoints/default, every default cell
    python benchmarks/budget_sweep.py --batch 1,16 --contexts 128      # fewer cells
    python benchmarks/budget_sweep.py --smoke                          # random tiny pair, CPU, seconds

A cell is (context, sampling temperature, batch size). In each cell, on the same held-out prompts and in the same
process, three kinds of decoder run through `kdtree_jax.speculative.engine.generate`:

- autoregressive (budget 0: a root-only tree through the same loop, no drafter);
- every fixed DDTree budget of --budgets (default 4, 8, 16, 32, 64: the policy's default menu,
  budget_policy.DEFAULT_MENU), the same budget every step;
- budget="auto" with menu = --budgets (0 included): each step picks its budget on the device from the drafter's
  calibrated probabilities and the measured cost model (kdtree_jax/speculative/budget_policy.py, cost_model.py).

Timing: each decoder first makes one untimed warm-up call (generate compiles its loop on the first call of a shape,
and budget="auto" measures its cost model there when the cache has no point for this batch and context), then
--repeats timed passes over all of the cell's prompts (in batches of the cell's batch size; each call's decode
seconds, compile and calibration excluded, as in spec_decode.py), round robin over the decoders (pass 1 of each,
then pass 2 of each, ...) so that the device's drift falls on all of them. tok/s = decoded tokens (the prefill's first token
of each sequence not counted) / decode seconds of a pass; the median over passes is reported. Speed-ups: auto
against autoregressive, and against the best fixed decoder of the cell (autoregressive included; which one it was
is in the table). Auto's policy: steps per menu budget (a histogram over the timed pass's batch steps; "ar" = steps
the gate ran without the drafter), and its predicted vs observed tokens per sequence-step on the drafted steps
(budget_policy.summary; a pass's calls weighted by their drafted steps).

Greedy cells: auto's tokens against budget 16's, token for token (greedy decoding is lossless, so the two should be
equal; in bfloat16 on a GPU a verify pass of another row count can round a near-tie the other way, so a difference
there is recorded, not an error), and every decoder's outputs against autoregressive (identical / total).

Cost model: the normal cache (cost_model.cache_dir(): $KDTREE_JAX_CACHE, else ~/.cache/kdtree_jax), so a rerun
decodes with the costs an earlier run measured; --calibrate measures them again in this run (auto's warm-up call,
calibrate=True). Each cell records whether auto calibrated in this run and how long it took.

Prompts: held-out files only (kdtree_jax/corpus.py, split "eval": the standard-library modules the default pair
never trained on), tokenized with the checkpoint's tokenizer. A context of L tokens: prompt i is the L tokens before
the cut of held-out file i (round robin over the files longer than L) at fraction (0.5 + i * 0.618...) mod 1 of the
file, as spec_decode.py picks them (the same prompts at its --prompt-len); when no held-out file is that long, the
held-out files are concatenated (repeated as needed) into one text and prompt i is the L tokens before a cut of
it at the same fractions. A cell decodes max(--prompts, batch) prompts, rounded up to a whole number of batches.

Compiles: every decoder of every cell is its own program (the pool's size follows the context, the tree the budget,
the sampling the temperature), and compiling is most of the run. With a persistent compilation cache (--cache-dir, on
by default) and --precompile-threads > 0 (default on a GPU: 1; more threads compile in parallel, which on a GPU slows
the programs: engine.compile_programs), the cells go in groups: a group's programs are compiled first (each a
generate call whose rows all end after the prefill, so nothing decodes there; auto with placeholder costs,
generate(costs=...), so nothing calibrates there), then its cells are measured one at a time, reading the programs
back from the cache. The files are rewritten after every cell, so a run stopped by
--deadline-s (or killed) keeps the cells it finished. On an H200 (c89fe7f) the default grid (8 cells, 56 programs)
compiled in ~290 s with 8 threads and measured in ~35 s: each further context (--contexts 128,2048) adds as much;
`--batch 1,16,64` takes three quarters of it.

Writes <out>/budget_sweep_<device>.{md,json,png} (--smoke: budget_sweep_smoke_<device>.*, to a temporary directory
unless --out): the tables, the settings (device, date, commit, jax version, XLA flags), and a figure: the policy's
predicted vs observed tokens per step per cell (y = x drawn) and each cell's speed-up over autoregressive per
decoder (auto marked).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (ROOT, os.path.join(ROOT, "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

from kdtree_jax import runtime  # noqa: E402

# Before JAX starts a backend: command buffers that capture the decode loop on a GPU (--no-command-buffers: off).
runtime.configure(False if "--no-command-buffers" in sys.argv else None)

import json  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import spec_decode as common  # noqa: E402  (benchmarks/spec_decode.py: pair loading, held-out prompts, stats)
from kdtree_jax import corpus  # noqa: E402
from kdtree_jax.checkpoint import add_dtype_argument  # noqa: E402
from kdtree_jax.speculative import budget_policy  # noqa: E402
from kdtree_jax.speculative import cost_model  # noqa: E402
from kdtree_jax.speculative import tree as trees  # noqa: E402
from kdtree_jax.speculative.engine import default_chunk_steps, generate  # noqa: E402

DEFAULT_OUT = common.DEFAULT_OUT
AUTO = "auto"
EQUALITY_BUDGET = 16  # greedy cells: auto's tokens against this fixed budget's

log = common.log


# Prompts --------------------------------------------------------------------------------------------------------
def context_prompts(tokenizer, count: int, length: int):
    """`count` held-out prompts of `length` tokens: spec_decode's (a window of a held-out file) when a held-out file is
    longer than `length`, else windows of the held-out files concatenated and repeated. -> (prompts, descriptions)."""
    try:
        return common.heldout_prompts(tokenizer, count, length)
    except ValueError:
        pass
    docs = corpus.documents("eval")
    ids = np.concatenate([np.asarray(tokenizer.encode(d.text + "\n"), np.int32) for d in docs])
    if ids.size == 0:
        raise ValueError("the held-out split is empty")
    reps = -(-(2 * length + 2) // ids.size)
    stream = np.tile(ids, max(reps, 1))
    prompts, where = [], []
    for i in range(count):
        frac = (0.5 + i * common.GOLDEN) % 1.0
        cut = length + int(frac * (stream.size - length))
        prompts.append(stream[cut - length:cut])
        where.append(f"held-out concatenated x{max(reps, 1)}@{cut}")
    return prompts, where


# Decoders -------------------------------------------------------------------------------------------------------
def decoders(budgets: list) -> list:
    """[(name, budget)] of a cell: autoregressive, each fixed budget, auto."""
    return [("autoregressive", 0)] + [(f"DDTree {b}", b) for b in budgets if b > 0] + [(AUTO, AUTO)]


def call_kwargs(args, budget, temperature: float, menu: list, batch_index: int, calibrate: bool = False) -> dict:
    kwargs = dict(max_new_tokens=args.max_new_tokens, budget=budget, topk=args.topk,
                  tree_temperature=args.tree_temperature, temperature=temperature, top_k=args.top_k,
                  top_p=args.top_p if temperature > 0 else 1.0, seed=args.seed + batch_index, impl=args.impl,
                  chunk_steps=args.chunk_steps)
    if budget == AUTO:
        kwargs.update(menu=tuple(menu), calibrate=calibrate)
    return kwargs


def run_one(target, drafter, prompts, args, budget, temperature, menu, batch_index=0, calibrate=False):
    use = None if budget == 0 else drafter
    return generate(target, use, prompts, **call_kwargs(args, budget, temperature, menu, batch_index, calibrate))


def placeholder_costs(menu: list) -> dict:
    """Costs for a warm-up call that must not calibrate (generate(costs=...)): every entry alike."""
    return {"cost_ar": 1.0, "cost_draft": 0.0, "cost_verify": [1.0] * len(menu)}


def precompile(target, drafter, cells: list, args, menu: list, threads: int) -> float:
    """Every cell's decoders compiled in `threads` parallel threads, so that XLA's compiles overlap and land in the
    persistent compilation cache. Each is a generate call of the cell's first batch whose rows all end after the
    prefill (on_tokens returns True: the loop's program is the same, its chunks find no row to decode), and auto
    gets placeholder costs (generate(costs=...): nothing calibrates here). A call that fails is logged; the
    measurement meets (and records) its error again. -> seconds."""
    jobs = [(cell, name, budget) for cell in cells for name, budget in decoders(args.budgets)]
    t0 = time.perf_counter()
    done = [0]

    def job(item):
        cell, name, budget = item
        use = None if budget == 0 else drafter
        kwargs = call_kwargs(args, budget, cell["temperature"], menu, 0)
        if budget == AUTO:
            kwargs.pop("calibrate")
            kwargs["costs"] = placeholder_costs(menu)
        try:
            generate(target, use, cell["batches"][0], on_tokens=lambda row, ids: True, **kwargs)
        except Exception as e:  # noqa: BLE001
            log(f"  precompile {cell_label(cell)} {name}: {type(e).__name__}: {e}")
        done[0] += 1
        if done[0] % max(len(jobs) // 8, 1) == 0 or done[0] == len(jobs):
            log(f"  precompile: {done[0]}/{len(jobs)} programs ({time.perf_counter() - t0:.0f} s)")

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(job, jobs))
    return time.perf_counter() - t0


def warm_decoder(target, drafter, cell: dict, args, budget, menu: list):
    """One decoder's untimed warm-up call in one cell (it compiles, or reads the program back, and auto calibrates
    there when asked or uncached): -> (its result, seconds)."""
    t0 = time.perf_counter()
    warm = run_one(target, drafter, cell["batches"][0], args, budget, cell["temperature"], menu,
                   calibrate=bool(args.calibrate and budget == AUTO))
    return warm, time.perf_counter() - t0


def timed_pass(target, drafter, cell: dict, args, budget, menu: list) -> list:
    """One timed pass of a decoder over all of a cell's prompts: -> one generate result per batch."""
    return [run_one(target, drafter, pb, args, budget, cell["temperature"], menu, batch_index=i)
            for i, pb in enumerate(cell["batches"])]


def decoder_stats(name: str, budget, cell: dict, warm, warm_seconds: float, passes: list) -> tuple[dict, list]:
    """A decoder's record from its warm-up and its timed passes: the median pass by tok/s.
    -> (stats, tokens of the first pass)."""
    sizes = [len(pb) for pb in cell["batches"]]
    pooled = [common.aggregate(results, sizes) for results in passes]
    tps = [p["tokens_per_second"] for p in pooled]
    median = int(np.argsort(tps)[len(tps) // 2])
    stats = dict(pooled[median])
    stats.update(decoder=name, budget=budget, tokens_per_second_passes=tps,
                 tokens_per_second=float(np.median(tps)), warmup_seconds=warm_seconds,
                 compile_seconds=warm.stats["compile_seconds"], num_nodes=warm.stats["num_nodes"],
                 decoding=warm.stats["decoding"], host_driven_loops=warm.stats.get("host_driven_loops"),
                 host_syncs_per_step=(sum(r.stats.get("host_syncs", 0) for r in passes[median])
                                      / max(sum(r.stats["steps"] for r in passes[median]), 1)))
    if budget == AUTO:
        stats["policy"] = policy_summary(passes[median], warm)
    return stats, [t for r in passes[0] for t in r.tokens]


def policy_summary(results: list, warm) -> dict:
    """The policy over one pass's calls: budget histogram (batch steps), predicted / observed tau on drafted steps,
    and what the warm-up call did with the cost model (calibrated in this run? how long?)."""
    summaries = [r.stats["budget_policy"] for r in results]
    menu = summaries[0]["menu"]
    hist = {str(b): sum(s["budget_steps"][str(b)] for s in summaries) for b in menu}
    hist["ar"] = sum(s["steps_without_drafter"] for s in summaries)
    drafted = np.array([sum(s["budget_steps"].values()) for s in summaries], np.float64)

    def weighted(key):
        vals = np.array([s[key] if s[key] is not None else np.nan for s in summaries], np.float64)
        ok = np.isfinite(vals) & (drafted > 0)
        return float((vals[ok] * drafted[ok]).sum() / drafted[ok].sum()) if ok.any() else float("nan")

    total = sum(hist.values())
    mean_budget = (sum(int(b) * hist[str(b)] for b in menu) / total) if total else float("nan")
    warm_policy = warm.stats["budget_policy"]
    return {
        "menu": menu,
        "budget_steps": hist,
        "steps": int(total),
        "drafted_steps": int(drafted.sum()),
        "mean_budget": mean_budget,  # AR steps count as budget 0
        "predicted_tau": weighted("predicted_tau"),
        "observed_tau": weighted("observed_tau"),
        "calibrated": bool(warm_policy.get("calibrated")) or any(s.get("calibrated") for s in summaries),
        "calibration_seconds": float(warm_policy.get("calibration_seconds") or 0.0)
        + sum(float(s.get("calibration_seconds") or 0.0) for s in summaries if s.get("calibrated")),
        "timed_calls_calibrated": sum(bool(s.get("calibrated")) for s in summaries),
        "costs_ms": summaries[0].get("costs_ms"),
        "cost_model": warm_policy.get("cost_model"),
    }


def first_differences(reference: list, outputs: list) -> list:
    return [common.first_difference(list(a), list(b)) for a, b in zip(reference, outputs)]


def run_cell(target, drafter, cell: dict, args, menu: list) -> dict:
    """Every decoder of one cell, in order; -> the cell's record (json). A decoder that raises (e.g. the engine's
    PoolExhaustedError) is recorded with its error and the cell goes on without it."""
    t0 = time.perf_counter()
    rows, tokens = {}, {}

    def failed(name, budget, e):
        log(f"  {cell_label(cell)} {name}: {type(e).__name__}: {e}")
        rows[name], tokens[name] = {"decoder": name, "budget": budget, "error": f"{type(e).__name__}: {e}",
                                    "tokens_per_second": float("nan"), "tau": float("nan")}, None

    warm = {}
    for name, budget in decoders(args.budgets):
        try:
            warm[name] = warm_decoder(target, drafter, cell, args, budget, menu)
        except Exception as e:  # noqa: BLE001 - a sweep records a failing decoder and goes on
            failed(name, budget, e)
    # The timed passes go round the decoders (AR, each budget, auto, AR, ...), so that a drift of the device's speed
    # over the cell (clocks, another process) falls on every decoder alike. Timed one decoder after the other, the
    # autoregressive program ran 1.16-1.20x faster where auto's cached verdict decoded with it (the same compiled
    # loop) than as the autoregressive decoder timed first (H100 at 0c2c032, greedy B = 16 and 64: 56,353 vs 46,945
    # and 205,973 vs 174,514 tok/s).
    passes = {name: [] for name in warm}
    for _ in range(args.repeats):
        for name, budget in decoders(args.budgets):
            if name not in passes:
                continue
            try:
                passes[name].append(timed_pass(target, drafter, cell, args, budget, menu))
            except Exception as e:  # noqa: BLE001
                del passes[name]
                failed(name, budget, e)
    for name, budget in decoders(args.budgets):
        if name in passes:
            rows[name], tokens[name] = decoder_stats(name, budget, cell, *warm[name], passes[name])
    rows = {name: rows[name] for name, _ in decoders(args.budgets)}
    nan = float("nan")
    ar = rows["autoregressive"]["tokens_per_second"]
    ar = ar if np.isfinite(ar) and ar > 0 else nan
    fixed = {n: r["tokens_per_second"] for n, r in rows.items() if n != AUTO and np.isfinite(r["tokens_per_second"])}
    best = max(fixed, key=fixed.get) if fixed else None
    auto = rows[AUTO]
    for r in rows.values():
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar
    record = {k: cell[k] for k in ("context", "temperature", "top_p", "batch", "prompts", "prompt_cuts")}
    record.update({
        "decoders": list(rows.values()),
        "auto_tokens_per_second": auto["tokens_per_second"],
        "auto_speedup_vs_ar": auto["tokens_per_second"] / ar,
        "best_fixed": best,
        "best_fixed_budget": None if best is None else rows[best]["budget"],
        "best_fixed_tokens_per_second": nan if best is None else fixed[best],
        "auto_vs_best_fixed": nan if best is None else auto["tokens_per_second"] / fixed[best],
        "auto_policy": auto.get("policy"),
        "errors": {n: r["error"] for n, r in rows.items() if "error" in r},
    })
    record["auto_equals_budget16"] = None  # sampled cells, or budget 16 not run
    if cell["temperature"] == 0:
        ref = tokens.get(f"DDTree {EQUALITY_BUDGET}")
        if ref is not None and tokens[AUTO] is not None:
            diffs = first_differences(ref, tokens[AUTO])
            record["auto_equals_budget16"] = all(d is None for d in diffs)
            record["auto_identical_to_budget16"] = sum(d is None for d in diffs)
            record["auto_first_differences_vs_budget16"] = diffs
        for name, r in rows.items():
            if tokens["autoregressive"] is not None and tokens[name] is not None:
                diffs = first_differences(tokens["autoregressive"], tokens[name])
                r["identical_to_ar"] = sum(d is None for d in diffs)
    record["seconds"] = time.perf_counter() - t0
    return record


# Report ---------------------------------------------------------------------------------------------------------
def _fmt(x, spec=".2f"):
    return common._fmt(x, spec)


NO_POLICY = {"budget_steps": {}, "predicted_tau": None, "observed_tau": None, "calibrated": None,
             "calibration_seconds": None, "mean_budget": None, "menu": [], "costs_ms": None}  # auto failed


def histogram_text(policy: dict) -> str:
    """'4: 26%, 16: 63%, ar: 11%' (entries with steps only; shares of the batch steps)."""
    steps = (policy or NO_POLICY)["budget_steps"]
    total = max(sum(steps.values()), 1)
    parts = [f"{k}: {100 * v / total:.0f}%" for k, v in steps.items() if v]
    return ", ".join(parts) or "–"


def calibrated_text(policy: dict) -> str:
    if policy.get("calibrated") is None:
        return "–"
    return f"{'yes' if policy['calibrated'] else 'no'} ({policy['calibration_seconds']:.1f} s)"


def cell_label(c: dict) -> str:
    return f"L={c['context']} {'greedy' if c['temperature'] == 0 else 'T=%g' % c['temperature']} B={c['batch']}"


def render(result: dict) -> str:
    m, cells = result["meta"], result["cells"]
    names = [n for n, _ in decoders(m["budgets"])]
    fixed = [n for n in names if n != AUTO]
    lines = [f"# Adaptive DDTree budget vs fixed budgets ({m['device']})", "",
             f"{m['date']}, commit {m['commit']}, jax {m['jax']} ({m['backend']}). Pair: {m['pair']} (target "
             f"{m['target_dtype']}, {m['target']['num_hidden_layers']} layers, hidden {m['target']['hidden_size']}; "
             f"drafter block size {m['block_size']}). DDTree top-K {m['topk']}, tree temperature "
             f"{m['tree_temperature']}; sampled cells: top-p {m['top_p']}. {m['max_new_tokens']} new tokens per "
             f"prompt, at least {m['prompts']} held-out prompts per cell (a whole number of batches); "
             f"{m['chunk_steps']} steps a chunk; {m['repeats']} timed pass(es) per decoder after a warm-up call "
             "(median).", "",
             f"Command: `{m['command']}` ({m['seconds'] / 60:.1f} min; of it compiling in parallel threads before "
             f"each group of cells: {_fmt(m.get('precompile_seconds'), '.0f')} s). Cost model: {m['cost_model_cache']}"
             f"{' (--calibrate: measured again in this run)' if m['calibrate'] else ''}. Command buffers: "
             f"{('on' if m.get('command_buffers') else 'off') if m['backend'] == 'gpu' else 'n/a'}.", ""]
    if m.get("stopped"):
        lines += [f"**Stopped early**: {m['stopped']}.", ""]
    lines += ["tok/s: decoded tokens / decode seconds (compile and calibration excluded). auto / AR and auto / "
              "best: auto's tok/s over autoregressive's and over the best fixed decoder of the cell (autoregressive "
              "included; its name in brackets). Histogram: auto's batch steps per menu budget (ar: steps without "
              "the drafter). τ pred / obs: the policy's predicted vs observed tokens per sequence-step on drafted "
              "steps. calibrated: whether auto measured its cost model in this run (seconds). = 16: greedy, auto's "
              "tokens equal budget 16's (identical / prompts).", ""]
    if m["backend"] == "cpu":
        lines += ["On a CPU a verify pass costs nearly in proportion to its tree nodes, so the fixed budgets lose to "
                  "autoregressive decoding here and the policy should mostly decode autoregressively; the tok/s "
                  "of an accelerator do not carry over.", ""]
    lines += ["## tok/s", "",
              "| context | T | batch | " + " | ".join("AR" if n == "autoregressive" else n.replace("DDTree ", "")
                                                       for n in fixed)
              + " | auto | auto / AR | auto / best | histogram | τ pred / obs | calibrated | = 16 |",
              "|---|---|---|" + "---|" * len(fixed) + "---|---|---|---|---|---|---|"]
    for c in cells:
        by = {r["decoder"]: r for r in c["decoders"]}
        pol = c["auto_policy"] or NO_POLICY
        best_tag = "AR" if c["best_fixed"] == "autoregressive" else str(c["best_fixed"]).replace("DDTree ", "")
        eq = c.get("auto_equals_budget16")
        eq_text = "–" if eq is None else f"{'yes' if eq else 'no'} ({c['auto_identical_to_budget16']}/{c['prompts']})"
        lines.append(
            f"| {c['context']} | {c['temperature']:g} | {c['batch']} | "
            + " | ".join(_fmt(by[n]["tokens_per_second"], ".0f") for n in fixed)
            + f" | **{_fmt(by[AUTO]['tokens_per_second'], '.0f')}** | {_fmt(c['auto_speedup_vs_ar'])}× | "
            f"{_fmt(c['auto_vs_best_fixed'])}× ({best_tag}) | {histogram_text(pol)} | "
            f"{_fmt(pol['predicted_tau'])} / {_fmt(pol['observed_tau'])} | "
            f"{calibrated_text(pol)} | {eq_text} |")
    lines += ["", "## τ (tokens per step, bonus included) per decoder", "",
              "| context | T | batch | " + " | ".join("AR" if n == "autoregressive" else n.replace("DDTree ", "")
                                                       for n in names) + " | auto mean budget |",
              "|---|---|---|" + "---|" * len(names) + "---|"]
    for c in cells:
        by = {r["decoder"]: r for r in c["decoders"]}
        lines.append(f"| {c['context']} | {c['temperature']:g} | {c['batch']} | "
                     + " | ".join(_fmt(by[n]["tau"], ".2f") for n in names)
                     + f" | {_fmt((c['auto_policy'] or NO_POLICY)['mean_budget'], '.1f')} |")
    greedy = [c for c in cells if c["temperature"] == 0]
    if greedy:
        lines += ["", "## Greedy outputs identical to autoregressive (identical / prompts)", "",
                  "| context | batch | " + " | ".join(n for n in names if n != "autoregressive") + " |",
                  "|---|---|" + "---|" * (len(names) - 1)]
        for c in greedy:
            by = {r["decoder"]: r for r in c["decoders"]}
            lines.append(f"| {c['context']} | {c['batch']} | "
                         + " | ".join(f"{by[n].get('identical_to_ar', '–')}/{c['prompts']}"
                                      for n in names if n != "autoregressive") + " |")
    lines += ["", "## Cost model the auto cells used (ms a step of the batch)", "",
              "| context | T | batch | AR | drafter | verify per menu budget |", "|---|---|---|---|---|---|"]
    for c in cells:
        pol = c["auto_policy"] or NO_POLICY
        costs = pol.get("costs_ms") or {}
        verify = costs.get("verify") or []
        lines.append(f"| {c['context']} | {c['temperature']:g} | {c['batch']} | {_fmt(costs.get('ar'), '.3f')} | "
                     f"{_fmt(costs.get('draft'), '.3f')} | "
                     + ", ".join(f"{b}: {_fmt(v, '.3f') if v < 1e29 else 'pruned'}"
                                 for b, v in zip(pol["menu"], verify)) + " |")
    errors = [(c, n, e) for c in cells for n, e in (c.get("errors") or {}).items()]
    if errors:
        lines += ["", "## Errors (the decoder's row is empty)", ""]
        lines += [f"- {cell_label(c)}, {n}: `{e}`" for c, n, e in errors]
    lines.append("")
    if result.get("plot"):
        lines += [f"Figure: `{result['plot']}`.", ""]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Left: predicted vs observed tokens per sequence-step of auto, one point per cell (y = x). Right: per
    (temperature, context), each batch size's speed-up over autoregressive per decoder, auto marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, cells = result["meta"], result["cells"]
    temps = sorted({c["temperature"] for c in cells})
    contexts = sorted({c["context"] for c in cells})
    fig, axes = plt.subplots(len(temps), 1 + len(contexts), figsize=(4.4 * (1 + len(contexts)), 3.9 * len(temps)),
                             squeeze=False)
    for row in axes[1:]:
        row[0].axis("off")
    ax = axes[0][0]
    batches = sorted({c["batch"] for c in cells})
    cmap = plt.get_cmap("viridis")
    color = {b: cmap(0.85 * i / max(len(batches) - 1, 1)) for i, b in enumerate(batches)}
    markers = {t: mk for t, mk in zip(temps, "os^Dv")}
    hi = 1.0
    for c in cells:
        p, o = (c["auto_policy"] or NO_POLICY)["predicted_tau"], (c["auto_policy"] or NO_POLICY)["observed_tau"]
        if p is None or o is None or not (np.isfinite(p) and np.isfinite(o)):
            continue
        hi = max(hi, p, o)
        ax.scatter([p], [o], color=color[c["batch"]], marker=markers[c["temperature"]], s=40)
        ax.annotate(f"L{c['context']}", (p, o), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.plot([1, hi * 1.05], [1, hi * 1.05], "k--", lw=1, label="y = x")
    for b in batches:
        ax.scatter([], [], color=color[b], marker="o", label=f"B={b}")
    for t, mk in markers.items():
        ax.scatter([], [], color="gray", marker=mk, label="greedy" if t == 0 else f"T={t:g}")
    ax.set_xlabel("predicted tokens / step (drafted steps)")
    ax.set_ylabel("observed tokens / step")
    ax.set_title("auto: predicted vs observed τ")
    ax.legend(fontsize=7)
    names = [n for n, _ in decoders(m["budgets"])]
    labels = ["AR" if n == "autoregressive" else n.replace("DDTree ", "") for n in names]
    x = np.arange(len(names))
    for (r, t), (k, ctx) in [(rt, kc) for rt in enumerate(temps) for kc in enumerate(contexts)]:
        ax = axes[r][1 + k]
        for c in [c for c in cells if c["temperature"] == t and c["context"] == ctx]:
            by = {d["decoder"]: d for d in c["decoders"]}
            y = np.array([np.nan if by[n]["speedup_vs_ar"] is None else by[n]["speedup_vs_ar"] for n in names],
                         np.float64)
            ax.plot(x[:-1], y[:-1], "-o", color=color[c["batch"]], ms=4, label=f"B={c['batch']}")
            ax.plot(x[-1], y[-1], "*", color=color[c["batch"]], ms=14, markeredgecolor="k")
            ax.axhline(y[-1], color=color[c["batch"]], lw=0.6, ls=":")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x, labels)
        ax.set_xlabel("budget (★ auto)")
        ax.set_ylabel("tok/s over autoregressive")
        ax.set_title(f"{'greedy' if t == 0 else 'T=%g' % t}, context {ctx}")
        ax.legend(fontsize=7)
    fig.suptitle(f"budget_sweep: {m['device']}, {m['commit']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(result: dict, out_dir: str, name: str, plot_too: bool) -> None:
    """<name>.json and .md (and with plot_too the .png) in out_dir."""
    if plot_too and result["cells"]:
        png = os.path.join(out_dir, name + ".png")
        plot(result, png)
        result["plot"] = os.path.basename(png)
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(common._clean(result), f, indent=1, allow_nan=False)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(render(result))


# Command line ---------------------------------------------------------------------------------------------------
def int_list(value: str, name: str, minimum: int) -> list:
    try:
        out = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{name} must be integers separated by commas; got {value!r}") from None
    if not out or min(out) < minimum:
        raise SystemExit(f"{name} must be integers >= {minimum} separated by commas; got {value!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=common.DEFAULT_CHECKPOINT,
                   help="pair to measure (default: checkpoints/default)")
    add_dtype_argument(p)
    p.add_argument("--batch", default="1,4,16,64",
                   help="batch sizes, comma-separated; each a cell (default 1,4,16,64)")
    p.add_argument("--temperatures", default="0,0.7",
                   help="sampling temperatures, comma-separated; each a cell (0 = greedy; > 0 samples with --top-p)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus filter of the sampled cells (default 0.95)")
    p.add_argument("--top-k", type=int, default=0, help="top-k filter of the sampled cells (0: off)")
    p.add_argument("--contexts", default="128",
                   help="prompt lengths in tokens (the context the decode starts at), comma-separated; each a cell. "
                        "Prompts longer than every held-out file are windows of the held-out files concatenated "
                        "and repeated (default 128; e.g. 128,512,2048, each context as long to run as the first; "
                        "the default pair's positions stop at 4096, so L + new tokens + the largest tree must stay "
                        "below)")
    p.add_argument("--budgets", default=",".join(map(str, budget_policy.DEFAULT_MENU)),
                   help="the fixed DDTree budgets timed, and auto's menu (0 = autoregressive, always run: the "
                        "baseline); default: budget_policy.DEFAULT_MENU = 0,4,8,16,32,64")
    p.add_argument("--prompts", type=int, default=16,
                   help="held-out prompts per cell (at least the batch size, rounded up to whole batches; default 16)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt (default 96)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed passes over the cell's prompts per decoder, after the warm-up call; the median "
                        "pass is reported (default 3: on the H200 one pass of a decoder moved by 10-20%% between "
                        "runs, e.g. AR at B = 16 0.29 and 0.50 ms a step, history/budget_sweep_h200_f457516_*)")
    p.add_argument("--topk", type=int, default=4, help="drafter candidates per depth for DDTree (default 4)")
    common.add_tree_temperature_argument(p)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (batch i of a pass uses seed + i)")
    p.add_argument("--impl", default="auto", help="verify-attention implementation (default auto)")
    p.add_argument("--chunk-steps", type=int, default=None,
                   help="decode steps per host iteration (engine.ChunkedLoop; 0: the whole decode in one call); "
                        "default: engine.default_chunk_steps(), what generate takes (8)")
    p.add_argument("--calibrate", action="store_true",
                   help="measure auto's cost model again in this run (generate(calibrate=True) on auto's warm-up "
                        "call of each cell), instead of the cached points of an earlier run (default: the normal "
                        "cache, $KDTREE_JAX_CACHE or ~/.cache/kdtree_jax; a cell without a cached point calibrates "
                        "anyway). Either way each cell records whether auto calibrated and for how long")
    p.add_argument("--precompile-threads", type=int, default=None,
                   help="run every cell's warm-up calls first in this many parallel threads (compiles overlap; "
                        "needs --cache-dir); 0: off. Default: 1 on a GPU (programs compiled 8 at a time ran slower: "
                        "engine.compile_programs), 0 on a CPU")
    p.add_argument("--cache-dir", default="~/.cache/kdtree_jax/jax_compilation_cache",
                   help="persistent XLA compilation cache ('' to disable; then nothing is precompiled)")
    p.add_argument("--no-command-buffers", action="store_true",
                   help="leave XLA's command buffers as XLA_FLAGS set them (default: kdtree_jax.runtime.configure())")
    p.add_argument("--deadline-s", type=float, default=0,
                   help="start no new group of cells after this many seconds of the run (the files hold the cells "
                        "finished; they are rewritten after every cell anyway); 0 (default): no deadline")
    p.add_argument("--no-plot", action="store_true", help="skip the png")
    p.add_argument("--out", default=None,
                   help="output directory (default: benchmarks/results; --smoke: a temp dir, removed at exit)")
    p.add_argument("--smoke", action="store_true",
                   help="random tiny pair on CPU: batch 1, greedy, context 24, budgets 0,4 and auto, 2 prompts x "
                        "8 tokens (each unless given)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if args.chunk_steps is None:
        args.chunk_steps = default_chunk_steps()
    given = {a.split("=")[0] for a in argv}
    if args.smoke:
        for flag, value in (("--batch", "1"), ("--temperatures", "0"), ("--contexts", "24"), ("--budgets", "0,4"),
                            ("--prompts", 2), ("--max-new-tokens", 8)):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    out_dir = args.out or (tempfile.mkdtemp(prefix="budget_sweep_smoke_") if args.smoke else DEFAULT_OUT)
    if args.smoke and not args.out:
        import atexit
        import shutil

        atexit.register(shutil.rmtree, out_dir, True)
    common.enable_compilation_cache(args.cache_dir)

    batch_sizes = int_list(args.batch, "--batch", 1)
    contexts = int_list(args.contexts, "--contexts", 1)
    args.budgets = sorted(set(int_list(args.budgets, "--budgets", 0)) | {0})
    try:
        temperatures = [float(t) for t in str(args.temperatures).split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--temperatures must be numbers separated by commas; got {args.temperatures!r}") from None
    if not temperatures or min(temperatures) < 0:
        raise SystemExit(f"--temperatures must be numbers >= 0; got {args.temperatures!r}")
    for name in ("prompts", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")

    t_all = time.perf_counter()
    target, drafter, tokenizer, pair = common.load_pair(args)
    common.resolve_tree_temperature(args)
    depth = drafter.cfg.depth
    limit = trees.max_ddtree_budget(depth, args.topk)
    bad = [b for b in args.budgets if b > limit]
    if bad or len(args.budgets) < 2:
        raise SystemExit(f"--budgets needs a budget in [1, {limit}] (block size {drafter.cfg.block_size}, --topk "
                         f"{args.topk}) and none above it; got {args.budgets}")
    menu = list(args.budgets)
    threads = args.precompile_threads
    if threads is None:
        # One at a time on a GPU: programs autotuned while others compile ran slower (engine.compile_programs).
        threads = 1 if jax.default_backend() == "gpu" else 0
    if not args.cache_dir:
        threads = 0  # nothing would carry the parallel compiles over to the measurement

    # Cells, with their prompts: per context the same prompts for every batch size (the first n of them).
    cells = []
    for context in contexts:
        need = max(-(-max(args.prompts, b) // b) * b for b in batch_sizes)
        prompts, where = context_prompts(tokenizer, need, context)
        for temperature in temperatures:
            for batch in batch_sizes:
                n = -(-max(args.prompts, batch) // batch) * batch
                lists = [p.tolist() for p in prompts[:n]]
                cells.append({"context": context, "temperature": temperature,
                              "top_p": args.top_p if temperature > 0 else 1.0, "batch": batch, "prompts": n,
                              "prompt_cuts": where[:n], "batches": common.batches(lists, batch)})

    meta = common.base_meta(args, target, drafter, pair)
    meta.update({"batch_sizes": batch_sizes, "temperatures": temperatures, "top_p": args.top_p, "top_k": args.top_k,
                 "contexts": contexts, "budgets": args.budgets, "menu": menu, "prompts": args.prompts,
                 "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "topk": args.topk,
                 "tree_temperature": args.tree_temperature, "seed": args.seed, "impl": args.impl, "depth": depth,
                 "chunk_steps": args.chunk_steps, "calibrate": args.calibrate,
                 "cost_model_cache": str(cost_model.cache_dir()), "compilation_cache": args.cache_dir,
                 "precompile_threads": threads, "command_buffers": runtime.command_buffers_configured(),
                 "xla_flags": os.environ.get("XLA_FLAGS", "")})
    log(f"{meta['device']} ({meta['backend']}): {pair}; {len(cells)} cells (contexts {contexts}, temperatures "
        f"{temperatures}, batch {batch_sizes}); decoders AR, {', '.join(map(str, args.budgets[1:]))}, auto; "
        f"{args.max_new_tokens} new tokens; cost model cache {meta['cost_model_cache']}")

    name = f"budget_sweep_{'smoke_' if args.smoke else ''}{common.device_slug()}"
    os.makedirs(out_dir, exist_ok=True)
    result = {"meta": meta, "cells": []}
    # Cells in groups: a group's programs compiled in parallel threads, then its cells measured one by one; the
    # files are rewritten after every cell (a run stopped by --deadline-s, or killed, keeps the cells it finished).
    per_group = max(1, round(2 * threads / len(decoders(args.budgets)))) if threads > 0 else len(cells)
    meta["precompile_seconds"] = 0.0 if threads > 0 else None
    stopped = None
    for g in range(0, len(cells), per_group):
        group = cells[g:g + per_group]
        if args.deadline_s and time.perf_counter() - t_all > args.deadline_s:
            stopped = f"--deadline-s {args.deadline_s:g} passed: {len(cells) - g} of {len(cells)} cells not run"
            log(stopped)
            break
        if threads > 0:
            log(f"precompile: cells {g + 1}-{g + len(group)} of {len(cells)}, "
                f"{len(group) * len(decoders(args.budgets))} programs in {threads} threads")
            meta["precompile_seconds"] += precompile(target, drafter, group, args, menu, threads)
        for i, cell in enumerate(group, start=g):
            rec = run_cell(target, drafter, cell, args, menu)
            result["cells"].append(rec)
            by = {r["decoder"]: r for r in rec["decoders"]}
            pol = rec["auto_policy"] or NO_POLICY
            eq = rec.get("auto_equals_budget16")
            log(f"[{i + 1}/{len(cells)}] {cell_label(rec)}: "
                + "  ".join(f"{'AR' if n == 'autoregressive' else n.replace('DDTree ', '')} "
                            f"{by[n]['tokens_per_second']:.0f}" for n in by)
                + f" tok/s | auto x{rec['auto_speedup_vs_ar']:.2f} vs AR, x{rec['auto_vs_best_fixed']:.2f} vs best "
                f"({rec['best_fixed']}) | {histogram_text(pol)} | tau pred {_fmt(pol['predicted_tau'])} obs "
                f"{_fmt(pol['observed_tau'])} | calibrated {calibrated_text(pol)}"
                + ("" if eq is None else f" | auto == 16: {eq}") + f" ({rec['seconds']:.0f} s, "
                f"{time.perf_counter() - t_all:.0f} s in all)")
            meta["seconds"] = time.perf_counter() - t_all
            write_results(result, out_dir, name, plot_too=False)
    meta["stopped"] = stopped
    meta["seconds"] = time.perf_counter() - t_all
    write_results(result, out_dir, name, plot_too=not args.no_plot)
    log(f"wrote {os.path.join(out_dir, name)}.{{json,md{'' if args.no_plot else ',png'}}} "
        f"({meta['seconds']:.0f} s)"
        + (" (--smoke without --out: removed at exit; the report follows)" if args.smoke and not args.out else ""))
    if args.smoke and not args.out:
        print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
