"""The rows of the parameter table: `Param` (one kind of params leaf) made of `Part`s (the
HF tensors it is read from), plain data a family module declares. Standard library only;
model/params_table.py holds the shared rows and derives everything else from them. See
docs/moe.md#parameters-one-table and docs/architecture.md#model-families.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.config.model import ModelConfig

Shape = tuple[int, ...]
SPLITS = ("whole", "columns", "rows", "vector", "vocab_rows", "vocab_columns",
          "expert_outputs", "expert_inputs", "expert_vectors")
LAYOUTS = ("plain", "transposed", "qkv", "gate_up", "gate_up_rows", "interleaved_gate_up",
           "experts_transposed")  # checkpoint/shard_source.py reads them; gate_up_rows:
# gate and up fused along the rows of HF's [out, in] storage; interleaved_gate_up: one
# HF tensor of all experts [E, in, 2F] (or biases [E, 2F]) whose even columns are gate,
# odd up, read into the blocks of gate_up_rows; experts_transposed: one HF tensor of
# all experts [E, in, out] read as [E, out, in]
SWAPPED = ("interleaved_gate_up", "experts_transposed")  # HF [E, in, out], ours [E, out, in]


@dataclasses.dataclass(frozen=True)
class Part:
    """One HF tensor of a leaf."""

    key: str  # our unfused name: "wq"
    hf: str  # HF name, under "model.layers.{i}." for a layer parameter; "{e}": an expert's
    shape: Callable[[ModelConfig], Shape]  # as params hold it ([in, out] for a weight),
    # one expert's for an experts leaf
    transposed: bool = False  # HF stores it [out, in]


def _always(cfg: ModelConfig, layer: int) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Param:
    """One kind of params leaf."""

    key: str
    parts: tuple[Part, ...]
    split: str  # one of SPLITS
    layout: str = ""  # one of LAYOUTS; "" for one part: "plain" or "transposed"
    quantized: bool = False  # a layer's linear weight: int8/w8a8/fp8/int4 apply
    when: Callable[[ModelConfig, int], bool] = _always  # layer -1: outside the layers
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


def hidden(cfg: ModelConfig) -> int:
    return cfg.hidden_size


def expert_size(cfg: ModelConfig) -> int:
    """One expert's intermediate size."""
    return cfg.moe.intermediate_size


def moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.is_moe_layer(layer)


def expert_rows(router: str, gate: str, up: str, down: str) -> tuple[Param, ...]:
    """The MoE rows of a family that stores each expert's tensors apart (HF names with
    "{e}"): router [D, E], experts' gate/up [E, 2F, D] and down [E, D, F], each expert
    [out, in] as HF stores it."""
    return (
        Param("w_router", (Part("w_router", router, lambda c: (hidden(c), c.moe.num_experts),
                                True),), "whole", when=moe_layer),
        Param("we_gate_up", (Part("we_gate", gate, lambda c: (expert_size(c), hidden(c))),
                             Part("we_up", up, lambda c: (expert_size(c), hidden(c)))),
              "expert_outputs", layout="gate_up_rows", when=moe_layer, experts=True),
        Param("we_down", (Part("we_down", down, lambda c: (hidden(c), expert_size(c))),),
              "expert_inputs", when=moe_layer, experts=True),
    )
