"""Mixture-of-experts models on the 8 virtual CPU devices of the test session.

A tiny Qwen2-MoE (8 query heads, 2 KV heads, 8 experts, a shared expert; layers 0 and
2 MoE, layer 1 dense) split with expert parallelism over 2, 4 and 8 devices (whole
experts per device) and with tensor parallelism over 2 and 4 (a slice of every
expert): the logits of one device within 1e-5, the same greedy tokens through
`LLM.generate`, each device holding its share of the expert bytes, and the compiled
step's collectives counted from its HLO."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, checkpoint, testing
from jaxinfer.checkpoint import shard_source
from jaxinfer.config import ModelOptions
from jaxinfer.engine.core.buckets import Bucket, BucketSet
from jaxinfer.engine.runner import Chunk, Runner
from jaxinfer.model import sharding
from jaxinfer.pallas import AttentionSettings

SPLITS = [(2, True), (4, True), (8, True), (2, False), (4, False)]  # (devices, EP)
CHUNKS = [Chunk(list(range(3, 40)), 0, [1, 2, 3, 4, 5]), Chunk([7, 8, 9], 0, [6])]
COLLECTIVES = (r"= (\S+|\([^)]*\)) "  # one result or a tuple of them
               r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\(")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("ep-qwen2-moe")
    testing.make_hf_model(path, "qwen2_moe", seed=21, num_attention_heads=8,
                          num_key_value_heads=2, num_hidden_layers=3, mlp_only_layers=[1])
    return path


def _runner(model_dir, tp: int, ep: bool = False, **kw: object) -> Runner:
    cfg = checkpoint.load_config(model_dir)
    mesh = sharding.make_mesh(tp)
    params = checkpoint.load_params(model_dir, cfg, mesh=mesh, expert_parallel=ep, **kw)
    return Runner(sharding.served_config(cfg, tp), params, num_pages=16, page_size=8,
                  options=ModelOptions(expert_parallel=ep),
                  max_model_len=64, mesh=mesh, attention=AttentionSettings(impl="reference"),
                  buckets=BucketSet(max_num_batched_tokens=16, max_num_seqs=4))


def test_logits_match_one_device(moe_dir):
    want = testing.logits(_runner(moe_dir, 1), CHUNKS)
    for tp, ep in SPLITS:
        got = testing.logits(_runner(moe_dir, tp, ep), CHUNKS)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"TP={tp} EP={ep}")


@pytest.mark.parametrize("ep", [True, False])
def test_each_device_holds_its_share_of_the_experts_and_reads_only_it(moe_dir, ep):
    log = shard_source.ReadLog()
    runner = _runner(moe_dir, 4, ep, log=log)
    reads: dict[str, list[int]] = {}
    for name, _, nbytes in log.reads:
        reads.setdefault(name, []).append(nbytes)
    for key in ("we_gate_up", "we_down"):
        leaf = runner.params["layers"][0][key]
        shards = leaf.addressable_shards
        assert len(shards) == 4 and len({str(s.index) for s in shards}) == 4
        for shard in shards:
            assert shard.data.nbytes == leaf.nbytes // 4
            if ep:  # whole experts: 2 of the 8 on each device
                assert shard.data.shape[0] == 2
        assert reads[f"layers.0.{key}"] == [leaf.nbytes // 4] * 4  # its slice, no more
    assert not np.array_equal(shards[0].data, shards[1].data)
    router = runner.params["layers"][2]["w_router"]
    assert all(s.data.nbytes == router.nbytes for s in router.addressable_shards)


def test_sizes_that_do_not_divide_are_refused(moe_dir):
    cfg = checkpoint.load_config(moe_dir)
    with pytest.raises(ValueError, match="must divide the 6 experts"):
        sharding.check_split(dataclasses.replace(
            cfg, moe=dataclasses.replace(cfg.moe, num_experts=6)), 4, expert_parallel=True)
    odd = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, intermediate_size=20))
    with pytest.raises(ValueError, match=r"blocks of 20 \(moe_intermediate_size=20\)"):
        sharding.check_split(odd, 2)
    sharding.check_split(odd, 2, expert_parallel=True)  # whole experts


def _collectives(runner: Runner, bucket: Bucket) -> list[tuple[str, str]]:
    """(result type, op) of each collective in the compiled step."""
    return re.findall(COLLECTIVES, runner._compile(bucket).as_text())


@pytest.mark.parametrize("ep", [True, False])
def test_compiled_step_has_one_all_reduce_per_mlp(moe_dir, ep):
    """Per layer: the attention output's all-reduce and one for the MLP: the dense
    MLP's row-parallel down projection, or in a MoE layer the experts' psum, which XLA
    combines with the shared expert's down projection into one all-reduce of two
    arrays. Plus the embedding's (a vocabulary split 4 ways) and the logits' gather."""
    runner = _runner(moe_dir, 4, ep)
    layers, moe_layers = runner.cfg.num_layers, 2
    for bucket in (Bucket(4, 4, True), Bucket(16, 4)):
        ops = _collectives(runner, bucket)
        reduces = [kind for kind, op in ops if op == "all-reduce"]
        assert len(reduces) == 2 * layers + 1, (bucket, ops)
        assert sum(kind.startswith("(") and kind.count("f32[") == 2
                   for kind in reduces) == moe_layers, (bucket, ops)
        assert [op for _, op in ops if op != "all-reduce"] == ["all-gather"], (bucket, ops)


def _greedy(model_dir, tp: int, ep: bool) -> list[list[int]]:
    llm = LLM(model_dir, tensor_parallel_size=tp, enable_expert_parallel=ep, max_num_seqs=4,
              max_num_batched_tokens=16, compilation_cache_dir="", strict_compile=True,
              attention_impl="reference")
    prompts = [list(range(20, 60)), list(range(5, 9)), [9] * 30]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                ignore_eos=True))
    assert llm.metrics()["compiles_after_warmup"] == 0
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("splits", [
    [(8, True), (4, False)],
    pytest.param([(2, True), (4, True), (2, False)], marks=pytest.mark.slow)])
def test_generate_gives_one_devices_tokens(moe_dir, splits):
    want = _greedy(moe_dir, 1, False)
    for tp, ep in splits:
        assert _greedy(moe_dir, tp, ep) == want, f"TP={tp} EP={ep}"
