"""The Flax model against independent formulations: non-absorbed MLA, a per-token MoE loop, and
prefill/decode/slot-layout invariances. Fresh random weights and inputs, float32."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import kdtree_jax
from kdtree_jax import kv_pool
from kdtree_jax.config import ModelConfig
from kdtree_jax.model.layers import dot_transposed, rope_cos_sin
from kdtree_jax.model.moe import MoE, expert_counts, route

TINY = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def model():
    return kdtree_jax.init_model(TINY, seed=3)


def _np(v):
    return np.asarray(v[...], np.float64)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def naive_mla(attn, x, positions, cfg):
    """HF's formulation: decompress per-head keys and values through kv_b_proj, causal softmax attention."""
    b, t, _ = x.shape
    heads = cfg.num_attention_heads
    q = _rms(x @ _np(attn.q_a_proj.kernel), _np(attn.q_a_layernorm.weight), 1e-6) @ _np(attn.q_b_proj.kernel)
    q = q.reshape(b, t, heads, cfg.qk_head_dim)
    kv = x @ _np(attn.kv_a_proj_with_mqa.kernel)
    c_kv = _rms(kv[..., : cfg.kv_lora_rank], _np(attn.kv_a_layernorm.weight), 1e-6)
    k_pe = kv[..., cfg.kv_lora_rank:]
    kv_full = (c_kv @ _np(attn.kv_b_proj.kernel)).reshape(b, t, heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    k_nope, v = kv_full[..., : cfg.qk_nope_head_dim], kv_full[..., cfg.qk_nope_head_dim:]
    cos, sin = (np.asarray(a, np.float64) for a in rope_cos_sin(cfg, jnp.asarray(positions)))
    q_pe = _rope(q[..., cfg.qk_nope_head_dim:], cos[:, :, None], sin[:, :, None])
    k_pe = _rope(k_pe, cos, sin)
    keys = np.concatenate([k_nope, np.broadcast_to(k_pe[:, :, None], k_nope.shape[:3] + (cfg.qk_rope_head_dim,))], -1)
    queries = np.concatenate([q[..., : cfg.qk_nope_head_dim], q_pe], -1)
    scores = np.einsum("bqhd,bkhd->bhqk", queries, keys) * cfg.softmax_scale
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, -1)
    return out @ _np(attn.o_proj.kernel)


def test_absorbed_mla_matches_decompressed(model):
    rng = np.random.default_rng(0)
    b, t = 2, 19
    attn = model.layers[1].self_attn
    x = rng.standard_normal((b, t, TINY.hidden_size)).astype(np.float32)
    positions = np.broadcast_to(np.arange(5, 5 + t), (b, t)).astype(np.int32)

    @jax.jit  # one program (run eagerly, each of the layer's operations compiles on its own)
    def layer_1(attn, x, positions):
        cache = kv_pool.init_cache(TINY, b, t, dtype=jnp.float32)
        cache, slots, batch = kv_pool.begin_chunk(cache, t)
        cos, sin = rope_cos_sin(TINY, positions)
        return attn(x, cos, sin, cache.pages, 1, batch, impl="reference")

    out, pages = layer_1(attn, jnp.asarray(x), jnp.asarray(positions))
    expected = naive_mla(attn, x.astype(np.float64), positions, TINY)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-4, atol=2e-4)
    # The layer wrote its latent rows into layer 1 of the pool, and only there.
    assert np.abs(np.asarray(pages[1])).sum() > 0 and np.abs(np.asarray(pages[0])).sum() == 0


def naive_route(x, w_router, bias, cfg):
    """Per token, in plain numpy: groups by top-2 biased sum, experts by biased score, weights unbiased."""
    scores = 1 / (1 + np.exp(-(x @ w_router.T)))
    chosen, weights = [], []
    for s in scores:
        biased = s + bias
        per_group = cfg.n_routed_experts // cfg.n_group
        group_score = [np.sort(biased[g * per_group:(g + 1) * per_group])[-2:].sum() for g in range(cfg.n_group)]
        keep_groups = np.argsort(group_score)[::-1][: cfg.topk_group]
        masked = np.full_like(biased, -np.inf)  # experts of excluded groups are never chosen
        for g in keep_groups:
            masked[g * per_group:(g + 1) * per_group] = biased[g * per_group:(g + 1) * per_group]
        idx = np.argsort(-masked, kind="stable")[: cfg.num_experts_per_tok]
        w = s[idx] / s[idx].sum() * cfg.routed_scaling_factor
        chosen.append(idx)
        weights.append(w)
    return np.array(chosen), np.array(weights)


