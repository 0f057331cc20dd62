"""The FFI verify-attention op (CPU handler) and the XLA baseline (ops/xla.py) against the pure-JAX oracle.

Inputs are fresh random draws: slot tables are random permutations (scattered rows), lengths are not
multiples of any tile (the prefix may be empty), masks are causal, random trees' ancestor masks or random
bits (which leave some queries with nothing visible). Shapes are few and static so the compiled functions
are shared across draws; lengths and masks are data, so they vary freely without recompiling.
`make_case` is shared with tests/test_verify_attention_gpu.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.ops import verify_attention
from kdtree_jax.ops import ffi as vffi
from kdtree_jax.ops.masks import ancestor_mask, causal_mask, pack_mask_bits
from kdtree_jax.ops.xla import DEFAULT_CHUNK, verify_attention_xla

needs_ffi = pytest.mark.skipif(not vffi.available(), reason="compiled extension not built")


@pytest.fixture(autouse=True)
def _on_cpu():
    """These tests are about the CPU handler: keep them on the host even where a GPU is the default."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def random_masks(rng: np.random.Generator, batch: int, num_queries: int):
    """One mask kind per sequence: causal (a chain), a random tree's ancestors, or random bits."""
    rows = []
    for _ in range(batch):
        kind = rng.integers(3)
        if kind == 0:
            rows.append(causal_mask(1, num_queries)[0])
        elif kind == 1:
            parents = np.array([-1] + [rng.integers(0, i) for i in range(1, num_queries)], np.int32)
            rows.append(ancestor_mask(jnp.asarray(parents)[None])[0])
        else:
            bits = rng.random((num_queries, num_queries)) < 0.3
            bits[rng.random(num_queries) < 0.2] = False  # some queries see no query token at all
            rows.append(pack_mask_bits(jnp.asarray(bits)))
    return jnp.stack(rows)


def make_case(seed: int, batch: int, num_queries: int, num_heads: int, max_len: int, *, latent: int, rope: int,
              dtype, num_layers: int = 3, num_slots: int | None = None, lens=None):
    """Random inputs of the contract; lengths default to random values in [T, Lmax] with the special
    cases (prefix 0, nothing at all, full table) mixed in."""
    rng = np.random.default_rng(seed)
    width = latent + rope
    num_slots = num_slots or batch * max_len + 7
    keys = jax.random.split(jax.random.PRNGKey(seed), 2)
    q = jax.random.normal(keys[0], (batch, num_queries, num_heads, width), jnp.float32).astype(dtype)
    kv_pool = jax.random.normal(keys[1], (num_layers, num_slots, width), jnp.float32).astype(dtype)
    kv_slots = np.stack([rng.permutation(num_slots)[:max_len] for _ in range(batch)]).astype(np.int32)
    if lens is None:
        lens = rng.integers(num_queries, max_len + 1, size=batch)
        specials = [num_queries, max_len, 0]  # empty prefix; full table; nothing visible (kv_len 0)
        for b in range(min(batch, len(specials))):
            if rng.random() < 0.5:
                lens[b] = specials[b]
    kv_lens = jnp.asarray(np.asarray(lens, np.int32))
    tree_mask = random_masks(rng, batch, num_queries)
    layer = jnp.int32(rng.integers(num_layers))
    return q, kv_pool, layer, jnp.asarray(kv_slots), kv_lens, tree_mask


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


def check_against_reference(out, lse, ref_out, ref_lse, *, tol: float):
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    ref_out, ref_lse = np.asarray(ref_out, np.float32), np.asarray(ref_lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty, err_msg="rows with nothing visible differ")
    assert np.all(out[empty] == 0.0), "a row with nothing visible must give out = 0"
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=tol, atol=tol)
    assert rel_err(out, ref_out) < tol, rel_err(out, ref_out)


@functools.cache
def jitted(impl: str, softmax_scale: float, rope_dim: int, num_splits: int = 0):
    return jax.jit(functools.partial(verify_attention, softmax_scale=softmax_scale, rope_dim=rope_dim,
                                     num_splits=num_splits, impl=impl))


