"""The FFI CPU handler at realistic lengths, against a float64 numpy formulation of the contract.

tests/test_verify_attention.py checks the handler against the JAX oracle on short tables; here the tables
are long (L ~ 1500-3000, many position blocks, lengths not multiples of any block; decode-sized batches,
for which the handler also splits the positions over threads), the widths are K2's
(512 + 64) and an odd split (500 + 36), and the reference is written in numpy straight from DESIGN.md's
contract (it does not call kdtree_jax.ops.reference). It also checks that no NaN from pool rows the
sequence does not own leaks in, that repeated calls are bit-identical (the handler runs on XLA's thread
pool), that a sequence's result does not depend on its place in the batch, that every SIMD variant the CPU
can run agrees with the reference (named by verify_attention_ffi's cpu_isa argument; one the CPU cannot
run is an error), that benchmarks/verify_attention_cpu.py --smoke writes a parseable result, and that
ffi.use_extension (its --extension) runs the op on another build.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from kdtree_jax.ops import ffi as vffi  # noqa: E402
from kdtree_jax.ops import verify_attention  # noqa: E402

pytestmark = pytest.mark.skipif(not vffi.available(), reason="compiled extension not built")


def numpy_reference(q, kv_pool, layer, kv_slots, kv_lens, tree_mask, *, softmax_scale, rope_dim):
    """float64, one query token at a time, from the contract: positions [0, min(kv_len, Lmax)) are valid,
    the last T of kv_len are the query tokens, prefix positions are seen by all, query token j by query i
    when bit j of tree_mask[b, i] is set; slots clip into the pool, a negative layer counts from the end."""
    q = np.asarray(q, np.float64)
    pool = np.asarray(kv_pool, np.float64)
    slots, lens, mask = np.asarray(kv_slots), np.asarray(kv_lens), np.asarray(tree_mask)
    batch, num_queries, num_heads, width = q.shape
    latent = width - rope_dim
    num_layers, num_slots, _ = pool.shape
    layer = int(layer)
    layer = min(max(layer + num_layers if layer < 0 else layer, 0), num_layers - 1)
    out = np.zeros((batch, num_queries, num_heads, latent))
    lse = np.full((batch, num_queries, num_heads), -np.inf)
    for b in range(batch):
        valid = min(max(int(lens[b]), 0), slots.shape[1])
        first = int(lens[b]) - num_queries
        rows = pool[layer, np.clip(slots[b, :valid], 0, num_slots - 1)]  # [valid, width]
        j = np.arange(valid) - first                                     # query-token index of each position
        for i in range(num_queries):
            bits = (mask[b, i, np.maximum(j, 0) // 32] >> (np.maximum(j, 0) % 32).astype(np.uint32)) & 1
            visible = (j < 0) | ((j < num_queries) & (bits == 1))
            if not visible.any():
                continue
            seen = rows[visible]
            scores = q[b, i] @ seen.T * softmax_scale                       # [H, n]
            top = scores.max(axis=1, keepdims=True)
            weights = np.exp(scores - top)
            total = weights.sum(axis=1, keepdims=True)
            out[b, i] = weights @ seen[:, :latent] / total
            lse[b, i] = (top + np.log(total))[:, 0]
    return out, lse


def random_tree_mask(rng, batch, num_queries):
    """Sequence 0: a random tree's ancestor-or-self bits; the others: random bits with some rows empty."""
    words = (num_queries + 31) // 32
    bits = np.zeros((batch, num_queries, num_queries), bool)
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, num_queries)]
    for i in range(num_queries):
        node = i
        while node >= 0:
            bits[0, i, node] = True
            node = parents[node]
    for b in range(1, batch):
        bits[b] = rng.random((num_queries, num_queries)) < 0.4
        bits[b, rng.random(num_queries) < 0.25] = False
    packed = np.zeros((batch, num_queries, words), np.uint32)
    for j in range(num_queries):
        packed[:, :, j // 32] |= bits[:, :, j].astype(np.uint32) << np.uint32(j % 32)
    return packed


def make_inputs(seed, *, batch, num_queries, num_heads, max_len, latent, rope, dtype, lens):
    """Fresh random inputs. Pool rows that no sequence reads (outside slots[b, :kv_len]) are NaN, and the
    table entries past kv_len point at them: a read of a position that is not valid would show."""
    rng = np.random.default_rng(seed)
    width = latent + rope
    num_layers, num_slots = 3, batch * max_len + 50
    pool = rng.standard_normal((num_layers, num_slots, width)).astype(np.float32)
    perm = rng.permutation(num_slots)
    slots = np.zeros((batch, max_len), np.int32)
    poisoned = np.ones(num_slots, bool)
    for b in range(batch):
        slots[b] = perm[b * max_len:(b + 1) * max_len]
        poisoned[slots[b, :lens[b]]] = False
    pool[:, poisoned] = np.nan
    q = rng.standard_normal((batch, num_queries, num_heads, width)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(pool, dtype), jnp.int32(rng.integers(num_layers)), jnp.asarray(slots),
            jnp.asarray(np.asarray(lens, np.int32)), jnp.asarray(random_tree_mask(rng, batch, num_queries)))


# name: (B, T, H, Lmax, Dc, Dr, dtype, kv_lens). Lens: full table, a length that is no multiple of 64,
# prefix 0 (kv_len = T) or less: only (part of) the tree, where random mask rows leave queries with
# nothing visible.
CASES = {
    "k2_bf16": (3, 33, 4, 2999, 512, 64, jnp.bfloat16, [2999, 1001, 33]),
    "odd_f32": (3, 33, 3, 1531, 500, 36, jnp.float32, [1531, 1237, 20]),  # kv_len 20 < T: first < 0
    # Decode: one row chunk per sequence, so the handler splits the positions and merges the splits.
    "decode_bf16": (2, 1, 8, 2500, 512, 64, jnp.bfloat16, [2500, 0]),
}


@functools.cache
def handler(softmax_scale, rope_dim):
    return jax.jit(functools.partial(verify_attention, softmax_scale=softmax_scale, rope_dim=rope_dim, impl="ffi"))


@pytest.fixture(autouse=True)
def _on_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    batch, num_queries, num_heads, max_len, latent, rope, dtype, lens = CASES[request.param]
    with jax.default_device(jax.devices("cpu")[0]):
        inputs = make_inputs(len(request.param), batch=batch, num_queries=num_queries, num_heads=num_heads,
                             max_len=max_len, latent=latent, rope=rope, dtype=dtype, lens=lens)
        scale = (latent + rope) ** -0.5
        out, lse = handler(scale, rope)(*inputs)
        ref_out, ref_lse = numpy_reference(*inputs, softmax_scale=scale, rope_dim=rope)
    return dict(name=request.param, inputs=inputs, scale=scale, rope=rope, dtype=dtype, out=out, lse=lse,
                ref_out=ref_out, ref_lse=ref_lse)


def check_accuracy(out, lse, ref_out, ref_lse, dtype):
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    empty = np.isneginf(ref_lse)
    assert empty.any() and not empty.all(), "the case should have rows with and without anything visible"
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert np.all(out[empty] == 0.0)
    assert np.isfinite(out).all() and np.isfinite(lse[~empty]).all(), "NaN/inf leaked into the result"
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=0, atol=2e-5 if dtype == jnp.float32 else 1e-4)
    # bfloat16 out: each value is rounded to 8 significant bits (relative error up to 2^-9).
    tol = 2e-6 if dtype == jnp.float32 else 4e-3
    err = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert err < tol, err
    assert np.abs(out - ref_out).max() < (1e-5 if dtype == jnp.float32 else 2e-2)