def v2_gate(x, w_router, cfg):
    """DeepSeek-V2's gate (group_limited_greedy), per token in numpy: softmax scores; groups ranked by their best
    score; the other groups' experts masked to 0; the top-k of what is left; weights the chosen scores (no
    normalisation here: norm_topk_prob is false in V2's configs) times routed_scaling_factor."""
    logits = x @ w_router.T
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    per_group = cfg.n_routed_experts // cfg.n_group
    chosen, weights = [], []
    for s in scores:
        group_best = s.reshape(cfg.n_group, per_group).max(-1)
        keep = np.argsort(-group_best, kind="stable")[: cfg.topk_group]
        masked = np.zeros_like(s)
        for g in keep:
            masked[g * per_group:(g + 1) * per_group] = s[g * per_group:(g + 1) * per_group]
        idx = np.argsort(-masked, kind="stable")[: cfg.num_experts_per_tok]
        chosen.append(idx)
        weights.append(s[idx] * cfg.routed_scaling_factor)
    return np.array(chosen), np.array(weights)


def test_route_group_limited_greedy_is_deepseek_v2s():
    """DeepSeek-V2 (group_limited_greedy, softmax, no bias, no normalisation) ranks groups by their best expert, where
    V3 ranks them by their two best: the same tokens must route differently under the two rules, and as V2's gate
    under its own."""
    cfg = TINY.replace(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3, scoring_func="softmax",
                       topk_method="group_limited_greedy", norm_topk_prob=False, routed_scaling_factor=16.0)
    rng = np.random.default_rng(5)
    w_router = rng.normal(0, 1, (16, cfg.hidden_size)).astype(np.float32)
    x = rng.standard_normal((64, cfg.hidden_size)).astype(np.float32)
    logits = jnp.asarray(x) @ jnp.asarray(w_router).T
    idx, w = route(logits, jnp.zeros(16), cfg)
    ref_idx, ref_w = v2_gate(x.astype(np.float64), w_router.astype(np.float64), cfg)
    np.testing.assert_array_equal(np.sort(np.asarray(idx), -1), np.sort(ref_idx, -1))
    np.testing.assert_allclose(np.sort(np.asarray(w), -1), np.sort(ref_w, -1), rtol=1e-5)
    v3_rule, _ = route(logits, jnp.zeros(16), cfg.replace(topk_method="noaux_tc"))
    assert (np.sort(np.asarray(v3_rule), -1) != np.sort(ref_idx, -1)).any()


def test_unknown_topk_method_is_one_line():
    with pytest.raises(ValueError, match="topk_method must be one of"):
        TINY.replace(topk_method="sinkhorn")


