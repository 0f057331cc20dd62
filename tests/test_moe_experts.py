"""The grouped expert MLP dispatch (kdtree_jax/ops/moe.py) on CPU.

On CPU, impl "xla" (and "cuda", which falls back there) is exactly routed_experts' original three
ragged_dots, bit for bit; "auto" is that too above a few rows per expert, and below it reads only the rows'
own experts (`gathered_mlp`), which must agree with ragged_dot to rounding, including rows that belong to
no group and empty groups, as must the dense form a decode loop runs on pre-laid weights (`dense_mlp`). The group table the CUDA op reads is checked against a Python loop; bad
arguments raise ValueError; and, where the extension holds the CUDA op, a program lowered for CUDA calls it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax.model.moe import routed_experts
from kdtree_jax.ops import moe as moe_ops


def original_routed_experts(x2d, indices, weights, gate, up, down, expert_offset=0):
    """routed_experts as it was before the dispatch: ragged_dot, and a scatter-add of the weighted rows into
    their tokens (an independent formulation of the combine, which is now a gather)."""
    num_tokens, k = indices.shape
    num_local = gate.shape[0]
    local = indices - expert_offset
    here = (local >= 0) & (local < num_local)
    flat_expert = jnp.where(here, local, num_local).reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    token_of_row = order // k
    rows = x2d[token_of_row]
    group_sizes = jnp.bincount(flat_expert, length=num_local + 1)[:num_local].astype(jnp.int32)
    h = jax.nn.silu(jax.lax.ragged_dot(rows, gate, group_sizes)) * jax.lax.ragged_dot(rows, up, group_sizes)
    out_rows = jax.lax.ragged_dot(h, down, group_sizes)
    row_weight = jnp.where(here, weights, 0.0).reshape(-1)[order]
    out_rows = out_rows * row_weight[:, None].astype(out_rows.dtype)
    return jnp.zeros_like(x2d).at[token_of_row].add(out_rows)


def make_case(seed, tokens, top_k, experts, hidden, inter, dtype):
    rng = np.random.default_rng(seed)
    w = lambda shape, s: jnp.asarray(rng.normal(0, s, shape).astype(np.float32)).astype(dtype)  # noqa: E731
    gate, up = w((experts, hidden, inter), hidden ** -0.5), w((experts, hidden, inter), hidden ** -0.5)
    down = w((experts, inter, hidden), inter ** -0.5)
    indices = jnp.asarray(np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)).astype(np.float32))
    x = w((tokens, hidden), 1.0)
    return x, indices, weights, gate, up, down


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["auto", "xla", "cuda", "dense"])
@pytest.mark.parametrize("offset,local", [(0, 12), (4, 5)])
def test_cpu_dispatch_matches_the_original_formulation(dtype, impl, offset, local):
    if impl == "cuda" and dtype != jnp.bfloat16:
        pytest.skip("impl='cuda' takes bfloat16 only")
    x, indices, weights, gate, up, down = make_case(1, 9, 3, 12, 24, 16, dtype)
    parts = (gate[offset:offset + local], up[offset:offset + local], down[offset:offset + local])
    new = jax.jit(routed_experts, static_argnames=("impl",))(x, indices, weights, *parts, expert_offset=offset,
                                                             impl=impl)
    old = jax.jit(original_routed_experts)(x, indices, weights, *parts, expert_offset=offset)
    # Not bit-identical: routed_experts now sums each token's weighted rows in float32 (a gather), where the
    # original scatter-added them in the model's dtype; the CPU's gathered experts also round differently.
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(new, np.float32), np.asarray(old, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("form", ["gathered", "dense", "all_experts"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_forms_match_ragged_dot(dtype, form):
    """gathered_mlp, dense_mlp (on the weights laid out expert axis second, as a decode loop passes them) and
    all_experts_mlp (impl="dense": every expert on every row, masked) against a float64 oracle and ragged_dot: random groups with empty ones and rows past every group (which
    must give zeros), fresh inputs."""
    rng = np.random.default_rng({"gathered": 7, "dense": 8, "all_experts": 9}[form])
    experts, hidden, inter, num_rows = 6, 40, 24, 19
    sizes = np.zeros(experts, np.int32)
    for e in rng.choice(experts, 13):  # 13 of 19 rows in groups, some experts empty
        sizes[e] += 1
    w = lambda shape, scale: jnp.asarray(rng.standard_normal(shape).astype(np.float32) * scale, dtype)
    rows = w((num_rows, hidden), 1.0)
    gate, up = w((experts, hidden, inter), hidden ** -0.5), w((experts, hidden, inter), hidden ** -0.5)
    down = w((experts, inter, hidden), inter ** -0.5)
    args = (rows, jnp.asarray(sizes), gate, up, down)
    if form == "gathered":
        got = np.asarray(jax.jit(moe_ops.gathered_mlp)(*args), np.float64)
    elif form == "all_experts":
        got = np.asarray(jax.jit(moe_ops.all_experts_mlp)(*args), np.float64)
    else:
        second = tuple(jnp.swapaxes(a, 0, 1) for a in (gate, up, down))
        got = np.asarray(jax.jit(moe_ops.dense_mlp)(rows, jnp.asarray(sizes), *second), np.float64)
    want = np.asarray(jax.jit(moe_ops.ragged_mlp)(*args), np.float64)
    # float64 numpy oracle, independent of both
    r, g, u, d = (np.asarray(a, np.float64) for a in (rows, gate, up, down))
    oracle = np.zeros((num_rows, hidden))
    start = 0
    for e, n in enumerate(sizes):
        a = r[start:start + n] @ g[e]
        oracle[start:start + n] = (a / (1 + np.exp(-a)) * (r[start:start + n] @ u[e])) @ d[e]
        start += n
    assert np.all(got[start:] == 0) and np.all(want[start:] == 0)
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(got, oracle, rtol=tol, atol=tol)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_group_table():
    sizes = jnp.asarray([0, 3, 0, 0, 1, 2, 0], jnp.int32)
    groups, num_active = jax.jit(moe_ops.group_table, static_argnums=1)(sizes, 8)
    assert int(num_active) == 3
    np.testing.assert_array_equal(np.asarray(groups)[:, :3], [[1, 4, 5], [0, 3, 4], [3, 1, 2]])
    np.testing.assert_array_equal(np.asarray(groups)[2, 3:], 0)  # unused slots are empty
    assert groups.shape == (3, 7)  # min(rows, experts) slots
    groups, num_active = moe_ops.group_table(sizes, 2)  # 2 rows can fill at most 2 groups
    assert groups.shape == (3, 2)


def test_group_table_items():
    """Experts with more than R rows give several work items (chunks of R rows, the last one shorter), in
    expert order; item slots are the most M rows can fill; R >= M gives one item per expert."""
    sizes = jnp.asarray([0, 9, 0, 1, 5, 0], jnp.int32)
    items, num_active = jax.jit(moe_ops.group_table, static_argnums=(1, 2))(sizes, 16, 4)
    assert int(num_active) == 6 and items.shape == (3, moe_ops.item_slots(16, 6, 4)) == (3, 8)
    np.testing.assert_array_equal(np.asarray(items)[:, :6], [[1, 1, 1, 3, 4, 4], [0, 4, 8, 9, 10, 14],
                                                             [4, 4, 1, 1, 4, 1]])
    np.testing.assert_array_equal(np.asarray(items)[:, 6:], 0)
    items, num_active = moe_ops.group_table(sizes, 16, 16)
    np.testing.assert_array_equal(np.asarray(items)[:, :int(num_active)], [[1, 3, 4], [0, 9, 10], [9, 1, 5]])
    # The slot count bounds the items of any sizes with sum <= M (brute force over small cases).
    rng = np.random.default_rng(0)
    for _ in range(200):
        experts, num_rows, per_item = int(rng.integers(1, 12)), int(rng.integers(1, 40)), int(rng.integers(1, 9))
        cuts = np.sort(rng.integers(0, num_rows + 1, experts - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [int(rng.integers(cuts[-1] if len(cuts) else 0, num_rows + 1))]]))
        assert sizes.sum() <= num_rows
        assert (-(-sizes // per_item)).sum() <= moe_ops.item_slots(num_rows, experts, per_item)
    # Past the grid limit, R grows until the slots fit.
    assert moe_ops.item_slots(10**6, 70000 // 2, moe_ops.rows_per_item(10**6, 70000 // 2)) <= moe_ops.MAX_ITEM_SLOTS
    assert moe_ops.rows_per_item(544, 8) == moe_ops.CUDA_ROWS_PER_ITEM


def test_validation_errors():
    x, _, _, gate, up, down = make_case(0, 4, 2, 6, 16, 8, jnp.bfloat16)
    sizes = jnp.zeros((6,), jnp.int32)
    with pytest.raises(ValueError, match="impl"):
        moe_ops.grouped_expert_mlp(x, sizes, gate, up, down, impl="triton")
    with pytest.raises(ValueError, match="rows"):
        moe_ops.grouped_expert_mlp(x[None], sizes, gate, up, down)
    with pytest.raises(ValueError, match="down"):
        moe_ops.grouped_expert_mlp(x, sizes, gate, up, down[:, :4])
    with pytest.raises(ValueError, match="group_sizes"):
        moe_ops.grouped_expert_mlp(x, sizes[:5], gate, up, down)
    with pytest.raises(ValueError, match="bfloat16"):
        moe_ops.grouped_expert_mlp(x.astype(jnp.float32), sizes, gate, up, down, impl="cuda")
    with pytest.raises(ValueError, match="blocks_per_sm"):
        moe_ops.grouped_expert_mlp(x, sizes, gate, up, down, blocks_per_sm=2)


@pytest.mark.skipif(not moe_ops.cuda_built(), reason="extension built without the CUDA MoE op")
def test_cuda_lowering_calls_the_op():
    """Lowered for CUDA (no GPU needed), bf16 at decode size calls the op; float32, or above the row
    threshold, stays on ragged_dot. Past ops.moe.PAIRS_MAX pairs, so that the pairs op does not take the call, and
    over more experts than pairs, so that every expert on every token (use_all_experts) does not either."""
    x, indices, weights, gate, up, down = make_case(2, moe_ops.PAIRS_MAX // 8 + 1, 8, 128, 32, 16, jnp.bfloat16)

    def lowered(*args, impl="auto", **kwargs):
        fn = jax.jit(lambda *a: routed_experts(*a, impl=impl, **kwargs))
        checks = [jax.export.DisabledSafetyCheck.custom_call(moe_ops.TARGET)]
        return jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()

    assert moe_ops.TARGET in lowered(x, indices, weights, gate, up, down)
    assert moe_ops.TARGET not in lowered(x, indices, weights, gate, up, down, impl="xla")
    f32 = [a.astype(jnp.float32) for a in (x, indices, weights, gate, up, down)]
    f32[1] = indices
    assert moe_ops.TARGET not in lowered(*f32)
    many = moe_ops.CUDA_MAX_ROWS // 8 + 1
    x2, i2, w2, *_ = make_case(3, many, 8, 16, 32, 16, jnp.bfloat16)
    assert moe_ops.TARGET not in lowered(x2, i2, w2, gate, up, down)
    assert moe_ops.TARGET in lowered(x2, i2, w2, gate, up, down, impl="cuda")
    # Few experts, many pairs: every expert on every token, no custom call.
    x3, i3, w3, g3, u3, d3 = make_case(4, moe_ops.PAIRS_MAX // 8 + 1, 8, 16, 32, 16, jnp.bfloat16)
    assert moe_ops.use_all_experts(i3.size, x3, g3, "auto")
    few_experts = lowered(x3, i3, w3, g3, u3, d3)
    assert moe_ops.TARGET not in few_experts and moe_ops.PAIRS_TARGET not in few_experts
    # The register budget reaches the op's attribute: 4 by default, 1 when asked for (A/B runs).
    assert f"blocks_per_sm = {moe_ops.CUDA_BLOCKS_PER_SM} : i64" in lowered(x, indices, weights, gate, up, down)
    assert "blocks_per_sm = 1 : i64" in lowered(x, indices, weights, gate, up, down, blocks_per_sm=1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("offset,local", [(0, 8), (3, 4)])
def test_all_experts_routed_matches_the_original_formulation(dtype, offset, local):
    """Every held expert on every token, the chosen pairs picked (the GPU's few-experts path), against the original
    ragged_dot + scatter-add formulation; ids held elsewhere add nothing."""
    x, indices, weights, gate, up, down = make_case(5, 41, 2, 8, 48, 24, dtype)
    parts = (gate[offset:offset + local], up[offset:offset + local], down[offset:offset + local])
    new = jax.jit(moe_ops.all_experts_routed)(x, indices - offset, weights, *parts)
    old = jax.jit(original_routed_experts)(x, indices, weights, *parts, expert_offset=offset)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(new, np.float32), np.asarray(old, np.float32), rtol=tol, atol=tol)


def test_all_experts_route_choice():
    """Past PAIRS_MAX pairs, with at least as many pairs as experts held, and within the FLOP budget only."""
    x = jnp.zeros((100, 256), jnp.bfloat16)  # 100 tokens x 8 experts of 256 x 256: 0.3 GFLOP
    assert moe_ops.use_all_experts(200, x, jnp.zeros((8, 256, 256), jnp.bfloat16), "auto")
    assert not moe_ops.use_all_experts(200, x, jnp.zeros((8, 256, 256), jnp.bfloat16), "xla")
    assert not moe_ops.use_all_experts(2000, x.repeat(10, 0), jnp.zeros((8, 256, 256), jnp.bfloat16), "auto")  # 3.1 GFLOP
    assert not moe_ops.use_all_experts(moe_ops.PAIRS_MAX, x[:36], jnp.zeros((8, 256, 256), jnp.bfloat16), "auto")
    assert not moe_ops.use_all_experts(200, x, jnp.zeros((384, 256, 256), jnp.bfloat16), "auto")  # more experts than pairs
    big = jnp.zeros((16, 7168, 256), jnp.bfloat16)  # a K2 slice's widths: over the FLOP budget
    assert not moe_ops.use_all_experts(800, jnp.zeros((100, 7168), jnp.bfloat16), big, "auto")


def test_benchmark_smoke(tmp_path):
    """benchmarks/moe_experts.py --smoke runs on CPU and writes results that parse (no timing checked)."""
    import json
    import os
    import sys
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    sys.path.insert(0, bench_dir)
    try:
        import moe_experts
    finally:
        sys.path.remove(bench_dir)
    assert moe_experts.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "moe_experts_smoke.json").read_text())
    assert {r["layout"] for r in data["rows"]} == {"ep", "tp"}
    assert all(r["xla_us"] > 0 and r["cuda_bps4_us"] > 0 for r in data["rows"])
    assert (tmp_path / "moe_experts_smoke.md").read_text().startswith("# Routed MoE")


def test_pair_expert_mlp_without_cuda_build_says_so():
    """The pairs op is CUDA-only: without it in the extension, a direct call fails with a one-line reason (with it,
    a first direct call registers the target: tests/test_moe_experts_gpu.py)."""
    if moe_ops.pairs_built():
        pytest.skip("this build has the CUDA pairs op")
    x = jnp.zeros((1, 8), jnp.bfloat16)
    w = jnp.zeros((2, 8, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="CUDA extension"):
        moe_ops.pair_expert_mlp(x, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1)), w, w, w)


def test_pair_expert_mlp_refuses_a_bad_down_unroll():
    x = jnp.zeros((1, 8), jnp.bfloat16)
    w = jnp.zeros((2, 8, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="down_unroll must be 1 or 2"):
        moe_ops.pair_expert_mlp(x, jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1)), w, w, w, down_unroll=3)
