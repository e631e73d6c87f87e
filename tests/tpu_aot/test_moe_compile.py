"""Mixture-of-experts steps compiled by libtpu's compiler over 8 chips (never run).

Qwen3-30B-A3B in bf16 on a v6e:2x4 with expert parallelism (16 of the 128 experts per
chip) and Mixtral-8x7B in bf16 on a v5e:2x4 with the experts split inside (each chip a
slice of every expert): 4-layer variants in the default run, the whole models `slow`.
Per chip the plan's weights and KV pool fit; the decode bucket gathers its tokens'
experts and the mixed bucket runs the megablox grouped matmul (Mosaic). Collectives
per step, L layers: per layer the attention output's all-reduce and the experts' psum,
the embedding's all-reduce, and the logits' all-gather (with one logits row XLA:TPU
writes the gather as an all-reduce).
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer import aot
from jaxinfer.config import load_preset
from jaxinfer.engine.runner.inputs import NUM_SAMPLE_POSITIONS

SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=8,
                        max_num_batched_tokens=16, max_model_len=2048, page_size=16)
MODELS = {"qwen3-30b-a3b": ("v6e-8", True), "mixtral-8x7b": ("v5e-8", False)}


def _cfg(name: str, layers: int | None):
    cfg = load_preset(name)
    return cfg if layers is None else dataclasses.replace(cfg, num_layers=layers)


def _settings(name: str) -> aot.Settings:
    """SETTINGS with the model's expert parallelism (whole experts a chip, or not)."""
    return dataclasses.replace(SETTINGS, expert_parallel=MODELS[name][1])


def _check(report: dict, cfg) -> None:
    assert report["fits"], report
    plan = report["plan"]
    assert plan["tensor_parallel_size"] == 8
    moe = cfg.moe  # gate, up and down of every expert, bf16, an eighth on each chip
    experts = cfg.num_layers * 3 * moe.num_experts * moe.intermediate_size * cfg.hidden_size
    assert plan["expert_weight_bytes"] == 2 * experts // 8
    for row in report["buckets"]:
        assert row["compiled"], row
        assert row["args_vs_plan"] < 0.01  # per chip: its weights and its pool
        assert row["total_bytes"] <= report["chip_usable_hbm_bytes"]
        one_row = row["slots"] * NUM_SAMPLE_POSITIONS == 1
        assert row["collectives"] == {
            "all-reduce": 2 * cfg.num_layers + 1 + one_row, "all-gather": int(not one_row),
            "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}, row


@pytest.mark.parametrize("name", list(MODELS))
def test_moe_layers_compile_over_8_chips(name):
    cfg = _cfg(name, 4)
    report = aot.compile_report(cfg, device=MODELS[name][0], settings=_settings(name),
                                buckets="ends")
    assert [(r["tokens"], r["slots"]) for r in report["buckets"]] == [(1, 1), (16, 8)]
    _check(report, cfg)
    # Mosaic kernels: attention's two passes a layer; the mixed bucket (16 tokens, 128 or
    # 32 choices) adds the megablox grouped matmul for gate/up and down, the decode
    # bucket gathers its one token's experts instead.
    assert [r["mosaic_kernels"] for r in report["buckets"]] == [2 * cfg.num_layers,
                                                                4 * cfg.num_layers]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_whole_moe_models_compile_over_8_chips(name):
    cfg = _cfg(name, None)
    report = aot.compile_report(cfg, device=MODELS[name][0], settings=_settings(name),
                                buckets="ends")
    _check(report, cfg)
