"""The goodput-adaptive tree budget: which DDTree budget a chunk of steps verifies, chosen on the device.

A DDTree of budget b is the b most probable prefixes of the drafter's candidates, so the tree of budget b is the
first b + 1 nodes of the tree of any larger budget (tree.py's node order). A node's score is the sum of the
drafter's log-probs along its path, so exp(score) estimates the chance that the verify pass accepts the node's whole
path, and a step that verifies the first b nodes is expected to emit

    E(b) = 1 + sum over nodes n = 1..b of q(n),    q(n) = calibrated exp(score(n))

tokens per sequence (the 1 is the bonus token every step emits). A step costs c_draft + c_verify(b) (the cost model,
cost_model.py, measured on the device), except an autoregressive step, which runs no drafter and costs c_ar. The
policy picks the menu entry with the most expected tokens per second.

The choice is made once per chunk of the chunked loop (engine.ChunkedLoop: k steps a call), for the whole batch, and
each menu entry is its own compiled program: a chunk's step has no control flow at all, so each entry's step costs
what the fixed budget's step costs. (With every entry in one program, one loop of zero or one trip
per entry inside the step, the speculative entries ran 1.5x their fixed programs on the H200 at batch 16, ~0.23 ms a
step of graph control flow: benchmarks/results/history/adaptive_overhead_h200_9922c3c.md.) At the end of each chunk
the program computes the next chunk's entry (`next_entry`) from its policy state; the host reads that small integer
for the chunk after the one in flight (it reads each chunk's tokens anyway), so no step waits for the host.

1. Draft or not. The policy keeps, per menu entry, a running mean of each drafted step's predicted tokens per
   sequence (`expected`). A drafted step of budget b measures E for b and every smaller entry (its tree's first
   nodes); a larger entry's predicted gain E - 1 moves by the factor b's gain moved by, keeping the ratio last measured
   when both were (the calibration times every entry; a chunk of the larger entry measures it again). The next
   chunk drafts when the best predicted rate with the drafter, max_b E(b) / (c_draft + c_verify(b)), beats the
   autoregressive rate 1 / c_ar by GATE_MARGIN; otherwise it is autoregressive and runs no drafter (the target's features of its
   tokens wait in a ring, PendingContext, and enter the drafter's cache at the end of that chunk). A closed gate still probes: after `probe_every` chunks'
   worth of steps without the drafter, one chunk drafts to refresh the prediction (a probe that finds speculation
   still loses doubles the interval; one that finds it pays reopens the gate). The first interval keeps the probes'
   extra cost at PROBE_SHARE of the autoregressive time.
2. Which budget: the argmax over the menu's budgets of E(b) / (c_draft + c_verify(b)); a chunk keeps the entry the
   chunk before it ran unless the argmax is predicted SWITCH_MARGIN faster (on a GPU the first call of another
   program costs milliseconds of host time), and in a static batch unless it finishes the batch SWITCH_COST_MS
   sooner (a batch's last few tokens never pay for a switch).
   The policy cannot be slower than autoregressive decoding by more than its probes (PROBE_SHARE) plus what wrong
   predictions cost for a chunk: a chunk speculates only when its predicted rate beats an autoregressive step's by
   GATE_MARGIN (so the costs may be that far off), and the calibration corrects the predictions after every drafted
   step.

Calibration: exp(score) is the drafter's (tree-temperature sharpened) belief, not the verify pass's acceptance
rate. The policy keeps, in bins of predicted probability, the decayed sums of predicted and observed acceptances
of every verified node, and scales each node's prediction by its bin's observed / predicted ratio (a reliability
diagram learned online). The sums start from a prior (a ratio of 1, or the calibration run's, cost_model.py) and
decay by CALIBRATION_DECAY a drafted step, so they follow the text's easy and hard stretches.

Pure functions on the loop's carry (`PolicyState`); engine.py / step.py call them.
"""

from __future__ import annotations

