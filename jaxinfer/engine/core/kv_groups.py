"""A request's KV pages in each page group (vLLM's hybrid KV cache manager). Plain Python.

One group, as ever, for a model whose layers all attend to everything (Llama) or all
within one window (Mistral), and whenever `disable_hybrid_kv_cache_manager` is set:
every layer keeps a page for every page of a request's tokens.

Two groups for a model with both sliding-window and full-attention layers (Gemma 3,
gpt-oss). The full group (the full-attention layers' KV arrays) keeps today's pages. The
sliding group has its own KV arrays, its own page ids and `PagePool`, and its own list
per request, `Request.sliding_page_ids`, indexed by the same logical page: logical page
i covers tokens [i * page_size, (i + 1) * page_size) in both groups, so the kernels are
unchanged. A sliding layer's query at position q sees tokens > q - window, so when a
step is scheduled whose first query of a request is at c (its computed count), every
sliding page all of whose tokens are below c - window + 1 is given back (`reserve` with
`first_query`); its entry becomes 0. No later query of that request sees it: queries
only move forward, a step in flight (asynchronous scheduling) reads before any later
step writes (the device runs steps in order), and rejected drafts roll the count back no
further than the scheduled chunk's first token + 1. The device page-table row keeps the
old id; the kernels skip pages before the window and the reference masks them (the
probabilities there are exactly 0, and finite K/V times 0 adds nothing).

Prefix caching stays exact. Full pages are cached as before (a hash chain whose serial
names a verified whole prefix). A sliding page is registered when its full twin is,
keyed by that twin's serial; pages that slide out of a window go to the sliding pool's
LRU, still hittable until evicted, never served once evicted. A hit of n full pages is
shortened to the longest m <= n for which every sliding page the first query after m
pages can see (logical pages `live_start(m * page_size)` .. m - 1) is cached; the
request then holds those sliding pages and 0 before them.
"""

from __future__ import annotations

from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.core.page_pool import ROOT, TRASH_PAGE, PagePool
from jaxinfer.engine.request import Request

SLIDING_KEY = "sliding"  # the extra key of a sliding page's cache entry


