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
from kdtree_jax.speculative.step import flush_pending

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


def _policy(cost_ar=1.0, cost_draft=0.0, cost_verify=(1.0, 1.5, 2.5), **kw):
    return bp.init_state(MENU, cost_ar=cost_ar, cost_draft=cost_draft, cost_verify=cost_verify, **kw)


def test_a_static_batch_waits_for_its_slowest_row():
    """Rows that start together end with the slowest: a batch whose one row the drafter cannot predict stays
    autoregressive though the batch's mean prediction pays; without that row (done) it speculates; continuous
    batching (a finished row takes the next request) goes by the mean."""
    rows = jnp.asarray([[1.0, 4.0, 4.0], [1.0, 1.05, 1.1]], jnp.float32)
    remaining, both = jnp.asarray([90, 90]), jnp.asarray([True, True])

    def entry(makespan, active=both):
        policy = _policy(expected=(1.0, 4.0, 4.0), batch=2, makespan=makespan)._replace(row_expected=rows)
        return int(bp.next_entry(policy, MENU, 0.0, 8, remaining, active))

    assert entry(True) == len(MENU)  # 90 / 1.05 steps at 1.5 against 90 at 1
    assert entry(True, jnp.asarray([True, False])) == 1
    assert entry(False) == 1


def test_next_entry_maximises_expected_tokens_per_cost_and_probes():
    def entry(**kw):
        return int(bp.next_entry(_policy(**kw), MENU, 0.0, steps=8))

    assert entry(expected=(1.0, 4.6, 4.6)) == 1  # 4.6 tokens for 1.5 beats 4.6 for 2.5 and 1 for 1
    assert entry(expected=(1.0, 4.6, 9.2)) == 2
    # No budget beats an autoregressive step: autoregressive chunks, until a probe is due.
    lost = _policy(expected=(1.0, 1.05, 1.1))
    assert int(lost.probe_every) == bp.probe_interval(1.0, 0.0, (1.0, 1.5, 2.5), MENU) == 25  # 0.5 extra / 2%
    assert int(bp.next_entry(lost, MENU, 0.0, steps=8)) == len(MENU)
    assert int(bp.next_entry(lost._replace(since_draft=jnp.int32(25 * 8)), MENU, 0.0, steps=8)) == 1
    # A forced entry (calibration) wins over the rule; a budget 0 entry is an autoregressive chunk.
    assert entry(expected=(1.0, 4.6, 4.6), force=2) == 2
    assert entry(expected=(1.0, 4.6, 4.6), force=0) == entry(expected=(1.0, 4.6, 4.6), force=len(MENU)) == len(MENU)


def test_the_gate_asks_for_a_margin_and_a_chunk_keeps_its_entry_unless_another_is_clearly_faster():
    def entry(expected, current=None, active=None, **kw):
        return int(bp.next_entry(_policy(expected=expected, **kw), MENU, 0.0, 8, current=current, active=active))

    # Budget 4 (cost 1.5) at 1.5 * 1.05 tokens: 5% faster than an autoregressive step, under the gate's margin.
    assert entry((1.0, 1.5 * 1.05, 1.0)) == len(MENU)
    assert entry((1.0, 1.5 * (1 + bp.GATE_MARGIN) * 1.01, 1.0)) == 1
    # Budget 16 (cost 2.5) 3% faster than budget 4: a chunk of budget 4 stays at 4, one of 16 at 16; 10% faster: 16.
    close, far = (1.0, 3.0, 5.0 * 1.03), (1.0, 3.0, 5.0 * 1.10)
    assert entry(close) == 2 and entry(close, current=1) == 1 and entry(close, current=2) == 2
    assert entry(far, current=1) == 2
    # An autoregressive chunk (len(MENU), or the budget 0 entry) leaves for a budget that opens the gate (the gate's
    # margin is above the switch's), and a probe that is due drafts.
    opens = (1.0, 1.5 * (1 + bp.GATE_MARGIN) * 1.01, 1.0)
    assert entry(opens, current=len(MENU)) == entry(opens, current=0) == 1
    assert entry((1.0, 1.5 * 1.05, 1.0), current=0) == len(MENU)
    lost = _policy(expected=(1.0, 1.05, 1.1))._replace(since_draft=jnp.int32(25 * 8))
    assert int(bp.next_entry(lost, MENU, 0.0, 8, current=len(MENU))) == 1
    # The chunk after the last active row runs the entry that ran (a switch for a chunk of no steps costs a program).
    assert entry(far, current=1, active=jnp.asarray([False, False])) == 1
    assert entry(far, current=1, active=jnp.asarray([False, True])) == 2



