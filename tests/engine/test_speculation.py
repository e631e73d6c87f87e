"""Speculative decoding on the host: the n-gram proposer, drafts in the scheduler (pages,
rollback, prefix registration, stops), the cost policy, the config. No device."""

from __future__ import annotations

import json

import pytest

from jaxinfer.config import EngineConfig, SpeculativeConfig
from jaxinfer.engine.core.buckets import Bucket, BucketSet
from jaxinfer.engine.core.page_pool import PagePool
from jaxinfer.engine.core.scheduler import Scheduler
from jaxinfer.engine.request import Request, SamplingParams, Status
from jaxinfer.engine.spec_decode.policy import EXPLORE_EVERY, Policy, expected_tokens
from jaxinfer.engine.spec_decode.proposer import NgramProposer
from jaxinfer.engine.spec_decode.speculation import Speculation

EOS = 99


def _request(tokens, *, outputs=(), rid="r", **params):
    params = SamplingParams(**({"max_tokens": 32, "temperature": 0.0} | params))
    return Request(request_id=rid, prompt_token_ids=list(tokens), params=params, arrival=0,
                   seed=0, output_token_ids=list(outputs))


def _decoding(scheduler, prompt, rid="r", **params):
    """A request whose prompt is computed and first token sampled: the next step is its
    first decode."""
    request = _request(prompt, rid=rid, **params)
    scheduler.add(request)
    plan = scheduler.schedule()
    scheduler.update(plan, [[7]])
    return request


def _scheduler(num_pages=32, caching=False, **kw):
    kw = {"page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16,
          "max_model_len": 64, "eos_token_ids": [EOS]} | kw
    return Scheduler(PagePool(num_pages, enable_caching=caching), **kw)


# ---- n-gram lookup ------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match_longest_first():
    proposer = NgramProposer(min_n=1, max_n=3)
    # "5 6 7" occurs at 0 (then 8 9) and the suffix "6 7" also at 10 (then 1): the longest
    # suffix match ("5 6 7", n = 3) wins over the later 2-gram.
    request = _request([5, 6, 7, 8, 9, 3, 3, 3, 3, 4, 6, 7, 1, 2, 5, 6, 7])
    assert proposer.propose(request, 2) == [8, 9]
    # Without a 3-gram match the latest 2-gram match ("6 7" at 10) proposes.
    assert proposer.propose(_request([6, 7, 1, 6, 7, 2, 0, 6, 7]), 2) == [2, 0]


def test_ngram_copies_on_over_a_repeating_pattern_and_extends_incrementally():
    proposer = NgramProposer(min_n=2, max_n=2)
    request = _request([1, 2, 3, 1, 2])
    assert proposer.propose(request, 5) == [3, 1, 2, 3, 1]  # period 3, copied past the end
    request.output_token_ids += [9, 1, 2]  # new tokens: the index takes them in
    assert proposer.propose(request, 3) == [9, 1, 2]  # the latest "1 2" is followed by 9


def test_ngram_without_a_match_or_room_proposes_nothing():
    proposer = NgramProposer(min_n=2, max_n=4)
    assert proposer.propose(_request([1, 2, 3, 4, 5]), 4) == []
    assert proposer.propose(_request([1, 2, 1, 2]), 0) == []
    assert proposer.propose(_request([1]), 3) == []
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=3, max_n=2)


# ---- drafts in the scheduler --------------------------------------------------------

