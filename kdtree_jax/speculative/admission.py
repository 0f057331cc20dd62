"""Batch rows between chunks of the decode loop: a new prompt admitted into a row (`admit_row`, `replace_row`,
`ChunkedLoop.admit`), rows emptied (`reset_rows`) or ended (`deactivate`); the state keeps its shapes, so nothing
compiles after a prompt bucket's first admission."""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kdtree_jax import kv_pool
from kdtree_jax.decode import _forward_chunk, validate_tokens
from kdtree_jax.kv_pool import KVCache
from kdtree_jax.model.drafter import Drafter, DrafterCache
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.ops.argmax import argmax_last
from kdtree_jax.speculative import accept as acceptance
from kdtree_jax.speculative import sampling as sampling_ops
from kdtree_jax.speculative import tree as trees
from kdtree_jax.speculative.step import LoopState, SpecConfig
from kdtree_jax.speculative.validation import round_up

PREFILL_CHUNK = 64  # prefill tokens per pass (generate's default chunk_size)
_TRACES: dict = {}  # name -> times traced (each trace is a compile)


def deactivate(state: LoopState, rows) -> LoopState:
    """The state with these batch rows inactive (the loop runs no more steps for them)."""
    rows = jnp.asarray(sorted(set(int(r) for r in rows)), jnp.int32)
    return state._replace(active=state.active.at[rows].set(False))


def _reset_row_state(state: LoopState, row) -> LoopState:
    return _reset_rows_state(state, jnp.arange(state.bonus.shape[0]) == row)


def _reset_rows_state(state: LoopState, which) -> LoopState:
    dcache = state.dcache
    if dcache is not None:
        dcache = dcache._replace(lens=jnp.where(which, 0, dcache.lens))
    pending = state.pending
    if pending is not None:  # an adaptive loop's features not yet in the drafter's context: the old sequence's
        pending = pending._replace(count=jnp.where(which, 0, pending.count))
    return state._replace(cache=kv_pool.reset_sequences(state.cache, which), dcache=dcache,
                          out=jnp.where(which[:, None], -1, state.out), num_out=jnp.where(which, 0, state.num_out),
                          active=state.active & ~which, pending=pending)


@functools.partial(jax.jit, donate_argnames=("state",))
def reset_rows(state: LoopState, which) -> LoopState:
    """Empty the batch rows where `which` [B] (bool) is set, between chunks: their KV slots back to the pool, their
    drafter context, output and count cleared, inactive. The rows are data, so any set of rows is one dispatch of one
    compiled program: the server resets every row a chunk finished at once (a dispatch per row cost the host 0.8 ms on
    the H200, a chunk's launch about 2: benchmarks/results/history/serve_host_h200_c0fbc86.md)."""
    return _reset_rows_state(state, jnp.asarray(which, bool))


def reset_row(state: LoopState, row: int) -> LoopState:
    """`reset_rows` of one row (the same compiled program)."""
    return reset_rows(state, np.arange(state.bonus.shape[0]) == row)


# Row admission: a new prompt in one batch row between chunks -------------------------------------------------------
# Continuous batching (the server, spec_decode.py --refill) gives a finished row the next prompt while the other rows
# keep decoding. The prompt is prefilled alone, in a one-row pool as long as its padded length, and copied into the
# batch's pool: prefilling a pool of the batch's shape would cost B times the work, and the other rows wait for it
# (they share the state). Shapes stay fixed (the prompt padded to a power-of-two bucket, the row and the length device
# scalars), so a steady stream of admissions compiles nothing. An admission is one host dispatch of one program
# (`_admit`: the pool, the prefill chunks, the drafter's context, the first token and the copy), the models passed as
# leaves flattened once (`ChunkedLoop.admit`): as ~25 separate jitted calls, each flattening the models again, it
# cost the host 8.6-16.8 ms an admission, which bounded a refill run's tokens/s on an H200.


