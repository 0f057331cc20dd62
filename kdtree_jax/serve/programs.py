"""The bucket's chunk programs by what its live rows need: how many rows a chunk computes, and whether any of them
samples or has a penalty.

Why: a chunk of the decode loop computes every row of its batch, live or free, and the one program that serves any
mix of settings (SpecConfig(sampled=True, penalties=True)) filters every node's logits with its row's settings and
keeps token counts, whatever the rows ask for. On the 2-core CPU with the default pair (autoregressive, --max-batch 8,
float32) that program costs 13.7 ms a step where a greedy-only one costs 4.2, and a batch of one 1.4: a single
greedy stream ran at ~10% of `python -m kdtree_jax.generate`'s tok/s (benchmarks/serve_host.py).

So a fixed-budget bucket (an adaptive one keeps its one program per menu entry: engine.ChunkedLoop picks among them)
compiles, at warm-up, a program per (rows, greedy): `rows` a power of two up to the batch, `greedy` when every live
row is greedy without penalties. Each launch takes the smallest that holds its live rows: a chunk of k < batch rows
gathers those rows' part of the state (their slot tables and lengths; the pool's pages and free list are shared, so
the k-row program allocates from the batch's pool), runs the loop's own chunk program on it (engine.decode_chunk,
traced into this one) and scatters it back, in one dispatch. A greedy program runs without the token counts (the
state's counts stay as they were: only a row with a penalty reads its counts, and such a row keeps the full program
while it lives; a row's counts are set afresh when it is admitted). Rows are batch-invariant (each row's step reads
only its own cache rows), so a request's tokens do not depend on the program that ran them; a greedy row takes the
argmax either way (sampling.accept_rows).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.kv_pool import KVCache
from kdtree_jax.model.drafter import DrafterCache
from kdtree_jax.speculative import engine
from kdtree_jax.speculative.sampling import RowSampling
from kdtree_jax.speculative.step import LoopState, SpecConfig


def take_rows(state: LoopState, rows) -> LoopState:
    """The state of batch rows `rows` [k] (distinct): per-row arrays gathered, the pool's pages and free list, the
    step counter and the batch's histograms shared."""
    c = state.cache
    cache = KVCache(c.pages, c.free_slots, c.num_free, c.slot_table[rows], c.seq_lens[rows], c.overflow)
    d = state.dcache
    dcache = None if d is None else DrafterCache(d.k[:, rows], d.v[:, rows], d.lens[rows])
    return state._replace(cache=cache, dcache=dcache, bonus=state.bonus[rows], out=state.out[rows],
                          num_out=state.num_out[rows], active=state.active[rows], key=state.key[rows],
                          sampling=RowSampling(*(x[rows] for x in state.sampling)),
                          counts=None if state.counts is None else state.counts[rows])


def put_rows(state: LoopState, sub: LoopState, rows) -> LoopState:
    """`state` with rows `rows` replaced by `sub` (take_rows' inverse) and the shared parts taken from `sub`."""
    c, s = state.cache, sub.cache
    cache = KVCache(s.pages, s.free_slots, s.num_free, c.slot_table.at[rows].set(s.slot_table),
                    c.seq_lens.at[rows].set(s.seq_lens), s.overflow)
    d, e = state.dcache, sub.dcache
    dcache = None if d is None else DrafterCache(d.k.at[:, rows].set(e.k), d.v.at[:, rows].set(e.v),
                                                 d.lens.at[rows].set(e.lens))
    return state._replace(cache=cache, dcache=dcache, bonus=state.bonus.at[rows].set(sub.bonus),
                          out=state.out.at[rows].set(sub.out), num_out=state.num_out.at[rows].set(sub.num_out),
                          active=state.active.at[rows].set(sub.active), step=sub.step,
                          key=state.key.at[rows].set(sub.key), accepted_hist=sub.accepted_hist,
                          expert_load=sub.expert_load,
                          sampling=RowSampling(*(x.at[rows].set(y) for x, y in zip(state.sampling, sub.sampling))),
                          counts=None if state.counts is None else state.counts.at[rows].set(sub.counts))


@functools.partial(jax.jit, static_argnames=("structure", "spec", "steps"), donate_argnames=("state",))
def rows_chunk(leaves, loop_weights, state: LoopState, rows, *, structure, spec: SpecConfig,
               steps: int) -> engine.ChunkOutput:
    """One chunk of rows `rows` [k] of the batch (the others untouched): -> the batch's ChunkOutput (a row not run
    emits nothing: its tokens are -1, its start its num_out)."""
    sub = engine.decode_chunk(leaves, loop_weights, take_rows(state, rows), structure=structure, spec=spec,
                               steps=steps)
    full = put_rows(state, sub.state, rows)
    tokens = jnp.full((state.bonus.shape[0], sub.tokens.shape[1]), -1, jnp.int32).at[rows].set(sub.tokens)
    return engine.ChunkOutput(full, tokens, state.num_out, full.num_out, sub.any_active, full.active, None)


