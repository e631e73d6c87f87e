"""Pipeline parallelism: the decoder layers split into stages over the mesh's `STAGE_AXIS`,
each stage holding its layers' weights and KV pages (stacked by slot: leaf [stages,
...]), a step's tokens flowing through the stages in microbatches so that they work at
once. One SPMD program: `shard_map` over the stage axis, tensor parallelism inside a
stage as before, activations handed on by collective permutes. The stage rule is
config/pipeline.py's. See docs/parallelism.md#pipeline-parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxinfer.config import pipeline as rules
from jaxinfer.model.attention import AttentionMetadata
from jaxinfer.model.sharding import STAGE_AXIS


def stage_spec(spec: P) -> P:
    """A slot leaf's PartitionSpec: split by stage on its new leading axis, then as the
    unstacked leaf."""
    return P(STAGE_AXIS, *spec)


def slot_count(num_layers: int, stages: int) -> int:
    """Layers (stages == 1) or layer slots (stacked by stage) the params and KV cache
    hold."""
    return rules.slots_per_stage(num_layers, stages)


def stack_layers(layer_list: Sequence[object], stages: int) -> list:
    """Per-layer trees (L of them, in order) -> per-slot trees whose leaves are stacked
    [stages, ...]: slot j holds layer start_s + j of each stage s, zeros where a stage has
    fewer layers (config/pipeline.py `stage_sizes`). Works on arrays, ShapeDtypeStructs
    (stacked shapes) and PartitionSpecs (`stage_spec`)."""
    num_layers = len(layer_list)
    sizes = rules.stage_sizes(num_layers, stages)
    starts = rules.stage_starts(num_layers, stages)
    slots = []
    for slot in range(max(sizes)):
        per_stage = [layer_list[start + min(slot, size - 1)]
                     for start, size in zip(starts, sizes, strict=True)]
        present = [slot < size for size in sizes]
        slots.append(jax.tree.map(functools.partial(_stack, present=present), *per_stage,
                                  is_leaf=lambda x: isinstance(x, P)))
    return slots


def _stack(*leaves: object, present: list[bool]) -> object:
    first = leaves[0]
    if isinstance(first, P):
        return stage_spec(first)
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype)
    return jnp.stack([leaf if here else jnp.zeros_like(leaf)
                      for leaf, here in zip(leaves, present, strict=True)])


def stack_in_place(layer_list: Sequence[object], stages: int, shardings: list) -> list:
    """`stack_layers` for arrays already on their stage's devices (the loader reads a
    layer onto its stage alone, checkpoint/hf.py): each device's buffer becomes its
    slice of the stacked array on `shardings` (per slot, stage-split), nothing moves
    between devices, and a stage's missing slot is zeros made where it lives."""
    sizes = rules.stage_sizes(len(layer_list), stages)
    starts = rules.stage_starts(len(layer_list), stages)
    slots = []
    for slot in range(max(sizes)):
        per_stage = [layer_list[start + min(slot, size - 1)]
                     for start, size in zip(starts, sizes, strict=True)]
        present = [slot < size for size in sizes]
        slots.append(jax.tree.map(functools.partial(_assemble, present=present),
                                  shardings[slot], *per_stage))
    return slots


def _assemble(sharding: jax.sharding.NamedSharding, *leaves: jax.Array,
              present: list[bool]) -> jax.Array:
    pieces = []
    for leaf, here in zip(leaves, present, strict=True):
        for shard in leaf.addressable_shards:
            data = shard.data[None] if here else jnp.zeros(
                (1, *shard.data.shape), shard.data.dtype, device=shard.device)
            pieces.append(data)
    return jax.make_array_from_single_device_arrays((len(leaves), *leaves[0].shape),
                                                    sharding, pieces)


def on_stages(layer_list: Sequence[object]) -> bool:
    """Whether the layers' arrays sit on their stages' devices alone (`stack_in_place`),
    rather than each on every device."""
    first = jax.tree.leaves(layer_list[0])[0]
    last = jax.tree.leaves(layer_list[-1])[0]
    return first.sharding.device_set != last.sharding.device_set


def microbatch_count(num_tokens: int, wanted: int) -> int:
    """Microbatches a step of `num_tokens` runs in: the largest divisor of it not above
    `wanted`, so every microbatch has the same static size."""
    return max(d for d in range(1, min(wanted, num_tokens) + 1) if num_tokens % d == 0)


def run_stages(layer_fn: Callable, stacked: list, kv_cache: list, x: jax.Array,
               md: AttentionMetadata, ropes: dict, *, stages: int, microbatches: int,
               num_layers: int, rows: jax.Array) -> tuple[jax.Array, list, jax.Array]:
    """The pipelined layers: `x` f32[T, D] (the embedded tokens, on every stage) through
    every stage's layers, microbatch by microbatch; returns (f32[R, D] the last layer's
    output at token `rows`, on every stage; the new stacked KV cache; i32[stages, slots,
    E] tokens per expert of each stage's MoE slots, [stages, 0, 0] without experts).
    `layer_fn(layer, x, kv_pages, md, ropes, slot)` -> (x, kv_pages, counts or None)."""
    run = functools.partial(_stage, layer_fn, stages=stages, num_layers=num_layers,
                            microbatches=microbatch_count(x.shape[0], microbatches))
    return jax.shard_map(run, in_specs=(P(STAGE_AXIS), P(STAGE_AXIS), P(), P(), P(), P()),
                         out_specs=(P(), P(STAGE_AXIS), P(STAGE_AXIS)),
                         axis_names={STAGE_AXIS}, check_vma=False)(
        stacked, kv_cache, x, md, ropes, rows)


