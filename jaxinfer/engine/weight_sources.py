"""What `update_weights` takes, as params leaves in the engine's layout: a params pytree
(whole or in part), a mapping of HF tensor names to arrays (the loader's conversion,
checkpoint/hf.py `leaves_from_hf_tensors`) or a checkpoint directory (HF or orbax),
with the bytes each sends from host. See docs/rl.md#updating-weights.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

import jax
import numpy as np

from jaxinfer import checkpoint
from jaxinfer.checkpoint import hf as hf_checkpoint
from jaxinfer.config import ModelConfig
from jaxinfer.engine.runner import weights as device_weights
from jaxinfer.model import sharding


def leaves_of(weights: object, params: dict, cfg: ModelConfig, *,
              expert_parallel: bool = False) -> tuple[dict, int]:
    """(leaf_name -> leaf, bytes sent from host) for `weights`; `params`: the engine's
    (for its dtype and mesh), `cfg`: the checkpoint's ModelConfig."""
    dtype, mesh = device_weights.float_dtype(params), device_weights.mesh_of(params)
    if isinstance(weights, (str, os.PathLike)):
        tree = checkpoint.load_params(pathlib.Path(weights), cfg, dtype, mesh,
                                      expert_parallel=expert_parallel)
        return device_weights.flat_leaves(tree), 0  # read from disk straight to devices
    if isinstance(weights, Mapping) and weights and all(
            isinstance(k, str) and "." in k for k in weights):
        return _from_hf_names(weights, cfg, dtype, mesh, expert_parallel)
    leaves = device_weights.flat_leaves(weights)
    return leaves, device_weights.host_bytes(leaves)


def _from_hf_names(weights: Mapping, cfg: ModelConfig, dtype: str, mesh: object,
                   expert_parallel: bool) -> tuple[dict, int]:
    """HF-named arrays: jax.Arrays fused where they are (no host copy) when the
    engine's mesh needs no KV head copies; host arrays (or jax.Arrays otherwise, read
    back first and counted) cut per device by the loader's reader."""
    on_device = all(isinstance(v, jax.Array) for v in weights.values())
    shards = mesh.shape[sharding.MODEL_AXIS]
    if on_device and sharding.served_config(cfg, shards) == cfg:
        return hf_checkpoint.fused_on_device(dict(weights), cfg), 0
    host = sum(v.nbytes for v in weights.values())
    tensors = {k: np.asarray(jax.device_get(v)) if isinstance(v, jax.Array) else
               np.asarray(v) for k, v in weights.items()}
    leaves = hf_checkpoint.leaves_from_hf_tensors(tensors, cfg, dtype, mesh,
                                                  expert_parallel=expert_parallel)
    return leaves, host