def reference_f32(case, softmax_scale, rope_dim):
    """The oracle on float32 copies of the inputs (the op's own inputs may be bf16)."""
    q, kv_pool, *rest = case
    f = jitted("reference", softmax_scale, rope_dim)
    return f(q.astype(jnp.float32), kv_pool.astype(jnp.float32), *rest)


# (B, T, H, Lmax, Dc, Dr, dtype): every T of the issue, H in {1, 8, 16}, odd table lengths.
CPU_SHAPES = [
    (3, 1, 8, 45, 32, 8, jnp.float32),
    (2, 2, 16, 37, 32, 8, jnp.float32),
    (3, 7, 1, 61, 24, 8, jnp.float32),
    (2, 16, 8, 83, 32, 8, jnp.float32),
    (1, 33, 1, 101, 16, 4, jnp.float32),
    (2, 64, 1, 150, 32, 8, jnp.float32),
    (1, 200, 1, 299, 16, 8, jnp.float32),
    (2, 7, 8, 77, 512, 64, jnp.bfloat16),  # the CUDA fast-path geometry, through the CPU handler
]


@needs_ffi
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: f"B{s[0]}T{s[1]}H{s[2]}L{s[3]}D{s[4]}+{s[5]}{s[6].__name__}")
def test_cpu_ffi_matches_reference(shape):
    batch, num_queries, num_heads, max_len, latent, rope, dtype = shape
    scale = (latent + rope) ** -0.5
    ffi_fn = jitted("ffi", scale, rope)
    for draw in range(3):
        case = make_case(1000 * draw + max_len, batch, num_queries, num_heads, max_len, latent=latent, rope=rope,
                         dtype=dtype)
        out, lse = ffi_fn(*case)
        assert out.dtype == dtype and out.shape == (batch, num_queries, num_heads, latent)
        assert lse.dtype == jnp.float32 and lse.shape == (batch, num_queries, num_heads)
        ref_out, ref_lse = reference_f32(case, scale, rope)
        check_against_reference(out, lse, ref_out, ref_lse, tol=1e-5 if dtype == jnp.float32 else 1e-2)


@needs_ffi
def test_nothing_visible_gives_zero_and_neg_inf():
    case = make_case(7, 2, 5, 2, 19, latent=16, rope=4, dtype=jnp.float32, lens=[0, 5])
    q, kv_pool, layer, kv_slots, kv_lens, _ = case
    empty_mask = jnp.zeros((2, 5, 1), jnp.uint32)  # and with prefix 0 (kv_len = T) nothing is left
    out, lse = jitted("ffi", 0.25, 4)(q, kv_pool, layer, kv_slots, kv_lens, empty_mask)
    assert np.all(np.asarray(out) == 0.0) and np.all(np.isneginf(np.asarray(lse)))


@needs_ffi
def test_out_of_range_slots_and_layer_are_clamped_like_the_reference():
    case = make_case(11, 2, 3, 2, 23, latent=16, rope=4, dtype=jnp.float32)
    q, kv_pool, _, kv_slots, kv_lens, tree_mask = case
    bad_slots = kv_slots.at[:, ::3].set(jnp.int32(10**6)).at[:, 1::5].set(-5)
    for layer in (jnp.int32(-2), jnp.int32(99)):
        out, lse = jitted("ffi", 0.25, 4)(q, kv_pool, layer, bad_slots, kv_lens, tree_mask)
        ref_out, ref_lse = jitted("reference", 0.25, 4)(q, kv_pool, layer, bad_slots, kv_lens, tree_mask)
        check_against_reference(out, lse, ref_out, ref_lse, tol=1e-5)


