"""The parameters one device holds, as the engine places them: the served model (KV
heads copied when fewer than devices) split by the parameter table
(model/params_table.py), leaf by leaf with the layer each belongs to; the parameter
counts and a decoded token's matmul FLOPs from them. The planner (planner.py) sums
their bytes; pipeline_plan.py sums a stage's layers.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.model import sharding
from jaxinfer.model.params_table import EXPERTS, LAYER, param_partition_specs, param_shapes
from jaxinfer.sizing import pipeline_plan

Leaf = tuple[int | None, str, tuple[int, ...], int, PartitionSpec]


def device_leaves(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> list[Leaf]:
    """(layer, name, shape, elements on one device, spec) of every parameter on one of
    `tp` devices, layer None outside the layers; experts whole with `expert_parallel`."""
    served = sharding.served_config(cfg, tp)
    flat, _ = jax.tree_util.tree_flatten_with_path(
        param_shapes(served), is_leaf=lambda x: isinstance(x, tuple))
    specs = jax.tree.leaves(param_partition_specs(served, tp, expert_parallel),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))
    out = []
    for (path, shape), spec in zip(flat, specs, strict=True):
        split = sum(axis is not None for axis in spec)  # axes split over the model axis
        layer = path[1].idx if path[0].key == "layers" else None
        out.append((layer, path[-1].key, shape, math.prod(shape) // tp ** split, spec))
    return out


def by_layer(cfg: ModelConfig, leaves: list[tuple[int | None, int]]) -> tuple[int, list[int]]:
    """(the figure outside the layers, the figure of each layer) from (layer, figure)."""
    per_layer = [0] * cfg.num_layers
    top = 0
    for layer, value in leaves:
        if layer is None:
            top += value
        else:
            per_layer[layer] += value
    return top, per_layer


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters: active counts k of the E experts per MoE layer."""
    flat = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    total = sum(math.prod(shape) for shape in flat)
    if cfg.moe is None:
        return total, total
    experts = sum(math.prod(shape) for _, name, shape, _, _ in device_leaves(cfg, 1)
                  if name in EXPERTS)
    return total, total - experts + experts * cfg.moe.num_experts_per_tok // cfg.moe.num_experts


def decode_flops(cfg: ModelConfig, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1) -> tuple[int, int]:
    """FLOPs of one decoded token on one device: (matmuls, attention per cached token).
    Matmuls: 2 x the matrices a token multiplies: k of E experts (their biases [E, n] are
    none), a tied embedding once, as the LM head. Attention: 4 x heads x head_dim x layers.
    With `pipeline_parallel_size`, one stage's: its layer slots and the head."""
    top, per_layer = matmul_flops_split(cfg, tensor_parallel_size)
    slots = pipeline_plan.layer_slots(cfg, pipeline_parallel_size)
    heads = cfg.num_heads // tensor_parallel_size
    return (top + pipeline_plan.stage_sum(cfg, pipeline_parallel_size, per_layer),
            4 * heads * cfg.head_dim * slots)  # q.k and p.v


def matmul_flops_split(cfg: ModelConfig, tensor_parallel_size: int = 1
                       ) -> tuple[int, list[int]]:
    """`decode_flops`' matmul FLOPs a token on one device as (the head's, each layer's)."""
    leaves = device_leaves(cfg, tensor_parallel_size)
    stacked = {p.key for p in LAYER if p.experts} | {"embed"}  # below, or not a matmul
    flops = [(layer, 2 * n) for layer, name, shape, n, _ in leaves
             if len(shape) == 2 and name not in stacked]
    if cfg.moe is not None:  # each token runs k of the E experts
        flops += [(layer, 2 * n * cfg.moe.num_experts_per_tok // cfg.moe.num_experts)
                  for layer, name, _, n, _ in leaves if name in EXPERTS]
    if cfg.tie_word_embeddings:
        flops += [(None, 2 * n) for _, name, _, n, _ in leaves if name == "embed"]
    return by_layer(cfg, flops)
