"""Orbax checkpoints: `convert_hf_to_orbax` (quantized when asked), `restore_orbax`
(straight onto the mesh) and `load_params`, which reads an HF or an orbax directory.
See docs/cli.md#convert.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.checkpoint import awq, prequantized_int4, shard_source
from jaxinfer.checkpoint.hf import check_dtype, load_config, load_hf_params, model_dir_path
from jaxinfer.checkpoint.quantized import (
    QUANTIZATION_FILE,
    checkpoint_quantization,
    quantized_head,
    served_quantization,
)
from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion, quantization, sharding
from jaxinfer.model.params_table import LAYER, param_partition_specs, param_shapes
from jaxinfer.model.transformer import Params

log = logging.getLogger(__name__)

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def load_params(model_dir: str | os.PathLike, cfg: ModelConfig, dtype: str = "float32",
                mesh: Mesh | None = None, log: shard_source.ReadLog | None = None, *,
                expert_parallel: bool = False, quantization_mode: str | None = None
                ) -> Params:
    """Params from an orbax checkpoint if `params/` exists, else from safetensors;
    placed on `mesh` with the tensor-parallel shardings (each device receives only
    its slice; whole experts with `expert_parallel`) in the served layout
    (`sharding.served_config`), or on the default device. `log` records the bytes each
    safetensors read asked for; `quantization_mode`: the mode the params are served in
    (an MXFP4 checkpoint's experts stay packed for None and "mxfp4": load_hf_params)."""
    root = model_dir_path(model_dir)
    mesh = mesh or sharding.make_mesh(1)
    if (root / "params").is_dir():
        return restore_orbax(root / "params", cfg, dtype, mesh,
                             expert_parallel=expert_parallel)
    return load_hf_params(root, cfg, dtype, mesh, log, expert_parallel=expert_parallel,
                          quantization_mode=quantization_mode)


def save_orbax(path: str | os.PathLike, params: Params) -> None:
    """Save params with orbax (OCDBT) at `path`, which must not exist."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(pathlib.Path(path).resolve(), params)
    checkpointer.wait_until_finished()


def restore_orbax(path: str | os.PathLike, cfg: ModelConfig, dtype: str = "float32",
                  mesh: Mesh | None = None, *, expert_parallel: bool = False) -> Params:
    """Restore params saved by `save_orbax`, cast to `dtype`, checked against cfg, each
    leaf straight onto its shardings on `mesh` (default: one device). With fewer KV
    heads than devices, q/k/v leaves are restored whole on every device, then copied
    into the served layout (fusion.replicate_kv_heads) on device."""
    import orbax.checkpoint as ocp

    check_dtype(dtype)
    mesh = mesh or sharding.make_mesh(1)
    shards = mesh.shape[sharding.MODEL_AXIS]
    sharding.validate(cfg, shards, mesh.size, expert_parallel)
    served = sharding.served_config(cfg, shards)
    specs = param_partition_specs(cfg, shards, expert_parallel)
    mode = checkpoint_quantization(pathlib.Path(path).parent)
    if served != cfg and mode is not None:
        raise ValueError(f"{path}: a {mode} orbax checkpoint cannot be served on {shards} "
                         f"devices with {cfg.num_kv_heads} KV heads (their copies are not "
                         "built for quantized weights yet): quantize at load instead")
    if served != cfg:  # q/k/v cannot split G groups over more devices: whole, for now
        for layer in specs["layers"]:
            layer.update({p.key: PartitionSpec() for p in LAYER
                          if p.layout == "qkv" and p.key in layer})
    shapes = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)),
                          param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    if mode is not None:  # the quantized tree: int8/fp8 values and f32 scales
        head = quantized_head(pathlib.Path(path).parent)
        shapes = jax.eval_shape(functools.partial(quantization.quantize_params, mode=mode,
                                                  head=head), shapes)
        specs = quantization.partition_specs(specs, mode, head=head)
    target = jax.tree.map(
        lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                             sharding=NamedSharding(mesh, spec)),
        shapes, specs)
    try:
        params = ocp.StandardCheckpointer().restore(pathlib.Path(path).resolve(), target)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{path}: orbax params do not match config.json ({e})") from None
    if served == cfg:
        return params
    served_shardings = sharding.named(mesh, param_partition_specs(served, shards,
                                                                  expert_parallel))
    copy = jax.jit(lambda p: p | {"layers": [fusion.replicate_kv_heads(layer, cfg, served)
                                             for layer in p["layers"]]},
                   out_shardings=served_shardings)
    return copy(params)


def convert_hf_to_orbax(hf_dir: str | os.PathLike, out_dir: str | os.PathLike,
                        dtype: str = "float32", quantization_mode: str | None = None,
                        calibration_data: str | os.PathLike | None = None) -> None:
    """Copy config and tokenizer files and write the weights as orbax `params/`,
    quantized (and QUANTIZATION_FILE saying how) when `quantization_mode` is given or
    the checkpoint is pre-quantized (compressed-tensors FP8: its layers kept as they are,
    the head quantized); int4 first folds in activation-aware scales chosen on
    `calibration_data` (awq.py)."""
    quantization.check_mode(quantization_mode)
    if calibration_data is not None and quantization_mode != "int4":
        raise ValueError(f"calibration_data={str(calibration_data)!r} needs "
                         f"quantization_mode='int4', not {quantization_mode!r}")
    src, dst = model_dir_path(hf_dir), pathlib.Path(out_dir)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    cfg = load_config(src)
    if prequantized_int4.group_size(src) is not None:
        raise ValueError(f"{src}: convert does not write an AWQ or GPTQ checkpoint's int4 "
                         "to orbax (its float32 scales and group size are not the orbax "
                         "layout's); serve the directory as it is")
    quantization_mode = served_quantization(src, quantization_mode)
    params = load_hf_params(src, cfg, dtype, quantization_mode=quantization_mode)
    if quantization_mode == "int4":
        params = awq.calibrate_checkpoint(params, cfg, src, calibration_data)
    if quantization_mode is not None:
        if quantization.mode_of(params) is None:
            params = quantization.quantize_params(params, quantization_mode)
        dst.mkdir(parents=True, exist_ok=True)
        stamp = {"mode": quantization_mode, "layout": quantization.LAYOUT_VERSION,
                 "quantized_head": quantization.has_quantized_head(params)}
        (dst / QUANTIZATION_FILE).write_text(json.dumps(stamp) + "\n")
    dst.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    save_orbax(dst / "params", params)
    log.info("wrote orbax checkpoint %s", dst)
