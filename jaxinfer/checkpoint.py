"""HF checkpoint directories and orbax checkpoints <-> the params pytree.

An HF directory holds config.json, model.safetensors (or shards listed in
model.safetensors.index.json), tokenizer files and generation_config.json.
Loading needs no torch and never executes code from the checkpoint. An orbax
checkpoint is the same directory with `params/` (orbax) in place of the
safetensors files. Checkpoints keep HF's separate q/k/v and gate/up tensors; params
(and so orbax checkpoints) hold them fused (model/fusion.py). Imports numpy, jax,
orbax, config, model, safetensors_file.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import safetensors_file
from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion
from jaxinfer.model.transformer import Params, hf_layer_shapes, param_shapes

log = logging.getLogger(__name__)

LAYER_NAMES = {  # our name -> (HF name under model.layers.{i}., transposed?)
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False), "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False), "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True), "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
TOP_NAMES = {"embed": ("model.embed_tokens.weight", False),
             "final_norm": ("model.norm.weight", False), "lm_head": ("lm_head.weight", True)}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def hf_names(cfg: ModelConfig) -> dict[str, tuple[tuple, bool]]:
    """HF tensor name -> (path into the unfused params (`hf_shapes`), transposed?)."""
    out = {}
    shapes = hf_shapes(cfg)
    for key in ("embed", "final_norm", "lm_head"):
        if key in shapes:
            name, transposed = TOP_NAMES[key]
            out[name] = ((key,), transposed)
    for i, layer in enumerate(shapes["layers"]):
        for key in layer:
            name, transposed = LAYER_NAMES[key]
            out[f"model.layers.{i}.{name}"] = (("layers", i, key), transposed)
    return out


def hf_shapes(cfg: ModelConfig) -> Params:
    """`param_shapes` with each layer's projections apart, as checkpoints store them."""
    return param_shapes(cfg) | {"layers": [hf_layer_shapes(cfg)
                                           for _ in range(cfg.num_layers)]}


def fuse(params: Params, cfg: ModelConfig) -> Params:
    """Params read with HF's separate projections -> the fused params pytree."""
    return params | {"layers": [fusion.fuse_layer(layer, cfg) for layer in params["layers"]]}


def load_config(model_dir: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (HF or orbax)."""
    path = _model_dir(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (is this a model directory?)")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    return ModelConfig.from_hf(hf)


def load_params(model_dir: str | os.PathLike, cfg: ModelConfig,
                dtype: str = "float32") -> Params:
    """Params from an orbax checkpoint if `params/` exists, else from safetensors."""
    root = _model_dir(model_dir)
    if (root / "params").is_dir():
        return restore_orbax(root / "params", cfg, dtype)
    return load_hf_params(root, cfg, dtype)


def load_hf_params(model_dir: str | os.PathLike, cfg: ModelConfig,
                   dtype: str = "float32") -> Params:
    """Read safetensors tensors into our params pytree, checking names and shapes; q/k/v
    and gate/up are fused on the host (model/fusion.py) before going to the device."""
    _check_dtype(dtype)
    tensors = _read_tensors(_model_dir(model_dir))
    expected = hf_names(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{model_dir}: checkpoint lacks tensor(s) {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} for {cfg.architecture}")
    unexpected = sorted(n for n in set(tensors) - set(expected) if not _ignorable(n, cfg))
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected tensor(s) {unexpected[:5]}; the config "
                         f"does not describe this checkpoint")
    shapes = hf_shapes(cfg)
    params = jax.tree.map(lambda _: None, shapes, is_leaf=lambda x: isinstance(x, tuple))
    for name, (path, transposed) in expected.items():
        array = tensors[name]
        want = _get(shapes, path)
        got = tuple(array.shape[::-1] if transposed else array.shape)
        if got != want:
            hf_want = want[::-1] if transposed else want
            raise ValueError(f"{model_dir}: tensor {name} has shape {tuple(array.shape)}, "
                             f"expected {hf_want} from config.json")
        if array.dtype.name not in FLOAT_DTYPES:
            raise ValueError(f"{model_dir}: tensor {name} has unsupported dtype "
                             f"{array.dtype.name}; expected one of {FLOAT_DTYPES}")
        _set(params, path, np.asarray(array).T if transposed else np.asarray(array))
    return jax.tree.map(lambda x: jnp.asarray(x, dtype=dtype), fuse(params, cfg))


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    return name.endswith(IGNORED_SUFFIXES) or (
        cfg.tie_word_embeddings and name == "lm_head.weight")


def _read_tensors(root: pathlib.Path) -> dict[str, np.ndarray]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{root}: no model.safetensors, "
                                "model.safetensors.index.json or params/ (orbax)")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        if not (root / file).is_file():
            raise FileNotFoundError(f"{root}: shard {file} listed in the index is missing")
        tensors |= safetensors_file.load(root / file)
    return tensors


def save_hf(model_dir: str | os.PathLike, cfg: ModelConfig, params: Params,
            dtype: str = "float32", extra_config: dict | None = None) -> None:
    """Write config.json and model.safetensors that transformers loads."""
    _check_dtype(dtype)
    root = pathlib.Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    params = params | {"layers": [fusion.unfuse_layer(jax.device_get(layer), cfg)
                                  for layer in params["layers"]]}
    for name, (path, transposed) in hf_names(cfg).items():
        value = np.asarray(jax.device_get(_get(params, path)).astype(dtype))
        tensors[name] = value.T if transposed else value
    safetensors_file.save(tensors, root / "model.safetensors", {"format": "pt"})
    hf = cfg.to_hf() | {"dtype": dtype} | (extra_config or {})
    (root / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def save_orbax(path: str | os.PathLike, params: Params) -> None:
    """Save params with orbax (OCDBT) at `path`, which must not exist."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(pathlib.Path(path).resolve(), params)
    checkpointer.wait_until_finished()


def restore_orbax(path: str | os.PathLike, cfg: ModelConfig,
                  dtype: str = "float32") -> Params:
    """Restore params saved by `save_orbax`, cast to `dtype`, checked against cfg."""
    import orbax.checkpoint as ocp

    _check_dtype(dtype)
    target = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)),
                          param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    try:
        return ocp.StandardCheckpointer().restore(pathlib.Path(path).resolve(), target)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{path}: orbax params do not match config.json ({e})") from None


def convert_hf_to_orbax(hf_dir: str | os.PathLike, out_dir: str | os.PathLike,
                        dtype: str = "float32") -> None:
    """Copy config and tokenizer files and write the weights as orbax `params/`."""
    src, dst = _model_dir(hf_dir), pathlib.Path(out_dir)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    cfg = load_config(src)
    params = load_hf_params(src, cfg, dtype)
    dst.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    save_orbax(dst / "params", params)
    log.info("wrote orbax checkpoint %s", dst)


def _model_dir(model_dir: str | os.PathLike) -> pathlib.Path:
    root = pathlib.Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    return root


def _check_dtype(dtype: str) -> None:
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"{dtype=} must be 'float32' or 'bfloat16'")


def _get(tree: Params, path: tuple) -> object:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Params, path: tuple, value: jax.Array) -> None:
    _get(tree, path[:-1])[path[-1]] = value
