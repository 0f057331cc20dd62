"""Sampled speculative decoding is lossless: over 20k seeds, the first 3 emitted tokens of a tiny-vocab
model follow the exact (filtered) autoregressive distribution, computed by enumerating every prefix."""

import itertools
import math

import numpy as np
import jax
import pytest

import kdtree_jax
from kdtree_jax.model.drafter import DrafterConfig, init_drafter
from kdtree_jax.speculative.accept import filter_logits
from kdtree_jax.speculative.engine import generate

VOCAB = 8
TEMPERATURE, TOP_P = 0.8, 0.95
PROMPT = [3, 1, 4, 1, 5]


def _chi_square_p_value(stat: float, dof: int) -> float:
    """Upper tail of chi-square via the Wilson-Hilferty normal approximation (good for dof >= 10)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


# "auto": the adaptive budget's program (menu 0 / 2 / 4, costs given so that the choice follows the drafter, not
# the timing): whichever budget a step takes, every emitted token is an exact sample.
@pytest.mark.parametrize("budget", [4, "auto"])
def test_first_three_tokens_match_autoregressive_distribution(budget):
    cfg = kdtree_jax.ModelConfig.preset("tiny").replace(vocab_size=VOCAB)
    target = kdtree_jax.init_model(cfg, seed=21)
    drafter = init_drafter(cfg, DrafterConfig(block_size=4, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16),
                           seed=22)

    # Exact joint distribution of (t1, t2, t3): run every continuation t1 t2 once.
    conts = np.array(list(itertools.product(range(VOCAB), repeat=2)), np.int32)
    seqs = np.concatenate([np.tile(PROMPT, (len(conts), 1)), conts], axis=1)
    logits = kdtree_jax.forward_logits(target, seqs)
    probs = np.asarray(jax.nn.softmax(filter_logits(logits, TEMPERATURE, 0, TOP_P), axis=-1), np.float64)
    p1 = probs[0, len(PROMPT) - 1]  # [V]
    p2 = probs[::VOCAB, len(PROMPT)]  # [V(t1), V]
    p3 = probs[:, len(PROMPT) + 1].reshape(VOCAB, VOCAB, VOCAB)  # [t1, t2, V]
    exact = p1[:, None, None] * p2[:, :, None] * p3

    counts = np.zeros((VOCAB,) * 3)
    taus = []
    per_call = 5000
    for seed in range(4):
        # chunk_size 8: the 5-token prompt is prefilled as one 8-position chunk (the default pads it to 16, and the
        # prefill of 5000 rows is most of a call's time).
        adaptive = dict(menu=(0, 2, 4), costs={"cost_ar": 1.0, "cost_draft": 0.1, "cost_verify": [1.0, 1.05, 1.1]})
        res = generate(target, drafter, [PROMPT] * per_call, max_new_tokens=3, budget=budget, topk=3,
                       temperature=TEMPERATURE, top_p=TOP_P, seed=seed, chunk_size=8,
                       **(adaptive if budget == "auto" else {}))
        toks = np.array(res.tokens)
        np.add.at(counts, (toks[:, 0], toks[:, 1], toks[:, 2]), 1)
        taus.append(res.stats["tau"])
    n = counts.sum()
    assert n == 4 * per_call
    assert max(taus) > 1.2, "the drafter must get tokens accepted, or the test checks nothing speculative"

    assert counts[exact == 0].sum() == 0  # never a token the filters removed
    expected = exact * n
    # Pool cells with small expectations so the chi-square approximation holds.
    big = expected >= 5
    stat = (((counts[big] - expected[big]) ** 2) / expected[big]).sum()
    rest_obs, rest_exp = counts[~big & (exact > 0)].sum(), expected[~big & (exact > 0)].sum()
    cells = int(big.sum())
    if rest_exp > 0:
        stat += (rest_obs - rest_exp) ** 2 / rest_exp
        cells += 1
    p_value = _chi_square_p_value(stat, cells - 1)
    assert p_value > 1e-3, f"chi-square {stat:.1f} on {cells - 1} dof, p = {p_value:.2e}"
