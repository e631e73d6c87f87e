"""Two page groups (engine/core/kv_groups.py): exact pages per group as requests grow, finish,
are preempted and hit the prefix cache."""

from __future__ import annotations

import pytest

from jaxinfer import testing
from jaxinfer.engine.core.kv_groups import (
    FullAttentionPages,
    PageGroup,
    PageGroups,
    SlidingWindowPages,
    from_plan,
)
from jaxinfer.engine.core.page_pool import PagePool
from jaxinfer.engine.core.scheduler import Scheduler
from jaxinfer.engine.request import Request, SamplingParams
from jaxinfer.sizing.page_groups import PageGroupPlan

PAGE, WINDOW = 8, 32


def _request(rid, prompt, *, arrival=0, max_tokens=8):
    prompt = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return Request(request_id=rid, prompt_token_ids=prompt, arrival=arrival, seed=0,
                   params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                         ignore_eos=True))


def _scheduler(full=200, sliding=40, caching=False, **kw):
    kw = {"page_size": PAGE, "max_num_seqs": 4, "max_num_batched_tokens": 64,
          "max_model_len": 1024} | kw
    return Scheduler([FullAttentionPages(PagePool(full, enable_caching=caching), PAGE),
                      SlidingWindowPages(PagePool(sliding, enable_caching=caching), PAGE,
                                         WINDOW)], **kw)


def _window_pool(s):
    return s.pages.groups[1].pool


def _held(request):
    return [i for i, page in enumerate(request.page_ids[1]) if page]


def _run(s, check=None, steps=1000):
    for _ in range(steps):
        if not s.has_unfinished():
            return
        plan = s.schedule()
        if check:
            check(plan)
        s.update(plan, [[7] * c.num_samples for c in plan.chunks])