import types
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# The default menu of budgets (0: autoregressive). Chosen from the measured sweeps: 4-64 spans the best fixed
# budgets of every batch size measured (32 at batch 1, 8-16 at batch 16; benchmarks/results), and each entry
# compiles one more verify pass into the loop.
DEFAULT_MENU = (0, 4, 8, 16, 32, 64)
# Upper edges of the calibration bins over log(predicted probability); the last bin holds everything below.
BIN_EDGES = (-0.05, -0.15, -0.3, -0.6, -1.0, -1.6, -2.5, -4.0)
NUM_BINS = len(BIN_EDGES) + 1
CALIBRATION_DECAY = 0.98  # per drafted step: the bins remember the last ~50 steps
PRIOR_WEIGHT = 2.0  # pseudo-observations of the prior ratio in each bin
# The gate's running mean of predicted tokens: an eighth from the last drafted step. At 0.5 one or two hard steps
# closed the gate for a probe interval: on the H200 at 0061bda, batch 1 greedy, auto skipped the drafter on 50% of
# the steps where every fixed budget ran 1.8-1.9x autoregressive (auto 4,426 tok/s against DDTree 8's 6,727).
EXPECTED_DECAY = 0.125
# _follow's floor on a gain (E - 1), so that a step whose tree the drafter could not predict (gain ~0) does not zero
# the larger entries' predictions for good.
GAIN_FLOOR = 0.05
# The gate drafts only when the best predicted rate beats an autoregressive step's by this share: the costs are measured
# to a few percent (the calibration's chunks on the H200 came out 10-60% away from what the decode paid at 8-step
# chunks, budget_sweep_h200 at d941d29), and a wrong "speculate" costs a whole chunk at a slower step while a wrong
# "autoregressive" costs at most the margin.
GATE_MARGIN = 0.1
# A chunk keeps the entry it runs unless another is predicted this share faster: on the H200 the first call of a
# program after another one ran costs 2-7 ms of host time more than a repeat (its command buffer's update), several
# chunks' worth of a few-percent gain (probe at d941d29, batch 16: 8.5 and 3.6 ms against ~1.7).
SWITCH_MARGIN = 0.05
# A static batch switches only where the switch saves more than this (ms of its predicted rest): the lower end of
# that first call's measured cost above (2-7 ms, H200). A batch's last few tokens save fractions of a millisecond by
# any switch. On the H100 at 1ee1b64 auto lost 5-9% to the fixed budget it mostly ran in the cells where its static
# batches also ran autoregressive chunks (greedy B = 4: 24 of 176 steps, 0.91x DDTree 8; T = 0.7 B = 1: 34 of 674,
# 0.95x; which chunks those were was not traced) and none where they never switched (greedy B = 1: 1.00x;
# history/budget_sweep_h100_1ee1b64). With this rule (H100, 3349b38, budget_sweep_h100_80gb_hbm3) every cell of
# B = 1 / 4 / 16 / 64, greedy and T = 0.7, ran one entry on all its steps.
SWITCH_COST_MS = 2.0
PROBE_SHARE = 0.02  # a closed gate's probes cost at most this share of the autoregressive time
PROBE_MIN, PROBE_MAX = 1, 256  # chunks between a closed gate's probes
# PolicyState.force: the policy decides; i in [0, len(menu)): menu entry i (a budget 0 entry: autoregressive); len(menu):
# autoregressive
FORCE_POLICY = -1


