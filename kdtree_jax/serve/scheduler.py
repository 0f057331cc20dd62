"""Continuous batching: one background thread owns every JAX call and runs the decode loop chunk after chunk,
admitting waiting requests into free batch rows between chunks and retiring finished ones.

Why one thread: JAX dispatch from several threads at once would interleave programs that donate the same state, and
the server's asyncio loop must never block on the device. The web side talks to this thread through `submit`
(a locked deque), `cancel` (a flag the thread reads) and, back, each request's `emit` callback (the server passes
one that hands events to its asyncio loop with call_soon_threadsafe).

The *bucket* is the one batch of `max_batch` rows with its pool, state and compiled chunk program. Every request
shares it whatever its sampling settings: each row's temperature, top-k, top-p, penalties and random stream are data
in the loop state, set when the row is admitted (speculative/sampling.py), so the program is compiled with
SpecConfig(sampled=True, penalties=True) and serves any mix. The cost of that generality is paid by greedy loads too:
every step filters each tree node's logits with its row's settings (a sort of the vocabulary per node; a greedy row
then takes the argmax of what is left) and keeps each row's token counts for the penalties, where a greedy-only
program takes the argmax of the raw logits. The shapes of everything the bucket runs are fixed when it is made — the
pool, the chunk program, row admission (a prefill padded to a power-of-two length bucket), row reset — so a steady
load of any mix of settings compiles nothing: `compile_count()` counts XLA compiles (the /metrics line
`kdtree_serve_compiles_total`).

The bucket's cycle (one chunk stays in flight while any row is live: the host reads chunk i while the device runs
chunk i + 1, so the device never waits for the host's reads, deliveries and admissions):

    admit waiting requests into free rows: the prompts of one length bucket prefilled together (a k-row pool as long
        as the bucket, k from a few group sizes: 1, 4, 16) and each copied into its row, one dispatch of one program
        a group (admission.admit_group), queued behind the chunk in flight;
    launch the next chunk (at most `chunk_steps` steps, the state stays on the device): with a fixed budget, the
        smallest program that holds the live rows, greedy-only while every live row is greedy, and a lone row's
        chunk `lone_chunk_steps` long while nothing waits (programs.py);
    read the new rows' first tokens (their prefills ran before this chunk) and stream them;
    read the previous chunk: hand each live row its new tokens; a row that reached its max_tokens, or was cancelled
        (client gone, stop string), is free for the next admission (it idles through the chunk in flight, as
        spec_decode.py --refill's rows do); the rows freed since the last dispatch are reset together before the
        next one (admission.reset_rows: their KV slots back to the pool; a dispatch per row cost the host 0.8 ms on
        the H200).

Per-token work stays off this thread: a request's `emit` hands its token ids to the event loop, where api.py makes
the text (incrementally: api.TextStream) and the server-sent events.

Each request's own max_tokens is enforced on the device by where its output starts: the loop stops a row once its
output count reaches the bucket's out width, so a row whose count starts at (width - max_tokens) stops after exactly
max_tokens tokens (admission.admit_row), with no extra steps and no per-request compile.

The adaptive tree budget (Settings.budget "auto", the default): the bucket's loop has the menu of DDTree budgets
(validation.adaptive_menu) compiled in, one chunk program per entry, and every chunk its policy
(speculative/budget_policy.py) picks one, or autoregressive steps that skip the drafter. The policy needs what a step
costs on this device: when the bucket is made (after its chunk programs compile; that is the warm-up, before the server says it is serving) the bucket takes the costs
from the cost-model cache (speculative/cost_model.py) or, when none is cached for this model pair, device, batch size
and program (or Settings.calibrate asks for a fresh measurement once per process),
measures them: a short fixed prompt (CALIBRATION_TEXT) is admitted into every row, engine.calibrate times each menu
entry on copies of that state with the loop's own program (nothing compiles), and the rows are reset. The policy's
state lives in the bucket's loop state, so what it learned (its calibration bins, its counters) carries from request
to request; after each chunk the scheduler copies it with the chunk's other counters (one read a chunk) and /metrics
reports the steps per budget, the steps without the drafter and the predicted vs observed tau.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import operator
import threading
import time
import traceback
import types
from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax import kv_pool
from kdtree_jax.serve.programs import RowPrograms
from kdtree_jax.sharding import replicate
from kdtree_jax.speculative import admission, budget_policy, cost_model, engine, validation
from kdtree_jax.speculative.sampling import SamplingParams

# --- compile counting ---------------------------------------------------------------------------------------------
# Every XLA compile (a jit cache miss, an eager op on a new shape) reports this event; counting it is how /metrics and
# the tests see that a steady load compiles nothing.
_COMPILES = [0]
_LISTENING = [False]


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


def compile_count() -> int:
    """XLA compiles in this process since the scheduler module started listening."""
    if not _LISTENING[0]:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        _LISTENING[0] = True
    return _COMPILES[0]


compile_count()  # listen from import on


class HostSpans:
    """Where the decode thread's time goes, by phase: seconds and calls since start (/metrics'
    kdtree_serve_decode_thread_seconds_total, benchmarks/serve_host.py). A phase's time includes any wait for the
    device inside it (a read of a chunk's tokens waits for that chunk): on a CPU, whose cores are the device, that is
    the decode itself; the host's own work is the rest."""

    def __init__(self):
        self.seconds: dict = collections.defaultdict(float)
        self.calls: dict = collections.defaultdict(int)

    def add(self, phase: str, t0: float) -> float:
        """Count perf_counter() - t0 to `phase`: -> now (the next span's start)."""
        now = time.perf_counter()
        self.seconds[phase] += now - t0
        self.calls[phase] += 1
        return now

    def snapshot(self) -> dict:
        return {k: (self.seconds[k], self.calls[k]) for k in list(self.seconds)}

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def max_tokens_for(prompt_len: int, *, max_len: int, num_nodes: int, depth: int, context: int) -> int:
    """The most new tokens a prompt of this length may ask for: the pool row (max_len positions) holds the prompt, the
    output and one verify tree (num_nodes, the drafter's depth) past it; the model's context holds prompt + output."""
    return min(max_len - prompt_len - num_nodes - depth - 1, context - prompt_len)


class QueueFull(Exception):
    """The waiting queue is at --max-queue: the server answers 429."""


class NotAccepting(Exception):
    """The scheduler is draining or stopped: the server answers 503."""


@dataclasses.dataclass(eq=False)
class Request:
    """One completion as the scheduler sees it: token ids in, token ids out through `emit`.

    emit(kind, value) is called from the scheduler thread: ("tokens", [ids]) as they arrive (the first call holds the
    first token), then once ("done", "length" | "cancelled") or ("error", message)."""

    prompt: list
    max_tokens: int
    emit: Callable[[str, object], None]
    temperature: float = 0.0  # the sampling settings (speculative/sampling.py's SamplingParams; 0: greedy)
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    id: int = dataclasses.field(default_factory=itertools.count().__next__)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by any thread; the scheduler frees the row at its next iteration
    cancel_reason: str = "cancelled"  # what the "done" event says then: "cancelled" (client gone) or "stop"
    delivered: int = 0  # tokens handed to emit
    finished: bool = False

    def __post_init__(self):
        # Checked here, on the caller's thread: a bad setting is the caller's ValueError, not a failed decode step.
        self.sampling = SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                       repetition_penalty=self.repetition_penalty,
                                       presence_penalty=self.presence_penalty,
                                       frequency_penalty=self.frequency_penalty)
        # Whether the row may run a greedy-only program (programs.py), read by every chunk's launch: once here.
        self.greedy = not (self.sampling.sampled or self.sampling.penalised)