def test_rejected_drafts_roll_back_and_free_their_pages():
    s = _scheduler()
    request = _decoding(s, range(1, 7))  # 6 prompt tokens + the sampled 7: 7 tokens
    assert (request.num_computed_tokens, request.page_ids) == (6, [[1, 2]])
    plan = s.schedule()
    assert s.reserve_drafts(plan, [4]) == [4]  # positions 6..10: pages 1, 2, 3
    plan = s.with_drafts(plan, [[10, 11, 12, 13]])
    (chunk,) = plan.chunks
    assert (chunk.start, chunk.num_tokens, chunk.num_samples) == (6, 5, 5)
    assert chunk.token_ids == [7, 10, 11, 12, 13] and request.page_ids == [[1, 2, 3]]
    # The target agrees with 10 and 11, then says 20 where 12 was proposed.
    s.update(plan, [[10, 11, 20, 30, 40]])
    assert request.output_token_ids == [7, 10, 11, 20]
    assert request.num_computed_tokens == 9  # 6 + the fed 7, 10, 11; not 20
    assert request.page_ids == [[1, 2, 3]]  # 10 tokens need 3 pages
    plan = s.schedule()
    s.reserve_drafts(plan, [4])
    assert request.page_ids == [[1, 2, 3, 4]]
    s.update(s.with_drafts(plan, [[1, 2, 3, 4]]), [[5, 6, 7, 8, 9]])  # all rejected
    assert request.output_token_ids[-1] == 5 and request.num_computed_tokens == 10
    assert request.page_ids == [[1, 2, 3]] and s.pool.num_free == 31 - 3  # page 4 freed


def test_all_drafts_accepted_add_the_bonus_token():
    s = _scheduler()
    request = _decoding(s, range(1, 5))
    plan = s.schedule()
    s.reserve_drafts(plan, [3])
    s.update(s.with_drafts(plan, [[10, 11, 12]]), [[10, 11, 12, 13]])
    assert request.output_token_ids == [7, 10, 11, 12, 13]
    assert request.num_computed_tokens == 8  # 4 + 7, 10, 11, 12


def test_a_stop_inside_the_accepted_drafts_ends_the_request_there():
    s = _scheduler()
    request = _decoding(s, range(1, 5), max_tokens=10)
    plan = s.schedule()
    s.reserve_drafts(plan, [3])
    finished = s.update(s.with_drafts(plan, [[10, EOS, 12]]), [[10, EOS, 12, 13]])
    assert finished == [request] and request.output_token_ids == [7, 10, EOS]
    assert request.status is Status.FINISHED and s.pool.num_used == 0
    other = _decoding(s, range(1, 5), rid="m", max_tokens=3)  # 1 output so far
    plan = s.schedule()
    assert s.reserve_drafts(plan, [4]) == [4]
    s.update(s.with_drafts(plan, [[10, 11, 12, 13]]), [[10, 11, 12, 13, 14]])
    assert other.output_token_ids == [7, 10, 11] and other.finish_reason == "length"


def test_drafts_get_no_pages_past_the_context_or_the_pool_and_never_preempt():
    s = _scheduler(max_model_len=10)
    request = _decoding(s, range(1, 8))  # 8 tokens, 7 computed: pages 1, 2
    assert s.reserve_drafts(s.schedule(), [5]) == [2]  # positions 8, 9: the context ends
    assert request.page_ids == [[1, 2, 3]]
    full = _scheduler(num_pages=3)  # 2 usable pages, both held by the request
    held = _decoding(full, range(1, 8))
    assert full.reserve_drafts(full.schedule(), [3]) == [0]  # no free page: no drafts
    assert held.page_ids == [[1, 2]] and held.status is Status.RUNNING
    assert full.num_preemptions == 0


def test_prefix_cache_registers_only_accepted_tokens():
    s = _scheduler(caching=True)
    request = _decoding(s, range(1, 4))  # 3 prompt tokens + 7
    plan = s.schedule()
    s.reserve_drafts(plan, [4])
    s.update(s.with_drafts(plan, [[8, 9, 10, 11]]), [[8, 5, 6, 6, 6]])
    # computed: 1 2 3 7 8 (5 tokens); tokens 1 2 3 7 8 5: page 1 full and registered
    assert request.num_computed_tokens == 5 and len(request.page_serials) == 1
    assert s.pool.match([1, 2, 3, 7, 8, 5, 0, 0], 4, 2)[0] == [request.page_ids[0][0]]
    assert s.pool.match([1, 2, 3, 7, 8, 9, 10, 11], 4, 2)[0] == [request.page_ids[0][0]]
    assert s.pool.num_cached == 1  # the page of rejected drafts 9, 10, 11 was not cached


