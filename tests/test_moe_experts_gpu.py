"""The CUDA grouped expert MLP (ffi/moe_experts.cu) against a float32 reference (needs a GPU; marked `gpu`).

The reference loops over rows in numpy (float64 from the same bf16 values), independent of ragged_dot.
Sizes are random: odd and non-multiple-of-8 widths (the element-wise path), K2-like multiples of 8 (the
16-byte path), 1..70 tokens × top-k, empty experts, every token on one expert (many 4-row chunks), and
pairs of experts held elsewhere (rows past every group must come out 0). Before each call the allocator is
handed NaN-filled blocks of the outputs' sizes, so a row the kernels fail to write shows up as NaN.
The work-item grid (each expert's rows in chunks of R rows, each chunk its own blocks) is checked against
the XLA formulation (ragged_dot) and the float64 reference at 1, 5 and 67 rows per expert, one expert holding
every row, empty experts and rows past every group, for R = 4 (the default), 1, 3 and one item per expert.
"""

from __future__ import annotations

import shutil
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import SANITIZER_CLEAN, run_compute_sanitizer
from kdtree_jax.model.moe import routed_experts
from kdtree_jax.ops import moe as moe_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not moe_ops.cuda_built(), reason="extension built without the CUDA MoE op"),
]


def poison_allocator(*shapes_and_dtypes):
    blocks = [jnp.full(shape, jnp.nan, dtype) for shape, dtype in shapes_and_dtypes]
    jax.block_until_ready(blocks)
    for block in blocks:
        block.delete()


def make_weights(rng, num_experts, hidden, inter):
    def bf16(shape, scale):
        return jnp.asarray(rng.normal(0, scale, shape).astype(np.float32)).astype(jnp.bfloat16)
    return (bf16((num_experts, hidden, inter), hidden ** -0.5), bf16((num_experts, hidden, inter), hidden ** -0.5),
            bf16((num_experts, inter, hidden), inter ** -0.5))


def reference_grouped(rows, group_sizes, gate, up, down):
    rows, gate, up, down = (np.asarray(a.astype(jnp.float32), np.float64) for a in (rows, gate, up, down))
    out = np.zeros_like(rows)
    start = 0
    for e, size in enumerate(np.asarray(group_sizes)):
        x = rows[start:start + size]
        g, u = x @ gate[e], x @ up[e]
        out[start:start + size] = (g / (1 + np.exp(-g)) * u) @ down[e]
        start += size
    return out


def reference_routed(x2d, indices, weights, gate, up, down, expert_offset=0):
    """Per-token loop over the chosen experts held here (float64)."""
    x, gate, up, down = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x2d, gate, up, down))
    out = np.zeros_like(x)
    for t, (chosen, w) in enumerate(zip(np.asarray(indices), np.asarray(weights))):
        for e, we in zip(chosen, w):
            e = e - expert_offset
            if 0 <= e < gate.shape[0]:
                g, u = x[t] @ gate[e], x[t] @ up[e]
                out[t] += we * ((g / (1 + np.exp(-g)) * u) @ down[e])
    return out


def assert_close(out, ref):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite output"
    scale = max(np.abs(ref).max(), 1e-3)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=1e-2 * scale)


def random_routing(rng, num_tokens, top_k, num_experts, mode):
    if mode == "one_expert":
        indices = np.tile(rng.permutation(num_experts)[:top_k], (num_tokens, 1))
    elif mode == "few_experts":  # most experts empty, some with many rows
        pool = rng.permutation(num_experts)[:max(top_k, 3)]
        indices = np.stack([rng.permutation(pool)[:top_k] for _ in range(num_tokens)])
    else:
        indices = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)])
    weights = rng.uniform(0.1, 1.0, (num_tokens, top_k)).astype(np.float32)
    return jnp.asarray(indices, jnp.int32), jnp.asarray(weights)


