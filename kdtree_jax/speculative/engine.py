"""DDTree speculative decoding: the whole decode in one jitted `lax.while_loop`.

One step, all on device (DESIGN.md, "Data flow of one speculative step"):

    drafter(block [bonus, MASK...], cached target features) -> per-depth top-K log-probs
    -> draft tree (DDTree best-first / chain / static shape) -> T slots allocated and placed
    -> target verify forward over the T nodes (tree mask, rope at start + depth)
    -> acceptance walk (greedy or sampled) -> commit the accepted path's slots, free the rest
    -> the accepted nodes' hidden states extend the drafter's context -> emit tokens.

Invariant between steps: the target cache holds every committed token except the last one (the
"bonus"), which sits at position `seq_lens` and becomes the next tree's root. The drafter's context
holds the target features of the same positions.

budget 0 is plain autoregressive decoding through the same loop (a root-only tree, no drafter pass).

This module holds the loop, its state and `generate`; beside it: validation.py (the arguments and the memory a call
needs), admission.py (a new prompt in a batch row between chunks), stats.py (what `generate` reports).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
import warnings
from typing import NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import kv_pool, profiling, runtime
from kdtree_jax.decode import prefill
from kdtree_jax.ops.argmax import argmax_last
from kdtree_jax.kv_pool import KVCache
from kdtree_jax.model.drafter import Drafter, DrafterCache
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.sharding import replicate
from kdtree_jax.speculative import admission, budget_policy, validation
from kdtree_jax.speculative import cost_model as cost_models
from kdtree_jax.speculative import sampling as sampling_ops
from kdtree_jax.speculative.stats import generate_stats
from kdtree_jax.speculative.step import (ExpertLoad, LoopState, PendingContext, SpecConfig, TreeShape,
                                         flush_pending, pending_capacity, speculative_step)

@dataclasses.dataclass
class GenerateResult:
    tokens: list  # per sequence, the generated token ids (prompt excluded, stop token included)
    stats: dict



@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def decode_loop(target: Transformer, drafter: Optional[Drafter], state: LoopState, spec: SpecConfig) -> LoopState:
    """Speculative steps until every sequence is done; one compiled program, no host round trip. (The adaptive budget
    runs in ChunkedLoop, which picks each chunk's menu entry.)"""
    if spec.menu:
        raise ValueError("the adaptive budget (a menu) decodes in ChunkedLoop (chunk_steps > 0), which picks each "
                         "chunk's budget")
    max_steps = spec.max_new_tokens  # each step emits >= 1 token per active sequence

    def cond(s: LoopState):
        return (s.step < max_steps) & s.active.any()

    # Weights derived from the parameters are computed here, once: inside the body XLA would redo them at
    # every step (it does not hoist the layout copies it adds after its loop-invariant code motion).
    loop_weights = target.loop_weights()
    return jax.lax.while_loop(cond, lambda s: speculative_step(target, drafter, s, spec, loop_weights), state)


# The device-resident loop, k steps per host iteration --------------------------------------------------------------
# `decode_loop` runs the whole decode in one call: nothing reaches the host until every sequence is done. The chunked
# loop runs at most k steps per call (a `lax.while_loop` bounded by k and by "all done") and hands the host the
# tokens those steps emitted, so output can stream and a batch row can be replaced between chunks. The state never
# leaves the device: each call donates it and returns it with the same shapes, so every chunk reuses one compiled
# program. The host keeps one chunk in flight: it enqueues chunk i + 1 before it reads chunk i's tokens, so its
# work (the read, the callbacks, detokenising) overlaps the device's, and what a chunk costs beyond its steps is the
# program boundary (the loop's exit, the token window's gather, the next launch: tens of microseconds on a GPU).
#
# How many steps a chunk: the host's work for a call must stay shorter than the chunk's device time, or the GPU waits.
# That work is mostly the dispatch of the chunk's program, which on the H200 takes 1.3-2.2 ms of host time for a fixed
# budget's program and 2.9-3.3 ms for an adaptive entry's (XLA's launch of the executable, not our Python;
# benchmarks/results/history/adaptive_overhead_h200_9874fc3.md), plus the read of the tokens. The cheapest step we
# run is the default pair's autoregressive step (~0.24 ms at B = 1), so 8 steps are ~2 ms of device time: about even.
# 32 steps a chunk were tried on the GPU (4734c0b / 9874fc3, benchmarks/results/history/budget_sweep_h200_9874fc3.md):
# the fixed programs moved by -1% to +10% (B = 1) and the adaptive budget's static batches lost (greedy B = 16: auto
# 0.50x AR against 0.89x at 8 steps, 302049e), so 8 stays. Continuous batching (the server, --refill) takes half: a row
# that finishes waits for its chunk's end before the next request takes it. A larger chunk only delays the stream; it
# never changes tokens. On a GPU the steps inside a chunk stay device-resident only when XLA captures the while loop in
# a command buffer (a CUDA graph with conditional nodes); otherwise XLA copies its predicate to the host every
# iteration: `kdtree_jax.runtime.configure()` sets that up (docs/usage.md, "Device-resident loop").
DEFAULT_CHUNK_STEPS = 8


def default_chunk_steps(continuous: bool = False) -> int:
    """Steps a chunk (the comment above): DEFAULT_CHUNK_STEPS, half of it for continuous batching (`continuous`: rows
    refilled between chunks, the server's 4)."""
    return max(DEFAULT_CHUNK_STEPS // 2, 1) if continuous else DEFAULT_CHUNK_STEPS


_TRACES: dict = {}  # name -> times traced (each trace is a compile); tests check a row's replacement adds none


class ChunkOutput(NamedTuple):
    """What one call of the chunked loop returns (all on device until the host reads it)."""

    state: LoopState  # the loop's state after the chunk (pass it to the next call)
    tokens: jnp.ndarray  # [B, k * (D + 1)] tokens the chunk emitted per sequence, -1 padding
    start: jnp.ndarray  # [B] state.num_out before the chunk: tokens[b, i] is output position start[b] + i
    num_out: jnp.ndarray  # [B] state.num_out after it
    any_active: jnp.ndarray  # [] bool: some sequence is still decoding
    active: jnp.ndarray  # [B] bool: which are (a row that is not is done: free for the next prompt, ChunkedLoop.admit)
    next_entry: Optional[jnp.ndarray] = None  # [] int32 an adaptive loop's menu entry for the next chunk (else None)


@jax.jit
def _loop_weights(target: Transformer):
    return target.loop_weights()


@functools.partial(jax.jit, static_argnames=("structure", "spec", "steps", "entry"), donate_argnames=("state",))
def _decode_chunk(leaves, loop_weights, state: LoopState, *, structure, spec: SpecConfig, steps: int,
                  entry: Optional[int] = None) -> ChunkOutput:
    # The models come in as their leaves (flattened once by ChunkedLoop): flattening two NNX modules costs ~1 ms
    # of host time a call, unflattening them here costs nothing at run time (it happens while tracing).
    _TRACES["decode_chunk"] = _TRACES.get("decode_chunk", 0) + 1
    target, drafter = jax.tree.unflatten(structure, leaves)
    if spec.menu:  # PolicyState.endless: a calibration's timing run
        endless = state.policy.endless
        state = state._replace(num_out=jnp.where(endless, 0, state.num_out), active=state.active | endless)
    start, stop_step = state.num_out, state.step + steps

    def cond(s: LoopState):
        return (s.step < stop_step) & s.active.any()

    state = jax.lax.while_loop(cond, lambda s: speculative_step(target, drafter, s, spec, loop_weights, entry), state)
    if spec.menu and not budget_policy.is_speculative(spec.menu, entry):
        # The features this chunk's autoregressive steps left in the ring, once a chunk and after its loop, so every
        # chunk starts with the ring empty (a drafting chunk extends the drafter's cache itself). Before the loop,
        # the flush cost every adaptive call ~1.6 ms of host time on the CPU (2.1 against 0.5 ms a call, default pair,
        # B = 2) and ~2.5 ms on the H200 (adaptive_overhead_h200_97c14ed): the call waited for it.
        state = flush_pending(drafter, state)
    width = state.accepted_hist.shape[0]
    index = start[:, None] + jnp.arange(steps * width, dtype=jnp.int32)[None, :]
    tokens = jnp.take_along_axis(state.out, jnp.minimum(index, state.out.shape[1] - 1), axis=1)
    tokens = jnp.where(index < state.num_out[:, None], tokens, -1)
    following = None
    if spec.menu:
        with jax.named_scope("policy"):
            context = budget_policy.mean_context(state.cache.seq_lens, state.active)
            state = state._replace(policy=budget_policy.end_of_chunk(state.policy, spec.menu, entry, context))
            following = budget_policy.next_entry(state.policy, spec.menu, context, steps, _remaining(state),
                                                 state.active, current=entry)
    if getattr(target, "mesh", None) is not None:  # replicated, as setup and admission place it: left to XLA,
        # the penalties' token counts come out split by vocabulary, and this program's next call would refuse them
        state = jax.lax.with_sharding_constraint(state, jax.sharding.NamedSharding(target.mesh,
                                                                                   jax.sharding.PartitionSpec()))
    return ChunkOutput(state, tokens, start, state.num_out, state.active.any(), state.active, following)


def output_limit(state: LoopState) -> int:
    """The output count at which a row stops: out's width less the loop's (static)."""
    return state.out.shape[1] - state.accepted_hist.shape[0]


def _remaining(state: LoopState):
    """[B] tokens each row may still emit."""
    return output_limit(state) - state.num_out


def compile_programs(build, keys) -> dict:
    """{key: build(key)} over `keys`: an adaptive loop's chunk program per menu entry, the server's row and admission
    programs. In parallel threads on a CPU (XLA compiles outside the GIL), one at a time on a GPU: there XLA times
    candidate kernels on the device while it compiles (autotuning), and a program compiled beside others came out
    slower. On the H100 at a3b364e the autoregressive program at batch 64 decoded 152,730 tok/s compiled 8 at a time
    against 174,232 compiled alone (budget_sweep.py --precompile-threads 8 / 1, each with its own compilation cache,
    5 passes; history/adaptive_session30_h100.md), as at 1ee1b64 in two cells (168-173k against 196-203k at B = 64,
    34-35k against 39.5-41k at T = 0.7, B = 16)."""
    keys = list(keys)
    if len(keys) <= 1 or jax.default_backend() == "gpu":
        return {key: build(key) for key in keys}
    with concurrent.futures.ThreadPoolExecutor(min(len(keys), os.cpu_count() or 1)) as pool:
        return dict(zip(keys, pool.map(build, keys)))


@functools.partial(jax.jit, static_argnames=("menu", "steps", "limit"))
def _first_entry(policy, seq_lens, active, num_out, *, menu, steps, limit):
    # The few arrays the pick reads, not the whole state: a call's host time grows with its arguments.
    return budget_policy.next_entry(policy, menu, budget_policy.mean_context(seq_lens, active), steps,
                                    limit - num_out, active)


def _entry_of_state(state: LoopState, *, menu, steps) -> int:
    """The entry a state's own policy picks for its next chunk (the host waits for it)."""
    return int(_first_entry(state.policy, state.cache.seq_lens, state.active, state.num_out, menu=menu, steps=steps,
                            limit=output_limit(state)))


def first_entry(state: LoopState, spec: SpecConfig, costs: dict, steps: int, *, makespan: bool) -> int:
    """The entry an adaptive loop's first chunk on `state` runs when its policy is fresh from `costs` (as `with_costs`
    makes it; makespan: a static batch), computed with the CPU as JAX's default device from the numbers the host
    already has, the same function as the device's pick (`_first_entry`). On the H100 at e556a92, picking on the GPU
    while the host waited cost ~1 ms of every adaptive generate call (benchmarks/adaptive_gap.py, B = 1 and 16)."""
    seq_lens, active, num_out = jax.device_get((state.cache.seq_lens, state.active, state.num_out))
    try:
        where = jax.default_device(jax.devices("cpu")[0])
    except RuntimeError:  # no CPU backend in this process (JAX_PLATFORMS): the default device picks
        where = contextlib.nullcontext()
    with where:
        policy = budget_policy.init_state(spec.menu, batch=state.bonus.shape[0], makespan=makespan, **costs)
        return int(_first_entry(policy, seq_lens, active, num_out, menu=spec.menu, steps=steps,
                                limit=output_limit(state)))


class _Call:
    """An adaptive ChunkedLoop's record of a call (or of admit / reset_rows between calls). Mutable only to cache the
    pick once read: a call's host work is what an adaptive chunk pays over a fixed one (at batch 1 on a GPU the host's
    ~1.5 ms a call is most of an 8-step chunk's device time), so the record keeps what later calls look up."""

    __slots__ = ("force", "chain", "entry", "next_entry", "key", "pick")

    def __init__(self, force, chain, entry: int, next_entry, key: int):
        self.force = force  # the output state's policy.force: the array object that identifies that state
        self.chain = chain  # the chain of calls it continues (one decode, one server bucket)
        self.entry = entry  # the entry it ran (admit / reset_rows: the entry of the call before)
        self.next_entry = next_entry  # ChunkOutput.next_entry (admit / reset_rows: None)
        self.key = key  # the id of the state's _shapes (a program's output has its input's)
        self.pick = None  # int(next_entry), once read


def _shapes(state: LoopState) -> tuple:
    """What selects a state's compiled programs (read on every call: no string of the whole tree, ~0.15 ms a call)."""
    leaves, structure = jax.tree.flatten(state)
    return structure, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


class ChunkedLoop:
    """The decode loop as chunks of at most `steps` steps, one compiled program for every chunk.

        loop = ChunkedLoop(target, drafter, spec, steps=8)
        out = loop(state)            # one chunk (asynchronous): ChunkOutput
        state = out.state            # donated by the next call; loop.admit / reset_rows work on it in between
        final, chunks = loop.run(state, on_chunk)   # chunks until every sequence is done, one chunk in flight

    drafter: None for autoregressive decoding (a root-only tree).

    The adaptive budget (spec.menu) is one program per menu entry (budget_policy.py): each chunk ends with the entry
    its policy picks for the next one (ChunkOutput.next_entry), and a call runs the entry of the newest such pick the
    host can read without waiting: its input's own when that chunk is done, else the one before it in the same chain
    of calls (the chunk in flight's input's). A state that comes from no call of this loop (a new batch, a
    calibration's forced copy) picks its entry from its own policy.
    """

    def __init__(self, target: Transformer, drafter: Optional[Drafter], spec: SpecConfig,
                 steps: int = DEFAULT_CHUNK_STEPS, loop_weights=None):
        """loop_weights: the target's `loop_weights()` when the caller has them (another loop of the same target:
        `chunked_loop` shares them, as they can be a copy of every expert's weights)."""
        if steps < 1:
            raise ValueError(f"chunk steps must be >= 1; got {steps}")
        self.spec, self.steps = spec, int(steps)
        self.leaves, self.structure = jax.tree.flatten((target, drafter))
        # Once, not per chunk (nor per step: see decode_loop).
        self.loop_weights = _loop_weights(target) if loop_weights is None else loop_weights
        self.compiled = None
        self._programs = {}  # (the id of the state's shapes, entry) -> Compiled
        self._keys = {}  # the state's _shapes -> its id (hashing the shapes costs ~30 us: once per chain of calls)
        self._recent = []  # an adaptive loop's last calls (_Call), newest last
        # What admit's program needs besides the leaves; its static plan per prefill chunk size.
        self.vocab_size, self.mesh = target.cfg.vocab_size, getattr(target, "mesh", None)
        self.hidden_layers = tuple(drafter.target_layer_ids) if drafter is not None else ()
        self._plans = {}

    def _kwargs(self, entry=None):
        return dict(structure=self.structure, spec=self.spec, steps=self.steps, entry=entry)

    def entries(self) -> tuple:
        """The programs' static entries: every menu entry that drafts, then len(menu) (autoregressive); (None,) for a
        fixed budget."""
        if not self.spec.menu:
            return (None,)
        menu = self.spec.menu
        return tuple(i for i in range(len(menu)) if budget_policy.is_speculative(menu, i)) + (len(menu),)

    def lower(self, state: LoopState, entry=None):
        return _decode_chunk.lower(self.leaves, self.loop_weights, state, **self._kwargs(entry))

    def compile(self, state: LoopState):
        """Compile the chunk program(s) ahead (an adaptive loop: one per entry, in threads); later calls run them (jax's
        own cache would compile again on the first jitted call: an ahead-of-time compile does not fill it): -> the jax
        Compiled a call on this state runs (an adaptive loop: where no call or `begin` has picked its entry, the
        autoregressive entry's: the pick waits for the device, `program(state)` does that)."""
        if self.spec.menu:
            capacity = state.pending.hidden.shape[2]
            logged = state.policy.log_path.shape[0]
            if min(capacity, logged) < self.steps:
                raise ValueError(f"the adaptive loop's pending ring and step log hold {capacity} and {logged} rows, "
                                 f"fewer than a chunk's {self.steps} steps (engine.adaptive_parts(chunk_steps=...))")
        key = self._key(_shapes(state))
        missing = [e for e in self.entries() if (key, e) not in self._programs]

        built = compile_programs(lambda entry: self.lower(state, entry).compile(), missing)
        self._programs.update({(key, e): program for e, program in built.items()})
        entry = None
        if self.spec.menu:
            known = self._record(state)
            entry = self._entry_for(state, known)[0] if known is not None else len(self.spec.menu)
        self.compiled = self._programs[(key, entry)]
        return self.compiled

    def _key(self, shapes: tuple) -> int:
        return self._keys.setdefault(shapes, len(self._keys))

    def runs(self, leaves: list, structure, spec: SpecConfig, steps: int) -> bool:
        """Whether this loop runs these models (the very same arrays: their flattened (target, drafter), flattened once
        by the caller, as that costs ~1 ms for two NNX modules) with these settings."""
        return (structure == self.structure and spec == self.spec and steps == self.steps
                and len(leaves) == len(self.leaves) and all(a is b for a, b in zip(leaves, self.leaves)))

    def runs_target(self, target_leaves: list) -> bool:
        """Whether this loop's target is the one with these leaves (the very same arrays): (target, drafter) flattens
        the target's leaves first."""
        return len(target_leaves) <= len(self.leaves) and all(a is b for a, b in zip(target_leaves, self.leaves))

    def _record(self, state: LoopState) -> Optional[_Call]:
        """This loop's record of the call whose output `state` is (or that admit / reset_rows made it from), or None."""
        return next((r for r in reversed(self._recent) if r.force is state.policy.force), None)

    def _remember(self, call: _Call):
        self._recent.append(call)
        if len(self._recent) > 8:
            del self._recent[0]

    def _entry_for(self, state: LoopState, known: Optional[_Call] = None) -> tuple:
        """(the entry a call on `state` runs, the chain of calls it continues) (class docstring); known: its
        `_record`."""
        known = known or self._record(state)
        if known is None:  # a state of no call of this loop: its own policy decides (it waits for the state)
            return _entry_of_state(state, menu=self.spec.menu, steps=self.steps), object()
        for r in reversed(self._recent):
            if r.chain is not known.chain or r.next_entry is None:
                continue
            if r.pick is None:
                if not r.next_entry.is_ready():
                    continue
                r.pick = int(r.next_entry)
            return r.pick, known.chain
        return known.entry, known.chain  # nothing of the chain done yet: the entry the chunk in flight runs

    def begin(self, state: LoopState, entry: int) -> LoopState:
        """`state` (of no call of this loop) starts with menu entry `entry`, which the caller picked (`first_entry`):
        its first call runs that entry without waiting for the state's own pick on the device. -> state."""
        key = self._key(_shapes(state))
        if (key, len(self.spec.menu)) not in self._programs:
            self.compile(state)
        self._remember(_Call(state.policy.force, object(), int(entry), None, key))
        return state

    def _carried(self, old: LoopState, new: LoopState) -> LoopState:
        """`new` (made from `old` between chunks) continues `old`'s chain of calls."""
        if self.spec.menu and (known := self._record(old)) is not None:
            self._remember(_Call(new.policy.force, known.chain, known.entry, None, known.key))
        return new

    def program(self, state: LoopState):
        """The jax Compiled that a call on `state` runs (compiled here if it is not yet), e.g. to profile it."""
        if not self.spec.menu:
            return self.compiled if self.compiled is not None else self.compile(state)
        key, entry, _ = self._pick(state)
        return self._programs[(key, entry)]

    def _pick(self, state: LoopState) -> tuple:
        """An adaptive loop's (the id of the state's shapes, the entry a call on it runs, its chain of calls), its
        programs compiled if they are not yet (a state this loop made has them: its input's)."""
        known = self._record(state)
        if known is not None:
            key = known.key
        else:  # the state's flattening and the shapes' hash: ~0.2 ms, once per chain
            key = self._key(_shapes(state))
            if (key, len(self.spec.menu)) not in self._programs:
                self.compile(state)
        entry, chain = self._entry_for(state, known)
        return key, entry, chain

    def __call__(self, state: LoopState) -> ChunkOutput:
        if not self.spec.menu:
            if self.compiled is not None:
                return self.compiled(self.leaves, self.loop_weights, state)
            return _decode_chunk(self.leaves, self.loop_weights, state, **self._kwargs())
        return self.call_entry(state, lambda key, entry: self._programs[(key, entry)](self.leaves, self.loop_weights,
                                                                                       state))

    def call_entry(self, state: LoopState, run) -> ChunkOutput:
        """An adaptive loop's call: run(the id of the state's shapes, the menu entry the call runs) -> its ChunkOutput
        (one of this loop's programs, or another program of that entry on the same state: serve/programs.py's lone
        row), recorded so that the next call continues its chain and runs the entry it picks."""
        key, entry, chain = self._pick(state)
        out = run(key, entry)
        # The pick's copy to the host is enqueued behind the chunk now, so that the call that reads it (a later one,
        # once it is ready) finds it on the host: a read that starts the copy itself may wait for the chunk in flight.
        out.next_entry.copy_to_host_async()
        self._remember(_Call(out.state.policy.force, chain, entry, out.next_entry, key))
        return out

    def reset_rows(self, state: LoopState, rows) -> LoopState:
        """`admission.reset_rows` of these batch rows (their slots back to the pool, the rows free), one dispatch,
        keeping an adaptive loop's chain."""
        which = np.zeros(state.bonus.shape[0], bool)
        which[list(rows)] = True
        return self._carried(state, admission.reset_rows(state, which))

    def reset_row(self, state: LoopState, row: int) -> LoopState:
        return self.reset_rows(state, [row])

    def admit(self, state: LoopState, prompt_ids, row: int, *, max_tokens: Optional[int] = None, seed: int = 0,
              sampling: Optional[sampling_ops.SamplingParams] = None,
              chunk_size: int = admission.PREFILL_CHUNK) -> tuple[LoopState, jnp.ndarray]:
        """`admission.admit_row` with this loop's models and settings, flattened once: a new prompt in batch row `row`
        between chunks, one host dispatch of one compiled program. -> (the state, the first token [1] on device)."""
        plan = self._plans.get(chunk_size)
        if plan is None:
            plan = self._plans[chunk_size] = admission.AdmitPlan(self.structure, self.hidden_layers, self.spec,
                                                                 chunk_size, self.mesh)
        new, first = admission.admit_with_plan(self.leaves, plan, state, prompt_ids, row, max_tokens, seed, self.spec,
                                               self.vocab_size, sampling)
        return self._carried(state, new), first

    def run(self, state: LoopState, on_chunk=None, max_chunks: Optional[int] = None):
        """Chunks until no sequence is active: -> (final state, chunks the host read).

        on_chunk(tokens [B, k*(D+1)], start [B], num_out [B]) (numpy) after each chunk, while the next one runs; it
        may return batch rows to end (they stop after the chunk in flight).
        The host enqueues chunk i + 1 before it reads chunk i; the chunk after the last one finds nothing active
        and runs no step."""
        current = self(state)
        chunks = 0
        while True:
            following = self(current.state)  # enqueued behind `current`: the device never waits for the host
            tokens, start, num_out, more = jax.device_get(
                (current.tokens, current.start, current.num_out, current.any_active))
            chunks += 1
            finished = on_chunk(tokens, start, num_out) if on_chunk is not None else None
            current = following
            if finished:  # rows the host ended (a stop string): inactive from the chunk after the one in flight
                current = current._replace(state=admission.deactivate(current.state, finished))
            if not more:
                return current.state, chunks
            if max_chunks is not None and chunks >= max_chunks:
                raise RuntimeError(f"the decode loop did not finish within {max_chunks} chunks")


@jax.jit
def _extend_drafter(drafter: Drafter, dcache: DrafterCache, hidden, num_new):
    return drafter.extend_context(dcache, hidden, num_new)


@functools.partial(jax.jit, static_argnames="sampled")
def _first_tokens(last_logits, rows: sampling_ops.RowSampling, keys, counts, *, sampled: bool):
    """(each prompt's first token: its row's settings (sampling.first_tokens), the argmax in a greedy program; the
    token counts with it, None without penalties). One program: run op by op, a sampled first token's ~100 operations
    took ~2 s of the CLI's prefill on the 2-core CPU, each a small compile in a new process."""
    if sampled:
        first = sampling_ops.first_tokens(last_logits, rows, keys, counts)
    else:
        first = argmax_last(sampling_ops.penalize(last_logits, counts, rows) if counts is not None else last_logits)
    return first, (sampling_ops.add_tokens(counts, first[:, None]) if counts is not None else None)


def initial_state(cache: KVCache, dcache: Optional[DrafterCache], first_tokens, *, max_new_tokens: int, width: int,
                  stop_ids, key, expert_load: ExpertLoad, active=None,
                  adaptive: Optional[tuple] = None, sampling: Optional[sampling_ops.RowSampling] = None,
                  counts=None) -> LoopState:
    """The decode loop's starting state (the public way to build a LoopState, for `decode_loop`).

    cache: the target's pool after the prompts (the first token not yet in it); dcache: the drafter's
    context over the same positions (None without a drafter); first_tokens [B]: each sequence's first
    generated token (the first tree's root), already emitted; width: D + 1 (tokens a step can emit; 1
    without a drafter); stop_ids [S] int32 (-1 padding); active [B] bool (default: every sequence);
    adaptive: (PolicyState, PendingContext) for a loop whose SpecConfig has a menu (`adaptive_parts`), else None.
    key: [B] keys, one random stream per row, or one key (row b's stream is then fold_in(key, b)).
    sampling: each row's settings (sampling.RowSampling; default: greedy, no penalties); counts: [B, V] int32 token
    counts of each row's prompt and emitted tokens, for a loop whose SpecConfig has penalties, else None.
    """
    first_tokens = jnp.asarray(first_tokens, jnp.int32)
    batch = first_tokens.shape[0]
    if key.ndim == 0:
        key = jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch))
    if sampling is None:
        sampling = sampling_ops.RowSampling.of([sampling_ops.SamplingParams()] * batch)
    return LoopState(
        cache=cache,
        dcache=dcache,
        bonus=first_tokens,
        out=jnp.full((batch, max_new_tokens + width), -1, jnp.int32).at[:, 0].set(first_tokens),
        num_out=jnp.ones((batch,), jnp.int32),
        active=jnp.ones((batch,), bool) if active is None else jnp.asarray(active, bool),
        step=jnp.zeros((), jnp.int32),
        key=key,
        accepted_hist=jnp.zeros((width,), jnp.int32),
        stop_ids=jnp.asarray(stop_ids, jnp.int32),
        expert_load=expert_load,
        policy=None if adaptive is None else adaptive[0],
        pending=None if adaptive is None else adaptive[1],
        sampling=sampling_ops.RowSampling(*(jnp.asarray(x) for x in sampling)),
        counts=None if counts is None else jnp.asarray(counts, jnp.int32),
    )


