"""Tensor- and expert-parallel layouts on 8 forced CPU devices: same logits, same greedy output, the
requested parameter shardings, and no all-gather of parameters or of the pool in the compiled HLO."""

import re

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import kdtree_jax
from kdtree_jax import decode, kv_pool
from kdtree_jax.model.drafter import DrafterConfig, init_drafter
from kdtree_jax.ops import ffi
from kdtree_jax.ops import moe as moe_ops
from kdtree_jax.sharding import make_mesh, replicate, shard_model
from kdtree_jax.speculative.engine import generate

# Heads, experts and intermediate sizes divisible by 8.
CFG = kdtree_jax.ModelConfig.preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=4, topk_group=2)
LAYOUTS = [("tp", 2), ("ep", 2), ("tp", 8), ("ep", 8)]

# Late in a full-suite process XLA:CPU segfaulted compiling this file's sharded decode loop: the process had run out
# of memory mappings (vm.max_map_count); tests/conftest.py now releases JAX's executables before that.
pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (forced CPU) devices")


@pytest.fixture(scope="module")
def model():
    return kdtree_jax.init_model(CFG, seed=3)


@pytest.fixture(scope="module")
def drafter():
    return init_drafter(CFG, DrafterConfig(block_size=4, num_layers=1, head_dim=16), seed=4)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 11)).astype(np.int32)


@pytest.fixture(scope="module")
def unsharded_logits(model, tokens):
    return np.asarray(kdtree_jax.forward_logits(model, tokens))


@pytest.mark.parametrize("layout,n", LAYOUTS)
def test_sharded_logits_equal_unsharded(model, tokens, unsharded_logits, layout, n):
    sharded = shard_model(model, make_mesh(n), layout)
    logits = np.asarray(kdtree_jax.forward_logits(sharded, tokens))
    assert np.abs(logits - unsharded_logits).max() / np.abs(unsharded_logits).max() < 1e-5


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_shared_expert_folded_into_routed_op(model, tokens, layout, monkeypatch):
    """The shared expert inside the routed experts' op, as a GPU's pairs op runs it (MoE.folds_shared), here through
    the op's CPU branch: its weights pass through the routed experts' shard_map (tp: sliced as the routed experts'
    intermediate dim, summed by their psum) and the logits stay the unfolded model's; ep does not fold (its routed
    experts are whole, the shared one split)."""
    from kdtree_jax.model.moe import MoE
    few = tokens[:1, :moe_ops.SHARED_FOLD_MAX_TOKENS]  # the fold's range
    want = np.asarray(kdtree_jax.forward_logits(model, few))
    monkeypatch.setattr(moe_ops, "pairs_shared_built", lambda: True)
    monkeypatch.setattr(moe_ops, "use_pairs", lambda *a, **k: True)
    # Traced for the CUDA branch, never run here: a stand-in of the op's shape (a wrong value would show in the logits).
    monkeypatch.setattr(moe_ops, "pair_expert_mlp", lambda x2d, *a, **k: jnp.full_like(x2d, jnp.nan))
    sharded = shard_model(model, make_mesh(8), layout)
    moes = [m for _, m in nnx.iter_graph(sharded) if isinstance(m, MoE)]
    x = jnp.zeros((3, CFG.hidden_size), moes[0].experts.gate_proj.dtype)
    assert moes and all(m.folds_shared(x, CFG.num_experts_per_tok, "auto") == (layout == "tp") for m in moes)
    assert not moes[0].folds_shared(x, CFG.num_experts_per_tok, "row_invariant")
    assert not moes[0].folds_shared(jnp.zeros((moe_ops.SHARED_FOLD_MAX_TOKENS + 1, CFG.hidden_size), x.dtype),
                                    CFG.num_experts_per_tok, "auto")
    logits = np.asarray(kdtree_jax.forward_logits(sharded, few))
    assert np.abs(logits - want).max() / np.abs(want).max() < 1e-5


def test_the_cost_model_of_a_sharded_target_is_its_layouts(model, drafter):
    """tp and ep split a step's work differently: their calibrated costs are cached apart (and apart from the
    unsharded target's)."""
    from kdtree_jax.sharding import layout_of
    from kdtree_jax.speculative.cost_model import fingerprint
    from kdtree_jax.speculative.step import SpecConfig

    spec = SpecConfig(budget=8, menu=(0, 8))
    tp, ep = (shard_model(model, make_mesh(2), layout) for layout in ("tp", "ep"))
    assert (layout_of(tp), layout_of(ep), layout_of(model)) == ("tp", "ep", None)
    keys = [fingerprint(m, drafter, spec) for m in (model, tp, ep)]
    assert keys[1]["layout"] == "tp" and keys[2]["layout"] == "ep" and keys[0]["layout"] is None
    assert len({repr(sorted(k.items())) for k in keys}) == 3


# Ragged prompts and settings as benchmarks/multi_gpu.py's correctness check (tests/test_benchmark_smoke.py runs it
# on these 8 devices): the same programs, compiled once in the session.
PROMPTS = [np.random.default_rng(1).integers(0, CFG.vocab_size, 9).tolist(), [5, 6, 7]]
GENERATE = dict(max_new_tokens=12, budget=6)


@pytest.fixture(scope="module")
def unsharded_output(model, drafter):
    return generate(model, drafter, PROMPTS, **GENERATE).tokens


# tp over 2 devices is left out here: its decode loop is test_vocab_padding.py's (greedy, tp, a 2-device mesh; one
# sharded decode loop fewer to compile, ~8 s). The logits above cover every layout.
@pytest.mark.parametrize("layout,n", [ln for ln in LAYOUTS if ln != ("tp", 2)])
def test_sharded_greedy_speculative_output_equals_unsharded(model, drafter, unsharded_output, layout, n):
    sharded = shard_model(model, make_mesh(n), layout)
    assert generate(sharded, drafter, PROMPTS, **GENERATE).tokens == unsharded_output


