"""ops/topk.py: log_softmax_top_k == lax.top_k(log_softmax(logits / t), k) on every path.

CPU: the XLA path against the formulation and a float64 numpy reference (ties: the lower index first), the
temperature folding the engine relies on (log_softmax(log_softmax(x) / t) = log_softmax(x / t)), argument errors.
GPU (marked `gpu`, skipped without an extension built with the CUDA op): the kernel (ffi/topk.cu) against the float64
reference on fresh random inputs, odd vocabularies (unaligned rows: the element-wise head and tail), every list size,
0 / 1 / 256 rows, bfloat16 and float32, rows of ties, -inf and NaN entries, poisoned outputs, inside a jitted
while_loop (a CUDA graph), under vmap, and under compute-sanitizer.
"""

from __future__ import annotations

import functools
import shutil
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SANITIZER_CLEAN, run_compute_sanitizer
from kdtree_jax.ops import topk as topk_ops
from kdtree_jax.ops.topk import log_softmax_top_k


def reference(logits, k: int, temperature: float = 1.0):
    """(values, indices) in float64: the logits scaled in float32 (as both paths do), log-probs in float64, sorted by
    (log-prob descending, index ascending)."""
    x = np.asarray(jnp.asarray(logits).astype(jnp.float32))
    if temperature != 1.0:
        x = x / np.float32(temperature)
    x = x.astype(np.float64)
    flat = x.reshape(-1, x.shape[-1])
    with np.errstate(invalid="ignore", divide="ignore"):
        m = flat.max(axis=-1, keepdims=True)
        lp = flat - (m + np.log(np.exp(flat - m).sum(axis=-1, keepdims=True)))
    ids = np.arange(flat.shape[-1])
    order = np.stack([np.lexsort((ids, -row)) for row in lp])[:, :k] if flat.shape[0] else np.zeros((0, k), int)
    vals = np.take_along_axis(lp, order, axis=-1)
    lead = x.shape[:-1]
    return vals.reshape(lead + (k,)), order.reshape(lead + (k,)), lp.reshape(x.shape)


def assert_matches(got, logits, k, temperature=1.0, exact_indices=False):
    """Values within a few ulp of the float64 reference; indices equal, except (unless exact_indices) where the
    reference's log-probs tie to within rounding (then the chosen index must still hold a log-prob that close)."""
    vals, idx = (np.asarray(a) for a in got)
    assert vals.dtype == np.float32 and idx.dtype == np.int32
    ref_vals, ref_idx, lp = reference(logits, k, temperature)
    assert vals.shape == idx.shape == ref_vals.shape
    np.testing.assert_allclose(vals, ref_vals, rtol=2e-6, atol=2e-6)
    if exact_indices:
        np.testing.assert_array_equal(idx, ref_idx)
        return
    differ = idx != ref_idx
    if differ.any():
        flat_lp = lp.reshape(-1, lp.shape[-1])
        rows = np.nonzero(differ.reshape(-1, k))[0]
        picked = np.take_along_axis(flat_lp, idx.reshape(-1, k).astype(np.int64), axis=-1)
        gap = np.abs(picked - ref_vals.reshape(-1, k))[differ.reshape(-1, k)]
        assert (gap <= 2e-6).all(), f"indices differ beyond near ties in rows {sorted(set(rows.tolist()))[:8]}"
    for row in idx.reshape(-1, k):
        assert len(set(row.tolist())) == k


needs_cuda_op = pytest.mark.skipif(not topk_ops.cuda_built(), reason="extension built without the CUDA top-k op")


def near_tie_rows(logits, k, temperature=1.0, gap=1e-4):
    """[...] True where two of the row's k + 1 best log-probs lie within `gap` (two formulations may order them
    differently by rounding alone)."""
    vals = reference(logits, min(k + 1, logits.shape[-1]), temperature)[0]
    with np.errstate(invalid="ignore"):
        return (np.abs(np.diff(vals, axis=-1)) < gap).any(-1)


@functools.partial(jax.jit, static_argnames=("k", "temperature", "impl"))
def op(logits, k, temperature=1.0, impl="auto"):
    return log_softmax_top_k(logits, k, temperature, impl=impl)


# ---------------------------------------------------------------------------------------------------------- CPU


@pytest.fixture(scope="module")
def logits_f32():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 1031)).astype(np.float32) * 3
    x[0, 1, rng.integers(0, 1031, 40)] = -np.inf
    return jnp.asarray(x)


