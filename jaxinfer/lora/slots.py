"""Which adapter each device slot holds (`AdapterSlots`): a request pins its adapter's
slot from admission until it finishes or is preempted; an adapter not resident takes a
free slot or the least recently used unpinned one, and waits (the request stays queued)
when every slot is pinned. Host copies are kept in an LRU of `max_cpu_loras`. Plain
Python: reading files and writing the device are the callables it is given.
See docs/lora.md#slots.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from jaxinfer.lora.request import LoRARequest


class AdapterSlots:
    """`max_loras` device slots and up to `max_cpu_loras` host copies of adapters."""

    def __init__(self, max_loras: int, max_cpu_loras: int | None, *,
                 read: Callable[[LoRARequest], object],
                 write: Callable[[int, object], None]) -> None:
        """`read(lora)`: the adapter's host copy (raises ValueError naming what is
        wrong); `write(slot, copy)`: put a host copy in a device slot."""
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras or max_loras
        self._read, self._write = read, write
        self._host: collections.OrderedDict[int, tuple[LoRARequest, object]] = \
            collections.OrderedDict()  # lora_int_id -> (request, host copy), LRU first
        self._held: list[int | None] = [None] * max_loras  # slot -> lora_int_id
        self._pins = [0] * max_loras
        self._recent: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._pinned_ids: set[int] = set()  # pin_lora: kept on the host and device
        self.counts = {"host_loads": 0, "host_evictions": 0, "slot_writes": 0,
                       "slot_swaps": 0}

    def add(self, lora: LoRARequest) -> bool:
        """Read the adapter to the host now (so a bad one fails at once, not in a step);
        False when it was there already. A different adapter under the same id or name
        is refused."""
        known = self._host.get(lora.lora_int_id)
        if known is not None:
            if known[0].lora_path != lora.lora_path or known[0].lora_name != lora.lora_name:
                raise ValueError(f"lora_int_id={lora.lora_int_id} is in use by adapter "
                                 f"{known[0].lora_name!r} ({known[0].lora_path})")
            self._host.move_to_end(lora.lora_int_id)
            return False
        same_name = [r for r, _ in self._host.values() if r.lora_name == lora.lora_name]
        if same_name:
            raise ValueError(f"lora_name={lora.lora_name!r} is in use by lora_int_id="
                             f"{same_name[0].lora_int_id}")
        copy = self._read(lora)
        self._host[lora.lora_int_id] = (lora, copy)
        self.counts["host_loads"] += 1
        self._evict_host(keep=lora.lora_int_id)
        return True

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter: its host copy, and its slot once no request holds it.
        False when it was not loaded."""
        if self._host.pop(lora_int_id, None) is None:
            return False
        self._pinned_ids.discard(lora_int_id)
        for slot, held in enumerate(self._held):
            if held == lora_int_id and not self._pins[slot]:
                self._held[slot] = None
                self._recent.pop(slot, None)
        return True

    def pin(self, lora_int_id: int) -> bool:
        """Keep the adapter on the host and in its slot once placed (vLLM's pin_lora)."""
        if lora_int_id not in self._host:
            return False
        self._pinned_ids.add(lora_int_id)
        return True

    def loaded(self) -> list[LoRARequest]:
        """The adapters held on the host, least recently used first."""
        return [lora for lora, _ in self._host.values()]

    def resident(self) -> dict[int, int]:
        """slot -> lora_int_id of the adapters on the device."""
        return {slot: held for slot, held in enumerate(self._held) if held is not None}

    def acquire(self, request: object) -> bool:
        """Give `request` (with `lora` set) a slot holding its adapter, pinned; False
        (nothing changed) when every slot is pinned by other adapters' requests."""
        lora = request.lora
        if request.adapter_slot >= 0:
            return True
        self.add(lora)  # a host copy evicted since it was added is read again
        slot = self._slot_of(lora.lora_int_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._place(slot, lora.lora_int_id)
        self._pins[slot] += 1
        self._recent.pop(slot, None)
        self._recent[slot] = None
        request.adapter_slot = slot
        return True

    def release(self, request: object) -> None:
        """Unpin the request's slot, if it holds one (idempotent)."""
        slot = request.adapter_slot
        if slot < 0:
            return
        request.adapter_slot = -1
        self._pins[slot] -= 1
        if not self._pins[slot] and self._held[slot] not in self._host:
            self._held[slot] = None  # removed while in use: free now
            self._recent.pop(slot, None)

    def _slot_of(self, lora_int_id: int) -> int | None:
        for slot, held in enumerate(self._held):
            if held == lora_int_id:
                return slot
        return None

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used unpinned one (not pin_lora's)."""
        for slot, held in enumerate(self._held):
            if held is None:
                return slot
        for slot in self._recent:
            if not self._pins[slot] and self._held[slot] not in self._pinned_ids:
                return slot
        return None

    def _place(self, slot: int, lora_int_id: int) -> None:
        self._host.move_to_end(lora_int_id)
        self._write(slot, self._host[lora_int_id][1])
        self.counts["slot_writes"] += 1
        self.counts["slot_swaps"] += self._held[slot] is not None
        self._held[slot] = lora_int_id

    def _evict_host(self, keep: int) -> None:
        """Drop least recently used host copies beyond max_cpu_loras, never `keep` (just
        read), one on the device or a pinned one (the host may then hold more until they
        leave)."""
        on_device = set(self._held) | {keep}
        for lora_int_id in list(self._host):
            if len(self._host) <= self.max_cpu_loras:
                return
            if lora_int_id not in on_device and lora_int_id not in self._pinned_ids:
                del self._host[lora_int_id]
                self.counts["host_evictions"] += 1
