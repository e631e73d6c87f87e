"""Which data-parallel replica a request goes to (`Router`, `load_balance_method`,
SGLang's name): `cache_aware` (the default: the replica remembering the longest run of
the prompt's leading pages, unless it is loaded `balance_threshold` completions beyond
the least loaded), `round_robin` or `shortest_queue`. Plain Python.
See docs/parallelism.md#data-parallelism ("Routing").
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from collections.abc import Sequence

from jaxinfer.config.engine import LOAD_BALANCE_METHODS


def page_chain(token_ids: Sequence[int], page_size: int) -> list[bytes]:
    """One digest per full leading page, each covering every token before it too."""
    digests, digest = [], hashlib.blake2b(digest_size=16)
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        digest.update(b"".join(int(t).to_bytes(4, "little")
                               for t in token_ids[start:start + page_size]))
        digests.append(digest.copy().digest())
    return digests


class Router:
    """Picks a replica for each request; `method` is one of LOAD_BALANCE_METHODS."""

    def __init__(self, num_replicas: int, *, page_size: int, method: str = "cache_aware",
                 balance_threshold: int = 32, max_pages: int = 1 << 16) -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load_balance_method={method!r} must be one of "
                             f"{LOAD_BALANCE_METHODS}")
        self.method = method
        self.page_size = page_size
        self.balance_threshold = balance_threshold
        self.max_pages = max_pages  # remembered per replica
        self._seen = [collections.OrderedDict() for _ in range(num_replicas)]
        self._turn = itertools.cycle(range(num_replicas))

    def pick(self, token_ids: Sequence[int], loads: Sequence[int]) -> int:
        """The replica for a prompt, given each replica's load now."""
        if self.method == "round_robin":
            return next(self._turn)
        least = min(range(len(loads)), key=loads.__getitem__)
        if self.method == "shortest_queue":
            return least
        chain = page_chain(token_ids, self.page_size)
        matches = [self._matched(seen, chain) for seen in self._seen]
        best = max(range(len(loads)), key=lambda r: (matches[r], -loads[r], -r))
        chosen = best if matches[best] and (
            loads[best] - loads[least] <= self.balance_threshold) else least
        self._remember(chosen, chain)
        return chosen

    def matched_pages(self, token_ids: Sequence[int]) -> list[int]:
        """Leading pages of `token_ids` each replica remembers."""
        chain = page_chain(token_ids, self.page_size)
        return [self._matched(seen, chain) for seen in self._seen]

    @staticmethod
    def _matched(seen: collections.OrderedDict, chain: list[bytes]) -> int:
        count = 0
        for digest in chain:
            if digest not in seen:
                break
            count += 1
        return count

    def _remember(self, replica: int, chain: list[bytes]) -> None:
        seen = self._seen[replica]
        for digest in chain:
            seen[digest] = None
            seen.move_to_end(digest)
        while len(seen) > self.max_pages:
            seen.popitem(last=False)
