"""The memory planner: its bytes equal what the engine allocates; its errors and CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from jaxinfer import checkpoint, planner
from jaxinfer.config import EngineConfig, load_preset
from jaxinfer.engine import runner
from jaxinfer.engine.engine import Engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_equals_the_engine_allocation(hf_model_dirs, dtype):
    engine = Engine(hf_model_dirs["qwen2"], EngineConfig(
        dtype=dtype, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32,
        kv_cache_memory_bytes=123_457, compilation_cache_dir=""), warm_up=False)
    plan = engine.memory_plan
    assert plan.kv_cache_bytes == runner.tree_bytes(engine.runner.kv_cache)
    assert plan.weight_bytes == runner.tree_bytes(engine.runner.params)
    assert plan.num_pages == engine.scheduler.pool.num_pages == 123_457 // plan.page_bytes
    cfg = checkpoint.load_config(hf_model_dirs["qwen2"])
    itemsize = 4 if dtype == "float32" else 2
    assert plan.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * \
        itemsize


def test_plan_for_a_memory_budget_counts_weights_pages_and_requests():
    cfg = load_preset("llama3.1-8b")
    plan = planner.plan(cfg, dtype="bfloat16", max_model_len=8192, page_size=16,
                        memory_bytes=24 * 10**9, bandwidth_gb_per_s=800.0)
    assert plan.weight_bytes == 8_030_261_248 * 2  # Llama 3.1 8B's parameter count
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert plan.num_pages == (24 * 10**9 - plan.weight_bytes) // (16 * plan.kv_bytes_per_token)
    assert plan.max_concurrent_requests == (plan.num_pages - 1) // 512
    step_bytes = plan.weight_bytes + 3 * 1000 * plan.kv_bytes_per_token
    assert math.isclose(plan.decode_roofline(3, 1000), 3 * 800e9 / step_bytes)


def test_plan_refuses_a_budget_without_room_for_one_request():
    cfg = load_preset("llama3.1-8b")
    with pytest.raises(ValueError, match=r"holds the 16.061 GB of bfloat16 weights.*"
                                         r"give at least 17.136 GB"):
        planner.plan(cfg, dtype="bfloat16", max_model_len=8192, memory_bytes=16 * 10**9)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes >= "):
        planner.plan(cfg, max_model_len=64, kv_cache_bytes=1000)
    with pytest.raises(ValueError, match="exactly one"):
        planner.plan(cfg, kv_cache_bytes=1, memory_bytes=1)


def test_plan_command_prints_the_plan_of_a_preset():
    out = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "plan", "--model=qwen3-0.6b", "--dtype=bfloat16",
         "--kv_dtype=bfloat16", "--max_model_len=4096", "--max_num_seqs=8", "--memory_gb=4",
         "--bandwidth_gb_per_s=100"], capture_output=True, text=True, check=True)
    summary = json.loads(out.stdout)
    expected = planner.plan(load_preset("qwen3-0.6b"), dtype="bfloat16", max_model_len=4096,
                            max_num_seqs=8, memory_bytes=4 * 10**9, bandwidth_gb_per_s=100.0)
    assert summary == expected.summary()
