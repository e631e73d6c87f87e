"""HF checkpoint directories: config.json and safetensors <-> the params pytree. Reads
without torch or checkpoint code, each device's slice on its own (shard_source), fused
on the fly; `save_hf` writes what transformers loads. See docs/cli.md#model-directories
and, for FP8, MXFP4 and multimodal checkpoints, docs/quantization.md and docs/models.md.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxinfer.checkpoint import (
    compressed_tensors,
    mxfp4,
    prequantized_int4,
    safetensors_file,
    shard_source,
    text_tower,
)
from jaxinfer.checkpoint.names import (
    get_leaf,
    hf_names,
    hf_shape,
    hf_shapes,
    leaf_layouts,
    leaf_name,
    with_model_prefix,
)
from jaxinfer.config import ModelConfig
from jaxinfer.config import pipeline as pipeline_rules
from jaxinfer.model import fusion, quantization, sharding
from jaxinfer.model.params_table import param_partition_specs, param_shapes
from jaxinfer.model.transformer import Params

log = logging.getLogger(__name__)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def load_config(model_dir: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of a checkpoint directory (HF or orbax). A `quantization_config`
    other than compressed-tensors FP8, AWQ or GPTQ int4 (of a dense model) or MXFP4 is
    refused here, before any weight is read."""
    hf = read_hf_config(model_dir)
    source = model_dir_path(model_dir) / "config.json"
    _scheme(hf, source)
    cfg = ModelConfig.from_hf(hf)
    prequantized_int4.check_model(hf, cfg, source)
    return cfg


