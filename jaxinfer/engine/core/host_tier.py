"""The host tier of the prefix cache: full pages evicted from a device pool are kept in
host-memory slots (an LRU of their `CachedPage` entries), and a prefix hit on one
brings it back into a free device page. This half only decides; it queues the copies
(`Transfer`) that the runner makes before the step that needs them
(engine/runner/kv_offload.py). Plain Python. See docs/kv_cache.md#the-host-tier.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.engine.core.page_pool import CachedPage

OFFLOAD, RESTORE = "offload", "restore"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One page's copy: `offload` device page -> host slot (before the page is
    overwritten), or `restore` host slot -> device page (before a step reads it)."""

    kind: str
    page: int
    slot: int


def phases(transfers: Sequence[Transfer]) -> list[tuple[list[Transfer], list[Transfer]]]:
    """The queue as (offloads, restores) phases, each copied as two batches (offloads
    first): a phase ends where an offload reads a page that an earlier restore of the
    phase writes, so every page is read after what the queue wrote before."""
    out: list[tuple[list[Transfer], list[Transfer]]] = []
    offloads: list[Transfer] = []
    restores: list[Transfer] = []
    restored: set[int] = set()
    for transfer in transfers:
        if transfer.kind == OFFLOAD and transfer.page in restored:
            out.append((offloads, restores))
            offloads, restores, restored = [], [], set()
        if transfer.kind == OFFLOAD:
            offloads.append(transfer)
        else:
            restores.append(transfer)
            restored.add(transfer.page)
    if offloads or restores:
        out.append((offloads, restores))
    return out


class HostTier:
    """`num_slots` host pages, each holding one evicted full page; least recently used
    first out when full. A restored page stays here too, so evicting it again copies
    nothing. A slot read by a queued restore is not reused until the queue has been
    taken (`take_transfers`), so a batch never reads a slot it also writes."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"{num_slots=} must be >= 1")
        self.num_slots = num_slots
        self._free: collections.deque[int] = collections.deque(range(num_slots))
        self._held: collections.OrderedDict[int, tuple[CachedPage, int]] = (
            collections.OrderedDict())  # hash -> (entry, slot), least recent first
        self._queue: list[Transfer] = []
        self._reading: set[int] = set()  # slots of queued restores
        self._after_queue: list[int] = []  # slots freed while a queued restore reads them
        self.stats = dict.fromkeys(("pages_offloaded", "pages_restored", "evictions",
                                    "dropped", "copies_saved"), 0)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def put(self, entry: CachedPage) -> None:
        """Keep `entry` (its page about to be reused on the device): nothing to copy if
        this tier holds its content already; else queue its offload into a slot, the
        least recently used entry's if none is free."""
        held = self._held.get(entry.hash)
        if held is not None:
            if _same(held[0], entry):  # restored from here, or a first page computed again
                self._held[entry.hash] = (entry, held[1])
                self._held.move_to_end(entry.hash)
                self.stats["copies_saved"] += 1
            return  # else a hash collision: the first content stays
        slot = self._free_slot()
        if slot is None:
            self.stats["dropped"] += 1
            return
        self._held[entry.hash] = (entry, slot)
        self._queue.append(Transfer(OFFLOAD, entry.page, slot))
        self.stats["pages_offloaded"] += 1

    def _free_slot(self) -> int | None:
        """A free slot, else the least recently used one no queued restore reads."""
        if self._free:
            return self._free.popleft()
        for key, (_, slot) in self._held.items():
            if slot not in self._reading:
                del self._held[key]
                self.stats["evictions"] += 1
                return slot
        return None

    def get(self, key: int) -> CachedPage | None:
        """The entry held under hash `key` (unverified), or None."""
        held = self._held.get(key)
        return None if held is None else held[0]

    def restore(self, entry: CachedPage, page: int) -> None:
        """Queue `entry`'s copy into device `page` (its copy here stays, most recent)."""
        _, slot = self._held[entry.hash]
        self._held.move_to_end(entry.hash)
        self._queue.append(Transfer(RESTORE, page, slot))
        self._reading.add(slot)
        self.stats["pages_restored"] += 1

    def take_transfers(self) -> tuple[Transfer, ...]:
        """The copies queued since the last call, in order; their slots may be reused."""
        queue, self._queue = tuple(self._queue), []
        self._reading.clear()
        self._free.extend(self._after_queue)
        self._after_queue = []
        return queue

    def clear(self) -> int:
        """Forget every held page (their KV came from weights since replaced); returns
        how many. Queued copies still run, and the slots they read wait for them."""
        count = len(self._held)
        for _, slot in self._held.values():
            (self._after_queue if slot in self._reading else self._free).append(slot)
        self._held.clear()
        return count


def _same(held: CachedPage, entry: CachedPage) -> bool:
    return (held.parent, held.tokens, held.extra) == (entry.parent, entry.tokens,
                                                      entry.extra)
