"""The bf16 engine step split over the 8 chips of a v5e:2x4 or v6e:2x4 slice (TP=8),
compiled by libtpu's compiler for that topology (compiled, never run).

`aot.compile_report` puts the step on a 1-D mesh over the topology's 8 abstract devices
with the engine's shardings (params by the spec table, KV pages by head) and sizes each
chip's KV pool with the planner; memory figures are per chip. Llama-3.1-8B's 8 KV heads
give each chip one; a 2-KV-head variant checks the copied heads (sharding.served_config).

Collectives read from the TPU-compiled HLO, per step, for L layers:
- 2 all-reduces a layer: after o and after down, whose weights are split by input rows;
- 1 all-reduce for the embedding lookup: the table is split along the vocabulary, each
  chip looks up the ids in its rows (zeros elsewhere), and the sum assembles the rows;
- the logits, split by vocabulary columns (LM head), gathered before sampling: one
  all-gather of f32[R, V], except with a single logits row (the 1-slot decode bucket),
  where XLA:TPU writes the gather as an all-reduce of a zero-padded f32[V].
So 2L + 1 all-reduces and 1 all-gather, or 2L + 2 and none for one row; nothing else.
The default run compiles the 8B's layer shapes with 4 layers for two buckets (1-slot
decode, and the one mixed bucket of a 16-token budget); `slow` compiles the whole 8B
(32 layers) for every bucket on both topologies.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer import aot
from jaxinfer.config import load_preset
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.engine.runner.inputs import NUM_SAMPLE_POSITIONS

TP = 8
SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=64,
                        max_num_batched_tokens=512, max_model_len=2048, page_size=16)
# Buckets (1, 1) (2, 2) (4, 4) (8, 8) decode and (16, 8) mixed: "ends" picks 2 of them.
SMALL = dataclasses.replace(SETTINGS, max_num_seqs=8, max_num_batched_tokens=16)


def llama(**changes: int) -> object:
    return dataclasses.replace(load_preset("llama3.1-8b"), **changes)


def expected_collectives(num_layers: int, logits_rows: int) -> dict[str, int]:
    one_row = logits_rows == 1
    return {"all-reduce": 2 * num_layers + 1 + one_row, "all-gather": int(not one_row),
            "reduce-scatter": 0, "all-to-all": 0, "collective-permute": 0}


def check_report(report: dict, cfg) -> None:
    assert report["fits"], report
    assert report["chips_used"] == report["chips_in_slice"] == TP
    assert report["tensor_parallel_note"] is None
    plan = report["plan"]
    assert plan["tensor_parallel_size"] == TP
    assert plan["unsharded_weight_bytes"] / TP <= plan["weight_bytes"]  # norms replicated
    kv_shape = f"bf16[{plan['num_pages']},16,1,2,{cfg.head_dim}]"  # one KV head a chip
    for row in report["buckets"]:
        assert row["compiled"], row
        assert row["mosaic_kernels"] == 2 * cfg.num_layers  # prefill + decode pass a layer
        assert row["kv_pages"] == [kv_shape]
        assert row["args_vs_plan"] < 0.01  # per chip: its weights and its pool
        assert row["total_bytes"] <= report["chip_usable_hbm_bytes"]
        assert row["temp_bytes"] < 0.5e9  # no LM head gathered whole (1.05 GB; 0.14 used)
        assert row["collectives"] == expected_collectives(
            cfg.num_layers, row["slots"] * NUM_SAMPLE_POSITIONS)


def test_llama_8b_layers_compile_over_v5e_2x4_decode_and_mixed():
    cfg = llama(num_layers=4)
    report = aot.compile_report(cfg, device="v5e-8", settings=SMALL, buckets="ends")
    assert [(r["tokens"], r["slots"]) for r in report["buckets"]] == [(1, 1), (16, 8)]
    check_report(report, cfg)


def test_kv_heads_copied_to_one_per_chip_compile_over_v6e_2x4():
    cfg = llama(num_layers=2, num_kv_heads=2)  # each KV head copied to 4 chips
    report = aot.compile_report(cfg, device="v6e-8", settings=SMALL, buckets="ends")
    check_report(report, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("device", ["v5e-8", "v6e-8"])
def test_llama_8b_compiles_over_8_chips_every_bucket(device):
    cfg = load_preset("llama3.1-8b")
    report = aot.compile_report(cfg, device=device, settings=SETTINGS, buckets="all")
    every = BucketSet(max_num_batched_tokens=SETTINGS.max_num_batched_tokens,
                      max_num_seqs=SETTINGS.max_num_seqs).all()
    assert len(report["buckets"]) == len(every)
    check_report(report, cfg)