def _as_int32(x):
    """A counter's bits as int32 (a float32's bit-cast, so it comes back exactly)."""
    x = jnp.ravel(x)
    return jax.lax.bitcast_convert_type(x, jnp.int32) if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.int32)


@jax.jit
def _host_view(tokens, start, num_out, hist, num_free, policy: Optional[tuple]):
    """Everything the host reads of a chunk as one int32 vector (`ChunkRead.of` takes it apart): its tokens, start and
    num_out, the acceptance histogram and the pool's free slots (/metrics) and, in an adaptive loop, the budget
    policy's counters (budget_policy.SUMMARY_FIELDS, int32 and float32 arrays). One array: a read of each small array
    on its own is a copy and a wait of its own, and each releases and retakes the GIL, which the HTTP server's event
    loop may hold for up to the switch interval (benchmarks/serve_dispatch.py). Dispatched behind the chunk, before
    the next chunk donates its state."""
    parts = [tokens.ravel(), start, num_out, hist, num_free[None]]
    if policy is not None:
        parts += list(policy)
    return jnp.concatenate([_as_int32(x) for x in parts])


# The policy's counters in SUMMARY_FIELDS' order as a tuple: a dict was built, and flattened with its keys sorted, at
# every chunk's launch.
_summary_fields = operator.attrgetter(*budget_policy.SUMMARY_FIELDS)


def host_view(out: engine.ChunkOutput):
    """`_host_view` of a chunk's output (on device, asynchronous)."""
    state = out.state
    policy = None if state.policy is None else _summary_fields(state.policy)
    return _host_view(out.tokens, out.start, out.num_out, state.accepted_hist, state.cache.num_free, policy)


class ChunkRead(NamedTuple):
    """A chunk's host view taken apart (numpy): tokens [B, W], start [B], num_out [B], hist [D + 1], num_free, and the
    policy's counters (an object with budget_policy.SUMMARY_FIELDS; None without the adaptive budget)."""

    tokens: np.ndarray
    start: np.ndarray
    num_out: np.ndarray
    hist: np.ndarray
    num_free: int
    policy: Optional[types.SimpleNamespace]

    @staticmethod
    def of(flat: np.ndarray, out: engine.ChunkOutput) -> "ChunkRead":
        """`flat` (the host view read) laid out by `out`'s shapes and dtypes (nothing is read from the device)."""
        batch, width = out.tokens.shape
        sizes = [batch * width, batch, batch, out.state.accepted_hist.shape[0], 1]
        policy = out.state.policy
        fields = [getattr(policy, k) for k in budget_policy.SUMMARY_FIELDS] if policy is not None else []
        pieces = np.split(np.asarray(flat), np.cumsum(sizes + [int(np.prod(x.shape)) for x in fields])[:-1])
        tokens, start, num_out, hist, num_free = pieces[:5]
        counters = None
        if policy is not None:
            counters = types.SimpleNamespace(**{
                k: (v.view(np.float32) if jnp.issubdtype(x.dtype, jnp.floating) else v).reshape(x.shape)
                for k, x, v in zip(budget_policy.SUMMARY_FIELDS, fields, pieces[5:])})
        return ChunkRead(tokens.reshape(batch, width), start, num_out, hist, int(num_free[0]), counters)


def adaptive_row_programs(setting: Optional[bool], backend: str) -> bool:
    """Whether an adaptive bucket builds row programs: Settings.adaptive_row_programs, where None means on a GPU."""
    return backend == "gpu" if setting is None else bool(setting)


def admit_group_sizes(batch: int, groups: Union[bool, tuple] = True) -> tuple:
    """The admission group sizes (Settings.admit_groups): each is a program per prompt bucket, so few of them."""
    if groups is True:
        sizes, k = [], 1
        while k <= batch:
            sizes.append(k)
            k *= 4
    else:
        sizes = list(groups) if groups else []
    sizes = sorted(set(int(k) for k in sizes) | {1})
    if sizes[-1] > batch:
        raise ValueError(f"admission group sizes must be in [1, {batch}] (--max-batch); got {tuple(sizes)}")
    return tuple(sizes)


class _Stopped(Exception):
    """stop() came while the warm-up was measuring a cost model: the warm-up ends there."""


