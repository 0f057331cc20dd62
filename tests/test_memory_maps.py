"""tests/conftest.py's guard against running out of memory mappings: XLA:CPU maps every executable it loads, and a
full-suite process that reached vm.max_map_count segfaulted inside the next compile. Dropping JAX's caches frees
the executables and their mappings."""

import sys

import jax
import jax.numpy as jnp
import pytest

from conftest import max_memory_maps, memory_maps, release_executables_if_many_maps


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_releasing_executables_frees_their_memory_maps():
    assert max_memory_maps() > 0
    assert release_executables_if_many_maps(limit=1 << 40) is False  # under the limit: nothing is dropped
    before = memory_maps()
    fns = [jax.jit(lambda x, i=i: jnp.tanh(x * i) @ x.T + i) for i in range(8)]  # eight programs of their own
    for fn in fns:
        fn(jnp.ones((16, 16))).block_until_ready()
    compiled = memory_maps()
    assert compiled > before
    assert release_executables_if_many_maps(limit=0) is True
    assert memory_maps() < compiled
