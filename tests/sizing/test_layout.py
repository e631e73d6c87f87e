"""The DP x TP layout: which splits are listed, what fits, the communication term, and
the recommendation (jaxinfer/sizing/layout.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from jaxinfer.config import load_preset
from jaxinfer.sizing import accelerators, layout, planner


def plan_kwargs(acc: accelerators.Accelerator, *, quantization: str | None = "int8",
                max_model_len: int = 1024, max_num_seqs: int = 64) -> dict:
    """plan's arguments as the plan command passes them for a device preset."""
    return dict(dtype="bfloat16", kv_dtype="bfloat16", quantization=quantization,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                memory_bytes=int(acc.chip.usable_hbm_bytes * 0.9),
                bandwidth_gb_per_s=acc.chip.hbm_bytes_per_s / 1e9,
                peak_flops_per_s=acc.chip.bf16_flops)


def by_tp(splits: list[layout.Split]) -> dict[int, layout.Split]:
    return {s.tensor_parallel_size: s for s in splits}


def without_communication(acc: accelerators.Accelerator) -> accelerators.Accelerator:
    chip = dataclasses.replace(acc.chip, interconnect_bytes_per_s=math.inf,
                               collective_latency_s=0.0, hop_latency_s=0.0)
    return dataclasses.replace(acc, chip=chip)


def test_every_split_uses_every_chip_and_only_valid_tensor_parallel_sizes():
    acc = accelerators.find_preset("v6e-8")
    llama = layout.splits(load_preset("llama3.1-8b"), acc, **plan_kwargs(acc))
    assert [(s.data_parallel_size, s.tensor_parallel_size) for s in llama] == [
        (8, 1), (4, 2), (2, 4), (1, 8)]
    smollm = load_preset("smollm-135m")  # 9 query heads, 3 KV heads: of 1, 2, 4, 8 only 1
    assert layout.tensor_parallel_sizes(smollm, 8) == [1]
    # of 9 chips: 3 splits every part; 9 not the 12 gate/up column blocks (1,536 / 128)
    assert layout.tensor_parallel_sizes(smollm, 9) == [1, 3]
    splits = layout.splits(smollm, acc, **plan_kwargs(acc))
    assert [(s.data_parallel_size, s.tensor_parallel_size) for s in splits] == [(8, 1)]


def test_split_figures_are_the_planners_per_chip():
    acc = accelerators.find_preset("v5e-8")
    cfg = load_preset("llama3.1-8b")
    split = layout.evaluate(cfg, acc, 2, **plan_kwargs(acc))
    plan = planner.plan(cfg, tensor_parallel_size=2, num_devices=8, **plan_kwargs(acc))
    assert split.data_parallel_size == 4
    assert split.weight_bytes == plan.weight_bytes == planner.weight_bytes(
        cfg, "bfloat16", 2, "int8")
    assert split.kv_cache_bytes == plan.kv_cache_bytes
    assert split.batch == min(64, plan.max_concurrent_requests)
    assert split.kv_read_bytes == split.batch * 1024 * plan.kv_bytes_per_token
    assert (split.memory_s, split.compute_s) == plan.decode_seconds(split.batch, 1024)
    assert split.tokens_per_s == pytest.approx(4 * split.batch / split.step_s)
    assert split.step_s == pytest.approx(split.memory_s + split.communication_s)


def test_communication_counts_the_compiled_steps_collectives():
    cfg, chip = load_preset("llama3.1-8b"), accelerators.CHIPS["v5e"]
    assert layout.communication_seconds(cfg, chip, 1, 64) == 0.0
    # 8 chips: 2 all-reduces a layer + the embedding's (65) of f32[64, 4096], and one
    # all-gather of f32[64, 128256]; a ring all-reduce: 2 * 7/8 of the bytes, 14 steps.
    activations, logits = 64 * 4096 * 4, 64 * 128256 * 4
    all_reduce = 2 * 7 / 8 * activations / 200e9 + 14 * 1e-6
    all_gather = 7 / 8 * logits / 200e9 + 7 * 1e-6
    assert layout.communication_seconds(cfg, chip, 8, 64) == pytest.approx(
        65 * all_reduce + all_gather)
    odd_vocab = dataclasses.replace(cfg, vocab_size=128257)  # head and embedding whole
    assert layout.communication_seconds(odd_vocab, chip, 8, 64) == pytest.approx(
        64 * all_reduce)
    gpu = accelerators.CHIPS["h100-80gb"]  # NCCL's model: 6.6 us + 0.6 us a step
    assert layout.all_reduce_seconds(gpu, 8, 0) == pytest.approx(6.6e-6 + 14 * 0.6e-6)