def test_pages_filled_by_accepted_drafts_are_cached_with_their_tokens():
    s = _scheduler(caching=True)
    request = _decoding(s, range(1, 4))  # 1 2 3 7: one page, computed 3
    plan = s.schedule()
    s.reserve_drafts(plan, [6])
    # All six accepted: computed 1 2 3 7 | 8 9 10 11 | 12 13 (10), the bonus 14 appended
    s.update(s.with_drafts(plan, [[8, 9, 10, 11, 12, 13]]), [[8, 9, 10, 11, 12, 13, 14]])
    assert request.num_computed_tokens == 10 and len(request.page_serials) == 2
    pages, _ = s.pool.match([1, 2, 3, 7, 8, 9, 10, 11, 0], 4, 2)
    assert pages == request.page_ids[0][:2]
    # A stop inside the run: only the pages of tokens kept are registered.
    s = _scheduler(caching=True)
    stopped = _decoding(s, [5, 5, 5])
    plan = s.schedule()
    s.reserve_drafts(plan, [6])
    s.update(s.with_drafts(plan, [[1, 1, 1, EOS, 1, 1]]), [[1, 1, 1, EOS, 1, 1, 1]])
    assert stopped.output_token_ids == [7, 1, 1, 1, EOS] and s.pool.num_used == 0
    assert len(s.pool.match([5, 5, 5, 7, 1, 1, 1, EOS, 0], 4, 2)[0]) == 2
    assert s.pool.num_cached == 2


# ---- the cost policy ----------------------------------------------------------------

def _policy(decode, verify, draft_step=0.0, trusted=True, **kw):
    """A policy with measured step times at S = 1 and, `trusted`, an engine-wide
    acceptance rate of 1/2 over 64 verified drafts (another request's)."""
    policy = Policy(4, free_proposals=True, **kw)
    policy.seed("decode", 1, decode)
    policy.seed("verify", 1, verify)
    for _ in range(32 if trusted else 0):
        policy.record_acceptance(_request([0], rid="earlier"), 4, 1)
    if draft_step:
        for steps in (1, 5):
            policy.seed_draft(1, steps, draft_step * steps)
    return policy


def test_policy_speculates_when_verifying_is_cheap_and_not_when_compute_bound():
    requests = [_request([1, 2, 3], rid=str(i)) for i in range(1)]
    assert _policy(1.0, 1.2).choose(requests, 1, [4], draft_model=False) == 4
    # E(0.5, 4) = 1.94 tokens for 5x the time of a decode: no.
    assert _policy(1.0, 5.0).choose(requests, 1, [4], draft_model=False) == 0
    assert expected_tokens(0.5, 4) == pytest.approx(1.9375)
    fixed = _policy(1.0, 5.0, adaptive=False)
    assert fixed.choose(requests, 1, [4], draft_model=False) == 4


def test_policy_runs_fewer_draft_steps_when_acceptance_is_low():
    request = _request([1, 2, 3])
    policy = _policy(1.0, 1.0, draft_step=0.3)
    for _ in range(50):  # the draft is never right
        policy.record_acceptance(request, 4, 0)
    assert policy.acceptance(request) < 0.05
    assert policy.choose([request], 1, [4], draft_model=True) == 0
    good = _request([1, 2, 3], rid="g")
    policy = _policy(1.0, 1.0, draft_step=0.05)
    for _ in range(50):
        policy.record_acceptance(good, 4, 4)
    assert policy.choose([good], 1, [4], draft_model=True) == 4
    policy = _policy(1.0, 1.0, draft_step=0.05)
    for _ in range(50):
        policy.record_acceptance(good, 2, 1)  # a = 1/2: more drafts add less and less
    chosen = policy.choose([good], 1, [4], draft_model=True)
    assert 1 <= chosen < 4


def _choices(policy, request, steps, times):
    """The policy's choices over `steps` steps, each step's time fed back as measured."""
    out = []
    for _ in range(steps):
        k = policy.choose([request], 1, [4], draft_model=False)
        policy.seed("verify" if k else "decode", 1, times[bool(k)])
        out.append(k)
    return out


