"""MLA's prologue as one CUDA op (ffi/mla_prologue.cu, ops/mla_prologue.py) against a float64 recomputation with the
model's bfloat16 roundings, against the model's XLA formulation on the same GPU, and through MLA itself (needs a GPU;
marked `gpu`).

Shapes: Kimi K2's (hidden 7168, q_lora 1536, kv_lora 512, rope 64), a small one on the vectorised path and an odd one
that takes the element-wise path (no dim a multiple of 8); 1 to 16 tokens. Outputs are garbage-poisoned through the
allocator first.
"""

from __future__ import annotations

import shutil
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SANITIZER_CLEAN, run_compute_sanitizer
from kdtree_jax.ops import mla_prologue as ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu" or not ops.cuda_built(),
                       reason="needs a GPU and the extension's CUDA prologue op"),
]

EPS = 1e-6
# (hidden H, q_lora Q, kv_lora C, rope R)
SHAPES = {"k2": (7168, 1536, 512, 64), "small": (256, 96, 64, 32), "odd": (203, 45, 27, 6)}


def bf16(a):
    return np.asarray(jnp.asarray(np.asarray(a, np.float32), jnp.bfloat16).astype(jnp.float32), np.float64)


def make(shape, tokens, seed):
    h, q, c, r = shape
    rng = np.random.default_rng(seed)
    x = bf16(rng.normal(0, 1, (tokens, h)))
    w = ops.PrologueWeights(*(jnp.asarray(a, jnp.bfloat16) for a in (
        rng.normal(0, h ** -0.5, (h, q)), rng.normal(0, h ** -0.5, (h, c + r)),
        1 + 0.2 * rng.normal(size=q), 1 + 0.2 * rng.normal(size=c))))
    angles = rng.uniform(0, 100, (tokens, 1)) * (10000.0 ** (-np.arange(r // 2) / max(r // 2, 1)))
    angles = np.concatenate([angles, angles], -1)
    return jnp.asarray(x, jnp.float32), w, jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles),
                                                                                                  jnp.float32)


def rms_norm64(a, weight):
    return bf16(np.asarray(weight, np.float64) * bf16(a / np.sqrt((a * a).mean(-1, keepdims=True) + EPS)))


def reference64(x, w, cos, sin):
    """The model's chain in float64, rounding to bfloat16 where the model's tensors are bfloat16."""
    x = np.asarray(x, np.float64)
    f64 = [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in w]
    c = f64[3].shape[0]
    q = rms_norm64(bf16(x @ f64[0]), f64[2])
    kv = bf16(x @ f64[1])
    k_pe = kv[:, c:]
    half = k_pe.shape[1] // 2
    rotated = np.concatenate([-k_pe[:, half:], k_pe[:, :half]], -1)
    pe = bf16(k_pe * np.asarray(cos, np.float64) + rotated * np.asarray(sin, np.float64))
    return q, np.concatenate([rms_norm64(kv[:, :c], f64[3]), pe], -1)


def xla_formulation(x, w, cos, sin):
    """What model/mla.py computes (RMSNorm, apply_rope; bfloat16 products), on the same GPU."""
    from kdtree_jax.model.layers import apply_rope

    def norm(a, weight):
        a32 = a.astype(jnp.float32)
        return weight * (a32 * jax.lax.rsqrt(jnp.mean(a32 * a32, -1, keepdims=True) + EPS)).astype(a.dtype)

    xb = x.astype(jnp.bfloat16)
    c = w.kv_norm.shape[0]
    kv = xb @ w.w_kva
    return norm(xb @ w.w_qa, w.q_norm), jnp.concatenate([norm(kv[:, :c], w.kv_norm),
                                                         apply_rope(kv[:, c:], cos, sin)], -1)


def poison(tokens, shape):
    h, q, c, r = shape
    jax.block_until_ready([jnp.full((tokens, q), jnp.nan, jnp.bfloat16), jnp.full((tokens, c + r), 7, jnp.bfloat16),
                           jnp.full((64 * tokens * (q + c + r),), jnp.nan, jnp.float32)])


def assert_close_bf16(got, want, ulps=4):
    """Within ulps / 256 of |want| (a bfloat16 ulp is 1/256 to 1/128 of a value), plus 1/1024 of the row's largest
    value (for values near zero)."""
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    assert np.isfinite(got).all()
    scale = np.abs(want).max(-1, keepdims=True)
    tol = ulps * 2.0 ** -8 * np.abs(want) + 2.0 ** -10 * scale
    bad = np.abs(got - want) > tol
    assert not bad.any(), f"{bad.sum()} of {bad.size} off; worst {np.abs(got - want).max():.3g}"


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 16])
def test_kernel_matches_float64(name, tokens):
    shape = SHAPES[name]
    x, w, cos, sin = make(shape, tokens, seed=tokens + 17 * list(SHAPES).index(name))
    poison(tokens, shape)
    q, latent = jax.jit(lambda x, w, c, s: ops.cuda_prologue(x, w, c, s, EPS))(x, w, cos, sin)
    want_q, want_latent = reference64(x, w, cos, sin)
    assert q.dtype == latent.dtype == jnp.bfloat16
    assert_close_bf16(q, want_q)
    assert_close_bf16(latent, want_latent)


