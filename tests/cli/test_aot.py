"""aot's choices, HLO readers and progress lines, which need no TPU compiler, and its
one-line refusal where libtpu is absent (the compiles themselves are in tests/tpu_aot,
run in .venv-tpu)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

from jaxinfer import aot, aot_rows
from jaxinfer.cli import aot_table
from jaxinfer.config import load_preset
from jaxinfer.sizing import accelerators

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Lines as libtpu prints them (abridged): an all-reduce, an async all-gather pair, a
# tuple-shaped all-reduce, and instructions merely named after collectives.
HLO = """\
ENTRY %main.1_spmd (param.1: bf16[16032,4096], param.2: bf16[50400,16,1,2,128], \
param.3: bf16[50400,16,1,2,128], param.4: s32[64]) -> (bf16[50400,16,1,2,128], s32[9]) {
  %all-reduce.1 = f32[16,4096]{1,0:T(8,128)} all-reduce(%fusion.3), channel_id=1
  %all-gather-start = (f32[64,16032], f32[64,128256]) all-gather-start(%fusion.9), dimensions={1}
  %all-gather-done = f32[64,128256]{1,0} all-gather-done(%all-gather-start)
  %all-reduce.2 = (f32[1], f32[1]) all-reduce(%a, %b), channel_id=2
  %copy.all-reduce.3 = f32[16,4096]{1,0} copy(%all-reduce.1)
}
"""


def test_collective_counts_reads_opcodes_and_counts_async_pairs_once():
    assert aot_rows.collective_counts(HLO) == {"all-reduce": 2, "all-gather": 1,
                                          "reduce-scatter": 0, "all-to-all": 0,
                                          "collective-permute": 0}


def test_kv_page_shapes_are_the_entrys_5d_parameters():
    assert aot_rows.kv_page_shapes(HLO) == ["bf16[50400,16,1,2,128]"]


def test_tensor_parallel_defaults_to_every_chip_of_the_slice():
    cfg = load_preset("llama3.1-8b")
    assert aot.choose_tensor_parallel(cfg, accelerators.get("v5e-8"), aot.Settings()) == (
        8, None)
    assert aot.choose_tensor_parallel(cfg, accelerators.get("v6e-1"), aot.Settings()) == (
        1, None)


def test_tensor_parallel_falls_back_to_one_chip_and_says_why():
    cfg = load_preset("smollm-135m")  # 9 query heads: 8 chips cannot split them
    tp, why = aot.choose_tensor_parallel(cfg, accelerators.get("v6e-8"), aot.Settings())
    assert tp == 1 and "does not split over the slice's 8" in why and "9 query heads" in why


def test_tensor_parallel_given_must_split_the_model_and_fit_the_slice():
    cfg, acc = load_preset("llama3.1-8b"), accelerators.get("v5e-4")
    settings = aot.Settings(tensor_parallel_size=2)
    assert aot.choose_tensor_parallel(cfg, acc, settings) == (2, None)
    with pytest.raises(ValueError, match="exceeds the 4 device"):
        aot.choose_tensor_parallel(cfg, acc, dataclasses.replace(settings,
                                                                 tensor_parallel_size=8))
    with pytest.raises(ValueError, match="must divide the 32 query heads"):
        aot.choose_tensor_parallel(cfg, acc, dataclasses.replace(settings,
                                                                 tensor_parallel_size=3))


def test_data_parallel_fills_the_slice_with_replicas_of_tensor_parallel_chips():
    cfg, acc = load_preset("llama3.1-8b"), accelerators.get("v6e-8")
    assert aot.choose_layout(cfg, acc, aot.Settings()) == (8, 1, None)  # as before
    assert aot.choose_layout(cfg, acc, aot.Settings(data_parallel_size=2)) == (4, 2, None)
    assert aot.choose_layout(cfg, acc, aot.Settings(data_parallel_size=8)) == (1, 8, None)
    assert aot.choose_layout(cfg, acc, aot.Settings(data_parallel_size=2,
                                                    tensor_parallel_size=2)) == (2, 2, None)
    with pytest.raises(ValueError, match="needs 16 chips; v6e-8 has 8"):
        aot.choose_layout(cfg, acc, aot.Settings(data_parallel_size=2, tensor_parallel_size=8))
    with pytest.raises(ValueError, match="data_parallel_size=3 must divide the slice's 8"):
        aot.choose_layout(cfg, acc, aot.Settings(data_parallel_size=3))
    smollm = load_preset("smollm-135m")  # 9 query heads: 2 replicas of 4 chips cannot split
    with pytest.raises(ValueError, match="must divide the 9 query heads"):
        aot.choose_layout(smollm, acc, aot.Settings(data_parallel_size=2))


def test_replicas_compiled_are_the_first_and_the_last():
    assert aot.replicas_to_compile(1) == [0]
    assert aot.replicas_to_compile(2) == [0, 1]
    assert aot.replicas_to_compile(8) == [0, 7]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None,
                    reason="libtpu is installed in this Python")
def test_aot_without_libtpu_says_how_to_install_it_in_one_line():
    env = {k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"}
    result = subprocess.run([sys.executable, "-m", "jaxinfer", "aot", "--model=qwen3-0.6b"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1  # a runtime failure: this Python lacks a library
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("jaxinfer: error: aot: libtpu's TPU compiler is not "
                               f"installed in this Python ({sys.executable})")
    assert "pip install 'jaxinfer[tpu-aot]'" in lines[0]
    assert "make .venv-tpu/.base" in lines[0] and ".venv-tpu/bin/python -m jaxinfer aot" in (
        lines[0])


def test_the_install_hint_names_an_extra_and_a_make_target_that_exist():
    extra = re.search(r"jaxinfer\[([\w-]+)\]", aot.INSTALL_HINT).group(1)
    target = re.search(r"`make (\S+)`", aot.INSTALL_HINT).group(1)
    assert f"\n{extra} = [" in (ROOT / "pyproject.toml").read_text()
    makefile = (ROOT / "Makefile").read_text()
    venv = re.search(r"^TPU_VENV := (\S+)$", makefile, re.M).group(1)
    assert target == f"{venv}/.base" and "\n$(TPU_VENV)/.base:" in makefile
    assert f"{venv}/bin/python -m jaxinfer aot" in aot.INSTALL_HINT


def test_progress_lines_name_the_work_and_each_bucket_as_it_ends():
    start = {"stage": "start", "device": "v5e-8", "layout": "DP 8 x TP 1", "buckets": 3,
             "replicas": [0, 7], "total": 6}
    assert aot_table.progress_line(start) == (
        "aot: compiling 6 steps (3 buckets) for replicas 0 and 7 of v5e-8 (DP 8 x TP 1), "
        "one at a time: tens of seconds to minutes each on a CPU host")
    bucket = {"stage": "bucket", "replica": 7, "replicas": [0, 7], "number": 5, "total": 6,
              "tokens": 256, "slots": 32, "decode": False, "compiled": True,
              "seconds": 14.23, "elapsed_s": 150.0}
    assert aot_table.progress_line(bucket) == (
        "aot: replica 7, bucket 5/6: 256 tokens x 32 seqs (mixed) compiled in 14.2 s "
        "(2.5 min so far)")
    one = bucket | {"replicas": [0], "replica": 0, "number": 1, "tokens": 1, "slots": 1,
                    "decode": True, "compiled": False}
    assert aot_table.progress_line(one) == (
        "aot: bucket 1/6: 1 token x 1 seq (decode) does not compile (see the table) in "
        "14.2 s (2.5 min so far)")


def test_exit_code_is_3_when_a_bucket_failed_and_1_when_nothing_fits():
    ok = {"compiled": True}
    failed = {"compiled": False, "error": "RESOURCE_EXHAUSTED: out of HBM"}
    report = {"plan": {}, "replicas": [{"buckets": [ok, ok]}, {"buckets": [ok]}]}
    assert aot_table.exit_code(report) == 0
    report["replicas"][1]["buckets"].append(failed)
    assert aot_table.exit_code(report) == 3
    assert aot_table.exit_code({"error": "the weights alone need 16.1 GB"}) == 1


def test_pipeline_stages_take_the_slice_over_their_tensor_parallel_chips():
    cfg, acc = load_preset("llama3.1-8b"), accelerators.get("v6e-8")
    assert aot.choose_layout(cfg, acc, aot.Settings(pipeline_parallel_size=2)) == (4, 1, None)
    assert aot.choose_layout(cfg, acc, aot.Settings(pipeline_parallel_size=2,
                                                    data_parallel_size=2)) == (2, 2, None)
    assert aot.choose_layout(cfg, acc, aot.Settings(pipeline_parallel_size=4,
                                                    tensor_parallel_size=2)) == (2, 1, None)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 x tensor_parallel_size=8 "
                                         "needs 16 chips; v6e-8 has 8"):
        aot.choose_layout(cfg, acc, aot.Settings(pipeline_parallel_size=2,
                                                 tensor_parallel_size=8))
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 must divide the slice's 8"):
        aot.choose_layout(cfg, acc, aot.Settings(pipeline_parallel_size=3))
    assert aot.layout_name(4, 1, 2) == "DP 1 x PP 2 x TP 4"
    assert aot.layout_name(4, 2, 1) == "DP 2 x TP 4"


def test_pipelined_step_specs_stack_layers_and_pages_by_stage():
    cfg = dataclasses.replace(load_preset("llama3.1-8b"), num_layers=5)  # stages of 3, 2
    settings = aot.Settings(pipeline_parallel_size=2, max_num_seqs=4, max_model_len=256,
                            kv_cache_memory_bytes=2**24)
    plan = aot.plan_for(cfg, accelerators.get("v5e-8"), settings, 4)
    params, kv = aot.step_specs(cfg, plan, settings, 4)
    assert len(params["layers"]) == len(kv) == 3  # slots a stage
    assert params["layers"][0]["wqkv"].shape == (2, 4096, 6144)
    assert params["embed"].shape == (cfg.vocab_size, 4096)  # on every stage, not stacked
    assert all(leaf.shape[0] == 2 for leaf in jax.tree.leaves([params["layers"], kv]))
    # each stage's own pool: the plan's pages of a chip, 2**24 bytes of it
    assert kv[0].shape[1] == plan.page_groups[0].num_pages
    assert plan.kv_cache_bytes <= 2**24


HLO_STAGES = """\
  %collective-permute-start = (f32[8,8192]{1,0}, f32[8,8192]{1,0}, u32[], u32[]) \
