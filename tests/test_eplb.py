"""Expert-load statistics and the EPLB placement: better balance, same logits."""

import numpy as np
import pytest

import kdtree_jax
from kdtree_jax import eplb
from kdtree_jax.model.drafter import DrafterConfig, init_drafter
from kdtree_jax.sharding import make_mesh, shard_model

CFG = kdtree_jax.ModelConfig.preset("tiny").replace(num_attention_heads=8, n_routed_experts=16, n_group=4, topk_group=2)


@pytest.fixture(scope="module")
def model():
    return kdtree_jax.init_model(CFG, seed=5)


def test_plan_balances_a_skewed_load():
    rng = np.random.default_rng(0)
    load = rng.zipf(1.6, size=(3, 32)).astype(float)  # a few very hot experts per layer
    before = eplb.imbalance(load, 8)
    plan = eplb.plan_placement(load, num_devices=8, redundant_per_device=1)
    assert plan.slot_expert.shape == (3, 8 * 5)
    for layer in range(3):  # every expert has at least one slot, and replicas point at their expert
        assert set(plan.slot_expert[layer]) == set(range(32))
        for e in range(32):
            slots = plan.replicas[layer, e, :plan.num_replicas[layer, e]]
            assert (plan.slot_expert[layer, slots] == e).all()
    after = eplb.imbalance(eplb.placed_load(load, plan), 8)
    assert (after <= before + 1e-9).all() and after.mean() < before.mean()


def test_placed_model_gives_the_same_logits_and_balances_measured_load(model):
    drafter = init_drafter(CFG, DrafterConfig(block_size=4, num_layers=1, head_dim=16), seed=6)
    prompts = [np.random.default_rng(1).integers(0, CFG.vocab_size, 12).tolist()]
    base = kdtree_jax.generate(model, drafter, prompts, max_new_tokens=16, budget=6, expert_devices=8)
    load = np.array(base.stats["expert_load"]["slot_tokens"])
    plan = eplb.plan_placement(load, num_devices=8, redundant_per_device=1)
    placed = eplb.apply_placement(model, plan)
    assert placed.layers[1].mlp.num_slots == 8 * 3 and model.layers[1].mlp.num_slots == 16  # the original is untouched

    # [2, 11]: the shape test_sharding.py (and benchmarks/multi_gpu.py's check) runs this config's logits at, so
    # the unsharded reference is one program compiled once in the session.
    tokens = np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 11))
    ref = np.asarray(kdtree_jax.forward_logits(model, tokens))
    np.testing.assert_allclose(np.asarray(kdtree_jax.forward_logits(placed, tokens)), ref, rtol=1e-5, atol=1e-5)
    sharded = shard_model(placed, make_mesh(8), "ep")
    np.testing.assert_allclose(np.asarray(kdtree_jax.forward_logits(sharded, tokens)), ref, rtol=1e-5, atol=1e-5)
    # Placing an already sharded model keeps every expert weight on its devices, in its sharding.
    placed_on_mesh = eplb.apply_placement(shard_model(model, make_mesh(8), "ep"), plan)
    gate = placed_on_mesh.layers[1].mlp.experts.gate_proj[...]
    assert gate.shape[0] == 8 * 3 and gate.sharding.spec[0] == "model"
    assert len(gate.addressable_shards) == 8 and gate.addressable_shards[0].data.shape[0] == 3
    np.testing.assert_allclose(np.asarray(kdtree_jax.forward_logits(placed_on_mesh, tokens)), ref, rtol=1e-5, atol=1e-5)

    again = kdtree_jax.generate(placed, drafter, prompts, max_new_tokens=16, budget=6, expert_devices=8)
    assert again.tokens == base.tokens
    measured_before = eplb.imbalance(load, 8).mean()
    measured_after = eplb.imbalance(np.array(again.stats["expert_load"]["slot_tokens"]), 8).mean()
    assert measured_after < measured_before


def test_engine_reports_expert_load(model):
    res = kdtree_jax.generate(model, None, [[1, 2, 3]], max_new_tokens=5, budget=0, expert_devices=4)
    stats = res.stats["expert_load"]
    assert stats["devices"] == 4 and len(stats["tokens_per_device_per_step"]) == 4
    # One token per step, top-k experts each: the devices' tokens add up to k per MoE layer.
    assert sum(stats["tokens_per_device_per_step"]) == pytest.approx(CFG.num_experts_per_tok)
    assert stats["max_over_mean_device_tokens"] >= 1.0
    with pytest.raises(ValueError, match="expert_devices"):
        kdtree_jax.generate(model, None, [[1, 2, 3]], max_new_tokens=2, budget=0, expert_devices=3)
