"""The bucket's chunk programs by what its live rows need: how many rows a chunk computes, and whether any of them
samples or has a penalty.

Why: a chunk of the decode loop computes every row of its batch, live or free, and the one program that serves any
mix of settings (SpecConfig(sampled=True, penalties=True)) filters every node's logits with its row's settings and
keeps token counts, whatever the rows ask for. On the 2-core CPU with the default pair (autoregressive, --max-batch 8,
float32) that program costs 13.7 ms a step where a greedy-only one costs 4.2, and a batch of one 1.4: a single
greedy stream ran at ~10% of `python -m kdtree_jax.generate`'s tok/s (benchmarks/serve_host.py).

So a fixed-budget bucket compiles, at warm-up, a program per (rows, greedy): `rows` a power of two up to the batch,
`greedy` when every live row is greedy without penalties (an adaptive bucket: a lone row's and the batch's, each one
per menu entry: RowPrograms). Each launch takes the smallest that holds its live rows: a chunk of k < batch rows
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
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.kv_pool import KVCache
from kdtree_jax.model.drafter import DrafterCache
from kdtree_jax.speculative import budget_policy, engine
from kdtree_jax.speculative.sampling import RowSampling
from kdtree_jax.speculative.step import LoopState, PendingContext, SpecConfig


class RowCosts(NamedTuple):
    """An adaptive loop's step costs for a chunk of fewer rows than the batch (budget_policy.PolicyState's cost fields,
    measured for that many rows): the policy's picks for a lone row are priced at one row's steps, not the batch's."""

    cost_ar: jnp.ndarray
    cost_draft: jnp.ndarray
    cost_verify: jnp.ndarray
    cost_slope: jnp.ndarray
    context0: jnp.ndarray

    @staticmethod
    def of(policy) -> "RowCosts":
        return RowCosts(*(getattr(policy, f) for f in RowCosts._fields))


def take_rows(state: LoopState, rows, costs: Optional[RowCosts] = None) -> LoopState:
    """The state of batch rows `rows` [k] (distinct): per-row arrays gathered, the pool's pages and free list, the
    step counter and the batch's histograms shared; an adaptive loop's policy with its per-row predictions and step log
    gathered, its calibration and counters shared, and its costs `costs` (those of a chunk of k rows)."""
    c = state.cache
    cache = KVCache(c.pages, c.free_slots, c.num_free, c.slot_table[rows], c.seq_lens[rows], c.overflow)
    d = state.dcache
    dcache = None if d is None else DrafterCache(d.k[:, rows], d.v[:, rows], d.lens[rows])
    policy, pending = state.policy, state.pending
    if policy is not None:
        policy = policy._replace(row_expected=policy.row_expected[rows], log_scores=policy.log_scores[:, rows],
                                 log_path=policy.log_path[:, rows], **(costs._asdict() if costs is not None else {}))
        pending = PendingContext(pending.hidden[:, rows], pending.count[rows])
    return state._replace(cache=cache, dcache=dcache, bonus=state.bonus[rows], out=state.out[rows],
                          num_out=state.num_out[rows], active=state.active[rows], key=state.key[rows],
                          sampling=RowSampling(*(x[rows] for x in state.sampling)),
                          counts=None if state.counts is None else state.counts[rows], policy=policy, pending=pending)


def put_rows(state: LoopState, sub: LoopState, rows) -> LoopState:
    """`state` with rows `rows` replaced by `sub` (take_rows' inverse) and the shared parts taken from `sub` (an
    adaptive loop's costs stay the batch's)."""
    c, s = state.cache, sub.cache
    cache = KVCache(s.pages, s.free_slots, s.num_free, c.slot_table.at[rows].set(s.slot_table),
                    c.seq_lens.at[rows].set(s.seq_lens), s.overflow)
    d, e = state.dcache, sub.dcache
    dcache = None if d is None else DrafterCache(d.k.at[:, rows].set(e.k), d.v.at[:, rows].set(e.v),
                                                 d.lens.at[rows].set(e.lens))
    policy, pending = state.policy, state.pending
    if policy is not None:
        p = sub.policy
        policy = p._replace(row_expected=policy.row_expected.at[rows].set(p.row_expected),
                            log_scores=policy.log_scores.at[:, rows].set(p.log_scores),
                            log_path=policy.log_path.at[:, rows].set(p.log_path), **RowCosts.of(policy)._asdict())
        pending = PendingContext(pending.hidden.at[:, rows].set(sub.pending.hidden),
                                 pending.count.at[rows].set(sub.pending.count))
    return state._replace(cache=cache, dcache=dcache, bonus=state.bonus.at[rows].set(sub.bonus),
                          out=state.out.at[rows].set(sub.out), num_out=state.num_out.at[rows].set(sub.num_out),
                          active=state.active.at[rows].set(sub.active), step=sub.step,
                          key=state.key.at[rows].set(sub.key), accepted_hist=sub.accepted_hist,
                          expert_load=sub.expert_load,
                          sampling=RowSampling(*(x.at[rows].set(y) for x, y in zip(state.sampling, sub.sampling))),
                          counts=None if state.counts is None else state.counts.at[rows].set(sub.counts),
                          policy=policy, pending=pending)


