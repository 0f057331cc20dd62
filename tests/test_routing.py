"""ops/routing.py: route_experts == the MoE router's XLA formulation (model/moe.py `route`) on every path.

CPU: the XLA formulation against the previous `route` math bit for bit (sigmoid + noaux_tc with groups, softmax
without groups, norm on / off), against a numpy reference of the selection on exact ties (lax.top_k's order: the lower
expert / group first), argument errors, "auto" past the kernel's limits, and (where the extension holds the CUDA op)
the lowering for CUDA. GPU (marked `gpu`, skipped without an extension built with the CUDA op): the kernel
(ffi/routing.cu) against the XLA formulation for K2's, DeepSeek-V3's and the default pair's routing and the kernel's
limits, N in {1, 9, 33, 257}: indices equal, weights within 1e-6 relative; exact ties, NaN, inside a fori_loop
(a CUDA graph) and under compute-sanitizer.
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
from kdtree_jax.config import DEEPSEEK_V3, KIMI_K2
from kdtree_jax.model.moe import route
from kdtree_jax.ops import routing as routing_ops
from kdtree_jax.ops.routing import route_experts, xla_route
from kdtree_jax.train import default_target_config

DEFAULT_PAIR = default_target_config()


def previous_route(router_logits, bias, cfg):
    """model/moe.py `route` as it was before ops/routing.py (frozen here: the formulation must not drift)."""
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores + bias.astype(jnp.float32) if cfg.topk_method == "noaux_tc" else scores
    num_tokens, num_experts = choice.shape
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        grouped = choice.reshape(num_tokens, cfg.n_group, num_experts // cfg.n_group)
        top2 = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)  # [N, G]
        _, best_groups = jax.lax.top_k(top2, cfg.topk_group)
        keep = jnp.zeros((num_tokens, cfg.n_group), bool).at[jnp.arange(num_tokens)[:, None], best_groups].set(True)
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)
    _, indices = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return indices.astype(jnp.int32), weights * cfg.routed_scaling_factor


def kwargs_of(cfg) -> dict:
    return dict(top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                scoring=cfg.scoring_func, use_bias=cfg.topk_method == "noaux_tc", norm_topk_prob=cfg.norm_topk_prob,
                routed_scaling_factor=cfg.routed_scaling_factor)


# The configurations the tests run: (id, ModelConfig).
GROUPED_64 = DEEPSEEK_V3.replace(n_routed_experts=64, n_group=8, topk_group=4, num_experts_per_tok=8)
CONFIGS = {
    "sigmoid-noaux-groups-e64": GROUPED_64,
    "sigmoid-noaux-groups-e64-nonorm": GROUPED_64.replace(norm_topk_prob=False),
    "softmax-nogroups-e64": GROUPED_64.replace(scoring_func="softmax", topk_method="greedy", n_group=1, topk_group=1,
                                               num_experts_per_tok=6, routed_scaling_factor=1.0),
    "softmax-nogroups-nonorm": GROUPED_64.replace(scoring_func="softmax", topk_method="greedy", n_group=1,
                                                  topk_group=1, num_experts_per_tok=6, norm_topk_prob=False),
    "kimi-k2": KIMI_K2,
    "deepseek-v3": DEEPSEEK_V3,
    "default-pair": DEFAULT_PAIR,
    "one-expert-groups": GROUPED_64.replace(n_routed_experts=16, n_group=16, topk_group=4, num_experts_per_tok=4),
    "limits": GROUPED_64.replace(n_routed_experts=512, n_group=16, topk_group=3, num_experts_per_tok=16),
    "tiny": GROUPED_64.replace(n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2),
}


def random_case(seed, num_tokens, cfg, scale=2.0):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((num_tokens, cfg.n_routed_experts)) * scale).astype(np.float32)
    bias = (rng.standard_normal(cfg.n_routed_experts) * 0.3).astype(np.float32)
    return jnp.asarray(logits), jnp.asarray(bias)


def selection_reference(scores, bias, cfg):
    """Indices by numpy on the float32 scores the XLA path computed: choice = scores + bias in float32, a group's score
    top1 + top2 in float32, ranks by (value descending, index ascending) -- lax.top_k's order, spelled out."""
    scores = np.asarray(scores, np.float32)
    choice = scores + np.asarray(bias, np.float32) if cfg.topk_method == "noaux_tc" else scores.copy()
    num_tokens, num_experts = choice.shape
    out = []
    for row in choice:
        row = row.copy()
        if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
            grouped = row.reshape(cfg.n_group, -1)
            top = -np.sort(-grouped, axis=-1)[:, :2]
            group_score = top[:, 0] + top[:, 1] if top.shape[1] == 2 else top[:, 0]
            keep = np.lexsort((np.arange(cfg.n_group), -group_score))[: cfg.topk_group]
            mask = np.ones(cfg.n_group, bool)
            mask[keep] = False
            grouped[mask] = -np.inf
            row = grouped.reshape(-1)
        out.append(np.lexsort((np.arange(num_experts), -row))[: cfg.num_experts_per_tok])
    return np.asarray(out, np.int32)


