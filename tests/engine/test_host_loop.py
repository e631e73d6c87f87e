"""The host loop: what a step sends does not grow with context, and asynchronous
scheduling gives exactly what synchronous steps give."""

from __future__ import annotations

import string

import numpy as np
import pytest

from jaxinfer import SamplingParams, testing
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine

SMALL = dict(page_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
             compilation_cache_dir="")
PAGE_BYTES = 4 * 512  # tiny llama: 2 layers x K,V x 2 kv heads x 16 dims x 4 bytes per token


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("long-llama")
    testing.make_hf_model(path, "llama", max_position_embeddings=32768)
    return path


def _decode_step_bytes(engine: Engine, prompt_len: int) -> int:
    """Bytes the runner sent for the decode step at KV length prompt_len + 1 of two
    requests with prompts of `prompt_len` tokens."""
    sent = []
    dispatch = engine.runner.dispatch

    def recording(plan, *args):
        step = dispatch(plan, *args)
        sent.append(([(c.start, c.num_tokens) for c in plan.chunks],
                     engine.runner.last_step_bytes))
        return step

    engine.runner.dispatch = recording
    rng = np.random.default_rng(prompt_len)
    for i in range(2):
        engine.add_request(f"{prompt_len}-{i}", rng.integers(0, 256, prompt_len).tolist(),
                           SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                          repetition_penalty=1.2))
    while engine.has_unfinished():
        engine.step()
    engine.runner.dispatch = dispatch
    (step_bytes,) = [b for chunks, b in sent if chunks == [(prompt_len, 1)] * 2]
    return step_bytes


def test_decode_step_sends_the_same_bytes_at_any_context_and_max_model_len(long_model):
    def engine(max_model_len):
        return Engine(long_model, EngineConfig(
            page_size=16, max_num_seqs=2, max_num_batched_tokens=4096, compilation_cache_dir="",
            max_model_len=max_model_len, kv_cache_memory_bytes=2100 * 16 * 512), warm_up=False)

    short, long = engine(2048), engine(32768)
    # KV lengths 96 and 1904 end on a page boundary: neither step appends a page id.
    sizes = {(2048, 96): _decode_step_bytes(short, 95),
             (32768, 96): _decode_step_bytes(long, 95),
             (32768, 1904): _decode_step_bytes(long, 1903)}
    assert len(set(sizes.values())) == 1, sizes
    # Two requests' tokens, slots, lengths and page-id room: no page table or history row
    # (one history row of max_model_len 2048 alone is 8 KiB).
    assert sizes[(2048, 96)] < 1024
    assert long.metrics.summary()["host_to_device_bytes_per_step"] > 0


def _workload():
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 256, 13).tolist()
    prompts, params = [], []
    for i in range(18):
        prompt = (shared if i % 3 == 0 else []) + rng.integers(0, 256, int(rng.integers(2, 30))
                                                             ).tolist()
        prompts.append(prompt)
        params.append(SamplingParams(
            max_tokens=int(rng.integers(1, 20)), temperature=[0.0, 0.8, 1.0][i % 3],
            top_p=0.9 if i % 4 == 1 else 1.0, seed=i, logprobs=2 if i % 5 == 0 else None,
            stop=tuple(string.ascii_letters + string.digits) if i % 6 == 2 else (),
            stop_token_ids=tuple(range(0, 256, 5)) if i % 7 == 3 else (),
            repetition_penalty=1.3 if i % 4 == 2 else 1.0,
            frequency_penalty=0.5 if i % 8 == 5 else 0.0,
            n=2 if i % 9 == 4 else 1, ignore_eos=i % 2 == 0))
    return prompts, params


