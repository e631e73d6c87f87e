"""LoRA adapter slots as the engine holds them (vLLM's `max_loras`, `max_lora_rank`):
the shape the step is compiled for, carried in `ModelOptions.lora`. Standard library
only. See docs/lora.md.
"""

from __future__ import annotations

import dataclasses

LORA_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class LoraSlots:
    """`max_loras` adapters resident on the device at once, each of rank at most
    `max_rank` (smaller ranks padded with zeros), stored in `dtype`."""

    max_loras: int
    max_rank: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                label = "max_lora_rank" if name == "max_rank" else name
                raise ValueError(f"{label}={value!r} must be a positive int")
        if self.dtype not in LORA_DTYPES:
            raise ValueError(f"LoRA dtype {self.dtype!r} must be one of {LORA_DTYPES}")


def check_settings(enable_lora: bool, max_loras: int, max_lora_rank: int,
                   max_cpu_loras: int | None) -> None:
    """ValueError naming the field unless the engine's LoRA settings are valid (they are
    checked whether or not `enable_lora` is set, as vLLM does)."""
    LoraSlots(max_loras, max_lora_rank)
    if max_cpu_loras is not None:
        if not isinstance(max_cpu_loras, int) or isinstance(max_cpu_loras, bool):
            raise ValueError(f"max_cpu_loras={max_cpu_loras!r} must be an int or None")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras={max_cpu_loras} must be >= max_loras="
                             f"{max_loras} (adapters on the device are also held on the "
                             "host)")
    if not isinstance(enable_lora, bool):
        raise ValueError(f"enable_lora={enable_lora!r} must be a bool")