def adaptive_parts(target: Transformer, drafter: Drafter, spec: SpecConfig, batch: int,
                   costs: Optional[dict] = None, chunk_steps: int = DEFAULT_CHUNK_STEPS,
                   static_batch: bool = False) -> tuple:
    """The adaptive loop's extra state for `initial_state(adaptive=...)`: (the policy's state with these costs, from
    `CostModel.costs`, or placeholders until `calibrate` measures them; the drafter's pending context, room for a
    chunk of `chunk_steps` autoregressive steps). static_batch: the rows start together and the batch ends with the
    last of them (generate), not rows refilled as they finish (the server): the policy then minimises the time to
    finish them all (budget_policy.next_entry)."""
    policy = budget_policy.init_state(spec.menu, batch=batch, makespan=static_batch,
                                      chunk_steps=pending_capacity(chunk_steps), depth=drafter.cfg.depth,
                                      **(costs or {}))
    pending = PendingContext.zeros(len(drafter.target_layer_ids), batch,
                                   pending_capacity(chunk_steps), target.cfg.hidden_size,
                                   target.dtype)
    return policy, pending


def with_costs(state: LoopState, spec: SpecConfig, costs: dict) -> LoopState:
    """The state with the policy's costs (and acceptance prior) replaced: same shapes, so no compile."""
    counters = state.policy
    steps, _, path = counters.log_path.shape
    fresh = budget_policy.init_state(spec.menu, batch=state.bonus.shape[0], makespan=bool(counters.makespan),
                                     chunk_steps=steps, depth=path - 1, **costs)
    return state._replace(policy=fresh._replace(chosen=counters.chosen, predicted_tokens=counters.predicted_tokens,
                                                observed_tokens=counters.observed_tokens,
                                                sequence_steps=counters.sequence_steps))


