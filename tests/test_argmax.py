"""argmax_last == jnp.argmax and top_k_last == jax.lax.top_k on fresh random logits, with ties, -inf rows
and odd vocabulary sizes."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kdtree_jax.ops.argmax import argmax_last, top_k_last


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


def top_k_inputs(rng, shape):
    """Rows full of ties (a few distinct values, +0.0 and -0.0 among them, ties across chunks), smooth rows,
    all -inf rows and rows with fewer finite values than k (the rest -inf ties: lax.top_k takes their
    lowest indices)."""
    vocab = shape[-1]
    ties = rng.choice(np.array([-2.0, -1.0, -0.0, 0.0, 1.0, -np.inf], np.float32), size=shape)
    ties[0, 0, :] = 1.0  # one value everywhere
    ties[1, 0, :] = -np.inf
    ties[1, 1, :] = -np.inf
    ties[1, 1, rng.choice(vocab, 2, replace=False)] = rng.standard_normal(2)  # 2 finite values, k up to 8
    top = ties[1, 2]
    top[top == 1.0] = 0.0
    top[rng.choice(vocab, 3, replace=False)] = 1.0  # 3 tied maxima, then many tied 0.0 / -0.0
    smooth = rng.standard_normal(shape).astype(np.float32)
    smooth[0, 1, vocab - 1] = 50.0  # the maximum in the last chunk
    smooth[1, 0, :vocab // 2] = -np.inf
    sparse = np.where(rng.random(shape) < 0.5, -np.inf, rng.choice(np.float32([-0.0, 0.0]), size=shape))
    return ties, smooth, sparse.astype(np.float32)


top_k_last_jit = jax.jit(top_k_last, static_argnums=1)


# chunked (20480, 6000, 8192: the chunk maxima, then the chosen chunks), whole rows (4099 prime, 97, k = vocab),
# and k past _MAX_ROUNDS (lax.top_k itself)
@pytest.mark.parametrize("vocab,k,dtype", [(20480, 4, jnp.float32), (6000, 8, jnp.bfloat16), (8192, 1, jnp.float32),
                                           (4099, 4, jnp.bfloat16), (97, 3, jnp.float32), (4, 4, jnp.bfloat16),
                                           (97, 20, jnp.float32)])
def test_top_k_last_matches_lax_top_k(vocab, k, dtype):
    rng = np.random.default_rng(vocab * 10 + k)
    for x in top_k_inputs(rng, (2, 3, vocab)):
        x = jnp.asarray(x, dtype)
        values, indices = top_k_last_jit(x, k)
        assert values.dtype == x.dtype and indices.dtype == jnp.int32
        # lax.top_k orders -0.0 below +0.0 in its sort lowering (the CPU) and ties them in the GPU TopK kernel,
        # as top_k_last does: the reference runs on x with -0.0 made +0.0 (there the lowerings agree), and the
        # values must be x's own bits (-0.0 kept) at those indices.
        _, want_indices = jax.lax.top_k(jnp.where(x == 0, jnp.zeros_like(x), x), k)
        np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
        np.testing.assert_array_equal(np.asarray(values).view(np.uint8),
                                      np.take_along_axis(np.asarray(x), np.asarray(want_indices), -1).view(np.uint8))


def test_top_k_last_is_plain_reduces():
    text = top_k_last_jit.lower(jnp.zeros((2, 3, 20480), jnp.float32), 4).compile().as_text()  # compiled above
    assert "topk" not in text.lower() and "custom-call" not in text and "sort" not in text.lower()
