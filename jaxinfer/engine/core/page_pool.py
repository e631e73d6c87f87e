"""The page allocator: a fixed pool of KV page ids with reference counts, the trash page
0, and the prefix cache (a verified hash chain over full pages, unused ones kept in an
LRU, evicted ones kept in the host tier when there is one). Plain Python. See
docs/sampling.md#prefix-caching and docs/kv_cache.md (#the-host-tier).
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
from collections.abc import Callable, Hashable, Sequence

from jaxinfer.engine.core.host_tier import HostTier

TRASH_PAGE = 0
ROOT = 0  # the parent serial of a request's first page


def page_hash(parent: int, tokens: tuple[int, ...], extra: Hashable) -> int:
    """The hash of a full page in its chain, the same in every process (hosts of a
    multi-host job run one schedule): a blake2b digest of the parent's serial, the token
    ids and the extra key's repr. Python's hash() differs between processes (of None,
    str and bytes, which are salted)."""
    digest = hashlib.blake2b(parent.to_bytes(8, "little", signed=True), digest_size=8)
    digest.update(array.array("q", tokens).tobytes())
    digest.update(repr(extra).encode())
    return int.from_bytes(digest.digest(), "little")


@dataclasses.dataclass(frozen=True)
class CachedPage:
    """What a registered page holds, to verify a hit."""

    hash: int
    page: int
    serial: int  # unique per registration; children name their parent by it
    parent: int  # the parent's serial, ROOT for a first page
    tokens: tuple[int, ...]
    extra: Hashable


class PagePool:
    """Hands out page ids 1..num_pages-1, takes them back, and caches full pages."""

    def __init__(self, num_pages: int, *, enable_caching: bool = False,
                 hash_fn: Callable[[int, tuple[int, ...], Hashable], int] = page_hash,
                 host: HostTier | None = None) -> None:
        """`host`: the host tier evicted cached pages go to (None: they are dropped)."""
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the trash page)")
        self.num_pages = num_pages
        self.enable_caching = enable_caching
        self.hash_fn = hash_fn
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._refs = [0] * num_pages
        self._by_hash: dict[int, int] = {}  # hash -> page
        self._cached: dict[int, CachedPage] = {}  # page -> what it holds
        self._children: dict[tuple[int, int], set[int]] = {}  # (parent, first token) -> pages
        self._serials = 0
        self.num_evictions = 0
        self.host = host if enable_caching else None

    @property
    def num_free(self) -> int:
        """Pages that can be handed out (free, or cached with no owner)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh pages with refcount 1, or None (nothing taken) if too few.
        Uncached free pages go first, then the least recently used cached ones."""
        if count > self.num_free:
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)
                entry = self._forget(page)
                if self.host is not None:
                    self.host.put(entry)
                self.num_evictions += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def share(self, pages: Sequence[int]) -> None:
        """One more owner for each page (a cached page with none leaves the LRU)."""
        for page in pages:
            if self._refs[page] <= 0 and page not in self._evictable:
                raise ValueError(f"page {page} is free; it cannot be shared")
            self._evictable.pop(page, None)
            self._refs[page] += 1

    def free(self, pages: Sequence[int]) -> None:
        """Drop one owner of each page; a page left with none is cached (most recently
        used end of the LRU) if registered, else free."""
        for page in pages:
            if page == TRASH_PAGE or self._refs[page] <= 0:
                raise ValueError(f"page {page} is not allocated")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._cached:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    # ---- the prefix cache -------------------------------------------------------------

    def register(self, page: int, parent: int, tokens: Sequence[int],
                 extra: Hashable = None) -> int:
        """Record that `page` (in use, full) holds `tokens` after the page with serial
        `parent`. Returns the serial that names this content: the page's new one, or
        the one of a page already cached with the same content (then `page` stays
        uncached)."""
        if self._refs[page] <= 0:
            raise ValueError(f"page {page} is not allocated; it cannot be registered")
        tokens = tuple(tokens)
        key = self.hash_fn(parent, tokens, extra)
        holder = self._by_hash.get(key)
        if holder is not None:
            known = self._cached[holder]
            if (known.parent, known.tokens, known.extra) == (parent, tokens, extra):
                return known.serial
            return self._serial()  # a collision: keep the first; this content is uncached
        if page in self._cached:
            raise ValueError(f"page {page} is already registered")
        held = self.host and self.host.get(key)
        serial = self._serial()
        if held and (held.parent, held.tokens, held.extra) == (parent, tokens, extra):
            serial = held.serial  # computed again: named as the host's copy, so that its
            # children there chain to it
        return self._add(CachedPage(key, page, serial, parent, tokens, extra))

    def _add(self, entry: CachedPage) -> int:
        self._by_hash[entry.hash] = entry.page
        self._cached[entry.page] = entry
        self._children.setdefault((entry.parent, entry.tokens[0]), set()).add(entry.page)
        return entry.serial

    def lookup(self, parent: int, tokens: Sequence[int], extra: Hashable = None
               ) -> CachedPage | None:
        """The cached page holding exactly `tokens` after `parent`, verified; or None."""
        key = self.hash_fn(parent, tuple(tokens), extra)
        page = self._by_hash.get(key)
        return None if page is None else _verified(self._cached[page], parent, tokens, extra)

    def lookup_host(self, parent: int, tokens: Sequence[int], extra: Hashable = None
                    ) -> CachedPage | None:
        """The host tier's entry holding exactly `tokens` after `parent`, verified (its
        `page` is the device page it was evicted from); or None."""
        if self.host is None:
            return None
        entry = self.host.get(self.hash_fn(parent, tuple(tokens), extra))
        return None if entry is None else _verified(entry, parent, tokens, extra)

    def restore(self, entry: CachedPage) -> int | None:
        """A device page (refcount 1) that will hold the host tier's `entry`, registered
        under its serial, its copy queued; or None (nothing taken) if none is free."""
        pages = self.allocate(1)
        if pages is None:
            return None
        if self.host.get(entry.hash) is None:  # the allocation evicted it
            self.free(pages)
            return None
        self.host.restore(entry, pages[0])
        self._add(dataclasses.replace(entry, page=pages[0]))
        return pages[0]

    def match(self, token_ids: Sequence[int], page_size: int, max_pages: int,
              extra: Hashable = None) -> tuple[list[int], list[int]]:
        """Pages (and serials) caching the leading full pages of `token_ids`, at most
        `max_pages`. Nothing is taken: pass the pages to `share`."""
        pages, serials, parent = [], [], ROOT
        for index in range(min(max_pages, len(token_ids) // page_size)):
            entry = self.lookup(parent, token_ids[index * page_size:(index + 1) * page_size],
                                extra)
            if entry is None:
                break
            pages.append(entry.page)
            serials.append(entry.serial)
            parent = entry.serial
        return pages, serials

    def take_match(self, token_ids: Sequence[int], page_size: int, max_pages: int,
                   extra: Hashable = None) -> tuple[list[int], list[int], list[int]]:
        """`match` over both tiers, each page taken as it is found (a device page shared,
        a host one restored into a new device page, so that no allocation evicts a page
        the hit holds); returns the pages, their serials and the indices of those the
        host tier restores."""
        pages, serials, parent, restored = [], [], ROOT, []
        for index in range(min(max_pages, len(token_ids) // page_size)):
            tokens = token_ids[index * page_size:(index + 1) * page_size]
            entry = self.lookup(parent, tokens, extra)
            if entry is not None:
                self.share([entry.page])
                page = entry.page
            else:
                entry = self.lookup_host(parent, tokens, extra)
                page = None if entry is None else self.restore(entry)
                if page is None:
                    break
                restored.append(index)
            pages.append(page)
            serials.append(entry.serial)
            parent = entry.serial
        return pages, serials, restored

    def partial_overlap(self, parent: int, tokens: Sequence[int], extra: Hashable = None
                        ) -> int:
        """The longest run of leading `tokens` that a cached child of `parent` also
        starts with (0 if none): tokens shared but not served, below the page floor."""
        if not tokens:
            return 0
        best = 0
        for page in self._children.get((parent, tokens[0]), ()):
            entry = self._cached[page]
            if entry.extra != extra:
                continue
            common = 0
            for ours, theirs in zip(tokens, entry.tokens, strict=False):
                if ours != theirs:
                    break
                common += 1
            best = max(best, common)
        return best

    def forget_cached(self) -> int:
        """Drop every cached page no request holds (its content is gone, as when the
        KV cache is freed); returns how many. Pages in use keep their registration."""
        pages = list(self._evictable)
        self._evictable.clear()
        for page in pages:
            self._forget(page)
            self._free.append(page)
        return len(pages) + (self.host.clear() if self.host else 0)

    def forget_in_use(self) -> int:
        """Unregister the cached pages requests still hold (their KV came from weights
        since replaced): freed later, they go back uncached; returns how many. Pages
        those requests register next chain off the forgotten ones, so no lookup from
        the root reaches them."""
        pages = [page for page in self._cached if self._refs[page] > 0]
        for page in pages:
            self._forget(page)
        if self.host:
            self.host.clear()  # computed with the old weights too
        return len(pages)

    def _serial(self) -> int:
        self._serials += 1
        return self._serials

    def _forget(self, page: int) -> CachedPage:
        entry = self._cached.pop(page)
        del self._by_hash[entry.hash]
        siblings = self._children[(entry.parent, entry.tokens[0])]
        siblings.discard(page)
        if not siblings:
            del self._children[(entry.parent, entry.tokens[0])]
        return entry


def _verified(entry: CachedPage, parent: int, tokens: Sequence[int], extra: Hashable
              ) -> CachedPage | None:
    """`entry` if it holds exactly `tokens` after `parent` with `extra`, else None (a
    hash collision)."""
    if (entry.parent, entry.tokens, entry.extra) != (parent, tuple(tokens), extra):
        return None
    return entry
