"""`LoRARequest`: which adapter a request runs with (vLLM's class and fields). Plain
Python. See docs/lora.md#the-python-api.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a unique positive id (the engine's key for it: its slot, its
    prefix-cache pages) and the directory of its PEFT files."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} must be a non-empty string")
        value = self.lora_int_id
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"lora_int_id={value!r} must be an int >= 1")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path={self.lora_path!r} must name the adapter's "
                             "directory")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
