"""The planner's split of KV bytes between page groups: the full and the sliding one."""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer.config import ModelConfig
from jaxinfer.sizing import planner
from jaxinfer.sizing.page_groups import group_layers, split_pages

# The Gemma 3 pattern: 5 sliding layers (window 1,024) to 1 full one, repeated twice.
GEMMA3_LIKE = ModelConfig(architecture="mistral", vocab_size=256, hidden_size=64,
                          intermediate_size=128, num_layers=12, num_heads=4, num_kv_heads=2,
                          head_dim=16, sliding_window=1024, max_position_embeddings=8192,
                          layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 2)
LAYER_TOKEN_BYTES = 2 * 2 * 16 * 4  # K and V of 2 heads x 16 float32 dims


def test_split_counts_pages_and_tokens_per_group():
    plan = planner.plan(GEMMA3_LIKE, kv_cache_bytes=10**9, max_model_len=4096, page_size=16,
                        max_num_batched_tokens=512)
    full_page, sliding_page = 16 * 2 * LAYER_TOKEN_BYTES, 16 * 10 * LAYER_TOKEN_BYTES
    first, second = plan.page_groups
    assert (first.kind, first.window, second.kind, second.window) == (
        "full", None, "sliding", 1024)
    assert (plan.page_bytes, first.page_bytes, second.page_bytes) == (
        full_page, full_page, sliding_page)
    window, context, slack = 1024 // 16 + 1, 4096 // 16, 512 // 16 + 1
    assert (first.request_pages, second.request_pages) == (context, window)
    assert first.num_pages == plan.num_pages
    # bytes = page bytes per layer x (n_full x P_full + n_sliding x P_sliding), with
    # P_sliding = (P_full - 1) x W / F + slack + 1, rounded down, the rest to the sliding
    full = plan.num_pages
    assert full == int((10**9 - sliding_page * (slack + 1 - window / context))
                       // (full_page + sliding_page * window / context))
    assert second.num_pages == (10**9 - full * full_page) // sliding_page
    assert second.num_pages - 1 >= (full - 1) * window // context + slack
    assert plan.kv_cache_bytes == full * full_page + second.num_pages * sliding_page
    assert plan.kv_cache_bytes <= 10**9
    summary = plan.summary()
    assert summary["kv_tokens"] == (full - 1) * 16
    assert summary["num_sliding_pages"] == second.num_pages
    assert summary["kv_tokens_sliding"] == (second.num_pages - 1) * 16
    one_group = planner.plan(GEMMA3_LIKE, kv_cache_bytes=10**9, max_model_len=4096,
                             page_size=16, hybrid_kv_cache=False)
    assert summary["kv_tokens_without_hybrid"] == one_group.summary()["kv_tokens"]
    assert len(one_group.page_groups) == 1 and "kv_tokens_sliding" not in one_group.summary()
    ratio = plan.max_concurrent_requests / one_group.max_concurrent_requests
    assert summary["max_concurrent_requests_without_hybrid"] == \
        one_group.max_concurrent_requests
    assert ratio == pytest.approx(12 / (2 + 10 * window / context), rel=0.01)  # ~2.64


@pytest.mark.parametrize("layer_types", [None, ("full_attention",) * 12,
                                         ("sliding_attention",) * 12])
def test_one_kind_of_layer_keeps_one_group(layer_types):
    cfg = dataclasses.replace(GEMMA3_LIKE, layer_types=layer_types)
    assert len(group_layers(cfg, 16, 4096, hybrid=True)) == 1
    plan = planner.plan(cfg, kv_cache_bytes=10**8, max_model_len=4096, page_size=16)
    (group,) = plan.page_groups
    assert (group.kind, group.window, group.num_layers) == ("full", None, 12)
    assert plan.num_pages == 10**8 // (16 * 12 * LAYER_TOKEN_BYTES)


def test_a_window_as_long_as_the_context_keeps_one_group():
    assert [(g.kind, g.num_layers) for g in group_layers(GEMMA3_LIKE, 16, 4096, True)] == [
        ("full", 2), ("sliding", 10)]
    assert len(group_layers(GEMMA3_LIKE, 16, 1024, True)) == 1  # 65 window pages >= 64
    assert len(group_layers(GEMMA3_LIKE, 16, 4096, False)) == 1  # the flag
    assert split_pages(1000, [10, 50], [4, 1], slack=1) == [
        int((1000 - 50 * 1.75) // 22.5), (1000 - 40 * 10) // 50]


def test_memory_that_fits_one_request_only_with_the_hybrid_cache():
    """`memory_bytes` is checked against what one request needs in its page groups."""
    cfg = dataclasses.replace(GEMMA3_LIKE, max_position_embeddings=65536)
    kw = dict(max_model_len=65536, page_size=16, max_num_batched_tokens=512,
              max_num_seqs=1)
    one_group = planner.plan(cfg, kv_cache_bytes=10**9, hybrid_kv_cache=False, **kw)
    weights = one_group.weight_bytes + one_group.batch_state_bytes
    pages = 65536 // 16
    full_need = (pages + 1) * 16 * 2 * LAYER_TOKEN_BYTES
    sliding_need = (1024 // 16 + 1 + 512 // 16 + 1 + 1) * 16 * 10 * LAYER_TOKEN_BYTES
    memory = weights + full_need + sliding_need
    with pytest.raises(ValueError, match="one request of max_model_len=65536 needs"):
        planner.plan(cfg, memory_bytes=memory, hybrid_kv_cache=False, **kw)
    plan = planner.plan(cfg, memory_bytes=memory, **kw)
    assert plan.max_concurrent_requests == 1
    with pytest.raises(ValueError, match="short"):
        planner.plan(cfg, memory_bytes=memory - 16 * LAYER_TOKEN_BYTES, **kw)
