"""Pre-quantized AWQ and GPTQ checkpoints read into jaxinfer's int4 layout as they are,
never quantized again: scheme.py reads config.json's `quantization_config`, packing.py
the formats' nibble orders, tensors.py checks the tensors and builds each device's
slice. See docs/quantization.md#pre-quantized-awq-and-gptq-checkpoints.
"""

from __future__ import annotations

import json
import os
import pathlib

from jaxinfer.checkpoint.prequantized_int4.scheme import (
    METHODS,
    MODE,
    SUPPORTED,
    Scheme,
    method_of,
    requested_mode,
    scheme_of,
)
from jaxinfer.checkpoint.prequantized_int4.tensors import PARTS, int4_views, quantized_leaf
from jaxinfer.config import ModelConfig

__all__ = ["METHODS", "MODE", "PARTS", "SUPPORTED", "Scheme", "check_model", "group_size",
           "int4_views", "method_of", "quantized_leaf", "requested_mode", "scheme_of"]


def check_model(hf: dict, cfg: ModelConfig, source: object) -> None:
    """ValueError naming what an AWQ or GPTQ checkpoint of `cfg`'s model quantizes that
    jaxinfer's int4 does not: experts."""
    scheme = scheme_of(hf, source)
    if scheme is not None and cfg.moe is not None:
        raise ValueError(f"{source}: {scheme.method} experts ({cfg.moe.num_experts} a "
                         f"layer in {cfg.architecture}) are not supported: jaxinfer's int4 "
                         f"applies to dense layers' projections only; supported: "
                         f"{SUPPORTED}")


def group_size(model_dir: str | os.PathLike, hf: dict | None = None) -> int | None:
    """The int4 group size of an AWQ or GPTQ checkpoint directory (its config.json, or
    `hf` when given), which the planner counts its weights in; None for any other."""
    if hf is None:
        path = pathlib.Path(model_dir) / "config.json"
        if not path.is_file():
            return None
        hf = json.loads(path.read_text())
    scheme = scheme_of(hf, pathlib.Path(model_dir) / "config.json")
    return scheme and scheme.group_size
