"""Verify attention on the CPU: the FFI CPU handler (impl="ffi") against the pure-JAX reference under jit.

One sequence (B=1) with L context positions before the T query tokens (kv_len = L + T), a causal mask
over the query tokens, K2's latent geometry (576 = 512 + 64) in bfloat16, the pool [4 layers, S slots,
576] and the sequence's slots a random permutation (scattered rows, as in a paged cache). Each case is
compiled once, run once to warm up, then timed with block_until_ready: the median of --reps calls (fewer
when a case is slow: about --budget seconds per impl, at least 4 calls), made in two rounds of
consecutive calls per impl.

  python benchmarks/verify_attention_cpu.py                  # writes results/verify_attention_cpu.{md,json}
  python benchmarks/verify_attention_cpu.py --smoke                     # tiny, checks the script runs (temp dir)
  python benchmarks/verify_attention_cpu.py --before old.json         # adds old.json's handler times as "before"
  python benchmarks/verify_attention_cpu.py --extension old/_verify_attention_ext.*.so --out old.json
                                         # times another build of the extension (e.g. an earlier commit's)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kdtree_jax.ops import ffi as vffi, verify_attention  # noqa: E402
from kdtree_jax.ops.masks import causal_mask  # noqa: E402
from kdtree_jax.provenance import git_commit, smoke_dir  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "verify_attention_cpu.json")
FULL_CASES = [(t, length, 4) for length in (256, 1024, 4096) for t in (1, 9, 17, 33, 65)] + [(33, 1024, 8)]
SMOKE_CASES = [(1, 20, 2), (9, 40, 2)]
LATENT, ROPE = 512, 64


def cpu_description() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return dict(cpu=model, cores=os.cpu_count(), jax_devices=len(jax.devices("cpu")))


def make_inputs(num_queries: int, length: int, num_heads: int, latent: int, rope: int, seed: int = 0):
    width = latent + rope
    kv_len = length + num_queries
    num_slots = max(2048, kv_len)
    keys = jax.random.split(jax.random.key(seed), 3)
    pool = jax.random.normal(keys[0], (4, num_slots, width), jnp.float32).astype(jnp.bfloat16)
    q = jax.random.normal(keys[1], (1, num_queries, num_heads, width), jnp.float32).astype(jnp.bfloat16)
    slots = jax.random.permutation(keys[2], num_slots)[None, :kv_len].astype(jnp.int32)
    lens = jnp.array([kv_len], jnp.int32)
    return q, pool, jnp.int32(1), slots, lens, causal_mask(1, num_queries)


def median_us(fns: dict, args, reps: int, budget_s: float, rounds: int = 2) -> dict:
    """Median µs per call of each function. The calls are made in `rounds` rounds, each function timed
    over a run of consecutive calls per round (as in a model, where the op follows itself layer after
    layer), so that a slow spell of the machine (shared cores) is unlikely to hit only one of them."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))  # compile + warm-up
    times = {name: [] for name in fns}
    per_round = max(2, -(-reps // rounds))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for rep in range(per_round):
                if rep >= 2 and time.perf_counter() - start > budget_s / rounds:
                    break
                t = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[name].append(time.perf_counter() - t)
    return {name: float(np.median(ts)) * 1e6 for name, ts in times.items()}


def bench_case(num_queries, length, num_heads, latent, rope, reps, budget_s):
    args = make_inputs(num_queries, length, num_heads, latent, rope)
    scale = (latent + rope) ** -0.5
    fns = {key: jax.jit(lambda *a, impl=impl: verify_attention(*a, softmax_scale=scale, rope_dim=rope, impl=impl))
           for impl, key in (("ffi", "handler_us"), ("reference", "reference_us"))}
    return dict(T=num_queries, L=length, H=num_heads, **median_us(fns, args, reps, budget_s))


def markdown(meta: dict, rows: list[dict]) -> str:
    has_before = any("before_us" in r for r in rows)
    lines = ["# Verify attention on the CPU: FFI handler vs XLA reference", "",
             f"{meta['cpu']} ({meta['cores']} cores), jax {meta['jax']}, {meta['date']}, commit {meta['commit']}.",
             f"B=1, bfloat16 pool [4, S, {meta['latent'] + meta['rope']}] (latent {meta['latent']} + rope "
             f"{meta['rope']}), scattered slots, causal mask over T query tokens after L context positions; "
             f"median of up to {meta['reps']} calls under jit after a warm-up (block_until_ready), in two rounds "
             f"of consecutive calls per impl.", ""]
    if meta.get("note"):
        lines += [meta["note"], ""]
    if has_before:
        lines += [f"'before' is the handler of commit {meta.get('before_commit', '?')} (scalar loops, double "
                  f"accumulation, one thread), timed by this script with --extension on a build of that commit "
                  f"({meta.get('before_date', '?')}).", ""]
        lines += ["| T | L | H | before µs | handler µs | reference µs | speed-up vs before | reference / handler |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    else:
        lines += ["| T | L | H | handler µs | reference µs | reference / handler |",
                  "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["reference_us"] / r["handler_us"]
        if has_before:
            before = r.get("before_us")
            lines.append(f"| {r['T']} | {r['L']} | {r['H']} | {before:.0f} | {r['handler_us']:.0f} | "
                         f"{r['reference_us']:.0f} | {before / r['handler_us']:.1f}× | {ratio:.2f}× |"
                         if before else
                         f"| {r['T']} | {r['L']} | {r['H']} | - | {r['handler_us']:.0f} | {r['reference_us']:.0f} "
                         f"| - | {ratio:.2f}× |")
        else:
            lines.append(f"| {r['T']} | {r['L']} | {r['H']} | {r['handler_us']:.0f} | {r['reference_us']:.0f} "
                         f"| {ratio:.2f}× |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="two tiny cases, small widths (checks the script runs)")
    p.add_argument("--reps", type=int, default=30, help="timed calls per case (at most)")
    p.add_argument("--budget", type=float, default=3.0,
                   help="seconds of timed calls per case and impl (at least 3 calls)")
    p.add_argument("--out", default=None, help="the JSON path; the markdown goes next to it (.md) (default: "
                   "benchmarks/results/verify_attention_cpu.json; --smoke: a temp dir)")
    p.add_argument("--before", default=None, help="a JSON written by this script for an earlier handler: its handler "
                                                     "times become the 'before' column")
    p.add_argument("--extension", default=None, help="path of another build of kdtree_jax._verify_attention_ext "
                                                        "to time instead of the installed one")
    p.add_argument("--note", default="", help="a sentence for the markdown (e.g. on the machine's load)")
    args = p.parse_args(argv)
    if args.extension:
        vffi.use_extension(args.extension)
    cases, latent, rope = (SMOKE_CASES, 16, 8) if args.smoke else (FULL_CASES, LATENT, ROPE)
    reps = 3 if args.smoke else args.reps

    with jax.default_device(jax.devices("cpu")[0]):
        meta = dict(cpu_description(), date=datetime.datetime.now().isoformat(timespec="seconds"),
                    commit=git_commit(), jax=jax.__version__, latent=latent, rope=rope, reps=reps,
                    smoke=args.smoke, extension=args.extension, note=args.note)
        print(json.dumps(meta), flush=True)
        rows = []
        for num_queries, length, num_heads in cases:
            rows.append(bench_case(num_queries, length, num_heads, latent, rope, reps, args.budget))
            print(json.dumps(rows[-1]), flush=True)

    if args.before:
        with open(args.before) as f:
            before = json.load(f)
        meta["before_commit"] = before["meta"]["commit"]
        meta["before_date"] = before["meta"]["date"]
        old = {(r["T"], r["L"], r["H"]): r["handler_us"] for r in before["rows"]}
        for r in rows:
            if (r["T"], r["L"], r["H"]) in old:
                r["before_us"] = old[(r["T"], r["L"], r["H"])]

    if args.out is None:
        args.out = os.path.join(smoke_dir("verify_attention_cpu"), "verify_attention_cpu_smoke.json") if args.smoke else RESULTS
    out_json = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out_json), exist_ok=True)
    with open(out_json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.splitext(out_json)[0] + ".md", "w") as f:
        f.write(markdown(meta, rows))
    print(markdown(meta, rows), flush=True)
    print(f"wrote {out_json} and .md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
