"""Automatic prefix caching: the page pool's hash chain and LRU (exact state), the
scheduler's hits, and the engine's greedy tokens with caching on == off."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxinfer import SamplingParams, testing
from jaxinfer.config import EngineConfig
from jaxinfer.engine.core.page_pool import ROOT, PagePool
from jaxinfer.engine.core.scheduler import Scheduler
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import Request

A, B, C = (1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)


def _cached_pool(num_pages=6, **kw):
    return PagePool(num_pages, enable_caching=True, **kw)


def test_free_cached_pages_go_to_the_lru_and_are_evicted_last():
    pool = _cached_pool()
    p1, p2, p3 = pool.allocate(3)
    s1 = pool.register(p1, ROOT, A)
    pool.register(p2, s1, B)
    pool.free([p2, p1, p3])  # p3 was never registered: plain free
    assert testing.evictable(pool) == [2, 1] and pool.num_cached == 2 and pool.num_free == 5
    assert pool.allocate(3) == [4, 5, 3]  # uncached free pages first
    assert pool.allocate(1) == [2] and pool.num_evictions == 1  # then the LRU's oldest
    assert pool.num_cached == 1 and pool.match(list(A + B), 4, 2) == ([1], [s1])


def test_a_hit_leaves_the_lru_in_o1_and_counts_its_owners():
    pool = _cached_pool()
    p1, p2 = pool.allocate(2)
    s1 = pool.register(p1, ROOT, A)
    s2 = pool.register(p2, s1, B)
    pool.free([p1, p2])
    pages, serials = pool.match(list(A + B + C), 4, 3)
    assert (pages, serials) == ([1, 2], [s1, s2])
    pool.share(pages)
    assert testing.evictable(pool) == [] and pool.refcount(1) == pool.refcount(2) == 1
    pool.share([1])
    pool.free([1])
    assert pool.refcount(1) == 1 and testing.evictable(pool) == []
    pool.free([2, 1])
    assert testing.evictable(pool) == [2, 1]  # most recently freed last


def test_match_stops_at_the_first_miss_and_respects_max_pages():
    pool = _cached_pool()
    p1, p2 = pool.allocate(2)
    s1 = pool.register(p1, ROOT, A)
    pool.register(p2, s1, B)
    assert pool.match(list(A + C + B), 4, 3) == ([1], [s1])
    assert pool.match(list(A + B), 4, 1) == ([1], [s1])
    assert pool.match(list(B + A), 4, 2) == ([], [])  # B is cached only after A


_DIGESTS = """
from jaxinfer.engine.core.page_pool import page_hash
cases = [(0, (1, 2, 3, 4), None), (7, (2**31 - 1, 0, 5, 9), None), (3, (4, 4), "adapter-a"),
         (2**40, (), ("lora", 2))]
