"""The memory planner: its bytes equal what the engine allocates; its errors and CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

from jaxinfer import aot, checkpoint, testing
from jaxinfer.config import EngineConfig, ModelConfig, load_preset
from jaxinfer.engine import runner
from jaxinfer.engine.engine import Engine
from jaxinfer.sizing import accelerators, memory_plan, planner


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
    with pytest.raises(ValueError, match=r"holds the 16.061 GB of bfloat16 weights, 0.001 GB "
                                         r"of per-request state.*give at least 17.138 GB"):
        planner.plan(cfg, dtype="bfloat16", max_model_len=8192, memory_bytes=16 * 10**9)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes >= "):
        planner.plan(cfg, max_model_len=64, kv_cache_bytes=1000)
    with pytest.raises(ValueError, match="exactly one"):
        planner.plan(cfg, kv_cache_bytes=1, memory_bytes=1)


def test_plan_command_prints_the_plan_of_a_preset():
    out = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "plan", "--model=qwen3-0.6b", "--dtype=bfloat16",
         "--kv_dtype=bfloat16", "--max_model_len=4096", "--max_num_seqs=8", "--memory_gb=4",
         "--bandwidth_gb_per_s=100", "--format=json"], capture_output=True, text=True,
        check=True)
    summary = json.loads(out.stdout)
    assert (summary.pop("model"), summary.pop("dtype")) == ("qwen3-0.6b", "bfloat16")
    expected = planner.plan(load_preset("qwen3-0.6b"), dtype="bfloat16", max_model_len=4096,
                            max_num_seqs=8, memory_bytes=4 * 10**9, bandwidth_gb_per_s=100.0)
    assert summary.pop("device") is None
    assert summary.pop("data_parallel_size") == 1
    assert summary.pop("quantization") is None  # a float preset's published checkpoint
    assert summary == expected.summary()
    assert summary["peak_flops_per_s"] is None  # no device: bytes only
    assert {row["bound"] for row in summary["decode_roofline"]} == {"memory"}


def _plan_cli(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "jaxinfer", "plan", *args, "--format=json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_plan_command_on_a_device_reports_per_device_bytes_roofline_and_cost():
    summary = _plan_cli("--model=llama3.1-8b", "--device=v5e-8", "--dtype=bfloat16",
                        "--max_model_len=8192", "--price_per_hour=9.6")
    device = summary["device"]
    assert (device["name"], device["devices"], device["device_hbm_bytes_per_s"]) == \
        ("v5e-8", 8, 819e9)
    assert summary["tensor_parallel_size"] == 8 and summary["replicas"] == 1
    cfg = load_preset("llama3.1-8b")
    assert summary["weight_bytes"] == planner.weight_bytes(cfg, "bfloat16", 8)
    assert summary["unsharded_weight_bytes"] == 8_030_261_248 * 2
    assert summary["kv_bytes_per_token"] == 2 * 32 * 1 * 128 * 2  # one KV head per chip
    budget = int(accelerators.get("v5e-8").chip.usable_hbm_bytes * 0.9)
    assert summary["num_pages"] == (budget - summary["weight_bytes"] - summary[
        "batch_state_bytes"]) // summary["page_bytes"]
    assert summary["bandwidth_gb_per_s"] == 819.0 and summary["peak_flops_per_s"] == 197e12
    rows = summary["decode_roofline"]
    assert [row["batch"] for row in rows] == [1, 8, 32]  # max_num_seqs=32
    for row in rows:
        step_bytes = summary["weight_bytes"] + row["batch"] * 8192 * summary[
            "kv_bytes_per_token"]
        assert math.isclose(row["tokens_per_s"], row["batch"] * 819e9 / step_bytes,
                            rel_tol=1e-3)
        cost = 9.6 / (row["tokens_per_s"] * 3600) * 1e6
        assert math.isclose(row["cost_per_million_output_tokens"], cost, rel_tol=1e-3)
    assert summary["cost_per_million_output_tokens"] == rows[-1][
        "cost_per_million_output_tokens"]


def test_plan_command_on_a_gpu_machine_with_overrides():
    summary = _plan_cli("--model=llama3.1-8b", "--device=a3-highgpu-8g", "--dtype=bfloat16",
                        "--max_model_len=4096", "--tensor_parallel_size=2", "--memory_gb=30",
                        "--bandwidth_gb_per_s=2000")
    assert summary["device"]["name"] == "h100-8" and summary["price_per_hour"] is None
    assert summary["tensor_parallel_size"] == 2 and summary["replicas"] == 4
    assert summary["weight_bytes"] == planner.weight_bytes(load_preset("llama3.1-8b"),
                                                           "bfloat16", 2)
    assert summary["kv_cache_bytes"] <= 30e9 - summary["weight_bytes"]
    assert summary["bandwidth_gb_per_s"] == 2000.0
    assert all(row["cost_per_million_output_tokens"] is None
               for row in summary["decode_roofline"])


def test_weights_split_over_tensor_parallel_devices_but_norms():
    cfg = load_preset("llama3.1-8b")
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size  # attn, mlp and final RMSNorm
    elements = 8_030_261_248
    assert planner.weight_bytes(cfg, "bfloat16", 8) == 2 * ((elements - norms) // 8 + norms)
    assert planner.kv_bytes_per_token(cfg, "bfloat16", 8) == \
        planner.kv_bytes_per_token(cfg, "bfloat16") // 8
    odd_vocab = dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1)  # 8 does not divide
    embed_and_head = 2 * odd_vocab.vocab_size * cfg.hidden_size
    assert planner.weight_bytes(odd_vocab, "float32", 8) == 4 * (
        (elements + 2 * cfg.hidden_size - norms - embed_and_head) // 8 + norms
        + embed_and_head)


def test_kv_heads_fewer_than_devices_are_replicated():
    cfg = dataclasses.replace(load_preset("qwen3-0.6b"), num_kv_heads=2)
    assert planner.kv_heads_per_device(cfg, 8) == 1 and planner.kv_heads_per_device(cfg, 2) == 1
    per_device = planner.kv_bytes_per_token(cfg, "bfloat16", 8)
    assert per_device == 2 * 1 * cfg.head_dim * cfg.num_layers * 2
    assert per_device == planner.kv_bytes_per_token(cfg, "bfloat16")  // 2
    d, h = cfg.hidden_size, cfg.head_dim
    qkv_per_device = d * (16 // 8 + 2 * 1) * h  # q: 2 heads, k and v: one head each
    full = planner.weight_bytes(cfg, "float32", 1) // 4
    qkv_full = d * (16 + 2 * 2) * h
    rest = full - cfg.num_layers * qkv_full
    norms = (2 * cfg.num_layers + 1) * d + 2 * cfg.num_layers * h  # q/k norms too
    assert planner.weight_bytes(cfg, "float32", 8) == 4 * (
        cfg.num_layers * qkv_per_device + (rest - norms) // 8 + norms)


@pytest.mark.parametrize("tp, message", [
    (3, "tensor_parallel_size=3 must divide the 32 query heads"),
    (0, "tensor_parallel_size=0 must be a positive int"),
    (12, "tensor_parallel_size=12 must divide the 8 KV heads or be a multiple of them"),
])
def test_invalid_tensor_parallel_size_names_the_numbers(tp, message):
    cfg = load_preset("llama3.1-8b")
    if tp == 12:
        cfg = dataclasses.replace(cfg, num_heads=48)
    with pytest.raises(ValueError, match=message):
        planner.plan(cfg, memory_bytes=10**12, tensor_parallel_size=tp)


def test_tensor_parallel_size_cannot_exceed_the_devices():
    with pytest.raises(ValueError, match="tensor_parallel_size=8 exceeds num_devices=4"):
        planner.plan(load_preset("llama3.1-8b"), memory_bytes=10**12, tensor_parallel_size=8,
                     num_devices=4)


def test_roofline_is_the_slower_of_bytes_and_flops_over_every_replica():
    cfg = load_preset("llama3.1-8b")
    common = dict(dtype="bfloat16", max_model_len=1024, memory_bytes=40 * 10**9,
                  tensor_parallel_size=2, bandwidth_gb_per_s=1000.0)
    two = planner.plan(cfg, num_devices=2, **common)
    four = planner.plan(cfg, num_devices=4, **common)
    assert four.replicas == 2 and four.decode_roofline(8, 1024) == 2 * two.decode_roofline(
        8, 1024)
    slow = planner.plan(cfg, num_devices=2, peak_flops_per_s=1e11, **common)
    matmul, attention = planner.decode_flops(cfg, 2)
    assert (slow.matmul_flops_per_token, slow.attention_flops_per_context_token) == (
        matmul, attention)
    assert matmul == 2 * (planner.weight_bytes(cfg, "bfloat16", 2) // 2
                          - cfg.vocab_size * cfg.hidden_size // 2 - 65 * cfg.hidden_size)
    flops = 8 * (matmul + 1024 * attention)
    assert math.isclose(slow.decode_roofline(8, 1024), 8 / (flops / 1e11))
    assert {row["bound"] for row in slow.roofline_rows()} == {"compute"}
    assert memory_plan.cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)


def test_decode_flops_count_active_experts_and_no_expert_biases():
    """Tiny gpt-oss (2 layers, 4 heads and 2 KV heads of 32, D 64, V 260, 8 experts of
    32 with biases, 2 per token): 2 x (q/k/v, o, router, 2 experts' gate/up and down, LM
    head); the experts' biases [E, n] multiply nothing."""
    cfg = ModelConfig.from_hf(testing.hf_config("gpt_oss").to_dict())
    layer = 64 * (4 + 2 * 2) * 32 + 4 * 32 * 64 + 64 * 8 + 2 * 3 * 32 * 64
    assert planner.decode_flops(cfg) == (2 * (2 * layer + 64 * 260), 4 * 4 * 32 * 2)
    # Two devices: each holds half of every expert, head and the LM head; the router whole.
    router = 64 * 8
    assert planner.decode_flops(cfg, 2) == (
        2 * (2 * (layer - router) // 2 + 2 * router + 64 * 260 // 2), 4 * 2 * 32 * 2)


def test_gpu_memory_utilization_sets_the_device_budget():
    """vLLM's knob: weights plus pool within that share of each chip's memory."""
    cfg, acc = load_preset("llama3.1-8b"), accelerators.get("v5e-8")
    plans = {share: aot.plan_for(cfg, acc, aot.Settings(gpu_memory_utilization=share), 8)
             for share in (0.5, 0.9)}
    usable = acc.chip.usable_hbm_bytes
    for share, plan in plans.items():
        held = plan.weight_bytes + plan.batch_state_bytes + plan.kv_cache_bytes
        assert held <= share * usable < held + plan.page_bytes
    assert plans[0.5].num_pages < plans[0.9].num_pages
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5 must be in"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_plan_that_does_not_fit_per_device_says_by_how_much():
    cfg = load_preset("llama3.1-8b")
    with pytest.raises(ValueError, match=r"2.000 GB per device \(tensor_parallel_size=8\) "
                                         r"holds the 2.008 GB .* GB short: give at least .* "
                                         r"raise tensor_parallel_size"):
        planner.plan(cfg, dtype="bfloat16", max_model_len=8192, memory_bytes=2 * 10**9,
                     tensor_parallel_size=8)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_plan_equals_the_engine_allocation_with_8bit_kv_and_scales(hf_model_dirs, kv_dtype):
    """Pages plus their f32 scales per token and KV head, to the byte."""
    engine = Engine(hf_model_dirs["llama"], EngineConfig(
        kv_cache_dtype=kv_dtype, page_size=4, max_num_seqs=2, max_num_batched_tokens=16,
        max_model_len=32, kv_cache_memory_bytes=123_457, compilation_cache_dir=""),
        warm_up=False)
    plan = engine.memory_plan
    assert plan.kv_cache_bytes == runner.tree_bytes(engine.runner.kv_cache)
    assert plan.num_pages == engine.scheduler.pool.num_pages == 123_457 // plan.page_bytes
    cfg = checkpoint.load_config(hf_model_dirs["llama"])
    combined = -(-2 * cfg.num_kv_heads // 4) * 4  # 8-bit pages: whole words of 4 heads
    assert plan.kv_bytes_per_token == cfg.num_layers * (
        combined * cfg.head_dim + 4 * 2 * cfg.num_kv_heads)


def test_int8_kv_pool_holds_about_twice_the_pages_of_bf16():
    """Llama 3.1 8B (8 KV heads of 128): an int8 token is 128 + 4 bytes per combined head
    against 256, so 256 / 132 = 1.939x the pages for the same memory (the scales keep
    it under 2)."""
    cfg = load_preset("llama3.1-8b")
    common = dict(dtype="bfloat16", max_model_len=8192, page_size=16,
                  kv_cache_bytes=10 * 10**9)
    bf16 = planner.plan(cfg, kv_dtype="bfloat16", **common)
    int8 = planner.plan(cfg, kv_dtype="int8", **common)
    assert int8.kv_bytes_per_token == 32 * 16 * (128 + 4)
    assert bf16.kv_bytes_per_token == 32 * 16 * 256
    assert int8.num_pages / bf16.num_pages == pytest.approx(256 / 132, rel=1e-4)
    assert planner.plan(cfg, kv_dtype="fp8", **common).num_pages == int8.num_pages


def test_plan_defaults_to_the_models_dtype_and_prints_a_table(hf_model_dirs):
    """vLLM's auto: a preset plans bfloat16 weights, a checkpoint its own dtype; the
    default output is aligned text, JSON with --format=json."""
    preset = _plan_cli("--model=llama3.1-8b", "--device=v5e-8")
    assert preset["dtype"] == "bfloat16"
    assert preset["unsharded_weight_bytes"] == planner.weight_bytes(
        load_preset("llama3.1-8b"), "bfloat16", 1)
    assert _plan_cli(f"--model={hf_model_dirs['llama']}", "--memory_gb=1")["dtype"] == \
        json.loads((hf_model_dirs["llama"] / "config.json").read_text()).get("dtype", "float32")
    table = subprocess.run([sys.executable, "-m", "jaxinfer", "plan", "--model=llama3.1-8b",
                            "--device=v5e-8"], capture_output=True, text=True, check=True).stdout
    assert "{" not in table and table.splitlines()[1].split() == ["dtype", "bfloat16"]
    assert any(line.split()[:2] == ["batch", "context"] for line in table.splitlines())


@pytest.mark.parametrize("name, total, active", [("mixtral-8x7b", 46.70e9, 12.88e9),
                                                 ("qwen3-30b-a3b", 30.53e9, 3.35e9)])
def test_moe_presets_count_total_and_active_parameters(name, total, active):
    """The published sizes: Mixtral 46.7B with 12.9B active, Qwen3-30B-A3B 30.5B / 3.3B."""
    got_total, got_active = planner.param_counts(load_preset(name))
    assert abs(got_total - total) < 0.01e9 and abs(got_active - active) < 0.01e9


def test_plan_counts_a_draft_model_or_speculative_heads():
    cfg, draft = load_preset("llama3.1-8b"), load_preset("qwen3-0.6b")
    common = dict(dtype="bfloat16", memory_bytes=40 * 10**9, max_model_len=4096)
    alone = planner.plan(cfg, **common)
    model = planner.plan(cfg, draft=draft, quantization="int8", **common)  # draft: bf16
    heads = planner.plan(cfg, draft=(10**9, 4096), **common)
    assert (alone.draft_weight_bytes, alone.draft_kv_bytes_per_token) == (0, 0)
    assert (model.draft_weight_bytes, model.draft_kv_bytes_per_token) == (
        planner.weight_bytes(draft, "bfloat16"), planner.kv_bytes_per_token(draft, "bfloat16"))
    assert (heads.draft_weight_bytes, heads.draft_kv_bytes_per_token) == (10**9, 4096)
    assert heads.page_bytes == alone.page_bytes + 16 * 4096
    assert heads.kv_cache_bytes < alone.kv_cache_bytes - 10**9 + alone.page_bytes


def test_moe_decode_reads_the_experts_its_batch_chooses():
    cfg = load_preset("qwen3-30b-a3b")  # 128 experts, top 8
    assert memory_plan.expected_distinct_experts(128, 8, 1) == 8
    assert memory_plan.expected_distinct_experts(128, 8, 32) == pytest.approx(
        128 * (1 - (120 / 128) ** 32))
    one = planner.plan(cfg, dtype="bfloat16", memory_bytes=40 * 10**9, max_model_len=4096,
                       tensor_parallel_size=2, bandwidth_gb_per_s=819)
    ep = planner.plan(cfg, dtype="bfloat16", memory_bytes=40 * 10**9, max_model_len=4096,
                      tensor_parallel_size=2, bandwidth_gb_per_s=819, expert_parallel=True)
    assert ep.weight_bytes == one.weight_bytes  # E/2 whole experts, or half of each
    experts = one.expert_weight_bytes
    assert 0.9 * one.weight_bytes < experts < one.weight_bytes
    assert one.step_weight_bytes(1) == pytest.approx(one.weight_bytes - experts * 120 / 128)
    assert one.step_weight_bytes(1) < one.step_weight_bytes(32) < one.weight_bytes
    memory_s, _ = one.decode_seconds(1, 4096)
    assert memory_s == pytest.approx((one.step_weight_bytes(1) + 4096 * one.kv_bytes_per_token)
                                     / 819e9)
    summary = one.summary()
    assert summary["active_params"] < summary["total_params"] / 9