def time_calls(call, state: LoopState, calls: int = 1):
    """`calls` chained calls of a compiled decode loop `call` (a ChunkedLoop, or decode_loop's program) on a copy of
    `state`, which is not consumed: -> (ms, steps run, the final state). The copy is on the device before the clock
    starts; reading the final step count ends it."""
    copy = jax.tree.map(jnp.copy, state)
    start = int(copy.step)
    jax.block_until_ready(copy)
    t0 = time.perf_counter()
    out = call(copy)
    for _ in range(calls - 1):
        out = call(out.state)
    final = out.state if isinstance(out, ChunkOutput) else out
    steps = int(final.step) - start
    return (time.perf_counter() - t0) * 1e3, steps, final


def step_ms_between(short, long) -> float:
    """A step's ms from a short and a long run of one program (`time_calls` results): the difference of their times
    over that of their steps, which leaves out what a call costs whatever it runs (its launch, the loop weights, the
    read of the result); the long run's mean where both ran as many steps."""
    if long[1] > short[1]:
        return max((long[0] - short[0]) / (long[1] - short[1]), 1e-6)
    return long[0] / max(long[1], 1)


def decode_ms(loop: "ChunkedLoop", state: LoopState, chunks: int):
    """A step's ms of `loop` decoding from a copy of `state` (not consumed) as ChunkedLoop.run decodes: one chunk in
    flight while the host reads the one before. The clock runs from the first chunk's read to that of the `chunks`-th
    after it, so the launch of the first and the wait for the last stay out, and every gap the host leaves between
    chunks stays in. Each chunk starts with every row active and none of its output used, so that no row runs out of
    tokens to emit (an adaptive loop's program does that, PolicyState.endless; a fixed loop's state gets two new arrays
    a chunk, which on a GPU also times their command buffer's update). -> (ms a step, steps timed, the final state)."""
    def fresh(s: LoopState) -> LoopState:
        if s.policy is not None:  # an adaptive loop does it in the program (PolicyState.endless)
            return s
        return s._replace(num_out=jnp.zeros_like(s.num_out), active=jnp.ones_like(s.active))

    copy = jax.tree.map(jnp.copy, state)
    if copy.policy is not None:
        copy = copy._replace(policy=copy.policy._replace(endless=jnp.ones_like(copy.policy.endless)))
    jax.block_until_ready(copy)
    current = loop(fresh(copy))
    step = jnp.copy(current.state.step)  # the next call donates the state
    following = loop(fresh(current.state))
    jax.device_get(current.num_out)
    first = int(step)
    t0 = time.perf_counter()
    for _ in range(chunks):
        current = following
        step = jnp.copy(current.state.step)
        following = loop(fresh(current.state))
        jax.device_get((current.tokens, current.num_out))
    ms = (time.perf_counter() - t0) * 1e3
    steps = int(step) - first
    final = following.state
    if final.policy is not None:
        final = final._replace(policy=final.policy._replace(endless=jnp.zeros_like(final.policy.endless)))
    jax.block_until_ready(final)
    return ms / max(steps, 1), steps, final


