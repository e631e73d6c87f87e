"""The published tensor layouts of speculative heads: every tensor's name, the shapes it
may have in torch's [out, in] orientation, its dtypes and whether a checkpoint must
hold it; and the check of a checkpoint's tensors against them, naming the first tensor
that does not fit. See docs/speculative_decoding.md#head-checkpoints-and-the-heads-step.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.config.heads import HeadConfig

FLOAT = ("float32", "float16", "bfloat16")
INDEX = ("int64", "int32")
MASK = ("bool",)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One published tensor: the shapes it may have (the first is written), its kind of
    dtype, and whether a checkpoint must have it."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...] = FLOAT
    required: bool = True


def published_layout(head: HeadConfig, own_embed: bool = False) -> dict[str, Spec]:
    """Every tensor name of `head`'s published layout -> its Spec (torch orientation)."""
    if head.method == "medusa":
        return _medusa_layout(head)
    d, vocab = head.hidden_size, head.vocab_size
    prefix = "midlayer." if head.method == "eagle3" else "layers.0."
    d_in = 2 * d if head.method == "eagle3" else d
    out = {prefix + suffix: Spec((shape,)) for suffix, shape in
           layer_shapes(head.layer, d_in).items()}
    out["fc.weight"] = Spec(((d, head.feature_size if head.method == "eagle3" else 2 * d),))
    out["embed_tokens.weight"] = Spec(((vocab, d),), required=False)
    if head.method == "eagle":
        out["fc.bias"] = Spec(((d,),), required=head.fc_bias)
        out[prefix + "input_layernorm.weight"] = Spec(((d,),), required=False)
        return out
    out["embed_tokens.weight"] = Spec(((vocab, d),), required=own_embed or (
        d != head.target_hidden_size))
    out |= {prefix + "hidden_norm.weight": Spec(((d,),)), "norm.weight": Spec(((d,),)),
            "lm_head.weight": Spec(((head.draft_vocab_size, d),)),
            "d2t": Spec(((head.draft_vocab_size,),), INDEX,
                        required=head.draft_vocab_size < vocab),
            "t2d": Spec(((vocab,),), MASK, required=False)}
    return out


def layer_shapes(layer: ModelConfig, d_in: int) -> dict[str, tuple[int, ...]]:
    d, f = layer.hidden_size, layer.intermediate_size
    q, kv = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    return {"self_attn.q_proj.weight": (q, d_in), "self_attn.k_proj.weight": (kv, d_in),
            "self_attn.v_proj.weight": (kv, d_in), "self_attn.o_proj.weight": (d, q),
            "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
            "mlp.down_proj.weight": (d, f), "input_layernorm.weight": (d,),
            "post_attention_layernorm.weight": (d,)}


def _medusa_layout(head: HeadConfig) -> dict[str, Spec]:
    d, kept = head.hidden_size, head.draft_vocab_size
    truncated = kept < head.vocab_size
    out = {}
    for h in range(head.num_heads):
        for j in range(head.num_layers):
            out[f"blocks.{h}.layers.{j}.weight"] = Spec(((d, d),))
            if head.fc_bias:
                out[f"blocks.{h}.layers.{j}.bias"] = Spec(((d,),))
        if h == 0 or not head.shared_lm_head:
            shapes = ((kept, d), (head.vocab_size, d)) if truncated else ((kept, d),)
            out[f"lm_heads.{h}.weight"] = Spec(shapes)
    if truncated:
        out["token_map"] = Spec(((kept,),), INDEX)
    return out


def check(root: pathlib.Path, tensors: dict[str, np.ndarray],
           expected: dict[str, Spec]) -> None:
    """ValueError naming the first tensor missing, unexpected, misshapen or mistyped."""
    missing = sorted(n for n, spec in expected.items() if spec.required and n not in tensors)
    if missing:
        raise ValueError(f"{root}: checkpoint lacks tensor(s) {missing[:5]}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ValueError(f"{root}: unexpected tensor(s) {unexpected[:5]}; config.json "
                         "does not describe them")
    for name, array in tensors.items():
        spec = expected[name]
        if tuple(array.shape) not in spec.shapes:
            raise ValueError(f"{root}: tensor {name} has shape {tuple(array.shape)}, "
                             f"expected {' or '.join(map(str, spec.shapes))} from "
                             "config.json")
        if array.dtype.name not in spec.dtypes:
            raise ValueError(f"{root}: tensor {name} has dtype {array.dtype.name}, "
                             f"expected one of {spec.dtypes}")
