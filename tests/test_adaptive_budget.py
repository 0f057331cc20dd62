"""The adaptive DDTree budget (budget="auto"): the policy's arithmetic against numpy, a prefix of a best-first tree is
the smaller budget's tree, every menu entry of the one compiled loop verifies exactly what the fixed budget verifies,
the lazily extended drafter context equals the eagerly extended one, greedy output is the fixed engine's, and the cost
model's cache and interpolation."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kdtree_jax import corpus
from kdtree_jax.speculative import budget_policy as bp
from kdtree_jax.speculative import cost_model as cm
from kdtree_jax.speculative import engine, validation
from kdtree_jax.speculative import tree as trees
from kdtree_jax.profiling import HloIndex
from kdtree_jax.speculative.step import _at_most_once, _flush, pending_capacity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "checkpoints", "default")
needs_default = pytest.mark.skipif(not os.path.exists(os.path.join(DEFAULT, "kdtree_checkpoint.json")),
                                   reason="checkpoints/default is not there")
MENU = (0, 4, 16)


# The policy's arithmetic -------------------------------------------------------------------------------------------
def test_expected_tokens_and_calibration_against_numpy():
    rng = np.random.default_rng(0)
    scores = np.concatenate([np.zeros((3, 1)), -np.sort(rng.exponential(1.5, (3, 16)), axis=1)], axis=1)
    valid = np.ones((3, 17), bool)
    policy = bp.init_state(MENU)
    # A bin observed to accept twice as often as predicted doubles its nodes' estimates (capped at 1).
    ratio = np.ones(bp.NUM_BINS)
    ratio[3] = 2.0
    policy = policy._replace(bin_acc=jnp.asarray(bp.PRIOR_WEIGHT * ratio, jnp.float32))
    q = np.asarray(bp.calibrated(policy, jnp.asarray(scores, jnp.float32), jnp.asarray(valid)))
    bins = np.array([(s < np.array(bp.BIN_EDGES)).sum() for s in scores.ravel()]).reshape(scores.shape)
    want = np.minimum(np.exp(scores) * ratio[bins], 1.0)
    want[:, 0] = 0.0
    np.testing.assert_allclose(q, want, rtol=1e-5)
    e = np.asarray(bp.expected_tokens(jnp.asarray(q), MENU))
    np.testing.assert_allclose(e, np.stack([1 + q[:, 1:1 + b].sum(1) for b in MENU], 1), rtol=1e-5)


def _policy(cost_ar=1.0, cost_draft=0.2, cost_verify=(1.0, 1.3, 2.0), **kw):
    return bp.init_state(MENU, cost_ar=cost_ar, cost_draft=cost_draft, cost_verify=cost_verify, **kw)


def test_choose_maximises_expected_tokens_per_cost():
    active = jnp.ones((2,), bool)
    q = np.zeros((2, 17), np.float32)
    q[:, 1:5] = 0.9  # four confident nodes, then nothing: budget 4 is worth 4.6 tokens for 1.5
    choice, expected = bp.choose(_policy(), MENU, jnp.asarray(q), active, 0.0)
    np.testing.assert_allclose(np.asarray(expected), [2.0, 9.2, 9.2], rtol=1e-6)
    assert int(choice) == 1
    q[:, 5:] = 0.9  # sixteen confident nodes: 16 pays for its cost
    assert int(bp.choose(_policy(), MENU, jnp.asarray(q), active, 0.0)[0]) == 2
    q[:] = 0.01  # the drafter is lost: a root-only verify beats every tree
    assert int(bp.choose(_policy(), MENU, jnp.asarray(q), active, 0.0)[0]) == 0
    # A forced entry (calibration) wins over the rule.
    assert int(bp.choose(_policy(force=2), MENU, jnp.asarray(q), active, 0.0)[0]) == 2


def test_gate_skips_the_drafter_when_speculation_cannot_pay_and_probes():
    cheap = _policy(expected=(1.0, 4.0, 6.0))
    assert bool(bp.should_draft(cheap, MENU, 0.0))
    # The drafter costs 9 AR steps: the gate closes, and opens again only to probe every probe_every steps.
    closed = _policy(cost_draft=9.0, expected=(1.0, 4.0, 6.0))
    assert int(closed.probe_every) == bp.probe_interval(9.0, 1.0) == min(bp.PROBE_MAX, 450)
    assert not bool(bp.should_draft(closed, MENU, 0.0))
    assert bool(bp.should_draft(closed._replace(since_draft=closed.probe_every - 1), MENU, 0.0))
    assert not bool(bp.should_draft(cheap._replace(force=jnp.int32(len(MENU))), MENU, 0.0))  # forced AR
    assert bool(bp.should_draft(closed._replace(force=jnp.int32(0)), MENU, 0.0))  # forced probe


def test_update_counts_verified_and_accepted_nodes():
    policy = _policy()
    scores = jnp.asarray([[0.0, -0.01, -0.02, -3.0, -3.0] + [-9.0] * 12], jnp.float32)
    valid = jnp.ones((1, 17), bool)
    path = jnp.asarray([[0, 1, 2, -1]], jnp.int32)  # nodes 1 and 2 accepted, 3 and 4 verified and refused
    expected = jnp.asarray([1.0, 3.0, 3.0], jnp.float32)
    new = bp.update(policy, MENU, drafted=jnp.bool_(True), choice=jnp.int32(1), scores=scores, valid=valid,
                    expected=expected, path=path, num_accepted=jnp.asarray([2]), active=jnp.ones((1,), bool),
                    context=0.0)
    d = bp.CALIBRATION_DECAY
    acc, pred = np.asarray(new.bin_acc), np.asarray(new.bin_pred)
    np.testing.assert_allclose(acc[0], bp.PRIOR_WEIGHT * d + 2, rtol=1e-6)  # two accepted in the top bin
    np.testing.assert_allclose(pred[0], bp.PRIOR_WEIGHT * d + np.exp(-0.01) + np.exp(-0.02), rtol=1e-6)
    np.testing.assert_allclose(acc[7], bp.PRIOR_WEIGHT * d, rtol=1e-6)  # the refused pair's bin: no acceptance
    np.testing.assert_allclose(pred[7], bp.PRIOR_WEIGHT * d + 2 * np.exp(-3.0), rtol=1e-6)
    assert np.asarray(new.chosen).tolist() == [0, 1, 0, 0]
    assert float(new.observed_tokens) == 3.0 and float(new.predicted_tokens) == 3.0
    # An AR step (no drafter) counts as such and leaves the bins alone.
    ar = bp.update(new, MENU, drafted=jnp.bool_(False), choice=jnp.int32(0), scores=scores, valid=valid,
                   expected=expected, path=path, num_accepted=jnp.asarray([0]), active=jnp.ones((1,), bool),
                   context=0.0)
    assert np.asarray(ar.chosen).tolist() == [0, 1, 0, 1]
    np.testing.assert_array_equal(np.asarray(ar.bin_acc), acc)
    assert int(ar.since_draft) == 1


def test_tree_prefix_is_the_smaller_budget():
    rng = np.random.default_rng(1)
    lp = jnp.asarray(np.sort(np.log(rng.dirichlet(np.ones(6), (2, 5))), axis=-1)[..., ::-1][..., :4].copy(),
                     jnp.float32)
    tok = jnp.asarray(rng.permutation(50)[:20].reshape(1, 5, 4).repeat(2, 0), jnp.int32)
    root, start = jnp.asarray([3, 4], jnp.int32), jnp.asarray([10, 20], jnp.int32)
    big = trees.build_ddtree(lp, tok, root, start, 40)
    for budget in (1, 4, 16, 33):
        small = trees.build_ddtree(lp, tok, root, start, budget)
        prefix = trees.tree_prefix(big, budget + 1)
        for name in ("tokens", "parents", "depths", "positions", "mask", "valid", "scores"):
            np.testing.assert_array_equal(np.asarray(getattr(prefix, name)), np.asarray(getattr(small, name)), name)


def test_an_untaken_branch_leaves_its_work_inside_its_loop():
    """A branch of the step (an at-most-once loop) whose work reads only values its loop does not change keeps that
    work inside the loop: XLA's loop-invariant code motion would otherwise hoist it out, where it runs on every step,
    taken or not (the adaptive program forced to autoregressive steps ran its drafter on each)."""
    def program(run, x, c0):
        def body(c, x):
            with jax.named_scope("branch_work"):
                return c[0] + jnp.tanh(x @ x).sum(), x.sum()
        return _at_most_once(run, body, (c0, jnp.float32(0)), x)

    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 64)), jnp.float32)
    compiled = jax.jit(program).lower(jnp.bool_(True), x, jnp.float32(1)).compile()
    index = HloIndex(compiled.as_text())
    work = [name for name, op in index.op_name.items() if "branch_work" in op]
    assert work, "the program lost the branch's op names"
    hoisted = [name for name in work if index.place[name][0] == index.entry]
    assert not hoisted, f"the branch's work runs outside its loop: {hoisted}"
    expect = 1 + np.tanh(np.asarray(x, np.float64) @ np.asarray(x, np.float64)).sum()
    np.testing.assert_allclose(float(compiled(jnp.bool_(True), x, jnp.float32(1))[0]), expect, rtol=1e-4)
    assert float(compiled(jnp.bool_(False), x, jnp.float32(1))[0]) == 1.0


# The compiled loop ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair_f32():
    from kdtree_jax import load_checkpoint

    return load_checkpoint(DEFAULT, dtype="float32")


@pytest.fixture(scope="module")
def prompts(pair_f32):
    _, _, tokenizer = pair_f32
    docs = corpus.documents("eval")[:3]
    return [tokenizer.encode(d.text)[40:40 + 24 + 5 * i] for i, d in enumerate(docs)]


def _loop_run(target, drafter, prompts, spec, force=None, costs=None):
    req = validation.validate(target, drafter, prompts, max_new_tokens=spec.max_new_tokens, budget=spec.budget,
                              topk=spec.topk, tree_temperature=1.0, temperature=0.0, stop_ids=(), tree="ddtree")
    state, loop_drafter, _ = engine.setup(target, drafter, req, spec, seed=0, chunk_size=64, kv_dtype=None,
                                          num_moe=0, slots=0)
    if spec.menu:
        state = engine.with_costs(state, spec, costs or {"cost_ar": 1.0})
        if force is not None:
            state = state._replace(policy=state.policy._replace(force=jnp.int32(force)))
    return engine.decode_loop(target, loop_drafter, state, spec=spec)


@needs_default
def test_each_menu_entry_verifies_what_the_fixed_budget_verifies(pair_f32, prompts):
    """The one adaptive program, forced to each entry, takes the fixed budget's trees step for step: same tokens, same
    acceptance histogram (a prefix of the largest tree is the smaller budget's tree, and its verify branch runs)."""
    target, drafter, _ = pair_f32
    spec = engine.SpecConfig(budget=max(MENU), max_new_tokens=24, menu=MENU)
    for i, budget in enumerate(MENU):
        auto = _loop_run(target, drafter, prompts, spec, force=i)
        fixed = _loop_run(target, drafter, prompts, engine.SpecConfig(budget=budget, max_new_tokens=24))
        np.testing.assert_array_equal(np.asarray(auto.out)[:, :24], np.asarray(fixed.out)[:, :24])
        if budget:  # (budget 0 decodes without a drafter: its histogram has one column)
            np.testing.assert_array_equal(np.asarray(auto.accepted_hist), np.asarray(fixed.accepted_hist))
        assert int(auto.step) == int(fixed.step)
        assert np.asarray(auto.policy.chosen).tolist()[i] == int(auto.step)


@needs_default
def test_lazy_drafter_context_is_the_eager_one(pair_f32, prompts):
    """Steps without the drafter leave their features pending; flushed, the drafter's cache holds what a prefill of
    the whole committed sequence gives (each position's keys and values depend on its own features only)."""
    target, drafter, _ = pair_f32
    spec = engine.SpecConfig(budget=max(MENU), max_new_tokens=24, menu=MENU)
    # Forced autoregressive for the whole run: every committed token's features go through the pending ring (with
    # its flushes when full).
    final = _loop_run(target, drafter, prompts, spec, force=len(MENU))
    width = drafter.cfg.depth + 1
    assert int(final.policy.chosen[-1]) == int(final.step) > pending_capacity(drafter.cfg.depth) - width  # a flush ran
    dcache, _ = jax.jit(lambda d, p: _flush(drafter, d, p))(final.dcache, final.pending)
    out, num_out, lens = np.asarray(final.out), np.asarray(final.num_out), np.asarray(final.cache.seq_lens)
    for b, p in enumerate(prompts):
        committed = list(p) + out[b, :lens[b] - len(p)].tolist()
        assert len(committed) == lens[b] and num_out[b] == lens[b] - len(p) + 1
        req = validation.validate(target, drafter, [committed], max_new_tokens=4, budget=4, topk=4,
                                  tree_temperature=1.0, temperature=0.0, stop_ids=(), tree="ddtree")
        ref, _, _ = engine.setup(target, drafter, req, engine.SpecConfig(budget=4, max_new_tokens=4), seed=0,
                                 chunk_size=64, kv_dtype=None, num_moe=0, slots=0)
        assert int(dcache.lens[b]) == int(ref.dcache.lens[0]) == lens[b]
        n = lens[b]
        np.testing.assert_allclose(np.asarray(dcache.k[:, b, :, :n]), np.asarray(ref.dcache.k[:, 0, :, :n]),
                                   atol=2e-4, rtol=2e-4)
        np.testing.assert_allclose(np.asarray(dcache.v[:, b, :, :n]), np.asarray(ref.dcache.v[:, 0, :, :n]),
                                   atol=2e-4, rtol=2e-4)


@needs_default
def test_auto_greedy_output_is_the_fixed_engines(pair_f32, prompts):
    """Greedy auto decoding (costs given, so the choices follow the drafter's confidence, not the timing) emits what
    the fixed budget and autoregressive decoding emit, in float32; the stats report the budgets chosen. With a drafter
    that costs more than speculation can earn, every step skips it."""
    target, drafter, _ = pair_f32
    ar = engine.generate(target, None, prompts, max_new_tokens=32, budget=0).tokens
    costs = {"cost_ar": 1.0, "cost_draft": 0.3, "cost_verify": [1.0, 1.2, 1.6]}
    auto = engine.generate(target, drafter, prompts, max_new_tokens=32, menu=MENU, costs=costs)
    assert auto.tokens == ar
    policy = auto.stats["budget_policy"]
    assert auto.stats["budget"] == "auto" and policy["menu"] == list(MENU)
    assert sum(policy["budget_steps"].values()) + policy["steps_without_drafter"] == auto.stats["steps"]
    assert policy["budget_steps"]["4"] + policy["budget_steps"]["16"] > 0 and auto.stats["tau"] > 1.5
    assert policy["observed_tau"] > 1.5 and policy["predicted_tau"] > 1.0
    costly = engine.generate(target, drafter, prompts, max_new_tokens=32, menu=MENU,
                             costs={"cost_ar": 1.0, "cost_draft": 50.0, "cost_verify": [1.0, 1.2, 1.6],
                                    "expected": [1.0, 1.0, 1.0]})
    assert costly.tokens == ar
    assert costly.stats["budget_policy"]["steps_without_drafter"] == costly.stats["steps"]


@needs_default
def test_auto_calibrates_once_and_caches(pair_f32, prompts, tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path))
    target, drafter, _ = pair_f32
    first = engine.generate(target, drafter, prompts[:1], max_new_tokens=16, menu=MENU)
    second = engine.generate(target, drafter, prompts[:1], max_new_tokens=16, menu=MENU)
    assert first.stats["budget_policy"]["calibrated"] and not second.stats["budget_policy"]["calibrated"]
    files = list((tmp_path / "cost_models").glob("*.json"))
    assert len(files) == 1 and first.stats["budget_policy"]["cost_model"] == str(files[0])
    costs = first.stats["budget_policy"]["costs_ms"]
    assert costs["ar"] > 0 and len(costs["verify"]) == len(MENU)
    assert first.tokens == second.tokens == engine.generate(target, None, prompts[:1], max_new_tokens=16,
                                                             budget=0).tokens
    third = engine.generate(target, drafter, prompts[:1], max_new_tokens=16, menu=MENU, calibrate=True)
    assert third.stats["budget_policy"]["calibrated"]


