"""Params of a pipelined runner (model/pipeline.py): the layers stacked by stage where
they lie, and quantized at load stage by stage, so no device ever holds more than its
stage's layers. See docs/parallelism.md#pipeline-parallelism.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh

from jaxinfer.config import pipeline as rules
from jaxinfer.model import pipeline, sharding
from jaxinfer.model import quantization as quantization_lib


def stacked(layer_list: list, stages: int, shardings: list) -> list:
    """The layers by slot, stacked by stage: in place when the loader put each on its
    stage's devices (checkpoint/hf.py), else gathered by one program."""
    if pipeline.on_stages(layer_list):
        return pipeline.stack_in_place(layer_list, stages, shardings)
    return jax.jit(functools.partial(pipeline.stack_layers, stages=stages),
                   out_shardings=shardings)(layer_list)


def quantize_on_stages(params: dict, mesh: Mesh, mode: str, shardings: dict) -> dict:
    """`quantization.quantize_params` for params whose layers lie on their stages'
    devices: each stage's layers quantized on its devices, the head on every stage.
    `shardings`: the unstacked params' on `mesh` (their specs, applied per stage)."""
    quantization_lib.check_quantizes(params, mode)
    stages = sharding.stage_count(mesh)
    sizes = rules.stage_sizes(len(params["layers"]), stages)
    layers = []
    for stage, (start, size) in enumerate(zip(
            rules.stage_starts(len(params["layers"]), stages), sizes, strict=True)):
        here = sharding.stage_mesh(mesh, stage)
        targets = jax.tree.map(lambda s, m=here: jax.sharding.NamedSharding(m, s.spec),
                               shardings["layers"][start:start + size])
        layers += jax.jit(functools.partial(quantization_lib.quantize_layers, mode=mode),
                          out_shardings=targets)(params["layers"][start:start + size])
    top = {k: v for k, v in params.items() if k != "layers"}
    top_shardings = {k: v for k, v in shardings.items() if k != "layers"}
    top = jax.jit(functools.partial(quantization_lib.quantize_head, mode=mode),
                  out_shardings=top_shardings)(top)
    return top | {"layers": layers}
