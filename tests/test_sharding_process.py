"""tests/test_sharding.py in a fresh process.

Late in a full-suite run XLA:CPU (jax 0.10.2) segfaulted three times while compiling test_sharding's sharded decode
loop (test_no_all_gather_of_parameters_or_pool, test_sharded_greedy_speculative_output_equals_unsharded), never when
the file ran alone; the cause is not found. A crash there would take the whole run with it, so the file runs in a
child pytest, with this process's environment (8 forced CPU devices, KDTREE_JAX_SLOW)."""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sharding_in_a_fresh_process():
    env = dict(os.environ, KDTREE_JAX_SHARDING_PROCESS="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                          os.path.join(HERE, "test_sharding.py")], env=env, cwd=os.path.dirname(HERE),
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout, res.stdout[-2000:]