@functools.partial(jax.jit, static_argnames=("structure", "spec", "steps", "entry"), donate_argnames=("state",))
def rows_chunk(leaves, loop_weights, state: LoopState, rows, costs: Optional[RowCosts] = None, *, structure,
               spec: SpecConfig, steps: int, entry: Optional[int] = None) -> engine.ChunkOutput:
    """One chunk of rows `rows` [k] of the batch (the others untouched): -> the batch's ChunkOutput (a row not run
    emits nothing: its tokens are -1, its start its num_out). An adaptive loop's chunk runs menu entry `entry` priced
    at `costs` (RowCosts), and its next_entry is the k rows' pick."""
    sub = engine.decode_chunk(leaves, loop_weights, take_rows(state, rows, costs), structure=structure, spec=spec,
                              steps=steps, entry=entry)
    full = put_rows(state, sub.state, rows)
    tokens = jnp.full((state.bonus.shape[0], sub.tokens.shape[1]), -1, jnp.int32).at[rows].set(sub.tokens)
    return engine.ChunkOutput(full, tokens, state.num_out, full.num_out, sub.any_active, full.active, sub.next_entry)


# The sets of rows whose device array RowPrograms keeps (each a few bytes; a load that churns through more starts over).
ROWS_KEPT = 256


def row_sizes(batch: int) -> tuple:
    """The programs' row counts: powers of two below the batch, then the batch."""
    sizes, k = [], 1
    while k < batch:
        sizes.append(k)
        k *= 2
    return tuple(sizes) + (batch,)


