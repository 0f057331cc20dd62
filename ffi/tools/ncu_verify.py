"""One verify-attention shape, called a few times, for Nsight Compute (ffi/tools/ncu_verify.sh).

    python ffi/tools/ncu_verify.py B T H L [VARIANT]     (VARIANT: kdtree_jax.ops.ffi.VARIANTS, default auto)
"""
import sys

import jax
import jax.numpy as jnp

from kdtree_jax.ops import ffi as vffi
from kdtree_jax.ops.masks import ancestor_mask

batch, num_queries, heads, length = map(int, sys.argv[1:5])
variant = sys.argv[5] if len(sys.argv) > 5 else "auto"
k = jax.random.split(jax.random.PRNGKey(0), 3)
kv_pool = jax.random.normal(k[0], (1, batch * length, 576), jnp.bfloat16)
q = jax.random.normal(k[1], (batch, num_queries, heads, 576), jnp.bfloat16)
kv_slots = jax.random.permutation(k[2], batch * length).astype(jnp.int32).reshape(batch, length)
kv_lens = jnp.full((batch,), length, jnp.int32)
parents = jnp.asarray([[-1] + list(range(num_queries - 1))] * batch, jnp.int32)
fn = jax.jit(lambda *a: vffi.verify_attention_ffi(*a, softmax_scale=0.07, variant=variant))
for _ in range(3):
    jax.block_until_ready(fn(q, kv_pool, jnp.int32(0), kv_slots, kv_lens, ancestor_mask(parents)))
print("done", batch, num_queries, heads, length, variant)
