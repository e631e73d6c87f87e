"""A request's KV pages in each page group, one class per attention kind
(`FullAttentionPages`, `SlidingWindowPages`), and `PageGroups`, which loops over them to
reserve, free, register and match (vLLM's hybrid KV cache manager). Plain Python.
See docs/kv_cache.md (#page-groups-the-hybrid-kv-cache, #freeing,
#prefix-caching-stays-exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from jaxinfer.engine.core.host_tier import HostTier
from jaxinfer.engine.core.page_pool import ROOT, TRASH_PAGE, PagePool
from jaxinfer.engine.request import Request


class PageGroup:
    """The pages of one attention kind. `ids`, a request's list in this group: its page
    of each logical page, 0 (TRASH_PAGE) before `live_start` where pages were given
    back or never held. A group other than the first caches a page as the twin of the
    first group's page of the same index, keyed by that page's serial, so a hit can only
    be served for the prefix the first group verified."""

    name = ""  # in usage() and the metrics: kv_pages_<name>_in_use
    window: int | None = None  # the window of the layers it serves; None: full attention

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size

    def live_start(self, first_query: int) -> int:
        """The first logical page a query at `first_query` or later can see."""
        raise NotImplementedError

    def free_dead(self, ids: list[int], first_query: int) -> None:
        """Give back the held pages before `live_start(first_query)`. The pages held
        always follow the 0s, so walking back from there finds exactly the new ones."""
        end = start = min(self.live_start(first_query), len(ids))
        while start > 0 and ids[start - 1] != TRASH_PAGE:
            start -= 1
        if start < end:
            self.pool.free(ids[start:end])
            ids[start:end] = [TRASH_PAGE] * (end - start)

    def need(self, ids: list[int], total: int, first_query: int | None) -> int:
        """Pages to take for `total` logical pages (none before the live ones)."""
        low = 0 if first_query is None else self.live_start(first_query)
        return max(0, total - max(len(ids), low))

    def grow(self, ids: list[int], total: int, first_query: int | None) -> None:
        """Extend `ids` to `total` pages: 0 for those no query will see, then new ones."""
        low = 0 if first_query is None else self.live_start(first_query)
        ids.extend([TRASH_PAGE] * max(0, min(total, low) - len(ids)))
        if len(ids) < total:
            ids.extend(self.pool.allocate(total - len(ids)))

    def release(self, ids: list[int], keep: int = 0) -> None:
        """Give back the pages from logical page `keep` on (cached ones stay cached)."""
        held = [page for page in ids[keep:] if page != TRASH_PAGE]
        if held:  # last page first: a prefix's tail is evicted before its head (vLLM)
            self.pool.free(held[::-1])
        del ids[keep:]

    def cache(self, ids: list[int], index: int, serial: int) -> None:
        """Register logical page `index` as the twin of the first group's page `serial`
        (one already given back is just not cached)."""
        if index < len(ids) and ids[index] != TRASH_PAGE:
            self.pool.register(ids[index], serial, (serial,), self.name)

    def hit(self, serials: Sequence[int], count: int) -> tuple[int, list[int]]:
        """The most leading pages m <= `count` of a hit whose serials are `serials` for
        which every page a query after them can see is cached here, and the request's
        ids then (0 before the live ones)."""
        found: dict[int, int | None] = {}

        def cached(index: int) -> int | None:
            if index not in found:
                entry = self.pool.lookup(serials[index], (serials[index],), self.name)
                found[index] = None if entry is None else entry.page
            return found[index]

        while count > 0:
            missing = [i for i in range(self.live_start(count * self.page_size), count)
                       if cached(i) is None]
            if not missing:
                break
            count = missing[-1]  # any longer hit still needs that page
        low = self.live_start(count * self.page_size) if count else 0
        return count, [TRASH_PAGE] * low + [cached(i) for i in range(low, count)]


class FullAttentionPages(PageGroup):
    """Every page of a request's tokens: a full-attention query sees them all."""

    name = "full"

    def live_start(self, first_query: int) -> int:
        return 0


class SlidingWindowPages(PageGroup):
    """The pages a sliding window still sees: a query at position q sees tokens
    > q - window, so a page all of whose tokens are below first_query - window + 1 is
    given back when a step's first query passes it."""

    name = "sliding"

    def __init__(self, pool: PagePool, page_size: int, window: int) -> None:
        if window <= 0:
            raise ValueError(f"{window=} must be > 0")
        super().__init__(pool, page_size)
        self.window = window

    def live_start(self, first_query: int) -> int:
        return max(0, first_query - self.window + 1) // self.page_size


KINDS: dict[str, type[PageGroup]] = {"full": FullAttentionPages,
                                     "sliding": SlidingWindowPages}


class GroupPlan(Protocol):
    """What the memory plan says of a page group (sizing/page_groups.py)."""

    kind: str
    window: int | None
    num_pages: int


