"""HF checkpoint directories and orbax checkpoints <-> the params pytree.

An HF directory holds config.json, model.safetensors (or shards listed in
model.safetensors.index.json), tokenizer files and generation_config.json.
Loading needs no torch and never executes code from the checkpoint. An orbax
checkpoint is the same directory with `params/` (orbax) in place of the
safetensors files. Checkpoints keep HF's separate q/k/v and gate/up tensors; params
(and so orbax checkpoints) hold them fused (model/fusion.py). A compressed-tensors FP8
checkpoint's layer projections load as they are stored, as fp8 QuantizedWeights
(compressed_tensors.py; its float LM head is quantized by the runner, as for every
quantized model); any other quantization_config is refused by load_config.
Imports numpy, jax, orbax, config, model, quantization, safetensors_file,
shard_source, sharding, compressed_tensors and awq (int4 convert).
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
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer import (
    awq,
    compressed_tensors,
    quantization,
    safetensors_file,
    shard_source,
    sharding,
)
from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion
from jaxinfer.model.transformer import (
    Params,
    hf_layer_shapes,
    param_partition_specs,
    param_shapes,
)

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
FUSED = {"wqkv": ("qkv", ("wq", "wk", "wv")), "bqkv": ("qkv", ("bq", "bk", "bv")),
         "w_gate_up": ("gate_up", ("w_gate", "w_up"))}  # fused leaf -> its HF parts
TOP_NAMES = {"embed": ("model.embed_tokens.weight", False),
             "final_norm": ("model.norm.weight", False), "lm_head": ("lm_head.weight", True)}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
QUANTIZATION_FILE = "quantization.json"  # orbax: {"mode": "w8a8", "layout": 2}
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
    """The ModelConfig of a checkpoint directory (HF or orbax). A `quantization_config`
    other than compressed-tensors FP8 is refused here, before any weight is read."""
    hf = read_hf_config(model_dir)
    compressed_tensors.scheme_of(hf, _model_dir(model_dir) / "config.json")
    return ModelConfig.from_hf(hf)


def read_hf_config(model_dir: str | os.PathLike) -> dict:
    """The config.json of a checkpoint directory, as a dict."""
    path = _model_dir(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (is this a model directory?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def load_params(model_dir: str | os.PathLike, cfg: ModelConfig, dtype: str = "float32",
                mesh: Mesh | None = None, log: shard_source.ReadLog | None = None) -> Params:
    """Params from an orbax checkpoint if `params/` exists, else from safetensors;
    placed on `mesh` with the tensor-parallel shardings (each device receives only
    its slice) in the served layout (`sharding.served_config`), or on the default device.
    `log` records the bytes each safetensors read asked for."""
    root = _model_dir(model_dir)
    mesh = mesh or sharding.make_mesh(1)
    if (root / "params").is_dir():
        return restore_orbax(root / "params", cfg, dtype, mesh)
    return load_hf_params(root, cfg, dtype, mesh, log)


def load_hf_params(model_dir: str | os.PathLike, cfg: ModelConfig, dtype: str = "float32",
                   mesh: Mesh | None = None, log: shard_source.ReadLog | None = None
                   ) -> Params:
    """Read safetensors tensors into our params pytree, checking names and shapes. Each
    leaf is built per device from the memory-mapped tensors (`shard_source`), q/k/v and
    gate/up fused on the fly (model/fusion.py), KV heads copied when the mesh has more
    devices than KV heads. A compressed-tensors FP8 checkpoint's linear weights become
    fp8 QuantizedWeights made of its float8 values and scales (compressed_tensors.py)."""
    _check_dtype(dtype)
    root = _model_dir(model_dir)
    scheme = compressed_tensors.scheme_of(read_hf_config(root), root / "config.json")
    tensors = _checked_tensors(root, cfg, scheme)
    mesh = mesh or sharding.make_mesh(1)
    shards = mesh.shape[sharding.MODEL_AXIS]
    sharding.validate(cfg, shards, mesh.size)
    served = sharding.served_config(cfg, shards)
    reader = shard_source.Reader(tensors, served, sharding.kv_replicas(cfg, shards), log)
    layouts = leaf_layouts(served)
    specs = quantization.partition_specs(param_partition_specs(served, shards),
                                         scheme and compressed_tensors.MODE, head=False)
    target = np.dtype(jnp.dtype(dtype))

    def array(name: str, layout: shard_source.Layout, shape: tuple[int, ...],
              spec: PartitionSpec, dtype: np.dtype) -> jax.Array:
        return jax.make_array_from_callback(
            shape, NamedSharding(mesh, spec),
            lambda index: reader.slice_of(name, layout, shape, index, dtype))

    def stored_value(name: str, layout: shard_source.Layout, shape: tuple[int, ...],
                     spec: PartitionSpec) -> jax.Array:
        """A fp8 weight [I, O] as QuantizedWeight stores it, [O, I] (HF's own layout)."""
        return jax.make_array_from_callback(
            shape[::-1], NamedSharding(mesh, spec),
            lambda index: np.ascontiguousarray(reader.slice_of(
                name, layout, shape, index[::-1], compressed_tensors.FP8).T))

    def leaf(path: tuple, shape: tuple[int, ...], spec: object) -> object:
        name = leaf_name(path)
        if not quantization.is_quantized(spec):
            return array(name, layouts[name], shape, spec, target)
        scale_layout = compressed_tensors.scale_layout(layouts[name])
        return quantization.QuantizedWeight(
            stored_value(name, layouts[name], shape, spec.value),
            array(f"{name}.scale", scale_layout, shape[1:], spec.scale, np.dtype(np.float32)),
            spec.mode)

    shapes = param_shapes(served)
    return jax.tree_util.tree_map_with_path(
        leaf, shapes, specs, is_leaf=lambda x: isinstance(x, tuple))


def leaf_name(path: tuple) -> str:
    """"layers.3.wqkv" for a params path, given as keys or as JAX's key entries."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def leaf_layouts(cfg: ModelConfig) -> dict[str, shard_source.Layout]:
    """leaf_name of each params leaf -> the HF tensors it is made of, and how."""
    out = {}
    for name, (path, transposed) in hf_names(cfg).items():
        if path[0] != "layers":
            out[leaf_name(path)] = shard_source.Layout(
                "transposed" if transposed else "plain", (name,))
    for i, layer in enumerate(param_shapes(cfg)["layers"]):
        prefix = f"model.layers.{i}."
        for key in layer:
            if key in FUSED:
                kind, parts = FUSED[key]
                names = tuple(prefix + LAYER_NAMES[p][0] for p in parts)
            else:
                hf, transposed = LAYER_NAMES[key]
                kind, names = "transposed" if transposed else "plain", (prefix + hf,)
            out[leaf_name(("layers", i, key))] = shard_source.Layout(kind, names)
    return out


def _checked_tensors(root: pathlib.Path, cfg: ModelConfig,
                     scheme: compressed_tensors.Scheme | None = None) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (memory-mapped), refused unless their names, shapes and
    dtypes are those `cfg` describes; with a compressed-tensors `scheme`, the fp8
    weights' scales added as float32 [out] `<module>.weight_scale` tensors."""
    tensors = _read_tensors(root)
    fp8_names, scales = set(), {}
    if scheme is not None:
        fp8_names = {n for n, (path, _) in hf_names(cfg).items()  # layer projections
                     if path[-1] in compressed_tensors.FP8_PARTS}
        scales = compressed_tensors.take_scales(tensors, fp8_names, scheme, root)
        for note in scheme.notes():
            log.warning("%s: loading fp8 weights as they are, but %s", root, note)
    expected = hf_names(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{root}: checkpoint lacks tensor(s) {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} for {cfg.architecture}")
    unexpected = sorted(n for n in set(tensors) - set(expected) if not _ignorable(n, cfg))
    if unexpected:
        raise ValueError(f"{root}: unexpected tensor(s) {unexpected[:5]}; the config "
                         f"does not describe this checkpoint")
    shapes = hf_shapes(cfg)
    for name, (path, transposed) in expected.items():
        array = tensors[name]
        want = _get(shapes, path)
        got = tuple(array.shape[::-1] if transposed else array.shape)
        if got != want:
            hf_want = want[::-1] if transposed else want
            raise ValueError(f"{root}: tensor {name} has shape {tuple(array.shape)}, "
                             f"expected {hf_want} from config.json")
        if array.dtype.name not in FLOAT_DTYPES and name not in fp8_names:
            raise ValueError(f"{root}: tensor {name} has unsupported dtype "
                             f"{array.dtype.name}; expected one of {FLOAT_DTYPES}")
    return tensors | scales


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


def restore_orbax(path: str | os.PathLike, cfg: ModelConfig, dtype: str = "float32",
                  mesh: Mesh | None = None) -> Params:
    """Restore params saved by `save_orbax`, cast to `dtype`, checked against cfg, each
    leaf straight onto its shardings on `mesh` (default: one device). With fewer KV
    heads than devices, q/k/v leaves are restored whole on every device, then copied
    into the served layout (fusion.replicate_kv_heads) on device."""
    import orbax.checkpoint as ocp

    _check_dtype(dtype)
    mesh = mesh or sharding.make_mesh(1)
    shards = mesh.shape[sharding.MODEL_AXIS]
    sharding.validate(cfg, shards, mesh.size)
    served = sharding.served_config(cfg, shards)
    specs = param_partition_specs(cfg, shards)
    mode = checkpoint_quantization(pathlib.Path(path).parent)
    if served != cfg and mode is not None:
        raise ValueError(f"{path}: a {mode} orbax checkpoint cannot be served on {shards} "
                         f"devices with {cfg.num_kv_heads} KV heads (their copies are not "
                         "built for quantized weights yet): quantize at load instead")
    if served != cfg:  # q/k/v cannot split G groups over more devices: whole, for now
        for layer in specs["layers"]:
            layer.update({k: PartitionSpec() for k in FUSED if k in layer and k != "w_gate_up"})
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
    served_shardings = sharding.named(mesh, param_partition_specs(served, shards))
    copy = jax.jit(lambda p: p | {"layers": [fusion.replicate_kv_heads(layer, cfg, served)
                                             for layer in p["layers"]]},
                   out_shardings=served_shardings)
    return copy(params)


def checkpoint_quantization(model_dir: str | os.PathLike) -> str | None:
    """The quantization an orbax checkpoint's weights were written in (its
    QUANTIZATION_FILE), or "fp8" for an HF compressed-tensors FP8 checkpoint
    (compressed_tensors.py); None for float weights."""
    path = pathlib.Path(model_dir) / QUANTIZATION_FILE
    if not path.is_file():
        config = pathlib.Path(model_dir) / "config.json"
        if config.is_file() and compressed_tensors.scheme_of(read_hf_config(model_dir),
                                                             config):
            return compressed_tensors.MODE
        return None
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
    config = root / "config.json"
    return not (config.is_file() and compressed_tensors.scheme_of(read_hf_config(root),
                                                                   config))


def served_quantization(model_dir: str | os.PathLike, requested: str | None) -> str | None:
    """The mode a checkpoint directory is served in: that of its weights if written
    quantized (`checkpoint_quantization`; asking for another is an error), else
    `requested`."""
    written = checkpoint_quantization(model_dir)
    if written is not None and requested not in (None, written):
        raise ValueError(f"{model_dir} holds {written} weights; quantization="
                         f"{requested!r} would need the float checkpoint")
    return written or requested


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
    src, dst = _model_dir(hf_dir), pathlib.Path(out_dir)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    cfg = load_config(src)
    quantization_mode = served_quantization(src, quantization_mode)
    params = load_hf_params(src, cfg, dtype)
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
