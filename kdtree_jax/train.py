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
elapsed / budget), so a run that is slower than planned still finishes its cosine decay in time. The budget is
--minutes, cut to what is left before --end-by (a Unix time) when given; the clock starts after the step's
compile (a warm-up call), so a slow compile shortens training instead of skipping the warmup.

Recipe v2 (issue 26; checkpoints/gpu_train_v2.sh): `--corpus checkpoints/corpus_v2.jsonl.xz` (the frozen pack of
kdtree_jax/corpus.py: standard library + its tests + site-packages code, ~67 M characters) instead of the
interpreter's standard library, a 5-layer target (`--layers 5`), and a drafter distilled on contexts that
include the target's own *sampled* continuations (`--gen-temperatures 0,0.7,1.0 --gen-top-p 0.95`) with the
KL divergence from the target's full next-token distribution as the main loss (`--kl-weight 1 --hard-weight
0.25`); its evaluation also reports the teacher-forced acceptance of sampled verification at T = 0.7 (top-p
0.95): the target's filtered probability mass on the drafter's top-1 / top-4 tokens per depth.
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
def train_tokenizer(out_dir: str, vocab_size: int = 8192, pack: Optional[str] = None) -> str:
    """Byte-level BPE on the training split (of `pack` if given); writes out_dir/tokenizer.json and returns
    its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus.iter_texts("train", pack=pack), trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    return path


def encode_split(tokenizer, split: str, pack: Optional[str] = None, by_source: bool = False,
                 cache: Optional[str] = None):
    """All documents of a split, each followed by EOS, as one int32 array (with by_source: a dict
    source -> array, each source's documents in order). pack: a corpus pack (corpus.build_pack) instead of
    the interpreter's standard library (one source, "stdlib"). cache: an .npz file that keeps the arrays for the next call (keyed
    by the tokenizer file's and the documents' fingerprints; a mismatch re-encodes)."""
    import hashlib

    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(tokenizer.path)
    eos = raw.token_to_id(EOS)
    docs = corpus.documents(split, pack=pack)
    with open(tokenizer.path, "rb") as f:
        key = hashlib.sha256(f.read()).hexdigest()[:16] + "-" + corpus.fingerprint(docs) + f"-{split}"
    path = None
    if cache:
        path = f"{cache.removesuffix('.npz')}.{split}.npz"
        if os.path.exists(path):
            with np.load(path) as z:
                if str(z["key"]) == key:
                    out = {k[4:]: z[k] for k in z.files if k.startswith("src_")}
                    return out if by_source else np.concatenate([out[k] for k in sorted(out)])
    ids = corpus.encode_texts(tokenizer.path, [d.text for d in docs])
    parts: dict = {}
    for d, a in zip(docs, ids):
        parts.setdefault(d.source, []).extend([a, np.asarray([eos], np.int32)])
    out = {k: np.concatenate(v) for k, v in parts.items()}
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        np.savez(path, key=np.asarray(key), **{f"src_{k}": v for k, v in out.items()})
    # Not by source: the sources one after the other (a stdlib split and a pack's eval split are one source,
    # in document order).
    return out if by_source else np.concatenate([out[k] for k in sorted(out)])


class WindowSampler:
    """Random windows from several token arrays (the sources of a pack), each row's source drawn with the
    given weights (default: proportional to the sources' token counts, i.e. uniform over all tokens)."""

    def __init__(self, arrays: dict, weights: Optional[dict] = None):
        self.names = sorted(arrays)
        self.arrays = [arrays[n] for n in self.names]
        w = np.asarray([(weights or {}).get(n, 0.0) if weights else len(arrays[n]) for n in self.names], np.float64)
        if weights and set(weights) - set(self.names):
            raise SystemExit(f"--mix names {sorted(set(weights) - set(self.names))} are not sources of the corpus "
                             f"({self.names})")
        if w.sum() <= 0:
            raise SystemExit("--mix gives every source weight 0")
        self.weights = w / w.sum()

    def __call__(self, rng: np.random.Generator, batch: int, seq_len: int) -> np.ndarray:
        which = rng.choice(len(self.arrays), size=batch, p=self.weights)
        return np.stack([sample_windows(rng, self.arrays[i], 1, seq_len)[0] for i in which])

    def describe(self) -> dict:
        return {n: {"tokens": int(len(a)), "weight": float(w)} for n, a, w in zip(self.names, self.arrays, self.weights)}


def parse_mix(text: str) -> Optional[dict]:
    """'stdlib=0.3,packages=0.5' -> {'stdlib': 0.3, 'packages': 0.5}; '' -> None."""
    if not text:
        return None
    return {k.strip(): float(v) for k, v in (kv.split("=") for kv in text.split(",") if kv.strip())}


def _commit(tree):
    """The arrays placed (committed) on the default device: a jitted step's outputs are, and an argument's
    placement is part of the compile key, so committing the initial state avoids a second compile at step 2."""
    return jax.device_put(tree, jax.devices()[0])


def _budget_seconds(minutes: float, end_by: Optional[float], reserve: float) -> float:
    """Training seconds from now: --minutes, cut to --end-by (a Unix time) less `reserve` seconds when given."""
    budget = minutes * 60
    if end_by:
        budget = min(budget, end_by - time.time() - reserve)
    return max(budget, 1.0)


def eval_windows(tokens: np.ndarray, seq_len: int, count: int) -> np.ndarray:
    """`count` windows of seq_len evenly spaced over the array (deterministic)."""
    starts = np.linspace(0, len(tokens) - seq_len - 1, count).astype(np.int64)
    return np.stack([tokens[s:s + seq_len] for s in starts])


def sample_windows(rng: np.random.Generator, tokens: np.ndarray, batch: int, seq_len: int) -> np.ndarray:
    starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
    return np.stack([tokens[s:s + seq_len] for s in starts])


# The target --------------------------------------------------------------------------------------
def default_target_config(vocab_size: int = 8192, layers: int = 4) -> ModelConfig:
    """K2's attention geometry (kv_lora_rank 512, rope 64, absorbed latent cache 576) and MoE structure
    (sigmoid noaux_tc routing, shared expert, dense first layer), scaled down for a CPU. The shipped v1
    target has 4 layers; recipe v2 uses 5 (14.9 M parameters, ~23 MB in bfloat16 on disk)."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=768, moe_intermediate_size=256, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096,
    )


def default_drafter_config() -> DrafterConfig:
    return DrafterConfig(block_size=16, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=64,
                         intermediate_size=768)


# The drafter phase's capacity options (DrafterConfig fields; 0: v2's).
CAPACITY_OPTIONS = ("block_size", "num_layers", "intermediate_size", "num_heads", "num_kv_heads")


def drafter_config_from_args(args, target_layers: int) -> DrafterConfig:
    """The v2 drafter (`default_drafter_config`) with the drafter phase's capacity options applied (issue 47's
    ablations: the block, the layers, the MLP width, the heads, which target layers feed it); 0 / "" keep v2's."""
    changes = {name: getattr(args, name) for name in CAPACITY_OPTIONS if getattr(args, name, 0)}
    ids = getattr(args, "target_layer_ids", "")
    if ids == "all":
        changes["target_layer_ids"] = tuple(range(target_layers))
    elif ids:
        try:
            changes["target_layer_ids"] = tuple(int(i) for i in ids.split(","))
        except ValueError:
            raise ValueError(f"--target-layer-ids takes layer numbers, comma-separated, or 'all'; got {ids!r}") from None
    return DrafterConfig(**{**default_drafter_config().to_dict(), **changes})


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
    """Linear warmup over the first warmup_frac of progress, then cosine from peak to floor * peak."""
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
    """Mean next-token loss over the windows, `batch` at a time (at most all of them; a smaller last batch
    counts by its size)."""
    batch = max(1, min(batch, len(windows)))
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        chunk = windows[i:i + batch]
        total += float(_eval_loss_jit(model, jnp.asarray(chunk))) * len(chunk)
        count += len(chunk)
    return total / count


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


def _save_pair(out: str, target: Transformer, drafter: Optional[Drafter], tokenizer_file: str, dtype, meta: dict,
               weights: str = "plain"):
    from kdtree_jax.checkpoint import save_checkpoint

    t = target if target.dtype == dtype else _recast_target(target, dtype)
    d = None
    if drafter is not None:
        d = drafter if drafter.dtype == dtype else cast_module(drafter, dtype)
    save_checkpoint(out, t, d, [tokenizer_file], extra_metadata=meta, weights=weights)


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
        tok_file = train_tokenizer(work, args.vocab, args.corpus)
    tokenizer = HFTokenizer(tok_file)
    train_by_source = encode_split(tokenizer, "train", args.corpus, by_source=True, cache=args.token_cache)
    train_tokens = np.concatenate([train_by_source[k] for k in sorted(train_by_source)])
    sampler = WindowSampler(train_by_source, parse_mix(args.mix))
    eval_tokens = encode_split(tokenizer, "eval", args.corpus, cache=args.token_cache)
    print(f"corpus: {len(train_tokens):,} train tokens, {len(eval_tokens):,} eval tokens "
          f"({time.time() - t_start:.0f} s); sources {json.dumps(sampler.describe())}", flush=True)

    cfg = default_target_config(tokenizer.vocab_size, args.layers)
    model = Transformer(cfg, jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = _commit(params), _commit(rest)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    tx = _make_optimizer(args.weight_decay)
    opt_state = _commit(tx.init(params))
    opt_state = _set_lr(opt_state, 0.0)
    step_fn = make_target_step(graphdef, tx, args.bias_rate)
    ev = eval_windows(eval_tokens, args.seq_len, args.eval_windows)
    rng = np.random.default_rng(args.seed)
    # Compile the step (and the eval) before the clock starts: a call whose results are dropped.
    t_compile = time.time()
    warm = step_fn(params, rest, opt_state, jnp.asarray(sampler(np.random.default_rng(123), args.batch, args.seq_len)))
    jax.block_until_ready(warm)
    del warm
    eval_loss(nnx.merge(graphdef, params, rest), ev[: max(args.batch, 8)], args.batch)
    compile_seconds = time.time() - t_compile
    # The final eval and the save take a few seconds; keep them inside --end-by.
    budget = _budget_seconds(args.minutes, args.end_by, reserve=args.end_reserve)
    print(f"target: {n_params / 1e6:.2f} M parameters; compiled in {compile_seconds:.0f} s; up to {args.steps} steps "
          f"of {args.batch} x {args.seq_len}, {budget:.0f} s of training", flush=True)

    t0 = time.time()
    history, step, loss_ema = [], 0, None
    bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True, mininterval=5)
    while step < args.steps:
        elapsed = time.time() - t0
        progress = max(step / args.steps, elapsed / budget)
        if progress >= 1.0:
            break
        lr = lr_at(progress, args.lr, args.warmup_frac, args.lr_floor)
        opt_state = _set_lr(opt_state, lr)
        batch = jnp.asarray(sampler(rng, args.batch, args.seq_len))
        params, rest, opt_state, loss, gnorm, counts = step_fn(params, rest, opt_state, batch)
        step += 1
        loss = float(loss)
        loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.2e}")
        if step % args.eval_every == 0:
            e = eval_loss(nnx.merge(graphdef, params, rest), ev[: max(args.batch, 8)], args.batch)
            c = np.asarray(counts, np.float64)
            history.append({"step": step, "train_loss_ema": loss_ema, "eval_loss": e, "lr": lr,
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
        "train_seconds": train_seconds, "compile_seconds": compile_seconds, "tokens_per_second":
        step * args.batch * args.seq_len / max(train_seconds, 1e-9), "final_train_loss_ema": loss_ema,
        "final_eval_loss": final_eval, "final_eval_ppl": math.exp(final_eval), "eval_windows": len(ev), "lr": args.lr,
        "warmup_frac": args.warmup_frac, "lr_floor": args.lr_floor, "layers": cfg.num_hidden_layers,
        "params": int(n_params), "sources": sampler.describe(),
        "history": history, "corpus": corpus.summary(args.corpus), "train_tokens": int(len(train_tokens)),
        "eval_tokens": int(len(eval_tokens)), "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
    }
    summary["corpus"].pop("eval_files", None)
    print(f"target done: {step} steps, {summary['tokens_seen']:,} tokens, {train_seconds:.0f} s "
          f"({summary['tokens_per_second']:,.0f} tokens/s); "
          f"eval loss {final_eval:.3f} (ppl {math.exp(final_eval):.1f})", flush=True)
    dtype = jnp.dtype(args.save_dtype)
    _save_pair(args.out, model, None, tok_file, dtype, {"target_training": summary}, args.weights)
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
                 depth_weights, hard_weight: float = 1.0, kl_weight: float = 1.0, sample_logp=None):
    """Block-distillation loss through the inference path.

    anchors [B, A]: block start positions c (the context is positions [0, c), the block's first token
    is tokens[c] at position c). Label of block index i (1..D): the target's argmax after x_{<c+i},
    i.e. pred[c + i - 1] (cross-entropy, weight hard_weight); soft label: the target's full distribution
    there, KL(target || drafter) (weight kl_weight; the same gradient as the soft cross-entropy, whose value
    differs by the target's entropy). Each depth i is weighted by depth_weights[i - 1].

    sample_logp [B, S, V] (evaluation): the target's log-probabilities after a sampling filter (e.g. T = 0.7,
    top-p 0.95); then the metrics include the teacher-forced acceptance of sampled verification, the
    filtered target mass on the drafter's top-1 (a chain) and top-4 (a DDTree level) tokens per depth,
    and the expected chain run from it (sum over depths of the product of the top-1 masses).
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
    tlogp = target_logp[rows[:, None], pos]
    kl = (jnp.exp(tlogp) * (tlogp - logq)).sum(-1)
    w = depth_weights[None, :]
    norm = w.sum() * b * a
    loss = ((hard_weight * hard + kl_weight * kl) * w).sum() / norm
    hit = (jnp.argmax(logq, -1) == labels)
    # Expected accepted length of a chain draft (teacher-forced): mean over anchors of the run of hits.
    run = jnp.cumprod(hit.astype(jnp.float32), axis=1).sum(1)
    top4_tok = jax.lax.top_k(logq, 4)[1]  # [B*A, D, 4]
    top4 = (top4_tok == labels[..., None]).any(-1)
    aux = {"hard": (hard * w).sum() / norm, "kl": (kl * w).sum() / norm, "acc_by_depth": hit.mean(0),
           "top4_by_depth": top4.mean(0), "chain_run": run.mean()}
    if sample_logp is not None:
        ps = jnp.exp(sample_logp[rows[:, None], pos])  # [B*A, D, V]
        mass4 = jnp.take_along_axis(ps, top4_tok, axis=-1)  # [B*A, D, 4]
        aux["sampled_top1_mass_by_depth"] = mass4[..., 0].mean(0)
        aux["sampled_top4_mass_by_depth"] = mass4.sum(-1).mean(0)
        aux["sampled_chain_run"] = jnp.cumprod(mass4[..., 0], axis=1).sum(1).mean()
    return loss, aux


def make_drafter_step(graphdef, tx, hard_weight: float, kl_weight: float):
    import optax

    @jax.jit
    def step(params, rest, opt_state, target, tokens, anchors, depth_weights):
        feats_ids = nnx.merge(graphdef, params, rest).target_layer_ids
        feats, pred, tlogp = distill_targets(target, tokens, feats_ids)

        def loss_fn(p):
            return drafter_loss(nnx.merge(graphdef, p, rest), target, tokens, feats, pred, tlogp, anchors,
                                depth_weights, hard_weight, kl_weight)

        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, aux

    return step


def make_drafter_eval(graphdef, hard_weight: float, kl_weight: float, sample_temperature: float = 0.7,
                      sample_top_p: float = 0.95):
    """Eval of the loss and metrics; sampled-verification masses at (sample_temperature, sample_top_p)."""
    from kdtree_jax.speculative.accept import filter_logits

    @jax.jit
    def ev(params, rest, target, tokens, anchors, depth_weights):
        drafter = nnx.merge(graphdef, params, rest)
        feats, pred, tlogp = distill_targets(target, tokens, drafter.target_layer_ids)
        slogp = jax.nn.log_softmax(filter_logits(tlogp, sample_temperature, 0, sample_top_p), axis=-1)
        return drafter_loss(drafter, target, tokens, feats, pred, tlogp, anchors, depth_weights, hard_weight,
                            kl_weight, sample_logp=slogp)

    return ev


def sampled_sequences(target: Transformer, prompts: np.ndarray, new_tokens: int, batch: int, deadline: float,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
    """Real prompts continued by the target's own decoding (what the drafter sees at inference): greedy at
    temperature 0, else sampled at that temperature (top-p filtered). Batches until `deadline` (time.time())."""
    from kdtree_jax.speculative.engine import generate

    out = []
    for n, i in enumerate(range(0, len(prompts) - batch + 1, batch)):
        if time.time() > deadline:
            break
        res = generate(target, None, prompts[i:i + batch], max_new_tokens=new_tokens, budget=0,
                       temperature=temperature, top_p=top_p if temperature > 0 else 1.0, seed=seed + n)
        for p, t in zip(prompts[i:i + batch], res.tokens):
            t = list(t) + [0] * (new_tokens - len(t))
            out.append(np.concatenate([p, np.asarray(t[:new_tokens], np.int32)]))
    return np.stack(out) if out else np.zeros((0, prompts.shape[1] + new_tokens), np.int32)


def greedy_sequences(target: Transformer, prompts: np.ndarray, new_tokens: int, batch: int, deadline: float):
    """Real prompts continued by the target's greedy decoding."""
    return sampled_sequences(target, prompts, new_tokens, batch, deadline)


def parse_temperatures(text: str) -> list[float]:
    temps = [float(t) for t in str(text).split(",") if t.strip()]
    if not temps or any(t < 0 for t in temps):
        raise SystemExit(f"--gen-temperatures must be a comma-separated list of temperatures >= 0; got {text!r}")
    return temps


def train_drafter(args) -> dict:
    from tqdm import tqdm

    from kdtree_jax.checkpoint import load_checkpoint, load_drafter, read_metadata

    t_start = time.time()
    if os.path.abspath(args.out) == os.path.abspath(args.target):
        raise SystemExit("--out must differ from --target")
    _prepare_out(args.out, args.overwrite)
    target, _, tokenizer = load_checkpoint(args.target, dtype=jnp.float32)
    cfg = target.cfg
    try:  # the drafter's options checked before the corpus is encoded
        dcfg = drafter_config_from_args(args, cfg.num_hidden_layers)
        dcfg.layer_ids(cfg)
    except ValueError as e:
        raise SystemExit(f"drafter options: {e}") from None
    init = None
    if args.init_from:  # a drafter trained before goes on training: its config, checked against this run's options
        try:
            init, init_meta = load_drafter(args.init_from, dtype=jnp.float32)
        except (ValueError, OSError) as e:
            raise SystemExit(f"--init-from: {e}") from None
        given = [k for k in CAPACITY_OPTIONS if getattr(args, k, 0)]
        changed = {k: (getattr(dcfg, k), getattr(init.cfg, k)) for k in given if getattr(dcfg, k) != getattr(init.cfg, k)}
        if args.target_layer_ids and tuple(dcfg.layer_ids(cfg)) != tuple(init.target_layer_ids):
            changed["target_layer_ids"] = (tuple(dcfg.layer_ids(cfg)), tuple(init.target_layer_ids))
        if changed:
            raise SystemExit(f"--init-from {args.init_from}: its drafter differs from the options given (given, its "
                             f"own: {changed}); leave them out to keep its own")
        if ModelConfig.from_dict(init_meta["target"]["config"]) != cfg:
            raise SystemExit(f"--init-from {args.init_from}: its drafter was trained for another target config")
        dcfg = init.cfg
    target_meta = read_metadata(args.target).get("extra", {})
    tok_file = os.path.join(args.target, "tokenizer", "tokenizer.json")
    train_by_source = encode_split(tokenizer, "train", args.corpus, by_source=True, cache=args.token_cache)
    sampler = WindowSampler(train_by_source, parse_mix(args.mix))
    eval_tokens = encode_split(tokenizer, "eval", args.corpus, cache=args.token_cache)
    temps = parse_temperatures(args.gen_temperatures)
    drafter = Drafter(cfg, dcfg, jnp.float32, rngs=nnx.Rngs(args.seed)) if init is None else init
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    params, rest = _commit(params), _commit(rest)
    t_graph, t_state = nnx.split(target)
    target = nnx.merge(t_graph, _commit(t_state))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    d = dcfg.depth
    depth_weights = jnp.asarray(np.exp(-np.arange(d) / args.depth_decay), jnp.float32)
    rng = np.random.default_rng(args.seed)
    s = args.seq_len
    budget = _budget_seconds(args.minutes, args.end_by, reserve=0.0)
    deadline_all = time.time() + budget

    # Self-continued sequences: a prompt of s - new real tokens, then the target's own tokens, decoded at each
    # of --gen-temperatures (greedy at 0, else sampled with --gen-top-p) for an equal share of the sequences.
    t_gen = time.time()
    new = s // 2
    n_gen = args.greedy_sequences
    gen_parts, gen_counts = [], {str(t): 0 for t in temps}
    if n_gen:
        prompts = sampler(rng, n_gen, s - new)
        # Batches round robin over the temperatures until the generation deadline, so that a deadline cuts every
        # temperature's share alike.
        deadline = t_gen + args.gen_fraction * budget
        for n, i in enumerate(range(0, len(prompts) - args.gen_batch + 1, args.gen_batch)):
            temp = temps[n % len(temps)]
            part = sampled_sequences(target, prompts[i:i + args.gen_batch], new, args.gen_batch, deadline, temp,
                                     args.gen_top_p, seed=args.seed + 1000 * n)
            if not len(part):
                break
            gen_parts.append(part)
            gen_counts[str(temp)] += int(len(part))
    gen_train = np.concatenate(gen_parts) if gen_parts else np.zeros((0, s), np.int32)
    gen_seconds = time.time() - t_gen
    ev_n = max(args.eval_sequences, 1)
    ev_prompts = eval_windows(eval_tokens, s - new, ev_n)
    # The eval's continuations at the training generation's batch when it divides them (one compiled loop fewer).
    ev_bs = args.gen_batch if ev_n % args.gen_batch == 0 else ev_n
    ev_sets = {"greedy": sampled_sequences(target, ev_prompts, new, ev_bs, float("inf")),
               f"T{args.eval_temperature:g}": sampled_sequences(target, ev_prompts, new, ev_bs, float("inf"),
                                                              args.eval_temperature, args.gen_top_p, seed=7)}
    print(f"drafter data: {len(gen_train)} self-continued train sequences {gen_counts} in {gen_seconds:.0f} s; "
          f"{n_params / 1e6:.2f} M drafter parameters", flush=True)

    def anchors_for(n, gen: bool):
        lo = (s - new) if gen else 8
        return rng.integers(lo, s - d + 1, size=(n, args.anchors)).astype(np.int32)

    ev_anchors = np.random.default_rng(1).integers(s - new, s - d + 1, size=(ev_n, args.anchors)).astype(np.int32)
    tx = _make_optimizer(args.weight_decay)
    opt_state = _set_lr(_commit(tx.init(params)), 0.0)
    step_fn = make_drafter_step(graphdef, tx, args.hard_weight, args.kl_weight)
    eval_fn = make_drafter_eval(graphdef, args.hard_weight, args.kl_weight, args.eval_temperature, args.gen_top_p)

    def evaluate(p):
        """{eval set: (loss, metrics)} over the held-out prompts' greedy and sampled continuations."""
        out = {}
        for name, seqs in ev_sets.items():
            loss, aux = eval_fn(p, rest, target, jnp.asarray(seqs), jnp.asarray(ev_anchors), depth_weights)
            out[name] = (float(loss), {k: np.asarray(v).tolist() for k, v in aux.items()})
        return out

    def next_batch():
        use_gen = len(gen_train) > 0 and rng.random() < args.greedy_mix
        if use_gen:
            batch = gen_train[rng.integers(0, len(gen_train), size=args.batch)]
        else:
            batch = sampler(rng, args.batch, s)
        return batch, anchors_for(args.batch, use_gen)

    # Compile the step and the eval before the clock starts (results dropped).
    t_compile = time.time()
    wb, wa = next_batch()
    jax.block_until_ready(step_fn(params, rest, opt_state, target, jnp.asarray(wb), jnp.asarray(wa), depth_weights))
    evaluate(params)
    compile_seconds = time.time() - t_compile
    t0 = time.time()
    # Keep time for the final eval and the save (--end-reserve seconds, and at least 5% of the budget).
    train_budget = max(5.0, deadline_all - t0 - max(args.end_reserve, 0.05 * budget))
    if args.train_seconds:  # an ablation's arms train alike, whatever their compile and generation took
        train_budget = min(train_budget, args.train_seconds)
    print(f"drafter: compiled in {compile_seconds:.0f} s; {train_budget:.0f} s of training", flush=True)
    history, step, loss_ema = [], 0, None
    bar = tqdm(total=args.steps, unit="step", dynamic_ncols=True, mininterval=5)
    while step < args.steps:
        progress = max(step / args.steps, (time.time() - t0) / train_budget)
        if progress >= 1.0:
            break
        opt_state = _set_lr(opt_state, lr_at(progress, args.lr, args.warmup_frac, args.lr_floor))
        batch, anchors = next_batch()
        params, opt_state, loss, aux = step_fn(params, rest, opt_state, target, jnp.asarray(batch),
                                               jnp.asarray(anchors), depth_weights)
        step += 1
        loss = float(loss)
        loss_ema = loss if loss_ema is None else 0.95 * loss_ema + 0.05 * loss
        bar.update(1)
        bar.set_postfix(loss=f"{loss_ema:.3f}", run=f"{float(aux['chain_run']):.2f}")
        if step % args.eval_every == 0:
            evs = evaluate(params)
            e, eaux = evs["greedy"]
            es, esaux = evs[f"T{args.eval_temperature:g}"]
            history.append({"step": step, "train_loss_ema": loss_ema, "eval_loss": e,
                            "eval_chain_run": eaux["chain_run"], "eval_sampled_loss": es,
                            "eval_sampled_chain_run": esaux["sampled_chain_run"], "seconds": time.time() - t0})
            tqdm.write(f"step {step}: train {loss_ema:.3f}  eval {e:.3f}  chain run {eaux['chain_run']:.2f}  "
                       f"T={args.eval_temperature:g}: eval {es:.3f}, expected chain run {esaux['sampled_chain_run']:.2f} "
                       f"({time.time() - t0:.0f} s)")
    bar.close()
    train_seconds = time.time() - t0
    evs = evaluate(params)
    e, eaux = evs["greedy"]
    drafter = nnx.merge(graphdef, params, rest)
    summary = {
        "phase": "drafter", "command": " ".join(sys.argv), "commit": git_commit(short=False), "steps": step,
        "init_from": None if init is None else {
            "path": os.path.abspath(args.init_from),
            "drafter_training": (init_meta.get("extra") or {}).get("drafter_training")},
        "batch": args.batch, "anchors_per_sequence": args.anchors, "seq_len": s, "block_size": dcfg.block_size,
        "drafter_config": {**dcfg.to_dict(), "target_layer_ids": list(dcfg.layer_ids(cfg))},
        "blocks_seen": step * args.batch * args.anchors, "label_tokens_seen": step * args.batch * args.anchors * d,
        "greedy_sequences": int(len(gen_train)), "greedy_new_tokens": new, "greedy_mix": args.greedy_mix,
        "gen_temperatures": temps, "gen_top_p": args.gen_top_p, "gen_sequences_by_temperature": gen_counts,
        "generation_seconds": gen_seconds, "compile_seconds": compile_seconds, "train_seconds": train_seconds,
        "final_train_loss_ema": loss_ema,
        "final_eval_loss": e, "eval_hard_ce": eaux["hard"], "eval_kl": eaux["kl"],
        "eval_top1_by_depth": eaux["acc_by_depth"],
        "eval_top4_by_depth": eaux["top4_by_depth"], "eval_chain_run": eaux["chain_run"],
        "eval_sequences": ev_n,
        "eval_by_set": {name: {"loss": l, **a} for name, (l, a) in evs.items()},
        "eval_sampling": {"temperature": args.eval_temperature, "top_p": args.gen_top_p},
        "hard_weight": args.hard_weight, "kl_weight": args.kl_weight, "depth_decay": args.depth_decay,
        "lr": args.lr, "params": int(n_params), "sources": sampler.describe(),
        "corpus": args.corpus or "stdlib",
        "history": history, "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
    }
    es, esaux = evs[f"T{args.eval_temperature:g}"]
    print(f"drafter done: {step} steps in {train_seconds:.0f} s; greedy eval loss {e:.3f}, teacher-forced chain run "
          f"{eaux['chain_run']:.2f}, top-1 by depth {np.round(eaux['acc_by_depth'], 2).tolist()}; "
          f"T={args.eval_temperature:g} (top-p {args.gen_top_p}): expected chain run {esaux['sampled_chain_run']:.2f}, "
          f"top-1 mass by depth {np.round(esaux['sampled_top1_mass_by_depth'], 2).tolist()}, "
          f"top-4 mass {np.round(esaux['sampled_top4_mass_by_depth'], 2).tolist()}", flush=True)
    meta = {**target_meta, "drafter_training": summary}
    _save_pair(args.out, target, drafter, tok_file, jnp.dtype(args.save_dtype), meta, args.weights)
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
        q.add_argument("--weights", default="plain", choices=["plain", "int8"],
                       help="how the checkpoint stores its matrices: plain (--save-dtype) or int8 with a scale per "
                            "128 weights (half bfloat16's bytes; read back in any dtype)")
        q.add_argument("--corpus", default=None,
                       help="corpus pack (kdtree_jax.corpus --build-pack; recipe v2: checkpoints/corpus_v2.jsonl.xz) "
                            "instead of this interpreter's standard library")
        q.add_argument("--token-cache", default=None,
                       help="keep the encoded corpus in PATH.{train,eval}.npz for the next run (the drafter reuses the "
                            "target's)")
        q.add_argument("--mix", default="", help="source weights of the training windows, e.g. "
                       "stdlib=0.3,stdlib_tests=0.2,packages=0.5 (default: proportional to the sources' tokens)")
        q.add_argument("--end-by", type=float, default=None,
                       help="Unix time by which the run must have saved its checkpoint (cuts --minutes)")
        q.add_argument("--end-reserve", type=float, default=20.0,
                       help="seconds kept before --end-by for the final eval and the save")
        q.add_argument("--warmup-frac", type=float, default=0.03, help="learning-rate warmup, fraction of the run")
        q.add_argument("--lr-floor", type=float, default=0.1, help="the cosine ends at this fraction of --lr")

    t = sub.add_parser("target", help="train the tokenizer and the target",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common(t, minutes=9.0, steps=20000, batch=16, lr=3e-3, seq_len=256)
    t.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    t.add_argument("--tokenizer", default=None, help="use this tokenizer.json instead of training one")
    t.add_argument("--eval-windows", type=int, default=64, help="held-out windows for the final eval loss")
    t.add_argument("--bias-rate", type=float, default=1e-3, help="router bias update rate (load balancing)")
    t.add_argument("--layers", type=int, default=4, help="target layers (the first dense, the rest MoE; v2: 5)")

    d = sub.add_parser("drafter", help="distill the drafter from a trained target",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common(d, minutes=9.0, steps=20000, batch=8, lr=2e-3, seq_len=256)
    d.add_argument("--target", required=True, help="checkpoint directory of the trained target")
    d.add_argument("--block-size", type=int, default=0, help="drafter block size (0: the default config's)")
    d.add_argument("--drafter-layers", dest="num_layers", type=int, default=0, metavar="N",
                   help="drafter layers (0: v2's 3)")
    d.add_argument("--drafter-intermediate", dest="intermediate_size", type=int, default=0, metavar="N",
                   help="the drafter MLP's width (0: v2's 768)")
    d.add_argument("--drafter-heads", dest="num_heads", type=int, default=0, metavar="N",
                   help="query heads (0: v2's 4)")
    d.add_argument("--drafter-kv-heads", dest="num_kv_heads", type=int, default=0, metavar="N",
                   help="key/value heads (0: v2's 2)")
    d.add_argument("--target-layer-ids", default="", metavar="IDS",
                   help="the target layers whose outputs feed the drafter, comma-separated, or 'all' (default: three "
                        "evenly spaced, v2's)")
    d.add_argument("--init-from", default="", metavar="DIR",
                   help="start from the drafter of this checkpoint (a pair, or a directory with its metadata file and "
                        "drafter/ alone) instead of random weights, with its config: a longer training in several "
                        "runs (each with a fresh optimizer and schedule, and new continuations with another --seed)")
    d.add_argument("--train-seconds", type=float, default=0.0,
                   help="at most this many seconds of training steps, counted after the compile (0: what the budget "
                        "leaves); checkpoints/gpu_drafter_ablation.sh gives each arm the same")
    d.add_argument("--anchors", type=int, default=16, help="block anchors per sequence per step")
    d.add_argument("--kl-weight", "--soft-weight", dest="kl_weight", type=float, default=1.0,
                   help="weight of KL(target's next-token distribution || drafter's) (the soft label; --soft-weight: "
                        "its old name, the same gradient)")
    d.add_argument("--hard-weight", type=float, default=1.0,
                   help="weight of the cross-entropy on the target's argmax (the greedy label)")
    d.add_argument("--depth-decay", type=float, default=7.0, help="loss weight of block index i is exp(-(i-1)/this)")
    d.add_argument("--greedy-sequences", type=int, default=512,
                   help="training sequences whose second half is the target's own continuation (batches of --gen-batch "
                        "round robin over --gen-temperatures)")
    d.add_argument("--gen-temperatures", default="0",
                   help="temperatures of those continuations: 0 greedy, > 0 sampled with --gen-top-p (v2: 0,0.7,1.0)")
    d.add_argument("--gen-top-p", type=float, default=0.95, help="top-p of the sampled continuations (and the eval's)")
    d.add_argument("--gen-batch", type=int, default=64, help="batch for generating them")
    d.add_argument("--gen-fraction", type=float, default=0.2, help="at most this fraction of --minutes generating")
    d.add_argument("--greedy-mix", type=float, default=0.75,
                   help="probability that a step's batch comes from the self-continued sequences")
    d.add_argument("--eval-sequences", type=int, default=0,
                   help="held-out prompts continued for the eval (greedy and at --eval-temperature; 0: --batch)")
    d.add_argument("--eval-temperature", type=float, default=0.7,
                   help="sampling temperature of the eval's sampled continuations and acceptance masses")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.phase == "drafter" and not args.eval_sequences:
        args.eval_sequences = args.batch
    if args.phase == "target":
        train_target(args)
    else:
        train_drafter(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