def test_matches_float64_numpy_reference(case):
    assert case["out"].dtype == case["dtype"] and case["lse"].dtype == jnp.float32
    check_accuracy(case["out"], case["lse"], case["ref_out"], case["ref_lse"], case["dtype"])


def test_repeated_calls_are_bit_identical(case):
    f = handler(case["scale"], case["rope"])
    for _ in range(3):
        out, lse = f(*case["inputs"])
        np.testing.assert_array_equal(np.asarray(out), np.asarray(case["out"]))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(case["lse"]))


def test_result_does_not_depend_on_place_in_batch(case):
    """Reversing the batch reverses the result bit for bit (work is split by sequence and row chunk)."""
    q, pool, layer, slots, lens, mask = case["inputs"]
    out, lse = handler(case["scale"], case["rope"])(q[::-1], pool, layer, slots[::-1], lens[::-1], mask[::-1])
    np.testing.assert_array_equal(np.asarray(out)[::-1], np.asarray(case["out"]))
    np.testing.assert_array_equal(np.asarray(lse)[::-1], np.asarray(case["lse"]))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _isa_runs() -> dict[str, bool] | None:
    """Which of the handler's named SIMD variants this CPU runs, from /proc/cpuinfo (None where unreadable)."""
    flags = _cpu_flags()
    if not flags:
        return None
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return {"baseline": True, "avx2": x86 and {"avx2", "fma"} <= flags,
            "avx512": x86 and {"avx512f", "fma"} <= flags}


@functools.cache
def isa_handler(softmax_scale, rope_dim, cpu_isa):
    return jax.jit(functools.partial(vffi.verify_attention_ffi, softmax_scale=softmax_scale, rope_dim=rope_dim,
                                     cpu_isa=cpu_isa))


