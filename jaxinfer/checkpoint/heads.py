"""Speculative heads' checkpoints (EAGLE-1/2, EAGLE-3, Medusa) <-> their params: safetensors
only, every tensor checked against its published layout (head_layouts.py) as vLLM loads
it; `save_eagle3`, `save_eagle`, `save_medusa` write them back, `random_head` makes one.
See docs/speculative_decoding.md#head-checkpoints-and-the-heads-step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.checkpoint import safetensors_file
from jaxinfer.checkpoint.head_layouts import check, layer_shapes, published_layout
from jaxinfer.checkpoint.hf import (
    _read_tensors,
    check_dtype,
    model_dir_path,
    read_hf_config,
)
from jaxinfer.config import ModelConfig
from jaxinfer.config.heads import HeadConfig, head_config, head_to_hf
from jaxinfer.model import fusion

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
LAYER_PARTS = {  # published suffix -> (our key, which part of it), layer 0
    "self_attn.q_proj.weight": ("wqkv", 0), "self_attn.k_proj.weight": ("wqkv", 1),
    "self_attn.v_proj.weight": ("wqkv", 2), "self_attn.o_proj.weight": ("wo", 0),
    "mlp.gate_proj.weight": ("w_gate_up", 0), "mlp.up_proj.weight": ("w_gate_up", 1),
    "mlp.down_proj.weight": ("w_down", 0), "post_attention_layernorm.weight": ("mlp_norm", 0),
    "input_layernorm.weight": ("attn_norm", 0), "hidden_norm.weight": ("hidden_norm", 0),
}


def load_head(model_dir: str | os.PathLike, target: ModelConfig, dtype: str = "float32",
              method: str | None = None) -> tuple[HeadConfig, dict]:
    """(HeadConfig, params) of a head directory for `target`, float tensors in `dtype`
    ("float32" or "bfloat16"); errors name the field or tensor that does not fit."""
    check_dtype(dtype)
    root = model_dir_path(model_dir)
    head = head_config(read_hf_config(root), target, method)
    tensors = _renamed(head, read_tensors(root))
    if head.method == "eagle":
        head = dataclasses.replace(head, fc_bias="fc.bias" in tensors)
    expected = published_layout(head, own_embed="embed_tokens.weight" in tensors)
    check(root, tensors, expected)
    build = {"eagle": _eagle_params, "eagle3": _eagle3_params, "medusa": _medusa_params}
    params = build[head.method](tensors, head)
    float_dtype = jnp.dtype(dtype)
    return head, jax.tree.map(lambda x: jnp.asarray(
        x, float_dtype if np.issubdtype(x.dtype, np.floating) else jnp.int32), params)


def read_tensors(root: pathlib.Path) -> dict[str, np.ndarray]:
    """The directory's safetensors tensors (memory-mapped); a pickle-only directory is
    refused with the file's name."""
    safetensors = (root / "model.safetensors").is_file() or (
        root / "model.safetensors.index.json").is_file()
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not safetensors and pickles:
        raise ValueError(f"{root}: only pickle weights {pickles}; jaxinfer reads "
                         "safetensors only and never unpickles (convert the file to "
                         "model.safetensors first)")
    return _read_tensors(root)