@pytest.mark.parametrize("name", ["k2", "odd"])
def test_kernel_agrees_with_xla_formulation(name):
    shape = SHAPES[name]
    x, w, cos, sin = make(shape, 4, seed=3)
    got = jax.jit(lambda x, w, c, s: ops.cuda_prologue(x, w, c, s, EPS))(x, w, cos, sin)
    want = jax.jit(xla_formulation)(x, w, cos, sin)
    for g, v in zip(got, want):
        g, v = np.asarray(g.astype(jnp.float32)), np.asarray(v.astype(jnp.float32))
        assert (g == v).mean() > 0.75  # the products' sums in another order: a bfloat16 ulp here and there
        assert_close_bf16(g, np.asarray(v, np.float64))


def test_rows_do_not_depend_on_the_call():
    """A token's outputs are the same bits whatever else the call holds (a fixed order of every sum)."""
    shape = SHAPES["k2"]
    x, w, cos, sin = make(shape, 6, seed=5)
    fn = jax.jit(lambda x, w, c, s: ops.cuda_prologue(x, w, c, s, EPS))
    together = fn(x, w, cos, sin)
    for t in (0, 4, 5):
        alone = fn(x[t:t + 1], w, cos[t:t + 1], sin[t:t + 1])
        for a, b in zip(alone, together):
            np.testing.assert_array_equal(np.asarray(a[0].astype(jnp.float32)), np.asarray(b[t].astype(jnp.float32)))


def _mla(cfg_kwargs=None):
    from flax import nnx

    from kdtree_jax.config import ModelConfig
    from kdtree_jax.model.mla import MLA
    cfg = ModelConfig(vocab_size=64, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                      intermediate_size=64, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                      qk_rope_head_dim=32, v_head_dim=32, moe_intermediate_size=32,
                      n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                      routed_scaling_factor=1.0, **(cfg_kwargs or {}))
    return cfg, MLA(cfg, jnp.bfloat16, nnx.Rngs(0))


@pytest.mark.parametrize("tokens,lowered", [(1, True), (16, True), (17, False)])
def test_mla_takes_the_kernel_at_decode_sizes(tokens, lowered, monkeypatch):
    from flax import nnx

    from kdtree_jax.model.layers import rope_cos_sin
    monkeypatch.setattr(ops, "MODEL_TAKES_IT", True)
    cfg, mla = _mla()
    x = jax.random.normal(jax.random.key(1), (1, tokens, cfg.hidden_size), jnp.bfloat16)
    cos, sin = rope_cos_sin(cfg, jnp.arange(tokens)[None] + 40)
    fn = nnx.jit(lambda m, x, c, s: m.projections(x, c, s))
    assert (ops.TARGET in fn.lower(mla, x, cos, sin).as_text()) == lowered
    got = fn(mla, x, cos, sin)
    monkeypatch.setattr(ops, "cuda_built", lambda: False)
    want = nnx.jit(lambda m, x, c, s: m.projections(x, c, s))(mla, x, cos, sin)
    for g, v in zip(got, want):
        assert g.shape == v.shape and g.dtype == v.dtype
        assert_close_bf16(g[0], np.asarray(v[0].astype(jnp.float32), np.float64))


def test_on_a_mesh_each_device_runs_it_whole(monkeypatch):
    from jax.sharding import Mesh
    monkeypatch.setattr(ops, "MODEL_TAKES_IT", True)

    shape = SHAPES["small"]
    x, w, cos, sin = make(shape, 2, seed=9)
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    ref = lambda x, c, s: xla_formulation(x, w, c, s)  # noqa: E731
    fn = jax.jit(lambda x, c, s: ops.prologue(x.astype(jnp.bfloat16), w, c, s, EPS, ref, mesh=mesh))
    assert ops.TARGET in fn.lower(x, cos, sin).as_text()
    want = reference64(x, w, cos, sin)
    for g, v in zip(fn(x, cos, sin), want):
        assert_close_bf16(g, v)


SANITIZER_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from kdtree_jax.ops import mla_prologue as ops
    rng = np.random.default_rng(0)
    # The 16-byte and the element-wise paths, one and several 4-row chunks, one split and many.
    for n, h, q, c, r in ((1, 7168, 1536, 512, 64), (6, 256, 96, 64, 32), (3, 203, 45, 27, 6), (2, 64, 8, 8, 0)):
        w = ops.PrologueWeights(*(jnp.asarray(rng.normal(0, 0.05, s).astype(np.float32)).astype(jnp.bfloat16)
                                  for s in ((h, q), (h, c + r), (q,), (c,))))
        x = jnp.asarray(rng.normal(0, 1, (n, h)).astype(np.float32))
        cs = jnp.asarray(rng.normal(0, 1, (n, r)).astype(np.float32))
        q_out, latent = jax.jit(lambda x, w, cs: ops.cuda_prologue(x, w, cs, cs, 1e-6))(x, w, cs)
        assert np.isfinite(np.asarray(q_out, np.float32)).all() and np.isfinite(np.asarray(latent, np.float32)).all()
    print("SANITIZER-CASE-OK")
""")


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_compute_sanitizer_is_clean(tool):
    """The prologue's two kernels under compute-sanitizer (racecheck and synccheck on their names only)."""
    returncode, log = run_compute_sanitizer(tool, SANITIZER_SCRIPT, "mla_prologue")
    assert "SANITIZER-CASE-OK" in log, log[-4000:]
    assert returncode == 0 and SANITIZER_CLEAN[tool] in log, log[-4000:]
