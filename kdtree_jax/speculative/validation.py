"""`generate`'s arguments checked before any device work: types, ranges, the context, the tree's size and the memory
the call needs, each a one-line ValueError naming the argument; and the adaptive budget's menu (`adaptive_menu`)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kdtree_jax.decode import validate_tokens
from kdtree_jax.model.drafter import Drafter
from kdtree_jax.model.transformer import Transformer
from kdtree_jax.speculative import budget_policy
from kdtree_jax.speculative import cost_model as cost_models
from kdtree_jax.speculative import tree as trees
from kdtree_jax.speculative.step import SpecConfig, TreeShape


def _as_batch(prompt_ids) -> tuple[list[np.ndarray], bool]:
    """A prompt (list of ids), a batch of prompts (list of lists, ragged) or a [B, L] array."""
    if isinstance(prompt_ids, (np.ndarray, jax.Array)):
        arr = np.asarray(prompt_ids)
        if arr.ndim == 1:
            return [arr], True
        if arr.ndim == 2:
            return list(arr), False
        raise ValueError(f"prompt_ids must be [L] or [B, L]; got shape {arr.shape}")
    prompt_ids = list(prompt_ids)
    if prompt_ids and all(np.isscalar(t) for t in prompt_ids):
        return [np.asarray(prompt_ids)], True
    return [np.asarray(p) for p in prompt_ids], False


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Request(NamedTuple):
    """A validated `generate` call: the prompts, the stop ids and the loop's static geometry."""

    prompts: list  # [np.ndarray] one per sequence
    stop: np.ndarray  # [S] int32, -1 padding
    use_drafter: bool  # False: autoregressive (no drafter, or ddtree with budget 0)
    depth: int  # the drafter's D (0 without one)
    num_nodes: int  # T, tree nodes per step (1 without the drafter)


# Tree nodes a step may verify (root included). The tree builders themselves stop only at the number of distinct
# prefixes (sum of K**d: 1.4e9 at D = 15, K = 4), but the step's cost grows faster than its nodes: the DDTree
# level search sorts D x budget x ln(budget) candidates, the verify pass runs T query rows against the context
# with a T x T ancestor mask, and the lm head writes T x V logits. Measured with the default pair on the 2-core CPU
# (16 new tokens, 2 steps): 0.2 s a step at budget 256, 0.8 s at 1024, 3.2 s at 2048, 13.6 s at 4096 (and 15 s of
# compile); the DDTree paper's largest budget is 1024. Larger trees are research for a faster device, not a run.
MAX_TREE_NODES = 4097


