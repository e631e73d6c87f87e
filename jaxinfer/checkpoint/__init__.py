"""HF checkpoint directories and orbax checkpoints <-> the params pytree.

`hf.py` reads an HF directory (config.json, safetensors checked against it, each
device's slice read on its own) and writes one (`save_hf`); `orbax_params.py` saves,
restores and converts to orbax `params/`, and holds `load_params`, which reads either
kind; `quantized.py` says which quantization a directory's weights are written and
served in; `names.py` maps HF tensor names to params leaves. The names the rest of
jaxinfer uses are re-exported here, so callers write `checkpoint.load_params(...)`.
"""

from jaxinfer.checkpoint.hf import load_config, load_hf_params, read_hf_config, save_hf
from jaxinfer.checkpoint.orbax_params import (
    convert_hf_to_orbax,
    load_params,
    restore_orbax,
    save_orbax,
)
from jaxinfer.checkpoint.quantized import (
    QUANTIZATION_FILE,
    checkpoint_quantization,
    quantized_head,
    served_quantization,
)

__all__ = [
    "QUANTIZATION_FILE", "checkpoint_quantization", "convert_hf_to_orbax", "load_config",
    "load_hf_params", "load_params", "quantized_head", "read_hf_config", "restore_orbax",
    "save_hf", "save_orbax", "served_quantization",
]