@pytest.mark.skipif(not ffi.available(), reason="the compiled extension is not built")
def test_ffi_cpu_handler_runs_inside_shard_map(model, tokens, unsharded_logits):
    sharded = shard_model(model, make_mesh(8), "tp")
    logits = np.asarray(kdtree_jax.forward_logits(sharded, tokens, impl="ffi"))
    assert np.abs(logits - unsharded_logits).max() / np.abs(unsharded_logits).max() < 1e-5


def test_parameter_shardings_are_the_requested_ones(model):
    mesh = make_mesh(8)
    expect = {
        "tp": {"q_b_proj": P(None, "model"), "o_proj": P("model", None), "kv_a_proj_with_mqa": P(None, None),
               "experts.gate_proj": P(None, None, "model"), "experts.down_proj": P(None, "model", None),
               "lm_head": P(None, "model"), "embed_tokens": P(None, None), "gate.weight": P(None, None)},
        "ep": {"q_b_proj": P(None, "model"), "o_proj": P("model", None), "kv_a_proj_with_mqa": P(None, None),
               "experts.gate_proj": P("model", None, None), "experts.down_proj": P("model", None, None),
               "lm_head": P(None, "model"), "embed_tokens": P(None, None), "gate.weight": P(None, None)},
    }
    for layout, specs in expect.items():
        sm = shard_model(model, mesh, layout)
        attn, moe = sm.layers[1].self_attn, sm.layers[1].mlp
        got = {"q_b_proj": attn.q_b_proj.kernel, "o_proj": attn.o_proj.kernel,
               "kv_a_proj_with_mqa": attn.kv_a_proj_with_mqa.kernel, "experts.gate_proj": moe.experts.gate_proj,
               "experts.down_proj": moe.experts.down_proj, "lm_head": sm.lm_head.kernel,
               "embed_tokens": sm.embed_tokens.embedding, "gate.weight": moe.gate.weight}
        for name, var in got.items():
            sharding = var[...].sharding
            assert sharding.mesh == mesh
            assert sharding.spec == specs[name] or tuple(sharding.spec) == tuple(specs[name]) + (None,) * (
                var.ndim - len(specs[name])), (layout, name, sharding.spec)


def _collectives(hlo_text: str):
    return [line for line in hlo_text.splitlines()
            if re.search(r"\b(all-gather|all-to-all|collective-permute)(-start)?\(", line)]


class _CompiledText:
    """Stands in for engine.decode_loop and keeps (HLO text, the pool's shape) of every program compiled through it."""

    def __init__(self, jitted):
        self.jitted, self.compiled = jitted, []

    def lower(self, target, drafter, state, **kwargs):
        lowered, out = self.jitted.lower(target, drafter, state, **kwargs), self.compiled

        class Lowered:
            def compile(self):
                compiled = lowered.compile()
                out.append((compiled.as_text(), tuple(state.cache.pages.shape)))
                return compiled

        return Lowered()


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_no_all_gather_of_parameters_or_pool(model, drafter, layout, monkeypatch):
    """The verify step (prefill chunk) and the whole speculative loop compile to all-reduces of
    activations only: nothing gathers a parameter or the latent pool. The loop is the one `generate` compiles and
    runs (the 8-device greedy test's, compiled already)."""
    from kdtree_jax.speculative import engine

    mesh = make_mesh(8)
    sm = shard_model(model, mesh, layout)
    cache = replicate(kv_pool.init_cache(CFG, 2, 64, dtype=jnp.float32), mesh)
    chunk = decode.forward_chunk.lower(sm, cache, jnp.zeros((2, 4), jnp.int32), jnp.ones((2,), jnp.int32),
                                       impl="reference").compile().as_text()
    assert _collectives(chunk) == []
    assert "all-reduce" in chunk  # the tensor-parallel sums are there

    spy = _CompiledText(engine.decode_loop)
    monkeypatch.setattr(engine, "decode_loop", spy)
    generate(sm, drafter, PROMPTS, **GENERATE)
    assert len(spy.compiled) == 1
    loop, pool_shape = spy.compiled[0]
    assert "while" in loop and "all-reduce" in loop
    param_shapes = {tuple(v.shape) for v in jax.tree.leaves(jax.tree.map(lambda x: x, sm)) if hasattr(v, "shape")}
    gathered = _collectives(loop)
    for line in gathered:  # whatever is gathered must be neither a parameter nor the pool
        shape = tuple(int(d) for d in re.search(r"\[([\d,]*)\]", line).group(1).split(",") if d)
        assert shape not in param_shapes and shape != pool_shape, line


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_restore_from_orbax_straight_into_a_layout(model, drafter, tokens, unsharded_logits, tmp_path, layout):
    from kdtree_jax.checkpoint import load_sharded

    path = tmp_path / f"ckpt_{layout}"
    kdtree_jax.save_checkpoint(str(path), model, drafter)
    mesh = make_mesh(8)
    target, restored_drafter, _ = load_sharded(str(path), mesh, layout)
    experts = target.layers[1].mlp.experts.gate_proj[...]
    assert experts.sharding.spec == (P("model", None, None) if layout == "ep" else P(None, None, "model"))
    assert target.layers[1].self_attn.q_b_proj.kernel[...].sharding.spec == P(None, "model")
    assert restored_drafter.fc.kernel[...].sharding.is_fully_replicated
    logits = np.asarray(kdtree_jax.forward_logits(target, tokens))
    assert np.abs(logits - unsharded_logits).max() / np.abs(unsharded_logits).max() < 1e-5
