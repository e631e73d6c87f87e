"""The parameter table: the rows every family shares (`Param`, config/families/rows.py,
gated by ModelConfig fields) and `layer_rows`, which joins a family's own. The params'
shapes, PartitionSpecs, checkpoint names, fusing, quantization and the planner's bytes
are derived from the rows. See docs/moe.md#parameters-one-table,
docs/architecture.md#model-families and docs/parallelism.md#tensor-parallelism.
"""

from __future__ import annotations

from collections.abc import Callable

from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig, families
from jaxinfer.config.families.rows import (
    LAYOUTS,
    SPLITS,
    SWAPPED,
    Param,
    Part,
    Shape,
)
from jaxinfer.config.families.rows import hidden as _d

MODEL_AXIS = "model"  # the mesh axis tensor parallelism splits (model/sharding.py)


def spec(param: Param, cfg: ModelConfig, tensor_parallel_size: int = 1,
         expert_parallel: bool = False) -> P:
    """A leaf's PartitionSpec over the model axis. Experts, stored [E, out, in] as HF
    stores each (a decode step's gathered matvecs then read whole rows), split by
    expert with `expert_parallel` (ModelOptions), else inside each expert as a dense
    MLP: gate/up by output rows, down by input columns."""
    vocab = cfg.vocab_size % tensor_parallel_size == 0
    by_expert = P(MODEL_AXIS, None, None)
    return {"whole": P(), "columns": P(None, MODEL_AXIS), "rows": P(MODEL_AXIS, None),
            "vector": P(MODEL_AXIS),
            "vocab_rows": P(MODEL_AXIS, None) if vocab else P(),
            "vocab_columns": P(None, MODEL_AXIS) if vocab else P(),
            "expert_outputs": by_expert if expert_parallel else P(None, MODEL_AXIS, None),
            "expert_inputs": by_expert if expert_parallel else P(None, None, MODEL_AXIS),
            "expert_vectors": P(MODEL_AXIS, None) if expert_parallel
            else P(None, MODEL_AXIS)}[param.split]


def _q(cfg: ModelConfig) -> int:
    return cfg.num_heads * cfg.head_dim


