"""EPLB-style expert placement: replicate the hottest experts into spare slots, balance load per device.

Under expert parallelism device d holds physical expert slots [d·s, (d+1)·s). At batch 1 a decode step
activates a few dozen of K2's 384 experts, and whichever device holds the most tokens' experts sets
the step time. Given the router's measured load per expert (the engine's `expert_load.slot_tokens`),
`plan_placement` gives each layer `num_devices · slots_per_device` physical slots: every expert gets
one, the spare ones go to the experts with the highest load per replica, and replicas are dealt to
devices heaviest first, each to the least-loaded device that still has room (and, where possible,
no copy of the same expert). `apply_placement` builds the model that serves that placement: the
same logits, with expert weights copied into their slots and tokens spread over a hot expert's
replicas.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from kdtree_jax.model.moe import MoE, ExpertMap
from kdtree_jax.model.transformer import Transformer


@dataclasses.dataclass
class Placement:
    slot_expert: np.ndarray  # [n_moe, slots] logical expert held by each physical slot
    replicas: np.ndarray  # [n_moe, E, R] physical slots of each expert, -1 padding
    num_replicas: np.ndarray  # [n_moe, E]
    num_devices: int

    @property
    def slots_per_device(self) -> int:
        return self.slot_expert.shape[1] // self.num_devices


def device_loads(slot_load: np.ndarray, num_devices: int) -> np.ndarray:
    """[n_moe, slots] load per slot -> [n_moe, devices] (slots split contiguously over devices)."""
    return slot_load.reshape(slot_load.shape[0], num_devices, -1).sum(-1)


def imbalance(slot_load: np.ndarray, num_devices: int) -> np.ndarray:
    """max / mean device load, per layer."""
    loads = device_loads(slot_load, num_devices)
    return loads.max(-1) / np.maximum(loads.mean(-1), 1e-12)


def _plan_layer(load: np.ndarray, num_devices: int, slots_per_device: int):
    num_experts = load.shape[0]
    total = num_devices * slots_per_device
    replicas = np.ones(num_experts, np.int64)
    for _ in range(total - num_experts):  # each spare slot to the expert with the most load per copy
        replicas[np.argmax(load / replicas)] += 1
    copies = [(load[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])]
    copies.sort(key=lambda c: (-c[0], c[1]))
    device_load = np.zeros(num_devices)
    device_slots = [[] for _ in range(num_devices)]
    for share, e in copies:
        open_devices = [d for d in range(num_devices) if len(device_slots[d]) < slots_per_device]
        fresh = [d for d in open_devices if e not in device_slots[d]] or open_devices
        d = min(fresh, key=lambda d: (device_load[d], d))
        device_slots[d].append(e)
        device_load[d] += share
    slot_expert = np.array([e for d in range(num_devices) for e in device_slots[d]], np.int32)
    return slot_expert, replicas


def plan_placement(expert_load, num_devices: int, redundant_per_device: int = 1) -> Placement:
    """Placement from measured load per logical expert [n_moe, E] (or [E] for one layer)."""
    load = np.atleast_2d(np.asarray(expert_load, np.float64))
    num_moe, num_experts = load.shape
    if num_devices < 1 or num_experts % num_devices:
        raise ValueError(f"num_devices ({num_devices}) must divide the number of experts ({num_experts})")
    if redundant_per_device < 0:
        raise ValueError(f"redundant_per_device must be >= 0; got {redundant_per_device}")
    slots_per_device = num_experts // num_devices + redundant_per_device
    # A little load everywhere so that never-seen experts still get a slot on a sensible device.
    load = load + 1e-6
    slot_experts, replica_counts = zip(*(_plan_layer(l, num_devices, slots_per_device) for l in load))
    slot_expert = np.stack(slot_experts)
    num_replicas = np.stack(replica_counts).astype(np.int32)
    max_rep = int(num_replicas.max())
    replicas = np.full((num_moe, num_experts, max_rep), -1, np.int32)
    for layer in range(num_moe):
        seen = np.zeros(num_experts, np.int64)
        for slot, e in enumerate(slot_expert[layer]):
            replicas[layer, e, seen[e]] = slot
            seen[e] += 1
    return Placement(slot_expert, replicas, num_replicas, num_devices)


def placed_load(expert_load, placement: Placement) -> np.ndarray:
    """Expected load per physical slot [n_moe, slots]: each expert's load split over its replicas."""
    load = np.atleast_2d(np.asarray(expert_load, np.float64))
    per_copy = load / placement.num_replicas
    return np.take_along_axis(per_copy, placement.slot_expert.astype(np.int64), axis=1)


def apply_placement(model: Transformer, placement: Placement, *, copy: bool = True) -> Transformer:
    """A copy of the target whose MoE layers hold experts in the placement's slots.

    copy=False re-places `model` itself and returns it: each layer's old expert weights are freed as
    their placed copies are made, so memory never holds the experts twice.

    A sharded model stays sharded: each expert weight is gathered into its slots on the devices, in
    the weight's own sharding, so no device ever holds more than its share (K2's experts are ~34 GB
    a layer). The slots must still divide over the mesh (`plan_placement` guarantees it for ep).
    """
    if copy:
        graphdef, state = nnx.split(model)
        # New Variable objects (the tree map rebuilds them) around the same arrays: replacing a value in
        # the copy leaves the original model untouched, and nothing is copied until it is replaced.
        placed = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    else:
        placed = model
    moe_layers = [layer.mlp for layer in placed.layers if layer.is_moe]
    if len(moe_layers) != placement.slot_expert.shape[0]:
        raise ValueError(f"placement has {placement.slot_expert.shape[0]} layers; the model has {len(moe_layers)} MoE layers")
    for i, moe in enumerate(moe_layers):
        _place_layer(moe, placement, i)
    return placed


def _place_layer(moe: MoE, placement: Placement, i: int) -> None:
    if moe.replicas is not None:
        raise ValueError("this model already has a placement; apply one to the original model")
    take = np.asarray(placement.slot_expert[i])
    for name in ("gate_proj", "up_proj", "down_proj"):
        var = getattr(moe.experts, name)
        value = var[...]
        sharding = value.sharding if moe.placement is not None else None
        placed = jax.jit(lambda w: w[take], out_shardings=sharding)(value)
        var.set_value(placed) if hasattr(var, "set_value") else setattr(var, "value", placed)
    replicas, num_replicas = jnp.asarray(placement.replicas[i]), jnp.asarray(placement.num_replicas[i])
    if moe.placement is not None:  # small tables, replicated next to the replicated router
        replicas, num_replicas = jax.device_put((replicas, num_replicas), NamedSharding(moe.placement.mesh, P()))
    moe.replicas = ExpertMap(replicas)
    moe.num_replicas = ExpertMap(num_replicas)