# Chunks timed per entry of the chunked loop (decode_ms). Chained calls timed without the host's reads of each chunk
# (the short / long difference) came out at 0.55-0.84x what the decode paid on the H200 (4af3d85,
# benchmarks/results/history/calibration_check_h200_4af3d85.md): the policy then drafted where AR was faster.
CALIBRATION_CHUNKS = 3


def calibrate(loop: "ChunkedLoop", state: LoopState, spec: SpecConfig, *, depth: int, on_progress=None,
              rows: Optional[int] = None) -> dict:
    """Time every menu entry's program of the adaptive ChunkedLoop `loop`, each on a copy of `state` with the policy
    forced to it: -> a cost_model point (make_point) with the run's acceptance as the prior. The state itself is not
    touched. rows: `loop` is a program of the state's first `rows` rows (the server's lone row, serve/programs.py: any
    callable on the state with a `steps`), and the point is that batch size's. A step's cost is what the decode pays
    for it: chunks run as ChunkedLoop.run runs them (`decode_ms`).
    An entry that cannot beat autoregressive decoding even if every drafted token were accepted
    ((1 + min(b, D)) / its step < 1 / the AR step) ends the sweep: larger budgets cost at least as much; so does one
    whose run, at the acceptance it saw, earned fewer tokens per ms than an autoregressive step and no more than the
    entry before it. Entries not timed cost +inf (never chosen).

    The point's acceptance prior (`expected`, the policy's starting tokens per step per entry) is what each timed entry
    emitted per sequence-step in its own run, not the policy's prediction at the run's end: the prediction is a
    running mean over the last few steps of the last entry timed, and on the H100 at c468e17 (T = 0.7, batch 1) the
    prior it gave closed the gate for a whole call where DDTree 8 ran 1.26x autoregressive decoding
    (history/budget_sweep_h100_c468e17). Entries not timed keep the prediction. `slowest` scales each entry's gain
    (tokens per step less the bonus) by the slowest row's share of the mean row's in the last timed entry's per-row
    predictions: a static batch's prior (budget_policy.init_state)."""
    menu = spec.menu
    base = state._replace(stop_ids=jnp.full_like(state.stop_ids, -1), active=jnp.ones_like(state.active),
                          num_out=jnp.ones_like(state.num_out))

    def forced(entry: int) -> LoopState:
        return base._replace(policy=base.policy._replace(force=jnp.int32(entry)))

    def step_ms(entry: int):
        ms_step, _, final = min((decode_ms(loop, forced(entry), CALIBRATION_CHUNKS) for _ in range(2)),
                                key=lambda r: r[0])
        return ms_step, final

    modes = ["ar"] + [i for i in range(len(menu)) if budget_policy.is_speculative(menu, i)]
    ms, prior, last_rate, observed = {}, None, float("inf"), {}
    decode_ms(loop, forced(len(menu)), 1)  # warm-up (on a GPU, a program's first call warms its command buffer)
    for n, mode in enumerate(modes):
        if on_progress is not None:
            on_progress("calibrate", n, len(modes))
        ms[mode], final = step_ms(len(menu) if mode == "ar" else mode)
        if mode != "ar":
            prior = final.policy
            # Tokens per ms this entry earned in its own run (the run's acceptance): once an entry earns less than
            # an autoregressive step and no more than the entry before it, larger trees (dearer, each extra node
            # less likely) are not timed.
            tau = float(prior.observed_tokens) / max(float(prior.sequence_steps), 1.0)
            observed[mode] = tau
            rate = tau / ms[mode]
            if (1 + min(menu[mode], depth)) / ms[mode] < 1.0 / ms["ar"] or (rate < 1.0 / ms["ar"]
                                                                            and rate <= last_rate):
                break
            last_rate = rate
    # A second round over the entries the first one timed, each keeping its faster step: the first round's entries
    # come in one order, and on the H200 the first of them (autoregressive) came out 30-70% above what the decode paid
    # for it (budget_sweep_h200 at d941d29: a GPU's clocks and caches warm to the work as it starts).
    for mode in list(ms):
        again, _ = step_ms(len(menu) if mode == "ar" else mode)
        ms[mode] = min(ms[mode], again)
    if on_progress is not None:
        on_progress("calibrate", len(modes), len(modes))
    batch = rows or state.bonus.shape[0]
    context = float(budget_policy.mean_context(state.cache.seq_lens[:batch], jnp.ones((batch,), bool)))
    expected = slowest = None
    if prior is not None:
        expected = np.asarray(prior.expected, np.float32).copy()
        for mode, tau in observed.items():
            expected[mode] = tau
        gains = np.asarray(prior.row_expected, np.float32)[:batch] - 1.0  # [B, M]
        share = np.clip(gains.min(0) / np.maximum(gains.mean(0), 1e-6), 0.0, 1.0)
        slowest = 1.0 + (expected - 1.0) * share
    return cost_models.make_point(batch, context, menu, ms, steps=CALIBRATION_CHUNKS * loop.steps,
                                  bin_ratio=None if prior is None else budget_policy.bin_ratio(prior),
                                  expected=expected, slowest=slowest)


