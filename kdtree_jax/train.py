"""Train the embedded default pair: a small K2-geometry MLA/MoE target, then a DFlash-style drafter
distilled from it. Corpus: the Python standard library (kdtree_jax/corpus.py).

    python -m kdtree_jax.train target  --out runs/target  --minutes 20
    python -m kdtree_jax.train drafter --target runs/target --out checkpoints/default --minutes 15

`target` trains the byte-level BPE tokenizer on the training split (unless --tokenizer is given), then
the target by next-token cross-entropy over random windows of the training split, and saves the target
(float32 by default) + tokenizer. `drafter` loads that target (frozen), builds distillation sequences
(real text windows, and real prompts continued by the target's own greedy decoding, which is what the
drafter sees at inference), and trains the drafter through exactly the inference code path
(`Drafter.extend_context` + `Drafter.__call__`): the context is the target's features of positions
[0, c), the block is [token at c, MASK, ...] at positions c.., and the label of block index i is the
target's argmax after the prefix x_{<c+i} (plus the target's full distribution there as a soft label).
It then saves the pair (bfloat16 by default) with the tokenizer.

Both phases stop themselves: the learning-rate schedule runs on progress = max(step / --steps,
elapsed / --minutes), so a run that is slower than planned still finishes its cosine decay in time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kdtree_jax import corpus
from kdtree_jax.corpus import EOS
from kdtree_jax.config import ModelConfig
from kdtree_jax.model.drafter import Drafter, DrafterCache, DrafterConfig
from kdtree_jax.decode import causal_forward
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.provenance import git_commit

# Tokenizer and data --------------------------------------------------------------------------------
def train_tokenizer(out_dir: str, vocab_size: int = 8192) -> str:
    """Byte-level BPE on the training split; writes out_dir/tokenizer.json and returns its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.iter_texts("train"), trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    return path


def encode_split(tokenizer, split: str) -> np.ndarray:
    """All documents of a split, each followed by EOS, as one int32 array."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(tokenizer.path)
    eos = raw.token_to_id(EOS)
    texts = [d.text for d in corpus.documents(split)]
    encs = raw.encode_batch(texts, add_special_tokens=False)
    parts = []
    for e in encs:
        parts.append(np.asarray(e.ids, np.int32))
        parts.append(np.asarray([eos], np.int32))
    return np.concatenate(parts)


def eval_windows(tokens: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """`count` windows of seq_len evenly spaced over the array (deterministic)."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64)
    return np.stack([tokens[s:s + seq_len] for s in starts])


def sample_windows(rng: np.random.Generator, tokens: np.ndarray, batch: int, seq_len: int) -> np.ndarray:
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    return np.stack([tokens[s:s + seq_len] for s in starts])


