"""The speculative decode loop end to end on tiny random-weight pairs.

Speculative greedy output must equal autoregressive greedy output token for token whatever the drafter
proposes; the drafter only changes how many tokens a step yields (tau). Oracle drafters pin tau down.
"""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import kdtree_jax
from kdtree_jax.model.drafter import DrafterCache, DrafterConfig, init_drafter
from kdtree_jax.speculative import step as step_ops
from kdtree_jax.speculative.engine import generate

TINY = kdtree_jax.ModelConfig.preset("tiny")
BLOCK = 5  # D = 4 drafted positions per step
# The prefill's token, then 4 full steps of BLOCK tokens: the oracle's full-acceptance test then runs the parametrised
# test's compiled loops (same spec and shapes) instead of compiling its own.
MAX_NEW = 1 + 4 * BLOCK


@pytest.fixture(scope="module")
def target():
    return kdtree_jax.init_model(TINY, seed=11)


DRAFTER = DrafterConfig(block_size=BLOCK, num_layers=1, head_dim=16)


@pytest.fixture(scope="module")
def drafter():
    return init_drafter(TINY, DRAFTER, seed=12)


@pytest.fixture(scope="module")
def prompts():
    """20+ random prompts of ragged lengths (<= 16, so they share one padded shape)."""
    rng = np.random.default_rng(5)
    return [rng.integers(0, TINY.vocab_size, int(n)).tolist() for n in rng.integers(1, 17, 21)]


@pytest.fixture(scope="module")
def greedy_ar(target, prompts):
    """Autoregressive greedy continuations, one batch of 3 prompts at a time."""
    out = []
    for i in range(0, len(prompts), 3):
        out += generate(target, None, prompts[i:i + 3], max_new_tokens=MAX_NEW, budget=0).tokens
    return out


class OracleDrafter(nnx.Module):
    """Proposes from a table of the right answers: the target's own greedy continuation.

    At positions where `wrong` is set, the top-1 proposal is wrong and the right token is ranked
    second (so only a tree with siblings recovers it). `hopeless` ranks the right token last, far below.
    `hopeless` is an array, not a Python attribute: a hopeless oracle is the same program as a noisy one (the
    graph is static, only the arrays differ), so it runs a decode loop compiled for the parametrised test.
    It asks the target for the random drafter's hidden layers (and ignores them): the prefill is then the same
    program for both drafters.
    """

    def __init__(self, sequences, vocab: int, depth: int, wrong=None, hopeless: bool = False):
        self.cfg = DrafterConfig(block_size=depth + 1)
        self.target_layer_ids = DRAFTER.layer_ids(TINY)
        self.vocab = vocab
        self.hopeless = nnx.Variable(jnp.asarray(hopeless, bool))
        self.table = nnx.Variable(jnp.asarray(sequences, jnp.int32))
        self.wrong = nnx.Variable(jnp.zeros(np.shape(sequences), bool) if wrong is None else jnp.asarray(wrong))

    def init_cache(self, batch, max_len):
        z = jnp.zeros((1, batch, 1, 1, 1))
        return DrafterCache(z, z, jnp.zeros((batch,), jnp.int32))

    def extend_context(self, cache, hidden, num_new):
        return cache._replace(lens=cache.lens + num_new)

    def __call__(self, target, cache, bonus, start):
        depth = self.cfg.depth
        table, wrong = self.table[...], self.wrong[...]
        pos = jnp.clip(start[:, None] + 1 + jnp.arange(depth)[None, :], 0, table.shape[1] - 1)
        right = jnp.take_along_axis(table, pos, axis=1)
        hopeless = self.hopeless[...]
        is_wrong = jnp.take_along_axis(wrong, pos, axis=1) | hopeless
        decoy = (right + 1) % self.vocab
        logits = jnp.full(right.shape + (self.vocab,), -20.0)
        onehot = lambda t: jax.nn.one_hot(t, self.vocab, dtype=bool)  # noqa: E731
        right_score = jnp.where(is_wrong, jnp.where(hopeless, -40.0, -1.0), 0.0)
        logits = jnp.where(onehot(right), right_score[..., None], logits)
        logits = jnp.where(onehot(decoy) & is_wrong[..., None], 0.0, logits)
        return jax.nn.log_softmax(logits, axis=-1)