def test_moe_matches_per_token_loop():
    cfg = TINY.replace(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3)
    moe = MoE(cfg, jnp.float32, nnx.Rngs(7))
    rng = np.random.default_rng(1)
    bias = rng.normal(0, 0.5, cfg.n_routed_experts).astype(np.float32)
    moe.gate.e_score_correction_bias[...] = jnp.asarray(bias)
    x = rng.standard_normal((37, cfg.hidden_size)).astype(np.float32)

    idx, w = jax.jit(lambda logits, bias: route(logits, bias, cfg))(jnp.asarray(x) @ moe.gate.weight[...].T,
                                                                     jnp.asarray(bias))
    ref_idx, ref_w = naive_route(x.astype(np.float64), _np(moe.gate.weight), bias.astype(np.float64), cfg)
    order = np.argsort(np.asarray(idx), -1)
    ref_order = np.argsort(ref_idx, -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1), np.take_along_axis(ref_idx, ref_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1), np.take_along_axis(ref_w, ref_order, -1), rtol=1e-5)

    # The bias must matter here: picking by unbiased scores would choose differently for some tokens.
    scores = x @ np.asarray(moe.gate.weight[...]).T
    unbiased_top = np.sort(np.argsort(-scores, -1)[:, : cfg.num_experts_per_tok], -1)
    assert (unbiased_top != np.sort(ref_idx, -1)).any()

    out_x, slots = jax.jit(lambda moe, x: moe(x))(moe, jnp.asarray(x)[None])  # one program, not one per operation
    out = np.asarray(out_x)[0]
    np.testing.assert_array_equal(np.sort(np.asarray(slots), -1), np.sort(ref_idx, -1))
    # Router statistics of several layers in one count: layer l's row is the bincount of its own slots.
    other = np.asarray(slots)[::-1] % 3
    counts = np.asarray(expert_counts([slots, jnp.asarray(other)], cfg.n_routed_experts))
    np.testing.assert_array_equal(counts, np.stack([np.bincount(ref_idx.ravel(), minlength=cfg.n_routed_experts),
                                                    np.bincount(other.ravel(), minlength=cfg.n_routed_experts)]))
    expected = np.zeros_like(x, dtype=np.float64)
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    for n in range(x.shape[0]):
        for e, weight in zip(ref_idx[n], ref_w[n]):
            h = silu(x[n] @ _np(moe.experts.gate_proj)[e]) * (x[n] @ _np(moe.experts.up_proj)[e])
            expected[n] += weight * (h @ _np(moe.experts.down_proj)[e])
        sh = moe.shared_experts
        expected[n] += (silu(x[n] @ _np(sh.gate_proj.kernel)) * (x[n] @ _np(sh.up_proj.kernel))) @ _np(sh.down_proj.kernel)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [(1,), (5,), (2, 3)])
def test_dot_transposed_is_x_times_w_transposed(rows):
    rng = np.random.default_rng(sum(rows))
    x = rng.standard_normal(rows + (48,)).astype(np.float32)
    w = rng.standard_normal((80, 48)).astype(np.float32)
    fn = jax.jit(lambda x, w: dot_transposed(x, w, preferred_element_type=jnp.float32))
    out = np.asarray(fn(jnp.asarray(x), jnp.asarray(w)))
    assert out.shape == rows + (80,)
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5)
    # On a CPU the product is w @ x.T behind a barrier (XLA:CPU's x @ w.T measured 2-15x slower: cpu_dot_transposed.md).
    if jax.default_backend() == "cpu":
        assert "optimization_barrier" in fn.lower(jnp.asarray(x), jnp.asarray(w)).as_text()


def test_tied_lm_head_is_the_embedding():
    cfg = TINY.replace(tie_word_embeddings=True)
    tied = kdtree_jax.init_model(cfg, seed=5)
    assert tied.lm_head is None
    x = np.random.default_rng(4).standard_normal((2, 3, cfg.hidden_size)).astype(np.float32)
    logits = np.asarray(jax.jit(lambda m, x: m.lm_logits(x))(tied, jnp.asarray(x)))
    np.testing.assert_allclose(logits, x.astype(np.float64) @ _np(tied.embed_tokens.embedding).T, rtol=1e-5, atol=1e-5)


def _random_prompts(rng, batch, length):
    return rng.integers(0, TINY.vocab_size, (batch, length)).astype(np.int32)


# The two prefill / decode tests below run one set of shapes (3 sequences, a 32-position pool, chunks of 4): one
# compiled prefill chunk and one decode step serve both (~3 s of compile each).
BATCH, POOL, CHUNK = 3, 32, 4


def test_prefill_then_decode_equals_full_prefill(model):
    rng = np.random.default_rng(2)
    b, total, prompt = BATCH, 21, 11
    toks = _random_prompts(rng, b, total)
    full = np.asarray(kdtree_jax.forward_logits(model, toks))
    cache = kv_pool.init_cache(TINY, b, POOL, dtype=jnp.float32)
    last, _, cache = kdtree_jax.prefill(model, cache, toks[:, :prompt], chunk_size=CHUNK)
    np.testing.assert_allclose(np.asarray(last), full[:, prompt - 1], rtol=1e-4, atol=1e-4)
    for pos in range(prompt, total):
        logits, cache = kdtree_jax.decode_step(model, cache, toks[:, pos])
        np.testing.assert_allclose(np.asarray(logits), full[:, pos], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(cache.seq_lens), [total] * b)


