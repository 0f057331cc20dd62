"""CPU A/B: the server at Python's 5 ms switch interval vs SWITCH_INTERVAL_S, the same requests, alternating rounds."""
import json, os, subprocess, sys, time
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks")); sys.path.insert(0, ROOT)
import numpy as np
import serve_load as sl
from kdtree_jax.generate import DEFAULT_CHECKPOINT

docs = sl.corpus_docs(os.path.join(DEFAULT_CHECKPOINT, "tokenizer"), 65)
reqs = sl.make_requests(48, (8, 64), (16, 48), 0, docs)
servers = {}
for name, interval in (("5ms", 0.005), ("0.5ms", None)):
    port = sl._free_port()
    code = ("import sys; import kdtree_jax.serve.__main__ as m; "
            + (f"m.SWITCH_INTERVAL_S = {interval}; " if interval else "")
            + "sys.exit(m.main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "--port", str(port), "--max-batch", "16", "--max-len", "256",
           "--max-queue", "100000", "--no-speculative", "--drain-timeout", "2"]
    log = f"/tmp/serve_switch_ab_{name}.log"
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    servers[name] = (proc, f"http://127.0.0.1:{port}", log)
for name, (proc, url, log) in servers.items():
    sl.wait_ready(name, proc, url, log, 600)
out = {k: [] for k in servers}
try:
    sl.drive(servers["0.5ms"][1], reqs[:8], 8, "default")  # warm both once (untimed)
    sl.drive(servers["5ms"][1], reqs[:8], 8, "default")
    for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 8):
        for name in (("5ms", "0.5ms") if rnd % 2 == 0 else ("0.5ms", "5ms")):
            results, wall, _ = sl.drive(servers[name][1], reqs, 16, "default")
            toks = sum(r.get("tokens", 0) if isinstance(r, dict) else 0 for r in results)
            out[name].append(toks / wall)
            print(name, rnd, round(toks / wall, 1), "tok/s", round(wall, 2), "s", flush=True)
finally:
    for proc, _, _ in servers.values():
        proc.terminate()
    for proc, _, _ in servers.values():
        proc.wait(timeout=30)
print(json.dumps({k: {"rounds": v, "median": float(np.median(v))} for k, v in out.items()}))