@needs_ffi
def test_mixed_dtypes_and_vmap():
    """float32 queries over a bfloat16 pool; vmap over a leading axis runs the handler per element."""
    q, kv_pool, layer, kv_slots, kv_lens, tree_mask = make_case(5, 2, 3, 2, 31, latent=16, rope=4, dtype=jnp.float32)
    kv_pool = kv_pool.astype(jnp.bfloat16)
    out, lse = jitted("ffi", 0.25, 4)(q, kv_pool, layer, kv_slots, kv_lens, tree_mask)
    ref_out, ref_lse = jitted("reference", 0.25, 4)(q, kv_pool.astype(jnp.float32), layer, kv_slots, kv_lens, tree_mask)
    check_against_reference(out, lse, ref_out, ref_lse, tol=1e-5)

    qs = jnp.stack([q, -q])
    f = jax.vmap(lambda qq: verify_attention(qq, kv_pool, layer, kv_slots, kv_lens, tree_mask, softmax_scale=0.25,
                                             rope_dim=4, impl="ffi"))
    vout, vlse = f(qs)
    np.testing.assert_array_equal(np.asarray(vout[0]), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(vlse[0]), np.asarray(lse))


@needs_ffi
def test_inside_scan_reads_layer_from_device():
    """`layer` is a traced scalar: one compiled scan walks the layers without host round-trips."""
    q, kv_pool, _, kv_slots, kv_lens, tree_mask = make_case(9, 1, 4, 2, 40, latent=16, rope=4, dtype=jnp.float32)

    def body(carry, layer):
        out, lse = verify_attention(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, softmax_scale=0.3, rope_dim=4,
                                    impl="ffi")
        return carry, (out, lse)

    _, (outs, lses) = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32)))()
    for layer in range(3):
        ref_out, ref_lse = jitted("reference", 0.3, 4)(q, kv_pool, jnp.int32(layer), kv_slots, kv_lens, tree_mask)
        check_against_reference(outs[layer], lses[layer], ref_out, ref_lse, tol=1e-5)


@needs_ffi
def test_ffi_validation_errors_are_clear():
    q, kv_pool, layer, kv_slots, kv_lens, tree_mask = make_case(3, 1, 2, 1, 10, latent=8, rope=4, dtype=jnp.float32)
    kw = dict(softmax_scale=0.5, rope_dim=4, impl="ffi")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        verify_attention(q.astype(jnp.float16), kv_pool.astype(jnp.float16), layer, kv_slots, kv_lens, tree_mask, **kw)
    with pytest.raises(ValueError, match="softmax_scale"):
        verify_attention(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, **{**kw, "softmax_scale": float("nan")})
    with pytest.raises(ValueError, match="tree_mask"):
        verify_attention(q, kv_pool, layer, kv_slots, kv_lens, tree_mask[..., :0], **kw)
    with pytest.raises(ValueError, match="num_splits"):
        verify_attention(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, num_splits=-1, **kw)


@needs_ffi
def test_split_heuristic_uses_static_shapes_only():
    # Small batches of short rows get many splits; big row counts none; never fewer than 4 KV tiles a split.
    assert vffi.ROWS_PER_BLOCK == {"wide": 32, "pipelined": 32, "hopper": 64}
    assert vffi.choose_num_splits(1, 16, 8, 65536, 132, rows_per_block=64) == 66  # T*H = 128: two Hopper blocks
    assert vffi.choose_num_splits(1, 16, 8, 65536, 132) == 33  # four blocks of 32 rows
    assert vffi.choose_num_splits(1, 1, 8, 65536, 132) == 132  # one block of 32 rows a split: one wave
    assert vffi.choose_num_splits(8, 257, 8, 65536, 132) == 1
    assert vffi.choose_num_splits(1, 64, 8, 16384, 132) == 8   # 16 blocks of 32 rows x 8 = one wave of 132
    assert vffi.choose_num_splits(1, 16, 8, 130, 132) == 2     # 9 KV tiles: two splits of four or five
    assert vffi.choose_num_splits(1, 16, 8, 40, 132) == 1
    # 9 row blocks x 8 sequences = 72 blocks, 55% of one wave: 5 splits fill three waves of 132 to 91%.
    assert vffi.choose_num_splits(8, 33, 8, 4096, 132) == 5
    assert vffi.choose_num_splits(2, 33, 8, 200, 132) == 3     # but no split shorter than four KV tiles
    # A short table whose one split fills a quarter of the slots stays whole (its merge of many rows costs more).
    assert vffi.choose_num_splits(8, 33, 8, 200, 132) == 1
    assert vffi.choose_num_splits(16, 33, 4, 320, 132, rows_per_block=64) == 1
    assert vffi.choose_num_splits(16, 17, 4, 320, 132, rows_per_block=64) == 4  # 32 blocks, under a quarter: split