def setup(target: Transformer, drafter: Optional[Drafter], req: validation.Request, spec: SpecConfig, *, seed,
           chunk_size: int, kv_dtype, num_moe: int, slots: int, on_progress=None, sampling=None,
           chunk_steps: int = DEFAULT_CHUNK_STEPS):
    """Prefill the prompts and the drafter's context, pick the first tokens: -> (the loop's starting state, the
    drafter the loop runs (None when autoregressive; replicated on a sharded target's mesh), prefill seconds).
    chunk_steps: the chunked loop's steps a call (an adaptive loop's ring holds a chunk's autoregressive steps)."""
    cfg = target.cfg
    batch = len(req.prompts)
    lens = np.array([p.size for p in req.prompts], np.int32)
    chunk = min(chunk_size, validation.round_up(int(lens.max()), 16))
    padded = validation.round_up(int(lens.max()), chunk)
    ids = np.zeros((batch, padded), np.int32)
    for b, p in enumerate(req.prompts):
        ids[b, :p.size] = p
    # Room for the prompt, every new token and one verify tree past the end; bucketed so similar
    # requests share a compiled loop.
    max_len = validation.round_up(padded + spec.max_new_tokens + req.num_nodes + req.depth + 1, 64)

    # One random stream per row: fold_in(key(seed), b) for one seed, key(seed_b) for a seed per prompt.
    keys = (sampling_ops.row_keys(np.asarray(seed) & 0x7FFFFFFF) if np.ndim(seed) else
            sampling_ops.batch_keys(int(seed), batch))
    rows = sampling_ops.RowSampling.of(sampling or [sampling_ops.SamplingParams()] * batch)
    counts = None
    if spec.penalties:  # the prompts' tokens (the zero padding not counted)
        counts = sampling_ops.count_tokens(np.where(np.arange(padded)[None, :] < lens[:, None], ids, -1),
                                           cfg.vocab_size)
    cache = kv_pool.init_cache(cfg, batch, max_len, dtype=kv_dtype or target.dtype)
    mesh = getattr(target, "mesh", None)
    if mesh is not None:  # a sharded target: the pool and the drafter live whole on every device
        cache = replicate(cache, mesh)
        if drafter is not None:
            drafter = replicate(drafter, mesh)

    t0 = time.perf_counter()
    hidden_layers = drafter.target_layer_ids if req.use_drafter else ()
    last_logits, hidden, cache = prefill(target, cache, ids, lens, chunk_size=chunk,
                                         hidden_layers=hidden_layers, impl=spec.impl, on_progress=on_progress)
    dcache = None
    if req.use_drafter:
        dcache = _extend_drafter(drafter, drafter.init_cache(batch, max_len), hidden, jnp.asarray(lens))
    first, counts = _first_tokens(last_logits, rows, keys, counts, sampled=spec.sampled)
    first_np = np.asarray(first)
    t_prefill = time.perf_counter() - t0

    active = ~np.isin(first_np, req.stop) & (spec.max_new_tokens > 1)
    adaptive = None
    if spec.menu and req.use_drafter:
        adaptive = adaptive_parts(target, drafter, spec, batch, chunk_steps=chunk_steps, static_batch=True)
        if mesh is not None:
            adaptive = replicate(adaptive, mesh)
    state = initial_state(cache, dcache, first, max_new_tokens=spec.max_new_tokens,
                          width=(req.depth if req.use_drafter else 0) + 1, stop_ids=req.stop, key=keys,
                          expert_load=ExpertLoad.zeros(num_moe, slots, spec.expert_devices), active=active,
                          adaptive=adaptive, sampling=rows, counts=counts)
    return state, (drafter if req.use_drafter else None), t_prefill


