"""Sampling settings as data: each batch row's temperature, top-k, top-p and penalties are arrays in the loop's state,
so greedy and sampled requests with any settings share one batch and one compiled program.

A request's settings are a `SamplingParams`; a batch's are a `RowSampling` (one array per setting, [B]), which the
engine keeps in its loop state and sets row by row when a request is admitted. Each row's random stream is its own
key (the state's `key` is [B] keys), so a seeded request draws the same tokens whatever batch it runs in.

The target's distribution for a row, in order (the order of Hugging Face's logits processors and warpers):

  1. penalties, from the counts of each token in the row's sequence so far (prompt + emitted tokens):
       repetition_penalty r (1 = off): a seen token's logit l becomes l / r if l > 0 else l * r (Hugging Face's);
       presence_penalty p (0 = off): a seen token's logit less p;
       frequency_penalty f (0 = off): each token's logit less f * its count;
  2. temperature (0 = greedy: the argmax of the penalised logits, lowest id among ties);
  3. top-k (0 = off) then top-p (1 = off), as `accept.filter_logits` defines them.

Speculative acceptance stays exact with penalties only if every tree node's distribution is penalised with the counts
of its own sequence: the committed counts plus the tokens on the node's path from the root (`path_tokens`), not the
committed counts alone. That is what `accept_rows` does, at each node it visits.

What the counts cost: an int32 [B, V] array in the loop state (the default pair: V = 8192, 32 KB a row; a
Kimi-K2-size vocabulary of 163,840: 640 KB a row, 42 MB at B = 64), a [B, V] copy and add per visited node, and
with greedy rows the whole [B, T, V] verify logits penalised once. A program compiled without penalties
(SpecConfig.penalties False) carries no counts and does none of this.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.ops.argmax import argmax_last
from kdtree_jax.speculative import accept as acceptance
from kdtree_jax.speculative.tree import Tree

FIRST_TOKEN_STREAM = 1 << 30  # folded into a row's key for its first token; a step folds in num_out (< 2**30)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (module docstring for what each does). All defaults: greedy, no penalties."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        def number(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number; got {value!r}")
        for field in dataclasses.fields(self):
            number(field.name, getattr(self, field.name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy); got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1: off); got {self.top_p}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off); got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1: off); got {self.repetition_penalty}")

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class RowSampling(NamedTuple):
    """A batch's sampling settings, one entry per row (the loop state's `sampling`)."""

    temperature: jnp.ndarray  # f32 [B], 0: greedy
    top_p: jnp.ndarray  # f32 [B], 1: off
    top_k: jnp.ndarray  # int32 [B], 0: off
    repetition_penalty: jnp.ndarray  # f32 [B], 1: off
    presence_penalty: jnp.ndarray  # f32 [B], 0: off
    frequency_penalty: jnp.ndarray  # f32 [B], 0: off

    @staticmethod
    def of(params: Sequence[SamplingParams]) -> "RowSampling":
        """The rows of these settings (numpy; the engine puts them on the device with the rest of the state)."""
        def column(name, dtype):
            return np.array([getattr(p, name) for p in params], dtype)
        return RowSampling(column("temperature", np.float32), column("top_p", np.float32), column("top_k", np.int32),
                           column("repetition_penalty", np.float32), column("presence_penalty", np.float32),
                           column("frequency_penalty", np.float32))

    def row(self, b) -> "RowSampling":
        """Row b as a batch of one."""
        return RowSampling(*(x[b][None] for x in self))

    def set_row(self, b, one: "RowSampling") -> "RowSampling":
        """These rows with row b replaced by `one` (a batch of one)."""
        return RowSampling(*(x.at[b].set(y[0]) for x, y in zip(self, one)))


def row_keys(seeds) -> jax.Array:
    """[B] typed keys, one per seed."""
    return jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))


def batch_keys(seed: int, batch: int) -> jax.Array:
    """[B] keys for a batch decoded with one seed: row b's is fold_in(key(seed), b)."""
    key = jax.random.key(seed)
    return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))


# Penalties ----------------------------------------------------------------------------------------------------------