@needs_ffi
def test_donated_pool_is_updated_in_place_not_copied():
    """Writing a step's KV rows into the donated pool and calling the op copies nothing of the pool."""
    num_layers, num_slots, width = 3, 50_000, 40
    pool = jnp.ones((num_layers, num_slots, width), jnp.float32)
    q, _, _, kv_slots, kv_lens, tree_mask = make_case(13, 1, 4, 2, 64, latent=32, rope=8, dtype=jnp.float32,
                                                      num_slots=num_slots, lens=[64])

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(pool, layer, new_rows):
        pool = pool.at[layer, kv_slots[0, -4:]].set(new_rows)
        out, _ = verify_attention(q, pool, layer, kv_slots, kv_lens, tree_mask, softmax_scale=0.2, rope_dim=8,
                                  impl="ffi")
        return pool, out

    stats = step.lower(pool, jnp.int32(1), jnp.ones((4, width))).compile().memory_analysis()
    assert stats.alias_size_in_bytes >= pool.nbytes
    assert stats.temp_size_in_bytes < pool.nbytes // 100, stats


# The XLA baseline (ops/xla.py), dense and chunked over L, against the oracle. Chunks: odd and not dividing L,
# a power of two, and one longer than the table (then it is the table). bf16 inputs against the oracle on their
# float32 copies: the probabilities are cast to bf16 before the value product, hence the bf16 tolerance.
XLA_SHAPES = [  # (B, T, H, Lmax, Dc, Dr, dtype, chunks besides the dense form); CPU_SHAPES' sizes (shared compiles)
    (3, 1, 8, 45, 32, 8, jnp.float32, (16,)),
    (2, 16, 8, 83, 32, 8, jnp.bfloat16, (7,)),
    (1, 33, 1, 101, 16, 4, jnp.float32, (10_000,)),  # two mask words a row; a chunk longer than the table
    (2, 64, 1, 150, 32, 8, jnp.bfloat16, (32,)),
    (2, 7, 8, 77, 512, 64, jnp.bfloat16, (16,)),     # K2's geometry
]


@functools.cache
def xla_jitted(softmax_scale: float, rope_dim: int, chunk):
    return jax.jit(functools.partial(verify_attention_xla, softmax_scale=softmax_scale, rope_dim=rope_dim, chunk=chunk))


@pytest.mark.parametrize("shape", XLA_SHAPES, ids=lambda s: f"B{s[0]}T{s[1]}H{s[2]}L{s[3]}D{s[4]}+{s[5]}{s[6].__name__}")
def test_xla_baseline_matches_reference(shape):
    batch, num_queries, num_heads, max_len, latent, rope, dtype, chunks = shape
    scale = (latent + rope) ** -0.5
    for draw in range(2):
        case = make_case(77 + 1000 * draw + max_len, batch, num_queries, num_heads, max_len, latent=latent, rope=rope,
                         dtype=dtype)
        ref_out, ref_lse = reference_f32(case, scale, rope)
        for chunk in (None, *chunks):
            out, lse = xla_jitted(scale, rope, chunk)(*case)
            assert out.dtype == dtype and out.shape == (batch, num_queries, num_heads, latent)
            assert lse.dtype == jnp.float32 and lse.shape == (batch, num_queries, num_heads)
            check_against_reference(out, lse, ref_out, ref_lse, tol=1e-5 if dtype == jnp.float32 else 1e-2)
    if num_queries == 16:  # the dispatch: impl="xla" is the dense form, impl="xla_chunked" the chunked one
        for impl, chunk in (("xla", None), ("xla_chunked", DEFAULT_CHUNK)):
            out, lse = jitted(impl, scale, rope)(*case)
            form_out, form_lse = xla_jitted(scale, rope, chunk)(*case)
            np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(form_out, np.float32))
            np.testing.assert_array_equal(np.asarray(lse), np.asarray(form_lse))