def prompt_bucket(n: int, max_len: int) -> int:
    """The padded prefill length of an n-token prompt admitted alone: a power of two from 16 (at most max_len), so
    that a handful of prefill programs serve every prompt (the padding costs compute, not pool positions)."""
    length = 16
    while length < n:
        length *= 2
    return min(length, max_len)


class AdmitPlan:
    """The static part of the admission program (`_admit`): the models' structure and what the prefill, the drafter
    and the first token's pick compile in. Its hash is computed once: jax hashes a static argument at every call,
    and hashing the models' structure (two NNX graphs) each time would cost the host what the fused call saves.
    Equal plans share programs: one per prompt bucket for a loop's program, whatever each row's sampling settings
    (they are traced data)."""

    __slots__ = ("structure", "hidden_layers", "impl", "sampled", "penalties", "chunk_size", "mesh", "_key", "_hash")

    def __init__(self, structure, hidden_layers: tuple, spec: SpecConfig, chunk_size: int, mesh):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
        self.structure, self.hidden_layers, self.impl, self.mesh = structure, tuple(hidden_layers), spec.impl, mesh
        self.sampled, self.penalties, self.chunk_size = spec.sampled, spec.penalties, int(chunk_size)
        self._key = (structure, self.hidden_layers, self.impl, self.sampled, self.penalties, self.chunk_size, mesh)
        self._hash = hash(self._key)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (isinstance(other, AdmitPlan) and self._hash == other._hash
                                 and self._key == other._key)


def _adopt_row_state(state: LoopState, fresh: KVCache, fresh_dcache: Optional[DrafterCache], row, first,
                     max_tokens, settings: sampling_ops.RowSampling, key, counts) -> LoopState:
    """Batch row `row` (a traced scalar) takes over the one-row pool `fresh` (and drafter context): see `admit_row`."""
    state = _reset_row_state(state, row)
    cache = state.cache
    count = fresh.seq_lens[0]
    n = min(fresh.max_len, cache.max_len)  # the prompt fits both (the caller checked it against max_len)
    j = jnp.arange(n, dtype=jnp.int32)
    valid = j < count
    short = cache.num_free < count
    # The prompt's latent rows go to slots popped from the batch's pool (its slot table row points at them).
    slots = jnp.where(valid, cache.free_slots[jnp.clip(cache.num_free - 1 - j, 0, cache.num_slots - 1)], 0)
    dest = jnp.where(valid & ~short, slots, cache.num_slots)  # out of range: dropped
    pages = cache.pages.at[:, dest].set(fresh.pages[:, fresh.slot_table[0, :n]], mode="drop")
    table = jnp.zeros((cache.max_len,), jnp.int32).at[:n].set(slots)
    cache = cache._replace(pages=pages, slot_table=cache.slot_table.at[row].set(table),
                           seq_lens=cache.seq_lens.at[row].set(count),
                           num_free=jnp.where(short, cache.num_free, cache.num_free - count),
                           overflow=cache.overflow | short | fresh.overflow)
    dcache = state.dcache
    if dcache is not None:  # positions past lens are masked out: the old occupant's leftovers there are never read
        n = min(fresh_dcache.k.shape[3], dcache.k.shape[3])  # positions: axis 3 ([L, B, Hkv, max_len, D])
        dcache = DrafterCache(dcache.k.at[:, row, :, :n].set(fresh_dcache.k[:, 0, :, :n]),
                              dcache.v.at[:, row, :, :n].set(fresh_dcache.v[:, 0, :, :n]),
                              dcache.lens.at[row].set(fresh_dcache.lens[0]))
    # The loop ends a row once its output count reaches the out buffer's width (max_new); this row's output starts
    # at max_new - max_tokens, so it ends after exactly max_tokens tokens, with no extra step and no compile.
    token = first[0]
    width = state.accepted_hist.shape[0]
    max_new = state.out.shape[1] - width
    offset = max_new - max_tokens
    num_out = offset + 1
    live = ~(token == state.stop_ids).any() & (num_out < max_new)
    out_row = jnp.full((state.out.shape[1],), -1, jnp.int32).at[offset].set(token)
    # The row's own settings, random stream and token counts (prompt + first token).
    return state._replace(cache=cache, dcache=dcache, bonus=state.bonus.at[row].set(token),
                          out=state.out.at[row].set(out_row), num_out=state.num_out.at[row].set(num_out),
                          active=state.active.at[row].set(live), sampling=state.sampling.set_row(row, settings),
                          key=state.key.at[row].set(key),
                          counts=None if counts is None else state.counts.at[row].set(counts[0]))