class PolicyState(NamedTuple):
    """The policy's part of the loop's carry (all on device, tiny). Costs are per step of the whole batch, ms."""

    cost_ar: jnp.ndarray  # [] f32 an autoregressive step (no drafter)
    cost_draft: jnp.ndarray  # [] f32 the drafter and the tree (0 where cost_verify holds whole steps)
    cost_verify: jnp.ndarray  # [M] f32 the rest of a drafted step per menu entry (a budget 0 entry: cost_ar)
    cost_slope: jnp.ndarray  # [M + 1] f32 ms per context token of the mean active row (entries, then AR)
    context0: jnp.ndarray  # [] f32 the mean context the costs were measured at
    bin_pred: jnp.ndarray  # [NUM_BINS] f32 decayed sums of predicted acceptance probabilities
    bin_acc: jnp.ndarray  # [NUM_BINS] f32 decayed counts of accepted nodes
    expected: jnp.ndarray  # [M] f32 running mean of predicted tokens per sequence per menu entry
    since_draft: jnp.ndarray  # [] int32 steps since the last drafted step
    probe_every: jnp.ndarray  # [] int32 a closed gate's probe interval, in chunks
    force: jnp.ndarray  # [] int32 FORCE_POLICY, or the menu entry (or len(menu): AR) every chunk takes (calibration)
    chosen: jnp.ndarray  # [M + 1] int32 steps per menu entry drafted, then steps without the drafter
    predicted_tokens: jnp.ndarray  # [] f32 sum over drafted steps and active rows of E(chosen budget)
    observed_tokens: jnp.ndarray  # [] int32 the tokens those rows emitted (counts: exact on a long-running server)
    sequence_steps: jnp.ndarray  # [] int32 active rows summed over drafted steps
    # A static batch ends with its slowest row: `next_entry` then minimises the predicted time to finish every row
    # (from each row's own running prediction) instead of maximising the batch's tokens per ms (continuous batching,
    # where a finished row takes the next request).
    makespan: jnp.ndarray  # [] bool
    row_expected: jnp.ndarray  # [B, M] f32 running mean of each row's predicted tokens per menu entry
    # Calibration's timing runs (engine.decode_ms): each chunk starts with every row active and its output empty, so
    # that no row runs out of tokens, in the program rather than by new arrays from the host between chunks (a new
    # buffer in a call's input costs an update of its command buffer on a GPU: the chunks timed that way came out up to
    # 2x what the decode paid for an autoregressive step on the H200, budget_sweep_h200 at f457516).
    endless: jnp.ndarray  # [] bool
    # The drafted steps of the chunk in flight, absorbed at its end (`absorb`): a step writes its tree's scores and
    # its accepted path (`log_step`, two in-place writes) instead of updating the calibration and the predictions
    # itself (~20 more ops a step, each a kernel on a GPU).
    log_scores: jnp.ndarray  # [S, B, max(menu) + 1] f32 each node's drafter score, -inf where not verified; the root
    # (node 0) 0 for an active row, -inf for an inactive one
    log_path: jnp.ndarray  # [S, B, D + 1] int32 the accepted node indices (-1 padding)
    logged: jnp.ndarray  # [] int32 steps logged in this chunk