def count_tokens(tokens, vocab_size: int):
    """int32 [B, V]: how often each token occurs in each row of tokens [B, N] (-1 padding is not counted)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    return add_tokens(jnp.zeros((tokens.shape[0], vocab_size), jnp.int32), tokens)


def add_tokens(counts, tokens):
    """counts [B, ..., V] (broadcast to tokens' leading shape) with tokens [B, ..., N] added (-1 padding skipped), as
    a scatter-add (a one-hot sum would materialise [..., N, V])."""
    tokens = jnp.asarray(tokens, jnp.int32)
    vocab = counts.shape[-1]
    lead = tokens.shape[:-1]
    flat = jnp.broadcast_to(counts, lead + (vocab,)).reshape(-1, vocab)
    ids = tokens.reshape(flat.shape[0], -1)
    ids = jnp.where(ids >= 0, ids, vocab)  # out of range: dropped (a negative index would wrap)
    rows = jnp.arange(flat.shape[0])[:, None]
    return flat.at[rows, ids].add(1, mode="drop").reshape(lead + (vocab,))


def penalize(logits, counts, rows: RowSampling):
    """f32 logits [B, ..., V] with each row's penalties applied for its token counts [B, ..., V]."""
    logits = jnp.asarray(logits, jnp.float32)
    extra = (1,) * (logits.ndim - 2)

    def per_row(x):
        return x.reshape(x.shape + extra + (1,))

    seen = counts > 0
    r = per_row(rows.repetition_penalty)
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - per_row(rows.presence_penalty) * seen - per_row(rows.frequency_penalty) * counts


def path_tokens(tree: Tree):
    """int32 [B, T, D]: each node's tokens from depth 1 down to itself (the tokens the node's sequence adds to the
    committed one, whose last token is the root), -1 padding. D parent lookups of [B, T]."""
    batch, num_nodes = tree.tokens.shape
    node = jnp.broadcast_to(jnp.arange(num_nodes, dtype=jnp.int32), (batch, num_nodes))
    columns = []
    for _ in range(tree.max_depth):
        depth = jnp.take_along_axis(tree.depths, node, axis=1)
        columns.append(jnp.where(depth >= 1, jnp.take_along_axis(tree.tokens, node, axis=1), -1))
        node = jnp.clip(jnp.take_along_axis(tree.parents, node, axis=1), 0, num_nodes - 1)
    if not columns:
        return jnp.full((batch, num_nodes, 0), -1, jnp.int32)
    return jnp.stack(columns, axis=-1).astype(jnp.int32)


# Filtering and drawing ----------------------------------------------------------------------------------------------


# A row's top-k and top-p cutoffs are looked for among its HEAD best logits first where a sort is slow: on the 2-core CPU
# lax.top_k(64) of 8,192 logits took ~30 us against ~1.6 ms for sorting them (a sampled autoregressive decode of the
# default pair there: 215 tok/s against greedy's 387). The whole sorted row is used only when some row's cutoff lies
# past the head (lax.cond). A GPU sorts the row in one kernel, and a conditional in the decode loop would split its
# command buffer (budget_policy.py's note on control flow in the step): it keeps the sort. 512, not 64: at batch 16 one
# row whose top-p 0.95 nucleus passed 64 tokens sorted the whole batch; the default pair at T = 0.7 on that CPU,
# autoregressive batch 16, 348 -> 730 tok/s, batch 1 unchanged within its spread
# (benchmarks/results/history/spec_decode_cpu_sampling_head_size_ab.md).
HEAD = 512


def _filtered(scaled, best, k, top_p):
    """scaled [B, V] with each row's top-k and top-p applied, the cutoffs read from `best` [B, n], each row's n largest
    values best first (n = V: the whole sorted row): -> (filtered [B, V], exact [B]: n was enough, i.e. the cutoffs
    are the whole row's)."""
    vocab, n = scaled.shape[-1], best.shape[-1]
    kth = jnp.where(k < vocab, jnp.take_along_axis(best, jnp.clip(k, 1, n) - 1, axis=-1), -jnp.inf)
    kept = jnp.where(scaled >= kth, scaled, -jnp.inf)  # ties with the k-th all stay
    # top-p over the best-first kept tokens: entries past k count no mass (ties past k are kept, and counted in the
    # normaliser, as in filter_logits).
    index = jnp.arange(n)[None, :]
    probs = jnp.where(index < k, jnp.exp(best - jax.nn.logsumexp(kept, axis=-1, keepdims=True)), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    count = jnp.sum((mass_before < top_p) & (index < k), axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(best, jnp.clip(count, 1, n) - 1, axis=-1)
    filtered = jnp.where((kept >= cutoff) | (top_p >= 1.0), kept, -jnp.inf)
    exact = ((k >= vocab) | (k <= n)) & ((top_p >= 1.0) | (count < n))
    return filtered, exact[:, 0]


def filter_rows(logits, rows: RowSampling, head: Optional[bool] = None):
    """The sampling distribution of each row as logits, f32 [B, V] (-inf on removed tokens): `accept.filter_logits`
    with each row's own temperature, top-k and top-p as data. A greedy row keeps only its argmax (lowest id among
    ties), at logit 0. head: look for the cutoffs among the HEAD best logits first (default: on a CPU)."""
    logits = jnp.asarray(logits, jnp.float32)
    vocab = logits.shape[-1]
    temperature = rows.temperature[:, None]
    argmax_only = jnp.where(jnp.arange(vocab) == argmax_last(logits)[:, None], 0.0, -jnp.inf)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    top_k = rows.top_k[:, None]
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # tokens top-k keeps in the sorted order
    top_p = rows.top_p[:, None]

    def whole_row():
        return _filtered(scaled, -jnp.sort(-scaled, axis=-1), k, top_p)[0]

    if head is None:
        head = jax.default_backend() == "cpu"
    if head and vocab > HEAD:
        fast, exact = _filtered(scaled, jax.lax.top_k(scaled, HEAD)[0], k, top_p)
        filtered = jax.lax.cond(jnp.all(exact | (rows.temperature <= 0)), lambda: fast, whole_row)
    else:
        filtered = whole_row()
    return jnp.where(temperature > 0, filtered, argmax_only)


def draw(logits, rows: RowSampling, keys, counts=None):
    """One token per row [B] int32: logits [B, V] penalised (when counts are given), filtered and sampled with keys
    [B] (a greedy row takes the argmax of its penalised logits)."""
    if counts is not None:
        logits = penalize(logits, counts, rows)
    filtered = filter_rows(logits, rows)
    return jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)


def first_tokens(last_logits, rows: RowSampling, keys, counts=None):
    """Each row's first token after its prompt ([B] int32): drawn from the row's own key's first-token stream, so it
    does not depend on the batch the row runs in."""
    return draw(last_logits, rows, jax.vmap(lambda k: jax.random.fold_in(k, FIRST_TOKEN_STREAM))(keys), counts)


def accept_rows(tree: Tree, target_logits, keys, rows: RowSampling, counts=None, *,
                sampled: bool) -> acceptance.Acceptance:
    """Tree acceptance with each row's own settings: -> accept.Acceptance.

    keys [B]: this step's key per row (the walk folds in the node); counts [B, V] or None: the rows' token counts so
    far, prompt and emitted tokens (the root's token included), for the penalties.
    sampled (static) False: every row is greedy; the argmax of every node's (penalised) logits at once
    (`accept.accept_greedy`). True: the walk (`accept.walk`), each visited node's logits penalised with the counts
    of its own path, filtered with its row's settings and sampled with fold_in(row key, node); a greedy row there
    takes the argmax, as it would alone."""
    if not sampled:
        if counts is not None:
            node_counts = add_tokens(counts[:, None, :], path_tokens(tree))  # [B, T, V]
            target_logits = penalize(target_logits, node_counts, rows)
        return acceptance.accept_greedy(tree, target_logits)
    acceptance._check_logits(tree, target_logits)
    paths = path_tokens(tree) if counts is not None else None

    def choose(node):
        row = jnp.take_along_axis(target_logits, node[:, None, None], axis=1)[:, 0]  # [B, V]
        node_counts = None
        if counts is not None:
            node_counts = add_tokens(counts, jnp.take_along_axis(paths, node[:, None, None], axis=1)[:, 0])
        node_keys = jax.vmap(jax.random.fold_in)(keys, node)
        return draw(row, rows, node_keys, node_counts)

    return acceptance.walk(tree, choose)


def step_keys(keys, num_out):
    """A step's key per row: fold_in(row key, the row's output count), new every step a row is active (each step
    emits >= 1 token) and independent of the other rows and of the loop's step counter."""
    return jax.vmap(jax.random.fold_in)(keys, num_out)


def committed_tokens(counts: Optional[jnp.ndarray], emitted, num_emitted):
    """counts with each row's first num_emitted [B] tokens of emitted [B, N] added (None stays None)."""
    if counts is None:
        return None
    keep = jnp.arange(emitted.shape[1])[None, :] < num_emitted[:, None]
    return add_tokens(counts, jnp.where(keep, emitted, -1))


__all__ = ["SamplingParams", "RowSampling", "row_keys", "batch_keys", "count_tokens", "add_tokens", "penalize",
           "path_tokens", "filter_rows", "draw", "first_tokens", "accept_rows", "step_keys", "committed_tokens"]
