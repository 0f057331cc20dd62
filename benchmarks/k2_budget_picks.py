"""Which DDTree budget the adaptive policy would pick for Kimi-K2 (one TP8 rank), from measured step costs.

    python benchmarks/k2_budget_picks.py                                # the decode_context results in the repo
    python benchmarks/k2_budget_picks.py --drafter-ms 0.42 --contexts 65536 --out /tmp/k2_picks.md
    python benchmarks/k2_budget_picks.py --costs my_costs.json          # a cost table of your own

No decoding here: the policy's own rule (kdtree_jax/speculative/budget_policy.py: `init_state`, `calibrated`,
`expected_tokens`, `choose`, `should_draft`, on a tree built by `tree.build_ddtree`) is evaluated on

1. a cost table: the drafter-free step time of a verify pass of T nodes at context L, from the K2 TP8-rank steps
   that benchmarks/decode_context.py measured (benchmarks/results/decode_context_*.json, the kernel rows, --layers
   layers). A budget b step costs c(T = b + 1), linear in T between the measured T points (beyond the largest
   measured T: the last segment's slope, marked "extrapolated"), plus --drafter-ms for the drafter (the policy's
   c_draft); an autoregressive step costs c(T = 1) with no drafter. The measured steps ran the drafter (its pass and
   its context extension, a part of the step's profile: drafter_ms), so that part is taken out of each measured step
   first (--keep-measured-drafter leaves it in). --step engine (default) takes the engine's chunked loop's step where
   decode_context timed it (engine_step_ms: what a decode runs; the policy's own calibration also leaves the call's
   cost out), else the benchmark's one-call step (step_ms); --step call takes step_ms everywhere.
   What is measured: at the time of writing, T = 1 / 9 / 33 only at 64k (decode_context_h200_25layers_64k, 25
   layers); 4k-200k only at T = 9 / 33 (decode_context_h200_25layers, an earlier commit). A context without its own
   T = 1 point is estimated: the nearest context with T = 1 measured (the anchor, e.g. 64k) plus the context's shift
   measured in one file that holds both contexts (c_T(L) - c_T(anchor) at T = 9 and 33; at T = 1 the shift is
   extrapolated linearly in T from those two); the table says which contexts are estimated and from what.
   Caveat: between measured T the step is concave in T (the MoE's distinct experts per layer saturate: 8 / 66 / 98
   at T = 1 / 9 / 33), so the linear interpolation prices T = 5 and 17 (budgets 4 and 16) below what they cost;
   budgets 8 and 32 sit on measured points (T = 9, 33) and 64 is extrapolated.
   --costs FILE replaces all of this with a table of your own (JSON: {"contexts": {"4096": {"1": ms, "9": ms, ...},
   ...}, "source": "..."}, drafter-free step ms per T).
2. acceptance profiles: the calibrated probability that the verify pass accepts a node's whole path. Per depth d the
   drafter's candidates of rank r = 0, 1, ... get probability c_d (1 - c_d)^r (a geometric tail over ranks), a
   node's probability is the product along its path (the independence the DDTree's scores assume), and the tree is
   the engine's: the best-first prefixes of `build_ddtree` over those log-probs (--topk candidates per depth,
   --depth depths). Profiles: geometric (c_d = p at every depth; --geometric, default 0.6, 0.8, 0.9) and the default
   pair's measured per-depth acceptance (--acceptance FILE: acceptance_by_depth a_d of its largest DDTree per
   sampling temperature, c_d = a_d / a_(d-1); default benchmarks/results/default_pair_v2_h200.json, the v2 pair on an
   H200). With these probabilities as the calibrated ones (a calibration ratio of 1), E(b) = 1 + the probabilities
   of the first b nodes.

The pick at each context and profile: the drafting budget with the most E(b) / (c_draft + c_verify(b)), when that
beats an autoregressive step's 1 / c_AR (budget_policy.next_entry's rule with its running prediction at these E(b)). Printed as a markdown table (and the rates of every
budget), written to --out when given (with a .json beside it).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys

if __name__ == "__main__":  # host-side arithmetic on tiny arrays: no accelerator needed
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kdtree_jax.speculative import budget_policy  # noqa: E402
from kdtree_jax.speculative import tree as trees  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
DEFAULT_ACCEPTANCE = os.path.join(RESULTS, "default_pair_v2_h200.json")
MIN_PROB = 1e-4
MAX_PROB = 0.999


# The cost table ------------------------------------------------------------------------------------------------
def load_decode_context(files: list, layers: int) -> list:
    """Every kernel row (impl "auto", a step time) of the files measured with `layers` layers:
    [{context, nodes, step_ms, engine_step_ms, drafter_ms, file, commit, date}]."""
    out = []
    for path in files:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        meta = data.get("meta") or {}
        if meta.get("layers") != layers:
            continue
        for r in data.get("rows") or []:
            if r.get("impl") != "auto" or r.get("step_ms") is None or r.get("context") is None:
                continue
            out.append({"context": int(r["context"]), "nodes": int(r["nodes"]), "step_ms": float(r["step_ms"]),
                        "engine_step_ms": r.get("engine_step_ms"), "drafter_ms": float(r.get("drafter_ms") or 0.0),
                        "file": os.path.basename(path), "commit": meta.get("commit", "?"),
                        "date": meta.get("date", "")})
    return out


def _verify_ms(row: dict, step: str, subtract_drafter: bool) -> tuple[float, str]:
    """A row's drafter-free step (ms) and the column it came from."""
    if step == "engine" and row.get("engine_step_ms") is not None:
        value, column = float(row["engine_step_ms"]), "engine"
    else:
        value, column = row["step_ms"], "call"
    return (value - row["drafter_ms"] if subtract_drafter else value), column


