"""The PP x TP x DP layout: which splits are listed, what fits, a stage's bytes per chip,
the communication terms, the hosts they cross, and the recommendation
(jaxinfer/sizing/layout.py, hosts.py, pipeline_plan.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from jaxinfer.config import load_preset
from jaxinfer.sizing import accelerators, hosts, layout, pipeline_plan, planner


def plan_kwargs(acc: accelerators.Accelerator, *, quantization: str | None = "int8",
                max_model_len: int = 1024, max_num_seqs: int = 64) -> dict:
    """plan's arguments as the plan command passes them for a device preset."""
    return dict(dtype="bfloat16", kv_dtype="bfloat16", quantization=quantization,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                memory_bytes=int(acc.chip.usable_hbm_bytes * 0.9),
                bandwidth_gb_per_s=acc.chip.hbm_bytes_per_s / 1e9,
                peak_flops_per_s=acc.chip.bf16_flops)


def by_tp(splits: list[layout.Split]) -> dict[int, layout.Split]:
    """The splits without stages, by TP."""
    return {s.tensor_parallel_size: s for s in splits if s.pipeline_parallel_size == 1}


def by_layout(splits: list[layout.Split]) -> dict[tuple[int, int, int], layout.Split]:
    """Every split by (DP, PP, TP)."""
    return {(s.data_parallel_size, s.pipeline_parallel_size, s.tensor_parallel_size): s
            for s in splits}


def without_communication(acc: accelerators.Accelerator) -> accelerators.Accelerator:
    chip = dataclasses.replace(acc.chip, interconnect_bytes_per_s=math.inf,
                               collective_latency_s=0.0, hop_latency_s=0.0)
    return dataclasses.replace(acc, chip=chip)


def test_every_split_uses_every_chip_and_only_valid_tensor_parallel_sizes():
    acc = accelerators.find_preset("v6e-8")
    llama = layout.splits(load_preset("llama3.1-8b"), acc, **plan_kwargs(acc))
    assert list(by_layout(llama)) == [  # by PP, then TP: without stages first
        (8, 1, 1), (4, 1, 2), (2, 1, 4), (1, 1, 8), (4, 2, 1), (2, 2, 2), (1, 2, 4),
        (2, 4, 1), (1, 4, 2), (1, 8, 1)]
    assert all(dp * pp * tp == 8 for dp, pp, tp in by_layout(llama))
    smollm = load_preset("smollm-135m")  # 9 query heads, 3 KV heads: of 1, 2, 4, 8 only 1
    assert layout.tensor_parallel_sizes(smollm, 8) == [1]
    # of 9 chips: 3 splits every part; 9 not the 12 gate/up column blocks (1,536 / 128)
    assert layout.tensor_parallel_sizes(smollm, 9) == [1, 3]
    splits = layout.splits(smollm, acc, **plan_kwargs(acc))
    assert list(by_layout(splits)) == [(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1)]


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
    assert one_chip.row() == {"data_parallel_size": 8, "pipeline_parallel_size": 1,
                              "tensor_parallel_size": 1, "fits": False, "note": one_chip.note}
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
    report = layout.report(splits, by_tp(splits)[8], acc, 1024)
    assert report["context"] == 1024 and report["chips"] == 8
    assert report["ring_bytes_per_s"] == 200e9  # half of v5e's 400 GB/s bidirectional
    assert [row["tensor_parallel_size"] for row in report["splits"]
            if row["pipeline_parallel_size"] == 1] == [1, 2, 4, 8]
    assert (report["hosts"], report["between_hosts"]) == (1, None)
    best = layout.recommend(splits)
    assert report["recommended"] == {
        "data_parallel_size": best.data_parallel_size, "pipeline_parallel_size": 1,
        "tensor_parallel_size": best.tensor_parallel_size, "fits": True,
        "tp_crosses_hosts": False, "tokens_per_s": round(best.tokens_per_s)}
    assert report["planned"]["tensor_parallel_size"] == 8
    assert report["recommended"]["tokens_per_s"] == max(
        row["tokens_per_s"] for row in report["splits"])