# The target --------------------------------------------------------------------------------------
def default_target_config(vocab_size: int = 8192) -> ModelConfig:
    """K2's attention geometry (kv_lora_rank 512, rope 64, absorbed latent cache 576) and MoE structure
    (sigmoid noaux_tc routing, shared expert, dense first layer), scaled down for a CPU."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=768, moe_intermediate_size=256, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096,
    )


def default_drafter_config() -> DrafterConfig:
    return DrafterConfig(block_size=16, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                         intermediate_size=768)


def lm_loss(model: Transformer, tokens):
    out = causal_forward(model, tokens)
    logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return nll.mean(), out.expert_counts


def _decay_mask(params):
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def _make_optimizer(weight_decay: float, clip: float = 1.0):
    import optax

    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, b1=0.9, b2=0.95,
                                                             weight_decay=weight_decay, mask=_decay_mask))


def _set_lr(opt_state, lr: float):
    opt_state[1].hyperparams["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return opt_state


def lr_at(progress: float, peak: float, warmup_frac: float = 0.03, floor: float = 0.1) -> float:
    if progress < warmup_frac:
        return peak * (progress / warmup_frac)
    t = min(1.0, (progress - warmup_frac) / max(1e-9, 1 - warmup_frac))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def make_target_step(graphdef, tx, bias_rate: float):
    import optax

    @jax.jit
    def step(params, rest, opt_state, tokens):
        def loss_fn(p):
            return lm_loss(nnx.merge(graphdef, p, rest), tokens)

        (loss, counts), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # DeepSeek-V3's auxiliary-loss-free balancing: nudge each expert's selection bias toward the
        # mean load (the bias only chooses experts, it has no gradient).
        model = nnx.merge(graphdef, params, rest)
        for i, layer in enumerate(l for l in model.layers if l.is_moe):
            c = counts[i].astype(jnp.float32)
            bias = layer.mlp.gate.e_score_correction_bias
            bias[...] = bias[...] + bias_rate * jnp.sign(c.mean() - c)
        _, params, rest = nnx.split(model, nnx.Param, ...)
        gnorm = optax.global_norm(grads)
        return params, rest, opt_state, loss, gnorm, counts

    return step


@jax.jit
def _eval_loss_jit(model, tokens):
    return lm_loss(model, tokens)[0]


def eval_loss(model: Transformer, windows: np.ndarray, batch: int) -> float:
    losses = []
    for i in range(0, len(windows) - batch + 1, batch):
        losses.append(float(_eval_loss_jit(model, jnp.asarray(windows[i:i + batch]))))
    return float(np.mean(losses))


def _prepare_out(path: str, overwrite: bool):
    if os.path.exists(path) and os.listdir(path):
        if not overwrite:
            raise SystemExit(f"--out {path} exists and is not empty (pass --overwrite to replace it)")
        shutil.rmtree(path)


def cast_module(module, dtype):
    """A copy of an NNX module with its floating parameters cast to dtype (float32-only ones, such as
    the router's bias, as the module built with that dtype keeps them)."""
    graphdef, state = nnx.split(module)

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return nnx.merge(graphdef, jax.tree.map(cast, state))


def _save_pair(out: str, target: Transformer, drafter: Optional[Drafter], tokenizer_file: str, dtype, meta: dict):
    from kdtree_jax.checkpoint import save_checkpoint

    t = target if target.dtype == dtype else _recast_target(target, dtype)
    d = None
    if drafter is not None:
        d = drafter if drafter.dtype == dtype else cast_module(drafter, dtype)
    save_checkpoint(out, t, d, [tokenizer_file], extra_metadata=meta)


def _recast_target(target: Transformer, dtype) -> Transformer:
    """The target rebuilt with `dtype` parameters (router bias stays float32, as Transformer keeps it)."""
    fresh = nnx.eval_shape(lambda: Transformer(target.cfg, dtype, rngs=nnx.Rngs(0)))
    graphdef, fresh_state = nnx.split(fresh)
    state = nnx.state(target)
    new = jax.tree.map(lambda want, have: jnp.asarray(have).astype(want.dtype), fresh_state, state)
    return nnx.merge(graphdef, new)


def train_target(args) -> dict:
    """Tokenizer + target. Returns the run's summary (also stored in the checkpoint metadata)."""
    from tqdm import tqdm

    from kdtree_jax.tokenizer import HFTokenizer

    t_start = time.time()
    _prepare_out(args.out, args.overwrite)
    work = args.out.rstrip("/") + ".work"
    os.makedirs(work, exist_ok=True)
    if args.tokenizer:
        tok_file = args.tokenizer
    else:
        print(f"training the tokenizer (byte-level BPE, vocab {args.vocab}) on the training split ...", flush=True)
        tok_file = train_tokenizer(work, args.vocab)
    tokenizer = HFTokenizer(tok_file)
    train_tokens = encode_split(tokenizer, "train")
    eval_tokens = encode_split(tokenizer, "eval")
    print(f"corpus: {len(train_tokens):,} train tokens, {len(eval_tokens):,} eval tokens "
          f"({time.time() - t_start:.0f} s)", flush=True)

    cfg = default_target_config(tokenizer.vocab_size)
    model = Transformer(cfg, jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    tx = _make_optimizer(args.weight_decay)
    opt_state = tx.init(params)
    step_fn = make_target_step(graphdef, tx, args.bias_rate)
    ev = eval_windows(eval_tokens, args.seq_len, args.eval_windows)
    rng = np.random.default_rng(args.seed)
    budget = args.minutes * 60
    print(f"target: {n_params / 1e6:.2f} M parameters; up to {args.steps} steps of {args.batch} x {args.seq_len}, "
          f"at most {args.minutes} min", flush=True)

    t0 = time.time()
    history, step, loss_ema = [], 0, None
    bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True, mininterval=5)
    while step < args.steps:
        elapsed = time.time() - t0
        progress = max(step / args.steps, elapsed / budget)
        if progress >= 1.0:
            break
        opt_state = _set_lr(opt_state, lr_at(progress, args.lr))
        batch = jnp.asarray(sample_windows(rng, train_tokens, args.batch, args.seq_len))
        params, rest, opt_state, loss, gnorm, counts = step_fn(params, rest, opt_state, batch)
        step += 1
        loss = float(loss)
        loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr_at(progress, args.lr):.2e}")
        if step % args.eval_every == 0:
            e = eval_loss(nnx.merge(graphdef, params, rest), ev[: max(args.batch, 8)], args.batch)
            c = np.asarray(counts, np.float64)
            history.append({"step": step, "train_loss_ema": loss_ema, "eval_loss": e,
                            "seconds": time.time() - t0,
                            "expert_max_over_mean": float((c.max(-1) / c.mean(-1)).mean())})
            tqdm.write(f"step {step}: train {loss_ema:.3f}  eval {e:.3f}  ({time.time() - t0:.0f} s)")
    bar.close()
    train_seconds = time.time() - t0
    model = nnx.merge(graphdef, params, rest)
    final_eval = eval_loss(model, ev, args.batch)
    summary = {
        "phase": "target", "command": " ".join(sys.argv), "commit": git_commit(short=False), "steps": step,
        "batch": args.batch, "seq_len": args.seq_len, "tokens_seen": step * args.batch * args.seq_len,
        "train_seconds": train_seconds, "final_train_loss_ema": loss_ema, "final_eval_loss": final_eval,
        "final_eval_ppl": math.exp(final_eval), "eval_windows": len(ev), "lr": args.lr, "params": int(n_params),
        "history": history, "corpus": corpus.summary(), "train_tokens": int(len(train_tokens)),
        "eval_tokens": int(len(eval_tokens)), "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
    }
    summary["corpus"].pop("eval_files", None)
    print(f"target done: {step} steps, {summary['tokens_seen']:,} tokens, {train_seconds:.0f} s; "
          f"eval loss {final_eval:.3f} (ppl {math.exp(final_eval):.1f})", flush=True)
    dtype = jnp.dtype(args.save_dtype)
    _save_pair(args.out, model, None, tok_file, dtype, {"target_training": summary})
    with open(os.path.join(work, "target_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


# The drafter --------------------------------------------------------------------------------------
def distill_targets(target: Transformer, tokens, layer_ids):
    """Frozen target over [B, S]: (features [n, B, S, H], argmax [B, S], log-probs [B, S, V])."""
    out = causal_forward(target, tokens, hidden_layers=layer_ids)
    logp = jax.nn.log_softmax(out.logits, axis=-1)
    return (jax.lax.stop_gradient(out.hidden), jnp.argmax(out.logits, -1).astype(jnp.int32),
            jax.lax.stop_gradient(logp))


def drafter_loss(drafter: Drafter, target: Transformer, tokens, feats, pred, target_logp, anchors,
                 depth_weights, soft_weight: float):
    """Block-distillation loss through the inference path.

    anchors [B, A]: block start positions c (the context is positions [0, c), the block's first token
    is tokens[c] at position c). Label of block index i (1..D): the target's argmax after x_{<c+i},
    i.e. pred[c + i - 1]; soft label: the target's distribution there.
    """
    b, s = tokens.shape
    a = anchors.shape[1]
    d = drafter.cfg.depth
    cache = drafter.init_cache(b, s)
    cache = drafter.extend_context(cache, feats, jnp.full((b,), s, jnp.int32))
    rep = lambda x: jnp.repeat(x, a, axis=1)  # [L, B, ...] -> [L, B*A, ...]
    flat_c = anchors.reshape(-1)
    cache = DrafterCache(rep(cache.k), rep(cache.v), flat_c)
    rows = jnp.repeat(jnp.arange(b), a)
    bonus = tokens[rows, flat_c]
    logq = drafter(target, cache, bonus, flat_c)  # [B*A, D, V]
    pos = flat_c[:, None] + jnp.arange(d)[None, :]  # c + i - 1 for i = 1..D
    labels = pred[rows[:, None], pos]
    hard = -jnp.take_along_axis(logq, labels[..., None], axis=-1)[..., 0]  # [B*A, D]
    p = jnp.exp(target_logp[rows[:, None], pos])
    soft = -(p * logq).sum(-1)
    w = depth_weights[None, :]
    loss = ((hard + soft_weight * soft) * w).sum() / (w.sum() * b * a)
    hit = (jnp.argmax(logq, -1) == labels)
    # Expected accepted length of a chain draft (teacher-forced): mean over anchors of the run of hits.
    run = jnp.cumprod(hit.astype(jnp.float32), axis=1).sum(1)
    top4 = (jax.lax.top_k(logq, 4)[1] == labels[..., None]).any(-1)
    return loss, {"hard": (hard * w).sum() / (w.sum() * b * a), "acc_by_depth": hit.mean(0),
                  "top4_by_depth": top4.mean(0), "chain_run": run.mean()}


def make_drafter_step(graphdef, tx, soft_weight: float):
    import optax

    @jax.jit
    def step(params, rest, opt_state, target, tokens, anchors, depth_weights):
        feats_ids = nnx.merge(graphdef, params, rest).target_layer_ids
        feats, pred, tlogp = distill_targets(target, tokens, feats_ids)

        def loss_fn(p):
            return drafter_loss(nnx.merge(graphdef, p, rest), target, tokens, feats, pred, tlogp, anchors,
                                depth_weights, soft_weight)

        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, aux

    return step


def make_drafter_eval(graphdef, soft_weight: float):
    @jax.jit
    def ev(params, rest, target, tokens, anchors, depth_weights):
        drafter = nnx.merge(graphdef, params, rest)
        feats, pred, tlogp = distill_targets(target, tokens, drafter.target_layer_ids)
        return drafter_loss(drafter, target, tokens, feats, pred, tlogp, anchors, depth_weights, soft_weight)

    return ev


def greedy_sequences(target: Transformer, prompts: np.ndarray, new_tokens: int, batch: int, deadline: float):
    """Real prompts continued by the target's greedy decoding (what the drafter sees at inference)."""
    from kdtree_jax.speculative.engine import generate

    out = []
    for i in range(0, len(prompts) - batch + 1, batch):
        if time.time() > deadline:
            break
        res = generate(target, None, prompts[i:i + batch], max_new_tokens=new_tokens, budget=0)
        for p, t in zip(prompts[i:i + batch], res.tokens):
            t = list(t) + [0] * (new_tokens - len(t))
            out.append(np.concatenate([p, np.asarray(t[:new_tokens], np.int32)]))
    return np.stack(out) if out else np.zeros((0, prompts.shape[1] + new_tokens), np.int32)


def train_drafter(args) -> dict:
    from tqdm import tqdm

    from kdtree_jax.checkpoint import load_checkpoint, read_metadata

    t_start = time.time()
    if os.path.abspath(args.out) == os.path.abspath(args.target):
        raise SystemExit("--out must differ from --target")
    _prepare_out(args.out, args.overwrite)
    target, _, tokenizer = load_checkpoint(args.target, dtype=jnp.float32)
    target_meta = read_metadata(args.target).get("extra", {})
    tok_file = os.path.join(args.target, "tokenizer", "tokenizer.json")
    train_tokens = encode_split(tokenizer, "train")
    eval_tokens = encode_split(tokenizer, "eval")
    cfg = target.cfg
    dcfg = default_drafter_config()
    if args.block_size:
        dcfg = DrafterConfig(**{**dcfg.to_dict(), "block_size": args.block_size})
    drafter = Drafter(cfg, dcfg, jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    d = dcfg.depth
    depth_weights = jnp.asarray(np.exp(-np.arange(d) / args.depth_decay), jnp.float32)
    rng = np.random.default_rng(args.seed)
    s = args.seq_len
    budget = args.minutes * 60
    deadline_all = t_start + budget

    # Greedy-continuation sequences: prompt of s - new real tokens, then the target's own greedy tokens.
    t_gen = time.time()
    new = s // 2
    n_gen = args.greedy_sequences
    gen_train = np.zeros((0, s), np.int32)
    if n_gen:
        prompts = sample_windows(rng, train_tokens, n_gen, s - new)
        gen_train = greedy_sequences(target, prompts, new, args.gen_batch, t_gen + args.gen_fraction * budget)
    gen_seconds = time.time() - t_gen
    ev_prompts = eval_windows(eval_tokens, s - new, args.batch)
    ev_gen = greedy_sequences(target, ev_prompts, new, args.batch, float("inf"))
    print(f"drafter data: {len(gen_train)} greedy-continued train sequences in {gen_seconds:.0f} s; "
          f"{n_params / 1e6:.2f} M drafter parameters", flush=True)

    def anchors_for(n, gen: bool):
        lo = (s - new) if gen else 8
        return rng.integers(lo, s - d + 1, size=(n, args.anchors)).astype(np.int32)

    ev_anchors = np.random.default_rng(1).integers(s - new, s - d + 1, size=(len(ev_gen), args.anchors)).astype(np.int32)
    tx = _make_optimizer(args.weight_decay)
    opt_state = tx.init(params)
    step_fn = make_drafter_step(graphdef, tx, args.soft_weight)
    eval_fn = make_drafter_eval(graphdef, args.soft_weight)

    def evaluate(p):
        loss, aux = eval_fn(p, rest, target, jnp.asarray(ev_gen), jnp.asarray(ev_anchors), depth_weights)
        return float(loss), {k: np.asarray(v).tolist() for k, v in aux.items()}

    t0 = time.time()
    train_budget = max(60.0, deadline_all - t0 - 60)  # keep a minute for the final eval and the save
    history, step, loss_ema = [], 0, None
    bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True, mininterval=5)
    while step < args.steps:
        progress = max(step / args.steps, (time.time() - t0) / train_budget)
        if progress >= 1.0:
            break
        opt_state = _set_lr(opt_state, lr_at(progress, args.lr))
        use_gen = len(gen_train) > 0 and rng.random() < args.greedy_mix
        if use_gen:
            idx = rng.integers(0, len(gen_train), size=args.batch)
            batch = gen_train[idx]
        else:
            batch = sample_windows(rng, train_tokens, args.batch, s)
        anchors = anchors_for(args.batch, use_gen)
        params, opt_state, loss, aux = step_fn(params, rest, opt_state, target, jnp.asarray(batch),
                                               jnp.asarray(anchors), depth_weights)
        step += 1
        loss = float(loss)
        loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", run=f"{float(aux['chain_run']):.2f}")
        if step % args.eval_every == 0:
            e, eaux = evaluate(params)
            history.append({"step": step, "train_loss_ema": loss_ema, "eval_loss": e,
                            "eval_chain_run": eaux["chain_run"], "seconds": time.time() - t0})
            tqdm.write(f"step {step}: train {loss_ema:.3f}  eval {e:.3f}  eval chain run {eaux['chain_run']:.2f} "
                       f"({time.time() - t0:.0f} s)")
    bar.close()
    train_seconds = time.time() - t0
    e, eaux = evaluate(params)
    drafter = nnx.merge(graphdef, params, rest)
    summary = {
        "phase": "drafter", "command": " ".join(sys.argv), "commit": git_commit(short=False), "steps": step,
        "batch": args.batch, "anchors_per_sequence": args.anchors, "seq_len": s, "block_size": dcfg.block_size,
        "blocks_seen": step * args.batch * args.anchors, "label_tokens_seen": step * args.batch * args.anchors * d,
        "greedy_sequences": int(len(gen_train)), "greedy_new_tokens": new, "greedy_mix": args.greedy_mix,
        "generation_seconds": gen_seconds, "train_seconds": train_seconds, "final_train_loss_ema": loss_ema,
        "final_eval_loss": e, "eval_hard_ce": eaux["hard"], "eval_top1_by_depth": eaux["acc_by_depth"],
        "eval_top4_by_depth": eaux["top4_by_depth"], "eval_chain_run": eaux["chain_run"],
        "soft_weight": args.soft_weight, "depth_decay": args.depth_decay, "lr": args.lr, "params": int(n_params),
        "history": history, "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
    }
    print(f"drafter done: {step} steps in {train_seconds:.0f} s; eval loss {e:.3f}, teacher-forced chain run "
          f"{eaux['chain_run']:.2f}, top-1 by depth {np.round(eaux['acc_by_depth'], 2).tolist()}", flush=True)
    meta = {**target_meta, "drafter_training": summary}
    _save_pair(args.out, target, drafter, tok_file, jnp.dtype(args.save_dtype), meta)
    work = args.out.rstrip("/") + ".work"
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "drafter_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


# CLI ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kdtree_jax.train",
        description="Train the embedded default pair on the Python standard library: first `target` "
                    "(tokenizer + MLA/MoE target), then `drafter` (DFlash-style block drafter distilled "
                    "from the frozen target). Each run stops itself within --minutes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="phase", required=True)

    def common(q, minutes, steps, batch, lr, seq_len):
        q.add_argument("--out", required=True, help="checkpoint directory to write (must be new or empty)")
        q.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
        q.add_argument("--steps", type=int, default=steps, help="maximum optimizer steps")
        q.add_argument("--minutes", type=float, default=minutes,
                       help="wall-clock budget of the run; the schedule is compressed to fit it")
        q.add_argument("--batch", type=int, default=batch, help="sequences per step")
        q.add_argument("--seq-len", type=int, default=seq_len, help="tokens per sequence")
        q.add_argument("--lr", type=float, default=lr, help="peak learning rate (warmup, then cosine to 10%%)")
        q.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
        q.add_argument("--eval-every", type=int, default=100, help="steps between eval-loss reports")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"],
                       help="parameter dtype of the saved checkpoint")

    t = sub.add_parser("target", help="train the tokenizer and the target",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common(t, minutes=9.0, steps=20000, batch=16, lr=3e-3, seq_len=256)
    t.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    t.add_argument("--tokenizer", default=None, help="use this tokenizer.json instead of training one")
    t.add_argument("--eval-windows", type=int, default=64, help="held-out windows for the final eval loss")
    t.add_argument("--bias-rate", type=float, default=1e-3, help="router bias update rate (load balancing)")

    d = sub.add_parser("drafter", help="distill the drafter from a trained target",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common(d, minutes=9.0, steps=20000, batch=8, lr=2e-3, seq_len=256)
    d.add_argument("--target", required=True, help="checkpoint directory of the trained target")
    d.add_argument("--block-size", type=int, default=0, help="drafter block size (0: the default config's)")
    d.add_argument("--anchors", type=int, default=16, help="block anchors per sequence per step")
    d.add_argument("--soft-weight", type=float, default=1.0,
                   help="weight of the soft (target distribution) cross-entropy next to the hard argmax labels")
    d.add_argument("--depth-decay", type=float, default=7.0, help="loss weight of block index i is exp(-(i-1)/this)")
    d.add_argument("--greedy-sequences", type=int, default=512,
                   help="training sequences whose second half is the target's greedy continuation")
    d.add_argument("--gen-batch", type=int, default=64, help="batch for generating them")
    d.add_argument("--gen-fraction", type=float, default=0.2, help="at most this fraction of --minutes generating")
    d.add_argument("--greedy-mix", type=float, default=0.75,
                   help="probability that a step's batch comes from the greedy-continued sequences")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.phase == "target":
        train_target(args)
    else:
        train_drafter(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
