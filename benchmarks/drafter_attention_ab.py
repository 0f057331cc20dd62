"""A/B of the drafter's attention formulations (session 19; kept in git history, deleted after the A/B): in-loop us
a drafter pass (the default pair's drafter, and a K2-rank-like drafter at a long context), one jitted fori_loop whose
bonus token comes from the previous pass, median of 5 after a warm-up.

  separate        5a820c6: context and block scored and softmaxed apart, combined (two softmaxes)
  scores_joined   0838e0d: two score products joined for one softmax, two P·V products
  keys_joined     the model's (kdtree_jax/model/drafter.py): keys and values joined, one product each side
  cudnn           jax.nn.dot_product_attention(implementation="cudnn") on position-major keys, the block gathered
                  after each row's context

    python benchmarks/drafter_attention_ab.py [LONG_CONTEXT]"""
import sys, time, math
from kdtree_jax import runtime
runtime.configure()
import jax, jax.numpy as jnp, numpy as np
import kdtree_jax
from kdtree_jax.model import drafter as dm

orig = dm.DrafterAttention.__call__


def separate(self, x, cos, sin, ctx_k, ctx_v, ctx_lens):
    cfg = self.cfg
    b, s, _ = x.shape
    q = apply_q(self, self.q_proj(x).reshape(b, s, cfg.num_heads, cfg.head_dim), cos, sin)
    k_blk, v_blk = self.keys_values(x, cos, sin)
    q = q.reshape(b, s, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
    k_blk, v_blk = k_blk.swapaxes(1, 2), v_blk.swapaxes(1, 2)
    scale = 1.0 / math.sqrt(cfg.head_dim)

    def scores_of(keys):
        dtype = jnp.promote_types(q.dtype, keys.dtype)
        return jnp.einsum("bskgd,bkld->bkgsl", q.astype(dtype), keys.astype(dtype),
                          preferred_element_type=jnp.float32) * scale

    in_ctx = jnp.arange(ctx_k.shape[2])[None, :] < ctx_lens[:, None]
    s_ctx = jnp.where(in_ctx[:, None, None, None, :], scores_of(ctx_k), -jnp.inf)
    s_blk = scores_of(k_blk)
    top = jnp.maximum(s_ctx.max(-1, keepdims=True, initial=-jnp.inf), s_blk.max(-1, keepdims=True))
    p_ctx, p_blk = jnp.exp(s_ctx - top), jnp.exp(s_blk - top)
    denom = p_ctx.sum(-1, keepdims=True) + p_blk.sum(-1, keepdims=True)
    out = (jnp.einsum("bkgsl,bkld->bkgsd", p_ctx / denom, ctx_v, preferred_element_type=jnp.float32)
           + jnp.einsum("bkgsl,bkld->bkgsd", p_blk / denom, v_blk, preferred_element_type=jnp.float32))
    out = out.astype(x.dtype).transpose(0, 3, 1, 2, 4)
    return self.o_proj(out.reshape(b, s, -1))


def apply_q(self, q, cos, sin):
    if self.q_norm is not None:
        q = self.q_norm(q)
    return dm.apply_rope(q, cos, sin)


def joint_scores(self, x, cos, sin, ctx_k, ctx_v, ctx_lens):
    """0838e0d: one softmax over [context scores ; block scores], two P·V products."""
    cfg = self.cfg
    b, s, _ = x.shape
    q = apply_q(self, self.q_proj(x).reshape(b, s, cfg.num_heads, cfg.head_dim), cos, sin)
    k_blk, v_blk = self.keys_values(x, cos, sin)
    group = cfg.num_heads // cfg.num_kv_heads
    q = q.reshape(b, s, cfg.num_kv_heads, group, cfg.head_dim)
    k_blk, v_blk = k_blk.swapaxes(1, 2), v_blk.swapaxes(1, 2)
    sc = lambda keys: jnp.einsum("bskgd,bkld->bkgsl", q, keys.astype(q.dtype), preferred_element_type=jnp.float32)
    max_len = ctx_k.shape[2]
    pos = jnp.arange(max_len + s)[None, :]
    vis = (pos < ctx_lens[:, None]) | (pos >= max_len)
    scr = jnp.concatenate([sc(ctx_k), sc(k_blk)], axis=-1) / math.sqrt(cfg.head_dim)
    p = jax.nn.softmax(jnp.where(vis[:, None, None, None, :], scr, -jnp.inf), axis=-1).astype(ctx_v.dtype)
    out = (jnp.einsum("bkgsl,bkld->bkgsd", p[..., :max_len], ctx_v, preferred_element_type=jnp.float32)
           + jnp.einsum("bkgsl,bkld->bkgsd", p[..., max_len:], v_blk.astype(ctx_v.dtype), preferred_element_type=jnp.float32))
    out = out.astype(x.dtype).transpose(0, 3, 1, 2, 4)
    return self.o_proj(out.reshape(b, s, -1))


def cudnn(self, x, cos, sin, ctx_k, ctx_v, ctx_lens):
    """cuDNN flash attention (BTNH): the block's keys written after the context (a concatenated copy here)."""
    cfg = self.cfg
    b, s, _ = x.shape
    q = apply_q(self, self.q_proj(x).reshape(b, s, cfg.num_heads, cfg.head_dim), cos, sin)
    k_blk, v_blk = self.keys_values(x, cos, sin)
    keys = jnp.concatenate([ctx_k.swapaxes(1, 2), k_blk.astype(ctx_k.dtype)], axis=1)  # [B, L+S, Hkv, D]
    vals = jnp.concatenate([ctx_v.swapaxes(1, 2), v_blk.astype(ctx_v.dtype)], axis=1)
    # Pack the block right after each row's context: keys at [lens, lens+s) = block (gather per row).
    max_len = ctx_k.shape[2]
    idx = jnp.arange(max_len + s)[None, :]
    src = jnp.where(idx < ctx_lens[:, None], idx, jnp.where(idx < ctx_lens[:, None] + s, max_len + idx - ctx_lens[:, None], idx))
    keys = jnp.take_along_axis(keys, src[:, :, None, None], axis=1)
    vals = jnp.take_along_axis(vals, src[:, :, None, None], axis=1)
    out = jax.nn.dot_product_attention(q.astype(keys.dtype), keys, vals, key_value_seq_lengths=ctx_lens + s,
                                       implementation="cudnn")
    return self.o_proj(out.astype(x.dtype).reshape(b, s, -1))


def run(label, fn, target, drafter, batch, max_len, lens_val, iters=200):
    dm.DrafterAttention.__call__ = fn
    cache = drafter.init_cache(batch, max_len)
    key = jax.random.PRNGKey(0)
    k = (jax.random.normal(key, cache.k.shape) * 0.5).astype(cache.k.dtype)
    v = (jax.random.normal(jax.random.PRNGKey(1), cache.v.shape)).astype(cache.v.dtype)
    cache = dm.DrafterCache(k, v, jnp.full((batch,), lens_val, jnp.int32))
    from flax import nnx
    gd, st = nnx.split(drafter)
    gt, tt = nnx.split(target)

    @jax.jit
    def loop(st, tt, cache, bonus):
        d = nnx.merge(gd, st); t = nnx.merge(gt, tt)
        def body(i, carry):
            bon, acc = carry
            lg = d.logits(t, cache, bon, cache.lens)
            nb = jnp.argmax(lg[:, 0], -1).astype(jnp.int32)
            return nb, acc + lg[:, -1, 0].sum()
        return jax.lax.fori_loop(0, iters, body, (bonus, jnp.float32(0)))

    bonus = jnp.zeros((batch,), jnp.int32)
    try:
        jax.block_until_ready(loop(st, tt, cache, bonus))
    except Exception as e:  # noqa
        print(f"{label:13s} B={batch:3d} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); jax.block_until_ready(loop(st, tt, cache, bonus)); ts.append(time.perf_counter() - t0)
    us = np.median(ts) / iters * 1e6
    print(f"{label:13s} B={batch:3d} L={max_len} lens={lens_val}: {us:7.1f} us a drafter forward (in-loop)", flush=True)
    return us


LONG = int(sys.argv[1]) if len(sys.argv) > 1 else 65536


def main():
    target, drafter, _ = kdtree_jax.load_checkpoint("checkpoints/default", dtype="auto")
    ref = None
    for batch, max_len, lens in ((1, 320, 200), (16, 320, 200)):
        for label, fn in (("separate", separate), ("scores_joined", joint_scores), ("keys_joined", orig), ("cudnn", cudnn)):
            run(label, fn, target, drafter, batch, max_len, lens)
    import dataclasses
    big = dm.init_drafter(target.cfg, dm.DrafterConfig(block_size=16, num_layers=2, num_heads=4, num_kv_heads=1,
                                                      head_dim=128, intermediate_size=1536), dtype=drafter.dtype)
    for label, fn in (("separate", separate), ("scores_joined", joint_scores), ("keys_joined", orig)):
        run(label, fn, target, big, 1, LONG, LONG - 100, iters=50)
    # agreement of the formulations on one input (B = 4)
    cache = drafter.init_cache(4, 320)
    k = (jax.random.normal(jax.random.PRNGKey(0), cache.k.shape) * 0.5).astype(cache.k.dtype)
    v = jax.random.normal(jax.random.PRNGKey(1), cache.v.shape).astype(cache.v.dtype)
    cache = dm.DrafterCache(k, v, jnp.array([5, 100, 200, 300], jnp.int32))
    bonus = jnp.array([1, 2, 3, 4], jnp.int32)
    outs = {}
    for label, fn in (("separate", separate), ("scores_joined", joint_scores), ("keys_joined", orig), ("cudnn", cudnn)):
        dm.DrafterAttention.__call__ = fn
        try:
            outs[label] = np.asarray(jax.jit(lambda c, b: drafter.logits(target, c, b, c.lens))(cache, bonus), np.float32)
        except Exception as e:  # noqa
            print(label, "failed", str(e)[:200])
    for label, o in outs.items():
        print(f"{label}: max |logits - keys_joined| {np.abs(o - outs['keys_joined']).max():.4f}, top-1 agreement "
              f"{(o.argmax(-1) == outs['keys_joined'].argmax(-1)).mean():.3f}")


if __name__ == "__main__":
    main()
