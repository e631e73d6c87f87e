"""The engine with an 8-bit KV cache (kv_cache_dtype="int8"/"fp8", pallas/kv_quant.py):
prefix caching and preemption give the tokens of a plain engine, no compile after
warm-up, and tensor parallelism splits pages and scales by KV head with the tokens of
one device."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import Engine
from jaxinfer.model.attention import QuantizedPages

SMALL = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32,
             compilation_cache_dir="", strict_compile=True, attention_impl="reference")
# tiny llama, int8: 2 layers x (4 combined heads x 16 values + 4 f32 scales) per token
PAGE_BYTES = 4 * 2 * (4 * 16 + 4 * 4)


def _workload() -> tuple[list[list[int]], list[int]]:
    """Prompts sharing system prefixes that end mid-page, one duplicate."""
    rng = np.random.default_rng(7)
    systems = [rng.integers(0, 256, size=n).tolist() for n in (9, 14)]
    prompts = [systems[i % 2] + rng.integers(0, 256, size=int(rng.integers(1, 6))).tolist()
               for i in range(10)]
    prompts.append(prompts[2])
    return prompts, [int(rng.integers(4, 12)) for _ in prompts]


def _greedy(engine: Engine, prompts: list[list[int]], max_tokens: list[int]) -> list:
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                            ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return [engine.release(f"r{i}").token_ids for i in range(len(prompts))]


def test_int8_kv_prefix_hits_and_preemption_give_the_plain_engines_tokens(hf_model_dirs):
    prompts, max_tokens = _workload()
    pressed = Engine(hf_model_dirs["llama"], EngineConfig(
        **SMALL, kv_cache_dtype="int8", kv_cache_memory_bytes=12 * PAGE_BYTES))
    plain = Engine(hf_model_dirs["llama"], EngineConfig(
        **SMALL, kv_cache_dtype="int8", enable_prefix_caching=False))
    assert isinstance(pressed.runner.kv_cache[0], QuantizedPages)
    assert pressed.scheduler.pool.num_pages == 12
    got = _greedy(pressed, prompts, max_tokens)
    assert got == _greedy(plain, prompts, max_tokens)
    metrics = pressed.metrics.summary()
    assert metrics["prefix_cache_hit_tokens"] > 0 and metrics["preemptions"] > 0
    assert plain.metrics.summary()["preemptions"] == 0
    for engine in (pressed, plain):  # strict_compile would have raised, too
        assert engine.metrics.compiles_after_warmup == 0


@pytest.mark.slow  # about 40 s: two engines warm up
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_tensor_parallel_8bit_kv_gives_the_tokens_of_one_device(hf_model_dirs, kv_dtype):
    """Tiny llama, 2 KV heads: at TP=2 each device holds one head's pages and scales."""
    prompts, max_tokens = _workload()
    prompts, max_tokens = prompts[:5], max_tokens[:5]
    tokens = {}
    for tp in (1, 2):
        engine = Engine(hf_model_dirs["llama"], EngineConfig(
            **SMALL, kv_cache_dtype=kv_dtype, tensor_parallel_size=tp))
        layer = engine.runner.kv_cache[0]
        shard = layer.scales.addressable_shards[0].data
        assert shard.shape[2] == layer.scales.shape[2] // tp  # scales split by KV head
        assert layer.pages.addressable_shards[0].data.shape[2] == layer.pages.shape[2] // tp
        tokens[tp] = _greedy(engine, prompts, max_tokens)
    assert tokens[2] == tokens[1]