def test_a_static_batch_switches_only_where_the_switch_pays_for_itself():
    """A static batch keeps its drafting entry for a tail that autoregressive steps would finish under SWITCH_COST_MS
    sooner (the other program's first call costs more), and still switches where the saving is larger; continuous
    batching keeps the relative rule alone."""
    rows = jnp.full((2, 3), 1.3, jnp.float32).at[:, 0].set(1.0)  # budget 4 (1.5 ms a step) emits 1.3 a step

    def entry(left, makespan=True):
        policy = _policy(expected=(1.0, 1.3, 1.3), batch=2, makespan=makespan)._replace(row_expected=rows)
        return int(bp.next_entry(policy, MENU, 0.0, 8, jnp.asarray([left, left]), jnp.asarray([True, True]),
                                 current=1))

    # 3 tokens: 3 ms autoregressive against 3 / 1.3 * 1.5 = 3.46 ms (13% slower, but 0.46 ms).
    assert entry(3) == 1
    assert entry(3, makespan=False) == len(MENU)
    # 60 tokens: 60 ms against 69.2 ms.
    assert entry(60) == len(MENU)

def test_a_probe_that_loses_doubles_the_interval_one_that_pays_resets_it():
    lost = _policy(expected=(1.0, 1.05, 1.1))._replace(probe_every=jnp.int32(40))
    assert int(bp.end_of_chunk(lost, MENU, 1, 0.0).probe_every) == 80
    assert int(bp.end_of_chunk(lost, MENU, len(MENU), 0.0).probe_every) == 40  # an autoregressive chunk: no verdict
    paid = lost._replace(expected=jnp.asarray([1.0, 4.0, 4.0], jnp.float32))
    assert int(bp.end_of_chunk(paid, MENU, 1, 0.0).probe_every) == 25


def _absorbed(policy, entry, steps):
    """The policy after a chunk of drafted steps of `entry` (each (scores [B, T], path [B, D + 1], active [B])):
    log_step each, then absorb."""
    for scores, path, active in steps:
        policy = bp.log_step(policy, MENU, entry, scores=jnp.asarray(scores, jnp.float32),
                             valid=jnp.ones(np.shape(scores), bool), path=jnp.asarray(path, jnp.int32),
                             active=jnp.asarray(active))
    return bp.absorb(policy, MENU, entry)


