"""Gemma 3 27B's step compiled by libtpu's compiler over a v6e:2x2 slice (never run).

bf16 weights and pages, split over the 4 chips (8 query heads and 4 KV heads a chip);
the sliding layers have their own page group (the hybrid KV cache), the global ones the
rest of the pool.
The default run compiles a 4-layer variant with one global layer (3 sliding layers of
1,024-token windows and local RoPE, then a global one with scaled RoPE) for two
buckets; `slow` compiles the whole 62 layers. The Gemma block adds no collective:
per step 2 all-reduces a layer (after o and after down), the embedding's all-reduce
and the logits' all-gather (an all-reduce with a single logits row), as for Llama
(test_tensor_parallel_compile.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer import aot
from jaxinfer.config import load_preset
from jaxinfer.engine.runner.inputs import NUM_SAMPLE_POSITIONS

DEVICE, CHIPS = "v6e-4", 4
SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=8,
                        max_num_batched_tokens=16, max_model_len=4096, page_size=16)
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def gemma3_27b(num_layers: int | None = None):
    cfg = load_preset("gemma-3-27b")
    if num_layers is None:
        return cfg
    types = (LOCAL,) * (num_layers - 1) + (GLOBAL,)
    return dataclasses.replace(cfg, num_layers=num_layers, layer_types=types)


def _check(report: dict, cfg) -> None:
    assert report["fits"], report
    assert report["chips_used"] == CHIPS and report["plan"]["tensor_parallel_size"] == CHIPS
    plan = report["plan"]  # the hybrid KV cache: the sliding layers' own, fewer pages
    assert 0 < plan["num_sliding_pages"] < plan["num_pages"]
    kv_shapes = {f"bf16[{plan[pages]},16,4,2,{cfg.head_dim}]"  # 4 KV heads a chip
                 for pages in ("num_pages", "num_sliding_pages")}
    for row in report["buckets"]:
        assert row["compiled"], row
        assert row["mosaic_kernels"] == 2 * cfg.num_layers  # prefill + decode pass a layer
        assert set(row["kv_pages"]) == kv_shapes
        assert row["args_vs_plan"] < 0.01
        assert row["total_bytes"] <= report["chip_usable_hbm_bytes"]
        one_row = row["slots"] * NUM_SAMPLE_POSITIONS == 1
        assert row["collectives"] == {
            "all-reduce": 2 * cfg.num_layers + 1 + one_row, "all-gather": int(not one_row),
            "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}, row


def test_gemma3_layers_with_one_global_compile_over_4_chips():
    cfg = gemma3_27b(4)
    assert cfg.sliding_layers() == (0, 1, 2)
    assert [cfg.layer_rope(i) for i in range(4)] == ["local"] * 3 + ["global"]
    report = aot.compile_report(cfg, device=DEVICE, settings=SETTINGS, buckets="ends")
    assert [(r["tokens"], r["slots"]) for r in report["buckets"]] == [(1, 1), (16, 8)]
    _check(report, cfg)


@pytest.mark.slow
def test_whole_gemma3_27b_compiles_over_4_chips():
    cfg = gemma3_27b()
    assert len(cfg.sliding_layers()) == 52  # 10 of the 62 layers are global
    report = aot.compile_report(cfg, device=DEVICE, settings=SETTINGS, buckets="ends")
    _check(report, cfg)
