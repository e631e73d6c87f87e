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
    first out when full. Slots read by queued restores are reused only once the queue
    has been taken (`take_transfers`), so a batch never reads a slot it also writes."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"{num_slots=} must be >= 1")
        self.num_slots = num_slots
        self._free: collections.deque[int] = collections.deque(range(num_slots))
        self._held: collections.OrderedDict[int, tuple[CachedPage, int]] = (
            collections.OrderedDict())  # hash -> (entry, slot), least recent first
        self._queue: list[Transfer] = []
        self._releasing: list[int] = []  # slots of queued restores
        self.stats = dict.fromkeys(("pages_offloaded", "pages_restored", "evictions",
                                    "dropped"), 0)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def put(self, entry: CachedPage) -> None:
        """Keep `entry` (its page about to be reused on the device): queue its offload
        into a slot, the least recently used entry's if none is free."""
        if entry.hash in self._held:  # a first page computed again: the same K/V
            self._held[entry.hash] = (entry, self._held[entry.hash][1])
            self._held.move_to_end(entry.hash)
            return
        if not self._free:
            if not self._held:
                self.stats["dropped"] += 1
                return  # every slot is being read by a queued restore
            _, (_, slot) = self._held.popitem(last=False)
            self._free.append(slot)
            self.stats["evictions"] += 1
        slot = self._free.popleft()
        self._held[entry.hash] = (entry, slot)
        self._queue.append(Transfer(OFFLOAD, entry.page, slot))
        self.stats["pages_offloaded"] += 1

    def get(self, key: int) -> CachedPage | None:
        """The entry held under hash `key` (unverified), or None."""
        held = self._held.get(key)
        return None if held is None else held[0]

    def drop(self, key: int) -> None:
        """Forget the page held under hash `key` (the device holds it again)."""
        _, slot = self._held.pop(key)
        self._free.append(slot)

    def restore(self, entry: CachedPage, page: int) -> None:
        """Queue `entry`'s copy into device `page`; it leaves this tier (the device's
        registration now holds it)."""
        _, slot = self._held.pop(entry.hash)
        self._queue.append(Transfer(RESTORE, page, slot))
        self._releasing.append(slot)
        self.stats["pages_restored"] += 1

    def take_transfers(self) -> tuple[Transfer, ...]:
        """The copies queued since the last call, in order; their slots free again."""
        queue, self._queue = tuple(self._queue), []
        self._free.extend(self._releasing)
        self._releasing = []
        return queue

    def clear(self) -> int:
        """Forget every held page (their KV came from weights since replaced); returns
        how many. Queued copies still run."""
        count = len(self._held)
        self._free.extend(slot for _, slot in self._held.values())
        self._held.clear()
        return count
