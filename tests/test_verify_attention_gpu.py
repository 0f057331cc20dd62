"""The CUDA verify-attention kernel against the pure-JAX oracle (needs a GPU; marked `gpu`).

Same sweep as the CPU tests, at the kernel's geometry (bf16, 576 = 512 + 64) and longer tables, with both
the automatic split count and forced ones (one split writes directly, several go through the merge).
Before every call the allocator is handed a NaN-filled block of the outputs' size, so an element the kernel
fails to write shows up as NaN. Also: repeated calls are bit-identical, a call inside `lax.while_loop`
with XLA command buffers agrees, and compute-sanitizer (memcheck) is clean on a small case.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_compute_sanitizer
from kdtree_jax.ops import ffi as vffi
from test_verify_attention import check_against_reference, jitted, make_case, reference_f32

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (vffi.available() and vffi.cuda_built()), reason="extension built without CUDA"),
]

LATENT, ROPE = 512, 64
SCALE = (128 + 64) ** -0.5  # K2's qk head dim (the absorbed row is 576 wide, the scale is not)


def poison_allocator(*shapes_and_dtypes):
    """Fill freshly allocated device blocks of these sizes with NaN and free them again: the next
    allocation of the same sizes (the kernel's outputs) very likely lands on the poisoned memory."""
    blocks = [jnp.full(shape, jnp.nan, dtype) for shape, dtype in shapes_and_dtypes]
    jax.block_until_ready(blocks)
    for block in blocks:
        block.delete()


def run_poisoned(fn, case):
    q = case[0]
    batch, num_queries, num_heads, _ = q.shape
    poison_allocator(((batch, num_queries, num_heads, LATENT), jnp.bfloat16),
                     ((batch, num_queries, num_heads), jnp.float32))
    return jax.block_until_ready(fn(*case))


def jitted_variant(variant: str, softmax_scale: float, num_splits: int):
    """The CUDA op with an explicit kernel variant (vffi.VARIANTS), as benchmarks and these tests force one."""
    return jax.jit(functools.partial(vffi.verify_attention_ffi, softmax_scale=softmax_scale, rope_dim=ROPE,
                                     num_splits=num_splits, variant=variant))


def check_two_draws(shape, num_splits, seed_step, seed_offset, variant="auto"):
    """The op with this kernel variant against the float32 reference on two random cases of this shape, outputs
    poisoned before each call."""
    batch, num_queries, num_heads, max_len = shape
    fn = jitted_variant(variant, SCALE, num_splits)
    for draw in range(2):
        case = make_case(seed_step * draw + max_len + num_splits + seed_offset, batch, num_queries, num_heads, max_len,
                         latent=LATENT, rope=ROPE, dtype=jnp.bfloat16)
        out, lse = run_poisoned(fn, case)
        ref_out, ref_lse = reference_f32(case, SCALE, ROPE)
        check_against_reference(out, lse, ref_out, ref_lse, tol=1e-2)


# (B, T, H, Lmax): every T of the issue, H in {1, 8, 16}, lengths that are no multiple of 16 or 32.
GPU_SHAPES = [
    (3, 1, 8, 2001),
    (2, 2, 16, 777),
    (3, 7, 1, 1234),
    (2, 16, 8, 3001),
    (1, 33, 1, 333),
    (2, 64, 1, 1500),
    (1, 200, 1, 999),
    (2, 200, 16, 517),
    (4, 16, 8, 40007),
]


# 16 and 17 splits: the largest count the warp-per-row merge takes and the smallest the block merge takes, on
# four of the shapes (decode rows, many rows, many heads, one head) to keep the file's device time down.
MERGE_BOUNDARY = [((3, 1, 8, 2001), 16), ((3, 1, 8, 2001), 17), ((2, 16, 8, 3001), 16), ((2, 16, 8, 3001), 17),
                  ((2, 200, 16, 517), 16), ((2, 200, 16, 517), 17), ((1, 33, 1, 333), 16), ((1, 33, 1, 333), 17)]
# The block merge's three column chunkings (B*T*H <= 16, <= 64, more rows): the B = 1 decode rows with their
# automatic split count, more splits than one round of loads (300 > 256, the last 43 splits empty), one row.
MERGE_CHUNKINGS = [((1, 1, 8, 4099), 0), ((1, 1, 8, 4099), 300), ((1, 1, 1, 2001), 40), ((1, 2, 8, 3001), 0),
                   ((1, 9, 8, 3001), 33)]


@pytest.mark.parametrize("shape,num_splits", [(s, n) for s in GPU_SHAPES for n in (0, 1, 5)] + MERGE_BOUNDARY + MERGE_CHUNKINGS,
                         ids=lambda v: "B{}T{}H{}L{}".format(*v) if isinstance(v, tuple) else str(v))
def test_cuda_matches_reference(shape, num_splits):
    check_two_draws(shape, num_splits, seed_step=97, seed_offset=0)


# Every many-row kernel on every shape, whatever "auto" picks: the pipelined kernel (sm_90-class shared memory) and
# the wide kernel (what sm_120 runs; forced here). Shapes with at most 16 rows in a block's row tile run the pipelined
# kernel's one-m16 instance (T*H = 8, 33, 200: the last row tile).
# The Hopper kernel (wgmma) runs on compute capability 9.0 only: elsewhere its cases are skipped.
MANY_ROW_VARIANTS = ["pipelined", "wide", "hopper"]


def skip_unless_runs(variant):
    if vffi.resolve_variant(variant, 1) is None:
        pytest.skip(f"the {variant} kernel does not run on this device")


@pytest.mark.parametrize("variant", MANY_ROW_VARIANTS)
@pytest.mark.parametrize("num_splits", [0, 5])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "B{}T{}H{}L{}".format(*s))
def test_each_many_row_kernel_matches_reference(shape, num_splits, variant):
    skip_unless_runs(variant)
    check_two_draws(shape, num_splits, seed_step=31, seed_offset=7, variant=variant)


