"""LoRA adapters as `Engine` methods (vLLM's add_lora, remove_lora, list_loras,
pin_lora) and the check of a request's `lora_request`; the slots are lora/slots.py's,
filled through the runner (runner/lora.py). Plain Python. See docs/lora.md.
"""

from __future__ import annotations

from jaxinfer.lora.request import LoRARequest
from jaxinfer.lora.slots import AdapterSlots


def make_slots(engine: object) -> AdapterSlots | None:
    """The engine's adapter slots; None without enable_lora."""
    device = engine.runner.adapters
    if device is None:
        return None
    return AdapterSlots(engine.config.max_loras, engine.config.max_cpu_loras,
                        read=device.read, write=device.write)


class AdapterControls:
    """Mixed into `Engine`."""

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter to the host (a bad one is refused now); False if loaded."""
        return self._adapters_or_raise("add_lora").add(_checked(lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        """Forget adapter `lora_id`; requests running with it finish with it."""
        return self._adapters_or_raise("remove_lora").remove(lora_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded (on the host, some also on the device)."""
        return {lora.lora_int_id for lora in self._adapters_or_raise("list_loras").loaded()}

    def pin_lora(self, lora_id: int) -> bool:
        """Never evict adapter `lora_id` from the host or, once placed, its slot."""
        return self._adapters_or_raise("pin_lora").pin(lora_id)

    def lora_counts(self) -> dict[str, int]:
        """Host loads and evictions, slot writes and swaps (those that replaced an
        adapter) so far; empty without enable_lora."""
        return dict(self.adapter_slots.counts) if self.adapter_slots else {}

    def adapter_of(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """A request's adapter, loaded to the host (ValueError naming `lora_request`
        when the engine serves none or the adapter cannot be read)."""
        if lora_request is None:
            return None
        self._adapters_or_raise("lora_request").add(_checked(lora_request))
        return lora_request

    def _adapters_or_raise(self, what: str) -> AdapterSlots:
        if self.adapter_slots is None:
            raise ValueError(f"{what}: this engine serves no LoRA adapters (start it with "
                             "enable_lora=True)")
        return self.adapter_slots


def _checked(lora_request: object) -> LoRARequest:
    if not isinstance(lora_request, LoRARequest):
        raise TypeError(f"lora_request is a {type(lora_request).__name__}, not LoRARequest")
    return lora_request