def _newest(rows: list) -> dict:
    """(context, nodes) -> the newest row measuring it."""
    best = {}
    for r in sorted(rows, key=lambda r: r["date"]):
        best[(r["context"], r["nodes"])] = r
    return best


def _shift_to_t1(shifts: dict) -> float:
    """The context shift at T = 1 from shifts {T: ms} at T > 1: linear in T through the two smallest T."""
    ts = sorted(t for t in shifts if t > 1)
    if not ts:
        return 0.0
    if len(ts) == 1:
        return shifts[ts[0]]
    t0, t1 = ts[0], ts[1]
    return shifts[t0] + (shifts[t1] - shifts[t0]) * (1 - t0) / (t1 - t0)


def _interp_shift(shifts: dict, t: int) -> float:
    if t in shifts:
        return shifts[t]
    pts = dict(shifts)
    pts.setdefault(1, _shift_to_t1(shifts))
    ts = sorted(pts)
    return float(np.interp(t, ts, [pts[k] for k in ts]))


def cost_table(rows: list, contexts: list, step: str = "engine", subtract_drafter: bool = True) -> dict:
    """Per context: {"points": {T: drafter-free ms}, "source": text, "estimated": bool} or {"missing": text}."""
    newest = _newest(rows)
    by_context = {}
    for (ctx, t), r in newest.items():
        by_context.setdefault(ctx, {})[t] = r
    anchors = [c for c, pts in by_context.items() if 1 in pts and len(pts) >= 2]
    table = {}
    for ctx in contexts:
        own = by_context.get(ctx, {})
        if 1 in own and len(own) >= 2:
            pts, cols = {}, set()
            for t, r in own.items():
                pts[t], col = _verify_ms(r, step, subtract_drafter)
                cols.add(col)
            files = sorted({f"{r['file']} ({r['commit']})" for r in own.values()})
            table[ctx] = {"points": dict(sorted(pts.items())), "estimated": False,
                          "source": f"measured: {', '.join(files)}; step: {'/'.join(sorted(cols))}"}
            continue
        if not anchors:
            table[ctx] = {"missing": "no context has T = 1 measured with these layers"}
            continue
        anchor = min(anchors, key=lambda c: abs(math.log(c / ctx)))
        # A file holding both contexts at >= 1 common T > 1: the shift c_T(ctx) - c_T(anchor), within that file.
        best = None
        for f in sorted({r["file"] for r in rows}):
            here = {(r["context"], r["nodes"]): r for r in rows if r["file"] == f}
            common = sorted(t for (c, t) in here if c == ctx and t > 1 and (anchor, t) in here)
            if common and (best is None or (len(common), here[(ctx, common[0])]["date"]) > best[0]):
                best = ((len(common), here[(ctx, common[0])]["date"]), f, here, common)
        if best is None:
            table[ctx] = {"missing": f"not measured, and no file holds both {ctx} and the anchor {anchor}"}
            continue
        _, f, here, common = best
        shifts = {t: _verify_ms(here[(ctx, t)], "call", subtract_drafter)[0]
                  - _verify_ms(here[(anchor, t)], "call", subtract_drafter)[0] for t in common}
        pts, cols = {}, set()
        for t, r in by_context[anchor].items():
            base, col = _verify_ms(r, step, subtract_drafter)
            cols.add(col)
            pts[t] = max(base + _interp_shift(shifts, t), 1e-3)
        commit = here[(ctx, common[0])]["commit"]
        anchor_files = sorted({f"{r['file']} ({r['commit']})" for r in by_context[anchor].values()})
        table[ctx] = {"points": dict(sorted(pts.items())), "estimated": True, "anchor": anchor,
                      "shift_ms": {str(t): round(v, 4) for t, v in sorted(shifts.items())},
                      "shift_t1_ms": round(_shift_to_t1(shifts), 4),
                      "source": f"estimated: {anchor} measured ({', '.join(anchor_files)}; step: "
                                f"{'/'.join(sorted(cols))}) + the shift {anchor} -> {ctx} of {f} ({commit}) at T = "
                                f"{', '.join(map(str, common))}, at T = 1 extrapolated in T"}
    return table