def test_policy_measures_a_stale_option_again_when_it_is_close():
    request = _request([1, 2, 3])
    # speculation: E(0.5, 4) / 1.6 = 1.21 tokens per second, decode 1: within 0.8
    choices = _choices(_policy(1.0, 1.6), request, 130, {False: 1.0, True: 1.6})
    assert choices.count(0) == 2 and choices[0] == 4  # decode measured again twice
    # A decode estimate too slow (a noisy moment) does not keep it speculating: decode is
    # measured again every 64 steps whatever its estimate, and wins once it is right.
    choices = _choices(_policy(10.0, 2.5), request, 300, {False: 1.0, True: 2.5})
    assert choices[:63] == [4] * 63 and choices[63] == 0 and choices[127:] == [0] * 173
    # Speculation far slower than decoding: never tried again.
    choices = _choices(_policy(1.0, 3.0), request, 200, {False: 1.0, True: 3.0})
    assert choices.count(4) == 0
    # Speculation a little slower (within 0.8): tried again every 64 steps.
    choices = _choices(_policy(1.0, 2.1), request, 130, {False: 1.0, True: 2.1})
    assert choices.count(4) == 2
    # Far slower, but the acceptance rate is the prior's guess: tried again too.
    choices = _choices(_policy(1.0, 3.0, trusted=False), request, 130,
                       {False: 1.0, True: 3.0})
    assert choices.count(4) == 2


def test_policy_skips_proposing_when_even_full_acceptance_loses():
    assert _policy(1.0, 4.9).may_pay(1)  # 5 tokens in 4.9 s beat 1 in 1 s
    policy = _policy(1.0, 6.0)  # K + 1 = 5 tokens in 6 s: never better than decoding
    assert not any(policy.may_pay(1) for _ in range(EXPLORE_EVERY))
    assert policy.may_pay(1)  # verify unmeasured for 64 steps, and 5/6 >= 0.8: look again
    assert not any(_policy(1.0, 7.0).may_pay(1) for _ in range(200))  # 5/7 < 0.8
    assert Policy(4).may_pay(1) and _policy(1.0, 9.0, adaptive=False).may_pay(1)


def test_ngram_lookups_run_only_where_full_proposals_could_pay():
    requests = [_request([1, 2, 3], rid=str(i)) for i in range(3)]
    policy = _policy(1.0, 4.5)  # may pay (5 tokens in 4.5 s), but at a = 1/2 E = 1.94
    assert policy.may_pay(1)
    assert not policy.worth_proposing(requests, 1, [4, 4, 4], draft_model=False)
    assert _policy(1.0, 1.5).worth_proposing(requests, 1, [4, 4, 4], draft_model=False)
    untrusted = _policy(1.0, 4.5, trusted=False)  # the prior's guess: look every 64 steps
    answers = [untrusted.worth_proposing(requests, 1, [4] * 3, False) for _ in range(65)]
    assert answers == [False] * 64 + [True]
    untrusted.free_proposals = False  # a draft model: its catch-up is not paid on a guess
    assert not any(untrusted.worth_proposing(requests, 1, [4] * 3, False) for _ in range(65))


def test_policy_estimates_draft_time_between_measured_lengths():
    policy = Policy(4)
    policy.seed_draft(2, 1, 1.0)
    assert policy.draft_seconds(2, 2) == pytest.approx(3.0)  # one length: proportional
    policy.seed_draft(2, 5, 3.0)
    assert policy.draft_seconds(2, 2) == pytest.approx(2.0)  # 3 steps on the line
    assert policy.draft_seconds(2, 4) == pytest.approx(3.0) and policy.draft_seconds(4, 1) == 0


