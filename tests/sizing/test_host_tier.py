"""The host tier in the memory plan (sizing/host_tier.py): pages counted as the runner
counts them, tokens and full contexts, the chips' host links and the restore time."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.config import load_preset
from jaxinfer.engine.runner import kv_offload
from jaxinfer.model import sharding
from jaxinfer.model.attention import kv_cache_spec
from jaxinfer.sizing import accelerators, host_tier, planner

GB = 10**9


def _plan(model: str = "llama3.1-8b", kv_dtype: str = "bfloat16", tp: int = 4,
          max_model_len: int = 8192, **kwargs):
    return planner.plan(load_preset(model), dtype="bfloat16", kv_dtype=kv_dtype,
                        max_model_len=max_model_len, kv_cache_bytes=8 * GB,
                        tensor_parallel_size=tp, **kwargs)


def test_pages_tokens_and_contexts_of_llama_8b_over_4_chips():
    """Llama-3.1-8B bf16: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes = 128 KiB a
    token, a 16-token page 2 MiB over the 4 chips (512 KiB each): 8 GiB hold 4,096 pages,
    65,536 tokens, 8 contexts of 8,192 tokens (512 pages each)."""
    plan = _plan()
    assert plan.kv_bytes_per_token == 32 * 2 * 128 * 2 * 2  # 2 KV heads a chip
    report = host_tier.report(plan, 8)
    assert report == {"kv_offloading_size_gib": 8, "host_pages": 4096,
                      "host_page_bytes": 2 * 2**20, "host_bytes": 8 * 2**30,
                      "host_tokens": 65536, "host_full_contexts": 8, "replicas": 1}
    half = host_tier.report(plan, 0.5)  # GiB need not be whole; the pages are
    assert half["host_pages"] == 256 and half["host_full_contexts"] == 0
    odd = host_tier.report(plan, 1.3)
    assert odd["host_pages"] == int(1.3 * 2**30 // (2 * 2**20)) == 665
    assert odd["host_bytes"] == 665 * 2 * 2**20 <= 1.3 * 2**30


@pytest.mark.parametrize("model,kv_dtype,tp", [("llama3.1-8b", "bfloat16", 4),
                                               ("llama3.1-8b", "int8", 2),
                                               ("qwen3-0.6b", "bfloat16", 1),
                                               ("smollm-135m", "float32", 3)])
def test_page_bytes_are_the_runners(model, kv_dtype, tp):
    """A replica's page is kv_offload.page_bytes of the cache the runner allocates
    (kv_cache_spec over tp shards; 8-bit pages with their scales)."""
    plan = _plan(model, kv_dtype, tp, max_model_len=2048)
    served = sharding.served_config(load_preset(model), tp)
    cache = kv_cache_spec(served, num_pages=plan.num_pages, page_size=plan.page_size,
                          dtype=kv_dtype, shards=tp)
    assert host_tier.replica_page_bytes(plan) == kv_offload.page_bytes(cache, plan.page_size)


def test_restore_time_over_the_chips_host_link():
    """One 8,192-token context is 1 GiB over the 4 chips, 256 MiB each, each chip over
    its own link: over an H100's PCIe Gen5 x16 (64 GB/s each way) 4.194 ms, over an
    A100's Gen4 x16 twice that."""
    plan = _plan()
    h100 = host_tier.report(plan, 8, accelerators.CHIPS["h100-80gb"])
    assert h100["device_host_link_bytes_per_s"] == 64e9
    assert h100["host_link_source"] == accelerators.H100_DATASHEET
    assert h100["host_link_note"] is None
    assert h100["restore_full_context_ms"] == round(2**28 / 64e9 * 1e3, 3) == 4.194
    a100 = host_tier.report(plan, 8, accelerators.CHIPS["a100-80gb"])
    assert a100["restore_full_context_ms"] == round(2**28 / 32e9 * 1e3, 3) == 8.389
    v5e = host_tier.report(plan, 8, accelerators.CHIPS["v5e"])
    assert v5e["device_host_link_bytes_per_s"] == 32e9
    assert "not published" in v5e["host_link_note"]


@pytest.mark.parametrize("name", sorted(accelerators.CHIPS))
def test_every_chip_has_a_host_link_figure_with_its_source(name):
    """PCIe x16 one way: Gen5 (64 GB/s) for H100 and H200, Gen4 (32 GB/s) for A100, L4
    and the TPUs (assumed, and said so); slower than the chip's HBM and its ICI/NVLink."""
    chip = accelerators.CHIPS[name]
    gen5 = name in ("h100-80gb", "h200")
    assert chip.host_link_bytes_per_s == (64e9 if gen5 else 32e9)
    assert chip.host_link_source.startswith("https://")
    assert bool(chip.host_link_note) == (chip.platform == "tpu")
    assert chip.host_link_bytes_per_s <= chip.ring_bytes_per_s < chip.hbm_bytes_per_s
    with pytest.raises(ValueError, match="host_link_bytes_per_s=0 must be > 0"):
        dataclasses.replace(chip, host_link_bytes_per_s=0)


def test_refuses_what_the_engine_refuses():
    with pytest.raises(ValueError, match="holds no KV page"):
        host_tier.report(_plan(), 1 / 1024)  # 1 MiB: half a page
    hybrid = _plan("gemma-3-27b", tp=1, max_model_len=8192)
    assert len(hybrid.page_groups) == 2
    with pytest.raises(ValueError, match="disable_hybrid_kv_cache_manager=True"):
        host_tier.report(hybrid, 8)
    one_group = _plan("gemma-3-27b", tp=1, max_model_len=8192, hybrid_kv_cache=False)
    assert host_tier.report(one_group, 8)["host_pages"] > 0
