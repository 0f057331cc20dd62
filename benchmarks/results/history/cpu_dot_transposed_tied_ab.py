"""A tied-head variant of the default pair (its lm head replaced by the embedding: outputs differ, costs are what a
tied model pays) decoded greedy on the CPU: AR and DDTree 4, dot_transposed (now) vs x @ w.T (before)."""
import sys, time
import kdtree_jax.runtime as rt; rt.configure()
import jax, jax.numpy as jnp, numpy as np
import kdtree_jax
from kdtree_jax.model import layers, transformer
from kdtree_jax.checkpoint import load_checkpoint
from kdtree_jax.speculative.engine import generate
arm = sys.argv[1]
if arm == "before":
    plain = lambda x, w, preferred_element_type=None: jnp.dot(x, w.T, preferred_element_type=preferred_element_type)
    transformer.dot_transposed = plain
target, drafter, tok = load_checkpoint("checkpoints/default", dtype="auto")
target.lm_head = None
prompts = [tok.encode(p) for p in ("def fibonacci(n):", "import os\nimport sys\n", "class Tree:\n    def __init__(self", "for i in range(10):")]
for budget in tuple(int(b) for b in sys.argv[2].split(",")):
    generate(target, drafter, prompts[0], max_new_tokens=64, budget=budget)  # compile
    ts = []
    for rep in range(3):
        n, t = 0, time.perf_counter()
        for p in prompts:
            r = generate(target, drafter, p, max_new_tokens=64, budget=budget)
            n += 64
        ts.append(n / (time.perf_counter() - t))
    print(arm, "budget", budget, "tok/s (end to end, median of 3)", round(float(np.median(ts)), 1), flush=True)