def test_xla_baseline_rows_with_nothing_visible():
    """kv_len 0; an empty prefix (kv_len = T) where queries 0-3 see only query token 4 and query 4 nothing: with
    chunk 2 < T = 5, those rows' first two chunks see nothing (the online merge starts from -inf)."""
    case = make_case(7, 2, 5, 2, 19, latent=16, rope=4, dtype=jnp.float32, lens=[0, 5])
    q, kv_pool, layer, kv_slots, kv_lens, _ = case
    q, kv_pool = q.astype(jnp.bfloat16), kv_pool.astype(jnp.bfloat16)
    bits = np.zeros((2, 5, 5), bool)
    bits[:, :4, 4] = True
    tree_mask = pack_mask_bits(jnp.asarray(bits))
    ref_out, ref_lse = reference_f32((q, kv_pool, layer, kv_slots, kv_lens, tree_mask), 0.25, 4)
    assert np.isneginf(np.asarray(ref_lse)).sum() == 5 * 2 + 1 * 2
    for chunk in (None, 2):
        out, lse = xla_jitted(0.25, 4, chunk)(q, kv_pool, layer, kv_slots, kv_lens, tree_mask)
        check_against_reference(out, lse, ref_out, ref_lse, tol=1e-2)


def test_xla_baseline_traced_layer_and_clamping():
    """`layer` traced (jit argument, scan over layers); out-of-range layer and slots clamp like the reference."""
    q, kv_pool, _, kv_slots, kv_lens, tree_mask = make_case(9, 1, 4, 2, 40, latent=16, rope=4, dtype=jnp.float32)
    for chunk in (None, 16):
        def body(carry, layer, chunk=chunk):
            return carry, verify_attention_xla(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, softmax_scale=0.3,
                                               rope_dim=4, chunk=chunk)

        _, (outs, lses) = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32)))()
        for layer in range(3):
            ref_out, ref_lse = jitted("reference", 0.3, 4)(q, kv_pool, jnp.int32(layer), kv_slots, kv_lens, tree_mask)
            check_against_reference(outs[layer], lses[layer], ref_out, ref_lse, tol=1e-5)
    bad_slots = kv_slots.at[:, ::3].set(jnp.int32(10**6)).at[:, 1::5].set(-5)
    for layer in (jnp.int32(-2), jnp.int32(99)):
        ref_out, ref_lse = jitted("reference", 0.3, 4)(q, kv_pool, layer, bad_slots, kv_lens, tree_mask)
        for chunk in (None, 16):
            out, lse = xla_jitted(0.3, 4, chunk)(q, kv_pool, layer, bad_slots, kv_lens, tree_mask)
            check_against_reference(out, lse, ref_out, ref_lse, tol=1e-5)


def test_xla_baseline_reads_rows_without_copying_the_layer():
    """The gather reads the sequence's rows straight from the pool: no temporary near the size of a layer."""
    num_layers, num_slots, width = 3, 50_000, 40
    pool = jnp.ones((num_layers, num_slots, width), jnp.float32)
    q, _, _, kv_slots, kv_lens, tree_mask = make_case(13, 1, 4, 2, 64, latent=32, rope=8, dtype=jnp.float32,
                                                      num_slots=num_slots, lens=[64])
    for chunk in (None, 16):
        f = jax.jit(functools.partial(verify_attention_xla, softmax_scale=0.2, rope_dim=8, chunk=chunk))
        stats = f.lower(q, pool, jnp.int32(1), kv_slots, kv_lens, tree_mask).compile().memory_analysis()
        assert stats.temp_size_in_bytes < pool.nbytes // num_layers // 100, (chunk, stats)


def test_xla_baseline_errors():
    case = make_case(3, 1, 2, 1, 10, latent=8, rope=4, dtype=jnp.float32)  # the shapes of the FFI's error test
    with pytest.raises(ValueError, match="chunk"):
        verify_attention_xla(*case, softmax_scale=0.5, rope_dim=4, chunk=0)
    with pytest.raises(ValueError, match="impl"):
        verify_attention(*case, softmax_scale=0.5, rope_dim=4, impl="dense")