# Extra small-row shapes (T*H <= 16: decode steps), every many-row kernel.
SMALL_ROW_SHAPES = [(1, 1, 8, 4099), (2, 4, 2, 1111), (1, 1, 3, 37)]


@pytest.mark.parametrize("variant", MANY_ROW_VARIANTS)
@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("shape", SMALL_ROW_SHAPES, ids=lambda s: "B{}T{}H{}L{}".format(*s))
def test_small_row_shapes_match_reference(shape, num_splits, variant):
    skip_unless_runs(variant)
    check_two_draws(shape, num_splits, seed_step=53, seed_offset=3, variant=variant)


# Tables wider than their sequences (the engine sizes a table for the longest sequence it may hold): under the
# occupancy policy a short sequence keeps the split length the host planned for a full table (up to 256 positions,
# device.cuh split_plan), so at most a few splits hold positions, the others' blocks exit, and a sequence in one split
# has its rows written by the main kernel while the merge leaves it alone. Lengths around the 256-position boundary
# (root row 256 / 257 positions at T = 4), nothing visible (0), and longer ones; auto, the warp merge (<= 16 splits)
# and the block merge (40).
SHORT_IN_WIDE = [((6, 4, 8, 8192), (0, 4, 100, 259, 260, 700)), ((3, 17, 4, 4096), (17, 300, 1500))]


@pytest.mark.parametrize("variant", ["auto"] + MANY_ROW_VARIANTS)
@pytest.mark.parametrize("num_splits", [0, 12, 40])
@pytest.mark.parametrize("shape,lens", SHORT_IN_WIDE, ids=lambda v: "B{}T{}H{}L{}".format(*v) if len(v) == 4 else None)
def test_short_sequences_in_wide_tables(shape, lens, num_splits, variant):
    skip_unless_runs(variant)
    batch, num_queries, num_heads, max_len = shape
    fn = jitted_variant(variant, SCALE, num_splits)
    case = make_case(11 + num_splits, batch, num_queries, num_heads, max_len, latent=LATENT, rope=ROPE,
                     dtype=jnp.bfloat16, lens=lens)
    out, lse = run_poisoned(fn, case)
    ref_out, ref_lse = reference_f32(case, SCALE, ROPE)
    check_against_reference(out, lse, ref_out, ref_lse, tol=1e-2)


def test_repeated_calls_are_bit_identical():
    case = make_case(5, 2, 16, 8, 5003, latent=LATENT, rope=ROPE, dtype=jnp.bfloat16)
    fn = jitted("auto", SCALE, ROPE, 0)
    first = [np.asarray(x) for x in run_poisoned(fn, case)]
    for _ in range(3):
        again = run_poisoned(fn, case)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, np.asarray(b))


def test_inside_while_loop_matches_single_call():
    """64 calls in one jitted while loop (layers rotate) give what the single calls give."""
    case = make_case(8, 1, 9, 8, 4099, latent=LATENT, rope=ROPE, dtype=jnp.bfloat16, num_layers=4)
    q, kv_pool, _, kv_slots, kv_lens, tree_mask = case
    fn = jitted("auto", SCALE, ROPE, 0)

    @jax.jit
    def loop():
        def body(i, acc):
            out, lse = fn(q, kv_pool, i % 4, kv_slots, kv_lens, tree_mask)
            return acc.at[i % 4].set(out.astype(jnp.float32))
        return jax.lax.fori_loop(0, 64, body, jnp.zeros((4,) + q.shape[:3] + (LATENT,), jnp.float32))

    looped = np.asarray(loop())
    for layer in range(4):
        out, _ = fn(q, kv_pool, jnp.int32(layer), kv_slots, kv_lens, tree_mask)
        np.testing.assert_array_equal(looped[layer], np.asarray(out, np.float32))


