"""Tensor parallelism: the device mesh (`MODEL_AXIS`; `layout_mesh` and `replica_mesh` for
data parallelism), which sizes are valid, KV heads copied when devices outnumber them
(`kv_replicas`, `served_config`), and where each array lives.
See docs/parallelism.md#tensor-parallelism and docs/architecture.md.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion
from jaxinfer.model.params_table import MODEL_AXIS

DATA_AXIS = "data"  # data-parallel replicas: rows of layout_mesh
STAGE_AXIS = "stage"  # pipeline stages (model/pipeline.py), outside the model axis


def validate(cfg: ModelConfig, tensor_parallel_size: int, num_devices: int,
             expert_parallel: bool = False) -> None:
    """Raise ValueError, naming the numbers, unless the model splits over that many
    devices (`check_split`) and that many are present."""
    check_split(cfg, tensor_parallel_size, expert_parallel)
    if tensor_parallel_size > num_devices:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} exceeds the "
                         f"{num_devices} device(s) present")


def check_split(cfg: ModelConfig, tensor_parallel_size: int,
                expert_parallel: bool = False) -> None:
    """Raise ValueError, naming the numbers, unless the model splits over that many
    devices: query heads divisible, KV heads divisible or dividing, and whole gate/up
    column blocks per device (model/fusion.py); with `expert_parallel`, whole experts."""
    n, heads, kv_heads = tensor_parallel_size, cfg.num_heads, cfg.num_kv_heads
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"tensor_parallel_size={n!r} must be a positive int")
    if heads % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the {heads} query heads")
    if kv_heads % n and n % kv_heads:
        raise ValueError(f"tensor_parallel_size={n} must divide the {kv_heads} KV heads "
                         f"or be a multiple of them (then KV heads are replicated)")
    if not all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        _check_blocks(n, cfg.intermediate_size, "intermediate_size")
    if cfg.moe is None:
        return
    if expert_parallel and cfg.moe.num_experts % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the {cfg.moe.num_experts} "
                         "experts (enable_expert_parallel=True gives each device whole "
                         "experts)")
    if not expert_parallel:
        _check_blocks(n, cfg.moe.intermediate_size, "moe_intermediate_size")
    if cfg.moe.shared_expert_intermediate_size:
        _check_blocks(n, cfg.moe.shared_expert_intermediate_size,
                      "shared_expert_intermediate_size")


def _check_blocks(n: int, size: int, name: str) -> None:
    """Whole gate/up column-block pairs (model/fusion.py) on each of n devices."""
    blocks = size // fusion.mlp_block(size)
    if blocks % n:
        raise ValueError(f"tensor_parallel_size={n} must divide the {blocks} gate/up "
                         f"column blocks of {fusion.mlp_block(size)} ({name}={size})")


def kv_replicas(cfg: ModelConfig, tensor_parallel_size: int) -> int:
    """Copies of each KV head: n / G when there are fewer KV heads G than devices n."""
    return max(1, tensor_parallel_size // cfg.num_kv_heads)


def served_config(cfg: ModelConfig, tensor_parallel_size: int) -> ModelConfig:
    """The model as it runs: with KV heads copied to one per device when G < n."""
    replicas = kv_replicas(cfg, tensor_parallel_size)
    return dataclasses.replace(cfg, num_kv_heads=cfg.num_kv_heads * replicas)


def make_mesh(tensor_parallel_size: int, devices: list | None = None) -> Mesh:
    """A 1-D mesh named `MODEL_AXIS` over the first `tensor_parallel_size` devices (all
    processes' devices, in JAX's global order)."""
    devices = jax.devices() if devices is None else devices
    if tensor_parallel_size > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} exceeds the "
                         f"{len(devices)} device(s) present")
    return Mesh(np.array(devices[:tensor_parallel_size]), (MODEL_AXIS,),
                axis_types=(jax.sharding.AxisType.Auto,))


def layout_mesh(data_parallel_size: int, tensor_parallel_size: int,
                devices: list | None = None, pipeline_parallel_size: int = 1) -> Mesh:
    """The ("data", "model") mesh over the first data_parallel_size x tensor_parallel_size
    devices (JAX's global order): row r is replica r's devices. With
    pipeline_parallel_size > 1, ("data", "stage", "model"): a replica's stages in order,
    each on tensor_parallel_size consecutive devices (so a stage stays on one host)."""
    devices = jax.devices() if devices is None else devices
    pp = pipeline_parallel_size
    wanted = data_parallel_size * pp * tensor_parallel_size
    if wanted > len(devices):
        stages = f" x pipeline_parallel_size={pp}" if pp > 1 else ""
        raise ValueError(f"data_parallel_size={data_parallel_size}{stages} x "
                         f"tensor_parallel_size={tensor_parallel_size} needs {wanted} "
                         f"devices; {len(devices)} present")
    grid = np.array(devices[:wanted])
    if pp == 1:
        return Mesh(grid.reshape(data_parallel_size, tensor_parallel_size),
                    (DATA_AXIS, MODEL_AXIS), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    return Mesh(grid.reshape(data_parallel_size, pp, tensor_parallel_size),
                (DATA_AXIS, STAGE_AXIS, MODEL_AXIS),
                axis_types=(jax.sharding.AxisType.Auto,) * 3)


def replica_mesh(layout: Mesh, replica: int) -> Mesh:
    """Replica `replica`'s own mesh: its row of `layout`, 1-D ("model"), or ("stage",
    "model") when the layout has stages."""
    names = tuple(name for name in layout.axis_names if name != DATA_AXIS)
    return Mesh(layout.devices[replica], names,
                axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def stage_count(mesh: Mesh) -> int:
    """Pipeline stages of `mesh` (1 without a stage axis)."""
    return mesh.shape[STAGE_AXIS] if STAGE_AXIS in mesh.axis_names else 1


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """Pipeline stage `stage`'s own 1-D ("model") mesh: its devices of `mesh`."""
    return Mesh(mesh.devices[stage], (MODEL_AXIS,), axis_types=(jax.sharding.AxisType.Auto,))


def named(mesh: Mesh, specs: object) -> object:
    """A pytree of PartitionSpecs -> NamedShardings on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def model_axis_size() -> int:
    """Devices on the model axis of the mesh being traced under (`jax.set_mesh`); 1
    outside any mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL_AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[MODEL_AXIS]


def replicate(x: jax.Array) -> jax.Array:
    """`x` gathered whole onto every device of the traced mesh (no-op outside one)."""
    if model_axis_size() == 1:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec())


def split_vocab(logits: jax.Array) -> jax.Array:
    """Logits f32[..., V] kept split along the vocabulary when the traced mesh divides
    it, as the vocab-split LM head computes them. Without this hint GSPMD may satisfy a
    later `replicate` by gathering the whole LM head (V x D) onto every device before
    the matmul, instead of gathering the S x V result after it."""
    shards = model_axis_size()
    if shards == 1 or logits.shape[-1] % shards:
        return logits
    spec = PartitionSpec(*([None] * (logits.ndim - 1)), MODEL_AXIS)
    return jax.lax.with_sharding_constraint(logits, spec)
