"""Spreading the target over devices: a 1-D mesh, logical-axis rules for two layouts, `shard_model`.

Every parameter names its dimensions with logical axes (Flax sharding metadata, set in model/*.py):
"embed", "heads", "q_lora", "kv_latent", "mlp", "experts", "expert_mlp", "router", "vocab", "vocab_out".
A layout maps some of them to the mesh axis; the rest are replicated.

  tp  MLA heads split (q_b/q_proj, kv_b_proj columns, o_proj rows); the latent pool replicated on every
      device (all heads read the same rows); dense MLPs, shared experts and every routed expert split
      along their intermediate dim; partial sums meet in an all-reduce.
  ep  MLA as in tp; routed experts split whole across devices (E/n each), tokens replicated, each
      device computes its experts' contributions, then one psum; dense MLPs as in tp.

In both, the lm head is split along the vocabulary and the embedding is replicated (a lookup into a
split table would gather it). A vocabulary the mesh does not divide is padded, as vLLM and SGLang do: the lm
head gets zero columns up to the next multiple of the mesh size (`pad_vocab`) and `Transformer.lm_logits` cuts
the padded ids' logits off, so no padded id is ever seen, and a checkpoint is saved without the padding. The verify-attention custom call runs under `jax.shard_map` on each
device's heads (MLA.attend), and the routed experts under `shard_map` with one psum (MoE.routed); the
rest is partitioned by XLA from the parameter shardings.

`LAYOUTS` is the one table: parameter shardings (`parameter_shardings`) and the shard_map specs of
MLA.attend and MoE.routed are all derived from it through a `MeshLayout` (mesh + layout name), which the
attention and MoE layers hold; no module writes a PartitionSpec by hand. Activations name their dimensions
with the same logical axes ("batch", "seq", "heads", "kv_latent", ...; unnamed ones are replicated).

The drafter is replicated: it is a few layers of the target's width (a few % of the target's FLOPs
and bytes), and running it whole on every device costs no collective inside the draft step, whose
latency is on the critical path, while its outputs (tree tokens) are needed on every device anyway.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kdtree_jax.config import MESH_AXIS

if TYPE_CHECKING:  # annotations only: the model imports this module (MeshLayout), this module never imports it
    from kdtree_jax.model.transformer import Transformer

LAYOUTS = {
    "tp": {"heads": MESH_AXIS, "mlp": MESH_AXIS, "expert_mlp": MESH_AXIS, "vocab_out": MESH_AXIS},
    "ep": {"heads": MESH_AXIS, "mlp": MESH_AXIS, "experts": MESH_AXIS, "vocab_out": MESH_AXIS},
}


def make_mesh(num_devices: Optional[int] = None, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A 1-D mesh named "model" over `num_devices` devices (default: all, across hosts once
    `jax.distributed.initialize()` has run)."""
    devices = list(jax.devices() if devices is None else devices)
    num_devices = len(devices) if num_devices is None else num_devices
    if not 1 <= num_devices <= len(devices):
        raise ValueError(f"num_devices must be in [1, {len(devices)}] (devices available); got {num_devices}")
    return Mesh(np.array(devices[:num_devices]), (MESH_AXIS,))


def partition_spec(axes: Optional[tuple], layout: str) -> P:
    """Logical axis names of one array (a parameter's, or an activation's) -> its PartitionSpec under a layout."""
    rules = LAYOUTS[layout]
    return P(*(rules.get(a) for a in axes)) if axes else P()


def check_layout(layout: str) -> None:
    """A layout name LAYOUTS knows, or a one-line error naming those it does."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)}; got {layout!r}")


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A mesh and the layout the model is split by on it: what a sharded attention or MoE layer is given
    (`MLA.placement`, `MoE.placement`) to build its shard_map specs from `LAYOUTS`."""

    mesh: Mesh
    layout: str

    def __post_init__(self):
        check_layout(self.layout)

    def spec(self, *axes: Optional[str]) -> P:
        """PartitionSpec of an array whose dimensions have these logical names (None: unnamed)."""
        return partition_spec(axes, self.layout)

    def param_spec(self, param: nnx.Variable) -> P:
        """PartitionSpec of a parameter, from its logical axes (model/layers.py `logical_axes`)."""
        return partition_spec(param.get_metadata().get("out_sharding"), self.layout)

    def splits(self, axis: str) -> bool:
        """Whether this layout splits the logical axis over the mesh."""
        return LAYOUTS[self.layout].get(axis) is not None