def one_step_left(state: LoopState) -> LoopState:
    """The state with every sequence one step from its token limit, so that a compiled loop runs exactly one step,
    the same work as any (positions come from the caches, not from the output count). Profiles take one step this
    way: where a command buffer replays a captured loop, the trace held the kernels of about one iteration of the
    eight the loop ran (114 a step against the step's ~870, Kimi-K2 rank on an H200, jaxlib 0.11.2, 23f2872)."""
    return state._replace(num_out=jnp.full_like(state.num_out, output_limit(state) - 1))


def _run_loop(target: Transformer, drafter: Optional[Drafter], state: LoopState, spec: SpecConfig, profile: bool,
              chunk_steps: int = 0, on_chunk=None, on_progress=None, prepare=None):
    """Compile the loop ahead (cached by jax for later calls with the same shapes, so tokens/s times decoding
    only), run it, optionally profile one step of it on a copy of the state: -> (final state, compile s, decode s,
    step profile or None, host syncs). chunk_steps 0: the whole decode in one call (`decode_loop`); k: the
    chunked loop (`ChunkedLoop`), on_chunk(tokens, start, num_out) after each chunk. prepare(call, state) -> state,
    after the compile: the adaptive budget's calibration (`_prepare_costs`)."""
    t1 = time.perf_counter()
    if on_progress is not None:
        on_progress("compile", 0, 1)
    if chunk_steps:
        runner = chunked_loop(target, drafter, spec, chunk_steps)
        loop, args = runner.compile(state), (runner.leaves, runner.loop_weights)
        steps_of = lambda out: out.state.step  # noqa: E731 - the profiled call is one chunk
    else:
        loop, args = decode_loop.lower(target, drafter, state, spec=spec).compile(), (target, drafter)
        steps_of = lambda out: out.step  # noqa: E731
    t_compile = time.perf_counter() - t1
    if on_progress is not None:
        on_progress("compile", 1, 1)
    host_loops = _host_driven_loops(loop, (jax.tree.structure((target, drafter)), spec, chunk_steps,
                                           str(jax.tree.map(lambda x: (x.shape, x.dtype), state))))
    if prepare is not None:  # the adaptive budget's costs, measured with these very programs (no compile)
        state = prepare(runner, state)
        loop = runner.program(state)  # the entry its first chunk runs (prepare picked it)
    # The profiled call comes after the timed decode: a trace taken of a replayed CUDA graph left the graph's later
    # replays slower (the timed decode at 2x its step after one, spec_decode at 0ec9d93, H200). Its state is a copy
    # taken now (the loop donates its state).
    profile_state = one_step_left(jax.tree.map(jnp.copy, state)) if profile else None
    t1 = time.perf_counter()
    if chunk_steps:
        final, host_syncs = runner.run(state, on_chunk, max_chunks=-(-spec.max_new_tokens // chunk_steps) + 2)
    else:
        final, host_syncs = loop(*args, state), 1
        if on_chunk is not None:
            on_chunk(*jax.device_get((final.out, jnp.zeros_like(final.num_out), final.num_out)))
    final.num_out.block_until_ready()
    t_decode = time.perf_counter() - t1
    step_profile = None
    if profile:
        # A compiled loop's first call is, on a GPU, XLA's warm-up of its command buffer (its log: "Executing warm up
        # iteration of command buffer thunk"), run thunk by thunk, with the gaps of launches from the host; later calls
        # replay the graph, where the trace holds about one iteration of a captured loop. The timed decode was such a
        # first call at least once, so the profile is of a one-step replay (one_step_left), whose set-up outside the
        # loop counts once a chunk (once a step where one call runs the whole decode, chunk_steps 0).
        step_profile = profiling.profile_call(loop, (*args, profile_state), steps_of=steps_of,
                                              call_steps=chunk_steps or None)
        del profile_state
    kv_pool.check_overflow(final.cache)
    return final, t_compile, t_decode, step_profile, host_syncs, host_loops


# The ChunkedLoops of the last generate (or chunked_loop) calls, the most recent last. Several, so that calls that
# alternate settings (a benchmark's decoders pass after pass, a program's two budgets) each find their own: a new
# loop compiles again (or reads its programs back from the compilation cache), and on a GPU a new executable's first
# calls record its command buffers (2.4-2.9 ms the first call, ~1 ms the second, H100 at 80c0990,
# history/serve_dispatch_h100_80c0990_default.json), inside the decode's time.
_LOOPS: list = []
LOOPS_KEPT = 8


def chunked_loop(target: Transformer, drafter: Optional[Drafter], spec: SpecConfig, steps: int) -> ChunkedLoop:
    """A ChunkedLoop of one of the last LOOPS_KEPT calls (generate's, or this function's) that runs these very models
    and settings, else a new one that replaces the oldest. Reusing it reuses its loop weights and its programs
    compiled ahead (`ChunkedLoop.compile`: jax caches no ahead-of-time compile, and a fresh ChunkedLoop would also
    recompute the weights and run a new program object, ~10 ms of a CPU decode). Loops are kept for one target at a
    time: a new loop of another target drops the others (they hold their models' arrays), and a new loop of the kept
    target shares its loop weights."""
    leaves, structure = jax.tree.flatten((target, drafter))
    runner = next((r for r in _LOOPS if r.runs(leaves, structure, spec, steps)), None)
    if runner is None:
        target_leaves = leaves[:len(jax.tree.leaves(target))]
        # Only this target's loops stay: another model's would hold its arrays (and executables) alive.
        _LOOPS[:] = [r for r in _LOOPS if r.runs_target(target_leaves)][-(LOOPS_KEPT - 1):] if LOOPS_KEPT > 1 else []
        shared = _LOOPS[-1].loop_weights if _LOOPS else None
        runner = ChunkedLoop(target, drafter, spec, steps, loop_weights=shared)
    else:
        _LOOPS.remove(runner)
    _LOOPS.append(runner)
    return runner


def clear_loops() -> None:
    """Drop the kept chunked loops (`chunked_loop`): their programs and the models' arrays they hold go with the
    last other reference (with jax.clear_caches(), what frees a process's executables)."""
    _LOOPS.clear()


_HOST_LOOPS: dict = {}  # (models' structure, spec, chunk steps, state shapes) -> runtime.host_driven_loops


def _host_driven_loops(compiled, key) -> Optional[int]:
    """On a GPU, the compiled loop's while loops that no command buffer captures (each copies its predicate to the
    host every step), once per program; None on other backends (their loops run from the host by design) and where
    the program's text cannot say (runtime.host_driven_loops: jaxlib 0.11 forms command buffers after the HLO)."""
    if jax.default_backend() != "gpu":
        return None
    if key not in _HOST_LOOPS:
        _HOST_LOOPS[key] = runtime.host_driven_loops(compiled.as_text() or "")
        if _HOST_LOOPS[key] and not _HOST_LOOPS.get("warned"):
            _HOST_LOOPS["warned"] = True
            warnings.warn("the decode loop runs from the host on this GPU (its while loop is in no command buffer: a "
                          "host round trip per step); call kdtree_jax.runtime.configure() before the first JAX "
                          "computation (python -m kdtree_jax.generate and the benchmarks do)", RuntimeWarning,
                          stacklevel=3)
    return _HOST_LOOPS[key]


def _loop_on_device() -> bool:
    """Whether this process decodes on a GPU whose while loops XLA captures in command buffers (the chunked loop
    then runs its steps without the host)."""
    return jax.default_backend() == "gpu" and runtime.command_buffers_configured()


def cached_refusal(model: cost_models.CostModel, menu: Sequence[int], batch: int, context: float,
                   static_batch: bool = False) -> Optional[dict]:
    """When `model` (the cached cost model of these settings) has a point for this batch and context whose costs and
    acceptance prior close the gate (budget_policy.pays: no menu budget is predicted to beat an
    autoregressive step), the verdict (for stats); else None (the adaptive loop decides step by step). generate and
    the server then run the plain autoregressive program. static_batch (generate): the prior is the slowest row's
    (the point's `slowest`), as the adaptive loop's first chunk would take it (budget_policy.init_state)."""
    point = model.lookup(batch, context)
    if point is None or point.get("expected") is None:
        return None
    costs = model.costs(batch, context)
    if static_batch:
        costs = {**costs, "expected": budget_policy.static_batch_prior(costs["expected"], costs.get("slowest"))}
    rate = float(budget_policy.speculative_rate(budget_policy.init_state(menu, **costs), menu, context))
    if budget_policy.pays(rate):
        return None
    return {"menu": list(menu), "decision": "autoregressive",
            "why": (f"the cost model (autoregressive step {costs['cost_ar']:.3g} ms, drafter {costs['cost_draft']:.3g} "
                    f"ms) and the measured acceptance give at most {rate:.2f}x an autoregressive step's tokens per ms "
                    f"with speculation, under the {1 + budget_policy.GATE_MARGIN:.2f}x the gate asks for"),
            "calibrated": False, "calibration_seconds": 0.0, "cost_model": str(model.path),
            "costs_ms": {"ar": costs["cost_ar"], "draft": costs["cost_draft"],
                         "verify": np.round(costs["cost_verify"], 4).tolist()}}


def _prepare_costs(target: Transformer, drafter: Drafter, spec: SpecConfig, call, state: LoopState, *,
                   chunk_steps: int, recalibrate: bool, on_progress, info: dict, costs: Optional[dict] = None,
                   model: Optional[cost_models.CostModel] = None) -> LoopState:
    """The adaptive loop's costs for this batch and context: given (`costs`), from the cache (`model`, the cached cost
    model of these settings), or calibrated now with `call` (and cached). Fills `info` with what happened, for
    stats["budget_policy"]."""
    if costs is not None:
        info.update(calibrated=False, calibration_seconds=0.0, cost_model="given")
        return _begin(call, target, state, spec, costs)
    batch = state.bonus.shape[0]
    context = float(budget_policy.mean_context(state.cache.seq_lens, jnp.ones_like(state.active)))
    point = None if recalibrate else model.lookup(batch, context)
    t0 = time.perf_counter()
    measured = point is None
    if measured:
        point = calibrate(call, state, spec, depth=drafter.cfg.depth, on_progress=on_progress)
        model.add(point)
        model.save()
    info.update(calibrated=measured, calibration_seconds=time.perf_counter() - t0, cost_model=str(model.path))
    return _begin(call, target, state, spec, model.costs(batch, context))


def _begin(call, target: Transformer, state: LoopState, spec: SpecConfig, costs: dict) -> LoopState:
    """The state with the policy's costs, registered with the ChunkedLoop `call` to start at the host's pick."""
    state = _replicated_policy(target, with_costs(state, spec, costs))
    return call.begin(state, first_entry(state, spec, costs, call.steps, makespan=True))


def _replicated_policy(target: Transformer, state: LoopState) -> LoopState:
    mesh = getattr(target, "mesh", None)
    return state if mesh is None else state._replace(policy=replicate(state.policy, mesh))


def _row_settings(prompt_ids, sampling, seed, **scalars) -> list:
    """generate's sampling arguments as one SamplingParams per prompt (ValueError naming a bad one)."""
    batch = len(validation._as_batch(prompt_ids)[0])
    if sampling is None:
        sampling = sampling_ops.SamplingParams(**{k: v for k, v in scalars.items()})
    rows = [sampling] * batch if isinstance(sampling, sampling_ops.SamplingParams) else list(sampling)
    if len(rows) != batch or not all(isinstance(p, sampling_ops.SamplingParams) for p in rows):
        raise ValueError(f"sampling must be a SamplingParams or a list of {batch} (one per prompt)")
    if np.ndim(seed) and len(seed) != batch:
        raise ValueError(f"seed must be one integer or a list of {batch} (one per prompt); got {len(seed)}")
    return rows


def generate(target: Transformer, drafter: Optional[Drafter], prompt_ids, *, max_new_tokens: int = 64,
             budget: Union[int, str] = "auto", topk: int = 4, tree_temperature: float = 1.0, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, sampling=None,
             seed: Union[int, Sequence[int]] = 0, stop_ids: Sequence[int] = (), tree: TreeShape = "ddtree", impl: str = "auto",
             chunk_size: int = 64, kv_dtype=None, expert_devices: Optional[int] = None,
             profile: bool = False, chunk_steps: Optional[int] = None, on_tokens=None,
             on_progress=None, row_invariant: bool = False, calibrate: bool = False,
             menu: Optional[Sequence[int]] = None, costs: Optional[dict] = None) -> GenerateResult:
    """Speculative decoding of one prompt or a batch of (ragged) prompts.

    budget "auto" (the default): each chunk of `chunk_steps` steps chooses its DDTree budget from `menu` (default
    budget_policy.DEFAULT_MENU, 0 = autoregressive steps that skip the drafter) by the drafter's own probabilities
    and a cost model of this device (budget_policy.py, cost_model.py); the batch is static, so the policy minimises
    the predicted time to finish every row. It decodes in chunks (chunk_steps 0 is refused). The cost model is
    measured once per model pair, device, batch size and context (a few seconds, with this call's compiled programs:
    nothing extra compiles) and cached under the user's cache directory; calibrate=True measures again. stats["budget_policy"] reports the
    steps each budget got and the predicted vs observed tokens per step. A number keeps that budget every step.
    costs: the policy's costs as `CostModel.costs` gives them (cost_ar, cost_draft, cost_verify [one per menu entry],
    optionally cost_slope, context0, bin_ratio, expected), used instead of the cache and calibration: research on the
    policy itself, or a decode that must not depend on timing.

    tree: "ddtree" (the `budget` best prefixes of the drafter's top-`topk` per depth), "chain" (DFlash:
    top-1 per depth) or a tuple of branching factors per depth (a static shape). budget 0 (or no
    drafter) decodes autoregressively through the same loop. temperature 0 is greedy; otherwise every
    emitted token is an exact sample of the target's (penalised, top-k/top-p filtered) distribution
    (speculative/sampling.py). repetition_penalty / presence_penalty / frequency_penalty: from the counts of each
    sequence's prompt and emitted tokens. sampling: a SamplingParams for every prompt, or a list of one per prompt
    (mixed settings in one batch and one program), instead of temperature ... frequency_penalty. seed: one for the
    batch (row b's stream is fold_in(key(seed), b)) or one per prompt.
    Returns the generated ids per sequence and stats: decoding ('speculative', or 'autoregressive' when there is no
    drafter or a DDTree's budget is 0; then tree is 'autoregressive' too), steps, tau (mean tokens per step), per-depth
    acceptance, tokens/s, and the router's expert load per step grouped into `expert_devices` devices
    (default: the target's mesh size) — the imbalance an expert-parallel layout would see.
    profile: first run the decode loop once under the profiler, on a copy of its starting state (memory for a
    second KV pool), and add stats["profile"]: each step's kernel time by part (kdtree_jax.profiling) and the
    idle time of the timed run (its step time less the union of the profiled step's kernels).
    chunk_steps: decode steps per host iteration (`ChunkedLoop`; the batch stays on device between chunks), capped
    at max_new_tokens; 0 runs the whole decode in one call (`decode_loop`); None (default): default_chunk_steps() when
    the budget is "auto", when on_tokens streams or on a GPU whose XLA_FLAGS capture while loops in command buffers (kdtree_jax.runtime: H200,
    bfloat16, greedy, 108a241, results/history/spec_decode_greedy_h200.md: 8 steps a chunk against the whole decode in one
    call, B = 1: autoregressive 4,191 vs 3,796 tok/s, DDTree 16 10,503 vs 7,985; B = 16: 59,691 vs 54,265 and
    54,756 vs 46,702; without command buffers the chunks cost more than they save: B = 1 autoregressive 2,302 vs
    3,712), else 0 (its gain on a CPU is not measured). on_tokens(batch_row, new_token_ids):
    called with each sequence's first token after the prefill, then after every chunk with the tokens it added
    (stop token included, never past max_new_tokens), while the device runs the next chunk; the calls of a row
    concatenate to its `tokens`. on_tokens returning True ends that row (e.g. a stop string the host found in its
    text): it gets no more calls and no more steps after the chunk in flight, so its `tokens` may run up to a chunk
    past the point it was ended. chunk_size is the prefill's chunk (tokens per prefill pass).
    on_progress(phase, done, total): ("prefill", prompt tokens done, the longest prompt's tokens) after each prefill
    chunk has run, then ("compile", 0, 1) and ("compile", 1, 1) around the decode loop's compile (a cache hit is
    quick), for a progress bar.
    row_invariant: every verify row computed as the one-token step computes it (SpecConfig.row_invariant), so that
    greedy speculative output equals autoregressive output token for token in bfloat16; much slower. On a GPU it
    needs kdtree_jax.runtime.configure(row_invariant=True) before JAX starts (a warning says when its flags are
    missing).

    Reads top to bottom as: `validation.validate` the arguments, `setup` (prefill, first tokens, `initial_state`),
    `_run_loop` (compile, `ChunkedLoop` or `decode_loop`), `stats.generate_stats`.
    """
    menu = validation.adaptive_menu(budget, menu, drafter, tree, topk)
    if isinstance(budget, str):
        budget = max(menu) if menu else 0
    # The scalars checked by validate (its messages name the vocabulary's bound), each row's settings then.
    given = sampling if sampling is None or isinstance(sampling, sampling_ops.SamplingParams) else list(sampling)
    listed = [given] if isinstance(given, sampling_ops.SamplingParams) else given
    scalars = dict(temperature=temperature, top_p=top_p, top_k=top_k) if given is None else dict(
        temperature=0.0, top_p=1.0, top_k=max((getattr(p, "top_k", 0) for p in listed), default=0))
    req = validation.validate(target, drafter, prompt_ids, max_new_tokens=max_new_tokens, budget=budget, topk=topk,
                    tree_temperature=tree_temperature, stop_ids=stop_ids, tree=tree, **scalars)
    rows = _row_settings(prompt_ids, given, seed, temperature=temperature, top_p=top_p, top_k=top_k,
                         repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                         frequency_penalty=frequency_penalty)
    mesh = getattr(target, "mesh", None)
    devices = expert_devices or (mesh.size if mesh is not None else 1)
    moe_layers = [layer.mlp for layer in target.layers if layer.is_moe]
    slots = moe_layers[0].num_slots if moe_layers else 0
    if slots % devices:
        raise ValueError(f"expert_devices ({devices}) must divide the expert slots per layer ({slots})")
    spec = SpecConfig(tree=tree if isinstance(tree, str) else tuple(int(b) for b in tree),
                      budget=budget if req.use_drafter else 0, topk=topk, tree_temperature=float(tree_temperature),
                      sampled=any(p.sampled for p in rows), penalties=any(p.penalised for p in rows),
                      max_new_tokens=max_new_tokens, impl=impl, expert_devices=devices,
                      row_invariant=bool(row_invariant), menu=menu if req.use_drafter else ())
    if not spec.menu and req.use_drafter:
        message = validation.budget_warning(target, drafter, prompt_ids, budget=budget, topk=topk, tree=spec.tree,
                                            sampled=spec.sampled, penalties=spec.penalties, impl=impl,
                                            row_invariant=spec.row_invariant)
        if message:
            warnings.warn(message, validation.BudgetWarning, stacklevel=2)
    # The cached cost model and acceptance prior may already say that no budget pays on this device at this batch
    # size (a CPU, where a drafter pass costs several autoregressive steps): then the call compiles and runs the plain
    # autoregressive loop, and pays nothing for the choice it would refuse at every step.
    skipped = model = None
    if spec.menu and costs is None:
        model = cost_models.CostModel.load(cost_models.fingerprint(target, drafter, spec))
        if not calibrate:
            skipped = cached_refusal(model, spec.menu, len(req.prompts),
                                     float(np.mean([p.size for p in req.prompts])), static_batch=True)
        if skipped is not None:
            spec = dataclasses.replace(spec, menu=(), budget=0)
            req = req._replace(use_drafter=False, num_nodes=1)
    if row_invariant and jax.default_backend() == "gpu" and not runtime.row_invariant_configured():
        warnings.warn("generate(row_invariant=True) without the XLA flags of kdtree_jax.runtime.configure("
                      "row_invariant=True) (call it before the first JAX computation): rows may still depend on the "
                      "verify pass's row count", RuntimeWarning, stacklevel=2)

    if chunk_steps is None:
        chunk_steps = default_chunk_steps() if on_tokens is not None or _loop_on_device() or spec.menu else 0
    if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, (int, np.integer)) or chunk_steps < 0:
        raise ValueError(f"chunk_steps must be an integer >= 0 (0: the whole decode in one call); got {chunk_steps!r}")
    if spec.menu and not chunk_steps:
        raise ValueError("budget 'auto' decodes in chunks (its budget is chosen per chunk): chunk_steps must be > 0")
    chunk_steps = min(int(chunk_steps), max_new_tokens)  # a step emits >= 1 token: more steps never run

    state, loop_drafter, t_prefill = setup(target, drafter, req, spec, seed=seed, sampling=rows, chunk_size=chunk_size,
                                            kv_dtype=kv_dtype, num_moe=len(moe_layers), slots=slots,
                                            on_progress=on_progress, chunk_steps=chunk_steps)
    on_chunk = None
    if on_tokens is not None:
        streamed = [1] * len(req.prompts)  # output positions handed to on_tokens, per row
        ended = set()  # rows whose on_tokens returned True
        for b, token in enumerate(np.asarray(state.bonus).tolist()):
            if on_tokens(b, [token]):
                ended.add(b)
        if ended:
            state = admission.deactivate(state, ended)

        def on_chunk(chunk_tokens, start, num_out):
            finished = []
            for b in range(chunk_tokens.shape[0]):
                end = min(int(num_out[b]), max_new_tokens)
                if end > streamed[b] and b not in ended:
                    if on_tokens(b, chunk_tokens[b, streamed[b] - int(start[b]):end - int(start[b])].tolist()):
                        ended.add(b)
                        finished.append(b)
                    streamed[b] = end
            return finished

    calibration = {}
    prepare = None
    if spec.menu:
        prepare = functools.partial(_prepare_costs, target, loop_drafter, spec, chunk_steps=chunk_steps,
                                    recalibrate=calibrate, on_progress=on_progress, info=calibration, costs=costs,
                                    model=model)
    final, t_compile, t_decode, step_profile, host_syncs, host_loops = _run_loop(
        target, loop_drafter, state, spec, profile, chunk_steps, on_chunk, on_progress, prepare)

    out_np, num_out = np.asarray(final.out), np.asarray(final.num_out)
    tokens = [out_np[b, :min(int(num_out[b]), max_new_tokens)].tolist() for b in range(len(req.prompts))]
    stats = generate_stats(final, tokens, spec, req.num_nodes, t_prefill=t_prefill, t_compile=t_compile,
                           t_decode=t_decode, step_profile=step_profile)
    # The host's reads of the loop's output: one per chunk (one for the whole loop with chunk_steps 0). On a GPU,
    # XLA adds a read of the loop predicate per step unless a command buffer captures the loop (runtime.py).
    # host_driven_loops (GPU only, else None): the compiled loop's while loops outside command buffers.
    # What ran: without a drafter (or with budget 0 on a DDTree) the loop decodes autoregressively, whatever `tree` says.
    stats["decoding"] = "speculative" if req.use_drafter else "autoregressive"
    if not req.use_drafter:
        stats["tree"] = "autoregressive"
    if "budget_policy" in stats:
        stats["budget_policy"].update(calibration)
    if skipped is not None:  # the whole call autoregressive, by the cached cost model's verdict
        stats["budget"] = "auto"
        stats["budget_policy"] = {**skipped, "budget_steps": {str(b): 0 for b in skipped["menu"]},
                                  "steps_without_drafter": stats["steps"], "predicted_tau": float("nan"),
                                  "observed_tau": float("nan"), "drafted_sequence_steps": 0.0, "calibration": None}
    stats.update(chunk_steps=chunk_steps, host_syncs=host_syncs,
                 host_syncs_per_step=host_syncs / max(stats["steps"], 1), host_driven_loops=host_loops)
    return GenerateResult(tokens=tokens, stats=stats)


# The chunk program under a public name, for code that traces it into a program of its own or lowers it for other
# shapes (the server's row programs, serve/programs.py): the same jitted function, its traces counted as its own.
decode_chunk = _decode_chunk