def from_plan(plans: Sequence[GroupPlan], *, page_size: int, enable_caching: bool,
              host_pages: int = 0) -> list[PageGroup]:
    """The page groups a memory plan sizes, each with a pool of its pages; the first
    with a host tier of `host_pages` pages when > 0 (kv_offloading_size)."""
    groups = []
    for plan in plans:
        host = HostTier(host_pages) if host_pages and not groups else None
        pool = PagePool(plan.num_pages, enable_caching=enable_caching, host=host)
        window = {} if plan.window is None else {"window": plan.window}
        groups.append(KINDS[plan.kind](pool, page_size, **window))
    return groups


class PageGroups:
    """The coordinator: reserves, frees, caches and matches a request's pages in every
    group; `Request.page_ids[g]` is its list in group g."""

    def __init__(self, groups: Sequence[PageGroup]) -> None:
        if not groups or not isinstance(groups[0], FullAttentionPages):
            raise ValueError("the first page group must keep every page (full attention)")
        if len({g.name for g in groups}) < len(groups) or len(
                {g.page_size for g in groups}) > 1:
            raise ValueError("page groups need distinct kinds and one page size")
        self.groups = tuple(groups)
        self.pool = groups[0].pool  # the prefix cache's anchor
        self.page_size = groups[0].page_size

    def _ids(self, request: Request) -> list[list[int]]:
        if not request.page_ids:
            request.page_ids = [[] for _ in self.groups]
        return request.page_ids

    def reserve(self, request: Request, num_tokens: int, first_query: int | None = None
                ) -> bool:
        """Pages in every group for the request's first `num_tokens` tokens, or False with
        nothing taken. `first_query`: the first position the step computes; the pages
        no query from there on sees are given back first (drafts pass None)."""
        total = -(-num_tokens // self.page_size)
        ids = self._ids(request)
        if first_query is not None:
            for group, held in zip(self.groups, ids, strict=True):
                group.free_dead(held, first_query)
        if any(group.need(held, total, first_query) > group.pool.num_free
               for group, held in zip(self.groups, ids, strict=True)):
            return False
        for group, held in zip(self.groups, ids, strict=True):
            group.grow(held, total, first_query)
        return True

    def release(self, request: Request) -> None:
        """Give back all the request's pages, in every group (cached ones stay cached)."""
        for group, held in zip(self.groups, request.page_ids, strict=False):
            group.release(held)
        request.page_ids, request.page_serials = [], []

    def trim(self, request: Request) -> None:
        """Free the pages past those the request's tokens need (they held rejected drafts'
        K/V only), in every group."""
        keep = -(-request.num_tokens // self.page_size)
        for group, held in zip(self.groups, request.page_ids, strict=False):
            group.release(held, keep)

    # ---- the prefix cache -------------------------------------------------------------

    def register(self, request: Request) -> None:
        """Register the request's newly computed full pages, and their twins."""
        full = min(request.num_computed_tokens, request.num_tokens) // self.page_size
        if not self.pool.enable_caching or full <= len(request.page_serials):
            return
        first, *others = request.page_ids
        parent = request.page_serials[-1] if request.page_serials else ROOT
        for index in range(len(request.page_serials), full):
            parent = self.pool.register(first[index], parent, request.tokens(
                index * self.page_size, (index + 1) * self.page_size), request.cache_key)
            request.page_serials.append(parent)
            for group, held in zip(self.groups[1:], others, strict=True):
                group.cache(held, index, parent)

    def take_cached(self, request: Request) -> int:
        """Start `request` on the cached pages of its leading full pages (never the last
        token's page: its logits are needed), as far as every group holds what a query
        after them sees; returns how many of them the host tier restores."""
        tokens = request.all_token_ids
        pages, serials, restored = self.pool.take_match(
            tokens, self.page_size, (len(tokens) - 1) // self.page_size, request.cache_key)
        count, held = len(pages), []
        while self.groups[1:]:  # each group may shorten the hit; stop when all agree
            shorter, held = count, []
            for group in self.groups[1:]:
                shorter, ids = group.hit(serials, shorter)
                held.append(ids)
            if shorter == count:
                break
            count = shorter
        request.page_ids = [pages[:count], *held]
        self.pool.free(pages[count:])  # taken by take_match; a host one stays restored
        for group, ids in zip(self.groups[1:], held, strict=True):
            group.pool.share([page for page in ids if page != TRASH_PAGE])
        request.page_serials = serials[:count]
        request.num_computed_tokens = count * self.page_size
        return sum(index < count for index in restored)

    # ---- counts -----------------------------------------------------------------------

    def usage(self) -> dict[str, dict[str, int]]:
        """Pages in use and free per group (the trash pages not counted)."""
        return {group.name: {"pages": group.pool.num_pages - 1,
                             "in_use": group.pool.num_used, "free": group.pool.num_free}
                for group in self.groups}