@needs_default
def test_auto_runs_the_autoregressive_loop_when_the_cached_costs_say_no_budget_pays(pair_f32, prompts, tmp_path,
                                                                                     monkeypatch):
    """A cached point whose drafter costs more than speculation can earn at the measured acceptance: the call runs
    the plain autoregressive program (no drafter, nothing to choose); a point where speculation pays keeps the
    adaptive loop."""
    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path))
    target, drafter, _ = pair_f32
    spec = engine.SpecConfig(budget=max(MENU), max_new_tokens=16, menu=MENU)
    model = cm.CostModel.load(cm.fingerprint(target, drafter, spec))
    context = float(np.mean([len(p) for p in prompts]))
    model.add(cm.make_point(len(prompts), context, MENU, {"ar": 1.0, 0: 5.0, 1: 5.5, 2: 7.0},
                            expected=[1.0, 3.0, 4.0]))
    model.save()
    res = engine.generate(target, drafter, prompts, max_new_tokens=16, menu=MENU)
    policy = res.stats["budget_policy"]
    assert policy["decision"] == "autoregressive" and res.stats["decoding"] == "autoregressive"
    assert policy["steps_without_drafter"] == res.stats["steps"] and not policy["calibrated"]
    assert res.tokens == engine.generate(target, None, prompts, max_new_tokens=16, budget=0).tokens
    model.add(cm.make_point(len(prompts), context, MENU, {"ar": 1.0, 0: 1.2, 1: 1.5, 2: 2.0},
                            expected=[1.0, 3.0, 4.0]))
    model.save()
    res = engine.generate(target, drafter, prompts, max_new_tokens=16, menu=MENU)
    assert "decision" not in res.stats["budget_policy"] and res.stats["decoding"] == "speculative"