def _prefill_rows(target, drafter, ids, ints, floats, plan: AdmitPlan, dtype):
    """The prompts ids [k, bucket] (zero padded; ints [k, 5], floats [k, 5] as `_admit` takes them, a row each)
    prefilled together in a k-row pool: -> (the pool, the drafter's context (or None), the first tokens [k], the rows'
    RowSampling, keys [k] and token counts [k, V] (or None))."""
    n, seed = ints[:, 0], ints[:, 3]
    length = ids.shape[1]
    chunk = min(plan.chunk_size, length)
    padded = round_up(length, chunk)
    tokens = jnp.pad(ids, ((0, 0), (0, padded - length)))
    # Room for whole prefill chunks (a chunk takes its slots before the padding's are given back): the pool cannot
    # overflow, and its flag is carried into the batch's all the same. Its dtype: the batch pool's.
    fresh = kv_pool.init_cache(target.cfg, ids.shape[0], padded, dtype=dtype)
    if plan.mesh is not None:  # a sharded target: the pool lives whole on every device
        fresh = jax.lax.with_sharding_constraint(fresh, NamedSharding(plan.mesh, PartitionSpec()))
    last_logits, hidden = None, []
    for start in range(0, padded, chunk):  # decode.prefill's chunks, in one program
        num_valid = jnp.clip(n - start, 0, chunk).astype(jnp.int32)
        logits, h, fresh = _forward_chunk(target, fresh, tokens[:, start:start + chunk], num_valid,
                                          plan.hidden_layers, plan.impl)
        hidden.append(h)
        idx = n - 1 - start  # each prompt's last token lies in some chunk; its logits are picked there
        picked = jnp.take_along_axis(logits, jnp.clip(idx, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        here = ((idx >= 0) & (idx < chunk))[:, None]
        last_logits = picked if last_logits is None else jnp.where(here, picked, last_logits)
    dcache = None
    if drafter is not None:
        hidden = jnp.concatenate(hidden, axis=2)[:, :, :length]
        dcache = drafter.extend_context(drafter.init_cache(ids.shape[0], length), hidden, n)
    settings = sampling_ops.RowSampling(floats[:, 0], floats[:, 1], ints[:, 4], floats[:, 2], floats[:, 3],
                                        floats[:, 4])
    # Each row's own stream, from its seed: its tokens do not depend on the batch it joins.
    keys = sampling_ops.row_keys(seed.astype(jnp.uint32))
    counts = None
    if plan.penalties:
        counts = sampling_ops.count_tokens(jnp.where(jnp.arange(length)[None, :] < n[:, None], ids, -1),
                                           target.cfg.vocab_size)
    if plan.sampled:
        first = sampling_ops.first_tokens(last_logits, settings, keys, counts)
    else:
        first = argmax_last(last_logits if counts is None else sampling_ops.penalize(last_logits, counts, settings))
    if counts is not None:
        counts = sampling_ops.add_tokens(counts, first[:, None])
    return fresh, dcache, first, settings, keys, counts


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def _admit(leaves, state: LoopState, ids, ints, floats, *, plan: AdmitPlan):
    """One admission, one program (per plan and prompt bucket): the one-row pool, the prompt's prefill chunks, the
    drafter's context, the first token and the adoption into batch row `row`. ids [1, bucket] (the prompt, zero
    padded); ints [5] = (prompt length, row, max_tokens, seed, top_k); floats [5] = (temperature, top_p,
    repetition_penalty, presence_penalty, frequency_penalty): the row's sampling settings, data like the rest.
    -> (the state, the first token [1])."""
    _TRACES["admit"] = _TRACES.get("admit", 0) + 1
    target, drafter = jax.tree.unflatten(plan.structure, leaves)
    fresh, dcache, first, settings, keys, counts = _prefill_rows(target, drafter, ids, ints[None], floats[None], plan,
                                                                 state.cache.pages.dtype)
    row, max_tokens = ints[1], ints[2]
    state = _adopt_row_state(state, fresh, dcache, row, first, max_tokens, settings, keys[0], counts)
    if plan.mesh is not None:
        # XLA would otherwise pick the outputs' shardings itself (the token counts come out split along the vocabulary,
        # as the lm head is): the chunk program, compiled for a state replicated on the mesh, would refuse them.
        state = jax.lax.with_sharding_constraint(state, NamedSharding(plan.mesh, PartitionSpec()))
    return state, first


class Prepared(NamedTuple):
    """One admission's inputs, checked on the host (`prepare`): the program's ids, ints and floats (`_admit`)."""

    ids: np.ndarray  # [bucket] int32: the prompt, zero padded to prompt_bucket
    ints: np.ndarray  # [5] int32: (prompt length, row, max_tokens, seed, top_k)
    floats: np.ndarray  # [5] float32: (temperature, top_p, repetition_penalty, presence_penalty, frequency_penalty)

    @property
    def row(self) -> int:
        return int(self.ints[1])


def prepare(state: LoopState, prompt_ids, row: int, max_tokens: Optional[int], seed: int, spec: SpecConfig,
            vocab_size: int, sampling: Optional[sampling_ops.SamplingParams] = None) -> Prepared:
    """The host's part of an admission: the checks (a ValueError of one line says what is wrong with this prompt)
    and the padded prompt. Nothing here touches the device."""
    prompt = validate_tokens(np.asarray(prompt_ids), vocab_size, "prompt_ids")
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError("prompt_ids must be one non-empty prompt")
    n, max_len = prompt.size, state.cache.max_len
    if n > max_len:
        raise ValueError(f"a prompt of {n} tokens does not fit the batch's {max_len} positions per sequence")
    max_new = state.out.shape[1] - state.accepted_hist.shape[0]
    max_tokens = max_new if max_tokens is None else int(max_tokens)
    if not 1 <= max_tokens <= max_new:
        raise ValueError(f"max_tokens must be in [1, {max_new}] (the loop's max_new_tokens); got {max_tokens}")
    ids = np.zeros((prompt_bucket(n, max_len),), np.int32)
    ids[:n] = prompt
    p = sampling or sampling_ops.SamplingParams()
    if (p.sampled and not spec.sampled) or (p.penalised and not spec.penalties):
        raise ValueError(f"this loop was compiled without {'sampling' if p.sampled and not spec.sampled else 'penalties'}"
                         " (SpecConfig.sampled / penalties); the request's settings need it")
    ints = np.array([n, row, max_tokens, seed & 0x7FFFFFFF, p.top_k], np.int32)
    floats = np.array([p.temperature, p.top_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty],
                      np.float32)
    return Prepared(ids, ints, floats)


def admit_with_plan(leaves, plan: AdmitPlan, state: LoopState, prompt_ids, row: int, max_tokens: Optional[int],
                seed: int, spec: SpecConfig, vocab_size: int, sampling: Optional[sampling_ops.SamplingParams] = None):
    """The host's part of an admission (`prepare`), then one dispatch of `_admit`."""
    p = prepare(state, prompt_ids, row, max_tokens, seed, spec, vocab_size, sampling)
    return _admit(leaves, state, p.ids[None], p.ints, p.floats, plan=plan)


# Several prompts admitted at once ----------------------------------------------------------------------------------
# When several prompts wait and rows are free (the server under a burst), admitting them one program each runs k
# prefills of one row: k dispatches of the host, and on a device that a short prompt leaves mostly idle, k times the
# time of one. `_admit_group` prefills k prompts of one bucket together in a k-row pool and adopts each into its own
# batch row, in one dispatch. Each row's prefill reads only its own pool row, so its tokens are the ones it gets
# alone (the same first token, sampled from its own stream). One program per (k, bucket): the caller keeps the set of
# k small (the server: 1 / 4 / 16).


@functools.partial(jax.jit, static_argnames=("plan",), donate_argnames=("state",))
def _admit_group(leaves, state: LoopState, ids, ints, floats, *, plan: AdmitPlan):
    """k admissions, one program (per plan, k and prompt bucket): ids [k, bucket], ints [k, 5], floats [k, 5] (a
    `Prepared` each; the rows distinct). The state's policy (an adaptive loop's) is not an input: the caller keeps
    its own (`admit_group`). -> (the state, the first tokens [k])."""
    _TRACES["admit_group"] = _TRACES.get("admit_group", 0) + 1
    target, drafter = jax.tree.unflatten(plan.structure, leaves)
    fresh, dcache, first, settings, keys, counts = _prefill_rows(target, drafter, ids, ints, floats, plan,
                                                                 state.cache.pages.dtype)

    def adopt(i, st):
        # Row i of the k-row pool seen as a one-row pool (its slot table row, its length; the pages shared).
        one = lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=0, keepdims=True)  # noqa: E731
        pool = fresh._replace(slot_table=one(fresh.slot_table), seq_lens=one(fresh.seq_lens))
        context = None if dcache is None else DrafterCache(
            jax.lax.dynamic_index_in_dim(dcache.k, i, axis=1, keepdims=True),
            jax.lax.dynamic_index_in_dim(dcache.v, i, axis=1, keepdims=True), one(dcache.lens))
        return _adopt_row_state(st, pool, context, ints[i, 1], one(first), ints[i, 2],
                                sampling_ops.RowSampling(*(one(x) for x in settings)), keys[i],
                                None if counts is None else one(counts))

    state = jax.lax.fori_loop(0, ids.shape[0], adopt, state)
    if plan.mesh is not None:  # as in _admit
        state = jax.lax.with_sharding_constraint(state, NamedSharding(plan.mesh, PartitionSpec()))
    return state, first


def admit_group(leaves, plan: AdmitPlan, state: LoopState, prepared: list, program=None):
    """Admit `prepared` (a `Prepared` each, of one prompt bucket, distinct rows) in one dispatch of `_admit_group`
    (or of `program`, its ahead-of-time compile for these shapes). -> (the state, the first tokens [k] on the device).

    The state's policy goes around the program, so the state that comes back holds the very policy arrays it was
    given: an adaptive ChunkedLoop knows the state that way (ChunkedLoop._record: the policy's `force`) and its next
    call continues the chain of calls without waiting for the device."""
    buckets = {p.ids.size for p in prepared}
    if len(buckets) != 1:
        raise ValueError(f"an admission group is of one prompt bucket; got buckets {sorted(buckets)}")
    rows = [int(p.ints[1]) for p in prepared]
    if len(set(rows)) != len(rows):
        raise ValueError(f"an admission group's rows must be distinct; got {rows}")
    ids = np.stack([p.ids for p in prepared])
    ints = np.stack([p.ints for p in prepared])
    floats = np.stack([p.floats for p in prepared])
    policy = state.policy
    run = program if program is not None else functools.partial(_admit_group, plan=plan)
    new, first = run(leaves, state._replace(policy=None), ids, ints, floats)
    return new._replace(policy=policy), first


def lower_group(leaves, plan: AdmitPlan, state: LoopState, k: int, bucket: int):
    """`_admit_group` lowered for k prompts of this bucket (state: the batch's, for its shapes)."""
    ids = jax.ShapeDtypeStruct((k, bucket), jnp.int32)
    ints = jax.ShapeDtypeStruct((k, 5), jnp.int32)
    floats = jax.ShapeDtypeStruct((k, 5), jnp.float32)
    return _admit_group.lower(leaves, state._replace(policy=None), ids, ints, floats, plan=plan)


def admit_row(target: Transformer, drafter: Optional[Drafter], state: LoopState, row: int, prompt_ids, *,
              spec: SpecConfig, max_tokens: Optional[int] = None, seed: int = 0,
              chunk_size: int = PREFILL_CHUNK, sampling: Optional[sampling_ops.SamplingParams] = None
              ) -> tuple[LoopState, jnp.ndarray]:
    """Batch row `row` takes a new prompt between chunks, in one dispatch of one compiled program (per prompt
    bucket); the state is donated. -> (the state, the first token [1] int32, on the device).

    The prompt is prefilled alone in a one-row pool padded to `prompt_bucket` (in chunks of chunk_size), the
    drafter's context built over it, its first token picked with `sampling` (the row's settings from now on; default
    greedy) from a random stream of the row's own, from `seed`, and the row's old sequence dropped (its KV slots back
    to the pool, its drafter context and output cleared); the prompt's latent rows are copied into slots popped from the batch's pool, its drafter context
    copied, and its first token becomes the row's bonus and first output; the row is active unless that token is a
    stop id. A pool that runs short sets the state's overflow flag. max_tokens: the row stops after this many
    tokens, the first included (default: the out buffer's max_new_tokens); its output then sits at
    out[row, max_new - max_tokens:]. drafter: the one the loop runs (None when autoregressive). Nothing here reads
    the device: the work queues behind the chunk in flight. Other rows go on untouched, no shape changes, nothing
    compiles after the first admission of a bucket. `ChunkedLoop.admit` is the same with the models flattened once
    (this flattens them at every call: ~1 ms of host time)."""
    leaves, structure = jax.tree.flatten((target, drafter))
    plan = AdmitPlan(structure, drafter.target_layer_ids if drafter is not None else (), spec, chunk_size,
                      getattr(target, "mesh", None))
    return admit_with_plan(leaves, plan, state, prompt_ids, row, max_tokens, seed, spec, target.cfg.vocab_size,
                           sampling)


def replace_row(target: Transformer, drafter: Optional[Drafter], state: LoopState, row: int, prompt_ids, *,
                spec: SpecConfig, chunk_size: int = PREFILL_CHUNK, seed: int = 0) -> LoopState:
    """A new prompt in batch row `row` between chunks (the row's old sequence is dropped): `admit_row`, after
    checking that the row exists and that the prompt, spec.max_new_tokens and a verify tree fit the pool's rows.
    drafter: the one the loop runs (None when autoregressive). No compile after the first."""
    cache = state.cache
    prompt = np.asarray(prompt_ids)
    if not 0 <= row < cache.batch:
        raise ValueError(f"row must be in [0, {cache.batch}); got {row}")
    depth = drafter.cfg.depth if drafter is not None else 0
    nodes = (1 if drafter is None else spec.budget + 1 if spec.tree == "ddtree" else depth + 1 if spec.tree == "chain"
             else trees.static_tree_structure(tuple(spec.tree))[0].shape[0])
    if prompt.size + spec.max_new_tokens + nodes + depth + 1 > cache.max_len:
        raise ValueError(f"a prompt of {prompt.size} tokens and {spec.max_new_tokens} new ones do not fit the "
                         f"batch's {cache.max_len} positions per sequence")
    state, _ = admit_row(target, drafter, state, row, prompt, spec=spec, seed=seed, chunk_size=chunk_size)
    return state
