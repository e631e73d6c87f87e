"""Model FLOPs for MFU: a step's count from its chunks equals a hand count from the
model's shape (the demo model; a tiny gpt-oss for sliding windows and experts), padding
and discarded positions apart; on CPU the peak is a matmul measured once per process."""

from __future__ import annotations

import dataclasses
import pathlib
import types

import pytest

from jaxinfer import checkpoint, testing
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.engine import loading
from jaxinfer.engine import runner as runner_lib
from jaxinfer.engine.core.scheduler import ScheduledChunk
from jaxinfer.engine.metrics.summary import Metrics, attended_positions
from jaxinfer.engine.request import Request, SamplingParams

DEMO = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"


def _chunk(start: int, num_tokens: int, num_samples: int = 1) -> ScheduledChunk:
    request = Request(request_id=f"r{start}", prompt_token_ids=list(range(start + 1)),
                      params=SamplingParams(), arrival=0, seed=0)
    return ScheduledChunk(request, start, num_tokens, num_samples)


def _record(metrics: Metrics, chunks: list[ScheduledChunk], dropped: list[bool]) -> None:
    metrics.record_plan(chunks, [0] * len(chunks), 64, 4, seconds=0.5, dropped=dropped,
                        pages_in_use=0, weight_bytes=0, kv_bytes_per_token=0)


@pytest.mark.parametrize("window", [None, 1, 3, 7, 40])
def test_attended_positions_is_the_sum_over_positions(window):
    for start in range(0, 12):
        for num_tokens in range(0, 12):
            expected = sum(min(p + 1, window or p + 1) for p in range(start, start + num_tokens))
            assert attended_positions(start, num_tokens, window) == expected


def test_demo_model_prompt_chunk_and_decode_flops_by_hand():
    """Demo model: V 4096, D 320, F 864, 6 layers, 5 heads and 1 KV head of 64, tied."""
    count = loading.flop_count(checkpoint.load_config(DEMO), EngineConfig(dtype="float32"))
    layer = 320 * (5 + 2) * 64 + 320 * 320 + 2 * 320 * 864 + 864 * 320  # qkv, o, gate/up, down
    assert count.matmul_per_token == 2 * 6 * layer == 12_902_400
    assert count.head_per_sample == 2 * 320 * 4096 == 2_621_440  # the tied embedding
    assert count.attention_per_position == 4 * 5 * 64
    assert count.windows == ((None, 6),) and count.devices == 1
    assert count.peak_source == "measured" and count.peak_flops_per_s > 0  # CPU
    metrics = Metrics(flop_count=count, bandwidth_gb_per_s=10.0)
    # A 10-token prompt chunk (positions 0..9 attend 1..10 tokens), a decode at
    # position 10, and a decode of a request that had stopped (discarded).
    _record(metrics, [_chunk(0, 10), _chunk(10, 1), _chunk(20, 1)], [False, False, True])
    prompt = 10 * 12_902_400 + 2_621_440 + 6 * 1280 * 55
    decode = 12_902_400 + 2_621_440 + 6 * 1280 * 11
    assert (prompt, decode) == (132_067_840, 15_608_320)
    assert metrics.model_flops == prompt + decode
    assert (metrics.real_tokens, metrics.discarded_tokens) == (11, 1)
    summary = metrics.summary()
    assert summary["model_flops"] == prompt + decode
    assert summary["achieved_tflops"] == round((prompt + decode) / 0.5 / 1e12, 6)
    assert summary["mfu"] == round((prompt + decode) / 0.5 / count.peak_flops_per_s, 4)
    assert summary["peak_flops_source"] == "measured"
    # No bytes read: nothing bounds it by memory.
    assert summary["bound"] == "compute"


