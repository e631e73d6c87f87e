"""Name maps between HF checkpoint tensors and the params pytree.

HF checkpoints keep q/k/v and gate/up as separate tensors, [out, in]; params hold
them fused (model/fusion.py) and [in, out]. `hf_names` maps each HF tensor to its
place in the unfused params (`hf_shapes`), `leaf_layouts` each fused params leaf to
the HF tensors it is made of (what `shard_source` reads per device). Reads no files.
"""

from __future__ import annotations

from jaxinfer.checkpoint import shard_source
from jaxinfer.config import ModelConfig
from jaxinfer.model import fusion
from jaxinfer.model.transformer import Params, hf_layer_shapes, param_shapes

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


def get_leaf(tree: Params, path: tuple) -> object:
    """The value at `path` (keys and list indices) in a params pytree."""
    for key in path:
        tree = tree[key]
    return tree