print([page_hash(*case) for case in cases])
"""


def test_page_digests_are_the_same_in_two_processes():
    """Hosts of a multi-host job must agree on them; Python's hash() of None and str
    changes from one interpreter to the next (address and salt)."""
    outputs = [subprocess.run([sys.executable, "-c", _DIGESTS], capture_output=True,
                              text=True, check=True, env=os.environ | {"PYTHONHASHSEED": seed})
               .stdout for seed in ("1", "2")]
    assert outputs[0] == outputs[1]
    digests = ast.literal_eval(outputs[0])
    assert len(set(digests)) == 4 and all(0 <= d < 2**64 for d in digests)


def test_a_forced_hash_collision_is_never_served():
    pool = _cached_pool(hash_fn=lambda parent, tokens, extra: 7)  # every page collides
    p1, p2 = pool.allocate(2)
    s1 = pool.register(p1, ROOT, A)
    assert pool.lookup(ROOT, B) is None  # same hash, other tokens
    s2 = pool.register(p2, ROOT, B)  # collides with A: B stays uncached
    assert s2 != s1 and pool.num_cached == 1
    assert pool.match(list(B), 4, 1) == ([], [])
    assert pool.lookup(s1, A) is None  # same tokens and hash, other parent
    assert pool.lookup(ROOT, A, extra="adapter") is None  # other extra key
    assert pool.lookup(ROOT, A).serial == s1


def test_a_reused_parent_page_does_not_revive_its_old_children():
    pool = _cached_pool(num_pages=3, hash_fn=lambda parent, tokens, extra: hash(tokens))
    p1, p2 = pool.allocate(2)
    s1 = pool.register(p1, ROOT, A)
    pool.register(p2, s1, B)
    pool.free([p1, p2])
    (page,) = pool.allocate(1)  # evicts page 1 (A); page 2 (B after A) stays cached
    assert page == 1 and pool.num_cached == 1
    s_new = pool.register(page, ROOT, C)
    assert pool.lookup(s_new, B) is None  # the hash matches B's page, the parent does not
    assert pool.match(list(C + B), 4, 2) == ([1], [s_new])


def test_registering_the_same_content_twice_keeps_one_page():
    pool = _cached_pool()
    p1, p2 = pool.allocate(2)
    s1 = pool.register(p1, ROOT, A)
    assert pool.register(p2, ROOT, A) == s1
    pool.free([p1, p2])
    assert testing.evictable(pool) == [1] and pool.num_cached == 1


def test_partial_overlap_measures_the_shared_run_below_a_page():
    pool = _cached_pool()
    (p1,) = pool.allocate(1)
    pool.register(p1, ROOT, A)
    assert pool.partial_overlap(ROOT, [1, 2, 9, 9]) == 2
    assert pool.partial_overlap(ROOT, [5, 2, 3, 4]) == 0
    assert pool.partial_overlap(ROOT, [1, 2, 3]) == 3


def _request(rid, prompt, arrival, group=""):
    return Request(request_id=rid, prompt_token_ids=list(prompt), arrival=arrival, seed=0,
                   params=SamplingParams(max_tokens=4, temperature=0.0), group=group)


def _scheduler(**kw):
    return Scheduler(_cached_pool(32), page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                     max_model_len=64, **kw)


def test_scheduler_starts_a_request_on_its_cached_prefix():
    s = _scheduler()
    first = _request("a", A + B + (13, 14), 0)
    s.add(first)
    plan = s.schedule()
    s.update(plan, [[50]])
    assert first.page_serials and len(first.page_serials) == 2  # two full pages registered
    second = _request("b", A + B + (20,), 1)
    s.add(second)
    plan = s.schedule()
    chunk = plan.chunks[-1]
    assert chunk.request is second and (chunk.start, chunk.num_tokens) == (8, 1)
    assert second.num_cached_tokens == 8 and second.page_ids[0][:2] == first.page_ids[0][:2]
    assert s.pool.refcount(first.page_ids[0][0]) == 2
    assert s.cache_stats == {"prompt_tokens": 19, "hit_tokens": 8, "host_hit_tokens": 0,
                             "miss_tokens_no_shared_prefix": 10 + 1,
                             "miss_tokens_shared_below_page": 0}


def test_scheduler_recomputes_the_last_prompt_token_and_counts_the_page_floor():
    s = _scheduler()
    s.add(_request("a", A + B, 0))
    s.update(s.schedule(), [[50]])
    twin = _request("b", A + B, 1)  # the whole prompt is cached; its last page is not taken
    s.add(twin)
    s.schedule()
    assert twin.num_cached_tokens == 4
    assert s.cache_stats["miss_tokens_shared_below_page"] == 4


def test_scheduler_n_siblings_share_the_prompt_pages_in_the_step_that_computes_them():
    s = _scheduler()
    prompt = A + B + C + (30,)
    first, second = _request("p#0", prompt, 0, "p"), _request("p#1", prompt, 1, "p")
    s.add(first)
    s.add(second)
    plan = s.schedule()
    assert [(c.request, c.start, c.num_tokens) for c in plan.chunks] == \
        [(first, 0, 13), (second, 12, 1)]  # the one-token chunk stays behind its writer
    assert second.page_ids[0][:3] == first.page_ids[0][:3]


def test_scheduler_a_request_hits_pages_an_earlier_one_computes_in_the_same_step():
    s = _scheduler()
    running = _request("d", (40, 41, 42), 0)
    s.add(running)
    s.update(s.schedule(), [[50]])  # now decoding: a one-token chunk each step
    first, second = _request("a", A + B + C + (13,), 1), _request("b", A + B + (20,), 2)
    s.add(first)
    s.add(second)
    plan = s.schedule()
    assert [(c.request, c.start, c.num_tokens) for c in plan.chunks] == \
        [(running, 3, 1), (first, 0, 13), (second, 8, 1)]
    assert second.num_cached_tokens == 8 and second.page_ids[0][:2] == first.page_ids[0][:2]
    assert s.cache_stats["hit_tokens"] == 8
    s.update(plan, [[51], [52], [53]])
    late = _request("c", A + (21,), 3)  # the next step: a plain hit
    s.add(late)
    plan = s.schedule()
    assert [(c.request, c.start, c.num_tokens) for c in plan.chunks] == \
        [(running, 4, 1), (first, 13, 1), (second, 9, 1), (late, 4, 1)]
    assert late.num_cached_tokens == 4


SMALL = dict(page_size=4, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=64,
             compilation_cache_dir="")
PAGE_BYTES = 4 * 512  # tiny llama: 2 layers x K,V x 2 kv heads x 16 dims x 4 bytes per token


def _shared_prefix_workload():
    """System prompts and few-shot blocks of lengths that end mid-page, duplicates."""
    rng = np.random.default_rng(5)
    systems = [rng.integers(0, 256, size=n).tolist() for n in (9, 14, 21)]
    shots = [rng.integers(0, 256, size=n).tolist() for n in (6, 11)]
    prompts = []
    for i in range(36):
        prompt = systems[i % 3] + (shots[i % 2] if i % 4 else [])
        prompt += rng.integers(0, 256, size=int(rng.integers(1, 8))).tolist()
        prompts.append(prompt[:40])
    prompts += [prompts[3], prompts[3], prompts[10]]  # exact duplicates
    max_tokens = [int(rng.integers(2, 20)) for _ in prompts]
    return prompts, max_tokens


def _greedy(engine, prompts, max_tokens):
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                            ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return [engine.release(f"r{i}") for i in range(len(prompts))]


@pytest.mark.parametrize("pages", [24])
def test_engine_prefix_cache_golden_with_eviction_and_preemption(hf_model_dirs, pages):
    prompts, max_tokens = _shared_prefix_workload()
    engines = {on: Engine(hf_model_dirs["llama"], EngineConfig(
        **SMALL, kv_cache_memory_bytes=pages * PAGE_BYTES, enable_prefix_caching=on))
        for on in (True, False)}
    cached, plain = (_greedy(engines[on], prompts, max_tokens) for on in (True, False))
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    metrics = engines[True].metrics.summary()
    assert metrics["prefix_cache_hit_tokens"] > 0 and metrics["prefix_cache_evictions"] > 0
    assert metrics["preemptions"] > 0
    assert metrics["prompt_tokens"] < engines[False].metrics.summary()["prompt_tokens"]
    assert any(o.num_cached_tokens > 0 for o in cached)
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert "prefix_cache_hit_rate" not in engines[False].metrics.summary()
    assert engines[True].scheduler.pool.num_used == 0


def test_engine_n_completions_share_the_prompt_pages(hf_model_dirs):
    engine = Engine(hf_model_dirs["llama"], EngineConfig(**SMALL))
    prompt = list(range(1, 30))
    engine.add_request("p", prompt, SamplingParams(n=3, max_tokens=5, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    out = engine.release("p")
    assert out.num_cached_tokens == 28  # the siblings took 7 full pages, then the last token
    assert len({tuple(o.token_ids) for o in out.outputs}) == 1  # greedy: the same tokens
    assert engine.metrics.summary()["prompt_tokens"] == 29 + 2  # one prompt + 2 last tokens
