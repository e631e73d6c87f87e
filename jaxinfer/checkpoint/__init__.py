"""HF checkpoint directories and orbax checkpoints <-> the params pytree. hf.py reads and
writes HF directories, orbax_params.py orbax ones (and `load_params`, either kind);
the names the rest of jaxinfer uses are re-exported here (`checkpoint.load_params`).
See docs/cli.md#model-directories.
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