def step_cost(points: dict, t: int) -> tuple[float, bool]:
    """c(T) linear between measured T points; beyond the largest, the last segment's slope. -> (ms, extrapolated)."""
    ts = sorted(points)
    vals = [points[k] for k in ts]
    if t <= ts[-1] or len(ts) == 1:
        return float(np.interp(t, ts, vals)), t > ts[-1]
    slope = (vals[-1] - vals[-2]) / (ts[-1] - ts[-2])
    return float(vals[-1] + slope * (t - ts[-1])), True


def load_costs_file(path: str) -> tuple[dict, str]:
    """A table of your own: {"contexts": {"L": {"T": ms}}, "source": "..."} -> (table as cost_table gives, source)."""
    with open(path) as f:
        data = json.load(f)
    source = data.get("source", os.path.basename(path))
    table = {}
    for ctx, pts in data["contexts"].items():
        points = {int(t): float(ms) for t, ms in pts.items()}
        if 1 not in points or len(points) < 2:
            raise SystemExit(f"--costs: context {ctx} needs T = 1 and at least one larger T; got {sorted(points)}")
        table[int(ctx)] = {"points": dict(sorted(points.items())), "estimated": False, "source": source}
    return table, source


# Acceptance profiles -------------------------------------------------------------------------------------------
def geometric_profile(p: float, depth: int) -> list:
    return [float(p)] * depth


def profile_from_acceptance(acc: list, depth: int) -> list:
    """Per-depth conditional acceptance c_d = a_d / a_(d-1) from P(>= d accepted) (a_0 = 1), clipped to
    [MIN_PROB, MAX_PROB]; depths beyond the measured ones get MIN_PROB."""
    out, prev = [], 1.0
    for d in range(depth):
        a = float(acc[d]) if d < len(acc) and acc[d] is not None else 0.0
        c = a / prev if prev > 0 else 0.0
        out.append(float(np.clip(c, MIN_PROB, MAX_PROB)))
        prev = a
    return out