def init_state(menu: Sequence[int], *, cost_ar=1.0, cost_draft=0.0, cost_verify=None, cost_slope=None,
               context0=0.0, bin_ratio=None, expected=None, slowest=None, force: int = FORCE_POLICY, batch: int = 1,
               makespan: bool = False, chunk_steps: int = 1, depth: int = 1) -> PolicyState:
    """A fresh policy state. Costs in ms (any consistent unit); cost_verify [M] defaults to cost_ar for every entry
    (so that only the predictions decide); bin_ratio [NUM_BINS] the calibration prior (default 1: trust the
    drafter); expected [M] the gate's prior (default: optimistic, 1 + b, so that the first step drafts), also every
    row's; makespan: a static batch (PolicyState.makespan); slowest [M]: a static batch's starting prediction for
    every row (default expected): the calibration's slowest row's (cost_model.make_point), since such a batch ends with
    its slowest row and no row's own rate is known before its first chunk (on the H100 at c468e17, batch 64 greedy,
    the mean row's prior drafted the first two chunks where DDTree 8 ran 0.77x autoregressive decoding: rows finished
    after 51 batch steps at a mean of 35); chunk_steps / depth: the log's room (steps a chunk, the drafter's depth
    D)."""
    m = len(menu)
    menu_arr = np.asarray(menu, np.float32)
    cost_verify = np.full((m,), cost_ar, np.float32) if cost_verify is None else np.asarray(cost_verify, np.float32)
    cost_slope = np.zeros((m + 1,), np.float32) if cost_slope is None else np.asarray(cost_slope, np.float32)
    ratio = np.ones((NUM_BINS,), np.float32) if bin_ratio is None else np.asarray(bin_ratio, np.float32)
    expected = 1.0 + menu_arr if expected is None else np.asarray(expected, np.float32)
    if cost_verify.shape != (m,) or cost_slope.shape != (m + 1,) or expected.shape != (m,):
        raise ValueError(f"cost_verify and expected must have one entry per menu budget ({m}), cost_slope {m + 1}")
    # Built in numpy and placed in one device_put: as ~25 eager jnp ops each policy cost a dispatch, and generate builds
    # three a call (adaptive_parts, with_costs, first_entry): on the H100 at a3b364e _prepare_costs took 21-24 ms of
    # every adaptive generate call (benchmarks/adaptive_gap.py --trace).
    f32 = np.float32
    host = PolicyState(
        cost_ar=f32(cost_ar), cost_draft=f32(cost_draft), cost_verify=cost_verify, cost_slope=cost_slope,
        context0=f32(context0), bin_pred=np.full((NUM_BINS,), PRIOR_WEIGHT, f32),
        bin_acc=(PRIOR_WEIGHT * ratio).astype(f32),
        expected=expected, since_draft=np.int32(0),
        probe_every=_probe_interval(np, cost_ar, cost_draft, cost_verify, menu), force=np.int32(force),
        chosen=np.zeros((m + 1,), np.int32), predicted_tokens=f32(0), observed_tokens=np.int32(0),
        sequence_steps=np.int32(0), makespan=np.bool_(makespan),
        row_expected=np.broadcast_to(static_batch_prior(expected, slowest) if makespan else expected,
                                     (batch, m)).astype(f32),
        endless=np.bool_(False),
        log_scores=np.full((chunk_steps, batch, max(max(menu), 0) + 1), -np.inf, f32),
        log_path=np.full((chunk_steps, batch, depth + 1), -1, np.int32), logged=np.int32(0))
    return jax.device_put(host)


def static_batch_prior(expected, slowest) -> np.ndarray:
    """A static batch's starting tokens per step per menu entry [M]: the slowest row's prior (`init_state`), never
    above the mean row's `expected`; `expected` itself where the calibration gave no slowest row."""
    expected = np.asarray(expected, np.float32)
    if slowest is None:
        return expected
    slowest = np.asarray(slowest, np.float32)
    if slowest.shape != expected.shape:
        raise ValueError(f"slowest must have one entry per menu budget ({expected.shape[0]})")
    return np.minimum(slowest, expected)


def probe_interval(cost_ar, cost_draft, cost_verify, menu: Sequence[int]) -> jnp.ndarray:
    """Chunks between a closed gate's probes ([] int32) so that their extra cost (the cheapest drafting entry's step
    over an autoregressive one, for one chunk) is PROBE_SHARE of the autoregressive time."""
    return _probe_interval(jnp, cost_ar, cost_draft, cost_verify, menu)


def _probe_interval(xp, cost_ar, cost_draft, cost_verify, menu: Sequence[int]):
    """probe_interval with xp = jnp (traced: the chunk's end) or np (init_state, on the host)."""
    cost_ar = xp.asarray(cost_ar, xp.float32)
    step = xp.where(xp.asarray(speculative_entries(menu)), cost_draft + xp.asarray(cost_verify, xp.float32), xp.inf)
    extra = xp.maximum(step.min() - cost_ar, 0.0)
    interval = xp.clip(xp.ceil(extra / (PROBE_SHARE * xp.maximum(cost_ar, 1e-9))), PROBE_MIN, PROBE_MAX)
    return xp.asarray(xp.where(cost_ar > 0, interval, PROBE_MIN)).astype(xp.int32)


