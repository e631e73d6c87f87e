"""Which quantization a checkpoint directory's weights are written in, and served in:
QUANTIZATION_FILE of a quantized orbax checkpoint, or an HF quantization_config
(compressed-tensors FP8, AWQ/GPTQ int4, MXFP4 experts), or for a preset its published
checkpoint's; anything else is float. See docs/quantization.md.
"""

from __future__ import annotations

import json
import os
import pathlib
import tomllib

from jaxinfer.checkpoint import compressed_tensors, mxfp4, prequantized_int4
from jaxinfer.checkpoint.hf import read_hf_config
from jaxinfer.config import PRESET_DIR
from jaxinfer.model import quantization

QUANTIZATION_FILE = "quantization.json"  # orbax: {"mode": "w8a8", "layout": 2}


def checkpoint_quantization(model_dir: str | os.PathLike) -> str | None:
    """The quantization an orbax checkpoint's weights were written in (its
    QUANTIZATION_FILE), or "fp8" for an HF compressed-tensors FP8 checkpoint
    (compressed_tensors.py), "int4" for an AWQ or GPTQ one (prequantized_int4/), "mxfp4"
    for gpt-oss's MXFP4 experts (mxfp4.py) or a preset whose published checkpoint holds
    them (`preset_quantization`); None for float weights."""
    path = pathlib.Path(model_dir) / QUANTIZATION_FILE
    if not path.is_file():
        return _hf_mode(pathlib.Path(model_dir)) or _mxfp4_mode(pathlib.Path(model_dir))
    try:
        written = json.loads(path.read_text())
        mode, layout = written.get("mode"), written.get("layout", 1)
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a JSON object with a 'mode' ({e})") from None
    quantization.check_mode(mode)
    if layout != quantization.LAYOUT_VERSION:
        raise ValueError(f"{path}: quantized layout {layout} was written by an older "
                         f"jaxinfer (this one reads {quantization.LAYOUT_VERSION}): convert "
                         "the float checkpoint again")
    return mode


def quantized_head(model_dir: str | os.PathLike) -> bool:
    """Whether a quantized model served from `model_dir` has a quantized LM head: yes,
    unless its checkpoint keeps the head float, as a compressed-tensors checkpoint does
    (it lists lm_head among the modules it leaves unquantized; a quantized head is
    refused) and its orbax conversion records in QUANTIZATION_FILE."""
    root = pathlib.Path(model_dir)
    if (root / QUANTIZATION_FILE).is_file():
        return bool(json.loads((root / QUANTIZATION_FILE).read_text()).get("quantized_head",
                                                                          True))
    return _hf_mode(root) is None


def _hf_mode(root: pathlib.Path) -> str | None:
    """The mode an HF checkpoint at `root` holds its layers' weights in: "fp8"
    (compressed-tensors), "int4" (AWQ, GPTQ), None for float ones. MXFP4 experts
    (gpt-oss) are not counted: they are decoded to floats on load (mxfp4.py)."""
    config = root / "config.json"
    if not config.is_file():
        return None
    hf = read_hf_config(root)
    if prequantized_int4.scheme_of(hf, config) is not None:
        return prequantized_int4.MODE
    if mxfp4.is_mxfp4(hf) or compressed_tensors.scheme_of(hf, config) is None:
        return None
    return compressed_tensors.MODE


def _mxfp4_mode(root: pathlib.Path) -> str | None:
    """"mxfp4" for an HF directory of MXFP4 experts, or a preset (a name, not a
    directory) whose published checkpoint is one; else None."""
    if not root.is_dir():
        return preset_quantization(str(root))
    config = root / "config.json"
    return mxfp4.MODE if config.is_file() and mxfp4.is_mxfp4(read_hf_config(root)) else None


def preset_quantization(name_or_path: str) -> str | None:
    """The mode of a preset's published checkpoint (its TOML's [checkpoint]
    quantization, as config.load_preset finds the file); None for float weights or no
    such preset."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".toml":
        path = PRESET_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        return None
    mode = tomllib.loads(path.read_text()).get("checkpoint", {}).get("quantization")
    quantization.check_mode(mode)
    return mode


def served_quantization(model_dir: str | os.PathLike, requested: str | None) -> str | None:
    """The mode a checkpoint directory (or a preset: its published checkpoint) is served
    in: that of its weights if written quantized (`checkpoint_quantization`; asking for
    another is an error), else `requested`. "awq" or "gptq" serves such a checkpoint's
    int4 as it is, and is refused for any other (prequantized_int4.requested_mode).
    MXFP4 experts serve packed as "mxfp4" unless another mode is asked for: they are
    then decoded on load and quantized in that mode."""
    config = pathlib.Path(model_dir) / "config.json"
    hf = read_hf_config(model_dir) if config.is_file() else None
    requested = prequantized_int4.requested_mode(hf, requested, model_dir)
    written = checkpoint_quantization(model_dir)
    if written == mxfp4.MODE and not (pathlib.Path(model_dir) / QUANTIZATION_FILE).is_file():
        return requested or written
    if written is not None and requested not in (None, written):
        raise ValueError(f"{model_dir} holds {written} weights; quantization="
                         f"{requested!r} would need the float checkpoint")
    return written or requested