def test_menu_and_budget_arguments():
    drafter = type("D", (), {"cfg": type("C", (), {"depth": 3})()})()
    assert validation.adaptive_menu("auto", None, drafter, "ddtree", 2) == (0, 4, 8, 14)  # 2 + 4 + 8 prefixes at most
    assert validation.adaptive_menu("auto", (8, 2), drafter, "ddtree", 4) == (0, 2, 8)
    assert validation.adaptive_menu(16, None, drafter, "ddtree", 4) == ()
    assert validation.adaptive_menu("auto", None, None, "ddtree", 4) == ()
    assert validation.adaptive_menu("auto", None, drafter, "chain", 4) == ()
    with pytest.raises(ValueError, match="'auto'"):
        validation.adaptive_menu("big", None, drafter, "ddtree", 4)
    with pytest.raises(ValueError, match="menu needs a budget"):
        validation.adaptive_menu("auto", (0,), drafter, "ddtree", 4)
    with pytest.raises(ValueError, match="menu is for"):
        validation.adaptive_menu(8, (4,), drafter, "ddtree", 4)


# The cost model ------------------------------------------------------------------------------------------------------
def test_cost_model_points_interpolate_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path))
    key = {"backend": "cpu", "model": "x", "menu": list(MENU)}
    model = cm.CostModel.load(key)
    assert model.points == [] and model.lookup(4, 100) is None
    short = cm.make_point(4, 100, MENU, {"ar": 1.0, 0: 1.5, 1: 2.0, 2: 3.0})
    long = cm.make_point(4, 1100, MENU, {"ar": 2.0, 0: 2.5, 1: 4.0, 2: 8.0})
    assert short["cost_draft"] == 0.5 and short["cost_verify"] == [1.0, 1.5, 2.5]
    model.add(short)
    model.add(long)
    model.save()
    again = cm.CostModel.load(key)
    assert again.lookup(4, 150)["context"] == 100 and again.lookup(4, 900)["context"] == 1100
    assert again.lookup(4, 2300) is None and again.lookup(8, 100) is None
    mid = again.costs(4, 600)
    np.testing.assert_allclose(mid["cost_verify"], [1.5, 2.5, 5.0])
    np.testing.assert_allclose(mid["cost_ar"], 1.5)
    np.testing.assert_allclose(mid["cost_slope"], [1e-3, 2e-3, 5e-3, 1e-3])
    # Beyond the measured contexts: the nearest point's costs, the slope still prices the growth.
    np.testing.assert_allclose(again.costs(4, 5000)["cost_verify"], [2.0, 3.5, 7.5])
    # A pruned entry (not measured: it could not beat AR) is never chosen.
    assert cm.make_point(1, 10, MENU, {"ar": 1.0, 0: 1.5, 1: 9.0})["cost_verify"][2] >= 1e29
    # Another key (another device, model or menu) does not read these points.
    assert cm.CostModel.load({**key, "backend": "gpu"}).points == []