def _stage(layer_fn: Callable, stacked: list, kv_cache: list, x: jax.Array,
           md: AttentionMetadata, ropes: dict, rows: jax.Array, *, stages: int,
           num_layers: int, microbatches: int) -> tuple[jax.Array, list, jax.Array]:
    """One stage's program (inside shard_map): M + stages - 1 ticks; at tick t stage s runs
    microbatch t - s through its layers when there is one, then hands it on."""
    stage = jax.lax.axis_index(STAGE_AXIS)
    layer_slots = [jax.tree.map(lambda a: a[0], layer) for layer in stacked]
    kv = [jax.tree.map(lambda a: a[0], pages) for pages in kv_cache]
    size = x.shape[0] // microbatches
    layers_here = jnp.asarray(rules.stage_sizes(num_layers, stages), jnp.int32)[stage]

    def tick(t: jax.Array, carry: tuple) -> tuple:
        kv, inbox, out, counts = carry
        micro = t - stage
        valid = (micro >= 0) & (micro < microbatches)
        start = jnp.clip(micro, 0, microbatches - 1) * size
        h = jnp.where(stage == 0, jax.lax.dynamic_slice_in_dim(x, start, size), inbox)
        md_micro = microbatch(md, start, size, valid)
        ropes_micro = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size),
                                   ropes)
        new_kv, slot_counts = [], []
        for slot, (layer, pages) in enumerate(zip(layer_slots, kv, strict=True)):
            y, pages, experts = layer_fn(layer, h, pages, md_micro, ropes_micro, slot)
            here = slot < layers_here
            h = jnp.where(here, y, h)
            new_kv.append(pages)
            if experts is not None:
                slot_counts.append(jnp.where(here & valid, experts, 0))
        if slot_counts:
            counts = counts + jnp.stack(slot_counts)
        last = valid & (stage == stages - 1)
        out = jnp.where(last, jax.lax.dynamic_update_slice_in_dim(out, h, start, 0), out)
        inbox = jax.lax.ppermute(h, STAGE_AXIS, [(s, s + 1) for s in range(stages - 1)])
        return new_kv, inbox, out, counts

    moe_slots = sum("w_router" in layer for layer in layer_slots)
    counts = jnp.zeros((moe_slots, *_expert_shape(layer_slots)), jnp.int32)
    carry = (kv, jnp.zeros((size, x.shape[1]), x.dtype), jnp.zeros_like(x), counts)
    for t in range(microbatches + stages - 1):  # unrolled: a loop carry copied the KV
        carry = tick(t, carry)
    kv, _, out, counts = carry
    result = from_last_stage(out[rows], stages)
    return (result, [jax.tree.map(lambda a: a[None], pages) for pages in kv],
            counts[None])


def _expert_shape(layer_slots: list) -> tuple[int, ...]:
    """(E,) from a MoE slot's router, (0,) without experts."""
    routers = [layer["w_router"] for layer in layer_slots if "w_router" in layer]
    return (routers[0].shape[-1],) if routers else (0,)


def microbatch(md: AttentionMetadata, start: jax.Array, size: int, valid: jax.Array
               ) -> AttentionMetadata:
    """The metadata of tokens [start, start + size) of the step: each request's queries
    clipped to them and its KV length to its last token among them (its later tokens
    come in a later microbatch, after these wrote their K/V); K/V writes of a microbatch
    that is not `valid` (a pipeline bubble) go to the padding page."""
    cu = md.cu_q_lens
    q_lens = cu[1:] - cu[:-1]
    later = jnp.clip(cu[1:] - (start + size), 0, q_lens)

    def take(a: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(a, start, size, axis=a.ndim - 1)

    groups = md.group_slot_mapping
    return dataclasses.replace(
        md, positions=take(md.positions),
        slot_mapping=jnp.where(valid, take(md.slot_mapping), 0),
        kv_lens=md.kv_lens - later, cu_q_lens=jnp.clip(cu - start, 0, size),
        group_slot_mapping=None if groups is None else jnp.where(valid, take(groups), 0),
        adapters=None if md.adapters is None else take(md.adapters))


def from_last_stage(value: jax.Array, stages: int) -> jax.Array:
    """`value` as the last stage holds it, on every stage: handed on stage to stage
    (last -> 0 -> 1 ...), stages - 1 collective permutes and no all-reduce."""
    stage = jax.lax.axis_index(STAGE_AXIS)
    for hop in range(stages - 1):
        sender = (hop - 1) % stages
        received = jax.lax.ppermute(value, STAGE_AXIS, [(sender, hop)])
        value = jnp.where(stage == hop, received, value)
    return value


def layer_order(counts: jax.Array, num_layers: int, stages: int,
                moe_layers: Sequence[int]) -> jax.Array:
    """i32[stages, slots, E] per-stage MoE slot counts -> i32[L_moe, E] in layer order."""
    starts = rules.stage_starts(num_layers, stages)
    moe = set(moe_layers)
    index = []
    for layer in sorted(moe):
        stage = max(s for s in range(stages) if starts[s] <= layer)
        slot = layer - starts[stage]
        moe_slot = sum(starts[stage] + j in moe for j in range(slot))
        index.append((stage, moe_slot))
    if not index:
        return jnp.zeros((0, 0), jnp.int32)
    where = np.asarray(index)
    return counts[where[:, 0], where[:, 1]]
