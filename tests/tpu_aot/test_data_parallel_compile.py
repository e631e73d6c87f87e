"""Data parallelism on a TPU slice: replicas of the int8 Llama-3.1-8B step, each compiled
by libtpu for its own chips (replica r: chips [r * TP, (r + 1) * TP)), never run.

`aot.compile_report` with `data_parallel_size` compiles replica 0 and the last (every
replica runs the same program on its own chips), each on a 1-D mesh over its chips of
the topology. Checked per replica: the executable's inputs live on that replica's
devices only; the compiled per-chip memory (`memory_analysis`: arguments, outputs,
temporaries) fits the chip and both replicas' are the same; the compiled arguments less
the planned KV pool are the planner's per-chip weight bytes within 1% (the rest is the
batch state and the step's inputs, a few KB), and those are the bytes `plan`'s layout
table shows for the split; the collectives are the tensor-parallel step's (none at
TP 1). The layouts are those `plan` recommends for the whole 8B in int8
(tests/sizing/test_layout.py): DP 8 x TP 1 on v5e-8, DP 2 x TP 4 on v6e-8. The default
run compiles 4 of the 8B's layers for the smallest bucket; `slow` compiles all 32 for
"ends".
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxinfer import aot
from jaxinfer.config import load_preset
from jaxinfer.engine.runner.inputs import NUM_SAMPLE_POSITIONS
from jaxinfer.sizing import accelerators, layout

# Buckets (1, 1) (2, 2) (4, 4) (8, 8) decode and (16, 8) mixed: the default run compiles
# the smallest (placement and memory per chip), `slow` "ends" (2 of them).
SMALL = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=8,
                     max_num_batched_tokens=16, max_model_len=2048, page_size=16,
                     quantization="int8")
WEIGHT_TOLERANCE = 0.01  # compiled arguments less the KV pool vs the planner's weights


def llama(num_layers: int) -> object:
    return dataclasses.replace(load_preset("llama3.1-8b"), num_layers=num_layers)


def expected_collectives(cfg, tp: int, logits_rows: int) -> dict[str, int]:
    """As tests/tpu_aot/test_tensor_parallel_compile.py counts them; none at TP 1."""
    if tp == 1:
        all_reduce = all_gather = 0
    else:
        one_row = logits_rows == 1
        all_reduce, all_gather = 2 * cfg.num_layers + 1 + one_row, int(not one_row)
    return {"all-reduce": all_reduce, "all-gather": all_gather, "reduce-scatter": 0,
            "all-to-all": 0, "collective-permute": 0}


def check_replicas(report: dict, cfg, device: str, dp: int, tp: int) -> None:
    acc = accelerators.get(device)
    assert report["fits"], report
    assert (report["data_parallel_size"], report["tensor_parallel_size"]) == (dp, tp)
    assert report["layout"] == f"DP {dp} x TP {tp}" and report["chips_used"] == 8
    plan = report["plan"]
    # the planner's bytes a chip are the layout table's for this split
    split = layout.evaluate(cfg, acc, tp, dtype=SMALL.dtype, kv_dtype=SMALL.kv_dtype,
                            quantization="int8", max_model_len=SMALL.max_model_len,
                            max_num_seqs=SMALL.max_num_seqs,
                            memory_bytes=int(acc.chip.usable_hbm_bytes * 0.9),
                            bandwidth_gb_per_s=acc.chip.hbm_bytes_per_s / 1e9)
    assert (split.data_parallel_size, split.fits) == (dp, True)
    assert (split.weight_bytes, split.kv_cache_bytes) == (plan["weight_bytes"],
                                                         plan["kv_cache_bytes"])
    ids = [d.id for d in aot.target_devices(acc)]
    replicas = report["replicas"]
    assert [r["replica"] for r in replicas] == [0, dp - 1]
    for replica in replicas:
        r = replica["replica"]
        mine = ids[r * tp:(r + 1) * tp]
        assert replica["chips"] == list(range(r * tp, (r + 1) * tp))
        assert replica["device_ids"] == mine
        for row in replica["buckets"]:
            assert row["compiled"], row
            assert row["placed_on"] == sorted(mine)  # the executable's own placement
            assert row["total_bytes"] <= report["chip_usable_hbm_bytes"]
            assert row["weights_vs_plan"] < WEIGHT_TOLERANCE
            assert row["args_vs_plan"] < 0.01
            assert row["mosaic_kernels"] == 2 * cfg.num_layers
            assert row["kv_pages"] and all(
                shape.split("[")[1].startswith(f"{plan['num_pages']},")
                for shape in row["kv_pages"])
            assert row["collectives"] == expected_collectives(
                cfg, tp, row["slots"] * NUM_SAMPLE_POSITIONS)
    first, last = replicas[0]["buckets"], replicas[-1]["buckets"]
    memory = ("argument_bytes", "output_bytes", "temp_bytes", "total_bytes")
    assert [[row[k] for k in memory] for row in first] == [
        [row[k] for k in memory] for row in last]  # one program, other chips
    assert not set(replicas[0]["device_ids"]) & set(replicas[-1]["device_ids"])


@pytest.mark.parametrize("device, dp, tp", [("v5e-8", 8, 1), ("v6e-8", 2, 4)])
def test_llama_8b_int8_layers_compile_for_the_first_and_last_replica(device, dp, tp):
    cfg = llama(4)
    settings = dataclasses.replace(SMALL, data_parallel_size=dp)  # TP: the rest
    report = aot.compile_report(cfg, device=device, settings=settings, buckets="smallest")
    assert [(r["tokens"], r["slots"]) for r in report["buckets"]] == [(1, 1)]
    check_replicas(report, cfg, device, dp, tp)


@pytest.mark.slow
@pytest.mark.parametrize("device, dp, tp", [("v5e-8", 8, 1), ("v6e-8", 2, 4)])
def test_llama_8b_int8_compiles_for_the_first_and_last_replica(device, dp, tp):
    cfg = llama(32)
    settings = dataclasses.replace(SMALL, data_parallel_size=dp, tensor_parallel_size=tp)
    report = aot.compile_report(cfg, device=device, settings=settings, buckets="ends")
    check_replicas(report, cfg, device, dp, tp)
