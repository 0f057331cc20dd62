"""Mixture of experts: DeepSeek-V3 / Kimi K2 routing, shared experts, grouped routed experts."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from kdtree_jax.config import MESH_AXIS, ModelConfig
from kdtree_jax.model.layers import MLP, dot_transposed, logical_axes
from kdtree_jax.model.row_invariant import RowLayout
from kdtree_jax.ops import moe as moe_ops
from kdtree_jax.ops import route as route_ops
from kdtree_jax.ops.moe import CUDA_BLOCKS_PER_SM, grouped_expert_mlp
from kdtree_jax.sharding import MeshLayout


def route(router_logits, bias, cfg: ModelConfig):
    """Choose experts per token: (indices [N, k] int32, weights [N, k] float32).

    Experts are *chosen* on `score + e_score_correction_bias` (noaux_tc; first the best `topk_group` groups,
    ranked by the sum of each group's top-2 biased scores; DeepSeek-V2's group_limited_greedy ranks a group by its
    best score, without a bias), but *weighted* by the unbiased scores of the chosen experts, normalised, times
    `routed_scaling_factor`.
    """
    logits = router_logits.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if cfg.scoring_func == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores + bias.astype(jnp.float32) if cfg.topk_method == "noaux_tc" else scores
    num_tokens, num_experts = choice.shape
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        grouped = choice.reshape(num_tokens, cfg.n_group, num_experts // cfg.n_group)
        if cfg.topk_method == "group_limited_greedy":
            group_score = grouped.max(-1)  # [N, G]
        else:
            group_score = jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)
        _, best_groups = jax.lax.top_k(group_score, cfg.topk_group)
        keep = jnp.zeros((num_tokens, cfg.n_group), bool).at[jnp.arange(num_tokens)[:, None], best_groups].set(True)
        # Experts of excluded groups can never be chosen (-inf, as in transformers >= 5 and DeepSeek's code).
        choice = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)
    _, indices = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return indices.astype(jnp.int32), weights * cfg.routed_scaling_factor


def swiglu(x, gate, up, down):
    """down(silu(x @ gate) * (x @ up)) on [H, I] / [I, H] weights, as layers.MLP computes it."""
    return jnp.dot(jax.nn.silu(jnp.dot(x, gate)) * jnp.dot(x, up), down)


def routed_experts(x2d, indices, weights, gate, up, down, expert_offset=0, impl="auto", expert_second=None,
                   blocks_per_sm=CUDA_BLOCKS_PER_SM, shared=None):
    """Sum over each token's chosen experts of weight * expert(x), for the experts held here.

    gate/up [E_local, H, I], down [E_local, I, H] are experts expert_offset .. expert_offset + E_local
    (all of them unsharded; a slice of them under expert parallelism, whose caller sums the devices'
    results). The (token, expert) pairs are sorted by expert so that `ragged_dot` runs each expert over
    one contiguous block of rows: exact, and no expert runs on tokens that did not choose it. Pairs of
    experts held elsewhere sort last, past every group, where ragged_dot yields zeros. `impl` picks the
    grouped MLP (ops/moe.py): ragged_dot, or on GPU a CUDA grouped GEMV for decode-sized row counts; on a GPU
    "auto" runs few pairs (ops.moe.PAIRS_MAX) unsorted through the CUDA pairs op, as "pairs" does at any count, and
    more pairs over few experts as every expert on every token (ops.moe.use_all_experts);
    `expert_second`: MoE.loop_weights(), for the CPU's dense form; `blocks_per_sm`: the CUDA op's register
    budget (ops/moe.py; benchmarks pass it for A/B runs); `shared`: a shared expert's (gate [H, I], up [H, I],
    down [I, H]) of the routed experts' width, added to every token's result: inside the pairs op's kernels on a GPU
    (pair_expert_mlp), as its own products elsewhere (MoE.folds_shared says when the model passes it).
    """
    num_tokens, k = indices.shape
    num_local = gate.shape[0]
    local = indices - expert_offset
    sorted_impl = "cuda" if impl == "pairs" else impl

    def on_sorted_rows(x2d, local, weights, gate, up, down):
        held = jnp.where((local >= 0) & (local < num_local), local, num_local)  # num_local: held elsewhere
        flat_expert = held.reshape(-1)
        order = jnp.argsort(flat_expert, stable=True)
        token_of_row = order // k
        rows = x2d[token_of_row]
        group_sizes = jnp.bincount(flat_expert, length=num_local + 1)[:num_local].astype(jnp.int32)
        out_rows = grouped_expert_mlp(rows, group_sizes, gate, up, down, impl=sorted_impl, expert_second=expert_second,
                                      blocks_per_sm=blocks_per_sm)
        # Back to (token, choice) order by a gather, then each token's weighted sum in float32: one fusion. The
        # scatter-add of the sorted rows into their tokens that this replaces took ~25 us per layer at T = 9
        # on an H200 (k colliding bf16 atomic adds per element), a tenth of the layer's MoE.
        position = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                                       unique_indices=True)
        pair_out = out_rows[position].reshape(num_tokens, k, -1)
        return moe_ops.weighted_pair_sum(pair_out, held < num_local, weights, x2d.dtype)

    args = (x2d, local, weights, gate, up, down)
    if shared is not None:
        if not moe_ops.use_pairs(num_tokens * k, x2d, gate, up, down, impl):  # no pairs op: the shared expert apart
            routed = routed_experts(x2d, indices, weights, gate, up, down, expert_offset, impl, expert_second,
                                    blocks_per_sm)
            return (routed + swiglu(x2d, *shared)).astype(x2d.dtype)

        def with_shared(*a):
            return (on_sorted_rows(*a) + swiglu(x2d, *shared)).astype(x2d.dtype)
        on_pairs = functools.partial(moe_ops.pair_expert_mlp, blocks_per_sm=blocks_per_sm, shared=shared)
        return jax.lax.platform_dependent(*args, cuda=on_pairs, default=with_shared)
    if moe_ops.use_all_experts(num_tokens * k, x2d, gate, impl):
        # Few experts, many pairs: every expert on every token beats the sort's bookkeeping on a GPU (ops/moe.py).
        return jax.lax.platform_dependent(*args, cuda=moe_ops.all_experts_routed, default=on_sorted_rows)
    if not moe_ops.use_pairs(num_tokens * k, x2d, gate, up, down, impl):
        return on_sorted_rows(*args)
    # Few pairs on a GPU: the pairs in place, no sort and no combine launches (ops/moe.py, pair_expert_mlp); the op
    # itself skips pairs whose expert is not held here (ids outside [0, E)), so they need no mask (a kernel less).
    on_pairs = functools.partial(moe_ops.pair_expert_mlp, blocks_per_sm=blocks_per_sm)
    return jax.lax.platform_dependent(*args, cuda=on_pairs, default=on_sorted_rows)


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        init = nnx.initializers.normal(stddev=1.0 / math.sqrt(cfg.hidden_size))
        # Every device routes every token, so the router is replicated ("router" maps to no mesh axis).
        self.weight = logical_axes(nnx.Param(
            init(rngs.params(), (cfg.n_routed_experts, cfg.hidden_size), jnp.float32).astype(dtype)), "router", "embed")
        self.e_score_correction_bias = logical_axes(nnx.Param(jnp.zeros((cfg.n_routed_experts,), jnp.float32)), "router")

    def __call__(self, x2d):
        # The router runs in float32 whatever the model's dtype (as HF does).
        logits = dot_transposed(x2d.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        # One CUDA kernel on a GPU (ops/route.py), `route` elsewhere.
        return route_ops.choose_experts(logits, self.e_score_correction_bias[...], self.cfg, route)


class RoutedExperts(nnx.Module):
    """All routed experts' SwiGLU weights stacked on a leading expert axis."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs):
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        normal = nnx.initializers.normal
        self.gate_proj = logical_axes(nnx.Param(normal(1.0 / math.sqrt(h))(rngs.params(), (e, h, i), dtype)),
                                      "experts", "embed", "expert_mlp")
        self.up_proj = logical_axes(nnx.Param(normal(1.0 / math.sqrt(h))(rngs.params(), (e, h, i), dtype)),
                                    "experts", "embed", "expert_mlp")
        self.down_proj = logical_axes(nnx.Param(normal(1.0 / math.sqrt(i))(rngs.params(), (e, i, h), dtype)),
                                      "experts", "expert_mlp", "embed")