def parameter_shardings(model: nnx.Module, mesh: Mesh, layout: str = "tp"):
    """An nnx.State of NamedShardings mirroring the model's parameters."""
    check_layout(layout)
    state = nnx.state(model)
    return jax.tree.map(lambda v: NamedSharding(mesh, partition_spec(v.get_metadata().get("out_sharding"), layout)),
                        state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def divisibility_problems(cfg, n: int, layout: str) -> list[str]:
    """The dimensions of a model config that `layout` splits over n devices and n does not divide (empty: it fits)."""
    problems = []
    if cfg.num_attention_heads % n:
        problems.append(f"num_attention_heads ({cfg.num_attention_heads})")
    if cfg.first_k_dense_replace and cfg.intermediate_size % n:
        problems.append(f"intermediate_size ({cfg.intermediate_size})")
    if cfg.n_shared_experts and (cfg.moe_intermediate_size * cfg.n_shared_experts) % n:
        problems.append(f"shared expert intermediate ({cfg.moe_intermediate_size * cfg.n_shared_experts})")
    if cfg.num_moe_layers:
        if layout == "tp" and cfg.moe_intermediate_size % n:
            problems.append(f"moe_intermediate_size ({cfg.moe_intermediate_size})")
        if layout == "ep" and cfg.n_routed_experts % n:
            problems.append(f"n_routed_experts ({cfg.n_routed_experts})")
    return problems


def mesh_sizes(cfg, layout: str, max_devices: int) -> list[int]:
    """The mesh sizes up to max_devices that `layout` can split this model config over."""
    check_layout(layout)
    return [n for n in range(1, max_devices + 1) if not divisibility_problems(cfg, n, layout)]


def check_divisible(model: "Transformer", mesh: Mesh, layout: str) -> None:
    """Every split dimension must divide evenly; say which one does not, before placing anything."""
    n = mesh.shape[MESH_AXIS]
    problems = divisibility_problems(model.cfg, n, layout)
    if problems:
        raise ValueError(f"layout {layout!r} over {n} devices needs these divisible by {n}: " + ", ".join(problems))


def shard_model(model: "Transformer", mesh: Mesh, layout: str = "tp") -> "Transformer":
    """A copy of the target with its parameters placed on `mesh` by `layout` ("tp" or "ep").

    The returned model's attention and MoE layers hold the MeshLayout, so jitted code (prefill, the decode
    loop) runs sharded with no further changes. The argument is left as it was.
    """
    graphdef, state = nnx.split(model)
    placed = jax.device_put(state, placement_shardings(model, mesh, layout))  # a prefix tree of state
    sharded = nnx.merge(graphdef, placed)
    pad_vocab(sharded, mesh, layout)
    attach_mesh(sharded, mesh, layout)
    return sharded


def placement_shardings(model: "Transformer", mesh: Mesh, layout: str) -> nnx.State:
    """Where a target's parameters are first placed (by `shard_model`, or read by `checkpoint.load_sharded`):
    `parameter_shardings`, but the lm head whole when the mesh does not divide the vocabulary, since a split
    needs it to; `pad_vocab` then pads and splits it. `model` may be abstract (nnx.eval_shape)."""
    check_layout(layout)
    check_divisible(model, mesh, layout)
    shardings = parameter_shardings(model, mesh, layout)
    if _needs_padding(model, mesh):
        shardings["lm_head"]["kernel"] = NamedSharding(mesh, P())
    return shardings


def padded_vocab_size(vocab_size: int, mesh: Mesh) -> int:
    """The vocabulary rounded up to a multiple of the mesh size (what a vocab-split lm head holds)."""
    n = mesh.shape[MESH_AXIS]
    return -(-vocab_size // n) * n


def _needs_padding(model: "Transformer", mesh: Mesh) -> bool:
    """An untied lm head whose vocabulary the mesh does not divide (a tied head reads the replicated embedding)."""
    return model.lm_head is not None and model.cfg.vocab_size % mesh.shape[MESH_AXIS] != 0


def _padded_head(model: "Transformer", mesh: Mesh):
    """The lm head's kernel [hidden, V] with zero columns up to padded_vocab_size, or None when no padding is
    needed (V divides the mesh, the head is already padded, or the head is tied to the replicated embedding)."""
    if not _needs_padding(model, mesh):
        return None
    kernel = model.lm_head.kernel[...]
    padded = padded_vocab_size(model.cfg.vocab_size, mesh)
    if kernel.shape[-1] == padded:
        return None
    kernel = kernel[:, :model.cfg.vocab_size]
    return jax.numpy.pad(kernel, ((0, 0), (0, padded - model.cfg.vocab_size)))


def pad_vocab(model: "Transformer", mesh: Mesh, layout: str) -> None:
    """In place: pad a restored model's lm head (placed whole, see placement_shardings) to the mesh and split it
    along the vocabulary as `layout` says. Nothing to do when the vocabulary divides the mesh."""
    head = _padded_head(model, mesh)
    if head is not None:
        spec = partition_spec(model.lm_head.kernel.get_metadata().get("out_sharding"), layout)
        placed = jax.device_put(head, NamedSharding(mesh, spec))
        kernel = model.lm_head.kernel
        kernel.set_value(placed) if hasattr(kernel, "set_value") else setattr(kernel, "value", placed)


def layout_of(model: "Transformer") -> Optional[str]:
    """The layout a sharded model is split by ("tp" / "ep"; `attach_mesh`), None for an unsharded one."""
    for _, module in nnx.iter_graph(model):
        placement = getattr(module, "placement", None)
        if isinstance(placement, MeshLayout):
            return placement.layout
    return None


def attach_mesh(model: "Transformer", mesh: Optional[Mesh], layout: Optional[str]) -> None:
    """Give a model whose parameters are already in place (`shard_model`, `load_sharded`, a benchmark's
    abstract model) its MeshLayout: each attention and MoE layer's `placement` (None: unsharded)."""
    placement = None if mesh is None else MeshLayout(mesh, layout)
    model.mesh = mesh
    for _, module in nnx.iter_graph(model):
        if hasattr(module, "placement"):  # MLA and MoE
            module.placement = placement


def replicate(tree, mesh: Mesh):
    """Place every array of a pytree (the KV cache, the drafter) whole on every device of the mesh."""
    return jax.device_put(tree, NamedSharding(mesh, P()))
