"""LoRA adapters on the device: fixed slots per target projection (`init`, `write`),
and the step's batched delta, each token through its own slot's A and B (`bind` wraps a
layer's projections as `AdaptedWeight`s, which `layers.linear` computes). Slot -1 is
the base model. See docs/lora.md#on-the-device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxinfer.config import ModelConfig
from jaxinfer.config.lora import LoraSlots
from jaxinfer.model import fusion
from jaxinfer.model.params_table import MODEL_AXIS

ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
ROW_PARALLEL = ("o", "down")  # input split over devices; the others split their output
# the fused weight each target adds to, in the order of its parts
FUSED = {"wqkv": ("q", "k", "v"), "wo": ("o",), "w_gate_up": ("gate", "up"),
         "w_down": ("down",)}

Lora = list  # per layer: {target: {"a": [in, L, r], "b": [L, r, out]}}


def layer_targets(cfg: ModelConfig, index: int) -> tuple[str, ...]:
    """The projections of layer `index` an adapter may modify: attention's always, the
    MLP's in a dense layer (a mixture of experts' experts take no adapter here)."""
    return ATTENTION_TARGETS if cfg.is_moe_layer(index) else TARGETS


def target_dims(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) of a target projection of the served model `cfg`."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (d, q), "k": (d, kv), "v": (d, kv), "o": (q, d), "gate": (d, f),
            "up": (d, f), "down": (f, d)}[target]


def shapes(cfg: ModelConfig, slots: LoraSlots) -> Lora:
    """The slots' ShapeDtypeStructs, per layer and target."""
    dtype = jnp.dtype(slots.dtype)
    out = []
    for index in range(cfg.num_layers):
        layer = {}
        for target in layer_targets(cfg, index):
            fan_in, fan_out = target_dims(cfg, target)
            layer[target] = {
                "a": jax.ShapeDtypeStruct((fan_in, slots.max_loras, slots.max_rank), dtype),
                "b": jax.ShapeDtypeStruct((slots.max_loras, slots.max_rank, fan_out), dtype)}
        out.append(layer)
    return out


def init(cfg: ModelConfig, slots: LoraSlots) -> Lora:
    """Every slot empty (zeros)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes(cfg, slots))


def partition_specs(cfg: ModelConfig, slots: LoraSlots) -> Lora:
    """Each slot array split as the base weight it modifies: a column-parallel target's
    B by its output, a row-parallel one's A by its input (GSPMD sums the partial
    shrinks)."""
    def spec(target: str, part: str) -> P:
        if target in ROW_PARALLEL:
            return P(MODEL_AXIS, None, None) if part == "a" else P()
        return P(None, None, MODEL_AXIS) if part == "b" else P()

    return [{target: {part: spec(target, part) for part in ("a", "b")} for target in layer}
            for layer in shapes(cfg, slots)]


def slot_bytes(cfg: ModelConfig, slots: LoraSlots, shards: int = 1) -> int:
    """Bytes of all the slots on one of `shards` devices (`cfg`: the served model)."""
    leaves = jax.tree.leaves(shapes(cfg, slots))
    specs = jax.tree.leaves(partition_specs(cfg, slots), is_leaf=lambda x: isinstance(x, P))
    return sum(leaf.size * leaf.dtype.itemsize // (shards if MODEL_AXIS in spec else 1)
               for leaf, spec in zip(leaves, specs, strict=True))


def write(lora: Lora, slot: jax.Array, adapter: Lora) -> Lora:
    """`lora` with slot `slot` (i32 scalar) holding `adapter`: per layer and target
    {"a": [in, r], "b": [r, out]} at the slots' rank (zero-padded by the host)."""
    def put(table: dict, new: dict) -> dict:
        a = jax.lax.dynamic_update_slice(table["a"], new["a"][:, None].astype(
            table["a"].dtype), (0, slot, 0))
        b = jax.lax.dynamic_update_slice(table["b"], new["b"][None].astype(
            table["b"].dtype), (slot, 0, 0))
        return {"a": a, "b": b}

    return [{target: put(layer[target], new[target]) for target in layer}
            for layer, new in zip(lora, adapter, strict=True)]


@dataclasses.dataclass(frozen=True)
class AdaptedWeight:
    """A base weight [I, O] (float or quantized) plus each token's adapter delta: the
    parts' (A, B) slot tables, fused into O's layout by `fuse` (model/fusion.py)."""

    base: object
    parts: tuple[dict, ...]  # {"a": [I, L, r], "b": [L, r, O_part]} per fused part
    select: jax.Array  # f32[T, L]: 1 at each token's slot, all 0 for the base model
    fuse: Callable[..., jax.Array]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.base.dtype

    def delta(self, x: jax.Array) -> jax.Array:
        """f32[..., O]: x's tokens through their slots' adapters (scaling folded in B)."""
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        outs = [_part_delta(rows, part["a"], part["b"], self.select) for part in self.parts]
        return self.fuse(*outs).reshape(*lead, -1)


def _part_delta(x: jax.Array, a: jax.Array, b: jax.Array, select: jax.Array) -> jax.Array:
    """f32[T, O]: every slot's shrink x @ A in one matmul [I, L * r], kept only at each
    token's slot, then one expand matmul [L * r, O]. Cost per token L * r * (I + O):
    dense, no gather, one shape for any mix of adapters."""
    fan_in, num_slots, rank = a.shape
    shrunk = jnp.matmul(x.astype(a.dtype), a.reshape(fan_in, num_slots * rank),
                        preferred_element_type=jnp.float32)
    shrunk = shrunk.reshape(-1, num_slots, rank) * select[:, :, None]
    return jnp.matmul(shrunk.reshape(-1, num_slots * rank).astype(b.dtype),
                      b.reshape(num_slots * rank, -1), preferred_element_type=jnp.float32)


def token_select(adapters: jax.Array, max_loras: int) -> jax.Array:
    """f32[T, L]: one-hot rows of each token's slot (-1, the base model: all zeros)."""
    return (adapters[:, None] == jnp.arange(max_loras)[None, :]).astype(jnp.float32)


def bind(layer: dict, lora_layer: dict, select: jax.Array, cfg: ModelConfig) -> dict:
    """The layer with each projection that has adapter slots wrapped as an
    AdaptedWeight (`cfg`: the served model, whose KV heads the fused q/k/v groups)."""
    fusers = {"wqkv": lambda q, k, v: fusion.fuse_qkv(q, k, v, cfg),
              "w_gate_up": fusion.fuse_gate_up}
    out = dict(layer)
    for key, targets in FUSED.items():
        if key in layer and all(t in lora_layer for t in targets):
            out[key] = AdaptedWeight(layer[key], tuple(lora_layer[t] for t in targets),
                                     select, fusers.get(key, _single))
    return out


def _single(x: jax.Array) -> jax.Array:
    return x