collective-permute-start(%fusion.2), channel_id=3, source_target_pairs={{0,2},{1,3}}
  %collective-permute-done = f32[8,8192]{1,0} collective-permute-done(%collective-permute-start)
  %collective-permute.1 = bf16[4,16]{1,0} collective-permute(%x), source_target_pairs={{0,1}}
  %all-reduce.1 = f32[8,8192]{1,0} all-reduce(%a), channel_id=1, replica_groups=[2,2]<=[4]
  %all-reduce.2 = f32[8]{0} all-reduce(%b), channel_id=2, replica_groups={{0,2},{1,3}}
  %all-gather.3 = f32[4,64]{1,0} all-gather(%c), replica_groups={}, dimensions={1}
"""


def test_stage_traffic_counts_permutes_and_groups_spanning_stages():
    # 2 stages of 2 chips: ids 0, 1 are stage 0; 2, 3 stage 1
    assert aot_rows.stage_traffic(HLO_STAGES, chips_per_stage=2, stages=2) == {
        "collective_permutes": 2, "collective_permute_bytes": 8 * 8192 * 4 + 4 * 16 * 2,
        "cross_stage_permutes": 1, "cross_stage_permute_bytes": 8 * 8192 * 4,
        "cross_stage_permute_shapes": ["f32[8,8192]"],
        "cross_stage_collectives": {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 0,
                                    "all-to-all": 0}}


def test_replica_groups_reads_the_three_forms():
    read = aot_rows.replica_groups
    assert read("x, replica_groups={{0,1},{2,3}}, y") == [[0, 1], [2, 3]]
    assert read("x, replica_groups=[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert read("x, replica_groups=[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert read("x, replica_groups=mesh['stage'=2,'model'=4] {'model'}") == [
        [0, 1, 2, 3], [4, 5, 6, 7]]
    assert read("x, replica_groups=mesh['stage'=2,'model'=2] {'stage'}") == [[0, 2], [1, 3]]
    assert read("x, replica_groups={}", num_devices=3) == [[0, 1, 2]]