def test_a_logged_step_counts_verified_and_accepted_nodes():
    policy = _policy(chunk_steps=2, depth=3)._replace(since_draft=jnp.int32(5))
    scores = np.array([[0.0, -0.01, -0.02, -3.0, -3.0] + [-9.0] * 12], np.float32)
    path = [[0, 1, 2, -1]]  # nodes 1 and 2 accepted, 3 and 4 verified and refused
    new = _absorbed(policy, 1, [(scores, path, [True])])
    d = bp.CALIBRATION_DECAY
    acc, pred = np.asarray(new.bin_acc), np.asarray(new.bin_pred)
    np.testing.assert_allclose(acc[0], bp.PRIOR_WEIGHT * d + 2, rtol=1e-6)  # two accepted in the top bin
    np.testing.assert_allclose(pred[0], bp.PRIOR_WEIGHT * d + np.exp(-0.01) + np.exp(-0.02), rtol=1e-6)
    np.testing.assert_allclose(acc[7], bp.PRIOR_WEIGHT * d, rtol=1e-6)  # the refused pair's bin: no acceptance
    np.testing.assert_allclose(pred[7], bp.PRIOR_WEIGHT * d + 2 * np.exp(-3.0), rtol=1e-6)
    assert np.asarray(new.chosen).tolist() == [0, 1, 0, 0] and int(new.since_draft) == 0 and int(new.logged) == 0
    e4 = 1 + np.exp(scores[0, 1:5]).sum()  # the step's E(4) by the (uncalibrated) drafter: budget 4's tree
    assert float(new.observed_tokens) == 3.0 and float(new.predicted_tokens) == pytest.approx(e4, rel=1e-6)
    # The running predictions, the batch's and the row's, move by the step's E where the step measured it (budgets
    # 0 and 4: its tree's nodes); budget 16's gain moves by the factor budget 4's gain moved by.
    d = bp.EXPECTED_DECAY
    measured = (1 - d) * np.array([1.0, 5.0]) + d * np.array([1.0, e4])
    factor = (measured[1] - 1 + bp.GAIN_FLOOR) / (4.0 + bp.GAIN_FLOOR)
    np.testing.assert_allclose(np.asarray(new.expected), [*measured, 1 + 16 * factor], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(new.row_expected), np.asarray(new.expected)[None, :], rtol=1e-6)
    # A step of the largest entry measures every entry.
    top = _absorbed(policy, 2, [(scores, path, [True])])
    e16 = 1 + np.exp(scores[0, 1:]).sum()
    np.testing.assert_allclose(np.asarray(top.expected),
                               (1 - d) * np.array([1.0, 5.0, 17.0]) + d * np.array([1, e4, e16]), rtol=1e-6)
    # An autoregressive step counts as such and leaves the bins alone.
    ar = bp.count_undrafted(new, MENU)
    assert np.asarray(ar.chosen).tolist() == [0, 1, 0, 1]
    np.testing.assert_array_equal(np.asarray(ar.bin_acc), acc)
    assert int(ar.since_draft) == 1


def _sequential(policy, entry, steps):
    """The reference: one observation per step, in order, in numpy (every step's E from the bins of the chunk's
    start, as absorb takes them)."""
    edges = np.asarray(bp.BIN_EDGES)
    ratio = np.asarray(policy.bin_acc) / np.asarray(policy.bin_pred)
    pred, acc = np.asarray(policy.bin_pred, np.float64), np.asarray(policy.bin_acc, np.float64)
    batch_e, rows = np.asarray(policy.expected, np.float64), np.asarray(policy.row_expected, np.float64).copy()
    known = np.asarray(MENU) <= MENU[entry]
    d, f = bp.EXPECTED_DECAY, bp.GAIN_FLOOR

    def follow(old, new):
        factor = (new[..., entry] - 1 + f) / (old[..., entry] - 1 + f)
        return np.where(known, new, 1 + (old - 1) * factor[..., None])

    observed = predicted = 0.0
    for scores, path, active in steps:
        scores, active = np.asarray(scores, np.float64), np.asarray(active)
        node = np.arange(scores.shape[1])
        verified = (node >= 1) & (node <= MENU[entry]) & active[:, None]
        accepted = np.array([[n in p and n > 0 for n in node] for p in np.asarray(path)]) & verified
        bins = (scores[..., None] < edges).sum(-1)
        raw = np.exp(np.minimum(scores, 0))
        q = np.where(verified, np.minimum(raw * ratio[bins], 1.0), 0.0)
        e = 1 + np.stack([q[:, 1:1 + b].sum(1) for b in MENU], 1)  # [B, M]
        pred = pred * bp.CALIBRATION_DECAY + np.bincount(bins[verified], raw[verified], bp.NUM_BINS)
        acc = acc * bp.CALIBRATION_DECAY + np.bincount(bins[accepted], minlength=bp.NUM_BINS)
        batch_e = follow(batch_e, (1 - d) * batch_e + d * e[active].mean(0))
        rows = np.where(active[:, None], follow(rows, (1 - d) * rows + d * e), rows)
        predicted += e[active, entry].sum()
        observed += (accepted.sum(1) + 1)[active].sum()
    return pred, acc, batch_e, rows, predicted, observed


