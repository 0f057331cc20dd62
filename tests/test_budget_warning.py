"""Issue 43: a fixed budget that the device cannot run at a useful speed warns, before any device work, with its
measured cost (the cached cost model of the adaptive budget) or, with none cached, its size against the drafter's."""

import warnings

import pytest

import kdtree_jax
from kdtree_jax.generate import main as cli_main
from kdtree_jax.speculative import cost_model as cost_models
from kdtree_jax.speculative import engine
from kdtree_jax.speculative.step import SpecConfig
from kdtree_jax.speculative.validation import adaptive_menu, budget_warning

TINY = kdtree_jax.ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def pair():
    """Abstract models (shapes only): the warning reads configurations and the cache, never weights."""
    from flax import nnx

    target = nnx.eval_shape(lambda: kdtree_jax.init_model(TINY, seed=0))
    drafter = nnx.eval_shape(lambda: kdtree_jax.init_drafter(TINY, kdtree_jax.DrafterConfig(block_size=8), seed=1))
    return target, drafter


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTREE_JAX_CACHE", str(tmp_path))
    return tmp_path


def cache_point(target, drafter, step_ms, *, expected=None, sampled=False):
    """A calibration point as engine.calibrate caches it for budget 'auto' (menu (0, 4, 8, 16, 32, 64)), batch 1."""
    menu = adaptive_menu("auto", None, drafter, "ddtree", 4)
    spec = SpecConfig(budget=max(menu), topk=4, sampled=sampled, menu=menu)
    model = cost_models.CostModel.load(cost_models.fingerprint(target, drafter, spec))
    model.add(cost_models.make_point(1, 3, menu, step_ms, expected=expected))
    model.save()


def test_without_a_cost_model_a_tree_past_the_drafters_candidates_warns(pair, empty_cache):
    target, drafter = pair  # D = 7, topk 4: 28 candidates; the adaptive menu's largest budget is 64
    message = budget_warning(target, drafter, [1, 2, 3], budget=4096, topk=4)
    assert message.startswith("budget 4096 verifies 4097 nodes a step, 146x the drafter's 7 positions x topk 4 = 28 "
                              "candidates and past the adaptive budget's largest (64), to keep at most 8 tokens a step")
    assert "no cost model" in message and "\n" not in message
    assert budget_warning(target, drafter, [1, 2, 3], budget=65, topk=4) is not None
    for budget in (64, 16, 0, "auto"):
        assert budget_warning(target, drafter, [1, 2, 3], budget=budget, topk=4) is None
    assert budget_warning(target, drafter, [1, 2, 3], budget=4096, topk=4, tree="chain") is None
    assert budget_warning(target, None, [1, 2, 3], budget=4096, topk=4) is None


def test_a_cached_cost_model_gives_the_step_cost_and_the_largest_budget_that_pays(pair, empty_cache):
    target, drafter = pair
    # An autoregressive step 4 ms, budget 4's whole step 16 ms (the larger entries pruned, as on a CPU): 3 ms a node
    # past it, and a step keeps at most 1 + min(b, 7) tokens, so budget b pays at full acceptance while
    # 16 + 3 (b - 4) <= 8 x 4: up to b = 9.
    cache_point(target, drafter, {"ar": 4.0, 1: 16.0}, expected=[1, 2.5, 3, 3.5, 4, 4.5], sampled=True)
    message = budget_warning(target, drafter, [1, 2, 3], budget=4096, topk=4)  # greedy: the sampled loop's costs
    assert message == ("budget 4096 verifies 4097 nodes a step: 12,292.0 ms a step or more on this device (linear in "
                       "nodes from the measured budget 4; an autoregressive step 4 ms), slower than autoregressive "
                       "decoding even if all 8 tokens a step can keep were accepted; the largest budget that can pay "
                       "here is 9, and at the measured acceptance none does (budget 0 or 'auto')")
    assert "34.0 ms a step or more" in budget_warning(target, drafter, [1, 2, 3], budget=10, topk=4)
    for budget in (9, 4, 1):
        assert budget_warning(target, drafter, [1, 2, 3], budget=budget, topk=4) is None
    # Another batch size has no point: the tree's size decides (65 > 64 warns, 10 does not).
    assert budget_warning(target, drafter, [[1, 2, 3]] * 2, budget=10, topk=4) is None
    assert "no cost model" in budget_warning(target, drafter, [[1, 2, 3]] * 2, budget=65, topk=4)