def row_sizes(batch: int) -> tuple:
    """The programs' row counts: powers of two below the batch, then the batch."""
    sizes, k = [], 1
    while k < batch:
        sizes.append(k)
        k *= 2
    return tuple(sizes) + (batch,)


class RowPrograms:
    """A fixed-budget bucket's chunk programs by (rows, greedy, steps) (module docstring). `full` is the bucket's
    engine.ChunkedLoop (every row, any settings, full.steps a chunk); the rest are compiled by `compile`.

    lone_steps (> full.steps; 0: none): the steps of a lone row's chunk while nothing waits for a row, a greedy and an
    any-settings one-row program. Why: a chunk's fixed costs (the program's dispatch, the host's read and hand-over of
    its tokens) are paid per chunk, and the server's short chunk (4 steps, for admission latency) pays them twice as
    often per token as `python -m kdtree_jax.generate`'s 8: on the 2-core CPU a single stream ran at 0.94x the CLI
    call's tok/s with 4-step chunks and 0.99x with 8 (serve_host.py --stream-ab: one process, 8 interleaved rounds;
    benchmarks/results/history/serve_host_cpu_ac80846.md). A long chunk delays only a request that arrives while it
    runs (it waits for that chunk, then the rows are two and the chunks short again)."""

    def __init__(self, full: engine.ChunkedLoop, batch: int, sizes: Optional[tuple] = None, lone_steps: int = 0):
        if full.spec.menu:
            raise ValueError("an adaptive loop picks its own programs (engine.ChunkedLoop)")
        self.full, self.batch = full, batch
        self.sizes = tuple(sorted(set(sizes) | {batch})) if sizes is not None else row_sizes(batch)
        if self.sizes[-1] != batch or self.sizes[0] < 1:
            raise ValueError(f"row sizes must be in [1, {batch}]; got {self.sizes}")
        self.lone_steps = int(lone_steps) if lone_steps and lone_steps > full.steps else 0
        self.greedy_spec = dataclasses.replace(full.spec, sampled=False, penalties=False)
        self._compiled: dict = {}  # (rows, greedy, steps) -> Compiled (the full batch's any-settings program: full)
        self.runs: collections.Counter = collections.Counter()  # chunks launched by (rows, greedy, steps)

    def keys(self) -> list:
        """Every program's (rows, greedy, steps)."""
        keys = [(k, g, self.full.steps) for k in self.sizes for g in (True, False)]
        if self.lone_steps:
            keys += [(1, g, self.lone_steps) for g in (True, False)]
        return keys

    def _lower(self, state: LoopState, k: int, greedy: bool, steps: int):
        spec = self.greedy_spec if greedy else self.full.spec
        if greedy:
            state = state._replace(counts=None)
        if k == self.batch:
            return engine.decode_chunk.lower(self.full.leaves, self.full.loop_weights, state,
                                             structure=self.full.structure, spec=spec, steps=steps)
        rows = jnp.arange(k, dtype=jnp.int32)
        return rows_chunk.lower(self.full.leaves, self.full.loop_weights, state, rows,
                                structure=self.full.structure, spec=spec, steps=steps)

    def compile(self, state: LoopState) -> None:
        """Every program but the full batch's any-settings one (the bucket's loop compiled it), in threads (XLA
        compiles outside the GIL)."""
        full = (self.batch, False, self.full.steps)
        keys = [key for key in self.keys() if key != full and key not in self._compiled]

        self._compiled.update(engine.compile_programs(lambda key: self._lower(state, *key).compile(), keys))

    def pick(self, live: int, greedy: bool, lone: bool = False) -> tuple:
        """(rows the chunk computes, greedy, steps) for `live` rows holding requests; lone: nothing waits for a row
        (a single live row then takes the long chunk)."""
        if lone and live == 1 and self.lone_steps:
            return 1, greedy, self.lone_steps
        k = next(k for k in self.sizes if k >= live)
        return k, greedy, self.full.steps

    def __call__(self, state: LoopState, live_rows: list, greedy: bool, lone: bool = False) -> engine.ChunkOutput:
        """One chunk of the smallest program that holds `live_rows` (batch row indices holding requests)."""
        k, greedy, steps = key = self.pick(len(live_rows), greedy, lone)
        self.runs[key] += 1
        if k == self.batch and not greedy and steps == self.full.steps:
            return self.full(state)
        counts = state.counts
        if greedy:
            state = state._replace(counts=None)
        program = self._compiled[key]
        if k == self.batch:
            out = program(self.full.leaves, self.full.loop_weights, state)
        else:
            rows = list(live_rows)
            taken = set(rows)
            rows += [r for r in range(self.batch) if r not in taken][:k - len(rows)]  # distinct: padding rows are free
            out = program(self.full.leaves, self.full.loop_weights, state, np.asarray(rows, np.int32))
        if greedy:
            out = out._replace(state=out.state._replace(counts=counts))
        return out