class Bucket:
    """`max_batch` rows decoding together, each with its own sampling settings: the pool, the loop state, who owns
    which row."""

    KEY = "batch"  # its name in the metrics

    def __init__(self, sched: "Scheduler", measured: Optional[dict] = None):
        """measured: the cost info of the calibration a bucket made just before this one (Scheduler._get_bucket):
        its point is in the cache, and this bucket takes the cache's verdict even under Settings.calibrate."""
        self.sched = sched
        target, drafter = sched.target, sched.drafter
        s = sched.settings
        self.spec = sched.spec()
        # The adaptive budget whose cached costs say no budget pays here (a CPU): the plain autoregressive program.
        self.refusal = None
        refusal_info = None  # the cost info of a refused bucket (no costs of its own to prepare)
        if self.spec.menu and s.costs is None and (not s.calibrate or measured is not None):
            self.refusal = sched.cached_refusal(self.spec.menu)
            if self.refusal is not None:
                self.spec = dataclasses.replace(self.spec, menu=(), budget=0)
                info = {**self.refusal, "seconds": 0.0}
                if measured is not None:
                    info.update(calibrated=True, seconds=measured.get("seconds", 0.0))
                sched.metrics.set_cost_info(self.KEY, info)
                refusal_info = info
                sched.say(f"[tree-budget cost model ({self._label()}, {'measured now' if measured else 'cached'}): "
                          f"serving autoregressively: {self.refusal['why']}]")
        self.drafter = drafter if self.spec.budget > 0 else None  # budget 0: autoregressive, no drafter pass
        self.batch, self.max_len = s.max_batch, s.max_len
        depth = self.drafter.cfg.depth if self.drafter is not None else 0
        cfg = target.cfg
        dtype = target.dtype
        cache = kv_pool.init_cache(cfg, self.batch, self.max_len, dtype=dtype)
        dcache = self.drafter.init_cache(self.batch, self.max_len) if self.drafter is not None else None
        moe = [layer.mlp for layer in target.layers if layer.is_moe]
        # The adaptive budget's policy and lazy drafter context: placeholder costs until _prepare_costs (same shapes).
        # The chunk programs by the live rows' count and settings (programs.py; the adaptive budget's only with
        # Settings.adaptive_row_programs, by default on a GPU; a sharded target keeps the one program).
        adaptive_rows = adaptive_row_programs(s.adaptive_row_programs, jax.default_backend())
        row_programs = bool(sched.mesh is None and s.row_programs and (not self.spec.menu or adaptive_rows))
        # Its step log and ring hold the longest chunk: a lone row's (RowPrograms) may be longer than the others.
        ring = max(s.chunk_steps, s.lone_chunk_steps if row_programs else 0)
        adaptive = (engine.adaptive_parts(target, self.drafter, self.spec, self.batch, chunk_steps=ring)
                    if self.spec.menu else None)
        self.state = engine.initial_state(
            cache, dcache, jnp.zeros((self.batch,), jnp.int32), max_new_tokens=sched.max_new_tokens,
            width=depth + 1, stop_ids=np.array([-1], np.int32), key=jax.random.key(0),
            expert_load=engine.ExpertLoad.zeros(len(moe), moe[0].num_slots if moe else 0, 1),
            active=np.zeros((self.batch,), bool), adaptive=adaptive,
            counts=np.zeros((self.batch, cfg.vocab_size), np.int32) if self.spec.penalties else None)
        # Committed to the device like every state a jitted call returns: a program's cache key includes that, so an
        # uncommitted first state would compile row admission and the chunk a second time on the next request.
        self.state = sched.place(self.state)
        self.loop = engine.ChunkedLoop(target, self.drafter, self.spec, steps=s.chunk_steps)
        # Compiled ahead of time, as engine.generate does: the bucket owns its program.
        self.loop.compile(self.state)
        # Admission: waiting prompts of one bucket go in together, in groups of these sizes (Settings.admit_groups).
        self.plan = admission.AdmitPlan(self.loop.structure, self.loop.hidden_layers, self.spec,
                                        admission.PREFILL_CHUNK, self.loop.mesh)
        self.group_sizes = admit_group_sizes(self.batch, s.admit_groups)
        self.admit_runs: collections.Counter = collections.Counter()  # group dispatches by (size, prompt bucket)
        self.admit_programs: dict = {}  # (size, prompt bucket) -> its program compiled ahead (compile_admission)
        self.programs = None
        if row_programs:
            self.programs = RowPrograms(self.loop, self.batch, None if s.row_programs is True else s.row_programs,
                                        lone_steps=s.lone_chunk_steps)
            self.programs.compile(self.state)
        self._trace_host_views()
        self.owner: list[Optional[Request]] = [None] * self.batch
        self.inflight: collections.deque = collections.deque()  # (ChunkOutput, host_view, owners at launch)
        self.firsts: list = []  # (request, row, first token on the device) admitted, not yet delivered
        self.retired: list[int] = []  # rows freed since the last dispatch, their KV slots not yet back (reset_retired)
        self.hist_seen = np.zeros(depth + 1, np.int64)  # accepted_hist already counted into the metrics
        # The policy's counters already counted (steps per menu entry then without the drafter; predicted tokens,
        # observed tokens, sequence steps of drafted steps).
        self.chosen_seen = np.zeros(len(self.spec.menu) + 1, np.int64)
        self.sums_seen = np.zeros(3, np.float64)
        self.cost_info: Optional[dict] = refusal_info
        if self.spec.menu:
            self._prepare_costs()
        self.last_used = time.perf_counter()

    def _trace_host_views(self) -> None:
        """`host_view` compiled for every token width a chunk of this bucket returns (its steps times D + 1: the
        server's chunk and a lone row's long one), on arrays placed as a chunk's outputs are. The warm-up's one request
        runs a lone row's chunk only, so the short chunk's view compiled under the first load instead (one compile at
        concurrency 16 in each server on an H100, bead05c, serve_load_h100_80gb_hbm3)."""
        steps = {self.loop.steps}
        if self.programs is not None:
            steps |= {k[2] for k in self.programs.keys()}
        state = self.state
        for n in sorted(steps):
            tokens = self.sched.place(jnp.full((self.batch, n * state.accepted_hist.shape[0]), -1, jnp.int32))
            jax.block_until_ready(host_view(engine.ChunkOutput(state, tokens, state.num_out, state.num_out,
                                                               None, state.active)))

    # -- the adaptive budget's costs -----------------------------------------------------------------------------
    def _prepare_costs(self) -> None:
        """The policy's step costs: Settings.costs if given, else the cached cost model's point for this batch size
        and the calibration prompt's context, else (or once per process with Settings.calibrate) measured now; the
        same for one row when a lone row has its own programs (RowPrograms: set_lone_costs)."""
        sched, s = self.sched, self.sched.settings
        t0 = time.perf_counter()
        lone_programs = self.programs is not None and self.programs.adaptive and self.batch > 1
        if s.costs is not None:  # given costs price the lone row's steps too
            costs, info = dict(s.costs), {"cost_model": "given", "calibrated": False}
            lone = costs
        else:
            model = sched.cost_model()
            prompt = sched.calibration_prompt()
            context = float(len(prompt))  # calibrate's context: the rows' mean length (the prompt's)
            path = str(model.path)
            fresh = s.calibrate and path not in sched.measured
            measured = [rows for rows in [self.batch] + ([1] if lone_programs else [])
                        if fresh or model.lookup(rows, context) is None]
            for rows in measured:
                sched.say(f"[measuring the tree-budget cost model: {self._label(rows)} (once per model pair, device, "
                          f"batch size and program; cached in {model.path.parent}) ...]")
                model.add(self._calibrate(prompt, lone=rows != self.batch))
            if measured:
                model.save()
                sched.measured.add(path)
            costs = model.costs(self.batch, context)
            lone = model.costs(1, context) if lone_programs else None
            info = {"cost_model": path, "calibrated": bool(measured), "context": context}
        info["seconds"] = time.perf_counter() - t0
        # A new policy state with these costs, the counters kept (zero here); committed like the rest of the state.
        self.state = sched.place(engine.with_costs(self.state, self.spec, costs))
        info["costs_ms"] = budget_policy.summary(jax.device_get(self.state.policy), self.spec.menu)["costs_ms"]
        if lone_programs:
            self.programs.set_lone_costs(lone)
            # What the lone programs price with (given costs may leave cost_verify out: init_state fills it).
            ar, draft, verify = jax.device_get(self.programs.lone_costs[:3])
            info["lone_costs_ms"] = {"ar": float(ar), "draft": float(draft),
                                     "verify": np.asarray(verify).round(4).tolist()}
        self.cost_info = info
        sched.metrics.set_cost_info(self.KEY, info)
        how = (f"measured in {info['seconds']:.1f} s" if info["calibrated"] else
               "given" if s.costs is not None else "cached")
        for rows, ms in [(self.batch, info["costs_ms"])] + ([(1, info["lone_costs_ms"])] if lone_programs else []):
            # Entries the calibration pruned (they could not beat an autoregressive step) cost "infinity" (1e30).
            verify = ", ".join(f"{b}: {v:.3g}" for b, v in zip(self.spec.menu, ms["verify"]) if v < 1e29)
            sched.say(f"[tree-budget cost model ({self._label(rows)}, {how}): autoregressive step {ms['ar']:.3g} ms, "
                      f"drafter {ms['draft']:.3g} ms, verify by budget {{{verify}}} ms]")

    def _label(self, rows: Optional[int] = None) -> str:
        batch = self.sched.settings.max_batch  # (the refusal's line comes before self.batch is set)
        return f"batch {batch}" if rows in (None, batch) else f"a lone row of batch {batch}"

    def _calibrate(self, prompt: list, lone: bool = False) -> dict:
        """engine.calibrate on this bucket's rows, each holding `prompt` (calibrate times copies of that state with the
        loop's own program, or with lone: the lone row's, RowPrograms.lone_loop), then the rows emptied again: -> the
        cost model point."""
        def progress(phase, done, total):
            if self.sched.stopping_warmup():
                raise _Stopped()

        try:
            self._admit_prepared([self._prepare(prompt, row, None, 0) for row in range(self.batch)])
            loop = self.programs.lone_loop() if lone else self.loop
            return engine.calibrate(loop, self.state, self.spec, depth=self.drafter.cfg.depth,
                                    on_progress=progress, rows=1 if lone else None)
        finally:
            self.state = self.loop.reset_rows(self.state, range(self.batch))

    def _publish_policy(self, policy) -> None:
        """A chunk's copy of the policy state (numpy) into the metrics: what changed since the last chunk."""
        summary = budget_policy.summary(policy, self.spec.menu)
        chosen = np.asarray(policy.chosen, np.int64)
        sums = np.array([policy.predicted_tokens, policy.observed_tokens, policy.sequence_steps], np.float64)
        self.sched.metrics.add_policy(self.KEY, self.spec.menu, chosen - self.chosen_seen, sums - self.sums_seen,
                                      summary)
        self.chosen_seen, self.sums_seen = chosen, sums

    # -- rows ----------------------------------------------------------------------------------------------------
    def free_rows(self) -> list[int]:
        return [r for r, req in enumerate(self.owner) if req is None]

    def busy(self) -> int:
        return self.batch - len(self.free_rows())

    def idle(self) -> bool:
        return self.busy() == 0 and not self.inflight

    def _prepare(self, prompt, row: int, max_tokens: Optional[int], seed: int,
                 sampling: Optional[SamplingParams] = None) -> admission.Prepared:
        return admission.prepare(self.state, prompt, row, max_tokens, seed, self.spec, self.loop.vocab_size, sampling)

    def groups(self, count: int) -> list[int]:
        """The admission group sizes that take `count` prompts of one bucket: the largest first."""
        out = []
        while count:
            k = max(g for g in self.group_sizes if g <= count)
            out.append(k)
            count -= k
        return out

    def _admit_prepared(self, prepared: list) -> list:
        """Admit prepared prompts (each with its own free row) in as few dispatches as the group sizes allow, each
        bucket's prompts together, oldest first: -> [(first tokens on the device, index in them)] in their order.
        A retired row that takes a prompt here needs no reset of its own: the admission empties the row first
        (admission._adopt_row_state), and a reset queued after it would empty the admitted row. The other retired
        rows stay for the next dispatch's reset (launch): the pool has room for every row at max_len
        (kv_pool.init_cache), so an admission never waits for their slots. Under load every retired row is taken
        at once, which saves a dispatch (0.23-0.27 ms of the decode thread on an H100, serve_dispatch.py) per
        chunk that retires rows."""
        taken = {p.row for p in prepared}
        self.retired = [row for row in self.retired if row not in taken]
        by_bucket: dict = {}
        for i, p in enumerate(prepared):
            by_bucket.setdefault(p.ids.size, []).append(i)
        firsts = [None] * len(prepared)
        for bucket, items in by_bucket.items():
            for k in self.groups(len(items)):
                group, items = items[:k], items[k:]
                self.state, first = admission.admit_group(self.loop.leaves, self.plan, self.state,
                                                          [prepared[i] for i in group],
                                                          program=self.admit_programs.get((k, bucket)))
                self.admit_runs[(k, bucket)] += 1
                for j, i in enumerate(group):
                    firsts[i] = (first, j)
        return firsts

    def admit(self, reqs: list[Request]) -> list[Request]:
        """Give the requests free rows, oldest first: each prompt prefilled with the others of its bucket in one
        dispatch (a group: `groups`), queued behind the chunk in flight; `deliver_firsts` streams the first tokens once
        the next chunk is launched, so the device runs that chunk while the host waits for the prefills and hands the
        tokens out. The row takes the request's sampling settings and a random stream of its own from its seed (else
        its id), so a seeded request's tokens do not depend on the batch it joins nor on its group. A request the
        admission's checks refuse (admission.prepare) gets its error alone and takes no row: the next one does, and
        the group goes in without it. -> the requests left waiting (no row for them)."""
        t = time.perf_counter()
        ready, rows = [], self.free_rows()
        while reqs and len(ready) < len(rows):
            req, reqs = reqs[0], reqs[1:]
            seed = (req.seed if req.seed is not None else req.id) & 0x7FFFFFFF
            row = rows[len(ready)]
            try:
                prepared = self._prepare(req.prompt, row, req.max_tokens, seed, req.sampling)
            except ValueError as e:
                req.finished = True
                self.sched.metrics.add("requests_error")
                req.emit("error", f"admission refused the request: {' '.join(str(e).split())[:300]}")
                continue
            ready.append((req, row, prepared))
        firsts = self._admit_prepared([p for _, _, p in ready])
        for (req, row, _), (first, j) in zip(ready, firsts):
            self.owner[row] = req
            self.firsts.append((req, row, first, j))
        self.sched.spans.add("admit.dispatch", t)
        self.last_used = time.perf_counter()
        return reqs

    def compile_admission(self, prompt: list) -> None:
        """Every admission group's program for every prompt bucket a row can take: for `prompt`'s (the warm-up's) by
        running it, each group size admitted into the first rows, which are then emptied (jax's own cache keeps the
        programs; the row reset compiles too); for the others ahead of time, in threads (XLA compiles outside the
        GIL), into admit_programs. Compiled on first use instead, each longer prompt bucket stalled the requests
        behind it while serving (the CPU load test at concurrency 16, 8981ae9: 3 admission compiles, TTFT p90 8.6 s
        against a p50 of 0.4)."""
        for k in self.group_sizes:
            firsts = self._admit_prepared([self._prepare(prompt, row, None, 0) for row in range(k)])
            jax.block_until_ready(firsts[0][0])
            self.state = self.loop.reset_rows(self.state, range(k))
        max_len = self.state.cache.max_len  # what admission.prepare pads to
        ran = admission.prompt_bucket(len(prompt), max_len)
        buckets, n = [], 1
        longest = self.sched.longest_prompt()
        if self.sched.settings.warmup_prompt_tokens is not None:  # the longer buckets compile on first use
            longest = min(longest, self.sched.settings.warmup_prompt_tokens)
        while n <= longest:
            buckets.append(admission.prompt_bucket(n, max_len))
            n = buckets[-1] + 1
        pairs = [(k, b) for b in buckets if b != ran for k in self.group_sizes if (k, b) not in self.admit_programs]
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
        self.admit_programs.update(engine.compile_programs(
            lambda pair: admission.lower_group(self.loop.leaves, self.plan, shapes, *pair).compile(), pairs))

    def deliver_firsts(self) -> None:
        """Stream the first token of every row admitted since the last call (one read for all of them: it waits for
        their prefills, not for the chunk launched after them)."""
        if not self.firsts:
            return
        spans, firsts = self.sched.spans, self.firsts
        self.firsts = []
        t = time.perf_counter()
        tokens = jax.device_get([first for _, _, first, _ in firsts])
        t = spans.add("admit.first_token_read", t)
        for (req, row, _, j), token in zip(firsts, tokens):
            if self.owner[row] is not req or req.finished:  # cancelled meanwhile
                continue
            self.sched.metrics.first_token(time.perf_counter() - req.submitted)
            self._deliver(row, req, [int(token[j])])
        spans.add("deliver", t)

    def _deliver(self, row: int, req: Request, ids: list) -> None:
        ids = ids[:req.max_tokens - req.delivered]
        if ids:
            req.delivered += len(ids)
            self.sched.metrics.add("generated_tokens", len(ids))
            req.emit("tokens", ids)
        if req.delivered >= req.max_tokens:
            self._retire(row, "length")

    def _retire(self, row: int, reason: str) -> None:
        """The row's request is over: tell it, free the row; its KV slots go back to the pool with the other rows
        retired before the next dispatch (reset_retired)."""
        req = self.owner[row]
        self.owner[row] = None
        self.retired.append(row)
        if not req.finished:
            req.finished = True
            self.sched.metrics.add("requests_cancelled" if reason == "cancelled" else "requests_ok")
            req.emit("done", reason)

    def reset_retired(self) -> None:
        """Empty every row retired since the last dispatch (their KV slots back to the pool), in one dispatch queued
        behind the chunk in flight; called before a chunk is launched (it would decode them) and when nothing is in
        flight (the pool's gauge). An admission takes retired rows without it (`_admit_prepared`)."""
        if not self.retired:
            return
        t = time.perf_counter()
        self.state = self.loop.reset_rows(self.state, self.retired)
        self.retired = []
        self.sched.spans.add("reset_rows", t)

    def sweep_cancelled(self) -> None:
        for row, req in enumerate(self.owner):
            if req is not None and req.cancelled:
                self._retire(row, req.cancel_reason)

    # -- chunks --------------------------------------------------------------------------------------------------
    def launch(self) -> None:
        """Enqueue one chunk (asynchronous: the device runs it while the host reads the previous one)."""
        self.reset_retired()
        t = time.perf_counter()
        if self.programs is not None:
            live = [r for r, req in enumerate(self.owner) if req is not None]
            greedy = all(self.owner[r].greedy for r in live)
            # Nothing waiting for a row (len of a deque: no lock needed for a hint): a lone row may take a long chunk.
            out = self.programs(self.state, live, greedy, lone=not self.sched._waiting)
        else:
            out = self.loop(self.state)
        self.state = out.state
        self.inflight.append((out, host_view(out), list(self.owner)))
        self.last_used = self.sched.spans.add("launch", t)

    def collect(self) -> None:
        """Read the oldest chunk in flight and hand each row's new tokens to the request that owned the row then
        (a row retired meanwhile, or already given to another request, drops them)."""
        spans = self.sched.spans
        t = time.perf_counter()
        out, view, owners = self.inflight.popleft()
        read = ChunkRead.of(jax.device_get(view), out)
        t = spans.add("collect.read", t)
        self.sched.metrics.add_steps(read.hist.astype(np.int64) - self.hist_seen)
        self.hist_seen = read.hist.astype(np.int64)
        if read.policy is not None:
            self._publish_policy(read.policy)
        self.sched.metrics.set_pool(self.KEY, read.num_free, self.state.cache.num_slots)
        for row, req in enumerate(owners):
            if req is None or self.owner[row] is not req or req.finished:
                continue
            n = int(read.num_out[row]) - int(read.start[row])
            if n > 0:
                self._deliver(row, req, read.tokens[row, :n].tolist())
        spans.add("collect.deliver", t)

    def refresh_pool(self) -> None:
        """Publish the pool's free slots when no chunk is in flight to do it (after the last row retired)."""
        if not self.inflight:
            self.reset_retired()
            self.sched.metrics.set_pool(self.KEY, int(self.state.cache.num_free), self.state.cache.num_slots)