# ---------------------------------------------------------------------------------------------------------- CPU

on_cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the XLA path (a GPU runs the CUDA op)")


@on_cpu_only
@pytest.mark.parametrize("name", list(CONFIGS))
def test_route_is_the_previous_formulation(name):
    """route (through ops/routing.py) and xla_route equal the previous route math bit for bit."""
    cfg = CONFIGS[name]
    logits, bias = random_case(len(name), 37, cfg)
    want = jax.jit(functools.partial(previous_route, cfg=cfg))(logits, bias)
    for got in (jax.jit(functools.partial(route, cfg=cfg))(logits, bias),
                jax.jit(functools.partial(xla_route, **kwargs_of(cfg)))(logits, bias)):
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
        assert got[0].dtype == jnp.int32 and got[1].dtype == jnp.float32


def tie_case(seed, num_tokens, cfg):
    """Logits of a few integer values (many exact ties between experts, and between groups: group 1 copies group 0),
    bias 0 or 0.5 (distinct choices stay far apart); row 0 all equal, row 1 all equal but for one expert."""
    rng = np.random.default_rng(seed)
    e = cfg.n_routed_experts
    logits = rng.integers(-2, 3, size=(num_tokens, e)).astype(np.float32)
    if cfg.n_group > 1:
        per = e // cfg.n_group
        logits[:, per:2 * per] = logits[:, :per]
    logits[0] = 1.0
    logits[1] = 0.0
    logits[1, e - 1] = 2.0
    bias = np.where(rng.random(e) < 0.5, 0.5, 0.0).astype(np.float32)
    if cfg.n_group > 1:
        bias[per:2 * per] = bias[:per]
    return jnp.asarray(logits), jnp.asarray(bias)


@pytest.mark.parametrize("name", ["sigmoid-noaux-groups-e64", "softmax-nogroups-e64", "deepseek-v3",
                                  "one-expert-groups"])
def test_ties_take_the_lower_index_first(name):
    cfg = CONFIGS[name]
    logits, bias = tie_case(3, 24, cfg)
    idx, _ = jax.jit(functools.partial(xla_route, **kwargs_of(cfg)))(logits, bias)
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    np.testing.assert_array_equal(np.asarray(idx), selection_reference(scores, bias, cfg))
    if cfg.topk_method != "noaux_tc" or not np.asarray(bias).any():
        np.testing.assert_array_equal(np.asarray(idx)[0], np.arange(cfg.num_experts_per_tok))


def test_equal_groups_keep_the_lower_groups():
    """Every logit equal, no bias: every group scores the same, the first topk_group groups are kept, and the experts
    are their first ones in index order."""
    cfg = GROUPED_64.replace(n_routed_experts=32, n_group=8, topk_group=2, num_experts_per_tok=8)
    run = jax.jit(functools.partial(xla_route, **kwargs_of(cfg)))
    idx, w = run(jnp.zeros((2, 32)), jnp.zeros(32))
    np.testing.assert_array_equal(np.asarray(idx), np.tile(np.arange(8), (2, 1)))  # groups 0 and 1: experts 0..7
    np.testing.assert_allclose(np.asarray(w), cfg.routed_scaling_factor / 8, rtol=1e-6)
    # The last group made best by one expert: it is kept with group 0, and its best expert comes first.
    logits = np.zeros((1, 32), np.float32)
    logits[0, 30] = 1.0
    idx, _ = run(jnp.asarray(logits), jnp.zeros(32))
    np.testing.assert_array_equal(np.asarray(idx)[0], [30, 0, 1, 2, 3, 28, 29, 31])