class RowPrograms:
    """A bucket's chunk programs by (rows, greedy, steps) (module docstring). `full` is the bucket's
    engine.ChunkedLoop (every row, any settings, full.steps a chunk); the rest are compiled by `compile`.

    lone_steps (> full.steps; 0: none): the steps of a lone row's chunk while nothing waits for a row, a greedy and an
    any-settings one-row program. Why: a chunk's fixed costs (the program's dispatch, the host's read and hand-over of
    its tokens) are paid per chunk, and the server's short chunk (4 steps, for admission latency) pays them twice as
    often per token as `python -m kdtree_jax.generate`'s 8: on the 2-core CPU a single stream ran at 0.94x the CLI
    call's tok/s with 4-step chunks and 0.99x with 8 (serve_host.py --stream-ab: one process, 8 interleaved rounds;
    benchmarks/results/history/serve_host_cpu_ac80846.md). A long chunk delays only a request that arrives while it
    runs (it waits for that chunk, then the rows are two and the chunks short again).

    An adaptive loop (full.spec.menu; the server builds this for it with Settings.adaptive_row_programs, by default on
    a GPU; the CLI's --[no-]lone-row-programs) has a lone row's programs, greedy and any-settings, and the batch's
    greedy one, one per menu entry each; the lone row's are priced at one row's costs (`set_lone_costs`: RowCosts);
    each call's pick is the next chunk's entry in the loop's chain of calls (ChunkedLoop.call_entry). Why: with one
    request in flight the full batch's program verified every empty row's tree too, and the policy priced it at the
    batch's step: on the H100 at f2afe17 the speculative server at concurrency 1 ran 0.61x the autoregressive one (whose
    lone row had its one-row greedy program), picking budget 16 on every step
    (benchmarks/results/history/serve_load_h100_80gb_hbm3_f2afe17; with them, 1.39x at bead05c). With
    only an any-settings lone program it ran 0.66x (2e87f37, an H100): that program's DDTree 8 step cost 0.657 ms
    against an autoregressive step's 0.323 (its walk over the tree sorts the vocabulary at every node it visits, even
    for a greedy row), so the policy drafted on 31% of the steps. A few live rows (2 to batch - 1) keep the batch's
    programs: each row count would be two programs per menu entry to compile."""

    def __init__(self, full: engine.ChunkedLoop, batch: int, sizes: Optional[tuple] = None, lone_steps: int = 0):
        self.full, self.batch = full, batch
        self.adaptive = bool(full.spec.menu)
        if self.adaptive:
            sizes = (1,) if batch > 1 else ()
        self.sizes = tuple(sorted(set(sizes) | {batch})) if sizes is not None else row_sizes(batch)
        if self.sizes[-1] != batch or self.sizes[0] < 1:
            raise ValueError(f"row sizes must be in [1, {batch}]; got {self.sizes}")
        self.lone_steps = int(lone_steps) if lone_steps and lone_steps > full.steps else 0
        self.greedy_spec = dataclasses.replace(full.spec, sampled=False, penalties=False)
        # (rows, greedy, steps, entry: the menu entry of an adaptive loop's program, else None) -> Compiled (the full
        # batch's any-settings program: full)
        self._compiled: dict = {}
        self.runs: collections.Counter = collections.Counter()  # chunks launched by (rows, greedy, steps)
        self.lone_costs: Optional[RowCosts] = None  # an adaptive loop's lone row's costs (set_lone_costs)
        # A chunk of fewer rows than the batch takes its rows as an argument: a numpy array there is copied to the
        # device by every call (a lone stream's every chunk), so each set of rows is copied once (a few sets under a
        # steady load; forgotten at ROWS_KEPT).
        self._rows: dict = {}

    def keys(self) -> list:
        """Every program's (rows, greedy, steps) (an adaptive loop's: each for every menu entry)."""
        if self.adaptive:
            lone = [(1, g, self.lone_steps or self.full.steps) for g in (True, False)] if self.batch > 1 else []
            return lone + [(self.batch, g, self.full.steps) for g in (True, False)]
        keys = [(k, g, self.full.steps) for k in self.sizes for g in (True, False)]
        if self.lone_steps:
            keys += [(1, g, self.lone_steps) for g in (True, False)]
        return keys

    def _lower(self, state: LoopState, k: int, greedy: bool, steps: int, entry: Optional[int]):
        spec = self.greedy_spec if greedy else self.full.spec
        if greedy:
            state = state._replace(counts=None)
        if k == self.batch:
            return engine.decode_chunk.lower(self.full.leaves, self.full.loop_weights, state,
                                             structure=self.full.structure, spec=spec, steps=steps, entry=entry)
        rows = jnp.arange(k, dtype=jnp.int32)
        return rows_chunk.lower(self.full.leaves, self.full.loop_weights, state, rows, self._costs(state),
                                structure=self.full.structure, spec=spec, steps=steps, entry=entry)

    def _costs(self, state: LoopState) -> Optional[RowCosts]:
        if not self.adaptive:
            return None
        if self.lone_costs is None:  # until set_lone_costs: the batch's (copies: the state is donated beside them)
            self.lone_costs = RowCosts(*(jnp.copy(x) for x in RowCosts.of(state.policy)))
        return self.lone_costs

    def set_lone_costs(self, costs: dict) -> None:
        """An adaptive loop's lone row's step costs (cost_model.CostModel.costs at batch 1; same shapes as the
        batch's, so nothing compiles)."""
        menu = self.full.spec.menu
        policy = budget_policy.init_state(menu, batch=1, **{k: v for k, v in costs.items() if k in (
            "cost_ar", "cost_draft", "cost_verify", "cost_slope", "context0")})
        self.lone_costs = RowCosts.of(policy)

    def compile(self, state: LoopState) -> None:
        """Every program but the full batch's any-settings one (the bucket's loop compiled it): in threads on a CPU
        (engine.compile_programs)."""
        full = (self.batch, False, self.full.steps)
        entries = self.full.entries() if self.adaptive else (None,)
        keys = [key + (e,) for key in self.keys() if key != full for e in entries
                if key + (e,) not in self._compiled]
        self._compiled.update(engine.compile_programs(lambda key: self._lower(state, *key).compile(), keys))

    def pick(self, live: int, greedy: bool, lone: bool = False) -> tuple:
        """(rows the chunk computes, greedy, steps) for `live` rows holding requests; lone: nothing waits for a row
        (a single live row then takes the long chunk)."""
        if self.adaptive:
            if lone and live == 1 and self.batch > 1:
                return 1, greedy, self.lone_steps or self.full.steps
            return self.batch, greedy, self.full.steps
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
        rows = None
        if k < self.batch:
            rows = self._rows.get((k, *live_rows))
            if rows is None:
                rows = self._device_rows(live_rows, k)

        def run(entry: Optional[int]) -> engine.ChunkOutput:
            given = state._replace(counts=None) if greedy else state
            program = self._compiled[key + (entry,)]
            if rows is None:
                return program(self.full.leaves, self.full.loop_weights, given)
            return program(self.full.leaves, self.full.loop_weights, given, rows, self._costs(state))

        out = self.full.call_entry(state, lambda _, entry: run(entry)) if self.adaptive else run(None)
        if greedy:
            out = out._replace(state=out.state._replace(counts=counts))
        return out

    def _device_rows(self, live_rows: list, k: int) -> jax.Array:
        """The k rows a chunk of `live_rows` computes (the live rows, then free ones: distinct), on the device."""
        rows = list(live_rows)
        taken = set(rows)
        rows += [r for r in range(self.batch) if r not in taken][:k - len(rows)]  # distinct: padding rows are free
        if len(self._rows) >= ROWS_KEPT:
            self._rows.clear()
        device = self._rows[(k, *live_rows)] = jax.device_put(np.asarray(rows, np.int32))
        return device

    def lone_loop(self) -> "LoneLoop":
        """An adaptive loop's lone row's greedy program on row 0, as engine.calibrate times a loop (the calibration's
        rows are greedy)."""
        return LoneLoop(self)


class LoneLoop:
    """RowPrograms' lone row (row 0, greedy) as a chunked loop: a call on the batch's state, `steps` a chunk."""

    def __init__(self, programs: RowPrograms):
        self.programs = programs
        self.steps = programs.pick(1, True, lone=True)[2]

    def __call__(self, state: LoopState) -> engine.ChunkOutput:
        return self.programs(state, [0], True, lone=True)
