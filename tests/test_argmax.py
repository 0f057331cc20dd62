"""argmax_last == jnp.argmax on fresh random logits, with ties, -inf rows and odd vocabulary sizes."""
import numpy as np
import jax.numpy as jnp
import pytest

from kdtree_jax.ops.argmax import argmax_last


@pytest.mark.parametrize("vocab", [8192, 163840 // 8, 6000, 1031, 4099, 97])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_argmax_last_matches_jnp_argmax(vocab, dtype):
    rng = np.random.default_rng(vocab)
    ties = rng.integers(-3, 3, size=(3, 4, vocab)).astype(np.float32)  # many equal maxima per row
    smooth = rng.standard_normal((3, 4, vocab)).astype(np.float32) * 4
    smooth[0, 1, :] = -np.inf
    smooth[2, 3, vocab - 1] = 50.0  # the maximum in the last chunk
    for x in (ties, smooth):
        x = jnp.asarray(x, dtype)
        got = argmax_last(x)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