def read_hf_config(model_dir: str | os.PathLike) -> dict:
    """The config.json of a checkpoint directory, as a dict."""
    path = model_dir_path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (is this a model directory?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def load_hf_params(model_dir: str | os.PathLike, cfg: ModelConfig, dtype: str = "float32",
                   mesh: Mesh | None = None, log: shard_source.ReadLog | None = None, *,
                   expert_parallel: bool = False, quantization_mode: str | None = None
                   ) -> Params:
    """Read safetensors tensors into our params pytree, checking names and shapes. Each
    leaf is built per device from the memory-mapped tensors (`shard_source`), q/k/v and
    gate/up fused on the fly (model/fusion.py), KV heads copied when the mesh has more
    devices than KV heads, whole experts per device with `expert_parallel`. A
    compressed-tensors FP8 checkpoint's linear weights become fp8 QuantizedWeights made
    of its float8 values and scales (compressed_tensors.py); an AWQ or GPTQ checkpoint's
    become int4 ones made of its codes, scales and zeros (prequantized_int4/). An MXFP4
    checkpoint's experts stay packed (mxfp4.py) unless `quantization_mode`, the mode
    they are served in, is another: then they are decoded to `dtype` as read."""
    check_dtype(dtype)
    root = model_dir_path(model_dir)
    hf = read_hf_config(root)
    scheme = _scheme(hf, root / "config.json")
    int4 = prequantized_int4.scheme_of(hf, root / "config.json")
    packed = mxfp4.kept_packed(hf, quantization_mode)
    tensors = _checked_tensors(root, cfg, scheme, int4)
    mesh = mesh or sharding.make_mesh(1)
    shards = mesh.shape[sharding.MODEL_AXIS]
    sharding.validate(cfg, shards, mesh.size, expert_parallel)
    served = sharding.served_config(cfg, shards)
    reader = shard_source.Reader(tensors, served, sharding.kv_replicas(cfg, shards), log)
    layouts = leaf_layouts(served)
    mode = (scheme and compressed_tensors.MODE or int4 and prequantized_int4.MODE
            or packed and mxfp4.MODE or None)
    specs = quantization.partition_specs(param_partition_specs(served, shards, expert_parallel),
                                         mode, head=False)
    target = np.dtype(jnp.dtype(dtype))

    placement = stage_placement(cfg, mesh)

    def leaf(path: tuple, shape: tuple[int, ...], spec: object) -> object:
        name = leaf_name(path)
        mesh = placement(name)  # a layer's stage's devices, with pipeline stages
        if not quantization.is_quantized(spec):
            return placed_leaf(reader, mesh, name, layouts[name], shape, spec, target)
        if spec.mode == mxfp4.MODE:
            return mxfp4.packed_weight(tensors[layouts[name].names[0]], layouts[name].kind,
                                       shape, spec, mesh, log and log.record)
        if int4 is not None:
            return prequantized_int4.quantized_leaf(reader, mesh, name, layouts[name], shape,
                                                    spec, int4.group_size)
        scale_layout = compressed_tensors.scale_layout(layouts[name])
        return quantization.QuantizedWeight(
            _fp8_value(reader, mesh, name, layouts[name], shape, spec.value),
            placed_leaf(reader, mesh, f"{name}.scale", scale_layout, shape[1:], spec.scale,
                        np.dtype(np.float32)),
            spec.mode)

    shapes = param_shapes(served)
    return jax.tree_util.tree_map_with_path(
        leaf, shapes, specs, is_leaf=lambda x: isinstance(x, tuple))


def stage_placement(cfg: ModelConfig, mesh: Mesh) -> Callable[[str], Mesh]:
    """leaf name -> the mesh it is read onto: with pipeline stages a layer's leaves go to
    its stage's devices alone (model/pipeline.py stacks them in place), the rest to
    every stage; else `mesh`."""
    stages = sharding.stage_count(mesh)
    if stages == 1:
        return lambda name: mesh
    starts = pipeline_rules.stage_starts(cfg.num_layers, stages)
    meshes = [sharding.stage_mesh(mesh, stage) for stage in range(stages)]

    def placement(name: str) -> Mesh:
        if not name.startswith("layers."):
            return mesh
        layer = int(name.split(".")[1])
        return meshes[max(s for s in range(stages) if starts[s] <= layer)]

    return placement


def placed_leaf(reader: shard_source.Reader, mesh: Mesh, name: str,
                layout: shard_source.Layout, shape: tuple[int, ...], spec: PartitionSpec,
                dtype: np.dtype) -> jax.Array:
    """The float leaf `name` built on `mesh`, each device's slice cut from `reader`'s
    HF tensors (fused on the fly): what loading and a weight update by HF names share."""
    return jax.make_array_from_callback(
        shape, NamedSharding(mesh, spec),
        lambda index: reader.slice_of(name, layout, shape, index, dtype),
        dtype=dtype)  # a stage on another process's devices: no shard read here


def leaves_from_hf_tensors(tensors: dict, cfg: ModelConfig, dtype: str, mesh: Mesh, *,
                           expert_parallel: bool = False) -> dict[str, jax.Array]:
    """leaf_name -> float leaf placed on `mesh`, for each params leaf whose HF tensors
    are all in `tensors` (HF name -> host array; a subset: a partial update), cut per
    device by the loader's reader. A name that is no HF tensor of `cfg`, a wrong shape,
    or a fused leaf given in part is a ValueError naming it."""
    shards = mesh.shape[sharding.MODEL_AXIS]
    served = sharding.served_config(cfg, shards)
    reader = shard_source.Reader(tensors, served, sharding.kv_replicas(cfg, shards))
    specs = param_partition_specs(served, shards, expert_parallel)
    leaf_shapes, out = param_shapes(served), {}
    for leaf, (layout, _) in given_leaves(tensors, cfg, served).items():
        path = _leaf_path(leaf)
        out[leaf] = placed_leaf(reader, mesh, leaf, layout, get_leaf(leaf_shapes, path),
                                get_leaf(specs, path), np.dtype(jnp.dtype(dtype)))
    return out


def fused_on_device(arrays: dict, cfg: ModelConfig) -> dict[str, jax.Array]:
    """leaf_name -> leaf for HF-named jax.Arrays, fused where they are (jnp ops on
    their devices, no host copy; the caller reshards): for a mesh that needs no KV
    head copies (sharding.served_config(cfg, shards) == cfg). Checked as
    `leaves_from_hf_tensors` checks."""
    names, out = hf_names(cfg), {}
    for leaf, (_, parts) in given_leaves(arrays, cfg, cfg).items():
        layer: dict = {}
        for name in parts:
            tensor = names[name]
            value = arrays[name].T if tensor.transposed else arrays[name]
            layer.setdefault(tensor.path[-1], []).append(value)
        layer = {k: jnp.stack(v) if len(v) > 1 or names[parts[0]].expert is not None
                 else v[0] for k, v in layer.items()}
        if leaf.startswith("layers."):
            layer = fusion.fuse_layer(layer, cfg)
        (out[leaf],) = layer.values()
    return out


def given_leaves(tensors: dict, cfg: ModelConfig, served: ModelConfig
                 ) -> dict[str, tuple[shard_source.Layout, list[str]]]:
    """leaf_name -> (its layout, its HF tensor names) for each leaf all of whose
    tensors `tensors` holds; ValueError for an unknown name, a wrong shape, or a
    fused leaf given in part."""
    expected, shapes = hf_names(cfg), hf_shapes(cfg)
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ValueError(f"unknown tensor name(s) {unknown[:5]} for {cfg.architecture}")
    for name, array in tensors.items():
        want = hf_shape(shapes, expected[name])
        want = want[::-1] if expected[name].transposed else want
        if tuple(array.shape) != tuple(want):
            raise ValueError(f"tensor {name} has shape {tuple(array.shape)}, expected "
                             f"{tuple(want)}")
    out = {}
    for leaf, layout in leaf_layouts(served).items():
        names = [n.format(e=e) for n in layout.names
                 for e in (range(layout.experts) if layout.experts else [0])]
        given = [n for n in names if n in tensors]
        if given and len(given) < len(names):
            missing = sorted(set(names) - set(given))
            raise ValueError(f"{leaf} is made of {len(names)} tensors; also give "
                             f"{missing[:5]}")
        if given:
            out[leaf] = (layout, names)
    return out


def _leaf_path(leaf: str) -> tuple:
    return tuple(int(k) if k.isdigit() else k for k in leaf.split("."))


def _fp8_value(reader: shard_source.Reader, mesh: Mesh, name: str,
               layout: shard_source.Layout, shape: tuple[int, ...],
               spec: PartitionSpec) -> jax.Array:
    """A fp8 weight [I, O] as QuantizedWeight stores it, [O, I] (HF's own layout)."""
    return jax.make_array_from_callback(
        shape[::-1], NamedSharding(mesh, spec),
        lambda index: np.ascontiguousarray(reader.slice_of(
            name, layout, shape, index[::-1], compressed_tensors.FP8).T),
        dtype=compressed_tensors.FP8)


def _scheme(hf: dict, source: pathlib.Path) -> compressed_tensors.Scheme | None:
    """The compressed-tensors scheme of a config.json dict; None for none, for MXFP4
    (gpt-oss's experts, decoded to floats on load: mxfp4.py) or for AWQ and GPTQ (checked
    here: prequantized_int4/)."""
    if mxfp4.is_mxfp4(hf) or prequantized_int4.scheme_of(hf, source) is not None:
        return None
    return compressed_tensors.scheme_of(hf, source)


def _checked_tensors(root: pathlib.Path, cfg: ModelConfig,
                     scheme: compressed_tensors.Scheme | None = None,
                     int4: prequantized_int4.Scheme | None = None) -> dict[str, object]:
    """The checkpoint's tensors (memory-mapped), refused unless their names, shapes and
    dtypes are those `cfg` describes; with a compressed-tensors `scheme`, the fp8
    weights' scales added as float32 [out] `<module>.weight_scale` tensors; with an AWQ
    or GPTQ `int4` scheme, each projection's packed tensors as its int4 views."""
    hf = read_hf_config(root)
    tensors = text_tower.text_tower_tensors(hf, _read_tensors(root), root)
    tensors = with_model_prefix(tensors)  # a bare decoder's names (an embedding model)
    if mxfp4.is_mxfp4(hf):  # experts' blocks and scales, decoded as slices are read
        tensors = mxfp4.decoded_tensors(tensors)
    fp8_names, scales = set(), {}
    if scheme is not None:
        fp8_names = {n for n, tensor in hf_names(cfg).items()  # layer projections
                     if tensor.path[-1] in compressed_tensors.FP8_PARTS}
        scales = compressed_tensors.take_scales(tensors, fp8_names, scheme, root)
        for note in scheme.notes():
            log.warning("%s: loading fp8 weights as they are, but %s", root, note)
    expected, views = hf_names(cfg), {}
    if int4 is not None:
        shapes = hf_shapes(cfg)
        weights = {n: hf_shape(shapes, t) for n, t in expected.items()
                   if t.path[-1] in prequantized_int4.PARTS}
        views = prequantized_int4.int4_views(tensors, weights, int4, root)
        expected = {n: t for n, t in expected.items() if n not in weights}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{root}: checkpoint lacks tensor(s) {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''} for {cfg.architecture}")
    unexpected = sorted(n for n in set(tensors) - set(expected) if not _ignorable(n, cfg))
    if unexpected:
        raise ValueError(f"{root}: unexpected tensor(s) {unexpected[:5]}; the config "
                         f"does not describe this checkpoint")
    shapes = hf_shapes(cfg)
    for name, tensor in expected.items():
        array = tensors[name]
        want = hf_shape(shapes, tensor)
        got = tuple(array.shape[::-1] if tensor.transposed else array.shape)
        if got != want:
            hf_want = want[::-1] if tensor.transposed else want
            raise ValueError(f"{root}: tensor {name} has shape {tuple(array.shape)}, "
                             f"expected {hf_want} from config.json")
        if array.dtype.name not in FLOAT_DTYPES and name not in fp8_names:
            raise ValueError(f"{root}: tensor {name} has unsupported dtype "
                             f"{array.dtype.name}; expected one of {FLOAT_DTYPES}")
    return tensors | scales | views


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    return name.endswith(IGNORED_SUFFIXES) or (
        (cfg.tie_word_embeddings or cfg.head != "lm") and name == "lm_head.weight")


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
    check_dtype(dtype)
    root = pathlib.Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {}
    params = params | {"layers": [fusion.unfuse_layer(jax.device_get(layer), cfg)
                                  for layer in params["layers"]]}
    for name, tensor in hf_names(cfg).items():
        value = np.asarray(jax.device_get(get_leaf(params, tensor.path)).astype(dtype))
        value = value if tensor.expert is None else value[tensor.expert]
        tensors[name] = value.T if tensor.transposed else value
    safetensors_file.save(tensors, root / "model.safetensors", {"format": "pt"})
    hf = cfg.to_hf() | {"dtype": dtype} | (extra_config or {})
    (root / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def model_dir_path(model_dir: str | os.PathLike) -> pathlib.Path:
    """`model_dir` as a path; FileNotFoundError unless it is a directory."""
    root = pathlib.Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    return root


def check_dtype(dtype: str) -> None:
    """ValueError unless `dtype` is a dtype params are loaded in."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"{dtype=} must be 'float32' or 'bfloat16'")