def _stream(engine: Engine, prompts, params, abort_after: dict[str, int]):
    """Every non-empty delta of every completion, in order, and the final outputs;
    prompt `rid` is aborted once it has `abort_after[rid]` tokens."""
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    deltas: dict[tuple[str, int], list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            for c in out.outputs:
                if c.delta_token_ids or c.delta_text:
                    deltas.setdefault((out.request_id, c.index), []).append(
                        (c.delta_token_ids, c.delta_text))
            limit = abort_after.get(out.request_id)
            if limit is not None and len(out.token_ids) >= limit and not out.finished:
                engine.abort(out.request_id)
    return deltas, [engine.release(i) for i in ids]


def _late_arrivals(engine: Engine) -> list[int]:
    """Prefix-cache hits of two prompts that share 36 tokens with one whose 40-token
    prompt is still computing (it takes two steps) when they arrive."""
    prefix = list(range(40, 76))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("late0", prefix + [1, 2, 3, 4], params)
    engine.step()
    for i in (1, 2):
        engine.add_request(f"late{i}", prefix + [i] * 5, params)
    while engine.has_unfinished():
        engine.step()
    return [engine.release(f"late{i}").num_cached_tokens for i in range(3)]


def _same(sync_out, async_out):
    for a, s in zip(async_out.outputs, sync_out.outputs, strict=True):
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
            (s.token_ids, s.text, s.finish_reason, s.stop_reason)
        assert (a.logprobs is None) == (s.logprobs is None)
        for mine, theirs in zip(a.logprobs or [], s.logprobs or [], strict=True):
            assert mine.keys() == theirs.keys()
            for token, lp in mine.items():
                assert lp.logprob == pytest.approx(theirs[token].logprob, abs=1e-5)
                assert lp.rank == theirs[token].rank


def test_async_scheduling_gives_what_synchronous_steps_give(hf_model_dirs):
    """Greedy and seeded sampling, logprobs, stop strings and tokens, max_tokens,
    penalties, n, prefix hits, preemption in a small pool, streaming deltas and an abort
    mid-stream: the same both ways, with no compilation after warm-up."""
    prompts, params = _workload()
    results = {}
    for flag in (False, True):
        engine = Engine(hf_model_dirs["llama"], EngineConfig(
            **SMALL, kv_cache_memory_bytes=20 * PAGE_BYTES, async_scheduling=flag,
            strict_compile=True))
        assert engine.async_scheduling is flag
        results[flag] = _stream(engine, prompts, params, abort_after={"p1": 3})
        results[flag] += (_late_arrivals(engine),)
        metrics = engine.metrics.summary()
        assert metrics["preemptions"] > 0 and metrics["prefix_cache_hit_tokens"] > 0
        assert metrics["compiles_after_warmup"] == 0
        assert engine.scheduler.pool.num_used == 0
        results[flag] += (metrics,)
    (sync_deltas, sync_outs, sync_hits, sync_m), (async_deltas, async_outs, async_hits,
                                                   async_m) = results[False], results[True]
    for s, a in zip(sync_outs, async_outs, strict=True):
        _same(s, a)
    # Hits in the tight pool depend on when freed pages are evicted; with room, they match:
    # the late prompts find all 36 tokens they share with late0: 32 from its first step,
    # 4 on the page it computes in the step they are admitted in.
    assert async_hits == sync_hits == [0, 36, 36]
    assert async_deltas == sync_deltas
    assert sync_outs[1].outputs[0].finish_reason == "abort"
    assert len(sync_outs[1].token_ids) == 3
    reasons = [o.stop_reason for s in sync_outs for o in s.outputs]
    assert any(isinstance(r, str) for r in reasons) and any(isinstance(r, int) for r in reasons)
    # Stops read one step late cost positions computed and discarded, never returned.
    assert sync_m["discarded_tokens"] == 0 < async_m["discarded_tokens"]
    assert async_m["generated_tokens"] == sync_m["generated_tokens"]


def test_penalized_request_on_a_long_prefix_hit_equals_one_computed_whole(hf_model_dirs):
    """A penalized request placed on a 300-token prefix hit gets its history from
    admission calls (more than one: 300 positions) and samples what it samples with
    the prefix computed in its own steps."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, 256, 300).tolist()
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.8,
                            frequency_penalty=0.7, presence_penalty=0.4, ignore_eos=True)
    outputs, hits = [], []
    for caching in (True, False):
        engine = Engine(hf_model_dirs["llama"], EngineConfig(
            page_size=4, max_num_seqs=2, max_num_batched_tokens=512, max_model_len=512,
            compilation_cache_dir="", enable_prefix_caching=caching), warm_up=False)
        engine.add_request("first", prefix + [7], SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        engine.add_request("penalized", prefix + [1, 2, 3], params)
        while engine.has_unfinished():
            engine.step()
        out = engine.release("penalized")
        outputs.append(out.token_ids)
        hits.append(out.num_cached_tokens)
    assert hits == [300, 0]
    assert outputs[0] == outputs[1]
    assert len(set(outputs[0])) > 6  # the penalties at work: no loop of one token
