"""The page allocator: a fixed pool of KV pages with reference counts.

Page 0 is the trash page: padding tokens write their K/V there and it is never
handed out. Free pages sit in a deque (allocation and free are O(1) per page);
a page returns to it when its reference count drops to zero, so a later issue
can share pages between requests (prefix caching, n > 1). Plain Python.
"""

from __future__ import annotations

import collections

TRASH_PAGE = 0


class PagePool:
    """Hands out page ids 1..num_pages-1 and takes them back."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"{num_pages=} must be >= 2 (page 0 is the trash page)")
        self.num_pages = num_pages
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh pages with refcount 1, or None (nothing taken) if too few."""
        if count > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """One more owner for each page."""
        for page in pages:
            if self._refs[page] <= 0:
                raise ValueError(f"page {page} is free; it cannot be shared")
            self._refs[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one owner of each page; pages left with none return to the pool."""
        for page in pages:
            if page == TRASH_PAGE or self._refs[page] <= 0:
                raise ValueError(f"page {page} is not allocated")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