class PageGroups:
    """The page pools of a request's KV: the full group, and the sliding one if any."""

    def __init__(self, pool: PagePool, *, page_size: int, sliding_pool: PagePool | None = None,
                 window: int | None = None) -> None:
        if (sliding_pool is None) != (window is None):
            raise ValueError("a sliding page pool needs its window, and a window its pool")
        self.pool = pool
        self.page_size = page_size
        self.sliding_pool = sliding_pool
        self.window = window

    def live_start(self, first_query: int) -> int:
        """The first logical page that a sliding layer's query at `first_query` or later
        can see: pages before it hold only tokens < first_query - window + 1."""
        return max(0, first_query - self.window + 1) // self.page_size

    def reserve(self, request: Request, num_tokens: int, first_query: int | None = None
                ) -> bool:
        """Pages in every group for the request's first `num_tokens` tokens, or False with
        nothing taken. `first_query`: the first position the step computes; the sliding
        pages no query from there on sees are given back first (drafts pass None)."""
        total = -(-num_tokens // self.page_size)
        need = total - len(request.page_ids)
        low = 0
        if self.sliding_pool is not None:
            if first_query is not None:
                self._slide(request, first_query)
                low = self.live_start(first_query)
            sliding_need = max(0, total - max(len(request.sliding_page_ids), low))
            if sliding_need > self.sliding_pool.num_free:
                return False
        if need > self.pool.num_free:
            return False
        if need > 0:
            request.page_ids.extend(self.pool.allocate(need))
        if self.sliding_pool is not None:
            ids = request.sliding_page_ids
            dead = max(0, min(total, low) - len(ids))  # pages no query will see: none held
            ids.extend([TRASH_PAGE] * dead)
            if len(ids) < total:
                ids.extend(self.sliding_pool.allocate(total - len(ids)))
        return True

    def _slide(self, request: Request, first_query: int) -> None:
        """Give back the request's sliding pages before `live_start(first_query)`."""
        ids = request.sliding_page_ids
        end = min(self.live_start(first_query), len(ids))
        gone = [page for page in ids[request.sliding_first:end] if page != TRASH_PAGE]
        if gone:
            self.sliding_pool.free(gone)
        ids[request.sliding_first:end] = [TRASH_PAGE] * max(0, end - request.sliding_first)
        request.sliding_first = max(request.sliding_first, end)

    def release(self, request: Request) -> None:
        """Give back all the request's pages, in every group (cached ones stay cached)."""
        if request.page_ids:
            self.pool.free(request.page_ids)
            request.page_ids = []
        request.page_serials = []
        held = [page for page in request.sliding_page_ids if page != TRASH_PAGE]
        if held:
            self.sliding_pool.free(held)
        request.sliding_page_ids, request.sliding_first = [], 0

    def trim(self, request: Request) -> None:
        """Free the pages past those the request's tokens need (they held rejected drafts'
        K/V only), in every group."""
        keep = -(-request.num_tokens // self.page_size)
        if len(request.page_ids) > keep:
            self.pool.free(request.page_ids[keep:])
            del request.page_ids[keep:]
        ids = request.sliding_page_ids
        if len(ids) > keep:
            held = [page for page in ids[keep:] if page != TRASH_PAGE]
            if held:
                self.sliding_pool.free(held)
            del ids[keep:]

    # ---- the prefix cache -------------------------------------------------------------

    def register(self, request: Request) -> None:
        """Register the request's newly computed full pages, and their sliding twins."""
        full = min(request.num_computed_tokens, request.num_tokens) // self.page_size
        if not self.pool.enable_caching or full <= len(request.page_serials):
            return
        parent = request.page_serials[-1] if request.page_serials else ROOT
        for index in range(len(request.page_serials), full):
            parent = self.pool.register(request.page_ids[index], parent, request.tokens(
                index * self.page_size, (index + 1) * self.page_size))
            request.page_serials.append(parent)
            if self.sliding_pool is not None and index < len(request.sliding_page_ids):
                page = request.sliding_page_ids[index]
                if page != TRASH_PAGE:  # one that slid out unregistered is just not cached
                    self.sliding_pool.register(page, parent, (parent,), SLIDING_KEY)

    def take_cached(self, request: Request) -> None:
        """Start `request` on the cached pages of its leading full pages (never the last
        token's page: its logits are needed), as far as the sliding group has the window
        before them too."""
        tokens = request.all_token_ids
        pages, serials = self.pool.match(tokens, self.page_size,
                                         (len(tokens) - 1) // self.page_size)
        if self.sliding_pool is not None:
            count, sliding = self._sliding_hit(serials)
            pages, serials = pages[:count], serials[:count]
            held = [page for page in sliding if page != TRASH_PAGE]
            self.sliding_pool.share(held)
            request.sliding_page_ids = sliding
            request.sliding_first = self.live_start(count * self.page_size)
        self.pool.share(pages)
        request.page_ids, request.page_serials = pages, serials
        request.num_computed_tokens = len(pages) * self.page_size

    def _sliding_hit(self, serials: list[int]) -> tuple[int, list[int]]:
        """The most leading full pages m <= len(serials) whose window is cached in the
        sliding group, and the request's sliding ids then (0 before the window)."""
        found: dict[int, int | None] = {}

        def cached(index: int) -> int | None:
            if index not in found:
                entry = self.sliding_pool.lookup(serials[index], (serials[index],), SLIDING_KEY)
                found[index] = None if entry is None else entry.page
            return found[index]

        count = len(serials)
        while count > 0:
            low = self.live_start(count * self.page_size)
            missing = [i for i in range(low, count) if cached(i) is None]
            if not missing:
                break
            count = missing[-1]  # any longer hit still needs that page
        low = self.live_start(count * self.page_size) if count else 0
        return count, [TRASH_PAGE] * low + [cached(i) for i in range(low, count)]

    # ---- counts -----------------------------------------------------------------------

    def usage(self) -> dict[str, dict[str, int]]:
        """Pages in use and free per group (the trash pages not counted)."""
        groups = {"full": self.pool}
        if self.sliding_pool is not None:
            groups["sliding"] = self.sliding_pool
        return {name: {"pages": pool.num_pages - 1, "in_use": pool.num_used,
                       "free": pool.num_free} for name, pool in groups.items()}


def sliding_group(num_sliding_pages: int, model: ModelConfig, engine: EngineConfig
                  ) -> dict[str, object]:
    """The Scheduler's sliding-group arguments for a memory plan's `num_sliding_pages`
    (none when 0: one group)."""
    if not num_sliding_pages:
        return {}
    return {"sliding_pool": PagePool(num_sliding_pages,
                                     enable_caching=engine.enable_prefix_caching),
            "window": model.sliding_window}