def test_argument_errors():
    x, b = jnp.zeros((3, 16), jnp.float32), jnp.zeros(16, jnp.float32)
    ok = dict(top_k=2, n_group=4, topk_group=2)
    cases = [(dict(top_k=0), "top_k"), (dict(top_k=17), "top_k"), (dict(top_k=2.0), "top_k"),
             (dict(n_group=3), "n_group"), (dict(n_group=0), "n_group"), (dict(topk_group=5), "topk_group"),
             (dict(topk_group=0), "topk_group"), (dict(scoring="tanh"), "scoring"), (dict(impl="fast"), "impl"),
             (dict(routed_scaling_factor="2"), "routed_scaling_factor")]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            route_experts(x, b, **{**ok, **change})
    with pytest.raises(ValueError, match="logits"):
        route_experts(jnp.zeros(16), b, **ok)
    with pytest.raises(ValueError, match="logits"):
        route_experts(jnp.zeros((3, 16), jnp.int32), b, **ok)
    with pytest.raises(ValueError, match="bias"):
        route_experts(x, jnp.zeros(8), **ok)
    big = jnp.zeros((1, routing_ops.MAX_EXPERTS * 2), jnp.float32)
    with pytest.raises(ValueError, match="impl='cuda'"):
        route_experts(big, jnp.zeros(big.shape[1]), top_k=2, impl="cuda")
    with pytest.raises(ValueError, match="impl='cuda'"):
        route_experts(jnp.zeros((1, 32)), jnp.zeros(32), top_k=routing_ops.MAX_K + 1, impl="cuda")
    # "auto" past the kernel's limits runs XLA; grouping that does not apply ignores n_group's limit.
    idx, _ = route_experts(big, jnp.zeros(big.shape[1]), top_k=routing_ops.MAX_K + 1)
    np.testing.assert_array_equal(np.asarray(idx)[0], np.arange(routing_ops.MAX_K + 1))
    assert routing_ops.within_limits(64, 8, 32, 32) and not routing_ops.within_limits(64, 8, 32, 4)


@on_cpu_only
def test_cpu_lowering_has_no_custom_call():
    logits, bias = random_case(0, 4, KIMI_K2)
    hlo = jax.jit(functools.partial(route, cfg=KIMI_K2)).lower(logits, bias).as_text()
    assert routing_ops.TARGET not in hlo


def test_derivative_is_the_xla_formulations():
    """A training step differentiates the routing weights: with_xla_derivative differentiates the XLA formulation,
    never the GPU branch (here a stand-in with no derivative, as the FFI call has none), whatever the platform."""
    cfg = DEEPSEEK_V3
    logits, bias = random_case(3, 5, cfg)
    kwargs = dict(top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, topk_group=cfg.topk_group,
                  routed_scaling_factor=cfg.routed_scaling_factor)
    xla = functools.partial(xla_route, **kwargs)

    def no_derivative(logits, bias):  # like the FFI call: jvp raises
        shapes = (jax.ShapeDtypeStruct((logits.shape[0], cfg.num_experts_per_tok), jnp.int32),
                  jax.ShapeDtypeStruct((logits.shape[0], cfg.num_experts_per_tok), jnp.float32))
        return jax.pure_callback(lambda a, b: tuple(np.asarray(v) for v in xla(a, b)), shapes, logits, bias)

    routed = routing_ops.with_xla_derivative(no_derivative, xla)
    probe = jnp.asarray(np.random.default_rng(0).normal(size=(5, cfg.num_experts_per_tok)), jnp.float32)
    loss = lambda f: lambda x: (f(x, bias)[1] * probe).sum()  # noqa: E731
    np.testing.assert_array_equal(np.asarray(jax.grad(loss(routed))(logits)), np.asarray(jax.grad(loss(xla))(logits)))