def test_sliding_window_and_expert_flops_by_hand():
    """Tiny gpt-oss: V 260, D 64, 2 layers (sliding 12, full), 4 heads and 2 KV heads of
    32, 8 experts of 32, 2 per token, biases on the experts (no matmul)."""
    cfg = ModelConfig.from_hf(testing.hf_config("gpt_oss").to_dict())
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    count = loading.flop_count(cfg, EngineConfig(dtype="float32", tensor_parallel_size=2))
    layer = 64 * (4 + 2 * 2) * 32 + 4 * 32 * 64 + 64 * 8 + 2 * 3 * 32 * 64  # qkv o router k=2
    assert count.matmul_per_token == 2 * 2 * layer == 149_504
    assert count.head_per_sample == 2 * 64 * 260
    assert count.attention_per_position == 4 * 4 * 32
    assert count.windows == ((12, 1), (None, 1))
    assert count.devices == 2  # the peak of the mesh: two devices
    assert count.peak_flops_per_s == 2 * runner_lib.peak_flops("float32")[0]
    metrics = Metrics(flop_count=count)
    # 20 prompt tokens: the sliding layer attends 1..12 then 12 each, the full one 1..20.
    _record(metrics, [_chunk(0, 20)], [False])
    assert metrics.model_flops == 20 * 149_504 + 33_280 + 512 * ((78 + 8 * 12) + 210)
    # A decode at position 30 and a prefill chunk that samples nothing (mid-prompt).
    before = metrics.model_flops
    _record(metrics, [_chunk(30, 1), _chunk(40, 4, num_samples=0)], [False, False])
    mid_prompt = 4 * 149_504 + 512 * (4 * 12 + (41 + 42 + 43 + 44))
    assert metrics.model_flops - before == 149_504 + 33_280 + 512 * (12 + 31) + mid_prompt


def test_peak_of_a_known_chip_is_its_preset_and_w8a8_takes_int8():
    """A device JAX names as a known chip gets the chip's published dense peak, without
    a probe (a stand-in device: no TPU here); w8a8's int8 dots their int8 peak."""
    probes = runner_lib.flops_probe_count()
    v6e = types.SimpleNamespace(device_kind="TPU v6 lite")
    assert runner_lib.peak_flops("bfloat16", v6e) == (918e12, "preset:v6e")
    assert runner_lib.peak_flops("float32", v6e) == (918e12, "preset:v6e")
    assert runner_lib.peak_flops("int8", v6e) == (1836e12, "preset:v6e")
    assert runner_lib.flops_probe_count() == probes
    assert runner_lib.device_chip(v6e).hbm_bytes_per_s == 1640e9
    assert runner_lib.device_chip() is None  # the CPU
    cfg = checkpoint.load_config(DEMO)
    w8a8 = loading.flop_count(cfg, EngineConfig(dtype="float32", quantization="w8a8"))
    probes = runner_lib.flops_probe_count()
    assert w8a8.peak_flops_per_s == runner_lib.peak_flops("int8")[0]  # the int8 probe's
    assert runner_lib.flops_probe_count() == probes  # measured once per process


def test_bound_compares_bytes_and_flops_at_one_sources_rates():
    """`bound`: the steps' bytes at the bandwidth against their FLOPs at the peak, both
    a known chip's published figures when there is one (the probe reads low on GPUs)."""
    count = loading.flop_count(checkpoint.load_config(DEMO), EngineConfig(dtype="float32"))
    step = count.chunk(0, 10, 1)  # 132_067_840 FLOPs, and 1 MB read in the step below
    probed = Metrics(flop_count=dataclasses.replace(count, peak_flops_per_s=step * 100.0),
                     bandwidth_gb_per_s=1e6 / 0.02 / 1e9)  # 1 MB: 20 ms, the FLOPs 10 ms
    chip = Metrics(flop_count=dataclasses.replace(count, peak_flops_per_s=step * 100.0,
                                                  chip_bytes_per_s=1e6 / 0.005),  # 5 ms
                   bandwidth_gb_per_s=1e6 / 0.02 / 1e9)
    for metrics in (probed, chip):
        metrics.record_plan([_chunk(0, 10)], [0], 16, 1, seconds=0.1, dropped=[False],
                            pages_in_use=0, weight_bytes=1_000_000, kv_bytes_per_token=0)
    assert probed.summary()["bound"] == "memory" and probed.summary()["mfu"] == 0.1
    assert probed.summary()["roofline_fraction"] == 0.2  # >= mfu: memory
    assert chip.summary()["bound"] == "compute"