def expert_counts(slots_per_layer, num_slots: int):
    """Tokens routed to each physical expert slot, [layers, num_slots] int32, from each MoE layer's routed slots
    [rows, k] (MoE.__call__). One count over every layer: a count per layer was two kernels a layer (a memset and a
    scatter-add) on a GPU, 48 of the Kimi-K2 rank step's ~900."""
    layers = len(slots_per_layer)
    flat = jnp.stack([s.reshape(-1) for s in slots_per_layer])  # [layers, rows * k]
    flat = flat + (jnp.arange(layers, dtype=flat.dtype) * num_slots)[:, None]
    return jnp.bincount(flat.reshape(-1), length=layers * num_slots).reshape(layers, num_slots).astype(jnp.int32)


class ExpertMap(nnx.Variable):
    """Where each logical expert's replicas live among the physical expert slots (see eplb.py)."""


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, placement: MeshLayout | None = None):
        self.placement = placement  # on a mesh (sharding.shard_model gives it): experts split by its layout
        # None: physical expert slot e holds logical expert e. Otherwise (eplb.apply_placement)
        # replicas [E, R] physical slots of each logical expert (-1 padding), num_replicas [E].
        self.replicas = nnx.data(None)
        self.num_replicas = nnx.data(None)
        self.gate = Router(cfg, dtype, rngs)
        self.experts = RoutedExperts(cfg, dtype, rngs)
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, rngs)
        else:
            self.shared_experts = None

    @property
    def num_slots(self) -> int:
        """Physical expert slots (E, or more when hot experts are replicated)."""
        return self.experts.gate_proj.shape[0]

    def to_physical(self, indices):
        """Logical expert ids [N, k] -> physical slots; a token picks among replicas by its index, which
        spreads a hot expert's tokens evenly over its copies."""
        if self.replicas is None:
            return indices
        token = jnp.arange(indices.shape[0], dtype=jnp.int32)[:, None]
        choice = token % self.num_replicas[...][indices]
        return self.replicas[...][indices, choice]

    def loop_weights(self):
        """What a decode loop computes once, before its while loop, for this layer's routed experts: on a
        CPU, unsharded, the expert weights laid out expert axis second for ops.moe.dense_mlp (XLA:CPU's
        ragged_dot transposes [E, H, I] to that layout at every call: in the loop, a copy of every expert
        at every step); None elsewhere (a GPU reads [E, H, I] as it is)."""
        if self.placement is not None or jax.default_backend() != "cpu":
            return None
        ex = self.experts
        return tuple(jnp.swapaxes(w[...], 0, 1) for w in (ex.gate_proj, ex.up_proj, ex.down_proj))

    def __call__(self, x, loop_weights=None, rows: RowLayout | None = None, residual=None):
        """-> (output like x, plus `residual` when given, the physical expert slots each real row was routed to
        [rows, k] int32: `expert_counts` turns them into router statistics, every layer's in one count).
        `loop_weights`: this layer's loop_weights(), computed by a decode loop before its body; `rows`: the rows
        of a row-invariant pass (model/row_invariant.py): every row is routed, the padding rows to no expert, and the
        routed experts run a block of rows at a time like the rest."""
        rows = RowLayout(x.shape[0], 1) if rows is None else rows  # None: x as it is
        x2d = x.reshape(-1, x.shape[-1])
        indices, weights = rows.map(self.gate, x2d)
        slots = self.to_physical(indices)
        impl = "row_invariant" if rows.invariant else "auto"  # ops/moe.py: a row's result alone or among others
        fold = self.folds_shared(x2d, slots.shape[1], impl)
        out = rows.map(lambda h, s, w: self.routed(h, s, w, loop_weights, impl, fold), x2d, rows.no_experts(slots),
                       weights)
        shared = None if fold else self.shared_experts
        extra = () if residual is None else (residual.reshape(x2d.shape),)

        def finish(h, o, *r):
            # The shared expert and the residual add in one row block: a row-invariant pass must fuse the shared
            # expert's last product with the adds after it as every pass does (XLA:CPU folds a dot and the add after
            # it into one rounding where they meet in one computation).
            o = o if shared is None else o + shared(h)
            return r[0] + o if r else o
        out = rows.map(finish, x2d, out, *extra)
        return out.reshape(x.shape), rows.real(slots)

    def folds_shared(self, x2d, top_k: int, impl: str) -> bool:
        """Whether the shared expert runs inside the routed experts' CUDA pairs op (ops.moe.pair_expert_mlp, shared=):
        a GPU "auto" pass of at most ops.moe.SHARED_FOLD_MAX_TOKENS rows whose routed pairs take that op, a shared
        expert as wide as a routed one on each device (n_shared_experts = 1; unsharded, or both split along the
        intermediate dim as tp splits them; not ep, whose routed experts stay whole while the shared one is split).
        Then no launches of its own, and on a mesh its partial sums ride the routed experts' psum instead of an
        all-reduce of their own."""
        shared, ex = self.shared_experts, self.experts
        if shared is None or impl != "auto" or x2d.shape[0] > moe_ops.SHARED_FOLD_MAX_TOKENS \
                or not moe_ops.pairs_shared_built():
            return False
        kernel = shared.gate_proj.kernel
        if kernel.shape[1] != ex.gate_proj.shape[2] or kernel.dtype != ex.gate_proj.dtype:
            return False
        if self.placement is not None:
            shared_split = self.placement.param_spec(shared.gate_proj.kernel)
            routed_split = self.placement.param_spec(ex.gate_proj)
            if tuple(shared_split)[1:2] != tuple(routed_split)[2:3] or self.placement.splits("experts"):
                return False
        return moe_ops.use_pairs(x2d.shape[0] * top_k, x2d, ex.gate_proj[...], ex.up_proj[...], ex.down_proj[...],
                                 impl)

    def routed(self, x2d, indices, weights, loop_weights=None, impl: str = "auto", with_shared: bool = False):
        """Routed experts; on a mesh each device computes its share and the shares are summed. `impl`: the grouped
        MLP's formulation (ops/moe.py; "row_invariant" in a row-invariant pass); `with_shared`: the shared expert
        added inside the same op (`folds_shared`).

        tp: every device holds every expert's 1/n of the intermediate dim (partial sums);
        ep: every device holds E/n whole experts and the tokens that chose them contribute there.
        Tokens and routing are replicated, so the only collective is the final psum.
        """
        ex = self.experts
        params = [ex.gate_proj, ex.up_proj, ex.down_proj]
        if with_shared:
            sh = self.shared_experts
            params += [sh.gate_proj.kernel, sh.up_proj.kernel, sh.down_proj.kernel]
        weights_in = tuple(p[...] for p in params)
        placement = self.placement
        if placement is None:
            return routed_experts(x2d, indices, weights, *weights_in[:3], impl=impl, expert_second=loop_weights,
                                  shared=weights_in[3:] or None)
        # Each weight's spec from its own logical axes; tokens, routing and the output are replicated.
        specs = tuple(placement.param_spec(p) for p in params)
        whole = placement.spec()
        experts_split = placement.splits("experts")

        def local(x, i, w, g, u, d, *shared):
            # ep: this device's experts are ids [offset, offset + E/n); tp: every expert, a slice of each.
            offset = jax.lax.axis_index(MESH_AXIS) * g.shape[0] if experts_split else 0
            return jax.lax.psum(routed_experts(x, i, w, g, u, d, expert_offset=offset, impl=impl,
                                               shared=shared or None), MESH_AXIS)
        return jax.shard_map(local, mesh=placement.mesh, in_specs=(whole,) * 3 + specs, out_specs=whole,
                             check_vma=False)(x2d, indices, weights, *weights_in)
