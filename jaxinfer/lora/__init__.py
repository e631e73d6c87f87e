"""LoRA adapters, the host half: `LoRARequest` (vLLM's), reading PEFT adapters
(peft.py) and which adapter each device slot holds (slots.py); the device half is
model/lora.py. See docs/lora.md.
"""

from jaxinfer.lora.request import LoRARequest

__all__ = ["LoRARequest"]