def llama_bytes(cfg, tp: int, itemsize: int = 2) -> tuple[int, int, int]:
    """(embedding, final norm and head; one layer; one layer's K/V a token) on one of tp
    chips, by hand from a Llama config: a layer's matrices 1/tp, its two norms whole; the
    embedding and head by vocabulary (tp divides it); K/V heads G / tp (one copied when
    tp > G)."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    assert cfg.vocab_size % tp == 0 and not cfg.tie_word_embeddings
    qkv = d * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd // tp
    layer = (qkv + cfg.num_heads * hd * d // tp + 3 * d * f // tp + 2 * d) * itemsize
    top = (2 * cfg.vocab_size * d // tp + d) * itemsize
    return top, layer, 2 * max(1, cfg.num_kv_heads // tp) * hd * itemsize


def llama_device_bytes(cfg, tp: int, pp: int, itemsize: int = 2) -> tuple[int, int]:
    """(weights, K/V a token) on one chip of a stage, which holds ceil(L / pp) layer
    slots and the embedding, final norm and head (`llama_bytes`)."""
    top, layer, kv = llama_bytes(cfg, tp, itemsize)
    slots = -(-cfg.num_layers // pp)
    return top + slots * layer, slots * kv


def test_70b_on_v5e_16_lists_pp2_tp8_with_a_stages_bytes_per_chip():
    acc, cfg = accelerators.find_preset("v5e-16"), load_preset("llama3.1-70b")
    kwargs = plan_kwargs(acc, quantization=None, max_model_len=8192, max_num_seqs=256)
    table = by_layout(layout.splits(cfg, acc, **kwargs))
    assert (acc.hosts, acc.host_chips) == (4, 4)
    split = table[1, 2, 8]
    assert split.fits and split.tp_crosses_hosts  # 8 chips: two 4-chip hosts, over ICI
    assert not split.tp_over_network and split.stage_boundaries_across_hosts == 1
    weights, per_token = llama_device_bytes(cfg, tp=8, pp=2)
    assert split.weight_bytes == weights  # 40 of the 80 layers, embedding and head / 8
    assert planner.kv_bytes_per_token(cfg, "bfloat16", 8, 2) == per_token == 40 * 2 * 128 * 2
    budget = kwargs["memory_bytes"]  # a chip's
    page_bytes = 16 * per_token
    state = planner.batch_state_bytes(256, 8192, 16)
    assert split.kv_cache_bytes == (budget - weights - state) // page_bytes * page_bytes
    # a step of `batch` requests in 2 microbatches: 3 ticks of batch / 2 rows each
    assert split.microbatches == 2 and split.bubble == pytest.approx(1 / 3)
    # M + PP - 2 hand-ons: the last tick's is read by nobody (XLA drops it)
    assert split.stage_send_bytes == 2 * -(-split.batch // 2) * cfg.hidden_size * 4
    assert split.kv_read_bytes == 3 * split.batch // 2 * 8192 * per_token
    four = table[1, 4, 4]  # 20 layer slots a chip, TP inside a host
    assert four.weight_bytes == llama_device_bytes(cfg, tp=4, pp=4)[0]
    assert not four.tp_crosses_hosts and four.stage_boundaries_across_hosts == 3
    assert not table[2, 1, 8].fits and table[2, 1, 8].note.endswith("GB short a chip")
    best = layout.recommend(list(table.values()))
    assert best.tokens_per_s == max(s.tokens_per_s for s in table.values())


def test_stage_bytes_follow_vllms_split_with_a_padding_slot():
    cfg = load_preset("llama3.1-70b")
    # stages of 27, 27, 26 layers (the last, with the head, one fewer): the last stage's
    # slot 26 is padding, a whole layer's bytes
    assert pipeline_plan.slot_layers(cfg, 3) == tuple(range(27))
    top, layer, _ = llama_bytes(cfg, tp=8)
    assert planner.weight_bytes(cfg, "bfloat16", 8, pipeline_parallel_size=3) == top + 27 * layer
    # 5 layers in 4 stages: 1, 1, 2, 1; every stage holds 2 slots, one of them padding
    five = dataclasses.replace(load_preset("smollm-135m"), num_layers=5)
    assert pipeline_plan.layer_slots(five, 4) == 2
    assert planner.kv_bytes_per_token(five, "bfloat16", 1, 4) == 2 * planner.kv_bytes_per_token(
        five, "bfloat16") // 5


@pytest.mark.parametrize("pp, message", [
    (81, r"pipeline_parallel_size=81 must be in \[1, 80\] \(the model's layers\)"),
    (0, "pipeline_parallel_size=0 must be a positive int")])
def test_a_pipeline_the_layers_cannot_take_is_refused_with_the_numbers(pp, message):
    with pytest.raises(ValueError, match=message):
        planner.plan(load_preset("llama3.1-70b"), memory_bytes=10**12, max_model_len=1024,
                     pipeline_parallel_size=pp)


def test_a_stage_that_does_not_fit_names_the_stage_and_the_shortfall():
    with pytest.raises(ValueError, match=r"GB per device \(tensor_parallel_size=2, "
                                         r"pipeline_parallel_size=2\) holds the .* short: "
                                         r"give at least .* GB, raise tensor_parallel_size "
                                         "or pipeline_parallel_size"):
        planner.plan(load_preset("llama3.1-70b"), dtype="bfloat16", max_model_len=1024,
                     memory_bytes=2 * 16 * 10**9, tensor_parallel_size=2,
                     pipeline_parallel_size=2)


def test_a_pipelined_step_reads_its_slots_every_tick_and_the_head_once():
    """Bytes, not times: the roofline's memory term times the bandwidth."""
    cfg = load_preset("llama3.1-70b")
    plan = planner.plan(cfg, dtype="bfloat16", max_model_len=4096, memory_bytes=2 * 60 * 10**9,
                        tensor_parallel_size=8, pipeline_parallel_size=2,
                        bandwidth_gb_per_s=1000.0)
    weights, per_token = llama_device_bytes(cfg, tp=8, pp=2)
    slots = weights - llama_bytes(cfg, tp=8)[0]
    assert (plan.weight_bytes, plan.layer_weight_bytes) == (weights, slots)
    memory_s, _ = plan.decode_seconds(32, 4096)  # 2 microbatches of 16: 3 ticks
    assert memory_s * 1000.0 * 1e9 == pytest.approx(
        3 * (slots + 16 * 4096 * per_token) + weights - slots)
    assert plan.summary()["pipeline_microbatches"] == 2


