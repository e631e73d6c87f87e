"""Tensor parallelism on the 8 virtual CPU devices of the test session (conftest.py).

Tiny models with 8 query heads: Llama with 2 KV heads (split over 2 devices, copied
at 4 and 8), Qwen2 with 1 (q/k/v bias, tied embeddings: copied at every size) and
Qwen3 with 4 (q/k norms, a vocabulary of 264 that splits 8 ways; the others' 260
splits over 2 and 4 and stays whole on every device at 8). Every size gives the logits
of one device within 1e-5 and the same tokens through `LLM.generate` (continuous
batching, chunked prefill, prefix caching, greedy and seeded sampling, logprobs)."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, checkpoint, testing
from jaxinfer.checkpoint import shard_source
from jaxinfer.checkpoint.names import leaf_name
from jaxinfer.config import ModelConfig
from jaxinfer.engine.core.buckets import Bucket, BucketSet
from jaxinfer.engine.runner import Chunk, Runner
from jaxinfer.model import sharding
from jaxinfer.model.params_table import param_partition_specs
from jaxinfer.pallas import AttentionSettings

TP_FAMILIES = {"llama": dict(num_attention_heads=8, num_key_value_heads=2),
               "qwen2": dict(num_attention_heads=8, num_key_value_heads=1),
               "qwen3": dict(num_attention_heads=8, num_key_value_heads=4, vocab_size=264)}
SIZES = (2, 4, 8)
CHUNKS = [Chunk(list(range(3, 40)), 0, [1, 2, 3, 4, 5]), Chunk([7, 8, 9], 0, [6])]


@pytest.fixture(scope="module")
def tp_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for i, (family, shape) in enumerate(TP_FAMILIES.items()):
        out[family] = tmp_path_factory.mktemp(f"tp-{family}")
        testing.make_hf_model(out[family], family, seed=10 + i, **shape)
    return out


def _runner(model_dir, tp: int, **kw: object) -> Runner:
    cfg = checkpoint.load_config(model_dir)
    mesh = sharding.make_mesh(tp)
    params = checkpoint.load_params(model_dir, cfg, mesh=mesh, **kw)
    return Runner(sharding.served_config(cfg, tp), params, num_pages=16, page_size=8,
                  max_model_len=64, mesh=mesh, attention=AttentionSettings(impl="reference"),
                  buckets=BucketSet(max_num_batched_tokens=16, max_num_seqs=4))


@pytest.mark.parametrize("family", list(TP_FAMILIES))
def test_logits_match_one_device(tp_dirs, family):
    want = testing.logits(_runner(tp_dirs[family], 1), CHUNKS)
    for tp in SIZES:
        got = testing.logits(_runner(tp_dirs[family], tp), CHUNKS)
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=f"{family} TP={tp}")
        assert (got.argmax(-1) == want.argmax(-1)).all()


def test_each_device_holds_its_share_of_weights_and_kv(tp_dirs):
    runner = _runner(tp_dirs["llama"], 4)  # 2 KV heads copied to 4: one per device
    assert runner.cfg.num_kv_heads == 4
    specs = jax.tree.leaves(param_partition_specs(runner.cfg, 4),
                            is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for leaf, spec in zip(jax.tree.leaves(runner.params), specs, strict=True):
        split = any(axis is not None for axis in spec)
        shards = leaf.addressable_shards
        assert len(shards) == 4
        for shard in shards:
            assert shard.data.nbytes == leaf.nbytes // (4 if split else 1), spec
        if split:  # really split: the four shards differ
            assert not np.array_equal(shards[0].data, shards[1].data)
    assert sum(1 for s in specs if any(a is not None for a in s)) == 2 + 4 * 2  # embed, lm_head
    for pages in runner.kv_cache:
        for shard in pages.addressable_shards:
            assert shard.data.nbytes == pages.nbytes // 4
            assert shard.data.shape[2] * shard.data.shape[3] == 2  # one head's K and V


def test_loading_reads_only_each_devices_slice(tp_dirs):
    log = shard_source.ReadLog()
    runner = _runner(tp_dirs["qwen2"], 4, log=log)  # bias, tied table, 1 KV head copied
    leaves = dict(zip([leaf_name(p) for p, _ in
                       jax.tree_util.tree_flatten_with_path(runner.params)[0]],
                      jax.tree.leaves(runner.params), strict=True))
    reads: dict[str, list[int]] = {}
    for name, _, nbytes in log.reads:
        reads.setdefault(name, []).append(nbytes)
    assert set(reads) == set(leaves)
    for name, leaf in leaves.items():
        shard_bytes = leaf.addressable_shards[0].data.nbytes  # float32 file, float32 leaf
        slices = len({str(s.index) for s in leaf.addressable_shards})  # 1 when replicated
        assert reads[name] == [shard_bytes] * slices, name  # one read per slice, no more
    wqkv = leaves["layers.0.wqkv"]
    assert wqkv.addressable_shards[0].data.nbytes == wqkv.nbytes // 4


def test_compiled_step_has_two_all_reduces_per_layer(tp_dirs):
    runner = _runner(tp_dirs["llama"], 8)  # vocabulary 260: embedding and LM head whole
    layers = runner.cfg.num_layers
    for bucket in (Bucket(4, 4, True), Bucket(16, 4)):
        hlo = runner._compile(bucket).as_text()
        ops = re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all)\(", hlo)
        assert ops.count("all-reduce") == 2 * layers and len(ops) == 2 * layers, bucket
    split = _runner(tp_dirs["llama"], 4)  # 260 splits 4 ways: the embedding lookup
    hlo = split._compile(Bucket(4, 4, True)).as_text()  # all-reduces its rows, the logits
    ops = re.findall(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all)\(", hlo)
    assert ops.count("all-reduce") == 2 * layers + 1 and ops.count("all-gather") == 1


def _generate(model_dir, tp: int) -> tuple[list, list]:
    llm = LLM(model_dir, tensor_parallel_size=tp, max_num_seqs=4, max_num_batched_tokens=16,
              compilation_cache_dir="", strict_compile=True, attention_impl="reference")
    shared = list(range(20, 60))  # two pages' worth: the second call hits the prefix cache
    params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=2),
              SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=4)]
    first = llm.generate([shared + [1, 2], list(range(5, 9)), [9] * 30], params)
    warm = llm.engine.runner.compiles.total
    second = llm.generate([shared + [3], shared + [4, 5]], params[:2])
    assert llm.engine.runner.compiles.total == warm  # no compile after warm-up
    assert second[0].num_cached_tokens > 0
    outs = first + second
    return ([o.outputs[0].token_ids for o in outs],
            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids,
                                     strict=False)] for o in outs])


@pytest.mark.parametrize("family", [
    "llama", pytest.param("qwen2", marks=pytest.mark.slow),
    pytest.param("qwen3", marks=pytest.mark.slow)])
def test_generate_gives_the_same_tokens_at_every_size(tp_dirs, family):
    tokens, logprobs = _generate(tp_dirs[family], 1)
    for tp in SIZES:
        got_tokens, got_logprobs = _generate(tp_dirs[family], tp)
        assert got_tokens == tokens, f"TP={tp}"
        for got, want in zip(got_logprobs, logprobs, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("tp, message", [
    (3, "tensor_parallel_size=3 must divide the 8 query heads"),
    (16, "tensor_parallel_size=16 exceeds the 8 device"),
    (0, "tensor_parallel_size=0 must be a positive int")])
def test_invalid_sizes_name_the_numbers(tp_dirs, tp, message):
    cfg = checkpoint.load_config(tp_dirs["llama"])
    if tp == 16:
        cfg = dataclasses.replace(cfg, num_heads=16, intermediate_size=2048)
    with pytest.raises(ValueError, match=message):
        sharding.validate(cfg, tp, jax.device_count())


def test_kv_heads_neither_dividing_nor_divided_are_refused():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=96, num_layers=1,
                      num_heads=12, num_kv_heads=3, head_dim=8)
    with pytest.raises(ValueError, match="must divide the 3 KV heads or be a multiple"):
        sharding.validate(cfg, 4, 8)
    sharding.validate(cfg, 3, 8)  # divides both


def test_orbax_restores_onto_the_mesh(tp_dirs, tmp_path):
    out = tmp_path / "orbax"
    checkpoint.convert_hf_to_orbax(tp_dirs["llama"], out)
    want = testing.logits(_runner(tp_dirs["llama"], 4), CHUNKS)
    restored = _runner(out, 4)  # 2 KV heads stored, copied to 4 on the mesh
    wqkv = restored.params["layers"][0]["wqkv"]
    assert wqkv.addressable_shards[0].data.nbytes == wqkv.nbytes // 4
    np.testing.assert_allclose(testing.logits(restored, CHUNKS), want, atol=1e-6)


@pytest.mark.parametrize("impl", ["tpu", "gpu"])
def test_pallas_kernels_run_per_device_in_shard_map(tp_dirs, impl):
    """The Pallas kernels (interpret mode on CPU) inside shard_map at TP=2 give the
    logits of the reference on one device."""
    want = testing.logits(_runner(tp_dirs["llama"], 1), CHUNKS)
    runner = _runner(tp_dirs["llama"], 2)
    runner = Runner(runner.cfg, runner.params, num_pages=16, page_size=8, max_model_len=64,
                    mesh=runner.mesh, attention=AttentionSettings(impl=impl, interpret=True))
    np.testing.assert_allclose(testing.logits(runner, CHUNKS), want, atol=1e-5)
