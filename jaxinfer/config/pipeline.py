"""What pipeline parallelism (`pipeline_parallel_size` > 1) runs with, checked on the
engine's settings alone; the model's own checks are model/pipeline.py's. See
docs/parallelism.md#pipeline-parallelism.
"""

from __future__ import annotations

from typing import Any

# settings a pipelined step does not carry yet, each with the reason given to the user
NOT_PIPELINED = {
    "speculative_config": "speculative decoding's verify and draft steps are not "
                          "pipelined",
    "enable_lora": "the LoRA adapter slots are not split by stage",
    "batch_invariant": "batch_invariant=True runs each replica on one device",
    "enable_prompt_logprobs": "the scoring step (prompt logprobs) is not pipelined",
}


def check_settings(config: Any) -> None:
    """ValueError naming the field unless `config` (an EngineConfig) can run its layers
    in `pipeline_parallel_size` stages."""
    microbatches = config.pipeline_microbatches
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) \
            or microbatches < 0:
        raise ValueError(f"pipeline_microbatches={microbatches!r} must be an int >= 0 "
                         "(0: one per stage)")
    if config.pipeline_parallel_size == 1:
        return
    for name, why in NOT_PIPELINED.items():
        if getattr(config, name):
            raise ValueError(f"pipeline_parallel_size={config.pipeline_parallel_size} with "
                             f"{name}={getattr(config, name)!r}: not supported ({why})")
    if config.quantization == "int4":
        raise ValueError(f"pipeline_parallel_size={config.pipeline_parallel_size} with "
                         "quantization='int4': not supported (its activation-aware scales "
                         "are calibrated at load over every layer at once; serve an AWQ or "
                         "GPTQ checkpoint, or int8)")
    if config.runner == "pooling":
        raise ValueError(f"pipeline_parallel_size={config.pipeline_parallel_size} with "
                         "runner='pooling': not supported (pooling steps are not "
                         "pipelined)")


def stage_sizes(num_layers: int, stages: int) -> tuple[int, ...]:
    """Layers of each of `stages` pipeline stages, in order: num_layers // stages each,
    and one more for each of the remainder's stages just before the last (vLLM's rule:
    the last stage also holds the LM head)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"pipeline_parallel_size={stages} must be in [1, {num_layers}] "
                         f"(the model's layers)")
    base, extra = divmod(num_layers, stages)
    sizes = [base] * stages
    for offset in range(2, extra + 2):
        sizes[-offset] += 1
    return tuple(sizes)


def stage_starts(num_layers: int, stages: int) -> tuple[int, ...]:
    """The first layer of each stage."""
    sizes = stage_sizes(num_layers, stages)
    return tuple(sum(sizes[:stage]) for stage in range(stages))


def slots_per_stage(num_layers: int, stages: int) -> int:
    """Layer slots every stage holds: its largest stage's layers (the others hold a zero
    slot in place of the missing one, so all stages run one program)."""
    return max(stage_sizes(num_layers, stages))


def slot_layers(num_layers: int, stages: int, slot: int) -> tuple[int, ...]:
    """The layers slot `slot` holds on each stage that has that many layers."""
    sizes, starts = stage_sizes(num_layers, stages), stage_starts(num_layers, stages)
    return tuple(start + slot for start, size in zip(starts, sizes, strict=True)
                 if slot < size)


def check_model(cfg: Any, stages: int) -> None:
    """ValueError unless `cfg`'s layers split into `stages` stages that run one program:
    the layers in each slot alike (attention window, RoPE, experts or MLP)."""
    if stages == 1:
        return
    for slot in range(slots_per_stage(cfg.num_layers, stages)):
        layers = slot_layers(cfg.num_layers, stages, slot)
        kinds = {(cfg.layer_window(i), cfg.layer_rope(i), cfg.is_moe_layer(i))
                 for i in layers}
        if len(kinds) > 1:
            raise ValueError(
                f"pipeline_parallel_size={stages}: layers {list(layers)} take slot {slot} "
                f"of their stages but differ (attention window, RoPE or experts); every "
                "stage runs one program, so choose a pipeline_parallel_size whose stages "
                "start at the same point of the model's layer pattern")