def test_communication_makes_tp8_lose_to_dp8_for_an_8b_int8_model_on_v5e_8():
    """At 1,024 tokens and 64 requests a replica, 8 replicas out-decode one 8-chip
    replica only because of its collectives: without them TP 8 would win."""
    acc, cfg = accelerators.find_preset("v5e-8"), load_preset("llama3.1-8b")
    splits = by_tp(layout.splits(cfg, acc, **plan_kwargs(acc)))
    assert splits[1].fits and splits[8].fits
    assert splits[1].tokens_per_s > splits[8].tokens_per_s
    assert splits[8].communication_s > 0.3 * splits[8].step_s
    free = by_tp(layout.splits(cfg, without_communication(acc), **plan_kwargs(acc)))
    assert free[1].tokens_per_s == splits[1].tokens_per_s  # no collectives at TP 1
    assert free[8].tokens_per_s > free[1].tokens_per_s


def test_a_split_that_does_not_fit_is_listed_and_never_recommended():
    acc, cfg = accelerators.find_preset("v5e-8"), load_preset("llama3.1-8b")
    splits = layout.splits(cfg, acc, **plan_kwargs(acc, quantization=None))  # 16 GB bf16
    one_chip = by_tp(splits)[1]
    assert not one_chip.fits and one_chip.tokens_per_s == 0.0
    assert one_chip.note.endswith("GB short a chip")
    assert one_chip.row() == {"data_parallel_size": 8, "tensor_parallel_size": 1,
                              "fits": False, "note": one_chip.note}
    best = layout.recommend(splits)
    assert best.fits and best.tensor_parallel_size > 1  # the model needs TP to fit
    assert layout.recommend([one_chip]) is None


@pytest.mark.parametrize("device, model, quantization, max_model_len", [
    ("v5e-8", "llama3.1-8b", "int8", 1024), ("v5e-8", "llama3.1-8b", "int8", 4096),
    ("v6e-8", "llama3.1-8b", "int8", 16384), ("h100-8", "qwen3-0.6b", None, 8192),
    ("v5e-8", "mistral-7b", None, 2048)])
def test_the_recommendation_has_the_most_tokens_per_s(device, model, quantization,
                                                      max_model_len):
    acc = accelerators.find_preset(device)
    splits = layout.splits(load_preset(model), acc, **plan_kwargs(
        acc, quantization=quantization, max_model_len=max_model_len))
    best = layout.recommend(splits)
    assert best.fits
    assert best.tokens_per_s == max(s.tokens_per_s for s in splits if s.fits)


def test_plans_recommendation_for_the_compiled_layouts():
    """The layouts tests/tpu_aot/test_data_parallel_compile.py compiles are the ones plan
    recommends for the whole 8B in int8: DP 8 x TP 1 on v5e-8 at 1,024 tokens and 32
    requests a replica (the engine's default), DP 2 x TP 4 on v6e-8 at 16,384 and 64."""
    v5e, v6e = accelerators.find_preset("v5e-8"), accelerators.find_preset("v6e-8")
    cfg = load_preset("llama3.1-8b")
    best = layout.recommend(layout.splits(cfg, v5e, **plan_kwargs(v5e, max_num_seqs=32)))
    assert (best.data_parallel_size, best.tensor_parallel_size, best.batch) == (8, 1, 32)
    best = layout.recommend(layout.splits(cfg, v6e, **plan_kwargs(v6e,
                                                                  max_model_len=16384)))
    assert (best.data_parallel_size, best.tensor_parallel_size) == (2, 4)
    assert best.batch < 64  # the pool at 16,384 tokens holds fewer than max_num_seqs


def test_report_lists_the_table_the_recommendation_and_the_layout_planned():
    acc, cfg = accelerators.find_preset("v5e-8"), load_preset("llama3.1-8b")
    splits = layout.splits(cfg, acc, **plan_kwargs(acc))
    report = layout.report(splits, splits[-1], acc, 1024)
    assert report["context"] == 1024 and report["chips"] == 8
    assert report["ring_bytes_per_s"] == 200e9  # half of v5e's 400 GB/s bidirectional
    assert [row["tensor_parallel_size"] for row in report["splits"]] == [1, 2, 4, 8]
    best = layout.recommend(splits)
    assert report["recommended"] == {
        "data_parallel_size": best.data_parallel_size,
        "tensor_parallel_size": best.tensor_parallel_size, "fits": True,
        "tokens_per_s": round(best.tokens_per_s)}
    assert report["planned"]["tensor_parallel_size"] == 8
    assert report["recommended"]["tokens_per_s"] == max(
        row["tokens_per_s"] for row in report["splits"])
