"""The parameter table: every fact about each kind of parameter, in one row.

A row (`Param`) gives a params leaf's key, the HF tensors it is made of (`Part`: our
unfused name, HF name, shape as [in, out], whether HF stores it transposed), how the
parts combine (`layout`: one tensor as stored or transposed, q/k/v grouped by KV head,
gate/up interleaved in blocks: model/fusion.py), how the leaf splits over the mesh's
model axis (`split`), whether weight quantization applies to it, and when the model
has it. Everything else is derived here or reads these rows: the params pytree's
shapes and PartitionSpecs, the checkpoint names (checkpoint/names.py), fusing and
unfusing (model/fusion.py), which weights quantize (model/quantization.py) and which
HF tensors a compressed-tensors checkpoint stores in fp8, and the planner's bytes.

Splits (Megatron): q/k/v and gate/up by output columns (whole KV-head groups, whole
gate/up block pairs), o and down by input rows, so each layer needs two all-reduces;
norms replicated. The embedding and the LM head split along the vocabulary: a
vocab-split LM head gives each device whole logit columns (gathered once before
sampling) where a hidden split would all-reduce V floats per row, and the tied table
serves both. A vocabulary the devices do not divide stays replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig

Shape = tuple[int, ...]
SPLITS = ("whole", "columns", "rows", "vector", "vocab_rows", "vocab_columns",
          "expert_outputs", "expert_inputs", "expert_vectors")
LAYOUTS = ("plain", "transposed", "qkv", "gate_up", "gate_up_rows", "interleaved_gate_up",
           "experts_transposed")  # shard_source.py reads them; gate_up_rows: gate and up
# fused along the rows of HF's [out, in] storage; interleaved_gate_up: one HF tensor of
# all experts [E, in, 2F] (or biases [E, 2F]) whose even columns are gate, odd up
# (gpt-oss), read into the blocks of gate_up_rows; experts_transposed: one HF tensor of
# all experts [E, in, out] read as [E, out, in]
SWAPPED = ("interleaved_gate_up", "experts_transposed")  # HF [E, in, out], ours [E, out, in]
MODEL_AXIS = "model"  # the mesh axis tensor parallelism splits (model/sharding.py)


@dataclasses.dataclass(frozen=True)
class Part:
    """One HF tensor of a leaf."""

    key: str  # our unfused name: "wq"
    hf: str  # HF name, under "model.layers.{i}." for a layer parameter; "{e}": an expert's
    shape: Callable[[ModelConfig], Shape]  # as params hold it ([in, out] for a weight),
    # one expert's for an experts leaf
    transposed: bool = False  # HF stores it [out, in]


@dataclasses.dataclass(frozen=True)
class Param:
    """One kind of params leaf."""

    key: str
    parts: tuple[Part, ...]
    split: str  # one of SPLITS
    layout: str = ""  # one of LAYOUTS; "" for one part: "plain" or "transposed"
    quantized: bool = False  # a layer's linear weight: int8/w8a8/fp8/int4 apply
    when: Callable[[ModelConfig, int], bool] = lambda cfg, layer: True  # layer -1: top
    experts: bool = False  # [E, ...]: one leaf per expert, stacked

    def shape(self, cfg: ModelConfig) -> Shape:
        """The leaf's shape: fused parts concatenate along their output axis (the last,
        or the one before it for `gate_up_rows`); an experts leaf stacks E of them."""
        if self.layout in SWAPPED:
            shape = self.part_shape(self.parts[0], cfg)
            return (*shape[:-2], shape[-1], shape[-2]) if len(shape) == 3 else shape
        shapes = [self.part_shape(part, cfg) for part in self.parts]
        axis = len(shapes[0]) - (2 if self.layout == "gate_up_rows" else 1)
        fused = sum(s[axis] for s in shapes)
        return (*shapes[0][:axis], fused, *shapes[0][axis + 1:])

    def part_shape(self, part: Part, cfg: ModelConfig) -> Shape:
        """A part's shape in the unfused params (E experts stacked)."""
        shape = part.shape(cfg)
        return (cfg.moe.num_experts, *shape) if self.experts else shape

    @property
    def kind(self) -> str:
        """How the parts combine, as checkpoint/shard_source.py names it."""
        if self.layout:
            return self.layout
        return "transposed" if self.parts[0].transposed else "plain"

    @property
    def fused(self) -> bool:
        return len(self.parts) > 1

    @property
    def stacked(self) -> bool:
        """An experts leaf that HF stores as one tensor of all experts (no "{e}")."""
        return self.experts and "{e}" not in self.parts[0].hf

    def spec(self, cfg: ModelConfig, tensor_parallel_size: int = 1) -> P:
        """The leaf's PartitionSpec over the model axis. Experts, stored [E, out, in] as
        HF stores each (a decode step's gathered matvecs then read whole rows), split by
        expert with `cfg.expert_parallel`, else inside each expert as a dense MLP: gate/up
        by output rows, down by input columns."""
        vocab = cfg.vocab_size % tensor_parallel_size == 0
        by_expert = P(MODEL_AXIS, None, None)
        return {"whole": P(), "columns": P(None, MODEL_AXIS), "rows": P(MODEL_AXIS, None),
                "vector": P(MODEL_AXIS),
                "vocab_rows": P(MODEL_AXIS, None) if vocab else P(),
                "vocab_columns": P(None, MODEL_AXIS) if vocab else P(),
                "expert_outputs": by_expert if cfg.expert_parallel
                else P(None, MODEL_AXIS, None),
                "expert_inputs": by_expert if cfg.expert_parallel
                else P(None, None, MODEL_AXIS),
                "expert_vectors": P(MODEL_AXIS, None) if cfg.expert_parallel
                else P(None, MODEL_AXIS)}[self.split]