@dataclasses.dataclass
class Settings:
    """The scheduler's static settings (the server's flags)."""

    max_batch: int = 8  # batch rows
    max_len: int = 1024  # pool positions per row: prompt + max_tokens + one verify tree must fit
    # "auto": the adaptive budget (each chunk picks from validation.adaptive_menu's menu, 0: autoregressive steps without
    # the drafter); a number: DDTree nodes per step besides the root, every step; 0: autoregressive.
    budget: Union[int, str] = "auto"
    menu: Optional[tuple] = None  # "auto": the budgets a chunk picks from (default budget_policy.DEFAULT_MENU)
    calibrate: bool = False  # "auto": measure the cost model again (once per process and model) instead of the cache's
    costs: Optional[dict] = None  # "auto": the policy's costs as CostModel.costs gives them (no cache, no calibration)
    calibration_prompt: Optional[tuple] = None  # token ids the calibration decodes (default: CALIBRATION_TEXT's bytes)
    topk: int = 4
    tree_temperature: float = 1.0
    # Decode steps per chunk: smaller streams sooner and admits sooner, larger costs less host work.
    chunk_steps: int = engine.default_chunk_steps(continuous=True)
    # The chunk programs by live rows (programs.py): True: every power of two below max_batch (the adaptive budget: a
    # lone row's, one per menu entry), a tuple: those row counts (max_batch is always one; ignored by the adaptive
    # budget), False: the one program for every row and setting.
    row_programs: Union[bool, tuple] = True
    # With row programs: a lone live row's chunk while nothing waits for a row (programs.RowPrograms: the CLI's chunk,
    # its fixed costs over twice the tokens); 0, or not above chunk_steps: none.
    lone_chunk_steps: int = engine.DEFAULT_CHUNK_STEPS
    # The adaptive budget's row programs (programs.RowPrograms: a lone row's, priced at one row's costs, and the batch's
    # greedy ones, each per menu entry). None: on where JAX's backend is a GPU, off elsewhere (a CPU's cached cost
    # model serves autoregressively, with the plain program's row programs, so they would only add compiles). They
    # double the adaptive bucket's start-up compiles; without them a lone request on a GPU runs the whole batch's
    # program, every empty row's tree verified too, priced at the batch's step (the speculative server at concurrency
    # 1: 0.61x the autoregressive one on an H100 without them, f2afe17; 1.04x with them on an H200). The greedy text
    # of a request alone and among others differed with them (sessions 31, 33) because their long chunks fed
    # api.TextStream more than its window at once, which sent part of the text twice (fixed in api.TextStream.text),
    # not because of the programs.
    adaptive_row_programs: Optional[bool] = None
    max_queue: int = 256  # waiting requests beyond which submit raises QueueFull (429)
    # Admission groups (Bucket.admit): True: 1 and every power of 4 up to max_batch; a tuple: those sizes (1 is always
    # one); False: every prompt alone.
    admit_groups: Union[bool, tuple] = True
    # The warm-up compiles row admission for the prompt buckets of prompts up to this many tokens (None: every prompt a
    # row can take); a longer prompt's bucket compiles on its first use, stalling the rows behind it.
    warmup_prompt_tokens: Optional[int] = None


