"""Speculative heads end to end (EAGLE-3, EAGLE-1, Medusa): greedy outputs equal the
plain engine's over the workload of test_speculative_engine (batching, chunked prefill,
prefix-cache hits, preemption) with random heads written in their published layouts;
the method is inferred from the checkpoint; the trained demo heads agree with the demo
model; the planner counts the heads' bytes; nothing compiles after warm-up.

Random heads rarely agree with the target, so rejections run everywhere; exactness
must not depend on the heads being right (tests/model/test_eagle.py checks that they
are).
"""

from __future__ import annotations

import pathlib

import jax
import pytest

from jaxinfer import checkpoint
from jaxinfer.checkpoint import heads as heads_checkpoint
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.request import SamplingParams
from jaxinfer.engine.spec_decode import loading as spec_loading
from tests.engine.test_speculative_engine import (
    DEMO,
    SMALL,
    _demo_prompts,
    _greedy,
    _workload,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
SAVERS = {"eagle3": heads_checkpoint.save_eagle3, "eagle": heads_checkpoint.save_eagle,
          "medusa": heads_checkpoint.save_medusa}
# the tiny llama has 2 layers: EAGLE-3's default capture points need 3, so they are given
SHAPES = {"eagle3": dict(eagle_aux_hidden_state_layer_ids=[0, 1, 2], draft_vocab_size=128),
          "eagle": {}, "medusa": dict(num_heads=4)}


def _write_head(path, method, target_dir, seed=0):
    target = checkpoint.load_config(target_dir)
    head, params = heads_checkpoint.random_head(method, target, jax.random.key(seed),
                                                **SHAPES[method])
    SAVERS[method](path, head, params, target)
    return head


@pytest.fixture(scope="module")
def head_dirs(hf_model_dirs, tmp_path_factory):
    out = {}
    for i, method in enumerate(SAVERS):
        out[method] = tmp_path_factory.mktemp(f"head-{method}")
        _write_head(out[method], method, hf_model_dirs["llama"], seed=i)
    return out


@pytest.fixture(scope="module")
def plain_tokens(hf_model_dirs):
    engine = Engine(hf_model_dirs["llama"], EngineConfig(**SMALL))
    return _greedy(engine, *_workload())


def _engine(target, spec, pages=20, **settings):
    """An engine whose pool holds `pages` pages, the heads' bytes per page counted."""
    probe = Engine(target, EngineConfig(**(SMALL | settings), speculative_config=spec),
                   warm_up=False)
    budget = pages * probe.memory_plan.page_bytes
    return Engine(target, EngineConfig(**(SMALL | settings), speculative_config=spec,
                                       kv_cache_memory_bytes=budget))


@pytest.mark.parametrize("method", ["eagle3", "medusa",
                                    pytest.param("eagle", marks=pytest.mark.slow)])
def test_heads_greedy_equals_plain_engine(hf_model_dirs, head_dirs, plain_tokens, method):
    spec = {"model": str(head_dirs[method]), "num_speculative_tokens": 3,
            "adaptive": False}  # no "method": inferred from config.json, as vLLM does
    engine = _engine(hf_model_dirs["llama"], spec)
    assert engine.config.speculative_config.method == method
    tokens = _greedy(engine, *_workload())
    assert tokens == plain_tokens
    metrics = engine.metrics.summary()
    assert metrics["compiles_after_warmup"] == 0
    assert metrics["preemptions"] > 0 and metrics["prefix_cache_hit_tokens"] > 0
    assert metrics["spec_verify_steps"] > 0 and metrics["spec_draft_tokens"] > 0
    assert metrics["spec_accepted_tokens"] < metrics["spec_draft_tokens"]
    assert engine.scheduler.pool.num_used == 0


def test_the_planner_counts_the_heads_bytes(hf_model_dirs, head_dirs):
    plain = Engine(hf_model_dirs["llama"], EngineConfig(**SMALL), warm_up=False)
    spec = {"model": str(head_dirs["eagle3"]), "num_speculative_tokens": 2}
    heads = Engine(hf_model_dirs["llama"], EngineConfig(**SMALL, speculative_config=spec),
                   warm_up=False)
    target = checkpoint.load_config(hf_model_dirs["llama"])
    # features of 3 layers x 64 floats, float32, plus the one layer's K/V (2 heads x 16)
    features = 3 * target.hidden_size * 4
    layer_kv = 2 * 2 * 16 * 4
    assert heads.memory_plan.draft_kv_bytes_per_token == features + layer_kv
    assert heads.memory_plan.draft_weight_bytes > 0
    assert plain.memory_plan.draft_kv_bytes_per_token == 0
    # the `plan` command's count from config.json and the published layout, no weights read
    assert spec_loading.head_plan(str(head_dirs["eagle3"]), target, heads.config) == (
        heads.memory_plan.draft_weight_bytes, features + layer_kv)


def test_a_head_that_does_not_fit_the_target_is_refused(hf_model_dirs, tmp_path):
    demo_head = tmp_path / "demo-sized"
    target = checkpoint.load_config(DEMO)
    head, params = heads_checkpoint.random_head("medusa", target, jax.random.key(0),
                                                num_heads=2)
    heads_checkpoint.save_medusa(demo_head, head, params, target)
    with pytest.raises(ValueError, match="hidden_size"):
        Engine(hf_model_dirs["llama"], EngineConfig(**SMALL, speculative_config={
            "model": str(demo_head), "num_speculative_tokens": 2}), warm_up=False)
    small = tmp_path / "two-heads"
    target = checkpoint.load_config(hf_model_dirs["llama"])
    head, params = heads_checkpoint.random_head("medusa", target, jax.random.key(0),
                                                num_heads=2)
    heads_checkpoint.save_medusa(small, head, params, target)
    with pytest.raises(ValueError, match="num_speculative_tokens=3 exceeds the 2 Medusa"):
        Engine(hf_model_dirs["llama"], EngineConfig(**SMALL, speculative_config={
            "model": str(small), "num_speculative_tokens": 3}), warm_up=False)
    with pytest.raises(ValueError, match="does not match the checkpoint"):
        Engine(hf_model_dirs["llama"], EngineConfig(**SMALL, speculative_config={
            "method": "eagle3", "model": str(small), "num_speculative_tokens": 2}),
            warm_up=False)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_demo_heads_greedy_equal_plain_engine_and_agree(method):
    path = ROOT / "checkpoints" / f"demo-{method}"
    if not path.is_dir():
        pytest.skip(f"{path} not trained")
    prompts = [p for p in _demo_prompts() if len(p) > 4]
    # bfloat16, as the demo model and heads are stored and benchmarked
    settings = dict(SMALL, max_model_len=96, max_num_batched_tokens=64, dtype="bfloat16")
    plain = _greedy(Engine(DEMO, EngineConfig(**settings)), prompts, [32] * len(prompts))
    spec = {"model": str(path), "num_speculative_tokens": 3, "adaptive": False}
    engine = Engine(DEMO, EngineConfig(**settings, speculative_config=spec))
    assert _greedy(engine, prompts, [32] * len(prompts)) == plain
    metrics = engine.metrics.summary()
    assert metrics["compiles_after_warmup"] == 0
    # trained on the target's own features (the demo draft model: above 0.2)
    assert metrics["spec_acceptance_rate"] > {"eagle3": 0.4, "medusa": 0.15}[method]


@pytest.mark.slow
def test_tensor_parallel_heads_equal_plain_engine(hf_model_dirs, head_dirs, plain_tokens):
    spec = {"model": str(head_dirs["eagle3"]), "num_speculative_tokens": 2,
            "adaptive": False}
    engine = _engine(hf_model_dirs["llama"], spec, tensor_parallel_size=2)
    assert _greedy(engine, *_workload()) == plain_tokens



def _widened_tables(text: str, shape: tuple[int, ...]) -> list[str]:
    """Lines of compiled HLO that convert into an f32 array of `shape`: a whole table
    widened (XLA:CPU names such ops and fusions `convert`)."""
    name = f"= f32[{','.join(map(str, shape))}]"
    return [line for line in text.splitlines() if name in line and "convert" in line]


def test_cpu_bf16_steps_widen_no_whole_store_or_table(hf_model_dirs, head_dirs):
    """bf16 on XLA:CPU: the feature store is kept as its uint16 bits, so neither the
    target's steps nor the drafter convert the whole store, and the drafter reads a
    float32 copy of the target's embedding made once, not widened every call."""
    spec = {"model": str(head_dirs["eagle3"]), "num_speculative_tokens": 2}
    engine = Engine(hf_model_dirs["llama"], EngineConfig(**SMALL, dtype="bfloat16",
                                                         speculative_config=spec),
                    warm_up=False)
    runner, heads = engine.runner, engine.speculation.proposer.runner
    store = runner.kv_cache[-1]
    assert store.dtype == jax.numpy.uint16
    embed = runner.params["embed"].shape
    buckets = runner.buckets
    for bucket in (buckets.decode()[0], buckets.verify()[0], buckets.pick(16, 2)):
        text = runner._compile(bucket).as_text()
        assert "scatter" in text and not _widened_tables(text, store.shape), bucket
    for bucket in (buckets.decode()[0], heads.prefill_buckets()[0]):
        text = heads._compile(bucket).as_text()
        assert not _widened_tables(text, store.shape), bucket
        assert not _widened_tables(text, embed), bucket
    assert heads._shared() is heads._shared()  # the float32 copy is made once


def _force(policy, runner, speculate):
    """Fill the policy's step-time windows so that it speculates (verifying costs what
    decoding does) or never does (verifying costs 1,000 decode steps)."""
    verify = 1.0 if speculate else 1000.0
    for bucket in runner.buckets.decode():
        for _ in range(16):  # the whole window: the median is the forced time
            policy.seed("decode", bucket.num_slots, 1.0)
            policy.seed("verify", bucket.num_slots, verify)


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_async_steps_between_speculating_ones_keep_greedy_exact(
        hf_model_dirs, head_dirs, plain_tokens, method):
    """The adaptive policy turned off and on in spells of steps: the steps it would not
    speculate in are planned beside the step in flight (asynchronous), the others after
    it is read; outputs equal the plain engine's either way, an EAGLE drafter catching
    up over what the asynchronous spells skipped."""
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["model"] = str(head_dirs["eagle3"])
    engine = _engine(hf_model_dirs["llama"], spec)
    assert engine.async_scheduling
    prompts, max_tokens = _workload()
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"g{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                            ignore_eos=True))
    step = 0
    while engine.has_unfinished():
        _force(engine.speculation.policy, engine.runner, speculate=step // 3 % 2 == 1)
        engine.step()
        step += 1
    assert [engine.release(f"g{i}").token_ids for i in range(len(prompts))] == plain_tokens
    metrics = engine.metrics.summary()
    assert metrics["spec_verify_steps"] > 0 and metrics["spec_skipped_in_flight"] > 0
    assert metrics["compiles_after_warmup"] == 0 and engine.scheduler.pool.num_used == 0
