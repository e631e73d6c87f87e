"""The scheduler, page pool and buckets: exact state after each step."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.engine.core.buckets import Bucket, BucketSet, slot_ladder, token_ladder
from jaxinfer.engine.core.page_pool import PagePool
from jaxinfer.engine.core.scheduler import Scheduler
from jaxinfer.engine.request import Request, SamplingParams, Status

EOS = 99


def _request(rid, prompt_len, *, arrival, priority=0, **params):
    params = SamplingParams(**({"max_tokens": 8, "temperature": 0.0} | params))
    return Request(request_id=rid, prompt_token_ids=list(range(1, prompt_len + 1)),
                   params=params, arrival=arrival, seed=0, priority=priority)


def _scheduler(num_pages=32, **kw):
    kw = {"page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16,
          "max_model_len": 64, "eos_token_ids": [EOS]} | kw
    return Scheduler(PagePool(num_pages), **kw)


def _plan(s):
    plan = s.schedule()
    return plan, [(c.request.request_id, c.start, c.num_tokens, c.num_samples)
                  for c in plan.chunks]


def test_page_pool_allocate_free_order_and_refcounts():
    pool = PagePool(6)
    assert pool.allocate(3) == [1, 2, 3]
    assert pool.allocate(3) is None and pool.num_free == 2  # nothing taken on failure
    pool.share([2])
    pool.free([1, 2])
    assert pool.refcount(2) == 1 and pool.num_free == 3
    assert pool.allocate(3) == [4, 5, 1]
    with pytest.raises(ValueError, match="page 0 is not allocated"):
        pool.free([0])
    pool.free([2])
    with pytest.raises(ValueError, match="page 2 is free"):
        pool.share([2])


def test_chunked_prefill_shares_the_budget_with_decodes():
    s = _scheduler()
    s.add(_request("a", 6, arrival=0))
    plan, chunks = _plan(s)
    assert chunks == [("a", 0, 6, 1)]
    s.update(plan, [[7]])
    s.add(_request("b", 30, arrival=1))
    plan, chunks = _plan(s)
    assert chunks == [("a", 6, 1, 1), ("b", 0, 15, 0)]  # 16-token budget
    s.update(plan, [[8], []])
    plan, chunks = _plan(s)
    assert chunks == [("a", 7, 1, 1), ("b", 15, 15, 1)]
    assert s.running[1].page_ids == [[3, 4, 5, 6, 7, 8, 9, 10]]


def test_waiting_admitted_by_priority_then_arrival_up_to_max_num_seqs():
    s = _scheduler(max_num_seqs=2)
    s.add(_request("late", 2, arrival=2))
    s.add(_request("low", 2, arrival=0, priority=5))
    s.add(_request("early", 2, arrival=1))
    _, chunks = _plan(s)
    assert [c[0] for c in chunks] == ["early", "late"]
    assert [r.request_id for r in s.waiting] == ["low"]


def test_stop_token_eos_min_tokens_and_length():
    s = _scheduler()
    a = _request("a", 3, arrival=0, stop_token_ids=[42], min_tokens=2)
    b = _request("b", 3, arrival=1, max_tokens=2)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert s.update(plan, [[42], [5]]) == []  # 42 before min_tokens: not a stop
    plan = s.schedule()
    assert s.update(plan, [[42], [6]]) == [a, b]
    assert (a.finish_reason, a.stop_reason, b.finish_reason) == ("stop", 42, "length")
    assert a.output_token_ids == [42, 42] and s.pool.num_used == 0


def test_eos_ignored_when_asked_and_max_model_len_ends():
    s = _scheduler(max_model_len=5)
    a = _request("a", 3, arrival=0, ignore_eos=True)
    s.add(a)
    s.update(s.schedule(), [[EOS]])
    assert not a.finished
    s.update(s.schedule(), [[EOS]])
    assert a.finish_reason == "length" and a.num_tokens == 5


def test_preemption_frees_latest_lowest_priority_and_recomputes():
    s = _scheduler(num_pages=5, max_num_batched_tokens=32)  # 4 usable pages of 4 tokens
    a, b = _request("a", 7, arrival=0), _request("b", 7, arrival=1)
    s.add(a)
    s.add(b)
    s.update(s.schedule(), [[1], [2]])
    assert a.page_ids == [[1, 2]] and b.page_ids == [[3, 4]]
    s.update(s.schedule(), [[3], [4]])  # 9 tokens each now: a needs a third page
    plan = s.schedule()
    assert [r.request_id for r in plan.preempted] == ["b"]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks] == [("a", 8, 1)]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.page_ids == []
    # b's pages went back tail first, so its last page is the one evicted
    assert b.output_token_ids == [2, 4] and a.page_ids == [[1, 2, 4]]
    s.update(plan, [[5]])
    s.finish(a, "abort")
    plan = s.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens, c.num_samples)
            for c in plan.chunks] == [("b", 0, 9, 1)]  # prompt + its 2 outputs, recomputed


def _verify_plan(s, samples):
    """Schedule the waiting requests' whole prompts, then sample the last `samples[i]`
    positions of chunk i (as a proposer's draft tokens would have them)."""
    plan = s.schedule()
    chunks = tuple(dataclasses.replace(c, num_samples=n)
                   for c, n in zip(plan.chunks, samples, strict=True))
    return dataclasses.replace(plan, chunks=chunks)


def test_update_appends_several_tokens_per_chunk_up_to_a_stop():
    s = _scheduler(max_num_seqs=5, max_num_batched_tokens=32)
    reqs = [_request("stop", 5, arrival=0, stop_token_ids=[42]),
            _request("min", 5, arrival=1, stop_token_ids=[42], min_tokens=2),
            _request("max", 5, arrival=2, max_tokens=2),
            _request("eos", 5, arrival=3),
            _request("all", 5, arrival=4)]
    for r in reqs:
        s.add(r)
    plan = _verify_plan(s, [3, 3, 3, 3, 3])
    finished = s.update(plan, [[5, 42, 7], [42, 42, 9], [5, 6, 7], [EOS, 8, 9], [5, 6, 7]])
    assert finished == reqs[:4]
    assert [r.output_token_ids for r in reqs] == [[5, 42], [42, 42], [5, 6], [EOS], [5, 6, 7]]
    assert [(r.finish_reason, r.stop_reason) for r in reqs] == [
        ("stop", 42), ("stop", 42), ("length", None), ("stop", None), (None, None)]
    assert reqs[4].num_computed_tokens == 5 and reqs[4].num_tokens == 8
    assert s.running == [reqs[4]] and reqs[4].page_ids == [[9, 10]]  # the others' pages freed
    assert s.pool.num_used == 2


def test_update_several_tokens_stop_at_max_model_len_and_accept_fewer():
    s = _scheduler(max_model_len=7)
    long, short = _request("long", 5, arrival=0), _request("short", 3, arrival=1)
    s.add(long)
    s.add(short)
    plan = _verify_plan(s, [3, 2])
    assert s.update(plan, [[1, 2, 3], [4]]) == [long]  # a rejection keeps fewer tokens
    assert long.output_token_ids == [1, 2] and long.finish_reason == "length"
    assert long.num_tokens == 7
    assert short.output_token_ids == [4] and short.num_computed_tokens == 3
    plan = s.schedule()
    assert [(c.start, c.num_tokens, c.num_samples) for c in plan.chunks] == [(3, 1, 1)]
    with pytest.raises(ValueError, match="2 tokens for a chunk of 'short' that samples 1"):
        s.update(plan, [[5, 6]])
    with pytest.raises(ValueError, match="num_samples=2 must be in"):
        dataclasses.replace(plan.chunks[0], num_samples=2)


def test_finish_keeps_only_the_outputs_before_a_stop_string():
    s = _scheduler()
    a, b = _request("a", 3, arrival=0, max_tokens=3), _request("b", 3, arrival=1)
    s.add(a)
    s.add(b)
    s.update(_verify_plan(s, [3, 3]), [[5, 6, 7], [5, 6, 7]])
    assert a.finish_reason == "length" and not b.finished
    # The engine's text shows a stop string at the 2nd token: the 3rd and its end are dropped.
    s.finish(a, "stop", "xy", num_output_tokens=2)
    s.finish(b, "stop", "xy", num_output_tokens=1)
    assert (a.output_token_ids, a.finish_reason, a.stop_reason) == ([5, 6], "stop", "xy")
    assert (b.output_token_ids, b.finish_reason, b.stop_reason) == ([5], "stop", "xy")
    assert not s.has_unfinished() and s.pool.num_used == 0
    s.finish(a, "abort")  # finished stays finished
    assert a.finish_reason == "stop"


def test_static_policy_fills_a_batch_then_waits_for_all_of_it():
    s = _scheduler(policy="static", max_num_seqs=2, max_num_batched_tokens=8)
    for i, max_tokens in enumerate((2, 3, 2)):
        s.add(_request(f"r{i}", 6, arrival=i, max_tokens=max_tokens))
    plan, chunks = _plan(s)
    assert chunks == [("r0", 0, 6, 1), ("r1", 0, 2, 0)]  # budget-limited
    s.update(plan, [[5], []])
    plan, chunks = _plan(s)
    assert chunks == [("r0", 6, 1, 1), ("r1", 2, 4, 1)]  # r1 joins the same batch
    s.update(plan, [[5], [5]])  # r0 has its 2 tokens and is done; a slot is free
    plan, chunks = _plan(s)
    assert chunks == [("r1", 6, 1, 1)]  # but r2 waits for the whole batch
    s.update(plan, [[5]])
    plan, chunks = _plan(s)
    assert chunks == [("r1", 7, 1, 1)]
    s.update(plan, [[5]])
    plan, chunks = _plan(s)
    assert [c[0] for c in chunks] == ["r2"]


def test_abort_waiting_and_running():
    s = _scheduler()
    a, b = _request("a", 4, arrival=0), _request("b", 4, arrival=1)
    s.add(a)
    s.schedule()
    s.add(b)
    s.finish(a, "abort")
    s.finish(b, "abort")
    assert not s.has_unfinished() and s.pool.num_used == 0
    assert a.finish_reason == b.finish_reason == "abort"


def test_token_and_slot_ladders():
    # powers of two to 256, every 64 tokens to 512, every 512 after
    assert token_ladder(512) == [16, 32, 64, 128, 256, 320, 384, 448, 512]
    assert token_ladder(2048) == [16, 32, 64, 128, 256, 320, 384, 448, 512, 1024, 1536, 2048]
    assert token_ladder(100) == [16, 32, 64, 100]
    assert token_ladder(300) == [16, 32, 64, 128, 256, 300]
    assert token_ladder(1000) == [16, 32, 64, 128, 256, 320, 384, 448, 512, 1000]
    assert slot_ladder(48) == [1, 2, 4, 8, 16, 32, 48]


def test_bucket_pick_and_all():
    buckets = BucketSet(max_num_batched_tokens=64, max_num_seqs=8)
    assert buckets.pick(1, 1) == Bucket(16, 8)
    assert buckets.pick(17, 3) == Bucket(32, 8)
    assert buckets.pick(64, 8) == Bucket(64, 8)
    assert len(buckets.all()) == 4 + 3  # decode slots 1, 2, 4, 8; mixed tokens 16, 32, 64
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        buckets.pick(65, 1)
    with pytest.raises(ValueError, match="must be >= max_num_seqs"):
        BucketSet(max_num_batched_tokens=4, max_num_seqs=8)


def test_host_modules_import_without_jax():
    import subprocess
    import sys

    code = ("import sys, jaxinfer.engine.core.scheduler, jaxinfer.engine.core.page_pool, "
            "jaxinfer.engine.core.buckets, jaxinfer.engine.request, "
            "jaxinfer.engine.metrics.summary; "
            "from jaxinfer import SamplingParams; "
            "assert 'jax' not in sys.modules and 'numpy' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('jax', 'numpy')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_constrained_request_waits_for_its_token_in_flight():
    """Asynchronous scheduling: a constrained request (structured outputs) sits out the
    step after one that samples it, until its token is read; the others go on."""
    from jaxinfer.engine.structured import StructuredOutputsParams

    s = _scheduler()
    s.add(_request("free", 4, arrival=0))
    s.add(_request("json", 4, arrival=1,
                   structured_outputs=StructuredOutputsParams(json_object=True)))
    first, chunks = _plan(s)
    assert chunks == [("free", 0, 4, 1), ("json", 0, 4, 1)]
    assert s.held_back_by_tokens()  # 1 of 2 running waits: the engine reads first
    second, chunks = _plan(s)  # planned before the first is read anyway
    assert chunks == [("free", 4, 1, 1)]
    json_request = first.chunks[1].request
    assert json_request.num_output_placeholders == 1
    s.update(first, [[7], [8]])
    assert not s.held_back_by_tokens()
    third, chunks = _plan(s)
    assert chunks == [("free", 5, 1, 1), ("json", 4, 1, 1)]  # its token read: back in
    assert json_request.output_token_ids == [8] and json_request.num_computed_tokens == 5
    s.update(second, [[9]])
    s.update(third, [[10], [11]])
    assert first.chunks[0].request.output_token_ids == [7, 9, 10]
    assert json_request.output_token_ids == [8, 11]
    for rid in "abc":  # three free requests to one constrained: it alone waits
        s.add(_request(rid, 4, arrival=2))
    plan, _ = _plan(s)
    assert len(s.running) == 4 and not s.held_back_by_tokens()