def measured_profiles(path: str) -> list:
    """[(name, acceptance_by_depth)] of the largest DDTree per sampling temperature in a default_pair.py result
    (configs) or a spec_decode.py result (rows, batch 1 preferred)."""
    with open(path) as f:
        data = json.load(f)
    rows = data.get("configs") or data.get("rows") or []
    best = {}
    for r in rows:
        if r.get("tree") != "ddtree" or not r.get("acceptance_by_depth") or r.get("mode", "static") != "static":
            continue
        t = float(r.get("temperature", 0.0))
        key = (r.get("batch", 1) == 1, r.get("budget", 0))
        if t not in best or key > best[t][0]:
            best[t] = (key, r)
    name = os.path.basename(path).rsplit(".", 1)[0]
    return [(f"{name} {'greedy' if t == 0 else 'T=%g' % t} (DDTree {r.get('budget')})", r["acceptance_by_depth"])
            for t, (_, r) in sorted(best.items())]


def node_probabilities(conditional: list, topk: int, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's DDTree of `budget` nodes over per-depth log-probs log(c_d (1 - c_d)^r): -> (scores [1, T],
    valid [1, T]) in the tree's node order."""
    c = np.clip(np.asarray(conditional, np.float64), MIN_PROB, MAX_PROB)
    ranks = np.arange(topk)[None, :]
    top_lp = (np.log(c)[:, None] + ranks * np.log1p(-c)[:, None])[None].astype(np.float32)  # [1, D, K], descending
    depth = c.size
    top_tok = np.broadcast_to(np.arange(topk, dtype=np.int32)[None, None, :], (1, depth, topk))
    tree = trees.build_ddtree(jnp.asarray(top_lp), jnp.asarray(top_tok), jnp.zeros((1,), jnp.int32),
                              jnp.zeros((1,), jnp.int32), budget)
    return tree.scores, tree.valid


# The policy's rule ---------------------------------------------------------------------------------------------
def pick(menu: list, points: dict, drafter_ms: float, scores, valid, context: float) -> dict:
    """The policy's gate and choice for one cost table and one tree: -> the pick and every budget's figures."""
    c_ar = step_cost(points, 1)[0]
    verify, extrapolated = [], []
    for b in menu:
        ms, ext = step_cost(points, b + 1) if b > 0 else (c_ar, False)
        verify.append(ms)
        extrapolated.append(ext)
    policy = budget_policy.init_state(menu, cost_ar=c_ar, cost_draft=drafter_ms, cost_verify=verify,
                                      context0=context)
    q = budget_policy.calibrated(policy, scores, valid)
    e = np.asarray(budget_policy.expected_tokens(q, menu))[0]
    cost = [drafter_ms + (v if b > 0 else c_ar) for b, v in zip(menu, verify)]
    rates = [float(x / y) for x, y in zip(e, cost)]  # tokens per ms, per sequence
    # The gate in its steady state (its running prediction equal to these E(b)): the best drafting budget's rate
    # against an autoregressive step's, with the gate's margin (budget_policy.next_entry, budget_policy.pays).
    chosen = max((i for i, b in enumerate(menu) if b > 0), key=lambda i: rates[i])
    drafts = bool(budget_policy.pays(rates[chosen] * c_ar))
    budget = menu[chosen] if drafts else None  # None: the gate keeps the step autoregressive
    best_rate = rates[chosen] if drafts else 1.0 / c_ar
    expected = e
    return {"budget": budget, "drafts": drafts, "choice": menu[chosen], "c_ar_ms": c_ar,
            "speedup_vs_ar": best_rate * c_ar, "expected": e.tolist(), "cost_ms": cost, "rate_per_ms": rates,
            "extrapolated": extrapolated, "summed_expected": np.asarray(expected).tolist()}


