"""Compact view of benchmarks/verify_kernel.py's JSON lines (stdin): one short line per row."""
import json
import sys

for line in sys.stdin:
    line = line.strip()
    if not line.startswith("{"):
        if "Error" in line or "Traceback" in line or "failed" in line:
            print(line[:200])
        continue
    r = json.loads(line)
    if "us" in r:
        print(f"B{r['B']} L{r['L']} T{r['T']} H{r.get('H', 8)} {r['slots'][:4]} {r['num_splits']}x{r['row_groups']} "
              f"{r['us']:.1f}us {r['gbps']:.0f}GB/s {r['tflops']:.1f}TF {100 * r['roofline_frac']:.0f}%"
              + (f" | events: plain {r['device_us']} graph {r['device_graph_us']} main {r['device_main_us']} "
                 f"merge {r['device_merge_us']}" if "device_us" in r else ""), flush=True)
    else:
        print(line[:300], flush=True)