def _oracle_table(prompts, continuations, length=128):
    table = np.zeros((len(prompts), length), np.int32)
    for b, (p, c) in enumerate(zip(prompts, continuations)):
        seq = list(p) + list(c)
        table[b, :len(seq)] = seq
    return table


@pytest.mark.parametrize("tree,budget,batch", [
    ("ddtree", 1, 3), ("ddtree", 4, 1), ("ddtree", 16, 3), ("ddtree", 63, 3), ("chain", 0, 3), ((2, 2, 1), 0, 1),
])
def test_speculative_greedy_equals_autoregressive(target, drafter, prompts, greedy_ar, tree, budget, batch):
    """With the real (random) drafter, and with a noisy oracle whose misses force sibling acceptance."""
    rng = np.random.default_rng(budget + batch)
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        expected = greedy_ar[i:i + batch]
        res = generate(target, drafter, group, max_new_tokens=MAX_NEW, budget=budget, topk=4, tree=tree)
        assert res.tokens == expected
        table = _oracle_table(group, expected)
        oracle = OracleDrafter(table, TINY.vocab_size, BLOCK - 1, wrong=rng.random(table.shape) < 0.3)
        res = generate(target, oracle, group, max_new_tokens=MAX_NEW, budget=budget, topk=4, tree=tree)
        assert res.tokens == expected


def test_tree_temperature_changes_the_tree_not_the_output(target, drafter, prompts, greedy_ar):
    """A sharpened ranking (tree temperature < 1) or a flattened one (> 1) builds other trees; greedy output stays
    autoregressive. One temperature per drafter (each pairing is a compiled loop of its own): the random drafter
    sharpened, the noisy oracle (its misses ranked second) flattened, so siblings of the wrong proposals enter."""
    group, expected = prompts[:3], greedy_ar[:3]
    table = _oracle_table(group, expected)
    oracle = OracleDrafter(table, TINY.vocab_size, BLOCK - 1, wrong=np.random.default_rng(5).random(table.shape) < 0.3)
    for tree_temperature, d in ((0.3, drafter), (2.0, oracle)):
        res = generate(target, d, group, max_new_tokens=MAX_NEW, budget=8, topk=4, tree_temperature=tree_temperature)
        assert res.tokens == expected


def test_tree_temperature_sharpens_the_ddtree_ranking():
    """Depth 1: tokens 1/2 at p .55/.45; depth 2 (after either): token 3 at .6. At budget 2 the raw
    probabilities keep both depth-1 siblings (.45 > .55 * .6); sharpened at 0.3 (.66/.34 and .8) the
    deeper top-1 path wins (.66 * .8 > .34)."""
    from types import SimpleNamespace
    from kdtree_jax.speculative import engine

    probs = np.full((1, 2, 8), 1e-9)
    probs[0, 0, [1, 2]] = [0.55, 0.45]
    probs[0, 1, [3, 4]] = [0.6, 0.4]

    class FixedDrafter:
        cfg = SimpleNamespace(depth=2)

        def __call__(self, target, dcache, bonus, start):
            return jnp.log(jnp.asarray(probs, jnp.float32))

    state = SimpleNamespace(cache=SimpleNamespace(seq_lens=jnp.array([5], jnp.int32)), dcache=None,
                            bonus=jnp.array([7], jnp.int32))
    for tree_temperature, tokens in ((1.0, [7, 1, 2]), (0.3, [7, 1, 3])):
        spec = engine.SpecConfig(budget=2, topk=2, tree_temperature=tree_temperature)
        tree = step_ops.draft_tree(FixedDrafter(), None, state, spec)
        assert np.asarray(tree.tokens)[0].tolist() == tokens