def _costs(policy: PolicyState, context):
    """(c_ar, c_draft, c_verify [M]) at the batch's mean context."""
    shift = context - policy.context0
    slope = policy.cost_slope
    return (jnp.maximum(policy.cost_ar + slope[-1] * shift, 1e-6), policy.cost_draft,
            jnp.maximum(policy.cost_verify + slope[:-1] * shift, 1e-6))


def mean_context(seq_lens, active):
    n = jnp.maximum(active.sum(), 1)
    return (jnp.where(active, seq_lens, 0).sum() / n).astype(jnp.float32)


def speculative_entries(menu: Sequence[int]) -> np.ndarray:
    """[M] bool: the entries that draft (a budget above 0)."""
    return np.asarray(menu) > 0


def _rates(policy: PolicyState, menu: Sequence[int], context):
    """(c_ar, the step cost c_draft + c_verify [M], the predicted tokens per ms of a drafted step per entry [M] by the
    running prediction `expected`, -1 where the entry does not draft) at the batch's mean context."""
    c_ar, c_draft, c_verify = _costs(policy, context)
    step = c_draft + c_verify
    return c_ar, step, jnp.where(jnp.asarray(speculative_entries(menu)), policy.expected / step, -1.0)


def speculative_rate(policy: PolicyState, menu: Sequence[int], context) -> jnp.ndarray:
    """The best predicted tokens per ms of a drafted step (by the running prediction `expected`), over an
    autoregressive step's: [] f32; the gate opens where it `pays`."""
    c_ar, _, rates = _rates(policy, menu, context)
    return rates.max() * c_ar


def pays(rate):
    """Whether a predicted speed-up over autoregressive decoding (`speculative_rate`) opens the gate (GATE_MARGIN)."""
    return rate >= 1.0 + GATE_MARGIN


def next_entry(policy: PolicyState, menu: Sequence[int], context, steps: int, remaining=None,
               active=None, current: Optional[int] = None) -> jnp.ndarray:
    """The menu entry the next chunk of `steps` steps runs ([] int32; len(menu): autoregressive, no drafter): the
    forced one, else the best predicted budget when it beats an autoregressive step by GATE_MARGIN (or a probe is
    due), else autoregressive. The best: in a static batch (policy.makespan, `remaining` [B] tokens each row has left,
    `active` [B]), the least predicted time to finish every active row, max over rows of remaining / E_row(b) steps at
    c_draft + c_verify(b) each, against max remaining steps at c_ar; otherwise the most predicted tokens per ms.
    current: the (static) entry of the chunk that ends here, kept unless the choice is SWITCH_MARGIN faster (and, in a
    static batch, finishes it SWITCH_COST_MS sooner)."""
    m = len(menu)
    if not speculative_entries(menu).any():
        return jnp.int32(m)
    c_ar, step, rates = _rates(policy, menu, context)
    if remaining is not None:
        speculative = jnp.asarray(speculative_entries(menu))
        left = jnp.where(active, remaining, 0).astype(jnp.float32)  # [B]
        steps_left = (left[:, None] / jnp.maximum(policy.row_expected, 1.0)).max(0)  # [M]
        finish = steps_left * step
        # The same comparison as tokens per ms: the batch's remaining work over its predicted finish time.
        work = jnp.maximum(left.max(), 1.0)
        rates = jnp.where(policy.makespan, jnp.where(speculative, work / jnp.maximum(finish, 1e-9), -1.0), rates)
    best = jnp.argmax(rates).astype(jnp.int32)
    gate = pays(rates[best] * c_ar)
    probe = policy.since_draft + steps > policy.probe_every * steps
    chosen = jnp.where(gate | probe, best, m)
    if current is not None:  # the entry this chunk ran stays unless the choice beats it by SWITCH_MARGIN (a probe
        # due still drafts); and a chunk after the last active row runs it again (no switch for a chunk of no steps)
        rate_of = lambda e: jnp.where(e == m, 1.0 / c_ar, rates[jnp.minimum(e, m - 1)])  # noqa: E731
        current_entry = jnp.int32(current if is_speculative(menu, current) else m)
        keep = rate_of(current_entry) >= (1.0 - SWITCH_MARGIN) * rate_of(chosen)
        if remaining is not None:  # a static batch's rest under each entry, in ms: a switch must pay for itself
            finish_of = lambda e: jnp.where(e == m, work * c_ar, finish[jnp.minimum(e, m - 1)])  # noqa: E731
            keep = keep | (policy.makespan & (finish_of(current_entry) - finish_of(chosen) < SWITCH_COST_MS))
        keep = keep & ~(probe & (current_entry == m))
        if active is not None:
            keep = keep | ~active.any()
        chosen = jnp.where(keep, current_entry, chosen)
    forced = jnp.where((policy.force < m) & jnp.asarray(np.append(speculative_entries(menu), False))[
        jnp.clip(policy.force, 0, m)], policy.force, m)
    return jnp.where(policy.force == FORCE_POLICY, chosen, forced).astype(jnp.int32)


