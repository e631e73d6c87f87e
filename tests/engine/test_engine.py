"""The engine end to end: batching, chunked prefill and preemption against a naive
decode, seeds, compile counts, stop strings, n > 1, aborts and bad requests."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, checkpoint
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import GREEDY_TEMPERATURE, MAX_LOGPROBS
from jaxinfer.engine.runner import Sample
from jaxinfer.model import transformer

SMALL = dict(page_size=4, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64,
             compilation_cache_dir="")
PAGE_BYTES = 4 * 512  # tiny llama: 2 layers x K,V x 2 kv heads x 16 dims x 4 bytes per token


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def engine(hf_model_dirs, request):
    """Small token budget and a 24-page pool, so prefill is chunked and requests preempt;
    asynchronous scheduling on and off (every test using it runs both ways)."""
    return Engine(hf_model_dirs["llama"],
                  EngineConfig(**SMALL, kv_cache_memory_bytes=24 * PAGE_BYTES,
                               async_scheduling=request.param))


def _run(engine, prompts, params):
    ids = [f"r{i}-{id(prompts)}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    while any(not engine.output(i).finished for i in ids):
        engine.step()
    return [engine.release(i) for i in ids]


def _naive_greedy(model_dir, prompts, max_tokens, width=64):
    """One dense causal forward over the whole padded sequence per generated token."""
    cfg = checkpoint.load_config(model_dir)
    params = checkpoint.load_params(model_dir, cfg)
    forward = jax.jit(functools.partial(transformer.forward_dense, cfg=cfg))
    tokens = np.zeros((len(prompts), width), np.int32)
    lengths = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    outputs = [[] for _ in prompts]
    for _ in range(max(max_tokens)):
        logits = np.asarray(forward(params, jnp.asarray(tokens)))
        for i in range(len(prompts)):
            if len(outputs[i]) < max_tokens[i] and lengths[i] < width:
                token = int(logits[i, lengths[i] - 1].argmax())
                outputs[i].append(token)
                tokens[i, lengths[i]] = token
                lengths[i] += 1
    return outputs


def test_engine_golden_batched_chunked_preempted_equals_naive(engine, hf_model_dirs):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, size=int(rng.integers(2, 41))).tolist() for _ in range(64)]
    max_tokens = [int(rng.integers(1, 24)) for _ in range(64)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in max_tokens]
    before = engine.metrics.summary()
    outs = _run(engine, prompts, params)
    want = _naive_greedy(hf_model_dirs["llama"], prompts, max_tokens)
    assert [o.token_ids for o in outs] == want
    after = engine.metrics.summary()
    assert after["preemptions"] > before["preemptions"]  # the small pool forced some
    assert after["mean_requests_per_step"] > 2  # batched, not one at a time
    assert engine.scheduler.pool.num_used == 0  # every page came back


def test_engine_seeded_sampling_same_alone_and_in_a_batch(engine):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    (alone,) = _run(engine, [[5, 6, 7, 8]], [params])
    others = [SamplingParams(max_tokens=20, temperature=1.0, seed=s) for s in range(5)]
    batch = _run(engine, [[9, 9, 9], [5, 6, 7, 8], [1] * 30, [2, 3], [4] * 17, [8]],
                 [others[0], params, *others[1:]])
    assert batch[1].token_ids == alone.token_ids


def test_engine_no_compiles_after_warmup(hf_model_dirs):
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    llm = LLM(hf_model_dirs["qwen3"], strict_compile=True, **SMALL)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        rng = np.random.default_rng(1)
        prompts = [rng.integers(0, 256, size=int(rng.integers(1, 50))).tolist()
                   for _ in range(200)]
        params = [SamplingParams(max_tokens=int(rng.integers(1, 14)),
                                 temperature=float(rng.choice([0.0, 0.7])), seed=i)
                  for i in range(200)]
        outs = llm.generate(prompts, params)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(outs) == 200 and all(o.finished for o in outs)
    assert compiles == []
    assert llm.metrics()["compiles_after_warmup"] == 0


def test_engine_static_scheduler_gives_the_same_greedy_tokens(hf_model_dirs, engine):
    static = Engine(hf_model_dirs["llama"], EngineConfig(**SMALL, scheduler="static"))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(30, 60))]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 9, 3)]
    assert [o.token_ids for o in _run(static, prompts, params)] == \
        [o.token_ids for o in _run(engine, prompts, params)]


TINY_TEMPERATURES = (1e-4, 1e-5, 1e-9, 1e-10, 1e-20, 1e-37, 1e-40)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_tiny_temperatures_sample_the_top_token(hf_model_dirs, dtype):
    """Below GREEDY_TEMPERATURE a request is greedy, token for token; at and above it each
    drawn token is a top one (a logit within 1e-3 of the best has all but e^-100 of the
    mass at 1e-5). The fused step once drew id 0 at 1e-10 .. 1e-20."""
    engine = Engine(hf_model_dirs["llama"], EngineConfig(**SMALL, dtype=dtype))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], list(range(30, 60))]

    def run(temperature):
        params = [SamplingParams(max_tokens=12, temperature=temperature, seed=seed,
                                 ignore_eos=True, logprobs=1) for seed in range(len(prompts))]
        return _run(engine, prompts, params)

    greedy = [o.token_ids for o in run(0.0)]
    for temperature in TINY_TEMPERATURES:
        outputs = run(temperature)
        if temperature < GREEDY_TEMPERATURE:
            assert [o.token_ids for o in outputs] == greedy, temperature
            continue
        for output in outputs:
            for token, entry in zip(output.token_ids, output.logprobs, strict=True):
                best = max(lp.logprob for lp in entry.values())
                assert entry[token].logprob >= best - 1e-3, (temperature, entry)


def test_engine_n_completions_differ_and_follow_the_seed(engine):
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=11)
    (first,) = _run(engine, [[1, 2, 3]], [params])
    (again,) = _run(engine, [[1, 2, 3]], [params])
    assert len(first.outputs) == 3
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]


def test_engine_abort_frees_pages_and_others_finish(engine):
    engine.add_request("keep", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0))
    engine.add_request("drop", [4, 5, 6], SamplingParams(max_tokens=30, temperature=0.0))
    engine.step()
    engine.abort("drop")
    assert engine.output("drop").finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert len(engine.release("keep").token_ids) == 6
    assert len(engine.release("drop").token_ids) < 30
    assert engine.scheduler.pool.num_used == 0


def test_engine_bad_requests_are_refused_and_others_served(engine):
    engine.add_request("good", [7, 7], SamplingParams(max_tokens=4, temperature=0.0))
    with pytest.raises(ValueError, match="the prompt has 64 tokens; max_model_len 64"):
        engine.add_request("long", list(range(64)), SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good", [1], SamplingParams())
    with pytest.raises(TypeError, match="not SamplingParams"):
        engine.add_request("typo", [1], {"max_tokens": 3})
    while engine.has_unfinished():
        engine.step()
    assert engine.release("good").finish_reason == "length"


def test_engine_penalties_and_min_tokens(engine):
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    (greedy,) = _run(engine, [[10, 11, 12]], [plain])
    repeated = max(set(greedy.token_ids), key=greedy.token_ids.count)
    penalized = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                               frequency_penalty=2.0)
    (out,) = _run(engine, [[10, 11, 12]], [penalized])
    assert out.token_ids.count(repeated) <= greedy.token_ids.count(repeated)
    assert out.token_ids != greedy.token_ids or greedy.token_ids.count(repeated) == 1
    stop = greedy.token_ids[0]
    (early,) = _run(engine, [[10, 11, 12]], [SamplingParams(
        max_tokens=16, temperature=0.0, stop_token_ids=[stop])])
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    (late,) = _run(engine, [[10, 11, 12]], [SamplingParams(
        max_tokens=16, temperature=0.0, stop_token_ids=[stop], min_tokens=3)])
    assert stop not in late.token_ids[:3] and len(late.token_ids) >= 3


@pytest.mark.parametrize("caching", [False, True])
def test_engine_metrics_count_tokens_computed_and_returned(hf_model_dirs, caching):
    """generated_tokens: tokens returned; prompt_tokens: prompt tokens computed, cache hits
    apart in prompt_tokens_cached; computed_tokens: every token the device ran."""
    engine = Engine(hf_model_dirs["llama"], EngineConfig(
        **SMALL, kv_cache_memory_bytes=64 * PAGE_BYTES, enable_prefix_caching=caching))
    shared = list(range(100, 113))  # 13 tokens: three full pages to share
    greedy = dict(temperature=0.0, ignore_eos=True)
    first = _run(engine, [shared + [1]], [SamplingParams(max_tokens=4, **greedy)])
    prompts = [shared + [2, 3], shared + [4], [5, 6, 7], list(range(30, 60))]
    params = [SamplingParams(max_tokens=m, **greedy) for m in (7, 1, 5)]
    params.append(SamplingParams(max_tokens=6, stop_token_ids=tuple(range(260))))  # 1 token
    outs = first + _run(engine, prompts, params)
    metrics = engine.metrics.summary()
    returned = [len(o.token_ids) for o in outs]
    assert returned == [4, 7, 1, 5, 1] and outs[-1].finish_reason == "stop"
    cached = [o.num_cached_tokens for o in outs]
    assert cached == ([0, 12, 12, 0, 0] if caching else [0] * 5)
    prompt_lens = [len(shared) + 1] + [len(p) for p in prompts]
    assert metrics["generated_tokens"] == sum(returned) == 18
    assert metrics["prompt_tokens"] == sum(prompt_lens) - sum(cached)
    assert metrics["prompt_tokens_cached"] == sum(cached)
    assert metrics["preemptions"] == 0
    # Each request ran its computed prompt tokens, then fed back each output but the last.
    assert metrics["computed_tokens"] == metrics["prompt_tokens"] + sum(returned) - len(outs)
    assert metrics["generated_tokens_per_s"] > 0 and metrics["prompt_tokens_per_s"] > 0
    # Model FLOPs: every computed position through the layers, attending position + 1
    # tokens in each layer; the LM head once per returned token (the last request's
    # position after its stop, computed by the asynchronous step, is not counted).
    count, flops = engine.metrics.flop_count, 0
    for prompt_len, hits, n in zip(prompt_lens, cached, returned, strict=True):
        positions = range(hits, prompt_len + n - 1)
        flops += (len(positions) * count.matmul_per_token + n * count.head_per_sample
                  + 2 * count.attention_per_position * sum(p + 1 for p in positions))
    assert count.windows == ((None, 2),) and metrics["model_flops"] == flops
    assert metrics["discarded_tokens"] >= 1  # asynchronous: the stopped request's next step
    assert metrics["peak_flops_source"] == "measured" and 0 < metrics["mfu"] <= 1
    assert metrics["achieved_tflops"] > 0 and metrics["peak_tflops"] > 0


def _samples(token_ids):
    top = np.full(MAX_LOGPROBS, -1, np.int32), np.full(MAX_LOGPROBS, -np.inf, np.float32)
    return [Sample(t, -0.5 - i, *top, proposed_logprob=-np.inf) for i, t in enumerate(token_ids)]


def test_engine_records_several_tokens_per_step_up_to_a_stop_string(hf_model_dirs):
    """The host half of a step whose chunks sample 4 positions (as with 3 draft tokens):
    the device is not run; the tokens come from the test. Byte tokenizer: id = byte."""
    engine = Engine(hf_model_dirs["llama"], EngineConfig(**SMALL), warm_up=False)
    engine.add_request("s", [1, 2, 3, 4, 5], SamplingParams(stop=["cd"], logprobs=0))
    engine.add_request("z", [6, 7, 8, 9, 10], SamplingParams(stop_token_ids=[ord("z")]))
    engine.add_request("l", [11, 12, 13, 14, 15], SamplingParams(max_tokens=3, stop=["cd"]))
    plan = engine.scheduler.schedule()
    plan = dataclasses.replace(plan, chunks=tuple(
        dataclasses.replace(c, num_samples=4) for c in plan.chunks))
    samples = [_samples(b"xcde"), _samples(b"xyzw"), _samples(b"cdxy")]
    lengths = [0, 0, 0]
    engine.scheduler.update(plan, [[s.token_id for s in chunk] for chunk in samples])
    assert engine._record_tokens(plan, samples, lengths) == ["s", "z", "l"]
    engine.metrics.record_plan(plan.chunks, lengths, 16, 4, seconds=0.1, dropped=[False] * 3,
                               pages_in_use=0, weight_bytes=0, kv_bytes_per_token=0)
    s, z, l = (engine._sync(rid) for rid in "szl")
    # The token completing the stop string ends it; the tokens after it are dropped.
    assert (s.token_ids, s.text, s.finish_reason, s.outputs[0].stop_reason) == (
        list(b"xcd"), "x", "stop", "cd")
    assert [{t: lp.logprob for t, lp in e.items()} for e in s.logprobs] == [
        {ord("x"): -0.5}, {ord("c"): -1.5}, {ord("d"): -2.5}]
    assert (z.token_ids, z.text, z.finish_reason, z.outputs[0].stop_reason) == (
        list(b"xyz"), "xyz", "stop", ord("z"))  # the scheduler dropped "w"
    # max_tokens ended it at "x", after the stop string: the stop string's end stands.
    assert (l.token_ids, l.text, l.finish_reason, l.outputs[0].stop_reason) == (
        list(b"cd"), "", "stop", "cd")
    assert engine.metrics.generated_tokens == 8 and engine.metrics.prompt_tokens == 15
    assert not engine.has_unfinished() and engine.scheduler.pool.num_used == 0
