"""Data-parallel routing (engine/parallel/routing.py): which replica a request goes to, and the
prefix-cache hit rate the rule buys over round-robin on real schedulers and page pools
(host only: sampled tokens are made up)."""

from __future__ import annotations

import random

import pytest

from jaxinfer.engine.core.page_pool import PagePool
from jaxinfer.engine.core.scheduler import Scheduler
from jaxinfer.engine.parallel.routing import Router, page_chain
from jaxinfer.engine.request import Request, SamplingParams

PAGE = 16


def test_page_chain_covers_every_token_before_a_page():
    a = page_chain(list(range(40)), 16)
    b = page_chain([99] + list(range(1, 40)), 16)
    assert len(a) == 2 and len(page_chain(list(range(15)), 16)) == 0
    assert a[0] != b[0] and a[1] != b[1]  # a different first token changes every digest
    assert page_chain(list(range(32)) + [7] * 8, 16) == a  # only full pages count


def test_cache_aware_keeps_a_preamble_on_one_replica_until_it_is_a_batch_busier():
    router = Router(3, page_size=PAGE, balance_threshold=2)
    preamble = list(range(100, 100 + 2 * PAGE))
    loads = [0, 0, 0]
    picks = []
    for i in range(5):
        picks.append(router.pick(preamble + [i], loads))
        loads[picks[-1]] += 1
    # the first goes to the least loaded; the next stay while 2 or fewer ahead
    assert picks == [0, 0, 0, 1, 1]
    assert router.matched_pages(preamble) == [2, 2, 0]
    other = router.pick(list(range(500, 500 + 2 * PAGE)), [3, 2, 0])
    assert other == 2  # nothing remembered: the least loaded
    assert router.pick([1, 2, 3], [1, 0, 0]) == 1  # shorter than a page: least loaded


def test_round_robin_and_shortest_queue():
    turns = Router(3, page_size=PAGE, method="round_robin")
    assert [turns.pick([1] * 40, [9, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert Router(3, page_size=PAGE, method="shortest_queue").pick([1] * 40, [2, 1, 1]) == 1
    with pytest.raises(ValueError, match="load_balance_method='random'"):
        Router(2, page_size=PAGE, method="random")


def test_remembered_pages_are_bounded_least_recently_used_first():
    router = Router(1, page_size=PAGE, max_pages=3)
    first, second = list(range(2 * PAGE)), list(range(1000, 1000 + 2 * PAGE))
    router.pick(first, [0])
    router.pick(second, [0])
    assert router.matched_pages(first) == [0] and router.matched_pages(second) == [2]


def served_hit_rate(method: str, num_replicas: int = 4, preambles: int = 4,
                    per_preamble: int = 64, seed: int = 0) -> tuple[float, float]:
    """Prefix-cache hit rate of `preambles` x `per_preamble` requests (a 4-page preamble
    and 8 tokens of their own, arriving in a random order) over real schedulers, one per
    replica, routed by `method`; and how many times preambles were computed."""
    rng = random.Random(seed)
    order = [p for p in range(preambles) for _ in range(per_preamble)]
    rng.shuffle(order)
    replicas = [Scheduler(PagePool(256, enable_caching=True), page_size=PAGE, max_num_seqs=8,
                          max_num_batched_tokens=128, max_model_len=256, eos_token_ids=[0])
                for _ in range(num_replicas)]
    router = Router(num_replicas, page_size=PAGE, method=method, balance_threshold=8)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    for i, p in enumerate(order):
        tokens = [1000 * (p + 1) + t for t in range(4 * PAGE)] + [rng.randrange(1, 999)
                                                                  for _ in range(8)]
        loads = [len(s.waiting) + len(s.running) for s in replicas]
        replica = replicas[router.pick(tokens, loads)]
        replica.add(Request(request_id=str(i), prompt_token_ids=tokens, params=params,
                            arrival=i, seed=0))
    while any(s.has_unfinished() for s in replicas):
        for s in replicas:
            plan = s.schedule()
            s.update(plan, [[5] * c.num_samples for c in plan.chunks])
    hits = sum(s.cache_stats["hit_tokens"] for s in replicas)
    looked_up = sum(s.cache_stats["prompt_tokens"] for s in replicas)
    own = 8 * len(order)  # each request's own tokens are always computed
    return hits / looked_up, (looked_up - hits - own) / (4 * PAGE)


def test_cache_aware_routing_beats_round_robin_on_shared_preambles():
    (cache_aware, passes), (round_robin, rr_passes) = (
        served_hit_rate("cache_aware"), served_hit_rate("round_robin"))
    # 4 preambles over 4 replicas: cache_aware keeps each on one replica, round-robin
    # computes each on every replica (requests admitted in one step also miss each other's
    # pages: a preamble is computed again within its first step's admissions).
    assert cache_aware > round_robin
    assert passes <= 2 * 4 < 4 * 4 <= rr_passes