def _d(cfg: ModelConfig) -> int:
    return cfg.hidden_size


def _q(cfg: ModelConfig) -> int:
    return cfg.num_heads * cfg.head_dim


def _kv(cfg: ModelConfig) -> int:
    return cfg.num_kv_heads * cfg.head_dim


def _f(cfg: ModelConfig) -> int:
    return cfg.intermediate_size


def _fe(cfg: ModelConfig) -> int:  # one expert's intermediate size
    return cfg.moe.intermediate_size


def _fs(cfg: ModelConfig) -> int:  # the shared expert's
    return cfg.moe.shared_expert_intermediate_size


def _dense(cfg: ModelConfig, layer: int) -> bool:
    return not cfg.is_moe_layer(layer)


def _moe(family: str) -> Callable[[ModelConfig, int], bool]:
    """MoE layers of `family`: "mixtral", "gpt_oss", or "qwen" (Qwen2-MoE, Qwen3-MoE)."""
    return lambda cfg, layer: cfg.is_moe_layer(layer) and family == {
        "mixtral": "mixtral", "gpt_oss": "gpt_oss"}.get(cfg.architecture, "qwen")


def _llama_norms(cfg: ModelConfig, layer: int) -> bool:
    return not cfg.post_norms


def _post_norms(cfg: ModelConfig, layer: int) -> bool:
    return cfg.post_norms


def _shared(cfg: ModelConfig, layer: int) -> bool:
    return cfg.is_moe_layer(layer) and _fs(cfg) > 0


TOP = (
    Param("embed", (Part("embed", "model.embed_tokens.weight",
                         lambda c: (c.vocab_size, _d(c))),), "vocab_rows"),
    Param("final_norm", (Part("final_norm", "model.norm.weight", lambda c: (_d(c),)),),
          "whole"),
    Param("lm_head", (Part("lm_head", "lm_head.weight", lambda c: (_d(c), c.vocab_size),
                           transposed=True),),
          "vocab_columns", when=lambda c, _: not c.tie_word_embeddings),
)


def _experts(family: str, router: str, gate: str, up: str, down: str) -> tuple[Param, ...]:
    """A family's MoE rows: router [D, E], experts' gate/up [E, 2F, D] and down
    [E, D, F], each expert [out, in] as HF stores it (HF names per expert, "{e}")."""
    when = _moe(family)
    return (
        Param("w_router", (Part("w_router", router, lambda c: (_d(c), c.moe.num_experts),
                                True),), "whole", when=when),
        Param("we_gate_up", (Part("we_gate", gate, lambda c: (_fe(c), _d(c))),
                             Part("we_up", up, lambda c: (_fe(c), _d(c)))),
              "expert_outputs", layout="gate_up_rows", when=when, experts=True),
        Param("we_down", (Part("we_down", down, lambda c: (_d(c), _fe(c))),),
              "expert_inputs", when=when, experts=True),
    )


def _gpt_oss_experts() -> tuple[Param, ...]:
    """gpt-oss's MoE rows: HF stores each kind for all experts in one tensor, [E, in,
    out], gate/up interleaved by column; router and experts have biases."""
    when = _moe("gpt_oss")
    return (
        Param("w_router", (Part("w_router", "mlp.router.weight",
                                lambda c: (_d(c), c.moe.num_experts), True),), "whole",
              when=when),
        Param("b_router", (Part("b_router", "mlp.router.bias",
                                lambda c: (c.moe.num_experts,)),), "whole", when=when),
        Param("we_gate_up", (Part("we_gate_up_interleaved", "mlp.experts.gate_up_proj",
                                  lambda c: (_d(c), 2 * _fe(c))),),
              "expert_outputs", layout="interleaved_gate_up", when=when, experts=True),
        Param("be_gate_up", (Part("be_gate_up_interleaved", "mlp.experts.gate_up_proj_bias",
                                  lambda c: (2 * _fe(c),)),),
              "expert_vectors", layout="interleaved_gate_up", when=when, experts=True),
        Param("we_down", (Part("we_down_transposed", "mlp.experts.down_proj",
                               lambda c: (_fe(c), _d(c))),),
              "expert_inputs", layout="experts_transposed", when=when, experts=True),
        # added once after the devices' shares are summed (model/moe.py): replicated
        Param("be_down", (Part("be_down", "mlp.experts.down_proj_bias", lambda c: (_d(c),)),),
              "whole", when=when, experts=True),
    )