# A GPU runs the CUDA op under "auto" (its tests are below): the two tests of the XLA path's lowering are CPU-only.
on_cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU lowering (a GPU runs the CUDA op)")


@on_cpu_only
def test_xla_path_is_the_formulation(logits_f32):
    """On a CPU the op is lax.top_k(log_softmax(x / t)) itself, compiled as one program: bit for bit (op by op, XLA's
    own reductions may round the last bit otherwise); and the float64 reference's values."""
    formulation = jax.jit(lambda x, t: jax.lax.top_k(jax.nn.log_softmax(x if t == 1.0 else x / jnp.float32(t),
                                                                         axis=-1), 4), static_argnums=1)
    for temperature in (1.0, 0.7):
        got = op(logits_f32, k=4, temperature=temperature)
        want = formulation(logits_f32, temperature)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        assert_matches(got, logits_f32, 4, temperature)


def test_ties_take_the_lower_index_first():
    rng = np.random.default_rng(1)
    ties = rng.integers(-3, 3, size=(4, 97)).astype(np.float32)
    ties[1] = 2.0  # one value everywhere: indices 0..k-1
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(ties, dtype)
        got = op(x, k=8)
        assert_matches(got, x, 8, exact_indices=True)
        np.testing.assert_array_equal(np.asarray(got[1])[1], np.arange(8))


def test_temperature_folds_into_the_logits(logits_f32):
    """What the engine did (log_softmax of the drafter's log-probs / t, then top_k) and what it does now (the logits
    and t to the op) pick the same candidates with the same log-probs up to rounding."""
    for temperature in (0.3, 2.0):
        before = jax.lax.top_k(jax.nn.log_softmax(jax.nn.log_softmax(logits_f32, axis=-1) / temperature, axis=-1), 4)
        after = op(logits_f32, k=4, temperature=temperature)
        np.testing.assert_array_equal(np.asarray(after[1]), np.asarray(before[1]))
        np.testing.assert_allclose(np.asarray(after[0]), np.asarray(before[0]), rtol=1e-5, atol=1e-5)


def test_leading_dims_vmap_and_bfloat16(logits_f32):
    x = logits_f32.astype(jnp.bfloat16)
    got = op(x, k=3)
    assert got[0].shape == (3, 5, 3)
    assert_matches(got, x, 3)
    mapped = jax.vmap(lambda r: log_softmax_top_k(r, 3))(x)
    np.testing.assert_array_equal(np.asarray(mapped[1]), np.asarray(got[1]))
    flat = op(x.reshape(15, -1), k=3)  # rows are independent of their layout
    np.testing.assert_array_equal(np.asarray(flat[1]).reshape(3, 5, 3), np.asarray(got[1]))


def test_argument_errors():
    x = jnp.zeros((2, 10), jnp.float32)
    cases = [(dict(k=0), "k must be in"), (dict(k=11), "k must be in"), (dict(k=2, temperature=0.0), "temperature"),
             (dict(k=2, temperature=-1.0), "temperature"), (dict(k=2, impl="fast"), "impl"),
             (dict(k=2.0), "k must be a Python int")]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            log_softmax_top_k(x, **kwargs)
    with pytest.raises(ValueError, match="floating"):
        log_softmax_top_k(jnp.zeros((2, 10), jnp.int32), 2)
    with pytest.raises(ValueError, match="V"):
        log_softmax_top_k(jnp.zeros((), jnp.float32), 1)
    big = jnp.zeros((1, topk_ops.MAX_K + 1), jnp.float32)
    with pytest.raises(ValueError, match=f"k <= {topk_ops.MAX_K}"):
        log_softmax_top_k(big, topk_ops.MAX_K + 1, impl="cuda")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        log_softmax_top_k(jnp.zeros((1, 8), jnp.float16), 2, impl="cuda")
    # "auto" past the kernel's limits runs XLA.
    vals, idx = log_softmax_top_k(big, topk_ops.MAX_K + 1)
    np.testing.assert_array_equal(np.asarray(idx)[0], np.arange(topk_ops.MAX_K + 1))


@on_cpu_only
def test_cpu_lowering_has_no_custom_call(logits_f32):
    hlo = op.lower(logits_f32, k=4).as_text()
    assert topk_ops.TARGET not in hlo