# Command line --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="4096,65536,131072", help="contexts L in tokens (default 4096,65536,131072)")
    p.add_argument("--menu", default=",".join(map(str, budget_policy.DEFAULT_MENU)),
                   help="the policy's menu of budgets (0: the autoregressive / root-only entry); default "
                        "budget_policy.DEFAULT_MENU")
    p.add_argument("--drafter-ms", type=float, default=0.5,
                   help="the drafter's cost per drafted step, ms (the policy's c_draft; default 0.5: decode_context "
                        "measured 0.42 ms of drafter in the K2 rank's step at 64k, T = 9 / 33)")
    p.add_argument("--results", default=RESULTS,
                   help="where the decode_context_*.json results are (default benchmarks/results; history/ is "
                        "not read)")
    p.add_argument("--files", default=None,
                   help="decode_context result files, comma-separated (default: every decode_context_*.json in "
                        "--results)")
    p.add_argument("--layers", type=int, default=25,
                   help="use the results measured with this many layers (default 25: the current K2 files)")
    p.add_argument("--step", choices=("engine", "call"), default="engine",
                   help="engine: the engine's chunked-loop step where measured (engine_step_ms), else the call's; "
                        "call: decode_context's one-call step (step_ms) everywhere")
    p.add_argument("--keep-measured-drafter", action="store_true",
                   help="do not take the drafter part (drafter_ms of the step's profile) out of the measured steps "
                        "(then --drafter-ms comes on top of it)")
    p.add_argument("--costs", default=None,
                   help="a cost table of your own instead of the results: JSON {\"contexts\": {\"4096\": {\"1\": ms, "
                        "\"9\": ms, \"33\": ms}, ...}, \"source\": \"...\"} (drafter-free step ms per T)")
    p.add_argument("--geometric", default="0.6,0.8,0.9",
                   help="geometric profiles: top-candidate acceptance p at every depth ('' for none)")
    p.add_argument("--acceptance", default=DEFAULT_ACCEPTANCE,
                   help="a default_pair.py or spec_decode.py result whose largest DDTree's acceptance_by_depth is a "
                        "profile per sampling temperature (default benchmarks/results/default_pair_v2_h200.json; "
                        "'' for none)")
    p.add_argument("--depth", type=int, default=15,
                   help="drafter depth (block size - 1; default 15: K2's DFlash drafter and the default pair's)")
    p.add_argument("--topk", type=int, default=4, help="drafter candidates per depth (default 4, generate's)")
    p.add_argument("--out", default=None, help="also write the table to this .md file (and a .json beside it)")
    return p


