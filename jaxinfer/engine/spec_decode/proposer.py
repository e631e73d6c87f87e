"""Speculative proposals, the draft tokens a step verifies: `NgramProposer` (prompt
lookup), `DraftProposer` (a draft model's runner over the target's page ids) and
`HeadProposer` (EAGLE / Medusa heads on the target's features). The model proposers
follow each request lazily and track how far their drafter's K/V are valid
(`_DrafterProgress`). Plain Python, no jax. See docs/speculative_decoding.md#proposers.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from jaxinfer.engine.core.scheduler import ScheduledChunk
from jaxinfer.engine.request import Request


class NgramProposer:
    """Prompt lookup over each request's own tokens."""

    method = "ngram"

    def __init__(self, *, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= {min_n=} <= {max_n=}")
        self.sizes = tuple(range(max_n, min_n - 1, -1))  # longest first
        self._indexes: weakref.WeakKeyDictionary[Request, _NgramIndex] = (
            weakref.WeakKeyDictionary())

    def propose(self, request: Request, count: int) -> list[int]:
        """Up to `count` tokens to follow `request`'s tokens; [] when nothing matches."""
        if count <= 0:
            return []
        index = self._indexes.get(request)
        if index is None:
            index = self._indexes[request] = _NgramIndex(self.sizes)
        tokens = request.all_token_ids
        index.extend(tokens)
        return index.lookup(tokens, count)


class _NgramIndex:
    """n-gram -> latest start among those followed by at least one more token."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(sizes)
        self.starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = dict.fromkeys(sizes, 0)  # n -> starts indexed so far

    def extend(self, tokens: Sequence[int]) -> None:
        for n in self.sizes:
            table, end = self.starts[n], len(tokens) - n  # starts j with j + n < len
            for j in range(self.indexed[n], end):
                table[tuple(tokens[j:j + n])] = j
            self.indexed[n] = max(self.indexed[n], end)

    def lookup(self, tokens: list[int], count: int) -> list[int]:
        for n in self.sizes:
            if len(tokens) <= n:
                continue
            start = self.starts[n].get(tuple(tokens[-n:]))
            if start is not None:
                return _copy_after(tokens, start + n, count)
        return []


def _copy_after(tokens: list[int], first: int, count: int) -> list[int]:
    """`count` tokens from position `first` on, continuing over the copied ones once the
    copy reaches the end (first < len(tokens))."""
    out: list[int] = []
    length = len(tokens)
    for i in range(count):
        at = first + i
        out.append(tokens[at] if at < length else out[at - length])
    return out


class _DrafterProgress:
    """How far each request's drafter K/V are valid (tokens of a draft model, positions
    of heads: the subclass says), forgotten when the request is preempted."""

    def __init__(self) -> None:
        # Request -> (its preemption count then, the count)
        self._computed: weakref.WeakKeyDictionary[Request, tuple[int, int]] = (
            weakref.WeakKeyDictionary())

    def computed(self, request: Request) -> int:
        """The count recorded for `request`; 0 when it has none or was preempted since."""
        preemptions, count = self._computed.get(request, (-1, 0))
        return count if preemptions == request.num_preemptions else 0

    def _record(self, request: Request, count: int) -> None:
        self._computed[request] = (request.num_preemptions, count)


class DraftProposer(_DrafterProgress):
    """A draft model's proposals; the device work is its runner's (`DraftRunner`).
    `computed(request)`: the tokens of `request` whose draft K/V are valid."""

    method = "draft_model"

    def __init__(self, runner: object) -> None:
        super().__init__()
        self.runner = runner  # engine/runner/draft.DraftRunner

    def propose(self, chunks: Sequence[ScheduledChunk], counts: Sequence[int]
                ) -> tuple[list[list[int]], object]:
        """Up to `counts[i]` drafts after each decode chunk's token; returns (drafts, the
        draft probabilities f32[S, k_max + 1, V] on device, for the verify step)."""
        requests = [c.request for c in chunks]
        behind = [(r, self.computed(r)) for r in requests]
        self.runner.catch_up([(r, done) for r, done in behind if done < r.num_tokens - 1])
        num_steps = max(counts) + 1
        tokens, probs = self.runner.propose(requests, num_steps)
        for request in requests:  # valid up to the last token + drafts until verified
            self._record(request, request.num_tokens - 1)
        return [list(row[:count]) for row, count in zip(tokens, counts, strict=True)], probs

    def verified(self, chunks: Sequence[ScheduledChunk]) -> None:
        """After the target's update: the draft's K/V hold up to the accepted tokens."""
        for chunk in chunks:
            request = chunk.request
            if not request.finished:
                self._record(request, request.num_computed_tokens)


class HeadProposer(_DrafterProgress):
    """EAGLE or Medusa proposals; the device work is its runner's (`HeadRunner`).
    `computed(request)`: the positions of `request` whose drafter K/V are valid."""

    def __init__(self, runner: object, method: str) -> None:
        super().__init__()
        self.runner = runner  # engine/runner/heads.HeadRunner
        self.method = method

    def propose(self, chunks: Sequence[ScheduledChunk], counts: Sequence[int]
                ) -> tuple[list[list[int]], object]:
        """Up to `counts[i]` drafts after each decode chunk's token; returns (drafts, their
        probabilities f32[S, k_max + 1, V] on device, for the verify step)."""
        requests = [c.request for c in chunks]
        tokens, probs = self.runner.propose(requests, max(counts),
                                            [self.computed(r) for r in requests])
        for request in requests:  # the first proposal step wrote the one before the last
            self._record(request, request.num_tokens - 1)
        return [list(row[:count]) for row, count in zip(tokens, counts, strict=True)], probs

    def verified(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Nothing to do: the verified positions' features are in the target's store, and
        the next proposal's first step reads them."""