needs_cuda_op = pytest.mark.skipif(not routing_ops.cuda_built(), reason="extension built without the CUDA routing op")


@needs_cuda_op
def test_cuda_lowering_calls_the_op():
    """Exported for CUDA (no GPU needed), "auto" calls the op within the kernel's limits with the config's attributes,
    and XLA's formulation past them or under impl="xla"."""

    def lowered(logits, bias, cfg, impl="auto"):
        fn = jax.jit(functools.partial(route, cfg=cfg, impl=impl))
        checks = [jax.export.DisabledSafetyCheck.custom_call(routing_ops.TARGET)]
        return jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(logits, bias).mlir_module()

    logits, bias = random_case(0, 9, DEEPSEEK_V3)
    text = lowered(logits, bias, DEEPSEEK_V3)
    assert routing_ops.TARGET in text
    for attr in ("top_k = 8 : i64", "n_group = 8 : i64", "topk_group = 4 : i64", "scoring = 0 : i64",
                 "use_bias = true", "norm_topk_prob = true"):
        assert attr in text, attr
    assert routing_ops.TARGET not in lowered(logits, bias, DEEPSEEK_V3, impl="xla")
    wide = DEEPSEEK_V3.replace(n_routed_experts=2 * routing_ops.MAX_EXPERTS)
    assert routing_ops.TARGET not in lowered(*random_case(1, 9, wide), wide)
    many_groups = DEEPSEEK_V3.replace(n_group=32, topk_group=4)
    assert routing_ops.TARGET not in lowered(logits, bias, many_groups)
    # Grouping that does not apply: the kernel runs, told n_group = 1.
    assert "n_group = 1 : i64" in lowered(logits, bias, DEEPSEEK_V3.replace(n_group=32, topk_group=32))
    # A training step's gradient through the router lowers for CUDA too (the kernel's derivative is XLA's).
    grad = jax.jit(jax.grad(lambda x: route(x, bias, DEEPSEEK_V3)[1].sum()))
    checks = [jax.export.DisabledSafetyCheck.custom_call(routing_ops.TARGET)]
    jax.export.export(grad, platforms=["cuda"], disabled_checks=checks)(logits)


# ---------------------------------------------------------------------------------------------------------- GPU

def poison_allocator(*shapes_and_dtypes):
    """Hand the allocator NaN-filled (indices: -1) blocks of the outputs' sizes: an unwritten element shows."""
    blocks = [jnp.full(shape, jnp.nan if jnp.issubdtype(dtype, jnp.floating) else -1, dtype)
              for shape, dtype in shapes_and_dtypes]
    jax.block_until_ready(blocks)
    for block in blocks:
        block.delete()


@functools.partial(jax.jit, static_argnames=("cfg", "impl"))
def routed(logits, bias, cfg, impl):
    return route(logits, bias, cfg, impl=impl)


def near_tie_rows(logits, bias, cfg, gap=1e-6):
    """[N] True where two of the row's k + 1 best choices, or two of its group scores, lie within `gap` but are not
    equal: exact ties are pinned, near ones can flip on an ulp of exp (16 ulp of 1.0 apart at most). In float32, as
    both paths compute, so that duplicated logits give equal choices here too."""
    x = np.asarray(logits, np.float32)
    if cfg.scoring_func == "sigmoid":
        scores = np.float32(1) / (np.float32(1) + np.exp(-x))
    else:
        ex = np.exp(x - x.max(-1, keepdims=True))
        scores = ex / ex.sum(-1, keepdims=True)
    choice = scores + np.asarray(bias, np.float32) if cfg.topk_method == "noaux_tc" else scores

    def close(v):
        d = np.abs(np.diff(v, axis=-1))
        return ((d > 0) & (d < gap)).any(-1)

    near = np.zeros(x.shape[0], bool)
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        top = -np.sort(-choice.reshape(x.shape[0], cfg.n_group, -1), axis=-1)[..., :2]
        near |= close(-np.sort(-top.sum(-1), axis=-1))
    k = min(cfg.num_experts_per_tok + 1, choice.shape[1])
    return near | close(-np.sort(-choice, axis=-1)[:, :k])