def test_absorbing_a_chunk_equals_one_observation_per_step():
    """Fresh random trees, three rows (one inactive on a step), four steps of a five-step log, a calibration prior
    that is not flat: the closed form of the decays and of _follow's factors against the step-by-step numpy one."""
    rng = np.random.default_rng()
    ratio = rng.uniform(0.3, 2.0, bp.NUM_BINS)
    policy = _policy(chunk_steps=5, depth=3, batch=3, bin_ratio=ratio)
    policy = policy._replace(row_expected=jnp.asarray(rng.uniform(1.0, 6.0, (3, 3)), jnp.float32))
    for entry in (1, 2):
        steps = []
        for s in range(4):
            scores = np.concatenate([np.zeros((3, 1)), -np.sort(rng.exponential(1.0, (3, 16)), axis=1)], 1)
            path = np.full((3, 4), -1)  # the root and up to 3 accepted nodes of the entry's tree
            for b in range(3):
                k = rng.integers(0, 4)
                path[b, :k + 1] = [0] + sorted(rng.choice(np.arange(1, MENU[entry] + 1), k, replace=False).tolist())
            steps.append((scores.astype(np.float32), path, np.array([True, s != 2, True])))
        got = _absorbed(policy, entry, steps)
        pred, acc, batch_e, rows, predicted, observed = _sequential(policy, entry, steps)
        np.testing.assert_allclose(np.asarray(got.bin_pred), pred, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got.bin_acc), acc, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got.expected), batch_e, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got.row_expected), rows, rtol=1e-5)
        assert float(got.predicted_tokens) == pytest.approx(predicted, rel=1e-5)
        assert int(got.observed_tokens) == observed and int(got.sequence_steps) == 11
        assert np.asarray(got.chosen).tolist()[entry] == 4 and int(got.logged) == 0


