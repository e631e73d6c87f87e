"""The responses kept for GET /v1/responses/{id} and `previous_response_id`: in memory,
bounded by a count, a total size and an age (--responses_store_max_entries,
--responses_store_max_bytes, --responses_store_ttl_s); the least recently used go first.
Only the event loop's thread touches it. See docs/serving.md#the-responses-api.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Entry:
    """A stored response and the conversation that led to it, its output included (the
    chat messages a continuation starts from; instructions are not carried over)."""

    response: dict[str, Any]
    conversation: list[dict]
    size: int  # bytes of both as JSON
    stored_at: float


class ResponseStore:
    """An LRU map of response ids to entries within `max_entries`, `max_bytes` and
    `ttl_s` seconds since an entry was stored."""

    def __init__(self, *, max_entries: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(self, response: dict[str, Any], conversation: list[dict]) -> bool:
        """Keep `response` (by its id); False when it alone is over `max_bytes` (not
        kept). Older entries leave to make room."""
        size = len(json.dumps([response, conversation], ensure_ascii=False).encode())
        self.delete(response["id"])
        if size > self.max_bytes:
            return False
        self._entries[response["id"]] = Entry(response, conversation, size, self._clock())
        self._bytes += size
        self._expire()
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> Entry | None:
        """The entry, now the most recently used; None if never stored, deleted, evicted
        or expired."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        if response_id not in self._entries:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        """Drop the entries older than `ttl_s` (the oldest-stored may sit anywhere in the
        LRU order, so every entry is looked at: the store is small)."""
        cutoff = self._clock() - self.ttl_s
        for response_id in [k for k, e in self._entries.items() if e.stored_at < cutoff]:
            self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        self._bytes -= self._entries.pop(response_id).size