def assert_cuda_matches_xla(logits, bias, cfg, allow_near_ties=True):
    got_idx, got_w = (np.asarray(a) for a in routed(logits, bias, cfg, "cuda"))
    want_idx, want_w = (np.asarray(a) for a in routed(logits, bias, cfg, "xla"))
    assert got_idx.dtype == np.int32 and got_w.dtype == np.float32 and got_idx.shape == want_idx.shape
    rows = ~near_tie_rows(logits, bias, cfg) if allow_near_ties else np.ones(len(got_idx), bool)
    assert rows.mean() > 0.95
    np.testing.assert_array_equal(got_idx[rows], want_idx[rows])
    np.testing.assert_allclose(got_w[rows], want_w[rows], rtol=1e-6, atol=0)
    for row in got_idx:
        assert len(set(row.tolist())) == len(row) and (row >= 0).all() and (row < cfg.n_routed_experts).all()


GPU_CONFIGS = ["kimi-k2", "deepseek-v3", "default-pair", "softmax-nogroups-e64", "sigmoid-noaux-groups-e64-nonorm",
               "one-expert-groups", "limits", "tiny"]


@pytest.mark.gpu
@needs_cuda_op
@pytest.mark.parametrize("num_tokens", [1, 9, 33, 257])
@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_cuda_matches_xla(name, num_tokens):
    cfg = CONFIGS[name]
    k = cfg.num_experts_per_tok
    logits, bias = random_case([num_tokens, len(name)], num_tokens, cfg)
    poison_allocator(((num_tokens, k), jnp.int32), ((num_tokens, k), jnp.float32))
    assert_cuda_matches_xla(logits, bias, cfg)
    # "auto" is the op on a GPU.
    np.testing.assert_array_equal(np.asarray(routed(logits, bias, cfg, "auto")[0]),
                                  np.asarray(routed(logits, bias, cfg, "cuda")[0]))
    # Other values at the same shapes: every element is rewritten.
    assert_cuda_matches_xla(*random_case([num_tokens, len(name), 1], num_tokens, cfg, scale=4.0), cfg)