@functools.cache
def isa_case(name):
    """CASES[name] at reduced length (Lmax 700): inputs, scale, rope, dtype and the float64 reference."""
    batch, num_queries, num_heads, _, latent, rope, dtype, lens = CASES[name]
    lens = [min(n, 700) for n in lens]
    with jax.default_device(jax.devices("cpu")[0]):
        inputs = make_inputs(7, batch=batch, num_queries=num_queries, num_heads=num_heads, max_len=700,
                             latent=latent, rope=rope, dtype=dtype, lens=lens)
    scale = (latent + rope) ** -0.5
    return inputs, scale, rope, dtype, numpy_reference(*inputs, softmax_scale=scale, rope_dim=rope)


@pytest.mark.parametrize("isa", ["baseline", "avx2", "avx512"])
def test_every_simd_variant_matches_reference(isa):
    """Every variant the CPU runs matches the reference on every case; one it cannot run fails the call."""
    runs = _isa_runs()
    if runs is None and isa != "baseline":
        pytest.skip("/proc/cpuinfo unreadable: cannot tell which variants this CPU runs")
    if runs is not None and not runs[isa]:
        inputs, scale, rope, _, _ = isa_case(sorted(CASES)[0])
        with pytest.raises(Exception, match=f"isa {isa} requested"):
            jax.block_until_ready(isa_handler(scale, rope, isa)(*inputs))
        return
    for name in sorted(CASES):
        inputs, scale, rope, dtype, ref = isa_case(name)
        out, lse = isa_handler(scale, rope, isa)(*inputs)
        check_accuracy(out, lse, *ref, dtype)


def test_auto_isa_is_the_best_variant():
    """cpu_isa="auto" (the default) runs the best variant the CPU has: the same bits as naming it."""
    runs = _isa_runs()
    if runs is None:
        pytest.skip("/proc/cpuinfo unreadable: cannot tell which variants this CPU runs")
    best = [isa for isa in ("avx512", "avx2", "baseline") if runs[isa]][0]
    for name in sorted(CASES):
        inputs, scale, rope, _, _ = isa_case(name)
        auto = isa_handler(scale, rope, "auto")(*inputs)
        named = isa_handler(scale, rope, best)(*inputs)
        for got, want in zip(auto, named):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_unknown_isa_is_rejected():
    inputs, scale, rope, _, _ = isa_case(sorted(CASES)[0])
    with pytest.raises(ValueError, match="cpu_isa"):
        vffi.verify_attention_ffi(*inputs, softmax_scale=scale, rope_dim=rope, cpu_isa="sse4")


def test_benchmark_smoke(tmp_path):
    bench_dir = os.path.join(ROOT, "benchmarks")
    if bench_dir not in sys.path:
        sys.path.insert(0, bench_dir)
    import verify_attention_cpu

    out = tmp_path / "va.json"
    assert verify_attention_cpu.main(["--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for key in ("cpu", "cores", "date", "commit", "jax"):
        assert key in data["meta"]
    assert len(data["rows"]) >= 2
    for row in data["rows"]:
        assert row["handler_us"] > 0 and row["reference_us"] > 0
    assert (tmp_path / "va.md").read_text().startswith("# Verify attention on the CPU")


def test_use_extension_runs_the_op_on_another_build():
    """ffi.use_extension (benchmarks/verify_attention_cpu.py --extension): the op then calls the handlers of the
    module loaded from that path, and once they are registered another build is refused. A fresh process: this
    one registered the installed build's handlers already."""
    import subprocess

    from kdtree_jax import _verify_attention_ext

    code = f"""
import jax.numpy as jnp, numpy as np
from kdtree_jax import _verify_attention_ext as installed
from kdtree_jax.ops import ffi, masks
ffi.use_extension({_verify_attention_ext.__file__!r})
assert ffi._ext is not installed
pool = jnp.arange(2 * 8 * 24, dtype=jnp.float32).reshape(2, 8, 24) / 100
q = jnp.ones((1, 2, 2, 24), jnp.float32)
args = (q, pool, 1, jnp.arange(8, dtype=jnp.int32)[None], jnp.array([5], jnp.int32), masks.causal_mask(1, 2))
out, _ = ffi.verify_attention_ffi(*args, softmax_scale=0.1, rope_dim=8)
ref, _ = ffi.verify_attention_reference(*args, softmax_scale=0.1, rope_dim=8)
np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
try:
    ffi.use_extension({_verify_attention_ext.__file__!r})
except RuntimeError as e:
    print("refused:", e)
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "refused: use_extension must run before" in run.stdout