def _available_memory_bytes(target: Transformer) -> Optional[int]:
    """Memory free for one generate call on the target's first device: the allocator's limit less what is in use on
    an accelerator, the host's available memory on a CPU; None when unknown."""
    import os

    mesh = getattr(target, "mesh", None)
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some backends do not implement it
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def validate(target: Transformer, drafter: Optional[Drafter], prompt_ids, *, max_new_tokens: int, budget: int,
              topk: int, tree_temperature: float, temperature: float, stop_ids, tree: TreeShape, top_k: int = 0,
              top_p: float = 1.0) -> Request:
    """Checks every argument of `generate` before any device work; raises ValueError naming the argument.

    Beyond the types and signs: the context (the longest prompt, and it plus max_new_tokens, against the target's
    max_position_embeddings), the tree's size (at most MAX_TREE_NODES nodes a step) and the memory the call needs
    (the KV pool and the drafter's context for prompt + max_new_tokens per sequence, and a step's logits), so that
    a huge value is a one-line error instead of a hang or an out-of-memory traceback."""
    import operator

    def integer(value, name):
        if isinstance(value, bool):
            raise ValueError(f"{name} must be an integer; got {value!r}")
        try:
            return operator.index(value)
        except TypeError:
            raise ValueError(f"{name} must be an integer; got {value!r}") from None

    cfg = target.cfg
    if isinstance(budget, str):  # "auto": the loop's trees are sized by the menu's largest budget
        menu = adaptive_menu(budget, None, drafter, tree, topk if isinstance(topk, int) else 1)
        budget = max(menu) if menu else 0
    prompts, _ = _as_batch(prompt_ids)
    if not prompts:
        raise ValueError("prompt_ids holds no prompt")
    for b, p in enumerate(prompts):
        if p.ndim != 1:
            raise ValueError(f"prompt_ids[{b}] must be a flat list of token ids; got shape {p.shape}")
        if p.size == 0:
            raise ValueError(f"prompt_ids[{b}] is empty (every prompt needs at least one token)"
                             if len(prompts) > 1 else "prompt_ids is empty (a prompt needs at least one token)")
    for p in prompts:
        validate_tokens(p, cfg.vocab_size, "prompt_ids")
    max_new_tokens = integer(max_new_tokens, "max_new_tokens")
    budget = integer(budget, "budget")
    topk = integer(topk, "topk")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0; got {budget}")
    if not 1 <= topk <= cfg.vocab_size:
        raise ValueError(f"topk must be in [1, {cfg.vocab_size}] (the vocabulary); got {topk}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    if not tree_temperature > 0:
        raise ValueError(f"tree_temperature must be > 0; got {tree_temperature}")
    top_k = integer(top_k, "top_k")
    if not 0 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k must be in [0, {cfg.vocab_size}] (0: off; the vocabulary); got {top_k}")
    if not 0 < top_p <= 1:  # whatever the temperature: a greedy call with a bad top_p is a bad call
        raise ValueError(f"top_p must be in (0, 1] (1: off); got {top_p}")
    if isinstance(tree, str) and tree not in ("ddtree", "chain"):
        raise ValueError(f"tree must be 'ddtree', 'chain' or a tuple of branching factors; got {tree!r}")
    stop = validate_tokens(np.asarray(list(stop_ids)), cfg.vocab_size, "stop_ids") if stop_ids else np.array([-1], np.int32)

    # The context: rope positions past max_position_embeddings are outside what the target was trained on (and
    # outside its yarn scaling): the output degrades without a word, so refuse before any device work.
    context = cfg.max_position_embeddings
    longest = max(p.size for p in prompts)
    if longest > context:
        raise ValueError(f"the prompt has {longest} tokens, more than the model's context of {context} tokens "
                         "(max_position_embeddings); shorten it")
    if longest + max_new_tokens > context:
        raise ValueError(f"the prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{longest + max_new_tokens} tokens exceeds the model's context of {context} tokens "
                         f"(max_position_embeddings); max_new_tokens can be at most {context - longest}")

    if drafter is not None and drafter.cfg.depth < 1:
        raise ValueError("the drafter's block_size must be >= 2")
    use_drafter = drafter is not None and not (tree == "ddtree" and budget == 0)
    depth = drafter.cfg.depth if drafter is not None else 0
    if use_drafter and tree == "ddtree":
        limit = min(trees.max_ddtree_budget(depth, topk), MAX_TREE_NODES - 1)
        if budget > limit:
            why = ("the most nodes a step may verify" if limit == MAX_TREE_NODES - 1 else
                   f"the distinct prefixes of block_size {drafter.cfg.block_size} and topk {topk}")
            raise ValueError(f"budget must be <= {limit} ({why}); got {budget}")
    if not isinstance(tree, str):
        branching = tuple(integer(b, "tree entries") for b in tree)
        if use_drafter and len(branching) > depth:
            raise ValueError(f"a static tree has at most {depth} levels (the drafter's block_size - 1); "
                             f"got {len(branching)}")
        if any(not 1 <= b <= topk for b in branching):
            raise ValueError(f"static tree branching factors must be in [1, topk={topk}]; got {list(branching)}")
        nodes, width = 1, 1
        for b in branching:
            width *= b
            nodes += width
            if nodes > MAX_TREE_NODES:
                raise ValueError(f"the static tree {list(branching)} has more than {MAX_TREE_NODES} nodes (the most "
                                 "a step may verify)")
    num_nodes = (budget + 1 if tree == "ddtree" else depth + 1 if tree == "chain" else nodes)
    if not use_drafter:
        num_nodes = 1

    # Memory: what `engine.setup` allocates (the KV pool, the drafter's context, the prompts' hidden states) and a
    # step's largest buffers (logits and the ancestor mask of T nodes), against what the device has free.
    batch = len(prompts)
    padded = round_up(longest, 64)
    max_len = round_up(padded + max_new_tokens + num_nodes + depth + 1, 64)
    itemsize = jnp.dtype(target.dtype).itemsize
    need = cfg.num_hidden_layers * batch * max_len * cfg.cache_dim * itemsize + batch * max_len * 8
    if use_drafter:
        dcfg = drafter.cfg
        need += 2 * dcfg.num_layers * batch * max_len * dcfg.num_kv_heads * dcfg.head_dim * itemsize
        need += len(drafter.target_layer_ids) * batch * padded * cfg.hidden_size * itemsize
    need += batch * num_nodes * (cfg.vocab_size * 4 + -(-num_nodes // 32) * 4 + cfg.num_hidden_layers * cfg.hidden_size * 4)
    available = _available_memory_bytes(target)
    if available is not None and need > available:
        raise ValueError(f"{batch} prompt(s) of up to {longest} tokens + max_new_tokens {max_new_tokens} with "
                         f"{num_nodes}-node trees need about {_format_bytes(need)} (KV pool, drafter context, a "
                         f"step's logits) but the device has {_format_bytes(available)} free: lower max_new_tokens, "
                         "budget or the number of prompts")
    return Request(prompts, stop, use_drafter, depth, num_nodes)


def adaptive_menu(budget, menu, drafter: Optional[Drafter], tree: TreeShape, topk: int) -> tuple:
    """The menu of DDTree budgets an adaptive loop chooses from, () for a fixed budget or no adaptive loop.

    budget "auto" with a drafter and tree "ddtree": `menu` (default budget_policy.DEFAULT_MENU), each entry capped at the
    prefixes the drafter's depth and topk make, with 0 (the autoregressive step) always in it. A number: ()."""
    if not isinstance(budget, str):
        if menu is not None:
            raise ValueError("menu is for budget='auto'; a numeric budget verifies that budget every step")
        return ()
    if budget != "auto":
        raise ValueError(f"budget must be an integer >= 0 or 'auto'; got {budget!r}")
    if drafter is None or tree != "ddtree":
        return ()
    limit = min(trees.max_ddtree_budget(drafter.cfg.depth, topk), MAX_TREE_NODES - 1)
    chosen = budget_policy.DEFAULT_MENU if menu is None else tuple(menu)
    if any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0 for b in chosen):
        raise ValueError(f"menu must hold integer budgets >= 0; got {list(chosen)}")
    entries = sorted({0, *(min(int(b), limit) for b in chosen)})
    if len(entries) < 2:
        raise ValueError(f"menu needs a budget in [1, {limit}] (the prefixes the drafter's depth and topk make); "
                         f"got {list(chosen)}")
    return tuple(entries)


# A step keeps at most 1 + min(budget, D) tokens (the accepted path and the bonus token), so a fixed budget whose
# step costs more than that many autoregressive steps loses to autoregressive decoding whatever the acceptance: the
# bound engine.calibrate prunes menu entries by. Without a measurement the warning falls back to the tree's size.
class BudgetWarning(UserWarning):
    """`generate` with a fixed budget this device does not run at a useful speed (`budget_warning`'s line)."""


def budget_warning(target: Transformer, drafter: Optional[Drafter], prompt_ids, *, budget, topk: int,
                   tree: TreeShape = "ddtree", sampled: bool = False, penalties: bool = False, impl: str = "auto",
                   row_invariant: bool = False) -> Optional[str]:
    """A one-line warning when a fixed DDTree `budget` is more than this device can run at a useful speed, else None.

    With a cost model of this pair and device cached (cost_model.py: any earlier budget='auto' run at this batch
    size measured one), the step's cost is the measured menu entry's, or interpolated / extrapolated linearly in
    nodes from the measured entries (on a CPU a verify pass costs about in proportion to its nodes); the warning
    says it when that step cannot beat an autoregressive step even if every drafted token were accepted, and names
    the largest budget that could, and the best at the measured acceptance. Without one: when the tree has more
    nodes than both the drafter's depth x topk candidates and the adaptive menu's largest budget.
    Call it after `validate` (it assumes valid arguments); it does no device work."""
    if drafter is None or tree != "ddtree" or isinstance(budget, str) or budget <= 0:
        return None
    depth = drafter.cfg.depth
    prompts, _ = _as_batch(prompt_ids)
    batch, context = len(prompts), float(np.mean([p.size for p in prompts]))
    limit = min(trees.max_ddtree_budget(depth, topk), MAX_TREE_NODES - 1)
    menu = adaptive_menu("auto", None, drafter, tree, topk)
    most = 1 + min(budget, depth)
    cached = _cached_costs(target, drafter, menu, topk=topk, sampled=sampled, penalties=penalties, impl=impl,
                           row_invariant=row_invariant, batch=batch, context=context)
    measured = []  # (budget, ms) of the drafting entries the calibration timed (it times at least the first)
    if cached is not None:
        cached_menu, costs = cached
        c_ar = costs["cost_ar"]
        measured = [(b, c) for b, c in zip(cached_menu, costs["cost_verify"]) if b > 0 and c < 1e29]
    if not measured:
        candidates = depth * topk
        if budget <= max(candidates, max(menu)):
            return None
        return (f"budget {budget} verifies {budget + 1} nodes a step, {(budget + 1) / candidates:.0f}x the drafter's "
                f"{depth} positions x topk {topk} = {candidates} candidates and past the adaptive budget's largest "
                f"({max(menu)}), to keep at most {most} tokens a step; no cost model of this device is cached to say "
                "what it costs (budget 'auto' measures one)")
    estimate = _step_cost_estimate(measured, c_ar)
    cost = float(estimate(np.asarray([budget]))[0])
    if cost <= most * c_ar:
        return None
    candidates = np.arange(1, limit + 1)
    pays = candidates[estimate(candidates) <= (1 + np.minimum(candidates, depth)) * c_ar]
    largest = int(pays.max()) if pays.size else 0
    expected = costs.get("expected")
    best = 0  # the entry the adaptive budget would pick by the calibration run's acceptance (E(b) per entry)
    if expected is not None:
        rate, b = max(((e / c, b) for b, c, e in zip(cached_menu, costs["cost_verify"], expected)
                       if b > 0 and c < 1e29), default=(0.0, 0))
        best = b if rate * c_ar >= 1.0 else 0
    sizes = " / ".join(str(b) for b, _ in measured)
    if any(b == budget for b, _ in measured):
        cost_text = f"{cost:,.1f} ms a step on this device (measured"
    elif budget < measured[-1][0]:
        cost_text = f"about {cost:,.1f} ms a step on this device (interpolated between the measured budgets {sizes}"
    else:  # the measured CPU steps grow faster than their nodes (this module's MAX_TREE_NODES note): a floor
        cost_text = (f"{cost:,.1f} ms a step or more on this device (linear in nodes from the measured budget"
                     + ("s " if len(measured) > 1 else " ") + sizes)
    return (f"budget {budget} verifies {budget + 1} nodes a step: {cost_text}; an autoregressive step {c_ar:.3g} "
            f"ms), slower than autoregressive decoding even if all {most} tokens a step can keep were accepted; the "
            f"largest budget that can pay here is {largest}, and at the measured "
            + (f"acceptance the best is {best}" if best else "acceptance none does (budget 0 or 'auto')"))


def _step_cost_estimate(measured: list, c_ar: float):
    """cost(budgets) [ms] from the measured drafting entries [(budget, ms)] and the autoregressive step (as budget 0):
    interpolated between them, past the largest along the line through the last two; never falling."""
    b = np.asarray([0] + [m[0] for m in measured], np.float64)
    c = np.maximum.accumulate(np.asarray([c_ar] + [m[1] for m in measured], np.float64))
    slope = (c[-1] - c[-2]) / (b[-1] - b[-2])

    def estimate(budgets):
        budgets = np.asarray(budgets, np.float64)
        return np.where(budgets > b[-1], c[-1] + slope * (budgets - b[-1]), np.interp(budgets, b, c))

    return estimate


def _cached_costs(target: Transformer, drafter: Drafter, menu: tuple, *, topk: int, sampled: bool, penalties: bool,
                  impl: str, row_invariant: bool, batch: int, context: float) -> Optional[tuple]:
    """(menu, CostModel.costs) of the cached cost model of these settings with a point at this batch size; else of
    any cached model of the same pair, device and topk (the loop's other settings change a step's cost far less than
    its tree does); None when there is none."""
    import json

    spec = SpecConfig(budget=max(menu), topk=topk, sampled=sampled, penalties=penalties, impl=impl,
                      row_invariant=row_invariant, menu=menu)
    key = cost_models.fingerprint(target, drafter, spec)
    models = [cost_models.CostModel.load(key)]
    same = ("format", "backend", "device", "devices", "jax", "target", "target_dtype", "drafter", "drafter_dtype",
            "topk")
    wanted = json.loads(json.dumps({k: key[k] for k in same}, default=str))
    folder = cost_models.CostModel.file_for(key).parent
    for path in sorted(folder.glob(f"{key['backend']}_*.json")) if folder.is_dir() else ():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        other = data.get("key", {})
        if path != models[0].path and all(other.get(k) == v for k, v in wanted.items()):
            models.append(cost_models.CostModel(other, data.get("points", []), path))
    for model in models:
        if any(p["batch"] == batch for p in model.points):
            return tuple(model.key["menu"]), model.costs(batch, context)
    return None