# Chunks the warm-up's request (a few tokens) may take before the warm-up fails instead of waiting for good.
WARMUP_MAX_CHUNKS = 64


# What the adaptive budget's calibration decodes in every row (Settings.calibration_prompt: its tokens, the server's
# tokenizer's encoding, at most CALIBRATION_TOKENS of them: the warm-up's prefill bucket, so no other program compiles).
CALIBRATION_TEXT = ("def fibonacci(n):\n    if n < 2:\n        return n\n"
                    "    return fibonacci(n - 1) + fibonacci(n - 2)\n")
CALIBRATION_TOKENS = 16


class Scheduler:
    """The decode thread. start() runs it; submit() / cancel() from any thread; stop() drains and joins.

    say: a callable for the start-up's progress lines (the command line prints them on stderr); None: silent."""

    def __init__(self, target, drafter, settings: Settings, metrics, say: Optional[Callable[[str], None]] = None):
        # A sharded target (sharding.shard_model, checkpoint.load_sharded) brings its mesh: the drafter and the whole
        # loop state (pool, rows, policy) live whole on every device of it, as engine.setup places them for generate.
        self.mesh = getattr(target, "mesh", None)
        if self.mesh is not None and drafter is not None:
            drafter = replicate(drafter, self.mesh)
        self.target, self.drafter, self.settings, self.metrics = target, drafter, settings, metrics
        self._say = say
        budget = settings.budget
        if isinstance(budget, str):  # "auto": the menu (empty without a drafter: autoregressive)
            self.menu = validation.adaptive_menu(budget, settings.menu, drafter, "ddtree", settings.topk)
            self.budget = max(self.menu) if self.menu else 0
        else:
            if isinstance(budget, bool) or int(budget) != budget or budget < 0:
                raise ValueError(f"budget must be 'auto' or an integer >= 0; got {budget!r}")
            self.menu, self.budget = (), int(budget)
        self.speculative = drafter is not None and self.budget > 0
        if not self.speculative:
            self.menu = ()
        self.depth = drafter.cfg.depth if self.speculative else 0
        self.num_nodes = self.budget + 1 if self.speculative else 1
        self.measured: set = set()  # cost-model files measured by this process (Settings.calibrate: once each)
        self._warming = False
        if self.menu:
            metrics.set_menu(self.menu)
        # The out buffer's width bounds any request's max_tokens; the pool (max_len) is the real limit.
        self.max_new_tokens = settings.max_len
        self.bucket: Optional[Bucket] = None  # made by the warm-up or the first request
        self._waiting: collections.deque[Request] = collections.deque()
        self._lock = threading.Condition()
        self._accepting = True
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self.ready = threading.Event()  # set once start()'s warm-up is over (done, interrupted by stop() or failed)
        self.warmup_error: Optional[BaseException] = None  # what a failed warm-up on the decode thread raised
        self._free_rows = settings.max_batch  # free batch rows as of the last iteration (a hint for submit)
        self.error: Optional[str] = None
        # Called by the decode thread at the end of each iteration (after a chunk's deliveries): the engine process
        # sends the iteration's events to the HTTP process in one write (engine_process.py).
        self.on_iteration: Optional[Callable[[], None]] = None
        self.spans = HostSpans()
        metrics.spans = self.spans

    def say(self, line: str) -> None:
        if self._say is not None:
            self._say(line)

    def place(self, tree):
        """A pytree of the loop state committed where the chunk program expects it: the default device, or replicated
        over a sharded target's mesh."""
        return jax.device_put(tree, jax.devices()[0]) if self.mesh is None else replicate(tree, self.mesh)

    def spec(self) -> engine.SpecConfig:
        """The bucket's SpecConfig: one program for any sampling settings (they are each row's data)."""
        s = self.settings
        return engine.SpecConfig(tree="ddtree", budget=self.budget if self.speculative else 0, topk=s.topk,
                                 tree_temperature=s.tree_temperature, sampled=True, penalties=True,
                                 max_new_tokens=self.max_new_tokens, menu=self.menu)

    def cost_model(self) -> cost_model.CostModel:
        """The bucket's cached cost model (adaptive budget only; no points when none is cached). Its points are keyed
        by batch size (max_batch) and context (len(calibration_prompt()))."""
        return cost_model.CostModel.load(cost_model.fingerprint(self.target, self.drafter, self.spec()))

    def cached_refusal(self, menu) -> Optional[dict]:
        """engine.cached_refusal for a bucket of `menu` at --max-batch rows and the calibration prompt's context."""
        return engine.cached_refusal(self.cost_model(), menu, self.settings.max_batch,
                                     float(len(self.calibration_prompt())))

    def calibration_prompt(self) -> list:
        """The tokens the adaptive budget's calibration admits into every row."""
        prompt = self.settings.calibration_prompt
        if not prompt:
            prompt = list(CALIBRATION_TEXT.encode())
        vocab = self.target.cfg.vocab_size
        return [int(t) % vocab for t in list(prompt)[:CALIBRATION_TOKENS]]

    def stopping_warmup(self) -> bool:
        """Whether stop() came during the warm-up (which then ends at its next safe point)."""
        return self._warming and self._stop

    # -- limits the API checks before submit ------------------------------------------------------------------------
    def longest_prompt(self) -> int:
        """The longest prompt a request may have: one that leaves room for one new token (max_tokens_for)."""
        return min(self.settings.max_len - self.num_nodes - self.depth - 2,
                   self.target.cfg.max_position_embeddings - 1)

    def max_tokens_for(self, prompt_len: int) -> int:
        return max_tokens_for(prompt_len, max_len=self.settings.max_len, num_nodes=self.num_nodes, depth=self.depth,
                              context=self.target.cfg.max_position_embeddings)

    # -- the web side ---------------------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        with self._lock:
            if not self._accepting:
                raise NotAccepting("the server is shutting down")
            # Requests the free rows will take at the next admission do not count against the queue (a burst
            # arrives faster than one admission takes in).
            if len(self._waiting) >= self.settings.max_queue + self._free_rows:
                raise QueueFull(f"{len(self._waiting)} requests are waiting for a batch row "
                                f"(--max-queue {self.settings.max_queue})")
            self._waiting.append(req)
            self.metrics.add("prompt_tokens", len(req.prompt))
            self._lock.notify()

    def cancel(self, req: Request, reason: str = "cancelled") -> None:
        """Free the request's row (or drop it from the queue) at the scheduler's next iteration; idempotent.
        reason: "cancelled" (the client went away) or "stop" (the server found a stop string in its text)."""
        with self._lock:
            if not req.cancelled:
                req.cancel_reason = reason
            req.cancelled = True
            self._lock.notify()

    def queue_length(self) -> int:
        return len(self._waiting)

    def busy_rows(self) -> int:
        return 0 if self.bucket is None else self.bucket.busy()

    def _idle(self) -> bool:
        return self.bucket is None or self.bucket.idle()

    # -- the thread -----------------------------------------------------------------------------------------------
    def start(self, warmup: bool = False) -> None:
        """Run the decode thread; with warmup, it first compiles the bucket's programs (warmup()) and sets
        `ready` when that is over. The thread is not a daemon: whoever starts it must stop() it (and the interpreter
        waits for it rather than tearing it down inside a compile: a thread unwound while in XLA's native code aborts
        the process with "FATAL: exception not rethrown")."""
        self._thread = threading.Thread(target=self._run, args=(warmup,), name="kdtree-serve-decode", daemon=False)
        self._thread.start()

    def stop(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop accepting; with drain, finish what was accepted first; then end the thread. The thread leaves at its
        next safe point (after the compile or chunk in flight returns): timeout=None waits for that."""
        with self._lock:
            self._accepting = False
            if not drain:
                for req in self._waiting:
                    req.cancelled = True
                for req in self.bucket.owner if self.bucket is not None else []:
                    if req is not None:
                        req.cancelled = True
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        """Whether the decode thread is still running."""
        return self._thread is not None and self._thread.is_alive()

    def warmup(self) -> bool:
        """Compile the bucket's programs (the chunk program, row admission of every prompt bucket in every admission
        group size, row reset) and, with the adaptive budget, take its cost model from the cache or measure it, before serving, by
        running one short request on the calling thread. False if stop() came first: it returns at the next safe point
        (between compiles, calibration timings and chunks), leaving the scheduler to be stopped."""
        done = threading.Event()
        req = Request(prompt=[0] * 8, max_tokens=min(3, self.max_tokens_for(8)), emit=lambda kind, v: (
            done.set() if kind != "tokens" else None))
        if self._stop:
            return False
        self._warming = True
        try:  # the chunk program's compile, and with the adaptive budget its costs (cached or measured now)
            bucket = self._get_bucket()
        except _Stopped:
            return False
        finally:
            self._warming = False
        if self._stop:
            return False
        bucket.compile_admission(req.prompt)  # every group size's program for the warm-up's prompt bucket
        if self._stop:
            return False
        self._admit_waiting([req])
        for _ in range(WARMUP_MAX_CHUNKS):  # its few tokens take a few chunks: more is a fault, not a slow device
            if done.is_set():
                break
            if self._stop:
                return False
            bucket.launch()
            bucket.deliver_firsts()
            bucket.collect()
        else:
            raise RuntimeError(f"the warm-up's request of {req.max_tokens} tokens did not finish in "
                               f"{WARMUP_MAX_CHUNKS} chunks")
        while bucket.inflight:
            bucket.collect()
        self.metrics.reset_counts()
        self.spans.reset()  # the profile is of serving, not of the warm-up's compiles
        return True

    def _run(self, warmup: bool = False) -> None:
        finished = True
        if warmup:
            try:
                finished = self.warmup()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on `ready` (the command line)
                self.warmup_error = e
                finished = False
        self.ready.set()
        if not finished:
            return
        while True:
            t0 = time.perf_counter()
            with self._lock:
                while not self._stop and not self._waiting and self._idle():
                    self._lock.wait(0.5)
                self.spans.add("idle", t0)
                if self._stop and not self._waiting and self._idle():
                    if self.on_iteration is not None:
                        self.on_iteration()
                    return
                waiting = [r for r in self._waiting if not r.cancelled]
                for r in self._waiting:
                    if r.cancelled and not r.finished:
                        r.finished = True
                        self.metrics.add("requests_cancelled")
                        r.emit("done", r.cancel_reason)
                self._waiting.clear()
            try:
                left = self._admit_waiting(waiting)
                with self._lock:
                    self._waiting.extendleft(reversed(left))  # still first in line
                self._step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                self._fail_all(e, waiting)
            t0 = time.perf_counter()
            self._update_gauges()
            self.spans.add("gauges", t0)
            if self.on_iteration is not None:
                self.on_iteration()

    def _admit_waiting(self, waiting: list[Request]) -> list[Request]:
        """Admit what fits, oldest first: -> the requests left waiting."""
        if not waiting:
            return []
        bucket = self._get_bucket()
        bucket.sweep_cancelled()
        # The chunk in flight is not read first: the prefills queue behind it and the next chunk behind them, so the
        # device never waits for the host; a row that chunk frees takes a request at the next iteration.
        if not bucket.free_rows():
            return waiting
        left = bucket.admit(waiting)
        self._update_gauges()  # /metrics shows the new rows before their first chunk
        return left

    def _get_bucket(self) -> Bucket:
        if self.bucket is None:
            bucket = Bucket(self)
            info = bucket.cost_info
            if info is not None and info.get("calibrated") and self.cached_refusal(bucket.spec.menu) is not None:
                # Measured just now, and no budget pays at this batch size (a CPU): serve as the next start will with
                # this cache, the plain autoregressive program and its row programs, instead of the adaptive program
                # whose every step costs the whole batch (on the 2-core CPU a lone stream ran at 23 tok/s on it
                # against the CLI's 314, e0585f6).
                bucket = None  # its pool freed before the next one's
                bucket = Bucket(self, measured=info)
            self.bucket = bucket
        return self.bucket

    def _step(self) -> None:
        """One chunk if any row is live, launched before the host reads anything: then the new rows' first tokens
        (their prefills ran before this chunk) and the chunk before it. While a row is live one chunk stays in flight,
        full batch or not, so the device never waits for the host's reads, deliveries and admissions (at the price of
        a finished row idling through the chunk in flight, as spec_decode.py --refill's loop does). Before, a batch
        with a free row read each chunk before launching the next; a request then waited for the chunk running
        and no longer, but every chunk waited for the host."""
        bucket = self.bucket
        if bucket is None:
            return
        bucket.sweep_cancelled()
        if bucket.busy():
            bucket.launch()
        bucket.deliver_firsts()
        while len(bucket.inflight) > (1 if bucket.busy() else 0):
            bucket.collect()

    def _fail_all(self, e: Exception, admitting: list[Request]) -> None:
        """Fail every request in a row and those being admitted (the others still wait in the queue)."""
        message = f"decode failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        traceback.print_exc()
        self.error = message
        with self._lock:
            queued = set(self._waiting)
        for req in admitting:
            if not req.finished and req not in queued:
                req.finished = True
                self.metrics.add("requests_error")
                req.emit("error", message)
        if self.bucket is not None:
            for req in self.bucket.owner:
                if req is not None and not req.finished:
                    req.finished = True
                    self.metrics.add("requests_error")
                    req.emit("error", message)
            self.bucket = None  # its state may be half-donated: start it afresh
            self.metrics.drop_pool(Bucket.KEY)

    def _update_gauges(self) -> None:
        if self.bucket is not None:
            self.bucket.refresh_pool()
        busy = self.busy_rows()
        self._free_rows = self.settings.max_batch - busy
        self.metrics.set_gauges(queue_length=len(self._waiting), busy_rows=busy, rows=self.settings.max_batch,
                                buckets=int(self.bucket is not None), compiles=compile_count())
