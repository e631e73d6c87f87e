"""Pipeline parallelism on the 8 virtual CPU devices of the test session (conftest.py).

A tiny 8-layer Llama (8 query heads, 4 KV heads) served as PP 2 x TP 4, PP 4 x TP 2,
PP 8, PP 3 x TP 2 (an uneven split: 3, 3, 2 layers) and PP 2 x TP 2 x DP 2 gives one
device's greedy tokens, with chunked prefill, prefix-cache hits and preemption under a
small page pool, and compiles nothing after warm-up; each device holds its stage's
layers and KV pages alone; the compiled step hands activations between stages by
collective permutes only (docs/parallelism.md#pipeline-parallelism)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, checkpoint, testing
from jaxinfer.aot_rows import replica_groups
from jaxinfer.config import EngineConfig, ModelConfig, ModelOptions
from jaxinfer.config import pipeline as rules
from jaxinfer.engine.structured import StructuredOutputsParams
from jaxinfer.model import sharding

LAYERS, PAGE_SIZE = 8, 4
# per token: 8 layers x K,V x 4 KV heads x 16 dims x 4 bytes (float32)
PAGE_BYTES = PAGE_SIZE * LAYERS * 2 * 4 * 16 * 4
SMALL = dict(page_size=PAGE_SIZE, max_num_seqs=4, max_num_batched_tokens=32,
             max_model_len=96, compilation_cache_dir="", attention_impl="reference",
             kv_cache_memory_bytes=30 * PAGE_BYTES)
SHARED = list(range(20, 60))  # a 40-token preamble: 10 full pages to hit
PROMPTS = [SHARED + [5, 6, 7], list(range(3, 40)), [9, 10, 11], SHARED + [8] * 20,
           list(range(100, 171)), [42] * 13]
LAYOUTS = {"pp2-tp4": dict(pipeline_parallel_size=2, tensor_parallel_size=4),
           "pp4-tp2": dict(pipeline_parallel_size=4, tensor_parallel_size=2),
           "pp8": dict(pipeline_parallel_size=8),
           "pp3-tp2": dict(pipeline_parallel_size=3, tensor_parallel_size=2),
           "pp2-tp2-dp2": dict(pipeline_parallel_size=2, tensor_parallel_size=2,
                               data_parallel_size=2)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("pp-llama")
    testing.make_hf_model(path, "llama", seed=21, num_attention_heads=8,
                          num_key_value_heads=4, num_hidden_layers=LAYERS)
    return path


def _serve(model_dir, **layout: object) -> tuple[list[list[int]], dict, LLM]:
    """Greedy tokens of PROMPTS, twice (the second time the preamble is cached), and the
    metrics after."""
    llm = LLM(str(model_dir), **SMALL, **layout)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    tokens += [o.outputs[0].token_ids for o in llm.generate(PROMPTS[::-1], params)]
    return tokens, llm.metrics(), llm


@pytest.fixture(scope="module")
def one_device(model_dir):
    tokens, metrics, _ = _serve(model_dir)
    assert metrics["preemptions"] > 0  # the pool is small enough to preempt
    return tokens


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_tokens_match_one_device(model_dir, one_device, layout):
    tokens, metrics, _ = _serve(model_dir, **LAYOUTS[layout])
    assert tokens == one_device
    assert metrics["compiles_after_warmup"] == 0
    assert metrics["preemptions"] > 0
    assert metrics["prefix_cache_hit_tokens"] >= 10 * PAGE_SIZE


def test_each_device_holds_its_stages_layers_and_kv_alone(model_dir):
    llm = LLM(str(model_dir), **SMALL, pipeline_parallel_size=4, tensor_parallel_size=2)
    runner = llm.engine.runner
    params, kv_cache = runner.params, runner.kv_cache
    assert len(params["layers"]) == len(kv_cache) == 2  # 2 slots of 4 stages
    mesh = runner.mesh
    stage_of = {d.id: s for s in range(4) for d in mesh.devices[s]}
    for leaf in jax.tree.leaves(params["layers"]) + jax.tree.leaves(kv_cache):
        assert leaf.shape[0] == 4
        for shard in leaf.addressable_shards:
            assert shard.index[0] == slice(stage_of[shard.device.id],
                                           stage_of[shard.device.id] + 1)
            split = shard.data.shape[1:] != leaf.shape[1:]  # also by head (TP 2)?
            assert shard.data.nbytes == leaf.nbytes // 4 // (2 if split else 1)
    whole = LLM(str(model_dir), **SMALL).engine.runner.params["layers"]
    starts = rules.stage_starts(LAYERS, 4)
    for name, stacked in params["layers"][1].items():  # slot 1: layers 1, 3, 5, 7
        for stage, start in enumerate(starts):
            np.testing.assert_array_equal(np.asarray(stacked[stage]),
                                          np.asarray(whole[start + 1][name]))


def test_the_loader_reads_each_layer_onto_its_stage_alone(model_dir):
    """No device ever holds another stage's layers, even while loading."""
    cfg = checkpoint.load_config(model_dir)
    mesh = sharding.replica_mesh(sharding.layout_mesh(1, 2, pipeline_parallel_size=4), 0)
    params = checkpoint.load_params(model_dir, cfg, mesh=mesh)
    starts = rules.stage_starts(LAYERS, 4)
    for layer, leaves in enumerate(params["layers"]):
        stage = max(s for s in range(4) if starts[s] <= layer)
        for leaf in jax.tree.leaves(leaves):
            assert leaf.sharding.device_set == set(mesh.devices[stage].flat)
    assert params["embed"].sharding.device_set == set(mesh.devices.flat)