@needs_cuda_op
def test_cuda_lowering_calls_the_op(logits_f32):
    """Lowered for a GPU, "auto" takes the custom call within the kernel's limits and XLA's TopK past them."""
    lower = lambda x, k: jax.jit(functools.partial(log_softmax_top_k, k=k)).trace(x).lower(  # noqa: E731
        lowering_platforms=("cuda",)).as_text()
    assert topk_ops.TARGET in lower(logits_f32, 4)
    assert topk_ops.TARGET not in lower(logits_f32, topk_ops.MAX_K + 1)


# ---------------------------------------------------------------------------------------------------------- GPU

def poison_allocator(*shapes_and_dtypes):
    """Hand the allocator NaN-filled (indices: -1) blocks of the outputs' sizes: an unwritten element shows."""
    blocks = [jnp.full(shape, jnp.nan if jnp.issubdtype(dtype, jnp.floating) else -1, dtype)
              for shape, dtype in shapes_and_dtypes]
    jax.block_until_ready(blocks)
    for block in blocks:
        block.delete()


def cuda(logits, k, temperature=1.0):
    return op(logits, k=k, temperature=temperature, impl="cuda")


def random_logits(rng, rows, vocab, dtype, scale=3.0):
    return jnp.asarray((rng.standard_normal((rows, vocab)) * scale).astype(np.float32)).astype(dtype)


@pytest.mark.gpu
@needs_cuda_op
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("vocab", [1, 7, 8193, 20480 + 3])
@pytest.mark.parametrize("rows", [0, 1, 256])
@pytest.mark.parametrize("k", [1, 4, 8, topk_ops.MAX_K])
def test_cuda_matches_reference(k, rows, vocab, dtype):
    if k > vocab:
        pytest.skip("k > V")
    rng = np.random.default_rng([k, rows, vocab, int(dtype == jnp.bfloat16)])
    x = random_logits(rng, rows, vocab, dtype)
    poison_allocator(((rows, k), jnp.float32), ((rows, k), jnp.int32))
    got = cuda(x, k)
    # bfloat16 logits tie often: their log-probs tie exactly, so the order among them is checked exactly.
    assert_matches(got, x, k, exact_indices=dtype == jnp.bfloat16)
    if rows:  # the same shapes again on other values: every element is rewritten
        y = random_logits(rng, rows, vocab, dtype)
        assert_matches(cuda(y, k), y, k, exact_indices=dtype == jnp.bfloat16)


@pytest.mark.gpu
@needs_cuda_op
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cuda_ties_inf_and_nan(dtype):
    rng = np.random.default_rng(7)
    vocab = 8193
    x = rng.integers(-3, 3, size=(8, vocab)).astype(np.float32)  # many equal maxima a row
    x[1] = 1.5  # every value equal: indices 0..k-1
    x[2, rng.integers(0, vocab, 3000)] = -np.inf  # -inf entries
    x[3] = -np.inf
    x[3, [5, 4000]] = 1.0  # two finite entries, k = 8: six -inf ones by index
    x[4, : vocab - 1] = -np.inf  # only the last entry is finite
    x[5, 100:] = 7.0  # ties at the row's end (the tail path)
    for k in (1, 4, 8, topk_ops.MAX_K):
        xs = jnp.asarray(x[:6], dtype)
        assert_matches(cuda(xs, k), xs, k, exact_indices=True)
        np.testing.assert_array_equal(np.asarray(cuda(xs, k)[1])[1], np.arange(k))
    # A row of -inf: values NaN (-inf - -inf, as XLA gives), indices 0..k-1.
    vals, idx = cuda(jnp.full((1, vocab), -jnp.inf, dtype), 4)
    assert np.isnan(np.asarray(vals)).all()
    np.testing.assert_array_equal(np.asarray(idx)[0], np.arange(4))
    # A NaN logit: its row's values are NaN, the selection treats it as -inf (every index real and distinct); the
    # other rows are untouched.
    y = x[:2].copy()
    y[0, [3, 11]] = np.nan
    vals, idx = cuda(jnp.asarray(y, dtype), 8)
    vals, idx = np.asarray(vals), np.asarray(idx)
    assert np.isnan(vals[0]).all() and not np.isnan(vals[1]).any()
    assert set(idx[0].tolist()).isdisjoint({3, 11}) and len(set(idx[0].tolist())) == 8
    np.testing.assert_array_equal(idx[1], np.arange(8))