def test_speculation_skips_prompt_chunks_and_counts_why():
    s = _scheduler()
    request = _request(range(1, 7))
    s.add(request)
    spec = Speculation(NgramProposer(min_n=1, max_n=2), max_drafts=3, adaptive=False)
    plan = s.schedule()  # the prompt chunk
    assert spec.add_drafts(s, plan, 1) == (plan, None)
    s.update(plan, [[3]])
    plan, probs = spec.add_drafts(s, s.schedule(), 1)  # tokens 1..6 3: "3" then 4 5 6
    assert probs is None and plan.chunks[0].draft_token_ids == (4, 5, 6)
    s.update(plan, [[4, 5, 9, 9]])
    spec.record(plan, [[4, 5, 9, 9]], 1, 0.01)
    stats = spec.stats.summary(1.0)
    assert (stats["spec_draft_tokens"], stats["spec_accepted_tokens"]) == (3, 2)
    assert stats["spec_skipped_prompt_chunks"] == 1
    assert stats["spec_accepted_per_position"] == [1, 1, 0]
    assert stats["spec_mean_acceptance_length"] == 3.0
    assert stats["spec_tokens_per_request_step"] == 3.0  # one verify step, 3 tokens


def test_no_speculation_in_steps_of_disable_by_batch_size_requests():
    s = _scheduler()
    spec = Speculation(NgramProposer(min_n=1, max_n=2), max_drafts=2, adaptive=False,
                       disable_by_batch_size=2)
    first = _decoding(s, [5, 7, 8, 9], rid="a")  # 5 7 8 9 7: "7" matched, 8 9 proposed
    plan, _ = spec.add_drafts(s, s.schedule(), 1)
    assert plan.chunks[0].draft_token_ids == (8, 9)
    s.update(plan, [[5]])
    s.add(_request([3, 4], rid="b"))
    s.update(s.schedule(), [[1], [6]])  # a decodes, b's prompt chunk: both decode next
    plan = s.schedule()
    assert len(plan.chunks) == 2 and spec.add_drafts(s, plan, 2) == (plan, None)
    assert spec.stats.skipped["batch_size"] == 2 and first.num_tokens == 7


# ---- configuration ------------------------------------------------------------------

def test_speculative_config_from_dict_json_and_errors():
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert config.speculative_config == SpeculativeConfig(method="ngram",
                                                          num_speculative_tokens=3)
    text = json.dumps({"method": "draft_model", "model": "/d", "num_speculative_tokens": 2})
    assert EngineConfig(speculative_config=text).speculative_config.model == "/d"
    # vLLM's shape without "method": inferred from "model"
    inferred = SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 2,
                                        "disable_by_batch_size": 8})
    assert (inferred.method, inferred.disable_by_batch_size) == ("draft_model", 8)
    assert SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2}) == \
        SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    bad = [({"method": "eagle", "num_speculative_tokens": 2}, "method='eagle'"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
           ({"method": "draft_model", "num_speculative_tokens": 2}, "model=None"),
           ({"method": "ngram", "num_speculative_tokens": 2, "model": "/d"}, "model='/d'"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5},
            "prompt_lookup_min=5"),
           ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys \\['k'\\]"),
           ({"method": "ngram"}, "lacks \\['num_speculative_tokens'\\]"),
           ("{not json", "not valid JSON"), ("[1]", "must be a JSON object"),
           ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "disable_by_batch_size=0"),
           ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "draft_tensor_parallel_size is for"),
           ({"model": "/d"}, "lacks \\['num_speculative_tokens'\\]"),
           ({"num_speculative_tokens": 2}, "lacks \\['method'\\]")]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            EngineConfig(speculative_config=value)


def test_verify_buckets_hold_k_plus_one_tokens_a_request():
    buckets = BucketSet(max_num_batched_tokens=64, max_num_seqs=8, verify_positions=5)
    assert buckets.verify() == [Bucket(5 * s, s, num_positions=5) for s in (1, 2, 4, 8)]
    assert buckets.pick(13, 3, verify=True) == Bucket(20, 4, num_positions=5)
    assert buckets.pick(3, 3, verify=True) == Bucket(20, 4, num_positions=5)
    with pytest.raises(ValueError, match="exceed the verify buckets"):
        buckets.pick(16, 3, verify=True)
    assert BucketSet(max_num_batched_tokens=64, max_num_seqs=8).verify() == []