LAYER = (
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
    # Llama's MLP input norm and Gemma's post-attention norm share HF's name.
    Param("mlp_norm", (Part("mlp_norm", "post_attention_layernorm.weight",
                            lambda c: (_d(c),)),), "whole", when=_llama_norms),
    Param("post_attn_norm", (Part("post_attn_norm", "post_attention_layernorm.weight",
                                  lambda c: (_d(c),)),), "whole", when=_post_norms),
    Param("mlp_norm", (Part("mlp_norm", "pre_feedforward_layernorm.weight",
                            lambda c: (_d(c),)),), "whole", when=_post_norms),
    Param("post_mlp_norm", (Part("post_mlp_norm", "post_feedforward_layernorm.weight",
                                 lambda c: (_d(c),)),), "whole", when=_post_norms),
    Param("w_gate_up", (Part("w_gate", "mlp.gate_proj.weight", lambda c: (_d(c), _f(c)), True),
                        Part("w_up", "mlp.up_proj.weight", lambda c: (_d(c), _f(c)), True)),
          "columns", layout="gate_up", quantized=True, when=_dense),
    Param("w_down", (Part("w_down", "mlp.down_proj.weight", lambda c: (_f(c), _d(c)), True),),
          "rows", quantized=True, when=_dense),
    *_experts("mixtral", "block_sparse_moe.gate.weight",
              "block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
              "block_sparse_moe.experts.{e}.w2.weight"),
    *_experts("qwen", "mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
              "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    *_gpt_oss_experts(),
    Param("ws_gate_up", (Part("ws_gate", "mlp.shared_expert.gate_proj.weight",
                              lambda c: (_d(c), _fs(c)), True),
                         Part("ws_up", "mlp.shared_expert.up_proj.weight",
                              lambda c: (_d(c), _fs(c)), True)),
          "columns", layout="gate_up", quantized=True, when=_shared),
    Param("ws_down", (Part("ws_down", "mlp.shared_expert.down_proj.weight",
                           lambda c: (_fs(c), _d(c)), True),),
          "rows", quantized=True, when=_shared),
    Param("w_shared_gate", (Part("w_shared_gate", "mlp.shared_expert_gate.weight",
                                 lambda c: (_d(c), 1), True),), "whole", when=_shared),
)

QUANTIZED = tuple(dict.fromkeys(p.key for p in LAYER if p.quantized))  # linear weights
EXPERTS = tuple(dict.fromkeys(p.key for p in LAYER if p.experts  # stacked [E, O, I]
                              and p.split in ("expert_outputs", "expert_inputs")))


def top_params(cfg: ModelConfig) -> tuple[Param, ...]:
    """The rows of the leaves outside the layers that `cfg`'s model has."""
    return tuple(p for p in TOP if p.when(cfg, -1))


def layer_params(cfg: ModelConfig, layer: int) -> tuple[Param, ...]:
    """The rows of the leaves layer `layer` of `cfg`'s model has."""
    return tuple(p for p in LAYER if p.when(cfg, layer))


def param_shapes(cfg: ModelConfig) -> dict:
    """The shape of every parameter, in the params pytree structure (fused)."""
    return _tree(cfg, lambda p: p.shape(cfg))


def param_partition_specs(cfg: ModelConfig, tensor_parallel_size: int = 1) -> dict:
    """The PartitionSpec of every parameter over the mesh's model axis."""
    return _tree(cfg, lambda p: p.spec(cfg, tensor_parallel_size))


def hf_layer_shapes(cfg: ModelConfig, layer: int = 0) -> dict[str, Shape]:
    """One layer's parameters with fused leaves apart (q/k/v, gate/up), experts stacked."""
    return {part.key: p.part_shape(part, cfg) for p in layer_params(cfg, layer)
            for part in p.parts}


def _tree(cfg: ModelConfig, value: Callable[[Param], object]) -> dict:
    tree = {p.key: value(p) for p in top_params(cfg)}
    tree["layers"] = [{p.key: value(p) for p in layer_params(cfg, i)}
                      for i in range(cfg.num_layers)]
    return tree