def test_oracle_drafter_reaches_block_length(target, prompts, greedy_ar):
    group, expected = prompts[:3], greedy_ar[:3]
    oracle = OracleDrafter(_oracle_table(group, expected), TINY.vocab_size, BLOCK - 1)
    max_new = 1 + 4 * BLOCK  # the prefill's token, then 4 full steps
    assert max_new == MAX_NEW
    # The settings (and so the compiled loops) of the parametrised chain-0-3 and ddtree-16-3 cases.
    for tree, budget in (("chain", 0), ("ddtree", 16)):
        res = generate(target, oracle, group, max_new_tokens=max_new, budget=budget, topk=4, tree=tree)
        assert res.tokens == [e[:max_new] for e in expected]
        assert res.stats["steps"] == 4
        assert res.stats["tau"] == BLOCK
        assert res.stats["acceptance_by_depth"] == [1.0] * (BLOCK - 1)


def test_always_wrong_drafter_gives_tau_one(target, prompts, greedy_ar):
    """The right token ranked below every top-4 candidate: no node of even a 16-node tree is ever accepted. The
    settings (and so the compiled loop) of the parametrised ddtree-16-3 case's oracle."""
    group, expected = prompts[3:6], greedy_ar[3:6]
    oracle = OracleDrafter(_oracle_table(group, expected), TINY.vocab_size, BLOCK - 1, hopeless=True)
    res = generate(target, oracle, group, max_new_tokens=MAX_NEW, budget=16, topk=4)
    assert res.tokens == expected
    assert res.stats["tau"] == 1.0


def test_stop_ids_end_sequences(target, prompts, greedy_ar):
    group, expected = prompts[6:9], greedy_ar[6:9]
    stop = expected[1][5]
    res = generate(target, None, group, max_new_tokens=MAX_NEW, budget=0, stop_ids=[stop])
    for got, full in zip(res.tokens, expected):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert got == full[:cut]


def test_pool_exhaustion_is_an_error_not_garbage(target, drafter):
    """A pool too small for the requested work raises instead of handing a slot out twice."""
    from kdtree_jax import kv_pool
    cache = kv_pool.init_cache(TINY, 2, 64, num_slots=40, dtype=jnp.float32)
    ids = np.ones((2, 16), np.int32)
    _, _, cache = kdtree_jax.prefill(target, cache, ids, chunk_size=16)
    with pytest.raises(kv_pool.PoolExhaustedError):
        for _ in range(8):
            _, cache = kdtree_jax.decode_step(target, cache, np.ones((2,), np.int32))
            kv_pool.check_overflow(cache)


def test_generate_validates_arguments(target, drafter):
    with pytest.raises(ValueError, match="budget"):
        generate(target, drafter, [1, 2], budget=-1)
    with pytest.raises(ValueError, match="budget must be <="):
        generate(target, drafter, [1, 2], budget=10_000, topk=2)
    with pytest.raises(ValueError, match="vocab_size"):
        generate(target, drafter, [1, TINY.vocab_size])
    with pytest.raises(ValueError, match="tree"):
        generate(target, drafter, [1, 2], tree="bush")
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(target, drafter, [1, 2], max_new_tokens=0)
    with pytest.raises(ValueError, match="tree_temperature"):
        generate(target, drafter, [1, 2], tree_temperature=0.0)


def test_target_without_moe_layers():
    cfg = TINY.replace(num_hidden_layers=1, first_k_dense_replace=1)
    dense = kdtree_jax.init_model(cfg, seed=1)
    res = generate(dense, None, [[1, 2, 3]], max_new_tokens=4, budget=0)
    assert len(res.tokens[0]) == 4 and res.stats["expert_load"] == {}