def _renamed(head: HeadConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Names as published under the aliases vLLM accepts: eagle3's layers.0. for
    midlayer., medusa's medusa_heads. prefix."""
    def name(n: str) -> str:
        if head.method == "eagle3" and n.startswith("layers.0."):
            return "midlayer." + n.removeprefix("layers.0.")
        return n.removeprefix("medusa_heads.") if head.method == "medusa" else n
    return {name(n): t for n, t in tensors.items()}


def _layer_params(tensors: dict[str, np.ndarray], prefix: str, cfg: ModelConfig) -> dict:
    """Our fused layer ([in, out]) from the published layer-0 tensors under `prefix`."""
    parts: dict[str, list] = {}
    for suffix, (key, index) in LAYER_PARTS.items():
        if prefix + suffix in tensors:
            tensor = np.asarray(tensors[prefix + suffix], np.float32)
            parts.setdefault(key, [None] * 3)[index] = tensor.T if tensor.ndim == 2 else tensor
    out = {key: value[0] for key, value in parts.items()
           if key not in ("wqkv", "w_gate_up")}
    out["wqkv"] = fusion.fuse_qkv(*parts["wqkv"], cfg)
    out["w_gate_up"] = fusion.fuse_gate_up(*parts["w_gate_up"][:2])
    return out


def _eagle_params(tensors: dict[str, np.ndarray], head: HeadConfig) -> dict:
    layer = _layer_params(tensors, "layers.0.", head.layer)
    layer.pop("attn_norm", None)  # layer 0 input norm: identity (docs/speculative_decoding.md)
    out = {"fc": np.asarray(tensors["fc.weight"], np.float32).T, "layer": layer}
    if head.fc_bias:
        out["fc_bias"] = np.asarray(tensors["fc.bias"], np.float32)
    return out


def _eagle3_params(tensors: dict[str, np.ndarray], head: HeadConfig) -> dict:
    def f32(name: str) -> np.ndarray:
        return np.asarray(tensors[name], np.float32)

    d2t = tensors.get("d2t", np.zeros(head.draft_vocab_size, np.int64))
    out = {"fc": f32("fc.weight").T,
           "layer": _layer_params(tensors, "midlayer.", head.layer),
           "final_norm": f32("norm.weight"), "lm_head": f32("lm_head.weight").T,
           "d2t": np.asarray(d2t, np.int32)}
    target_ids = np.arange(head.draft_vocab_size) + out["d2t"]
    if target_ids.min() < 0 or target_ids.max() >= head.vocab_size:
        raise ValueError(f"tensor d2t maps draft ids outside the target's vocabulary "
                         f"[0, {head.vocab_size})")
    if "embed_tokens.weight" in tensors:
        out["embed"] = f32("embed_tokens.weight")
    return out


def _medusa_params(tensors: dict[str, np.ndarray], head: HeadConfig) -> dict:
    d = head.hidden_size
    shape = (head.num_heads, head.num_layers)
    w = np.zeros((*shape, d, d), np.float32)
    b = np.zeros((*shape, d), np.float32)
    for h in range(head.num_heads):
        for j in range(head.num_layers):
            w[h, j] = np.asarray(tensors[f"blocks.{h}.layers.{j}.weight"], np.float32).T
            if head.fc_bias:
                b[h, j] = tensors[f"blocks.{h}.layers.{j}.bias"]
    count = 1 if head.shared_lm_head else head.num_heads
    token_map = np.asarray(tensors["token_map"], np.int64) if "token_map" in tensors else None
    if token_map is not None and (token_map.min() < 0 or token_map.max() >= head.vocab_size):
        raise ValueError(f"tensor token_map holds ids outside [0, {head.vocab_size})")
    heads = []
    for h in range(count):
        lm = np.asarray(tensors[f"lm_heads.{h}.weight"], np.float32)
        if token_map is not None and lm.shape[0] == head.vocab_size:
            lm = lm[token_map]  # a whole LM head cut to the map's rows, as vLLM does
        heads.append(lm.T)
    out = {"blocks_w": w, "lm_heads": np.stack(heads)}
    if head.fc_bias:
        out["blocks_b"] = b
    if token_map is not None:
        out["token_map"] = token_map.astype(np.int32)
    return out


def save_head(model_dir: str | os.PathLike, head: HeadConfig, params: dict,
              target: ModelConfig, dtype: str = "float32") -> None:
    """Write config.json and model.safetensors of `head` in its published layout."""
    check_dtype(dtype)
    root = pathlib.Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)
    tensors = (_medusa_tensors(head, params) if head.method == "medusa"
               else _eagle_tensors(head, params))
    float_dtype = np.dtype(jnp.dtype(dtype))
    tensors = {n: t.astype(float_dtype) if np.issubdtype(t.dtype, np.floating) else t
               for n, t in tensors.items()}
    safetensors_file.save(tensors, root / "model.safetensors", {"format": "pt"})
    hf = head_to_hf(head, target) | {"torch_dtype": dtype}
    (root / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def save_eagle3(model_dir: str | os.PathLike, head: HeadConfig, params: dict,
                target: ModelConfig, dtype: str = "float32") -> None:
    """SafeAILab's EAGLE-3 layout (docs/speculative_decoding.md)."""
    _expect(head, "eagle3")
    save_head(model_dir, head, params, target, dtype)


def save_eagle(model_dir: str | os.PathLike, head: HeadConfig, params: dict,
               target: ModelConfig, dtype: str = "float32") -> None:
    """SafeAILab's EAGLE-1/2 layout (docs/speculative_decoding.md)."""
    _expect(head, "eagle")
    save_head(model_dir, head, params, target, dtype)


def save_medusa(model_dir: str | os.PathLike, head: HeadConfig, params: dict,
                target: ModelConfig, dtype: str = "float32") -> None:
    """vLLM's Medusa layout (docs/speculative_decoding.md)."""
    _expect(head, "medusa")
    save_head(model_dir, head, params, target, dtype)


def _expect(head: HeadConfig, method: str) -> None:
    if head.method != method:
        raise ValueError(f"a {head.method} head cannot be saved as {method}")


def _eagle_tensors(head: HeadConfig, params: dict) -> dict[str, np.ndarray]:
    prefix = "midlayer." if head.method == "eagle3" else "layers.0."
    layer = params["layer"]
    q, k, v = fusion.split_qkv(layer["wqkv"], head.layer)
    gate, up = fusion.split_gate_up(layer["w_gate_up"])
    ours = {"wo": layer["wo"], "w_down": layer["w_down"], "mlp_norm": layer["mlp_norm"]}
    ours |= {key: layer[key] for key in ("attn_norm", "hidden_norm") if key in layer}
    lead = q.shape[:-2]
    parts = {"wqkv": [x.reshape(*lead, -1) for x in (q, k, v)], "w_gate_up": [gate, up]}
    out = {}
    for suffix, (key, index) in LAYER_PARTS.items():
        value = parts[key][index] if key in parts else ours.get(key)
        if value is not None:
            out[prefix + suffix] = value.T if value.ndim == 2 else value
    out["fc.weight"] = params["fc"].T
    if "fc_bias" in params:
        out["fc.bias"] = params["fc_bias"]
    if "embed" in params:
        out["embed_tokens.weight"] = params["embed"]
    if head.method == "eagle3":
        target_ids = np.arange(head.draft_vocab_size) + params["d2t"]
        t2d = np.zeros(head.vocab_size, bool)
        t2d[target_ids] = True
        out |= {"norm.weight": params["final_norm"], "lm_head.weight": params["lm_head"].T,
                "d2t": params["d2t"].astype(np.int64), "t2d": t2d}
    return out


def _medusa_tensors(head: HeadConfig, params: dict) -> dict[str, np.ndarray]:
    out = {}
    for h in range(head.num_heads):
        for j in range(head.num_layers):
            out[f"blocks.{h}.layers.{j}.weight"] = params["blocks_w"][h, j].T
            if head.fc_bias:
                out[f"blocks.{h}.layers.{j}.bias"] = params["blocks_b"][h, j]
    for h in range(params["lm_heads"].shape[0]):
        out[f"lm_heads.{h}.weight"] = params["lm_heads"][h].T
    if "token_map" in params:
        out["token_map"] = params["token_map"].astype(np.int64)
    return out


def random_head(method: str, target: ModelConfig, key: jax.Array, *,
                own_embed: bool = False, **config: Any) -> tuple[HeadConfig, dict]:
    """A random head of `method` for `target` (float32): `config` overrides config.json
    fields of the published layout (hidden_size, intermediate_size, draft_vocab_size,
    num_heads, eagle_aux_hidden_state_layer_ids, ...); `own_embed`: eagle3 with its own
    embedding table. Weights are normal / sqrt(fan-in), norms near one, biases small."""
    hf = _default_config(method, target) | config
    head = head_config(hf, target, method)
    rng = np.random.default_rng(np.asarray(jax.random.randint(key, (4,), 0, 2**31 - 1)))
    if method == "medusa":
        params = _random_medusa(head, rng)
    else:
        params = _random_eagle(head, rng, own_embed)
    return head, jax.tree.map(jnp.asarray, params)


def _default_config(method: str, target: ModelConfig) -> dict[str, Any]:
    d = target.hidden_size
    if method == "medusa":
        return {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": d,
                "vocab_size": target.vocab_size, "num_heads": 3, "num_hidden_layers": 1}
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
           "intermediate_size": 2 * d, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 1, "vocab_size": target.vocab_size, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": target.max_position_embeddings}
    if method == "eagle3":
        out |= {"architectures": ["LlamaForCausalLMEagle3"],
                "draft_vocab_size": max(1, target.vocab_size // 2)}
    return out


def _random_eagle(head: HeadConfig, rng: np.random.Generator, own_embed: bool) -> dict:
    layer_cfg, d = head.layer, head.hidden_size
    d_in = 2 * d if head.method == "eagle3" else d
    shapes = layer_shapes(layer_cfg, d_in)
    weights = {suffix: _normal(rng, shape) for suffix, shape in shapes.items()}
    weights = {k: 1 + 0.1 * rng.standard_normal(v.shape[0]).astype(np.float32)
               if v.ndim == 1 else v for k, v in weights.items()}
    if head.method == "eagle3":
        weights["hidden_norm.weight"] = 1 + 0.1 * rng.standard_normal(d).astype(np.float32)
    prefix = "midlayer." if head.method == "eagle3" else "layers.0."
    tensors = {prefix + k: v for k, v in weights.items()}
    fc_in = head.feature_size if head.method == "eagle3" else 2 * d
    tensors["fc.weight"] = _normal(rng, (d, fc_in))
    if head.fc_bias:
        tensors["fc.bias"] = 0.1 * rng.standard_normal(d).astype(np.float32)
    if head.method == "eagle":
        return _eagle_params(tensors, head)
    kept = np.sort(rng.choice(head.vocab_size, head.draft_vocab_size, replace=False))
    tensors |= {"norm.weight": 1 + 0.1 * rng.standard_normal(d).astype(np.float32),
                "lm_head.weight": _normal(rng, (head.draft_vocab_size, d)),
                "d2t": kept - np.arange(head.draft_vocab_size)}
    if own_embed or d != head.target_hidden_size:
        tensors["embed_tokens.weight"] = rng.standard_normal(
            (head.vocab_size, d)).astype(np.float32)
    return _eagle3_params(tensors, head)


def _random_medusa(head: HeadConfig, rng: np.random.Generator) -> dict:
    d, kept = head.hidden_size, head.draft_vocab_size
    count = 1 if head.shared_lm_head else head.num_heads
    out = {"blocks_w": _normal(rng, (head.num_heads, head.num_layers, d, d), d),
           "lm_heads": _normal(rng, (count, d, kept), d)}
    if head.fc_bias:
        out["blocks_b"] = 0.1 * rng.standard_normal(
            (head.num_heads, head.num_layers, d)).astype(np.float32)
    if kept < head.vocab_size:
        out["token_map"] = np.sort(rng.choice(head.vocab_size, kept,
                                              replace=False)).astype(np.int32)
    return out


def _normal(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int = 0
            ) -> np.ndarray:
    """normal / sqrt(fan_in), by default the last axis (a torch [out, in] weight's)."""
    return (rng.standard_normal(shape) / np.sqrt(fan_in or shape[-1])).astype(np.float32)