def is_speculative(menu: Sequence[int], entry: int) -> bool:
    """Whether a (static) entry drafts: a menu budget above 0 (a budget 0 entry and len(menu) are autoregressive)."""
    return 0 <= entry < len(menu) and menu[entry] > 0


def _bins(log_p):
    edges = jnp.asarray(BIN_EDGES, jnp.float32)
    return (log_p[..., None] < edges).sum(-1)  # 0: the most confident bin


def calibrated(policy: PolicyState, scores, valid) -> jnp.ndarray:
    """Each node's calibrated acceptance probability q [B, T] from its drafter score (root and padding: 0)."""
    ratio = policy.bin_acc / jnp.maximum(policy.bin_pred, 1e-6)
    p = jnp.exp(jnp.minimum(scores, 0.0))
    q = jnp.minimum(p * ratio[_bins(scores)], 1.0)
    node = jnp.arange(scores.shape[1])[None, :]
    return jnp.where(valid & (node > 0), q, 0.0)


def expected_tokens(q, menu: Sequence[int]) -> jnp.ndarray:
    """E(b) per sequence and menu entry [B, M]: 1 + the calibrated probabilities of the first b nodes. An entry whose b
    exceeds the tree's nodes (T - 1) gets the whole tree's (`absorb` scales those entries instead, `known_entries`)."""
    total = jnp.cumsum(q, axis=1)  # [B, T]: total[:, i] = q[1] + ... + q[i]
    last = q.shape[1] - 1
    return 1.0 + jnp.stack([total[:, min(b, last)] if b > 0 else jnp.zeros_like(total[:, 0]) for b in menu], axis=1)


def known_entries(menu: Sequence[int], entry: int) -> np.ndarray:
    """[M] bool: the entries whose E a drafted step of menu entry `entry` measures (its tree is the budget-b tree, and
    a smaller budget's tree is its first nodes); the larger ones are scaled (`absorb`)."""
    return np.asarray(menu) <= menu[entry]


def _follow(old, new_known, known, entry: int):
    """Running predictions [..., M] after a step that measured the `known` entries (new_known there): each unmeasured
    (larger) entry's gain E - 1 moves by the factor the measured entry `entry`'s gain moved by, so that the ratio
    of the two gains stays the one last measured together (by calibration, or a chunk of a larger entry)."""
    gain_old, gain_new = old[..., entry] - 1.0, new_known[..., entry] - 1.0
    factor = (gain_new + GAIN_FLOOR) / (gain_old + GAIN_FLOOR)
    return jnp.where(jnp.asarray(known), new_known, 1.0 + (old - 1.0) * factor[..., None])