def _ints(value: str, name: str, minimum: int) -> list:
    try:
        out = [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{name} must be integers separated by commas; got {value!r}") from None
    if not out or min(out) < minimum:
        raise SystemExit(f"{name} must be integers >= {minimum}; got {value!r}")
    return out


def render(result: dict) -> str:
    m = result["meta"]
    menu = m["menu"]
    lines = ["# The adaptive budget's picks for Kimi-K2 (one TP8 rank)", "",
             f"Menu {menu}; drafter {m['drafter_ms']} ms a drafted step; DDTree depth {m['depth']}, top-{m['topk']} "
             f"per depth. Step costs: {m['cost_source']}.", "",
             "Cost table (drafter-free step ms by verify nodes T; a budget b step verifies T = b + 1):", "",
             "| context | T points (ms) | source |", "|---|---|---|"]
    for ctx, entry in result["costs"].items():
        if "missing" in entry:
            lines.append(f"| {ctx} | – | {entry['missing']} |")
            continue
        pts = ", ".join(f"T={t}: {v:.3f}" for t, v in entry["points"].items())
        lines.append(f"| {ctx} | {pts} | {entry['source']} |")
    lines += ["", "Picks (the gate, then argmax E(b) / cost(b); AR: the gate keeps the step autoregressive). "
              "speed-up: the pick's expected tokens per ms over the autoregressive step's:", "",
              "| profile | " + " | ".join(f"L={c}" for c in result["contexts"]) + " |",
              "|---|" + "---|" * len(result["contexts"])]
    for prof in result["profiles"]:
        cells = []
        for ctx in result["contexts"]:
            r = result["picks"].get(f"{prof['name']}|{ctx}")
            if r is None:
                cells.append("–")
            else:
                ext = " (extrap.)" if r["budget"] is not None and r["extrapolated"][menu.index(r["budget"])] else ""
                cells.append(f"{'AR' if r['budget'] is None else r['budget']}{ext} ×{r['speedup_vs_ar']:.2f}")
        lines.append(f"| {prof['name']} | " + " | ".join(cells) + " |")
    lines += ["", "Expected tokens per step E(b) and tok/ms per budget (cost ms in brackets), per profile and context:",
              "", "| profile | context | " + " | ".join(f"b={b}" for b in menu) + " | AR |",
              "|---|---|" + "---|" * (len(menu) + 1)]
    for prof in result["profiles"]:
        for ctx in result["contexts"]:
            r = result["picks"].get(f"{prof['name']}|{ctx}")
            if r is None:
                continue
            cells = [f"E {e:.2f}, {rate:.3f}/ms ({c:.2f}{'*' if x else ''})"
                     for e, rate, c, x in zip(r["expected"], r["rate_per_ms"], r["cost_ms"], r["extrapolated"])]
            lines.append(f"| {prof['name']} | {ctx} | " + " | ".join(cells)
                         + f" | {1 / r['c_ar_ms']:.3f}/ms ({r['c_ar_ms']:.2f}) |")
    lines += ["", "*: T beyond the largest measured T, extrapolated linearly.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    contexts = _ints(args.contexts, "--contexts", 1)
    menu = sorted(set(_ints(args.menu, "--menu", 0)) | {0})
    if len(menu) < 2:
        raise SystemExit("--menu needs a budget > 0")
    if args.depth < 1 or args.topk < 1:
        raise SystemExit("--depth and --topk must be >= 1")
    limit = trees.max_ddtree_budget(args.depth, args.topk)
    if max(menu) > limit:
        raise SystemExit(f"--menu's largest budget must be <= {limit} (depth {args.depth}, top-{args.topk})")

    if args.costs:
        table, source = load_costs_file(args.costs)
        table = {c: table.get(c, {"missing": f"not in {args.costs}"}) for c in contexts}
    else:
        files = (args.files.split(",") if args.files else
                 sorted(glob.glob(os.path.join(args.results, "decode_context_*.json"))))
        rows = load_decode_context(files, args.layers)
        if not rows:
            raise SystemExit(f"no decode_context kernel rows with {args.layers} layers in {files}")
        table = cost_table(rows, contexts, step=args.step, subtract_drafter=not args.keep_measured_drafter)
        measured_t1 = sorted({r["context"] for r in rows if r["nodes"] == 1})
        source = (f"decode_context results with {args.layers} layers ({', '.join(sorted({r['file'] for r in rows}))}); "
                  f"T = 1 measured at L = {', '.join(map(str, measured_t1)) or 'none'}"
                  + (" only" if len(measured_t1) == 1 else "")
                  + ("; the measured drafter part taken out" if not args.keep_measured_drafter else ""))

    profiles = []
    for p in [float(x) for x in str(args.geometric).split(",") if x.strip()]:
        if not 0 < p < 1:
            raise SystemExit(f"--geometric values must be in (0, 1); got {p}")
        profiles.append({"name": f"geometric p={p:g}", "conditional": geometric_profile(p, args.depth)})
    if args.acceptance:
        for name, acc in measured_profiles(args.acceptance):
            profiles.append({"name": name, "conditional": profile_from_acceptance(acc, args.depth),
                             "acceptance_by_depth": acc})
    if not profiles:
        raise SystemExit("no acceptance profile (--geometric and --acceptance both empty)")

    picks = {}
    for prof in profiles:
        scores, valid = node_probabilities(prof["conditional"], args.topk, max(menu))
        for ctx in contexts:
            entry = table[ctx]
            if "missing" in entry:
                continue
            picks[f"{prof['name']}|{ctx}"] = pick(menu, entry["points"], args.drafter_ms, scores, valid, ctx)
    result = {"meta": {"menu": menu, "drafter_ms": args.drafter_ms, "depth": args.depth, "topk": args.topk,
                       "cost_source": source, "step": args.step, "layers": args.layers,
                       "subtract_measured_drafter": not args.keep_measured_drafter,
                       "command": " ".join([os.path.basename(sys.argv[0] or "k2_budget_picks.py")] + argv)},
              "contexts": contexts, "costs": {str(c): table[c] for c in contexts}, "profiles": profiles,
              "picks": picks}
    text = render(result)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
