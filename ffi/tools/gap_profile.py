"""Where a verify-attention call's time goes inside an XLA program (GPU; issue 3's "per-call gap").

    python ffi/tools/gap_profile.py [--calls 8] [--out DIR] "B T H L" ...

For each shape: the unrolled program of benchmarks/verify_kernel.py (one call per layer, every output
returned) is timed (median wall of 20 runs), then run once under the profiler. Printed per shape: the
program's wall time per call, its kernels' time per call and their union ("busy"), the device idle per call,
every kernel of the middle calls with its start, duration and the gap before it, and the host-side events
of the run that last longest (the thunk launches: if the host launches slower than the device runs, the
device waits). The same shape is timed by the extension's CUDA-event harness (plain launches) for comparison.
The optimised HLO of each program is written under --out.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import verify_kernel as vk  # noqa: E402

from kdtree_jax.ops import ffi as vffi  # noqa: E402


def host_events(xspace_path: str, t0: int, t1: int):
    """(name, duration ns, thread line) of the host events inside [t0, t1] (ns), longest first."""
    data = jax.profiler.ProfileData.from_file(xspace_path)
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                if ev.start_ns >= t0 and ev.end_ns <= t1:
                    out.append((ev.name[:90], ev.end_ns - ev.start_ns, line.name[:30]))
    return sorted(out, key=lambda e: -e[1])


def profile_shape(batch, num_queries, heads, length, calls, out_dir):
    kv_pool = vk.make_pool(jax.random.PRNGKey(length), batch, length)
    args = vk.make_inputs(jax.random.PRNGKey(length + num_queries), kv_pool, batch, num_queries, length, True, heads)
    calls = min(calls, kv_pool.shape[0] - 1)
    fn = vk.unrolled(vk.kernel_op(), kv_pool.shape[0])(calls)
    compiled = fn.lower(*args).compile()
    with open(os.path.join(out_dir, f"hlo_B{batch}_T{num_queries}_H{heads}_L{length}.txt"), "w") as f:
        f.write(compiled.as_text() or "")
    for _ in range(20):
        jax.block_until_ready(compiled(*args))
    walls = []
    for _ in range(20):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        walls.append(time.perf_counter() - t)
    wall_us = statistics.median(walls) / calls * 1e6

    trace_dir = tempfile.mkdtemp(prefix="gap_profile_")
    try:
        jax.profiler.start_trace(trace_dir)
        try:
            jax.block_until_ready(compiled(*args))
        finally:
            jax.profiler.stop_trace()
        path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
        from kdtree_jax.profiling import busy_ns, kernel_events
        events, _ = kernel_events(path)
        events = sorted(events, key=lambda e: e[1])
        t0, t1 = events[0][1], events[-1][2]
        hosts = host_events(path, t0 - 200_000, t1)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)

    kernel_us = sum(e[2] - e[1] for e in events) / calls / 1e3
    busy_us = busy_ns(events) / calls / 1e3
    span_us = (t1 - t0) / calls / 1e3
    splits = vffi.choose_num_splits(batch, num_queries, heads, length, vffi.sm_count())
    row_groups = vffi.choose_row_groups(num_queries, heads)
    harness = vk.device_timing(batch, num_queries, heads, length, True, splits, row_groups,
                               vffi.choose_variant() if row_groups == 2 else None)
    print(f"\n=== B={batch} T={num_queries} H={heads} L={length}: {calls} calls, splits {splits}, row groups {row_groups}")
    print(f"wall/call {wall_us:.1f} us | profiled span/call {span_us:.1f} | kernels/call {kernel_us:.1f} | "
          f"busy/call {busy_us:.1f} | idle/call {span_us - busy_us:.1f} | kernels {len(events)} | harness {harness}")
    lines = sorted({e[0] for e in events})
    print(f"device lines: {lines}")
    prev_end = None
    for e in events:
        gap = (e[1] - prev_end) / 1e3 if prev_end is not None else 0.0
        print(f"  t={(e[1] - t0) / 1e3:9.1f} dur={(e[2] - e[1]) / 1e3:7.1f} gap={gap:6.1f}  {e[0][:12]}  {e[3][:70]}")
        prev_end = e[2] if prev_end is None else max(prev_end, e[2])
    print("host events in the run (longest 25):")
    for name, ns, line in hosts[:25]:
        print(f"  {ns / 1e3:9.1f} us  {line:30s} {name}")
    by_name = {}
    for name, ns, line in hosts:
        key = name.split(":")[0][:50]
        by_name.setdefault(key, [0, 0])
        by_name[key][0] += ns
        by_name[key][1] += 1
    print("host events by name (total us, count; top 20):")
    for key, (ns, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"  {ns / 1e3:9.1f} us  x{n:4d}  {key}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="+", help='"B T H L"')
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    if jax.default_backend() != "gpu" or not vffi.cuda_built():
        sys.exit("needs a GPU and the extension built with CUDA")
    os.makedirs(args.out, exist_ok=True)
    for shape in args.shapes:
        profile_shape(*map(int, shape.split()), calls=args.calls, out_dir=args.out)


if __name__ == "__main__":
    main()