def test_ragged_prompts_and_permuted_slots(model):
    """Right-padded prompts of different lengths, in a pool whose free list is shuffled, give each
    sequence the logits it gets alone in a contiguous pool; the padding's slots are given back."""
    rng = np.random.default_rng(3)
    lens = np.array([13, 4, 9], np.int32)
    toks = _random_prompts(rng, BATCH, 13)
    cache = kv_pool.init_cache(TINY, BATCH, POOL, dtype=jnp.float32)
    cache = cache._replace(free_slots=jnp.asarray(rng.permutation(cache.num_slots).astype(np.int32)))
    last, _, cache = kdtree_jax.prefill(model, cache, toks, lens, chunk_size=CHUNK)
    assert int(cache.num_free) == cache.num_slots - lens.sum()
    nxt = _random_prompts(rng, BATCH, 1)[:, 0]
    step_logits, cache = kdtree_jax.decode_step(model, cache, nxt)
    for b in range(BATCH):
        seq = np.concatenate([toks[b, : lens[b]], nxt[b:b + 1]])[None]
        # Right-padded to one length, so the three references are one compiled shape: the forward is causal, and
        # what follows the sequence changes none of its logits.
        seq = np.pad(seq, ((0, 0), (0, lens.max() + 1 - seq.shape[1])))
        full = np.asarray(kdtree_jax.forward_logits(model, seq))[0]
        np.testing.assert_allclose(np.asarray(last)[b], full[lens[b] - 1], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(step_logits)[b], full[lens[b]], rtol=1e-4, atol=1e-4)


def test_hidden_states_are_returned_in_requested_order(model):
    toks = _random_prompts(np.random.default_rng(4), 1, 6)
    cache = kv_pool.init_cache(TINY, 1, 8, dtype=jnp.float32)
    _, hidden, _ = kdtree_jax.prefill(model, cache, toks, hidden_layers=(2, 0), chunk_size=8)
    assert hidden.shape == (2, 1, 6, TINY.hidden_size)
    cache = kv_pool.init_cache(TINY, 1, 8, dtype=jnp.float32)
    _, h0, _ = kdtree_jax.prefill(model, cache, toks, hidden_layers=(0,), chunk_size=8)
    np.testing.assert_array_equal(np.asarray(hidden[1]), np.asarray(h0[0]))


# Bad input: clear ValueErrors before any device work ------------------------------------------------
def test_prompt_longer_than_pool(model):
    cache = kv_pool.init_cache(TINY, 1, 8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="does not fit"):
        kdtree_jax.prefill(model, cache, np.ones((1, 9), np.int32))


def test_token_out_of_vocab(model):
    with pytest.raises(ValueError, match="vocab_size"):
        kdtree_jax.forward_logits(model, np.array([[1, TINY.vocab_size]]))
    with pytest.raises(ValueError, match="vocab_size"):
        kdtree_jax.forward_logits(model, np.array([[-1, 2]]))


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'kimi-k3'"):
        ModelConfig.preset("kimi-k3")


def test_presets_have_the_published_shapes():
    k2 = ModelConfig.preset("kimi-k2")
    assert (k2.num_attention_heads, k2.n_routed_experts, k2.cache_dim, k2.first_k_dense_replace) == (64, 384, 576, 1)
    v3 = ModelConfig.preset("deepseek-v3")
    assert (v3.num_attention_heads, v3.n_routed_experts, v3.n_group, v3.topk_group) == (128, 256, 8, 4)
    rank = ModelConfig.preset("kimi-k2-tp8-rank")
    assert (rank.num_attention_heads, rank.moe_intermediate_size, rank.kv_lora_rank) == (8, 256, 512)
    # Softmax scale: 192**-0.5 * mscale(32, 1)**2.
    assert k2.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * np.log(32) + 1) ** 2)