def test_other_dtypes_fall_back_to_reference_on_gpu():
    case = make_case(3, 1, 4, 2, 50, latent=32, rope=8, dtype=jnp.float32)
    with pytest.warns(UserWarning, match="does not handle"):
        vffi._warn_fallback_once.cache_clear()
        out, lse = jax.jit(functools.partial(vffi.verify_attention_ffi, softmax_scale=0.2, rope_dim=8))(*case)
    ref_out, ref_lse = reference_f32(case, 0.2, 8)
    check_against_reference(out, lse, ref_out, ref_lse, tol=1e-5)


SANITIZER_SCRIPT = textwrap.dedent("""
    import functools, sys
    sys.path.insert(0, {tests!r})
    import jax, jax.numpy as jnp, numpy as np
    from kdtree_jax.ops import ffi as vffi
    from test_verify_attention import make_case
    # T*H = 40 runs both row-tile instances of the kernels (32 rows, then 8: one m16 tile), T*H = 8 the one-m16 one:
    # every pipeline, with and without the merge.
    # The Hopper kernel pads both to one 64-row block.
    for num_queries, variant in ((5, "pipelined"), (5, "wide"), (1, "pipelined"), (1, "wide"), (5, "hopper"),
                                 (1, "hopper"), (9, "hopper")):
        if vffi.resolve_variant(variant, num_queries * 8) is None:
            continue
        for splits in (1, 3):
            case = make_case(1, 2, num_queries, 8, 301, latent=512, rope=64, dtype=jnp.bfloat16)
            fn = jax.jit(functools.partial(vffi.verify_attention_ffi, softmax_scale=0.07, rope_dim=64,
                                           num_splits=splits, variant=variant))
            out, lse = fn(*case)
            out.block_until_ready()
            assert np.isfinite(np.asarray(out, np.float32)).all()
    # Short sequences in a wide table: idle split blocks, rows written by the main kernel, merges that skip them.
    for variant in ("auto", "pipelined", "wide"):
        case = make_case(2, 3, 4, 8, 2048, latent=512, rope=64, dtype=jnp.bfloat16, lens=(4, 259, 700))
        fn = jax.jit(functools.partial(vffi.verify_attention_ffi, softmax_scale=0.07, rope_dim=64, variant=variant))
        out, lse = fn(*case)
        out.block_until_ready()
        assert np.isfinite(np.asarray(out, np.float32)).all()
    print("SANITIZER-CASE-OK")
""")


@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not installed")
def test_compute_sanitizer_is_clean(tool):
    script = SANITIZER_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    returncode, log = run_compute_sanitizer(tool, script, "verify_attention")  # our kernels' names hold it
    assert "SANITIZER-CASE-OK" in log, log[-4000:]
    if tool == "racecheck":
        sites = racecheck_hazard_sites(log)
        unexplained = [site for site in sites if site not in hopper_scale_handover_sites()]
        assert not unexplained and (returncode == 0 or sites), log[-4000:]
        return
    assert returncode == 0, log[-4000:]
    assert "ERROR SUMMARY: 0 errors" in log, log[-4000:]


def racecheck_hazard_sites(log):
    """(write file:line, read file:line) of every hazard racecheck reports."""
    pattern = r"Race reported between \w+ access at [^\n]* in ([\w./-]+:\d+)\s*\n=+\s+and \w+ access at [^\n]* in ([\w./-]+:\d+)"
    return [(os.path.basename(w.split(":")[0]) + ":" + w.split(":")[1], os.path.basename(r.split(":")[0]) + ":" + r.split(":")[1])
            for w, r in re.findall(pattern, log)]


@functools.cache
def hopper_scale_handover_sites():
    """The one exchange of the Hopper kernel that racecheck reports: the scores warpgroup's store of a tile's rescale
    factors and the output warpgroup's load of them. They are ordered by named barriers the tool does not model as
    ordering (the load precedes the loader's bar.arrive of P_FREE, which the storer's bar.sync waits for before the
    next store; the store precedes the storer's bar.arrive of P_READY, which the loader's bar.sync waits for), the
    producer/consumer hand-over of warp-specialised kernels. Lines are read from the source, so an edit that moves
    them keeps the test exact; any other hazard fails it."""
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "ffi", "verify", "hopper_kernel.cu")
    with open(source) as f:
        lines = f.read().splitlines()
    stores = [i + 1 for i, line in enumerate(lines) if re.search(r"scale_s\[row_[ab]\] = sc_[ab];", line)]
    loads = [i + 1 for i, line in enumerate(lines) if "rescale(acc, scale_s[row_a], scale_s[row_b])" in line]
    assert len(stores) == 2 and len(loads) == 1, (stores, loads)
    return {(f"hopper_kernel.cu:{w}", f"hopper_kernel.cu:{loads[0]}") for w in stores}