def test_measured_entries_interpolate_and_the_best_at_the_measured_acceptance_is_named(pair, empty_cache):
    target, drafter = pair
    # A device where trees are cheap up to 16 and dear past it: 4 -> 5 ms, 8 -> 6, 16 -> 8, 32 -> 40 (64 pruned);
    # at full acceptance (8 tokens, 16 ms) the line 8 + 2 (b - 16) reaches 16 ms at b = 20.
    cache_point(target, drafter, {"ar": 2.0, 1: 5.0, 2: 6.0, 3: 8.0, 4: 40.0}, expected=[1, 3, 4, 4.4, 4.5, 4.5])
    message = budget_warning(target, drafter, [1, 2, 3], budget=32, topk=4)
    assert message.startswith("budget 32 verifies 33 nodes a step: 40.0 ms a step on this device (measured; an "
                              "autoregressive step 2 ms)")
    assert "the largest budget that can pay here is 20, and at the measured acceptance the best is 8" in message
    assert "about 24.0 ms a step on this device (interpolated between the measured budgets 4 / 8 / 16 / 32;" in (
        budget_warning(target, drafter, [1, 2, 3], budget=24, topk=4))
    assert "104.0 ms a step or more" in budget_warning(target, drafter, [1, 2, 3], budget=64, topk=4)  # 40 + 2 x 32
    for budget in (20, 1):  # below the smallest entry: on the line from the autoregressive step
        assert budget_warning(target, drafter, [1, 2, 3], budget=budget, topk=4) is None


class _NoDecode(Exception):
    pass


def test_cli_warns_in_one_line_before_decoding(capsys, empty_cache, monkeypatch):
    def no_decode(*a, **k):
        raise _NoDecode

    monkeypatch.setattr(engine, "generate", no_decode)
    with pytest.raises(_NoDecode):
        cli_main(["--prompt", "def f(x):", "--budget", "4096", "--max-new-tokens", "4"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(lines) == 1 and lines[0].startswith("warning: --budget 4096 verifies 4097 nodes a step, 68x the "
                                                         "drafter's 15 positions x topk 4 = 60 candidates")
    with pytest.raises(_NoDecode):
        cli_main(["--prompt", "def f(x):", "--budget", "16", "--max-new-tokens", "4"])
    assert "warning: " not in capsys.readouterr().err


def test_the_library_warns_a_caller_of_generate_once_with_its_own_category(pair, empty_cache, monkeypatch):
    """engine.generate gives the same line as a BudgetWarning before any device work (the CLI, which prints its own,
    filters the category out)."""
    from kdtree_jax.speculative.validation import BudgetWarning

    target, drafter = pair

    def no_decode(*a, **k):
        raise _NoDecode

    monkeypatch.setattr(engine, "setup", no_decode)
    with pytest.warns(BudgetWarning, match=r"^budget 4096 verifies 4097 nodes a step") as caught, \
            pytest.raises(_NoDecode):
        engine.generate(target, drafter, [1, 2, 3], budget=4096, max_new_tokens=4)
    assert len([w for w in caught if w.category is BudgetWarning]) == 1
    with pytest.raises(_NoDecode), warnings.catch_warnings():  # a budget that fits: no warning (one is an error)
        warnings.simplefilter("error", BudgetWarning)
        engine.generate(target, drafter, [1, 2, 3], budget=16, max_new_tokens=4)


def test_the_server_warns_of_a_fixed_budget_at_start_up(pair, empty_cache, capsys):
    """`python -m kdtree_jax.serve --budget N` says what the command line says, for its --max-batch rows."""
    from kdtree_jax.serve.__main__ import budget_notice

    target, drafter = pair
    budget_notice(target, drafter, 4096, max_batch=4, topk=4, prompt=[1, 2, 3])
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: --budget 4096 verifies 4097 nodes a step, 146x the drafter's 7 positions")
    budget_notice(target, drafter, 16, max_batch=4, topk=4, prompt=[1, 2, 3])
    assert capsys.readouterr().err == ""