@pytest.mark.gpu
@needs_cuda_op
def test_cuda_temperature_and_engine_equivalence():
    """With a temperature, against the reference and against what the engine computed before (log_softmax of the
    drafter's log-probs / t, then XLA's top_k): the default pair's shape, [16, 16, 8192] float32."""
    rng = np.random.default_rng(11)
    x = jnp.asarray((rng.standard_normal((16, 16, 8192)) * 4).astype(np.float32))
    for temperature in (1.0, 0.5, 1.7):
        got = cuda(x, 4, temperature)
        assert_matches(got, x, 4, temperature)
        before = jax.jit(lambda v: jax.lax.top_k(jax.nn.log_softmax(jax.nn.log_softmax(v, axis=-1) / temperature,
                                                                    axis=-1), 4))(x)
        np.testing.assert_allclose(np.asarray(got[0]), np.asarray(before[0]), rtol=1e-5, atol=1e-5)
        clear = ~near_tie_rows(x, 4, temperature)  # rows whose top-5 log-probs are >= 1e-4 apart
        assert clear.mean() > 0.99
        np.testing.assert_array_equal(np.asarray(got[1])[clear], np.asarray(before[1])[clear])
    # "auto" lowers to the op on a GPU, and vmap keeps it one call.
    np.testing.assert_array_equal(np.asarray(op(x, k=4)[1]), np.asarray(cuda(x, 4)[1]))
    mapped = jax.jit(jax.vmap(lambda r: log_softmax_top_k(r, 4, impl="cuda")))(x)
    np.testing.assert_array_equal(np.asarray(mapped[1]), np.asarray(cuda(x, 4)[1]))


@pytest.mark.gpu
@needs_cuda_op
def test_cuda_op_inside_while_loop():
    """Inside a jitted while_loop (a CUDA graph when XLA captures the body): each step's candidates feed the next
    step's logits, so a stale replay shows."""
    rng = np.random.default_rng(13)
    x0 = jnp.asarray(rng.standard_normal((32, 4099)).astype(np.float32))

    def step(x):
        vals, idx = log_softmax_top_k(x, 4, impl="cuda")
        bump = jnp.zeros_like(x).at[jnp.arange(x.shape[0])[:, None], idx].add(-1.0)  # demote this step's winners
        return x + bump + 1e-3 * vals.sum(-1, keepdims=True), idx

    def body(carry):
        i, x, seen = carry
        x, idx = step(x)
        return i + 1, x, seen.at[i].set(idx)

    loop = jax.jit(lambda x: jax.lax.while_loop(lambda c: c[0] < 5, body,
                                                (0, x, jnp.zeros((5, 32, 4), jnp.int32))))
    _, x_loop, seen = loop(x0)
    x = x0
    step_jit = jax.jit(step)
    for i in range(5):
        x, idx = step_jit(x)
        np.testing.assert_array_equal(np.asarray(seen[i]), np.asarray(idx))
    np.testing.assert_array_equal(np.asarray(x_loop), np.asarray(x))


SANITIZER_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from kdtree_jax.ops.topk import log_softmax_top_k
    rng = np.random.default_rng(0)
    # Both dtypes, aligned and unaligned rows, every list size, a row of -inf, 1 and 16 warps a block.
    for rows, vocab in ((3, 7), (5, 8193), (2, 163840 // 8 + 3)):
        for dtype in (jnp.float32, jnp.bfloat16):
            x = rng.standard_normal((rows, vocab)).astype(np.float32)
            x[0] = -np.inf
            x = jnp.asarray(x).astype(dtype)
            for k in (1, 2, 4, 8, 16, 32):
                if k <= vocab:
                    vals, idx = jax.jit(lambda v: log_softmax_top_k(v, k, 0.8, impl="cuda"))(x)
                    assert (np.asarray(idx) >= 0).all() and (np.asarray(idx) < vocab).all()
    print("SANITIZER-CASE-OK")
""")


@pytest.mark.gpu
@needs_cuda_op
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer_is_clean(tool):
    """The kernel under compute-sanitizer (racecheck and synccheck on it only: its name holds "log_softmax_top_k")."""
    returncode, log = run_compute_sanitizer(tool, SANITIZER_SCRIPT, "log_softmax_top_k")
    assert "SANITIZER-CASE-OK" in log, log[-4000:]
    assert returncode == 0 and SANITIZER_CLEAN[tool] in log, log[-4000:]