def log_step(policy: PolicyState, menu: Sequence[int], entry: int, *, scores, valid, path, active) -> PolicyState:
    """A drafted step of menu entry `entry`, logged for the chunk's end (`absorb`): scores / valid [B, T] its tree's,
    path [B, D + 1] the accepted node indices, active [B] the rows that stepped."""
    node = jnp.arange(scores.shape[1])[None, :]
    verified = valid & (node >= 1) & (node <= menu[entry]) & active[:, None]
    logged = jnp.where(verified, scores, -jnp.inf).at[:, 0].set(jnp.where(active, 0.0, -jnp.inf))
    width = policy.log_scores.shape[2]
    logged = jnp.pad(logged[:, :width], ((0, 0), (0, width - min(scores.shape[1], width))), constant_values=-jnp.inf)
    # A small entry's tree is shallower than the drafter (step.tree_depth): its path is padded as the walk pads it.
    path = jnp.pad(path.astype(jnp.int32), ((0, 0), (0, policy.log_path.shape[2] - path.shape[1])), constant_values=-1)
    i = policy.logged
    return policy._replace(
        log_scores=jax.lax.dynamic_update_index_in_dim(policy.log_scores, logged, i, 0),
        log_path=jax.lax.dynamic_update_index_in_dim(policy.log_path, path, i, 0),
        logged=i + 1)


def absorb(policy: PolicyState, menu: Sequence[int], entry: int) -> PolicyState:
    """The chunk's logged steps of menu entry `entry` into the calibration bins (every verified node: its raw drafter
    probability exp(score) and whether the walk accepted it), the running predictions and the counters; the log
    emptied. The same as one observation per step in order, except that every step's predictions E come from the
    bins as they were at the chunk's start: the decays and `_follow`'s factors compose in closed form (a running
    mean's weights; the factors' product telescopes to the last over the first)."""
    scores, path = policy.log_scores, policy.log_path  # [S, B, T], [S, B, D + 1]
    steps, batch, width = scores.shape
    n = policy.logged
    index = jnp.arange(steps)
    ran = index < n
    active = ran[:, None] & (scores[:, :, 0] == 0.0)  # [S, B]
    node = jnp.arange(width)
    verified = jnp.isfinite(scores) & (node >= 1) & active[..., None]  # [S, B, T]
    on_path = ((path[..., None] == node) & (path[..., None] > 0)).any(2)  # [S, B, T]
    in_bin = _bins(scores)[..., None] == jnp.arange(NUM_BINS)  # [S, B, T, bins]
    raw = jnp.exp(jnp.minimum(scores, 0.0))
    add_pred = jnp.where(in_bin & verified[..., None], raw[..., None], 0.0).sum((1, 2))  # [S, bins]
    add_acc = (in_bin & (verified & on_path)[..., None]).sum((1, 2)).astype(jnp.float32)
    decayed = CALIBRATION_DECAY ** jnp.maximum(n - 1 - index, 0).astype(jnp.float32)
    weight = jnp.where(ran, decayed, 0.0)[:, None]
    keep = CALIBRATION_DECAY ** n.astype(jnp.float32)

    # Each step's E per row and entry from the chunk's first bins; the running means over the steps a row ran.
    q = calibrated(policy, scores.reshape(steps * batch, width), verified.reshape(steps * batch, width))
    row_e = expected_tokens(q, menu).reshape(steps, batch, len(menu))  # [S, B, M]
    on = active.astype(jnp.float32)
    e = EXPECTED_DECAY
    later = jnp.cumsum(on[::-1], axis=0)[::-1] - on  # [S, B] steps the row ran after this one
    row_mean = ((1 - e) ** on.sum(0))[:, None] * policy.row_expected + (
        (on * e * (1 - e) ** later)[..., None] * row_e).sum(0)
    known = known_entries(menu, entry)
    summed = jnp.where(active[..., None], row_e, 0.0).sum(1)  # [S, M]
    mean = summed / jnp.maximum(on.sum(1), 1.0)[:, None]
    step_weight = jnp.where(ran, e * (1 - e) ** jnp.maximum(n - 1 - index, 0).astype(jnp.float32), 0.0)
    batch_mean = (1 - e) ** n.astype(jnp.float32) * policy.expected + (step_weight[:, None] * mean).sum(0)
    emitted = jnp.where(active, on_path.sum(2) + 1, 0).sum().astype(jnp.int32)
    return policy._replace(
        bin_pred=keep * policy.bin_pred + (weight * add_pred).sum(0),
        bin_acc=keep * policy.bin_acc + (weight * add_acc).sum(0),
        expected=_follow(policy.expected, batch_mean, known, entry),
        since_draft=jnp.where(n > 0, 0, policy.since_draft),
        chosen=policy.chosen.at[entry].add(n),
        predicted_tokens=policy.predicted_tokens + summed[:, entry].sum(),
        observed_tokens=policy.observed_tokens + emitted,
        sequence_steps=policy.sequence_steps + active.sum().astype(jnp.int32),
        row_expected=_follow(policy.row_expected, row_mean, known, entry),
        logged=jnp.zeros_like(n))