def _kv(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads * cfg.head_dim


def _f(cfg: ModelConfig) -> int:
    return cfg.intermediate_size


def _dense(cfg: ModelConfig, layer: int) -> bool:
    return not cfg.is_moe_layer(layer)


def _no_post_norms(cfg: ModelConfig, layer: int) -> bool:
    return not cfg.post_norms


TOP = (
    Param("embed", (Part("embed", "model.embed_tokens.weight",
                         lambda c: (c.vocab_size, _d(c))),), "vocab_rows"),
    Param("final_norm", (Part("final_norm", "model.norm.weight", lambda c: (_d(c),)),),
          "whole"),
    Param("lm_head", (Part("lm_head", "lm_head.weight", lambda c: (_d(c), c.vocab_size),
                           transposed=True),),
          "vocab_columns", when=lambda c, _: not c.tie_word_embeddings and c.head == "lm"),
    Param("score", (Part("score", "score.weight", lambda c: (_d(c), c.num_labels),
                         transposed=True),),
          "whole", when=lambda c, _: c.head == "score"),
)


SHARED_LAYER = (
    Param("attn_norm", (Part("attn_norm", "input_layernorm.weight", lambda c: (_d(c),)),),
          "whole"),
    Param("wqkv", (Part("wq", "self_attn.q_proj.weight", lambda c: (_d(c), _q(c)), True),
                   Part("wk", "self_attn.k_proj.weight", lambda c: (_d(c), _kv(c)), True),
                   Part("wv", "self_attn.v_proj.weight", lambda c: (_d(c), _kv(c)), True)),
          "columns", layout="qkv", quantized=True),
    Param("bqkv", (Part("bq", "self_attn.q_proj.bias", lambda c: (_q(c),)),
                   Part("bk", "self_attn.k_proj.bias", lambda c: (_kv(c),)),
                   Part("bv", "self_attn.v_proj.bias", lambda c: (_kv(c),))),
          "vector", layout="qkv", when=lambda c, _: c.qkv_bias),
    Param("q_norm", (Part("q_norm", "self_attn.q_norm.weight", lambda c: (c.head_dim,)),),
          "whole", when=lambda c, _: c.qk_norm),
    Param("k_norm", (Part("k_norm", "self_attn.k_norm.weight", lambda c: (c.head_dim,)),),
          "whole", when=lambda c, _: c.qk_norm),
    Param("wo", (Part("wo", "self_attn.o_proj.weight", lambda c: (_q(c), _d(c)), True),),
          "rows", quantized=True),
    Param("bo", (Part("bo", "self_attn.o_proj.bias", lambda c: (_d(c),)),), "whole",
          when=lambda c, _: c.o_bias),
    Param("sinks", (Part("sinks", "self_attn.sinks", lambda c: (c.num_heads,)),), "vector",
          when=lambda c, _: c.attention_sinks),
    # the MLP's input norm; with post_norms, HF's name is Gemma's post-attention norm
    # (config/families/gemma2.py)
    Param("mlp_norm", (Part("mlp_norm", "post_attention_layernorm.weight",
                            lambda c: (_d(c),)),), "whole", when=_no_post_norms),
    Param("w_gate_up", (Part("w_gate", "mlp.gate_proj.weight", lambda c: (_d(c), _f(c)), True),
                        Part("w_up", "mlp.up_proj.weight", lambda c: (_d(c), _f(c)), True)),
          "columns", layout="gate_up", quantized=True, when=_dense),
    Param("w_down", (Part("w_down", "mlp.down_proj.weight", lambda c: (_f(c), _d(c)), True),),
          "rows", quantized=True, when=_dense),
)
# every kind of layer leaf of every family: the shared rows, then each family's own
LAYER = SHARED_LAYER + tuple(dict.fromkeys(
    row for family in families.FAMILIES for row in family.rows))

QUANTIZED = tuple(dict.fromkeys(p.key for p in LAYER if p.quantized))  # linear weights
EXPERTS = tuple(dict.fromkeys(p.key for p in LAYER if p.experts  # stacked [E, O, I]
                              and p.split in ("expert_outputs", "expert_inputs")))


def top_params(cfg: ModelConfig) -> tuple[Param, ...]:
    """The rows of the leaves outside the layers that `cfg`'s model has."""
    return tuple(p for p in TOP if p.when(cfg, -1))


def layer_rows(cfg: ModelConfig) -> tuple[Param, ...]:
    """The layer rows of `cfg`'s family: the shared ones, then the family's own."""
    return SHARED_LAYER + families.family(cfg.architecture).rows


def layer_params(cfg: ModelConfig, layer: int) -> tuple[Param, ...]:
    """The rows of the leaves layer `layer` of `cfg`'s model has."""
    return tuple(p for p in layer_rows(cfg) if p.when(cfg, layer))


def param_shapes(cfg: ModelConfig) -> dict:
    """The shape of every parameter, in the params pytree structure (fused)."""
    return _tree(cfg, lambda p: p.shape(cfg))


def param_partition_specs(cfg: ModelConfig, tensor_parallel_size: int = 1,
                          expert_parallel: bool = False) -> dict:
    """The PartitionSpec of every parameter over the mesh's model axis (experts whole per
    device with `expert_parallel`)."""
    return _tree(cfg, lambda p: spec(p, cfg, tensor_parallel_size, expert_parallel))


def hf_layer_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, Shape]:
    """One layer's parameters with fused leaves apart (q/k/v, gate/up), experts stacked."""
    return {part.key: p.part_shape(part, cfg) for p in layer_params(cfg, layer)
            for part in p.parts}


def _tree(cfg: ModelConfig, value: Callable[[Param], object]) -> dict:
    tree = {p.key: value(p) for p in top_params(cfg)}
    tree["layers"] = [{p.key: value(p) for p in layer_params(cfg, i)}
                      for i in range(cfg.num_layers)]
    return tree


__all__ = ["EXPERTS", "LAYER", "LAYOUTS", "MODEL_AXIS", "QUANTIZED", "SHARED_LAYER", "SPLITS",
           "SWAPPED", "TOP", "Param", "Part", "Shape", "hf_layer_shapes", "layer_params",
           "layer_rows", "param_partition_specs", "param_shapes", "spec", "top_params"]
