"""Weight quantization at load: round trips bit-exact against numpy, matmul error
within the scales' resolution, quantized engines close to the float model, bytes as
the planner predicts (one device and split over two), no compilation after warm-up,
tensor parallelism unchanged."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import EngineConfig
from jaxinfer.engine.runner import tree_bytes
from jaxinfer.model import quantization
from jaxinfer.sizing import planner

MODES = quantization.LINEAR_MODES  # mxfp4 (experts alone): tests/model/test_mxfp4_packed.py
PER_COLUMN = tuple(m for m in MODES if m != "int4")  # int4's own: tests/test_int4.py
SMALL = dict(page_size=8, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16)


@pytest.mark.parametrize("mode", PER_COLUMN)
def test_quantize_round_trip_is_bit_exact_against_numpy(mode):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 48)).astype(np.float32) * rng.uniform(0.01, 5, 48)
    w[:, 7] = 0  # a zero column: scale 1, values 0
    q = quantization.quantize(jnp.asarray(w), mode)
    value, scale = quantization.quantize_numpy(w, mode)
    assert q.value.dtype == value.dtype and q.scale.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(q.scale), scale)
    np.testing.assert_array_equal(np.asarray(q.value).view(np.uint8), value.view(np.uint8))
    restored = np.asarray(quantization.dequantize(q))
    assert value.shape == (48, 64)  # stored [O, I]
    np.testing.assert_array_equal(restored, (value.astype(np.float32) * scale[:, None]).T)
    step = scale if mode != "fp8" else np.abs(w).max(axis=0) / 8  # fp8: 3 mantissa bits
    assert np.all(np.abs(restored - w) <= step / 2 + 1e-7)
    assert scale[7] == 1 and not np.asarray(q.value)[7].astype(np.float32).any()


@pytest.mark.parametrize("mode", MODES)
def test_quantized_linear_is_close_to_the_float_matmul(mode):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    q = quantization.quantize(jnp.asarray(w), mode)
    y = np.asarray(quantization.linear(jnp.asarray(x), q))
    exact = x @ w
    err = np.abs(y - exact).max() / np.abs(exact).max()
    assert err < {"int8": 0.02, "w8a8": 0.03, "fp8": 0.08, "int4": 0.15}[mode], err
    if mode == "w8a8":  # the int32 dot is exact: the result is the dequantized product
        xs = np.abs(x).max(axis=1, keepdims=True) / 127
        xq = np.clip(np.round(x / xs), -127, 127)
        value, scale = quantization.quantize_numpy(w, mode)
        expected = (xq @ value.T.astype(np.float64)) * xs * scale
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_ml_dtypes_fp8_max_is_448():
    assert quantization.FP8_MAX == 448.0 == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


@pytest.fixture(scope="module")
def engines(hf_model_dirs):
    path = hf_model_dirs["llama"]
    return {mode: LLM(path, quantization=mode, strict_compile=True, **SMALL)
            for mode in (None, *MODES)}


@pytest.mark.parametrize("mode", MODES)
def test_quantized_engine_follows_the_float_model(engines, mode):
    prompts = [[1, 5, 9, 13, 2, 7], [3, 4, 4, 8, 20, 31, 2, 11, 6]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    ref = engines[None].generate(prompts, params)
    out = engines[mode].generate(prompts, params)
    if mode != "int4":  # random weights: the top tokens lie < 0.1 nat apart, within int4's
        # error (its token agreement is measured on the demo: benchmarks/int4_accuracy.py)
        assert [o.token_ids[:3] for o in out] == [o.token_ids[:3] for o in ref]
    for o, r in zip(out, ref, strict=True):  # the float model's top token keeps its logprob
        first = r.token_ids[0]
        tolerance = 0.2 if mode == "int4" else 0.1
        assert o.logprobs[0][first].logprob == pytest.approx(r.logprobs[0][first].logprob,
                                                             abs=tolerance)
    assert engines[mode].metrics()["compiles_after_warmup"] == 0


@pytest.mark.parametrize("mode", [None, *MODES])
def test_weight_bytes_match_the_planner(engines, mode):
    engine = engines[mode].engine
    actual = tree_bytes(engine.runner.params)
    assert actual == engine.memory_plan.weight_bytes
    cfg = engine.model_config
    if mode is not None:  # one byte per linear weight plus a f32 scale per column; int4:
        # half a byte plus a bf16 step and offset per group of rows and column
        linear = sum(np.prod(w.shape) // 2 + 4 * np.prod(w.shape) // quantization.int4_group(
            w.shape[0]) if mode == "int4" else np.prod(w.shape) + 4 * w.shape[1]
            for layer in engine.runner.params["layers"]
            for name, w in layer.items() if name in quantization.QUANTIZED_WEIGHTS)
        rest = planner.weight_bytes(cfg, "float32") - 4 * sum(
            np.prod(w.shape) for layer in engine.runner.params["layers"]
            for name, w in layer.items() if name in quantization.QUANTIZED_WEIGHTS)
        # the LM head: int8/fp8 [V, D] and a scale per vocabulary row, replacing a float
        # head or, tied, beside the float embedding table
        vocab, hidden = cfg.vocab_size, cfg.hidden_size
        head = vocab * hidden + 4 * vocab
        if not cfg.tie_word_embeddings:
            rest -= 4 * vocab * hidden
        assert actual == linear + head + rest
        assert engine.runner.params["lm_head"].value.shape == (vocab, hidden)


@pytest.mark.parametrize("mode", ["w8a8", "fp8"])
def test_tensor_parallel_quantized_matches_one_device(hf_model_dirs, engines, mode):
    llm = LLM(hf_model_dirs["llama"], quantization=mode, tensor_parallel_size=2,
              strict_compile=True, **SMALL)
    prompts = [[1, 5, 9, 13, 2, 7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert llm.generate(prompts, params)[0].token_ids == \
        engines[mode].generate(prompts, params)[0].token_ids
    per_device = collections.Counter()
    for leaf in jax.tree.leaves(llm.engine.runner.params):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    expected = planner.weight_bytes(llm.engine.model_config, "float32", 2, mode)
    assert list(per_device.values()) == [expected, expected]
    scale = llm.engine.runner.params["layers"][0]["wqkv"].scale
    assert scale.addressable_shards[0].data.shape[0] == scale.shape[0] // 2  # split columns


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization='int3' must be one of"):
        EngineConfig(quantization="int3")


@pytest.mark.parametrize("mode", ["w8a8", "int4"])
def test_quantized_orbax_checkpoint_loads_without_requantizing(hf_model_dirs, engines,
                                                                tmp_path, mode):
    from jaxinfer import checkpoint

    out = tmp_path / mode
    checkpoint.convert_hf_to_orbax(hf_model_dirs["llama"], out, quantization_mode=mode)
    assert checkpoint.checkpoint_quantization(out) == mode
    llm = LLM(out, strict_compile=True, **SMALL)  # the mode comes from the checkpoint
    for name in ("w_down", "wqkv", "attn_norm"):  # int4: AWQ's folded scales come along
        restored = llm.engine.runner.params["layers"][1][name]
        at_load = engines[mode].engine.runner.params["layers"][1][name]
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(at_load), strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    restored = llm.engine.runner.params["layers"][1]["w_down"]
    assert restored.mode == mode and restored.value.dtype == quantization.STORAGE[mode]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert llm.generate([[1, 5, 9]], params)[0].token_ids == \
        engines[mode].generate([[1, 5, 9]], params)[0].token_ids
    assert tree_bytes(llm.engine.runner.params) == llm.engine.memory_plan.weight_bytes
    other = "int8"
    with pytest.raises(ValueError, match=f"holds {mode} weights; quantization='{other}'"):
        LLM(out, quantization=other, warm_up=False, **SMALL)