# (tokens, top_k, experts, hidden, inter, routing)
CASES = [
    (1, 1, 4, 64, 64, "random"),
    (1, 8, 16, 7168 // 8, 2048 // 8, "random"),    # K2 proportions, 16-byte path
    (9, 8, 96, 512, 256, "random"),
    (33, 8, 40, 256, 72, "random"),
    (70, 8, 12, 128, 64, "few_experts"),
    (70, 2, 8, 64, 128, "one_expert"),             # one group of 70 rows: 18 chunks
    (5, 3, 7, 37, 21, "random"),                   # odd widths: element-wise path
    (64, 4, 10, 100, 36, "few_experts"),           # widths % 8 == 4
    (17, 2, 5, 8, 8, "one_expert"),
    (3, 4, 6, 2056, 40, "random"),                 # 3 hidden-dim splits in kernel 1 (the last one short)
    (4, 2, 5, 1501, 24, "few_experts"),            # 2 splits, element-wise path
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("blocks_per_sm", [1, 4])
def test_grouped_mlp_matches_reference(case, blocks_per_sm):
    tokens, top_k, experts, hidden, inter, mode = case
    rng = np.random.default_rng(CASES.index(case))
    gate, up, down = make_weights(rng, experts, hidden, inter)
    indices, _ = random_routing(rng, tokens, top_k, experts, mode)
    flat = np.asarray(indices).reshape(-1)
    # A few pairs go to "non-local" experts: they sort last and belong to no group.
    local = np.where(rng.uniform(size=flat.shape) < 0.15, experts, flat)
    order = np.argsort(local, kind="stable")
    group_sizes = jnp.asarray(np.bincount(local, minlength=experts + 1)[:experts], jnp.int32)
    x = jnp.asarray(rng.normal(0, 1, (tokens, hidden)).astype(np.float32)).astype(jnp.bfloat16)
    rows = x[order // top_k]
    fn = jax.jit(lambda *a: moe_ops.grouped_expert_mlp(*a, impl="cuda", blocks_per_sm=blocks_per_sm))
    poison_allocator(((rows.shape[0], hidden), jnp.bfloat16), ((rows.shape[0], inter), jnp.float32))
    out = jax.block_until_ready(fn(rows, group_sizes, gate, up, down))
    assert_close(out, reference_grouped(rows, group_sizes, gate, up, down))
    # Deterministic: a second call is bit-identical.
    np.testing.assert_array_equal(np.asarray(fn(rows, group_sizes, gate, up, down)), np.asarray(out))


# (rows M, experts E, share of experts with rows): E > 1024 takes several rounds of the table kernel's scans;
# M < E leaves fewer slots than experts; a share of 0 gives no group at all.
TABLE_CASES = [(72, 384, 0.15), (9, 8, 0.6), (5, 3000, 0.001), (2048, 1500, 0.5), (7, 40, 0.0), (1, 1, 1.0)]


@pytest.mark.parametrize("case", TABLE_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("per_item", ["4", "1", "3"])
def test_table_kernel_matches_group_table(case, per_item):
    """The op's first kernel builds the same table as ops.moe.group_table (jnp), from random sizes whose sum
    is at most M; the op runs on 8-wide toy experts so that only the table matters."""
    num_rows, experts, share = case
    rng = np.random.default_rng(num_rows * 7 + experts)
    sizes = np.where(rng.uniform(size=experts) < share, rng.integers(1, 12, experts), 0)
    while sizes.sum() > num_rows:  # keep sum <= M
        sizes[rng.choice(np.flatnonzero(sizes))] -= 1
    sizes = jnp.asarray(sizes, jnp.int32)
    gate, up, down = make_weights(rng, experts, 8, 8)
    rows = jnp.asarray(rng.normal(0, 1, (num_rows, 8)).astype(np.float32)).astype(jnp.bfloat16)
    slots = moe_ops.item_slots(num_rows, experts, int(per_item))
    poison_allocator(((3, slots), jnp.int32))
    out, groups, num_active = jax.jit(lambda *a: moe_ops.call_cuda_op(*a, int(per_item)))(rows, sizes, gate, up, down)
    want_groups, want_active = moe_ops.group_table(sizes, num_rows, int(per_item))
    assert groups.shape == (3, slots)
    assert int(num_active) == int(want_active)
    np.testing.assert_array_equal(np.asarray(groups), np.asarray(want_groups))
    assert_close(out, reference_grouped(rows, sizes, gate, up, down))


def test_table_kernel_clamps_bad_sizes():
    """Negative sizes count as 0 and sizes past M are cut at row M: the op stays in bounds."""
    num_rows, experts = 6, 5
    sizes = jnp.asarray([2, -3, 3, 4, 1], jnp.int32)  # 2 + 3 + 4 > 6: the third group is cut, the fourth dropped
    rng = np.random.default_rng(11)
    gate, up, down = make_weights(rng, experts, 16, 8)
    rows = jnp.asarray(rng.normal(0, 1, (num_rows, 16)).astype(np.float32)).astype(jnp.bfloat16)
    out, groups, num_active = jax.jit(lambda *a: moe_ops.call_cuda_op(*a))(rows, sizes, gate, up, down)
    assert int(num_active) == 3
    np.testing.assert_array_equal(np.asarray(groups)[:, :3], [[0, 2, 3], [0, 2, 5], [2, 3, 1]])
    assert_close(out, reference_grouped(rows, jnp.asarray([2, 0, 3, 1, 0]), gate, up, down))


# (name, experts, hidden, inter, group sizes, rows past every group): the work-item grid at odd sizes.
ITEM_CASES = [
    ("one_row_each", 8, 256, 256, [1] * 8, 0),
    ("five_each", 8, 256, 256, [5] * 8, 3),
    ("sixty_seven_each", 8, 256, 256, [67] * 8, 0),                 # the default pair at batch-16 DDTree 16
    ("all_on_one", 8, 256, 256, [0, 0, 0, 544, 0, 0, 0, 0], 0),     # one expert, 136 items
    ("mixed_empty", 12, 256, 256, [0, 67, 0, 5, 1, 0, 0, 13, 0, 2, 0, 0], 7),
    ("first_and_last", 6, 128, 64, [67, 0, 0, 0, 0, 5], 1),
    ("odd_widths", 5, 37, 21, [0, 67, 1, 5, 0], 2),                 # element-wise path
    ("k2_like", 40, 7168 // 8, 2048 // 8, [1, 2, 0, 3, 1, 0, 5, 1] * 5, 4),  # 16-byte path, few rows each
    ("split_hidden", 4, 2056, 40, [9, 0, 67, 1], 0),                # 3 hidden-dim splits in kernel 1
]


@pytest.mark.parametrize("case", ITEM_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("per_item", ["4", "1", "3", "100000"])
def test_item_grid_matches_xla(case, per_item):
    """The CUDA op, each expert's rows spread over items of R rows, against ragged_dot (ragged_mlp, same
    device) and the float64 reference; its table against group_table; rows past every group are 0."""
    _, experts, hidden, inter, sizes, spare = case
    rng = np.random.default_rng(ITEM_CASES.index(case) * 10 + len(per_item))
    gate, up, down = make_weights(rng, experts, hidden, inter)
    sizes = jnp.asarray(sizes, jnp.int32)
    num_rows = int(sizes.sum()) + spare
    rows = jnp.asarray(rng.normal(0, 1, (num_rows, hidden)).astype(np.float32)).astype(jnp.bfloat16)
    poison_allocator(((num_rows, hidden), jnp.bfloat16), ((num_rows, inter), jnp.float32))
    out, items, num_active = jax.jit(lambda *a: moe_ops.call_cuda_op(*a, int(per_item)))(rows, sizes, gate, up, down)
    want_items, want_active = moe_ops.group_table(sizes, num_rows, int(per_item))
    assert int(num_active) == int(want_active)
    np.testing.assert_array_equal(np.asarray(items), np.asarray(want_items))
    ref = reference_grouped(rows, sizes, gate, up, down)
    assert_close(out, ref)
    xla = jax.jit(moe_ops.ragged_mlp)(rows, sizes, gate, up, down)
    assert_close(out, np.asarray(xla.astype(jnp.float32), np.float64))
    if spare:
        assert not np.asarray(out[num_rows - spare:].astype(jnp.float32)).any()
    auto = jax.jit(lambda *a: moe_ops.grouped_expert_mlp(*a, impl="auto"))(rows, sizes, gate, up, down)
    if per_item == str(moe_ops.CUDA_ROWS_PER_ITEM):  # auto = the CUDA op at its default R here (<= 2048 rows)
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(out))
    else:
        assert_close(auto, ref)
    dense = jax.jit(lambda *a: moe_ops.grouped_expert_mlp(*a, impl="dense"))(rows, sizes, gate, up, down)
    assert_close(dense, ref)


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_routed_experts_device_slices(layout):
    """Each device's share as shard_map hands it over (tp: a slice of every expert's intermediate dim;
    ep: E/n whole experts with expert_offset), summed over 4 "devices", equals the full computation."""
    rng = np.random.default_rng(7)
    tokens, top_k, experts, hidden, inter, n = 9, 8, 32, 256, 96, 4
    gate, up, down = make_weights(rng, experts, hidden, inter)
    indices, weights = random_routing(rng, tokens, top_k, experts, "random")
    x = jnp.asarray(rng.normal(0, 1, (tokens, hidden)).astype(np.float32)).astype(jnp.bfloat16)
    fn = jax.jit(routed_experts, static_argnames=("impl",))
    total = np.zeros((tokens, hidden))
    ref = np.zeros((tokens, hidden))
    for d in range(n):
        if layout == "tp":
            s = slice(d * inter // n, (d + 1) * inter // n)
            parts, offset = (gate[:, :, s], up[:, :, s], down[:, s, :]), 0
        else:
            s = slice(d * experts // n, (d + 1) * experts // n)
            parts, offset = (gate[s], up[s], down[s]), d * experts // n
        out = fn(x, indices, weights, *parts, expert_offset=offset, impl="cuda")
        assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()
        total += np.asarray(out.astype(jnp.float32))
        ref += reference_routed(x, indices, weights, *parts, expert_offset=offset)
    assert_close(jnp.asarray(total), ref)
    full = reference_routed(x, indices, weights, gate, up, down)
    np.testing.assert_allclose(ref, full, rtol=1e-9, atol=1e-9)


def test_auto_uses_cuda_op_and_agrees_with_ragged_dot():
    """Past PAIRS_MAX pairs (the pairs op's range) and over more experts than pairs (use_all_experts' range): the
    sorted CUDA op. (At 9 x 8 = 72 pairs over 24 experts, as this test had it, "auto" runs the pairs op.)"""
    rng = np.random.default_rng(3)
    gate, up, down = make_weights(rng, 128, 128, 64)
    tokens = moe_ops.PAIRS_MAX // 8 + 1
    indices, weights = random_routing(rng, tokens, 8, 128, "random")
    x = jnp.asarray(rng.normal(0, 1, (tokens, 128)).astype(np.float32)).astype(jnp.bfloat16)
    assert not moe_ops.use_all_experts(indices.size, x, gate, "auto")
    fn = jax.jit(routed_experts, static_argnames=("impl",))
    hlo = fn.lower(x, indices, weights, gate, up, down, impl="auto").as_text()
    assert moe_ops.TARGET in hlo
    auto = fn(x, indices, weights, gate, up, down, impl="auto")
    xla = fn(x, indices, weights, gate, up, down, impl="xla")
    assert_close(auto, np.asarray(xla.astype(jnp.float32), np.float64))


def test_inside_while_loop():
    """Inside lax.fori_loop (XLA may capture the loop body in a CUDA graph): same result as plain calls."""
    rng = np.random.default_rng(5)
    gate, up, down = make_weights(rng, 16, 256, 128)
    indices, weights = random_routing(rng, 9, 8, 16, "random")
    x = jnp.asarray(rng.normal(0, 1, (9, 256)).astype(np.float32)).astype(jnp.bfloat16)

    @jax.jit
    def loop(x):
        def body(i, x):
            return x + routed_experts(x, indices, weights, gate, up, down, impl="cuda") * 1e-2
        return jax.lax.fori_loop(0, 3, body, x)

    expected = x
    step = jax.jit(lambda x: x + routed_experts(x, indices, weights, gate, up, down, impl="cuda") * 1e-2)
    for _ in range(3):
        expected = step(expected)
    assert_close(loop(x), np.asarray(expected.astype(jnp.float32), np.float64))


# The pairs op (ffi/moe_pairs.cu): (tokens, top_k, experts, hidden, inter, share of pairs held elsewhere).
PAIR_CASES = [
    (1, 8, 16, 7168 // 8, 2048 // 8, 0.0),     # an autoregressive step, K2 proportions: 16-byte path, split hidden
    (1, 1, 4, 64, 64, 0.0),
    (9, 8, 96, 512, 256, 0.3),                 # a verify pass under expert parallelism
    (5, 3, 7, 37, 21, 0.2),                    # odd widths: element-wise path
    (4, 2, 5, 1501, 24, 0.0),                  # several hidden-dim splits, element-wise path
    (3, 4, 6, 2056, 40, 0.5),                  # several splits, the last one short
    (70, 2, 8, 256, 256, 0.1),                 # 140 pairs on 8 experts (forced: "auto" sorts these)
    (6, 2, 4, 128, 64, 1.0),                   # nothing held here: zeros
]


def routing_held_here(rng, tokens, top_k, experts, elsewhere):
    """Random choices among 2 * experts global ids, of which [0, experts) are held here (offset 0): about `elsewhere`
    of the pairs on ids held elsewhere (a token may repeat an expert: the op must not care)."""
    local = rng.integers(0, experts, (tokens, top_k))
    indices = np.where(rng.uniform(size=local.shape) < elsewhere, local + experts, local)
    weights = rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32)
    return jnp.asarray(indices, jnp.int32), jnp.asarray(weights)


@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("blocks_per_sm", [1, 4])
def test_pairs_op_matches_reference(case, blocks_per_sm):
    """routed_experts on the pairs in place (impl="pairs") against the float64 loop and the sorted CUDA op;
    NaN-poisoned outputs; a second call bit-identical (the arrival counters are zeroed per call)."""
    tokens, top_k, experts, hidden, inter, elsewhere = case
    rng = np.random.default_rng(PAIR_CASES.index(case) + 100)
    gate, up, down = make_weights(rng, experts, hidden, inter)
    indices, weights = routing_held_here(rng, tokens, top_k, experts, elsewhere)
    x = jnp.asarray(rng.normal(0, 1, (tokens, hidden)).astype(np.float32)).astype(jnp.bfloat16)
    fn = jax.jit(routed_experts, static_argnames=("impl", "blocks_per_sm"))
    assert moe_ops.PAIRS_TARGET in fn.lower(x, indices, weights, gate, up, down, impl="pairs").as_text()
    poison_allocator(((tokens, hidden), jnp.bfloat16), ((tokens * top_k, hidden), jnp.bfloat16),
                     ((tokens * top_k, inter), jnp.float32))
    out = jax.block_until_ready(fn(x, indices, weights, gate, up, down, impl="pairs", blocks_per_sm=blocks_per_sm))
    ref = reference_routed(x, indices, weights, gate, up, down)
    if elsewhere == 1.0:
        assert not np.asarray(out.astype(jnp.float32)).any()
    else:
        assert_close(out, ref)
    again = fn(x, indices, weights, gate, up, down, impl="pairs", blocks_per_sm=blocks_per_sm)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
    on_sorted = fn(x, indices, weights, gate, up, down, impl="cuda", blocks_per_sm=blocks_per_sm)
    assert_close(out, np.asarray(on_sorted.astype(jnp.float32), np.float64))


def test_pairs_op_with_expert_offset():
    """Expert parallelism's second device (expert_offset = E): ids below the offset are negative locally and ids
    past E + E held elsewhere; routed_experts hands the pairs op the local ids unmasked, which skips both."""
    rng = np.random.default_rng(7)
    tokens, top_k, experts, hidden, inter = 5, 4, 6, 256, 64
    gate, up, down = make_weights(rng, experts, hidden, inter)
    indices = jnp.asarray(rng.integers(0, 3 * experts, (tokens, top_k)), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (tokens, top_k)).astype(np.float32))
    x = jnp.asarray(rng.normal(0, 1, (tokens, hidden)).astype(np.float32)).astype(jnp.bfloat16)
    fn = jax.jit(routed_experts, static_argnames=("impl", "expert_offset"))
    out = fn(x, indices, weights, gate, up, down, expert_offset=experts, impl="pairs")
    assert_close(out, reference_routed(x, indices, weights, gate, up, down, expert_offset=experts))


@pytest.mark.parametrize("down_unroll", [1, 2])
@pytest.mark.parametrize("hidden,inter", [(7168 // 8, 2048 // 8), (2056, 40), (37, 21), (256, 200)])
def test_pairs_op_equals_sorted_op_bitwise(hidden, inter, down_unroll):
    """At the sorted op's split count a pair's expert output is the sorted op's row bit for bit: with one choice a
    token and weight 1 the two ops' results are equal (each is that output, rounded once), whichever down_unroll
    (its steps are added in the same order; I = 200 leaves the second step of some slices past I)."""
    rng = np.random.default_rng(hidden)
    tokens, experts = 24, 6
    gate, up, down = make_weights(rng, experts, hidden, inter)
    indices = jnp.asarray(rng.integers(0, experts, (tokens, 1)), jnp.int32)
    weights = jnp.ones((tokens, 1), jnp.float32)
    x = jnp.asarray(rng.normal(0, 1, (tokens, hidden)).astype(np.float32)).astype(jnp.bfloat16)
    splits = moe_ops.choose_splits(tokens, hidden, inter)
    pairs = jax.jit(lambda *a: moe_ops.pair_expert_mlp(*a, splits=splits, down_unroll=down_unroll))(
        x, indices, weights, gate, up, down)
    on_sorted = jax.jit(routed_experts, static_argnames=("impl",))(x, indices, weights, gate, up, down, impl="cuda")
    np.testing.assert_array_equal(np.asarray(pairs), np.asarray(on_sorted))


@pytest.mark.parametrize("experts", [16, 128])
def test_auto_takes_pairs_op_for_few_pairs_only(experts):
    """"auto": the pairs op up to PAIRS_MAX pairs; above, every expert on every token where the pairs reach every
    expert (16 experts: use_all_experts), else the sorted op (128 experts)."""
    rng = np.random.default_rng(9)
    gate, up, down = make_weights(rng, experts, 128, 64)
    fn = jax.jit(routed_experts, static_argnames=("impl",))
    for tokens, top_k in ((1, 8), (moe_ops.PAIRS_MAX // 2, 2), (moe_ops.PAIRS_MAX // 2 + 1, 2), (150, 2)):
        indices, weights = random_routing(rng, tokens, top_k, experts, "random")
        x = jnp.asarray(rng.normal(0, 1, (tokens, 128)).astype(np.float32)).astype(jnp.bfloat16)
        hlo = fn.lower(x, indices, weights, gate, up, down, impl="auto").as_text()
        few = tokens * top_k <= moe_ops.PAIRS_MAX
        every = moe_ops.use_all_experts(tokens * top_k, x, gate, "auto")
        assert every == (not few and tokens * top_k >= experts)
        assert (moe_ops.PAIRS_TARGET in hlo) == few and (moe_ops.TARGET in hlo) == (not few and not every)
        assert_close(fn(x, indices, weights, gate, up, down, impl="auto"),
                     reference_routed(x, indices, weights, gate, up, down))


def test_pairs_op_inside_while_loop():
    """Inside lax.fori_loop (a CUDA graph when XLA captures the body): the memset and the arrival counters replay."""
    rng = np.random.default_rng(15)
    gate, up, down = make_weights(rng, 16, 2056, 128)
    indices, weights = random_routing(rng, 3, 8, 16, "random")
    x = jnp.asarray(rng.normal(0, 1, (3, 2056)).astype(np.float32)).astype(jnp.bfloat16)

    def step(x):
        return x + routed_experts(x, indices, weights, gate, up, down, impl="pairs") * 1e-2

    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 4, lambda i, x: step(x), x))
    expected = x
    for _ in range(4):
        expected = jax.jit(step)(expected)
    np.testing.assert_array_equal(np.asarray(loop(x)), np.asarray(expected))


# The pairs op with the shared expert: (tokens, top_k, experts, hidden, inter, share of pairs held elsewhere).
SHARED_CASES = [
    (1, 8, 16, 7168 // 8, 2048 // 8, 0.0),     # an autoregressive step, K2 proportions
    (9, 8, 40, 512, 256, 0.3),                 # a verify pass, some pairs held elsewhere
    (5, 3, 7, 37, 21, 0.0),                    # odd widths: element-wise path
    (3, 4, 6, 2056, 40, 0.5),                  # several hidden-dim splits, the last one short
    (4, 2, 5, 64, 64, 1.0),                    # no routed pair held here: the shared expert alone
]


def reference_shared(x2d, gate, up, down):
    x, gate, up, down = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x2d, gate, up, down))
    g, u = x @ gate, x @ up
    return (g / (1 + np.exp(-g)) * u) @ down


@pytest.mark.parametrize("case", SHARED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_pairs_op_with_shared_expert(case):
    """pair_expert_mlp(shared=...) against the float64 loop plus the shared MLP, NaN-poisoned; and bit for bit against
    the plain pairs op given the shared expert as one more expert that every token chooses last with weight 1 (the
    same float32 sum: 1 * y adds y exactly)."""
    tokens, top_k, experts, hidden, inter, elsewhere = case
    rng = np.random.default_rng(SHARED_CASES.index(case) + 300)
    gate, up, down = make_weights(rng, experts, hidden, inter)
    shared = tuple(w[0] for w in make_weights(rng, 1, hidden, inter))
    indices, weights = routing_held_here(rng, tokens, top_k, experts, elsewhere)
    x = jnp.asarray(rng.normal(0, 1, (tokens, hidden)).astype(np.float32)).astype(jnp.bfloat16)
    fn = jax.jit(routed_experts, static_argnames=("impl",))
    assert moe_ops.PAIRS_SHARED_TARGET in fn.lower(x, indices, weights, gate, up, down, impl="pairs",
                                                   shared=shared).as_text()
    poison_allocator(((tokens, hidden), jnp.bfloat16), ((tokens * (top_k + 1), hidden), jnp.bfloat16),
                     ((tokens * (top_k + 1), inter), jnp.float32))
    out = jax.block_until_ready(fn(x, indices, weights, gate, up, down, impl="pairs", shared=shared))
    assert_close(out, reference_routed(x, indices, weights, gate, up, down) + reference_shared(x, *shared))
    # The shared expert as expert E, chosen last by every token with weight 1 (ids past 2E stay held elsewhere).
    local = jnp.where(indices < experts, indices, 2 * experts + 1)
    as_expert = [jnp.concatenate([a, b[None]]) for a, b in zip((gate, up, down), shared)]
    splits = moe_ops.choose_splits(tokens * top_k, hidden, inter)
    plain = jax.jit(lambda *a: moe_ops.pair_expert_mlp(*a, splits=splits))(
        x, jnp.concatenate([local, jnp.full((tokens, 1), experts, jnp.int32)], 1),
        jnp.concatenate([weights, jnp.ones((tokens, 1), jnp.float32)], 1), *as_expert)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))


def test_moe_layer_folds_shared_expert_on_gpu():
    """A GPU "auto" MoE layer with few pairs runs its shared expert inside the pairs op (no products of its own) and
    agrees with the layer whose shared expert runs apart (impl forced off the fold) and with float64."""
    from flax import nnx

    from kdtree_jax.config import ModelConfig
    from kdtree_jax.model.moe import MoE
    cfg = ModelConfig(vocab_size=64, hidden_size=256, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                      moe_intermediate_size=128, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
                      qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4,
                      n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5)
    moe = MoE(cfg, jnp.bfloat16, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 3, 256), jnp.float32).astype(jnp.bfloat16)
    fn = nnx.jit(lambda m, x: m(x)[0])
    assert moe.folds_shared(x.reshape(3, 256), 4, "auto")
    hlo = fn.lower(moe, x).as_text()
    assert moe_ops.PAIRS_SHARED_TARGET in hlo and "kdtree_moe_pairs\"" not in hlo
    out = fn(moe, x)
    x2d = x.reshape(3, 256)
    indices, weights = moe.gate(x2d)
    sh = moe.shared_experts
    ref = (reference_routed(x2d, indices, weights, moe.experts.gate_proj[...], moe.experts.up_proj[...],
                            moe.experts.down_proj[...])
           + reference_shared(x2d, sh.gate_proj.kernel[...], sh.up_proj.kernel[...], sh.down_proj.kernel[...]))
    assert_close(out.reshape(3, 256), ref)
    apart = nnx.jit(lambda m, x: m.routed(x, *m.gate(x), impl="pairs") + m.shared_experts(x))(moe, x2d)
    assert_close(out.reshape(3, 256), np.asarray(apart.astype(jnp.float32), np.float64))


SANITIZER_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from kdtree_jax.model.moe import routed_experts
    rng = np.random.default_rng(0)
    # Both ops, the 16-byte and the element-wise paths, one and several hidden-dim splits, pairs held elsewhere.
    for tokens, top_k, experts, hidden, inter in ((3, 4, 6, 2056, 40), (5, 3, 7, 37, 21), (2, 8, 16, 256, 128)):
        w = [jnp.asarray(rng.normal(0, 0.05, s).astype(np.float32)).astype(jnp.bfloat16)
             for s in ((experts, hidden, inter), (experts, hidden, inter), (experts, inter, hidden))]
        x = jnp.asarray(rng.normal(0, 1, (tokens, hidden)).astype(np.float32)).astype(jnp.bfloat16)
        indices = jnp.asarray(rng.integers(0, 2 * experts, (tokens, top_k)), jnp.int32)
        weights = jnp.asarray(rng.uniform(0.1, 1, (tokens, top_k)).astype(np.float32))
        for impl in ("pairs", "cuda"):
            out = jax.jit(routed_experts, static_argnames=("impl",))(x, indices, weights, *w, impl=impl)
            assert np.isfinite(np.asarray(out, np.float32)).all()
        shared = tuple(a[0] for a in w)  # the pairs op with a shared expert
        out = jax.jit(routed_experts, static_argnames=("impl",))(x, indices, weights, *w, impl="pairs", shared=shared)
        assert np.isfinite(np.asarray(out, np.float32)).all()
        from kdtree_jax.ops import moe as moe_ops  # the pairs op's down kernel at both unrolls
        for unroll in (1, 2):
            out = jax.jit(lambda *a: moe_ops.pair_expert_mlp(*a, down_unroll=unroll))(x, indices, weights, *w)
            assert np.isfinite(np.asarray(out, np.float32)).all()
    # The router's choice (ffi/moe_route.cu): K2's sizes, and groups with softmax scores.
    from kdtree_jax.config import ModelConfig
    from kdtree_jax.ops.route import cuda_choose_experts
    base = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
                v_head_dim=16, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5)
    for cfg in (ModelConfig(**base, n_routed_experts=384, num_experts_per_tok=8),
                ModelConfig(**base, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                            scoring_func="softmax")):
        logits = jnp.asarray(rng.normal(0, 2, (9, cfg.n_routed_experts)).astype(np.float32))
        bias = jnp.asarray(rng.normal(0, 0.1, cfg.n_routed_experts).astype(np.float32))
        i, w = jax.jit(lambda l, b: cuda_choose_experts(l, b, cfg))(logits, bias)
        assert np.isfinite(np.asarray(w)).all() and (np.asarray(i) < cfg.n_routed_experts).all()
    print("SANITIZER-CASE-OK")
""")


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_compute_sanitizer_is_clean(tool):
    """Both MoE ops and the router's op under compute-sanitizer (racecheck and synccheck on our kernels only: their names
    start with "moe_")."""
    returncode, log = run_compute_sanitizer(tool, SANITIZER_SCRIPT, "moe_")
    assert "SANITIZER-CASE-OK" in log, log[-4000:]
    assert returncode == 0 and SANITIZER_CLEAN[tool] in log, log[-4000:]