def test_pages_per_group_follow_the_window_at_long_context():
    s = _scheduler()
    s.add(_request("a", 300, max_tokens=40))
    seen = []

    def check(plan):
        for chunk in plan.chunks:
            request, end = chunk.request, chunk.start + chunk.num_tokens
            assert len(request.page_ids[0]) == -(-end // PAGE)  # every page of its tokens
            live = s.pages.groups[1].live_start(chunk.start)
            # sliding: exactly the pages some query of this step (or a later one) sees
            assert _held(request) == list(range(live, -(-end // PAGE)))
            assert len(_held(request)) <= -(-(WINDOW + chunk.num_tokens) // PAGE) + 1
            assert _window_pool(s).num_used == len(_held(request))
            seen.append((chunk.start, chunk.num_tokens, len(_held(request))))

    _run(s, check)
    assert seen[:3] == [(0, 64, 8), (64, 64, 12), (128, 64, 12)]
    assert seen[-1] == (338, 1, 5)  # a decode holds ceil(33 / 8) + 1 pages at most
    assert s.pool.num_used == 0 and _window_pool(s).num_used == 0  # all back
    assert s.pages.usage() == {"full": {"pages": 199, "in_use": 0, "free": 199},
                               "sliding": {"pages": 39, "in_use": 0, "free": 39}}


def test_sliding_shortage_refuses_admission_though_full_pages_are_free():
    s = _scheduler(sliding=8)  # 7 sliding pages
    s.add(_request("a", 40))
    s.add(_request("b", 40, arrival=1))
    plan = s.schedule()
    # a takes 5 sliding pages; b's 24-token chunk would need 3 of the 2 left
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 40)]
    assert [r.request_id for r in s.waiting] == ["b"]
    assert s.pool.num_free == 194 and _window_pool(s).num_free == 2


def test_full_shortage_refuses_admission_though_sliding_pages_are_free():
    s = _scheduler(full=7)  # 6 full pages
    s.add(_request("a", 40))
    s.add(_request("b", 40, arrival=1))
    plan = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.chunks] == [("a", 40)]
    assert s.pool.num_free == 1 and _window_pool(s).num_free == 34


def test_sliding_shortage_preempts_and_pages_come_back():
    s = _scheduler(sliding=10, max_num_batched_tokens=128)  # 9 sliding pages
    a, b = _request("a", 30, max_tokens=40), _request("b", 30, arrival=1, max_tokens=40)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [c.num_tokens for c in plan.chunks] == [30, 30]  # 4 + 4 sliding pages
    s.update(plan, [[7], [7]])
    preempted = []
    for _ in range(12):  # both decode; at 32 tokens each needs a fifth page: 10 > 9
        plan = s.schedule()
        preempted += [r.request_id for r in plan.preempted]
        held = sum(len(_held(r)) for r in s.running)
        assert _window_pool(s).num_used == held <= 9
        s.update(plan, [[7] * c.num_samples for c in plan.chunks])
    assert preempted[0] == "b" and set(preempted) == {"b"}  # the later arrival goes
    assert s.num_preemptions == b.num_preemptions == len(preempted)
    _run(s)
    assert s.pool.num_used == 0 and _window_pool(s).num_used == 0


def test_prefix_hit_takes_the_window_pages_and_is_shortened_when_one_is_evicted():
    s = _scheduler(caching=True)
    prompt = list(range(1, 101))
    s.add(_request("a", prompt, max_tokens=1))
    _run(s)
    sliding = _window_pool(s)
    assert sliding.num_used == 0 and sliding.num_cached == 12  # 12 full pages, 12 twins

    b = _request("b", prompt[:60] + [500, 501])
    s.add(b)
    plan = s.schedule()
    # 7 full pages hit (56 tokens); the window before 56 is pages 3..6, all cached
    assert (plan.chunks[0].start, b.num_cached_tokens) == (56, 56)
    assert _held(b) == [3, 4, 5, 6, 7] and b.page_ids[1][:3] == [0, 0, 0]
    s.update(plan, [[7]])
    _run(s)

    # Evict page 5's sliding twin: move every other cached page to the LRU's young end,
    # then take one page more than the uncached free ones.
    serials = s.pages.pool.match(prompt, PAGE, 12)[1]
    twin = sliding.lookup(serials[5], (serials[5],), "sliding").page
    for page in testing.evictable(sliding):
        if page != twin:
            sliding.share([page])
            sliding.free([page])
    taken = sliding.allocate(sliding.num_free - sliding.num_cached + 1)
    assert sliding.lookup(serials[5], (serials[5],), "sliding") is None
    sliding.free(taken)
    c = _request("c", prompt[:60] + [600, 601], arrival=2)
    s.add(c)
    plan = s.schedule()
    # m = 7 needs pages 3..6 (5 is gone); m = 5 needs pages 1..4: a hit of 40 tokens
    assert (plan.chunks[0].start, c.num_cached_tokens) == (40, 40)
    assert len(c.page_ids[0]) == -(-62 // PAGE) and c.page_ids[0][:5] == [1, 2, 3, 4, 5]
    s.update(plan, [[7]])
    _run(s)
    assert s.pool.num_used == 0 and sliding.num_used == 0


def test_drafts_reserve_pages_without_sliding_and_trim_gives_them_back():
    s = _scheduler()
    a = _request("a", 70, max_tokens=20)
    s.add(a)
    _run(s, steps=2)  # prompt (64 + 6 tokens), then one decode
    plan = s.schedule()
    (chunk,) = plan.chunks
    granted = s.reserve_drafts(plan, [4])
    assert granted == [4]
    end = chunk.start + chunk.num_tokens + 4
    assert len(a.page_ids[1]) == len(a.page_ids[0]) == -(-end // PAGE)
    assert _held(a)[0] == s.pages.groups[1].live_start(chunk.start)
    plan = s.with_drafts(plan, [[1, 2, 3, 4]])
    s.update(plan, [[9, 9, 9, 9, 9]])  # the first draft is rejected
    assert len(a.page_ids[1]) == len(a.page_ids[0]) == -(-a.num_tokens // PAGE)
    assert _window_pool(s).num_used == len(_held(a))


def test_one_group_without_a_window_is_unchanged():
    pages = PageGroups([FullAttentionPages(PagePool(10), 4)])
    a = _request("a", 10)
    assert pages.reserve(a, 10, first_query=0) and a.page_ids == [[1, 2, 3]]
    assert list(pages.usage()) == ["full"]
    pages.release(a)
    assert pages.pool.num_used == 0 and a.page_ids == []


class _ChunkedLocalPages(PageGroup):
    """Chunked local attention (Llama 4's): a query sees only its own chunk of tokens.
    A new kind of page group needs no more than its `live_start`."""

    name = "chunked"

    def __init__(self, pool, page_size, chunk):
        super().__init__(pool, page_size)
        self.chunk = chunk

    def live_start(self, first_query):
        return first_query // self.chunk * self.chunk // self.page_size


def test_the_coordinator_loops_over_any_number_of_kinds():
    s = Scheduler([FullAttentionPages(PagePool(200, enable_caching=True), PAGE),
                   SlidingWindowPages(PagePool(40, enable_caching=True), PAGE, WINDOW),
                   _ChunkedLocalPages(PagePool(40, enable_caching=True), PAGE, 16)],
                  page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=1024)
    prompt = list(range(1, 101))
    s.add(_request("a", prompt, max_tokens=30))

    def check(plan):
        for chunk in plan.chunks:
            end = -(-(chunk.start + chunk.num_tokens) // PAGE)
            for group, ids in zip(s.pages.groups, chunk.request.page_ids, strict=True):
                live = group.live_start(chunk.start)
                assert [i for i, page in enumerate(ids) if page] == list(range(live, end))
                assert group.pool.num_used == end - live

    _run(s, check)
    assert all(group.pool.num_used == 0 for group in s.pages.groups)
    # b's hit: 12 full pages (96 tokens); each group holds from its live page on, the
    # chunked one only the page of the chunk that starts at 96
    b = _request("b", prompt[:99] + [500], arrival=1)
    s.add(b)
    plan = s.schedule()
    assert b.num_cached_tokens == plan.chunks[0].start == 96
    held = [[i for i, page in enumerate(ids) if page] for ids in b.page_ids]
    assert held == [list(range(13)), list(range(8, 13)), [12]]


def test_groups_from_a_memory_plan():
    plans = [PageGroupPlan("full", None, 2, 128, num_pages=10),
             PageGroupPlan("sliding", WINDOW, 10, 5, num_pages=6)]
    full, sliding = from_plan(plans, page_size=PAGE, enable_caching=True)
    assert isinstance(full, FullAttentionPages) and isinstance(sliding, SlidingWindowPages)
    assert (full.pool.num_pages, sliding.pool.num_pages, sliding.window) == (10, 6, WINDOW)
    assert full.pool.enable_caching and sliding.pool.enable_caching
    assert [g.live_start(100) for g in (full, sliding)] == [0, (100 - WINDOW + 1) // PAGE]
    with pytest.raises(ValueError, match="first page group"):
        PageGroups([sliding, full])