def test_uneven_split_follows_vllms_rule():
    assert rules.stage_sizes(8, 3) == (3, 3, 2)
    assert rules.stage_sizes(10, 4) == (2, 3, 3, 2)
    assert rules.stage_sizes(80, 2) == (40, 40)
    with pytest.raises(ValueError, match="pipeline_parallel_size=9 must be in"):
        rules.stage_sizes(8, 9)


def test_stages_must_start_alike_in_the_layer_pattern():
    # Gemma 3: five sliding-window layers, then one global. Two stages of six run one
    # program; in three stages of four, slot 1 is global on the second (layer 5) only.
    cfg = ModelConfig.from_hf(testing.hf_config("gemma3", num_hidden_layers=12).to_dict())
    assert cfg.layer_window(5) is None and cfg.layer_window(4) is not None
    ModelOptions(pipeline_stages=2).check(cfg)
    with pytest.raises(ValueError, match="layers \\[1, 5, 9\\] take slot 1"):
        ModelOptions(pipeline_stages=3).check(cfg)


@pytest.mark.parametrize("field", ["speculative_config", "enable_lora", "batch_invariant",
                                   "enable_prompt_logprobs"])
def test_what_is_not_pipelined_is_refused_by_name(field):
    value = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}.get(
        field, True)
    with pytest.raises(ValueError, match=f"pipeline_parallel_size=2 with {field}="):
        EngineConfig(pipeline_parallel_size=2, **{field: value})


def test_only_activations_cross_stages(model_dir):
    llm = LLM(str(model_dir), **SMALL, pipeline_parallel_size=2, tensor_parallel_size=4)
    runner = llm.engine.runner
    bucket = max(runner.buckets.all(), key=lambda b: b.num_tokens)
    hlo = runner._compile(bucket).as_text()
    stage_of = {i: i // 4 for i in range(8)}  # mesh order: stage-major
    permutes, reduces = [], []
    for line in hlo.splitlines():
        if " all-reduce(" in line or " all-reduce-start(" in line:
            reduces.append(replica_groups(line))
        if " all-gather(" in line or " all-gather-start(" in line:
            reduces.append(replica_groups(line))  # the LM head's vocabulary, in a stage
        if " collective-permute(" in line or " collective-permute-start(" in line:
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line).group(1)
            shape = re.search(r"= (\w+\[[\d,]*\])", line).group(1)
            permutes.append((shape, [tuple(map(int, p.strip("{}").split(",")))
                                     for p in pairs.split("},{")]))
    assert len(reduces) > 8  # tensor parallelism's, inside a stage
    for groups in reduces:
        for group in groups:
            assert len({stage_of[d] for d in group}) == 1, groups
    # two microbatches (one per stage) of hidden_size floats, then the sampled rows
    hidden = runner.cfg.hidden_size
    micro = f"f32[{bucket.num_tokens // 2},{hidden}]"
    rows = f"f32[{bucket.num_slots},{hidden}]"
    crossing = {shape for shape, pairs in permutes
                if any(stage_of[a] != stage_of[b] for a, b in pairs)}
    assert crossing == {micro, rows}


def test_sleep_and_structured_outputs_with_stages_updates_refused(model_dir, one_device):
    llm = LLM(str(model_dir), **SMALL, pipeline_parallel_size=2)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    llm.sleep(1)  # weights to host memory and back, stacked as they were
    llm.wake_up()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == \
        one_device[:len(PROMPTS)]
    constrained = SamplingParams(max_tokens=16, temperature=0.0, structured_outputs=(
        StructuredOutputsParams(regex="[0-9]{3}-[a-z]{2}")))
    text = llm.generate(["code: "], constrained)[0].outputs[0].text
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text), text  # the grammar's mask applied
    with pytest.raises(NotImplementedError, match="pipeline_parallel_size=2"):
        llm.sleep(2)
    with pytest.raises(NotImplementedError, match="update_weights with pipeline"):
        llm.update_weights(llm.engine.runner.params)


def test_experts_split_inside_stages(tmp_path):
    """Qwen3-MoE (4 layers, 8 experts) as PP 2 x TP 2 with expert parallelism: one
    device's greedy tokens and tokens routed to each expert of each layer."""
    testing.make_hf_model(tmp_path, "qwen3_moe", seed=5, num_hidden_layers=4)
    settings = dict(SMALL, kv_cache_memory_bytes=None, max_num_seqs=2,
                    max_num_batched_tokens=16)  # three buckets to compile
    params = SamplingParams(max_tokens=8, temperature=0.0)
    runs = []
    for layout in ({}, dict(pipeline_parallel_size=2, tensor_parallel_size=2,
                            enable_expert_parallel=True)):
        llm = LLM(str(tmp_path), **settings, **layout)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)]
        runs.append((tokens, llm.metrics()["expert_tokens"]))
    assert runs[1] == runs[0]
    assert len(runs[0][1]) == 4 and sum(map(sum, runs[0][1])) > 0
