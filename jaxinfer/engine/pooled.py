"""A pooling model's requests in the paged engine: each prompt chunk's pooled hidden
states (first token, last token, sum: runner/results.py `ChunkPools`) gathered per
request as steps read them back, so a prompt chunked across steps pools as one. Imports
no numpy: the arrays are only kept and added. See docs/pooling.md#decoder-models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class PromptPools:
    """One request's chunks so far: (start, length, pools) by start. A chunk computed
    again (after a preemption) replaces those from its start on."""

    prompt_len: int
    chunks: list[tuple[int, int, object]] = dataclasses.field(default_factory=list)

    def add(self, start: int, length: int, pools: object) -> None:
        self.chunks = [c for c in self.chunks if c[0] < start] + [(start, length, pools)]

    @property
    def covered(self) -> int:
        """Prompt tokens pooled: a prefix-cache hit's tokens are never computed here."""
        return sum(length for _, length, _ in self.chunks)

    def first(self) -> object:
        """f32[D]: the prompt's first token (needs the whole prompt computed)."""
        return self.chunks[0][2].first

    def last(self) -> object:
        """f32[D]: its last token, from the chunk that reached the prompt's end."""
        return self.chunks[-1][2].last

    def total(self) -> object:
        """f32[D]: the sum over every prompt token."""
        total = self.chunks[0][2].total
        for _, _, pools in self.chunks[1:]:
            total = total + pools.total
        return total

    def scores(self) -> object:
        """f32[num_labels]: the score head on the last token."""
        return self.chunks[-1][2].scores


class PoolBook:
    """Every pooling request's `PromptPools`, by request id."""

    def __init__(self) -> None:
        self._pools: dict[str, PromptPools] = {}

    def record(self, chunks: Sequence, pooled: Sequence) -> None:
        """A step's chunks and their ChunkPools (prompt positions only: a pooling
        request has nothing after its prompt)."""
        for chunk, pools in zip(chunks, pooled, strict=True):
            request = chunk.request
            prompt_len = len(request.prompt_token_ids)
            length = min(chunk.num_tokens, prompt_len - chunk.start)
            if length <= 0:
                continue
            entry = self._pools.setdefault(request.request_id, PromptPools(prompt_len))
            entry.add(chunk.start, length, pools)

    def pop(self, request_id: str) -> PromptPools | None:
        return self._pools.pop(request_id, None)
