"""Reading a PEFT LoRA adapter (`adapter_config.json`, `adapter_model.safetensors`) into
its host copy: per layer and target projection, A [in, r] and B [r, out] in float32
with the scaling (lora_alpha / r, or / sqrt(r) with use_rslora) folded into B
(runner/lora.py lays it out as a device slot holds it). What jaxinfer cannot serve
(DoRA, embedding or LM-head adapters, biases, expert adapters) is refused by name.
See docs/lora.md#adapters.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np

from jaxinfer.checkpoint import safetensors_file
from jaxinfer.config import ModelConfig
from jaxinfer.lora.request import LoRARequest
from jaxinfer.model import lora as lora_lib

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\."
                  r"(?:self_attn|mlp)\.(?P<proj>\w+))\.lora_(?P<part>[AB])\.weight$")

HostAdapter = dict  # layer index -> {target: (a f32[in, r], b f32[r, out])}


def read(lora: LoRARequest, cfg: ModelConfig, max_rank: int) -> HostAdapter:
    """The adapter at `lora.lora_path` for a model of `cfg`, its ranks at most
    `max_rank`; ValueError naming the file and what is wrong."""
    root = pathlib.Path(lora.lora_path)
    config = _config(root)
    weights = _weights(root)
    pairs = _pairs(weights, root)
    out: HostAdapter = {}
    for (module, layer, target), (a, b) in sorted(pairs.items()):
        rank = a.shape[0]
        if rank > max_rank:
            raise ValueError(f"{root}: {module} has rank {rank}, over max_lora_rank="
                             f"{max_rank}")
        _check_target(cfg, root, module, layer, target, a, b)
        scale = _scaling(config, module, rank)
        out.setdefault(layer, {})[target] = (a.T.astype(np.float32),
                                             (b.T * scale).astype(np.float32))
    if not out:
        raise ValueError(f"{root / WEIGHTS_FILE}: no lora_A/lora_B weights of q/k/v/o or "
                         "gate/up/down projections")
    return out


def _config(root: pathlib.Path) -> dict:
    path = root / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no such file (a PEFT LoRA adapter directory has "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: must be a JSON object")
    _refuse_unsupported(config, path)
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise ValueError(f"{path}: {key}={config.get(key)!r} must be a positive number")
    return config


def _refuse_unsupported(config: dict, path: pathlib.Path) -> None:
    """ValueError for the PEFT options that change what the adapter computes beyond
    x @ A @ B * scaling on q/k/v/o/gate/up/down."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{path}: peft_type={peft_type!r}: only LORA adapters are served")
    refused = {"use_dora": "DoRA adapters are not served",
               "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights are not served",
               "lora_bias": "adapters with a bias on lora_B are not served"}
    for key, reason in refused.items():
        if config.get(key):
            raise ValueError(f"{path}: {key}=true: {reason}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={config['bias']!r}: adapters that train biases "
                         "are not served (bias must be 'none')")
    if config.get("modules_to_save"):
        raise ValueError(f"{path}: modules_to_save={config['modules_to_save']!r}: "
                         "adapters that replace whole modules (an LM head, embeddings) "
                         "are not served")


def _weights(root: pathlib.Path) -> dict[str, np.ndarray]:
    path = root / WEIGHTS_FILE
    if not path.is_file():
        other = " (adapter_model.bin: save it with safe_serialization=True)" if (
            root / "adapter_model.bin").is_file() else ""
        raise ValueError(f"{path}: no such file{other}")
    return safetensors_file.load(path)


def _pairs(weights: dict[str, np.ndarray], root: pathlib.Path
           ) -> dict[tuple[str, int, str], tuple[np.ndarray, np.ndarray]]:
    """(module, layer, target) -> (lora_A [r, in], lora_B [out, r]) as saved."""
    parts: dict[tuple[str, int, str], dict[str, np.ndarray]] = {}
    for name, value in weights.items():
        match = _KEY.match(name)
        if match is None or match["proj"] not in PEFT_TARGETS:
            raise ValueError(f"{root / WEIGHTS_FILE}: {name}: {_refusal(name)}")
        key = (match["module"], int(match["layer"]), PEFT_TARGETS[match["proj"]])
        parts.setdefault(key, {})[match["part"]] = np.asarray(value, np.float32)
    pairs = {}
    for key, found in parts.items():
        if set(found) != {"A", "B"}:
            raise ValueError(f"{root / WEIGHTS_FILE}: {key[0]} has lora_{''.join(found)} "
                             "without its other half")
        a, b = found["A"], found["B"]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"{root / WEIGHTS_FILE}: {key[0]}: lora_A {a.shape} and "
                             f"lora_B {b.shape} do not make a rank-r pair")
        pairs[key] = (a, b)
    return pairs


def _refusal(name: str) -> str:
    """Why a tensor of an adapter file is not served."""
    if "embedding" in name or "embed_tokens" in name:
        return "embedding adapters are not served"
    if "lm_head" in name:
        return "LM-head adapters are not served"
    if "experts" in name or "shared_expert" in name:
        return "adapters on a mixture of experts' experts are not served (attention only)"
    if "magnitude" in name:
        return "DoRA adapters are not served"
    return ("not a LoRA weight of q/k/v/o_proj or gate/up/down_proj "
            "(lora_A.weight / lora_B.weight)")


def _check_target(cfg: ModelConfig, root: pathlib.Path, module: str, layer: int,
                  target: str, a: np.ndarray, b: np.ndarray) -> None:
    if layer >= cfg.num_layers:
        raise ValueError(f"{root}: {module}: the model has {cfg.num_layers} layers")
    if target not in lora_lib.layer_targets(cfg, layer):
        raise ValueError(f"{root}: {module}: layer {layer} is a mixture of experts: "
                         "adapters on its MLP are not served (attention only)")
    fan_in, fan_out = lora_lib.target_dims(cfg, target)
    if a.shape[1] != fan_in or b.shape[0] != fan_out:
        raise ValueError(f"{root}: {module}: lora_A {a.shape} and lora_B {b.shape} do not "
                         f"fit a [{fan_out}, {fan_in}] projection of this model")


def _scaling(config: dict, module: str, rank: int) -> float:
    """lora_alpha / r (rsLoRA: / sqrt(r)), with rank_pattern and alpha_pattern applied
    to `module` as PEFT matches them (a key matching the module's name or its tail)."""
    r = _pattern(config.get("rank_pattern"), module, config["r"])
    alpha = _pattern(config.get("alpha_pattern"), module, config["lora_alpha"])
    if r != rank:
        raise ValueError(f"{module}: adapter_config.json says r={r}, its weights rank "
                         f"{rank}")
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern(patterns: dict | None, module: str, default: float) -> float:
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
