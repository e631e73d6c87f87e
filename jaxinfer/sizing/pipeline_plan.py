"""Pipeline parallelism in the plan: the layer slots every stage holds (config/pipeline.py's
rule, vLLM's), one device's share of per-layer figures over them, the microbatches and
bubble of a step, and the bytes a step hands from stage to stage (model/pipeline.py).
See docs/cli.md#choosing-a-pp-x-tp-x-dp-layout.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.config import ModelConfig
from jaxinfer.config import pipeline as rules
from jaxinfer.sizing.page_groups import group_layers

ACTIVATION_BYTES = 4  # the stages hand on float32 [tokens, hidden] rows


def check(cfg: ModelConfig, pp: int) -> None:
    """ValueError naming the numbers unless `cfg`'s layers split into `pp` stages that
    run one program: 1 <= pp <= layers, and the layers in each slot alike."""
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise ValueError(f"pipeline_parallel_size={pp!r} must be a positive int")
    rules.stage_sizes(cfg.num_layers, pp)
    rules.check_model(cfg, pp)


def check_plan(cfg: ModelConfig, pp: int, *, beside: bool, hybrid: bool, page_size: int,
               max_model_len: int) -> None:
    """`check`, and for pp > 1 what the memory plan holds beside the model: no drafter or
    LoRA slots (`beside`), one KV page group (model/pipeline.py stacks every slot's pages
    alike). ValueError naming the numbers."""
    check(cfg, pp)
    if pp == 1:
        return
    if beside:
        raise ValueError(f"pipeline_parallel_size={pp} with a speculative drafter or LoRA "
                         "adapter slots: not pipelined")
    groups = group_layers(cfg, page_size, max_model_len, hybrid)
    if len(groups) > 1:
        raise ValueError(
            f"pipeline_parallel_size={pp} with {groups[1].num_layers} sliding-window layers "
            f"of {cfg.num_layers} in their own page group: not planned by stage; give "
            "disable_hybrid_kv_cache_manager=True (one group of every layer's pages)")


def layer_slots(cfg: ModelConfig, pp: int) -> int:
    """Layer slots on every stage: ceil(layers / pp) (a stage with fewer layers holds a
    zero slot of a whole layer's size)."""
    return rules.slots_per_stage(cfg.num_layers, pp)


def slot_layers(cfg: ModelConfig, pp: int) -> tuple[int, ...]:
    """One layer of each slot, whose shapes the slot has (check: a slot's layers are
    alike); at pp = 1 every layer."""
    check(cfg, pp)
    return tuple(rules.slot_layers(cfg.num_layers, pp, slot)[0]
                 for slot in range(layer_slots(cfg, pp)))


def stage_sum(cfg: ModelConfig, pp: int, per_layer: Sequence[int]) -> int:
    """A per-layer figure (bytes, FLOPs, one entry per layer) summed over the slots one
    stage holds: each slot counts as its layers do, padding slots included."""
    return sum(per_layer[layer] for layer in slot_layers(cfg, pp))


def microbatches(tokens: int, pp: int, wanted: int = 0) -> int:
    """Microbatches a step of `tokens` runs in: `wanted` (0: one per stage), at most one a
    token; 1 without stages."""
    if pp == 1:
        return 1
    return max(1, min(wanted or pp, tokens))


def ticks(pp: int, m: int) -> int:
    """Ticks of a pipelined step of m microbatches over pp stages: m + pp - 1 (each
    stage runs its layers once a tick, bubbles included)."""
    return m + pp - 1


def bubble_fraction(pp: int, m: int) -> float:
    """The share of ticks a stage idles: (pp - 1) / (m + pp - 1)."""
    return (pp - 1) / ticks(pp, m)


def microbatch_bytes(cfg: ModelConfig, tokens: int, m: int) -> int:
    """One microbatch's activations, what a stage sends the next a tick: ceil(tokens / m)
    x hidden_size float32."""
    return -(-tokens // m) * cfg.hidden_size * ACTIVATION_BYTES


def stage_send_bytes(cfg: ModelConfig, tokens: int, pp: int, m: int) -> int:
    """What one stage boundary carries in a step, from each device of the sending stage
    to its peer: a microbatch every tick but the last (whose hand-on nobody reads), the
    bubbles' too; 0 without stages."""
    if pp == 1:
        return 0
    return (ticks(pp, m) - 1) * microbatch_bytes(cfg, tokens, m)


def broadcast_bytes(cfg: ModelConfig, rows: int, pp: int) -> int:
    """The last stage's sampled rows handed to every stage: rows x hidden x 4 on each of
    pp - 1 hops (last -> 0 -> 1 ...); 0 without stages."""
    return (pp - 1) * rows * cfg.hidden_size * ACTIVATION_BYTES


def broadcast_hops(pp: int) -> tuple[tuple[int, int], ...]:
    """(sender, receiver) stage of each hop handing the last stage's rows on, in order
    (model/pipeline.py `from_last_stage`)."""
    return tuple(((hop - 1) % pp, hop) for hop in range(pp - 1))
