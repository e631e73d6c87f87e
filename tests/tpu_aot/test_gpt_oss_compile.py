"""gpt-oss-20b's step compiled by libtpu's compiler for one v6e chip (never run).

bf16 attention and pages; the experts as the published checkpoint holds them, MXFP4
packed (`quantization="mxfp4"`: uint8 blocks and e8m0 scales, decoded to bf16 inside
the step; the other weights bf16), or fp8 (`quantization="fp8"`: every linear weight,
the experts stacked [E, O, I] with a scale per expert and row). The default run
compiles a 4-layer variant (two sliding-window layers of 128 tokens, two full ones;
attention sinks, YaRN, expert biases, the clamped SwiGLU) with MXFP4 experts for two
buckets; `slow` compiles it with fp8 and the whole 24 layers both ways. The decode
bucket gathers its token's 4 experts (MXFP4: their packed bytes); the mixed bucket
(16 tokens, 64 choices) runs the megablox grouped matmul for gate/up and down (MXFP4:
on the layer's experts decoded to bf16), so each layer adds two Mosaic kernels to
attention's two.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer import aot
from jaxinfer.config import load_preset

DEVICE = "v6e-1"
# The chip's whole KV pool, as the engine sizes it (weights plus pool within 0.9 of HBM).
SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=8,
                        max_num_batched_tokens=16, max_model_len=4096, page_size=16,
                        quantization="mxfp4", quantized_head=False)
FP8 = dataclasses.replace(SETTINGS, quantization="fp8", quantized_head=True)


def gpt_oss_20b(num_layers: int | None = None):
    cfg = load_preset("gpt-oss-20b")
    if num_layers is None:
        return cfg
    return dataclasses.replace(cfg, num_layers=num_layers,
                               layer_types=cfg.layer_types[:num_layers])


def _check(report: dict, cfg, mode: str = "mxfp4") -> None:
    assert report["fits"], report
    assert report["chips_used"] == 1
    plan = report["plan"]
    moe = cfg.moe
    elements = cfg.num_layers * 3 * moe.num_experts * moe.intermediate_size * cfg.hidden_size
    scales = cfg.num_layers * moe.num_experts * (2 * moe.intermediate_size + cfg.hidden_size)
    assert plan["expert_weight_bytes"] == {  # packed: half a byte an element, a byte per
        # 32; fp8: a byte an element, f32 scales per expert and row
        "mxfp4": elements // 2 + elements // 32, "fp8": elements + 4 * scales}[mode]
    for row in report["buckets"]:
        assert row["compiled"], row
        assert row["args_vs_plan"] < 0.01
        assert row["total_bytes"] <= report["chip_usable_hbm_bytes"]
        assert set(row["collectives"].values()) == {0}
        # head_dim 64 pages in rows of 128 lanes (K and V side by side): no copy of the
        # pool into a lane-padded layout around the K/V write and the Mosaic kernel
        assert row["temp_bytes"] < 0.5 * plan["kv_cache_bytes"], row
        assert all(pages.endswith(",16,4,2,128]") for pages in row["kv_pages"]), row


def test_gpt_oss_20b_layers_compile_on_one_v6e_chip_with_mxfp4_experts():
    """The experts' packed bytes are the step's arguments: the compiled step's arguments
    are the plan's bytes (within 1%), the bf16 experts only a temporary of one layer."""
    cfg = gpt_oss_20b(4)
    assert cfg.sliding_layers() == (0, 2)
    report = aot.compile_report(cfg, device=DEVICE, settings=SETTINGS, buckets="ends")
    assert [(r["tokens"], r["slots"]) for r in report["buckets"]] == [(1, 1), (16, 8)]
    _check(report, cfg)
    assert [r["mosaic_kernels"] for r in report["buckets"]] == [2 * cfg.num_layers,
                                                                4 * cfg.num_layers]


@pytest.mark.slow  # the default run compiles the same layers with MXFP4 experts
def test_gpt_oss_20b_layers_compile_on_one_v6e_chip_with_fp8_experts():
    cfg = gpt_oss_20b(4)
    report = aot.compile_report(cfg, device=DEVICE, settings=FP8, buckets="ends")
    _check(report, cfg, "fp8")
    assert [r["mosaic_kernels"] for r in report["buckets"]] == [2 * cfg.num_layers,
                                                                4 * cfg.num_layers]


@pytest.mark.slow  # the default run's 4-layer test asserts the same over the whole pool
def test_head_dim_64_pages_are_not_copied_around_the_step():
    """One layer, an 8 GB pool: the step's temporaries stay far below the pool. With
    [.., packing, 64] pages XLA:TPU kept the donated pool in a compact layout of its own
    and copied it into the 128-lane padded layout the K/V write and the Mosaic kernel
    need, and back: two pools of temporaries (kv_layout.py, `fold`). What is left (2.2 GB
    in the mixed bucket) is the embedding's transposed copy and bf16 experts."""
    settings = dataclasses.replace(SETTINGS, kv_cache_memory_bytes=8 * 10**9)
    report = aot.compile_report(gpt_oss_20b(1), device=DEVICE, settings=settings,
                                buckets="ends")
    pool = report["plan"]["kv_cache_bytes"]
    assert pool > 7 * 10**9
    for row in report["buckets"]:
        assert row["compiled"], row
        assert row["temp_bytes"] < 0.5 * pool, row
        [pages] = row["kv_pages"]
        assert pages.endswith(",16,4,2,128]"), pages  # rows of 128 lanes: K and V


@pytest.mark.slow
@pytest.mark.parametrize("settings", [SETTINGS, FP8], ids=["mxfp4", "fp8"])
def test_whole_gpt_oss_20b_compiles_on_one_v6e_chip(settings):
    cfg = gpt_oss_20b()
    report = aot.compile_report(cfg, device=DEVICE, settings=settings, buckets="ends")
    _check(report, cfg, settings.quantization)