def test_a_trees_first_nodes_are_the_smaller_budgets_tree():
    """What lets a drafted step of budget b measure E for every smaller entry: the budget-b' tree is the first b' + 1
    nodes of the budget-b tree."""
    rng = np.random.default_rng(1)
    lp = jnp.asarray(np.sort(np.log(rng.dirichlet(np.ones(6), (2, 5))), axis=-1)[..., ::-1][..., :4].copy(),
                     jnp.float32)
    tok = jnp.asarray(rng.permutation(50)[:20].reshape(1, 5, 4).repeat(2, 0), jnp.int32)
    root, start = jnp.asarray([3, 4], jnp.int32), jnp.asarray([10, 20], jnp.int32)
    big = trees.build_ddtree(lp, tok, root, start, 40)
    for budget in (1, 4, 16, 33):
        small = trees.build_ddtree(lp, tok, root, start, budget)
        n, words = budget + 1, -(-(budget + 1) // 32)
        for name in ("tokens", "parents", "depths", "positions", "valid", "scores"):
            np.testing.assert_array_equal(np.asarray(getattr(big, name))[:, :n], np.asarray(getattr(small, name)), name)
        np.testing.assert_array_equal(np.asarray(big.mask)[:, :n, :words], np.asarray(small.mask))


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


def _loop_run(target, drafter, prompts, spec, force=None, costs=None, chunk_steps=8):
    """The decode of `prompts` with `spec` (an adaptive one forced to menu entry `force`, or with `costs`)."""
    req = validation.validate(target, drafter, prompts, max_new_tokens=spec.max_new_tokens, budget=spec.budget,
                              topk=spec.topk, tree_temperature=1.0, temperature=0.0, stop_ids=(), tree="ddtree")
    state, loop_drafter, _ = engine.setup(target, drafter, req, spec, seed=0, chunk_size=64, kv_dtype=None,
                                          num_moe=0, slots=0, chunk_steps=chunk_steps)
    if not spec.menu:
        return engine.decode_loop(target, loop_drafter, state, spec=spec)
    state = engine.with_costs(state, spec, costs or {"cost_ar": 1.0})
    if force is not None:
        state = state._replace(policy=state.policy._replace(force=jnp.int32(force)))
    return engine.ChunkedLoop(target, loop_drafter, spec, chunk_steps).run(state)[0]


def _chunk_program_text(target, drafter, prompts, spec, entry=None) -> str:
    req = validation.validate(target, drafter, prompts, max_new_tokens=spec.max_new_tokens, budget=spec.budget,
                              topk=spec.topk, tree_temperature=1.0, temperature=0.0, stop_ids=(), tree="ddtree")
    state, loop_drafter, _ = engine.setup(target, drafter, req, spec, seed=0, chunk_size=64, kv_dtype=None,
                                          num_moe=0, slots=0)
    return engine.ChunkedLoop(target, loop_drafter, spec, 8).lower(state, entry).compile().as_text()


@needs_default
def test_an_entrys_chunk_program_has_the_fixed_programs_control_flow(pair_f32, prompts):
    """The choice of a budget adds no control flow to a step (on a GPU each loop or conditional in a step is a graph
    node with its own launches): an adaptive entry's chunk program, speculative or autoregressive, has as many loops
    and conditionals as the fixed budget's."""
    import re

    target, drafter, _ = pair_f32

    def control_flow(text):  # the program's loops and conditionals (not those XLA:CPU emits for a scatter or sort)
        ops = re.findall(r"\s(while|conditional)\(.*op_name=\"[^\"]*/(while|cond|switch)\"", text)
        return sorted(ops)

    spec = engine.SpecConfig(budget=max(MENU), max_new_tokens=24, menu=MENU)
    # A speculative entry drafts the menu's largest tree (it predicts every entry) and verifies its own prefix.
    largest = control_flow(_chunk_program_text(target, drafter, prompts, engine.SpecConfig(budget=max(MENU),
                                                                                           max_new_tokens=24)))
    assert ("while", "while") in largest  # (the chunk's loop of steps)
    for entry in (1, 2):
        assert control_flow(_chunk_program_text(target, drafter, prompts, spec, entry)) == largest, entry
    ar = control_flow(_chunk_program_text(target, drafter, prompts, engine.SpecConfig(budget=0, max_new_tokens=24)))
    assert control_flow(_chunk_program_text(target, drafter, prompts, spec, len(MENU))) == ar


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
        assert np.asarray(auto.policy.chosen).tolist()[i if budget else len(MENU)] == int(auto.step)


@needs_default
def test_lazy_drafter_context_is_the_eager_one(pair_f32, prompts):
    """Steps without the drafter leave their features pending; flushed, the drafter's cache holds what a prefill of
    the whole committed sequence gives (each position's keys and values depend on its own features only)."""
    target, drafter, _ = pair_f32
    spec = engine.SpecConfig(budget=max(MENU), max_new_tokens=24, menu=MENU)
    # Forced autoregressive for the whole run: every committed token's features go through the pending ring (flushed
    # at the start of every chunk).
    final = _loop_run(target, drafter, prompts, spec, force=len(MENU), chunk_steps=4)
    assert int(final.policy.chosen[-1]) == int(final.step) > 4  # a chunk started with a flush
    dcache = jax.jit(lambda s: flush_pending(drafter, s))(final).dcache
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
    assert short["cost_draft"] == 0.0 and short["cost_verify"] == [1.0, 2.0, 3.0]  # whole steps; budget 0: AR
    model.add(short)
    model.add(long)
    model.save()
    again = cm.CostModel.load(key)
    assert again.lookup(4, 150)["context"] == 100 and again.lookup(4, 900)["context"] == 1100
    assert again.lookup(4, 2300) is None and again.lookup(8, 100) is None
    mid = again.costs(4, 600)
    np.testing.assert_allclose(mid["cost_verify"], [1.5, 3.0, 5.5])
    np.testing.assert_allclose(mid["cost_ar"], 1.5)
    np.testing.assert_allclose(mid["cost_slope"], [1e-3, 2e-3, 5e-3, 1e-3])
    # Beyond the measured contexts: the nearest point's costs, the slope still prices the growth.
    np.testing.assert_allclose(again.costs(4, 5000)["cost_verify"], [2.0, 4.0, 8.0])
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
    # The resets are the program's (PolicyState.endless): a chunk of a finished batch, every row inactive and at its
    # limit, runs all its steps; the final state decodes normally again.
    done = state._replace(active=jnp.zeros_like(state.active), num_out=jnp.full_like(state.num_out, 8),
                          policy=state.policy._replace(endless=jnp.bool_(True)))
    assert int(loop(jax.tree.map(jnp.copy, done)).state.step) == 2
    assert not bool(final.policy.endless)
    # The program a call runs (to profile it) is the forced entry's, one per entry.
    def forced(entry):
        return state._replace(policy=state.policy._replace(force=jnp.int32(entry)))

    assert loop.program(forced(len(MENU) - 1)) is loop.program(forced(len(MENU) - 1))
    assert loop.program(forced(len(MENU) - 1)) is not loop.program(forced(len(MENU)))


def test_calibration_priors_each_timed_entry_by_the_tokens_it_emitted(pair_f32, prompts, monkeypatch):
    """The cost model's acceptance prior for each timed entry is what that entry's own timed run emitted per
    sequence-step (its counters), not the running prediction left by the last entry timed; untimed entries keep the
    prediction."""
    target, drafter, _ = pair_f32
    spec = engine.SpecConfig(budget=max(MENU), max_new_tokens=8, menu=MENU)
    req = validation.validate(target, drafter, prompts, max_new_tokens=8, budget=spec.budget, topk=spec.topk,
                              tree_temperature=1.0, temperature=0.0, stop_ids=(), tree="ddtree")
    state, _, _ = engine.setup(target, drafter, req, spec, seed=0, chunk_size=64, kv_dtype=None, num_moe=0, slots=0)
    state = engine.with_costs(state, spec, {"cost_ar": 1.0})
    emitted = {1: 9, 2: 14}  # tokens over 4 sequence-steps per drafting entry (MENU's budgets 4 and 16)

    batch = state.bonus.shape[0]
    assert batch >= 2
    # Per-row predictions: row 0's gains (E - 1) half of every other row's.
    rows = np.tile(np.asarray([1.0, 2.0, 3.0], np.float32), (batch, 1))
    rows[0] = [1.0, 1.5, 2.0]

    def fake_decode_ms(loop, forced, chunks):
        entry = int(forced.policy.force)
        policy = forced.policy._replace(observed_tokens=jnp.int32(emitted.get(entry, 4)),
                                        sequence_steps=jnp.int32(4), expected=jnp.asarray([1.0, 2.0, 2.5]),
                                        row_expected=jnp.asarray(rows))
        return 1.0, 4, forced._replace(policy=policy)

    monkeypatch.setattr(engine, "decode_ms", fake_decode_ms)
    point = engine.calibrate(type("Loop", (), {"steps": 2})(), state, spec, depth=drafter.cfg.depth)
    assert point["expected"] == pytest.approx([1.0, 9 / 4, 14 / 4])
    # A static batch's prior: each entry's gain scaled by the slowest row's share of the mean row's.
    mean_gain = (batch - 0.5) / batch
    share = 0.5 / mean_gain
    assert point["slowest"] == pytest.approx([1.0, 1 + (9 / 4 - 1) * share, 1 + (14 / 4 - 1) * share], rel=1e-5)


def test_a_static_batch_starts_from_its_slowest_rows_prior():
    """init_state seeds every row of a static batch (makespan) with the calibration's slowest-row prior (never above
    the mean's), a refilled batch with the mean; the cached verdict of a static batch weighs the slowest row, so a
    point whose mean row pays but whose slowest row does not runs the autoregressive program for generate only."""
    menu = (0, 8)
    static = bp.init_state(menu, batch=3, makespan=True, expected=[1.0, 3.0], slowest=[1.0, 1.5])
    refilled = bp.init_state(menu, batch=3, makespan=False, expected=[1.0, 3.0], slowest=[1.0, 1.5])
    np.testing.assert_allclose(np.asarray(static.row_expected), [[1.0, 1.5]] * 3)
    np.testing.assert_allclose(np.asarray(refilled.row_expected), [[1.0, 3.0]] * 3)
    np.testing.assert_allclose(np.asarray(static.expected), [1.0, 3.0])
    model = cm.CostModel({"test": "slowest"}, path=None)
    model.add(cm.make_point(4, 100.0, menu, {"ar": 1.0, 1: 2.0}, expected=[1.0, 3.0], slowest=[1.0, 2.0]))
    assert engine.cached_refusal(model, menu, 4, 100.0) is None  # 3 tokens per 2 ms: 1.5x an AR step
    refused = engine.cached_refusal(model, menu, 4, 100.0, static_batch=True)  # 2 per 2 ms: 1.0x
    assert refused is not None and refused["decision"] == "autoregressive"


@needs_default
def test_the_first_chunks_entry_is_picked_on_the_host_as_the_device_picks_it(pair_f32, prompts, monkeypatch):
    """engine.first_entry (the host's pick, CPU as the default device) equals the state's own pick on its device for
    costs that lead to each kind of entry, and generate's first chunk runs it without the device's pick (which it
    would wait for)."""
    target, drafter, _ = pair_f32
    spec = engine.SpecConfig(budget=max(MENU), max_new_tokens=24, menu=MENU)
    req = validation.validate(target, drafter, prompts, max_new_tokens=24, budget=spec.budget, topk=spec.topk,
                              tree_temperature=1.0, temperature=0.0, stop_ids=(), tree="ddtree")
    state, _, _ = engine.setup(target, drafter, req, spec, seed=0, chunk_size=64, kv_dtype=None, num_moe=0, slots=0,
                               chunk_steps=4)
    picks = set()
    for costs in ({"cost_ar": 1.0, "cost_verify": [1.0, 1.2, 1.6]},  # cheap trees: the largest
                  {"cost_ar": 1.0, "cost_verify": [1.0, 1.2, 9.0]},  # dear large tree: budget 4
                  {"cost_ar": 1.0, "cost_draft": 50.0, "cost_verify": [1.0, 1.2, 1.6]},  # autoregressive
                  {"cost_ar": 1.0, "cost_verify": [1.0, 2.0, 3.0], "expected": [1.0, 2.5, 3.4],
                   "slowest": [1.0, 1.5, 2.2]}):
        device = engine._entry_of_state(engine.with_costs(state, spec, costs), menu=MENU, steps=4)
        assert engine.first_entry(state, spec, costs, 4, makespan=True) == device
        picks.add(device)
    assert len(picks) >= 3

    def no_wait(*args, **kwargs):
        raise AssertionError("generate waited for the device's pick of its first chunk")

    monkeypatch.setattr(engine, "_entry_of_state", no_wait)
    costs = {"cost_ar": 1.0, "cost_verify": [1.0, 1.2, 1.6]}
    auto = engine.generate(target, drafter, prompts, max_new_tokens=24, menu=MENU, costs=costs, chunk_steps=4)
    assert sum(auto.stats["budget_policy"]["budget_steps"].values()) > 0