def count_undrafted(policy: PolicyState, menu: Sequence[int]) -> PolicyState:
    """An autoregressive step: counted, and the gate's probe clock runs."""
    return policy._replace(since_draft=policy.since_draft + 1, chosen=policy.chosen.at[len(menu)].add(1))


def end_of_chunk(policy: PolicyState, menu: Sequence[int], entry: int, context) -> PolicyState:
    """After a drafted chunk: its logged steps absorbed (`absorb`); a probe (or any drafted chunk) that found
    speculation still loses doubles the gate's probe interval; one that found it pays resets it to the base interval
    (`probe_interval`)."""
    if not is_speculative(menu, entry):
        return policy
    policy = absorb(policy, menu, entry)
    c_ar, c_draft, c_verify = _costs(policy, context)
    paid = pays(speculative_rate(policy, menu, context))
    base = probe_interval(c_ar, c_draft, c_verify, menu)
    return policy._replace(probe_every=jnp.where(paid, base, jnp.minimum(2 * policy.probe_every, PROBE_MAX)))


def bin_ratio(policy: PolicyState) -> np.ndarray:
    """The calibration's observed / predicted ratio per bin (host), e.g. to carry as the next run's prior."""
    return np.asarray(policy.bin_acc) / np.maximum(np.asarray(policy.bin_pred), 1e-6)


# The policy's fields `summary` reads.
SUMMARY_FIELDS = ("chosen", "sequence_steps", "predicted_tokens", "observed_tokens", "bin_acc", "bin_pred", "cost_ar",
                  "cost_draft", "cost_verify")


def summary(policy: PolicyState, menu: Sequence[int]) -> dict:
    """What a run's policy did, for GenerateResult.stats and /metrics: steps per budget (a histogram;
    "steps_without_drafter" counts the autoregressive steps), and the predicted vs observed tokens per sequence-step
    of drafted steps."""
    # One read of the device for the fields below, not one a field (each a wait and a copy on a GPU); `policy` may be
    # any object with them (the server's unpacked copy, serve/scheduler.py).
    policy = types.SimpleNamespace(**jax.device_get({k: getattr(policy, k) for k in SUMMARY_FIELDS}))
    chosen = np.asarray(policy.chosen).tolist()
    seq_steps = float(policy.sequence_steps)
    return {
        "menu": list(menu),
        "budget_steps": {str(b): int(c) for b, c in zip(menu, chosen[:-1])},
        "steps_without_drafter": int(chosen[-1]),
        "predicted_tau": float(policy.predicted_tokens) / seq_steps if seq_steps else float("nan"),
        "observed_tau": float(policy.observed_tokens) / seq_steps if seq_steps else float("nan"),
        "drafted_sequence_steps": seq_steps,
        "calibration": bin_ratio(policy).round(3).tolist(),
        "costs_ms": {"ar": float(policy.cost_ar), "draft": float(policy.cost_draft),
                     "verify": np.asarray(policy.cost_verify).round(4).tolist()},
    }