@needs_default
def test_decode_ms_times_whole_chunks_of_every_row_without_consuming_the_state(pair_f32, prompts):
    """Calibration times chunks as the decode runs them: every timed chunk runs all its steps (each starts with every
    row active and room to emit, even where a forced large budget would finish the rows), and the state is reusable."""
    target, drafter, _ = pair_f32
    spec = engine.SpecConfig(budget=max(MENU), max_new_tokens=8, menu=MENU)
    req = validation.validate(target, drafter, prompts, max_new_tokens=8, budget=spec.budget, topk=spec.topk,
                              tree_temperature=1.0, temperature=0.0, stop_ids=(), tree="ddtree")
    state, loop_drafter, _ = engine.setup(target, drafter, req, spec, seed=0, chunk_size=64, kv_dtype=None,
                                          num_moe=0, slots=0)
    state = engine.with_costs(state, spec, {"cost_ar": 1.0})
    state = state._replace(policy=state.policy._replace(force=jnp.int32(len(MENU) - 1)))
    loop = engine.ChunkedLoop(target, loop_drafter, spec, 2)
    ms, steps, final = engine.decode_ms(loop, state, 3)
    assert steps == 3 * 2 and ms > 0  # 8 tokens a row would end after ~2 steps of the largest budget without resets
    assert int(final.step) == int(state.step) + 5 * 2  # the clock's 3 chunks, the one before and the one in flight
    assert int(state.step) == 0 and not state.step.is_deleted()
