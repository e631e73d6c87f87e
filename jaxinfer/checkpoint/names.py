"""Name maps between HF checkpoint tensors ([out, in], q/k/v and gate/up apart) and the
fused [in, out] params, both from the parameter table: `hf_names`, `hf_shapes`,
`leaf_layouts` (what shard_source reads per device). Reads no files.
See docs/architecture.md#params-and-the-kv-cache.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxinfer.checkpoint import shard_source
from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion, params_table
from jaxinfer.model.transformer import Params

LAYER_PREFIX = "model.layers.{}."


# The decoder's own tensors, saved without the "model." of *ForCausalLM when a bare
# `XModel` (an embedding model: Qwen3-Embedding, gte-Qwen2) is saved alone.
BARE_DECODER_PREFIXES = ("embed_tokens.", "layers.", "norm.")


def with_model_prefix(tensors: dict) -> dict:
    """`tensors` with a bare decoder's names given *ForCausalLM's "model." prefix."""
    return {("model." + name if name.startswith(BARE_DECODER_PREFIXES) else name): tensor
            for name, tensor in tensors.items()}


class HFTensor(NamedTuple):
    """Where one HF tensor goes in the unfused params."""

    path: tuple  # into `hf_shapes`' tree
    transposed: bool  # HF stores it [out, in], params [in, out]
    expert: int | None = None  # an experts leaf's index on its first axis


def hf_names(cfg: ModelConfig) -> dict[str, HFTensor]:
    """HF tensor name -> its place in the unfused params (`hf_shapes`)."""
    out = {}
    for param in params_table.top_params(cfg):
        for part in param.parts:
            out[part.hf] = HFTensor((part.key,), part.transposed)
    for i in range(cfg.num_layers):
        prefix = LAYER_PREFIX.format(i)
        for param in params_table.layer_params(cfg, i):
            for part in param.parts:
                path = ("layers", i, part.key)
                if not param.experts or param.stacked:  # one tensor (of all experts)
                    out[prefix + part.hf] = HFTensor(path, part.transposed)
                    continue
                for e in range(cfg.moe.num_experts):
                    out[prefix + part.hf.format(e=e)] = HFTensor(path, part.transposed, e)
    return out


def hf_shape(shapes: Params, tensor: HFTensor) -> tuple[int, ...]:
    """The shape of one HF tensor as params hold it ([in, out]), from `hf_shapes`."""
    shape = get_leaf(shapes, tensor.path)
    return shape if tensor.expert is None else shape[1:]


def hf_shapes(cfg: ModelConfig) -> Params:
    """The params' shapes with each layer's fused leaves apart, as checkpoints store them."""
    return params_table.param_shapes(cfg) | {
        "layers": [params_table.hf_layer_shapes(cfg, i) for i in range(cfg.num_layers)]}


def fuse(params: Params, cfg: ModelConfig) -> Params:
    """Params read with HF's separate projections -> the fused params pytree."""
    return params | {"layers": [fusion.fuse_layer(layer, cfg) for layer in params["layers"]]}


def leaf_name(path: tuple) -> str:
    """"layers.3.wqkv" for a params path, given as keys or as JAX's key entries."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def leaf_layouts(cfg: ModelConfig) -> dict[str, shard_source.Layout]:
    """leaf_name of each params leaf -> the HF tensors it is made of, and how."""
    out = {}
    for param in params_table.top_params(cfg):
        out[param.key] = shard_source.Layout(param.kind, tuple(p.hf for p in param.parts))
    for i in range(cfg.num_layers):
        prefix = LAYER_PREFIX.format(i)
        for param in params_table.layer_params(cfg, i):
            out[leaf_name(("layers", i, param.key))] = shard_source.Layout(
                param.kind, tuple(prefix + p.hf for p in param.parts),
                cfg.moe.num_experts if param.experts and not param.stacked else 0)
    return out


def get_leaf(tree: Params, path: tuple) -> object:
    """The value at `path` (keys and list indices) in a params pytree."""
    for key in path:
        tree = tree[key]
    return tree