def test_h100_16_keeps_tensor_parallelism_inside_a_host():
    acc, cfg = accelerators.find_preset("h100-16"), load_preset("llama3.1-70b")
    assert (acc.hosts, acc.host_chips, acc.network_bytes_per_s) == (2, 8, 125e9)
    kwargs = plan_kwargs(acc, quantization=None, max_model_len=8192, max_num_seqs=256)
    splits = layout.splits(cfg, acc, **kwargs)
    table = by_layout(splits)
    best = layout.recommend(splits)
    assert not best.tp_crosses_hosts
    assert (best.data_parallel_size, best.pipeline_parallel_size,
            best.tensor_parallel_size) == (2, 1, 8)
    across = table[1, 1, 16]
    assert across.tp_crosses_hosts and across.tp_over_network
    network = hosts.host_link(acc)  # each GPU's eighth of its machine's 1,000 Gbps
    assert network.ring_bytes_per_s == 125e9 / 8
    assert across.communication_s == layout.communication_seconds(cfg, network, 16,
                                                                  across.batch)
    assert not table[1, 2, 8].tp_crosses_hosts  # one stage a machine
    assert table[1, 2, 8].stage_boundaries_across_hosts == 1


def test_recommend_passes_over_tp_across_a_network_when_tp_in_a_host_fits():
    common = dict(fits=True, batch=8, memory_s=0.01)
    fast = layout.Split(data_parallel_size=1, tensor_parallel_size=16, tp_crosses_hosts=True,
                        tp_over_network=True, **common)
    slow = layout.Split(data_parallel_size=1, pipeline_parallel_size=2,
                        tensor_parallel_size=8, pipeline_s=0.01, **common)
    assert fast.tokens_per_s > slow.tokens_per_s
    assert layout.recommend([fast, slow]) is slow
    assert layout.recommend([fast]) is fast  # nothing keeps TP in a host
    ici = dataclasses.replace(fast, tp_over_network=False)  # a TPU slice's hosts
    assert layout.recommend([ici, slow]) is ici


def test_hosts_of_a_layout_follow_the_mesh_rows():
    acc = accelerators.find_preset("v5e-16")  # 4 hosts of 4 chips
    assert [hosts.host(acc, hosts.Layout(dp=1, pp=2, tp=8), 0, s, k)
            for s in range(2) for k in (0, 7)] == [0, 1, 2, 3]
    assert hosts.boundaries_crossing_hosts(acc, hosts.Layout(dp=2, pp=2, tp=4)) == 1
    assert not hosts.tp_crosses_hosts(acc, hosts.Layout(dp=2, pp=4, tp=2))
    assert pipeline_plan.broadcast_hops(4) == ((3, 0), (0, 1), (1, 2))
    assert [pipeline_plan.microbatches(t, 4, m) for t, m in ((32, 0), (2, 0), (32, 1))] == [
        4, 2, 1]
    assert pipeline_plan.microbatches(32, 1, 8) == 1
