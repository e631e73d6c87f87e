"""The hybrid KV cache through the engine: a tiny model of 5 sliding-window layers (window
32) to 1 full-attention layer gives the same greedy tokens as the same engine with
`disable_hybrid_kv_cache_manager=True`, with batching, chunked prefill across the window,
prefix hits and preemption, with asynchronous scheduling on and off, compiling nothing
after warm-up."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from jaxinfer import SamplingParams, checkpoint, testing
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.engine.runner import tree_bytes

WINDOW, PAGE = 32, 8
LAYER_TYPES = ("sliding_attention",) * 5 + ("full_attention",)
HYBRID = ModelConfig(architecture="mistral", vocab_size=256, hidden_size=64,
                     intermediate_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
                     head_dim=16, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                     max_position_embeddings=256)
SMALL = dict(page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256,
             compilation_cache_dir="", strict_compile=True)
LAYER_PAGE_BYTES = PAGE * 2 * 2 * 16 * 4  # a page of one layer: K and V, 2 heads x 16 f32


@pytest.fixture(scope="module", autouse=True)
def full_precision_matmuls():
    """Float32 dots at full precision: on a GPU the default (TF32) rounds a recompute
    after preemption, in another batch shape, differently enough to flip a near-tie of
    this random model (seen on an H200: equal at full precision). XLA:CPU's
    float32 dots are full precision already."""
    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", before)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A random checkpoint of HYBRID; config.json carries its layer_types, which the
    loader is given by `layer_types_from_config` until a reader of them lands for the
    architecture."""
    path = testing.make_random_model(tmp_path_factory.mktemp("hybrid"), HYBRID, seed=1)
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(hf | {"layer_types": list(LAYER_TYPES)}))
    with pytest.MonkeyPatch.context() as patch:
        read = checkpoint.load_config

        def layer_types_from_config(root):
            cfg = read(root)
            types = json.loads((path / "config.json").read_text()).get("layer_types")
            if cfg.layer_types is None and str(root) == str(path) and types:
                import dataclasses
                cfg = dataclasses.replace(cfg, layer_types=tuple(types))
            return cfg

        patch.setattr(checkpoint, "load_config", layer_types_from_config)
        yield path


def _workload(seed=0, count=16):
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, 256, 50).tolist() for _ in range(2)]
    prompts = [systems[i % 2] + rng.integers(1, 256, int(rng.integers(5, 70))).tolist()
               for i in range(count)]
    prompts += [prompts[1], prompts[2]]  # exact duplicates, admitted later
    return prompts, [int(rng.integers(4, 24)) for _ in prompts]


def _greedy(engine, prompts, max_tokens):
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                            ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return [engine.release(f"r{i}").token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def reference(hybrid_dir):
    """The workloads' tokens with every layer keeping every page (one group)."""
    engine = Engine(hybrid_dir, EngineConfig(**SMALL, disable_hybrid_kv_cache_manager=True,
                                             kv_cache_memory_bytes=12 * 64 * LAYER_PAGE_BYTES))
    assert len(engine.memory_plan.page_groups) == 1
    assert len({layer.shape for layer in engine.runner.kv_cache}) == 1
    assert engine.runner.state.page_table.shape[0] == 1  # one page table per slot
    return {seed: _greedy(engine, *_workload(seed)) for seed in (0, 1)}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_hybrid_tokens_equal_one_group_under_preemption(hybrid_dir, reference,
                                                        async_scheduling):
    # 39 full pages and 12 sliding ones: a prefill chunk alone takes 9 of the latter
    engine = Engine(hybrid_dir, EngineConfig(**SMALL, async_scheduling=async_scheduling,
                                             kv_cache_memory_bytes=100 * LAYER_PAGE_BYTES))
    plan = engine.memory_plan
    assert [g.num_pages for g in plan.page_groups] == [39, 12]
    assert engine.runner.state.page_table.shape[0] == 2
    assert plan.kv_cache_bytes == (39 + 12 * 5) * LAYER_PAGE_BYTES == tree_bytes(
        engine.runner.kv_cache)
    shapes = [layer.shape[0] for layer in engine.runner.kv_cache]
    assert shapes == [12] * 5 + [39]
    assert _greedy(engine, *_workload(0)) == reference[0]
    metrics = engine.metrics.summary()
    assert metrics["preemptions"] > 0 and metrics["compiles_after_warmup"] == 0
    assert metrics["kv_pages_full_in_use"] == metrics["kv_pages_sliding_in_use"] == 0
    assert metrics["kv_pages_sliding_free"] == 11 and metrics["kv_pages_full_free"] == 38


def test_hybrid_tokens_equal_one_group_with_prefix_hits(hybrid_dir, reference):
    engine = Engine(hybrid_dir, EngineConfig(**SMALL, kv_cache_memory_bytes=160 * 6
                                             * LAYER_PAGE_BYTES))
    prompts, max_tokens = _workload(1)
    peak = []
    step = engine.scheduler.schedule

    def recording():
        plan = step()
        peak.append(tuple(group.pool.num_used for group in engine.scheduler.pages.groups))
        return plan

    engine.scheduler.schedule = recording
    assert _greedy(engine, prompts, max_tokens) == reference[1]
    metrics = engine.metrics.summary()
    assert metrics["prefix_cache_hit_tokens"] > 0 and metrics["compiles_after_warmup"] == 0
    assert max(s for _, s in peak) < max(f for f, _ in peak)  # the window, not the context
    assert engine.scheduler.pages.groups[1].pool.num_cached > 0


def test_hybrid_tokens_equal_one_group_with_ngram_speculation(hybrid_dir, reference):
    # drafts reserve sliding pages without freeing; rejected ones are trimmed in both groups
    engine = Engine(hybrid_dir, EngineConfig(
        **SMALL, kv_cache_memory_bytes=100 * LAYER_PAGE_BYTES, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "adaptive": False}))
    assert _greedy(engine, *_workload(0)) == reference[0]
    metrics = engine.metrics.summary()
    assert metrics["spec_accepted_tokens"] > 0 and metrics["spec_draft_tokens"] > \
        metrics["spec_accepted_tokens"]  # some drafts rejected, their pages trimmed
    assert metrics["preemptions"] > 0 and metrics["compiles_after_warmup"] == 0
    assert metrics["kv_pages_full_in_use"] == metrics["kv_pages_sliding_in_use"] == 0
