"""Llama-3.1-70B's step in pipeline stages, PP 2 x TP 8 over the 16 chips of a v5e-16
(v5e:4x4, four hosts of four chips), compiled by libtpu's compiler (compiled, never run).

`aot.compile_report` with `pipeline_parallel_size=2` lays the replica's chips out
("stage", "model"), stage-major: stage s on chips [8s, 8s + 8). The layers and their KV
pages are stacked by slot with a leading [stages] axis split over "stage"
(model/pipeline.py), the embedding and LM head split by TP on both stages, and the pool
per chip is the planner's for one stage. Checked: per-chip argument bytes within usable
HBM and within 5% of the plan's (weights of the stage's layer slots, embedding and head,
its pool); the collective permutes crossing stages are exactly a microbatch's
activations f32[T/M, 8192] handed on each tick but the last (M + PP - 1 ticks, unrolled)
and the sampled rows f32[R, 8192] (the last stage's rows handed to the other), with the
bytes of pipeline_plan's figures; no all-reduce, all-gather, reduce-scatter or
all-to-all groups chips of both stages. The default run compiles 4 of the 70B's
layers (2 slots a stage) for the one mixed bucket of a 16-token budget (16 tokens, 4
rows: 2 microbatches of 8); `slow` compiles the whole 80 layers (40 slots a stage) for
the smallest, a mixed and the largest bucket of a 512-token budget.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer import aot
from jaxinfer.config import load_preset
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.sizing import pipeline_plan

PP, TP, DEVICE = 2, 8, "v5e-16"
SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=4,
                        max_num_batched_tokens=16, max_model_len=2048, page_size=16,
                        tensor_parallel_size=TP, pipeline_parallel_size=PP)
MIXED = BucketSet(max_num_batched_tokens=16, max_num_seqs=4).all()[-1]  # 16 tokens, 4 rows


def llama_70b(num_layers: int = 80) -> object:
    return dataclasses.replace(load_preset("llama3.1-70b"), num_layers=num_layers)


def check_memory(report: dict) -> None:
    assert report["fits"], report
    assert report["layout"] == "DP 1 x PP 2 x TP 8"
    assert report["chips_used"] == report["chips_in_slice"] == PP * TP
    plan = report["plan"]
    assert (plan["pipeline_parallel_size"], plan["tensor_parallel_size"]) == (PP, TP)
    [replica] = report["replicas"]
    assert replica["chips"] == list(range(PP * TP))
    for row in report["buckets"]:
        assert row["compiled"], row
        assert row["total_bytes"] <= report["chip_usable_hbm_bytes"]
        assert row["args_vs_plan"] < 0.05  # per chip: its stage's slots, embed, head, pool
        assert row["weights_vs_plan"] < 0.05


def test_llama_70b_layers_compile_in_two_stages_of_eight_chips():
    cfg = llama_70b(num_layers=4)
    report = aot.compile_report(cfg, device=DEVICE, settings=SETTINGS, buckets=[MIXED])
    check_memory(report)
    [row] = report["buckets"]
    micro = pipeline_plan.microbatches(MIXED.num_tokens, PP)  # one per stage
    ticks = pipeline_plan.ticks(PP, micro)  # unrolled (model/pipeline.py)
    rows = MIXED.num_slots  # one sampled position a request
    assert row["cross_stage_permute_shapes"] == sorted(
        {f"f32[{MIXED.num_tokens // micro},{cfg.hidden_size}]", f"f32[{rows},{cfg.hidden_size}]"})
    # a hand-on every tick but the last (its result unused), then the rows' PP - 1 hops
    hand_ons = ticks - 1
    assert row["cross_stage_permutes"] == row["collective_permutes"] == hand_ons + PP - 1
    assert row["cross_stage_permute_bytes"] == (
        hand_ons * pipeline_plan.microbatch_bytes(cfg, MIXED.num_tokens, micro)
        + pipeline_plan.broadcast_bytes(cfg, rows, PP))
    assert row["cross_stage_collectives"] == {"all-reduce": 0, "all-gather": 0,
                                              "reduce-scatter": 0, "all-to-all": 0}
    # tensor parallelism inside a stage: 2 all-reduces a slot every tick (bubbles too)
    # and the embedding's, the logits' gather (test_tensor_parallel_compile.py)
    slots = pipeline_plan.layer_slots(cfg, PP)
    assert row["collectives"]["all-reduce"] == 2 * slots * ticks + 1
    assert row["collectives"]["all-gather"] == 1


@pytest.mark.slow
def test_whole_llama_70b_compiles_in_two_stages_of_eight_chips():
    cfg = llama_70b()
    report = aot.compile_report(cfg, device=DEVICE, settings=dataclasses.replace(
        SETTINGS, max_num_seqs=32, max_num_batched_tokens=512), buckets="ends")
    check_memory(report)
    assert report["plan"]["weight_bytes"] > 9e9  # 40 of the 80 layers a chip, embed, head
    for row in report["buckets"]:
        assert row["cross_stage_permutes"] == row["collective_permutes"]
        assert all(shape.startswith("f32[") and shape.endswith(f",{cfg.hidden_size}]")
                   for shape in row["cross_stage_permute_shapes"])
        assert row["cross_stage_collectives"] == {"all-reduce": 0, "all-gather": 0,
                                                  "reduce-scatter": 0, "all-to-all": 0}