def duplicate_case(seed, num_tokens, cfg):
    """Random logits and bias with exact ties only: experts copied onto others, group 0 copied onto the last group,
    row 0 all equal (indices 0..k-1 without bias), row 1 the same value but for two experts."""
    rng = np.random.default_rng(seed)
    e = cfg.n_routed_experts
    logits = (rng.standard_normal((num_tokens, e)) * 2).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.3).astype(np.float32)
    src, dst = rng.integers(0, e, e // 3), rng.integers(0, e, e // 3)
    logits[:, dst] = logits[:, src]
    bias[dst] = bias[src]
    if cfg.n_group > 1:
        per = e // cfg.n_group
        logits[:, e - per:] = logits[:, :per]
        bias[e - per:] = bias[:per]
    logits[0] = 0.5
    logits[1] = -1.0
    logits[1, [e // 2, e - 1]] = 3.0
    return jnp.asarray(logits), jnp.asarray(bias)


@pytest.mark.gpu
@needs_cuda_op
@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_cuda_exact_ties(name):
    cfg = CONFIGS[name]
    logits, bias = duplicate_case(5, 33, cfg)
    assert_cuda_matches_xla(logits, bias, cfg)
    zero = jnp.zeros_like(bias)
    idx = np.asarray(routed(logits, zero, cfg, "cuda")[0])
    if cfg.n_group == 1 or cfg.topk_group == cfg.n_group:
        np.testing.assert_array_equal(idx[0], np.arange(cfg.num_experts_per_tok))
    assert_cuda_matches_xla(logits, zero, cfg)


@pytest.mark.gpu
@needs_cuda_op
def test_cuda_nan_logits():
    """A NaN logit: every index valid and distinct, the other rows untouched (ordering: IEEE total order)."""
    for name in ("kimi-k2", "deepseek-v3", "softmax-nogroups-e64"):
        cfg = CONFIGS[name]
        logits, bias = random_case(9, 4, cfg)
        poisoned = np.asarray(logits).copy()
        poisoned[0, [3, 40]] = np.nan
        poisoned[2] = np.nan
        got_idx, got_w = (np.asarray(a) for a in routed(jnp.asarray(poisoned), bias, cfg, "cuda"))
        want_idx, want_w = (np.asarray(a) for a in routed(logits, bias, cfg, "cuda"))
        for row in got_idx:
            assert len(set(row.tolist())) == len(row) and (row >= 0).all() and (row < cfg.n_routed_experts).all()
        np.testing.assert_array_equal(got_idx[[1, 3]], want_idx[[1, 3]])
        np.testing.assert_array_equal(got_w[[1, 3]], want_w[[1, 3]])
        assert np.isnan(got_w[2]).all()


@pytest.mark.gpu
@needs_cuda_op
@pytest.mark.parametrize("name", ["kimi-k2", "deepseek-v3", "default-pair"])
def test_cuda_op_inside_fori_loop(name):
    """Inside a jitted fori_loop (a CUDA graph when XLA captures the body): each step demotes its chosen experts in
    the next step's logits, so a stale replay shows."""
    cfg = CONFIGS[name]
    logits0, bias = random_case(13, 9, cfg)

    def step(x):
        idx, w = route(x, bias, cfg, impl="cuda")
        bump = jnp.zeros_like(x).at[jnp.arange(x.shape[0])[:, None], idx].add(-0.75)
        return x + bump + 1e-3 * w.sum(-1, keepdims=True), idx

    def body(i, carry):
        x, seen = carry
        x, idx = step(x)
        return x, seen.at[i].set(idx)

    steps = 6
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, steps, body,
                                               (x, jnp.zeros((steps,) + (x.shape[0], cfg.num_experts_per_tok),
                                                             jnp.int32))))
    x_loop, seen = loop(logits0)
    x = logits0
    step_jit = jax.jit(step)
    for i in range(steps):
        x, idx = step_jit(x)
        np.testing.assert_array_equal(np.asarray(seen[i]), np.asarray(idx))
    np.testing.assert_array_equal(np.asarray(x_loop), np.asarray(x))
    assert len({tuple(np.asarray(seen[i]).ravel()) for i in range(steps)}) > 1  # the selection moved


SANITIZER_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from kdtree_jax.ops.routing import route_experts
    rng = np.random.default_rng(0)
    # 1..4 warps a block, sigmoid / softmax, groups of one and of many experts, k up to 16.
    for e, k, g, tg, scoring in ((8, 2, 1, 1, "sigmoid"), (256, 8, 8, 4, "sigmoid"), (384, 8, 1, 1, "sigmoid"),
                                 (512, 16, 16, 3, "softmax"), (16, 4, 16, 4, "sigmoid")):
        x = jnp.asarray(rng.standard_normal((5, e)).astype(np.float32))
        b = jnp.asarray(rng.standard_normal(e).astype(np.float32))
        idx, w = jax.jit(lambda x, b: route_experts(x, b, top_k=k, n_group=g, topk_group=tg, scoring=scoring,
                                                    impl="cuda"))(x, b)
        assert (np.asarray(idx) >= 0).all() and (np.asarray(idx) < e).all()
    print("SANITIZER-CASE-OK")
""")


@pytest.mark.gpu
@needs_cuda_op
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_compute_sanitizer_is_clean(tool):
    """The kernel under compute-sanitizer (racecheck and synccheck on it only: its name holds "route_experts")."""
    returncode, log = run_compute_sanitizer(tool, SANITIZER_SCRIPT, "route_experts")
    assert "SANITIZER-CASE-OK" in log, log[-4000:]
    assert returncode == 0 and SANITIZER_CLEAN[tool] in log, log[-4000:]
