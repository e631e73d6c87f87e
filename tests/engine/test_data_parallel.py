"""Data parallelism on the 8 virtual CPU devices of the test session (conftest.py):
DP x TP layouts give one device's greedy tokens through `LLM.generate`, with prefix
hits; each replica holds its own requests, pages and devices; nothing compiles after
warm-up; metrics add up over the replicas."""

from __future__ import annotations

import pathlib

import jax
import pytest

from jaxinfer import LLM, SamplingParams, testing
from jaxinfer.engine.parallel.data_parallel import DataParallelEngine

SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96, page_size=8,
                compilation_cache_dir="")
PREAMBLE = list(range(3, 43))  # five full pages
PROMPTS = ([PREAMBLE + [50 + i, 60 + i] for i in range(6)]
           + [[7 + i, 8, 9, 10 + i] for i in range(6)] + ["def read(path):", "import os"])
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("dp-llama")
    testing.make_hf_model(path, "llama", num_attention_heads=8, num_key_value_heads=2)
    return path


@pytest.fixture(scope="module")
def expected(model_dir: pathlib.Path) -> list[list[int]]:
    llm = LLM(model_dir, **SETTINGS)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _check_layout(model_dir: pathlib.Path, expected: list[list[int]], dp: int, tp: int
                  ) -> None:
    llm = LLM(model_dir, data_parallel_size=dp, tensor_parallel_size=tp, **SETTINGS)
    engine = llm.engine
    assert isinstance(engine, DataParallelEngine) and len(engine.replicas) == dp
    routed, pick = [], engine.router.pick  # where each prompt went, in order
    engine.router.pick = lambda *args: routed.append(pick(*args)) or routed[-1]
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    _check_replicas_own_their_state(engine, routed, tp)
    metrics = llm.metrics()
    replicas = metrics["replicas"]
    assert metrics["compiles_after_warmup"] == 0
    assert all(r["compiles_after_warmup"] == 0 for r in replicas)
    assert metrics["generated_tokens"] == sum(map(len, expected))
    assert metrics["generated_tokens"] == sum(r["generated_tokens"] for r in replicas)
    assert metrics["prefix_cache_hit_tokens"] >= 3 * 40  # the preamble, on its replica
    assert metrics["requests_finished"] == len(PROMPTS)


def _check_replicas_own_their_state(engine: DataParallelEngine, routed: list[int],
                                    tp: int) -> None:
    """Replica r runs on devices [r * tp, (r + 1) * tp), holds its KV cache there, and
    served exactly the requests routed to it; the preamble's requests shared one."""
    devices = jax.devices()
    for index, replica in enumerate(engine.replicas):
        mine = set(devices[index * tp:(index + 1) * tp])
        assert set(replica.runner.mesh.devices.flat) == mine
        for leaf in jax.tree.leaves(replica.runner.kv_cache):
            assert leaf.sharding.device_set == mine
        assert replica.scheduler.pool.num_used == 0  # every page given back
    assert len(set(routed[:6])) == 1  # the shared preamble stayed together
    assert len(set(routed)) == len(engine.replicas)  # and every replica served some
    for index, replica in enumerate(engine.replicas):
        served = sum(1 for r in routed if r == index)
        assert replica.metrics.latency.summary()["requests_finished"] == served


def test_dp2_tp4_matches_one_device(model_dir, expected):
    _check_layout(model_dir, expected, dp=2, tp=4)


def test_dp4_tp2_matches_one_device(model_dir, expected):
    _check_layout(model_dir, expected, dp=4, tp=2)


@pytest.mark.slow
def test_dp8_matches_one_device(model_dir, expected):
    _check_layout(model_dir, expected, dp=8, tp=1)


def test_too_many_devices_is_refused_naming_both_sizes(model_dir):
    with pytest.raises(ValueError, match=r"data_parallel_size=3 x tensor_parallel_size=4 "
                                         r"needs 12 devices; 8 present"):
        LLM(model_dir, data_parallel_size=3, tensor_parallel_size=4, **SETTINGS)
