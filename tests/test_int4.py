"""int4 weights and their AWQ scales: the group rule, packing and a bit-exact round
trip against numpy, bytes as planned on one and two devices, groups that would straddle
devices refused, tensor parallelism unchanged, AWQ's output error below
round-to-nearest on held-out activations of the demo model, calibration data errors
and the CLI's convert."""

from __future__ import annotations

import collections
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, checkpoint, testing
from jaxinfer.checkpoint import awq
from jaxinfer.config import DEFAULT_MODEL, EngineConfig, load_preset
from jaxinfer.model import quantization
from jaxinfer.sizing import planner
from jaxinfer.text import corpus
from jaxinfer.text.tokenizer import Tokenizer

SMALL = dict(page_size=8, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16)


@pytest.mark.parametrize(("rows", "group"), [(320, 64), (864, 32), (576, 64), (1536, 128),
                                             (192, 64), (512, 128), (96, 32)])
def test_int4_group_is_the_largest_of_128_64_32_dividing_the_inputs(rows, group):
    assert quantization.int4_group(rows) == group


def test_int4_group_refuses_inputs_no_group_divides():
    with pytest.raises(ValueError, match="divisible by one of .* got 100"):
        quantization.int4_group(100)


def test_int4_round_trip_is_bit_exact_against_numpy():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((192, 40)).astype(np.float32) * rng.uniform(0.01, 5, 40)
    w[64:128, 3] = 0.7  # a constant group: step 1, every code 0, offset = the value
    w[:, 5] += 3.0  # a column far from zero: the offset does the work
    q = quantization.quantize(jnp.asarray(w), "int4")
    value, scale = quantization.quantize_numpy(w, "int4")
    assert q.value.dtype == np.uint8 and q.value.shape == (96, 40) and q.shape == (192, 40)
    assert q.scale.dtype == jnp.bfloat16 and q.scale.shape == (2, 3, 40)
    np.testing.assert_array_equal(np.asarray(q.value), value)
    np.testing.assert_array_equal(np.asarray(q.scale).view(np.uint16), scale.view(np.uint16))
    jitted = jax.jit(functools.partial(quantization.quantize, mode="int4"))(w)  # as at load
    np.testing.assert_array_equal(np.asarray(jitted.value), value)
    np.testing.assert_array_equal(np.asarray(jitted.scale).view(np.uint16), scale.view(np.uint16))
    restored = np.asarray(quantization.dequantize(q))
    np.testing.assert_array_equal(restored, quantization.dequantize_numpy(value, scale))
    step, offset = (np.repeat(x.astype(np.float32), 64, axis=0) for x in scale)
    # half a step, plus the bf16 rounding of the step (times up to 15 codes) and offset
    bound = step * (0.5 + 15 * 2.0 ** -8) + np.abs(offset) * 2.0 ** -8
    assert np.all(np.abs(restored - w) <= bound)
    assert np.all(restored[64:128, 3] == np.float32(ml_dtypes.bfloat16(0.7)))


def test_int4_packs_even_rows_in_the_low_nibble():
    codes = np.tile(np.arange(16, dtype=np.float32), 2)[:, None]  # 32 rows: one group
    q = quantization.quantize(jnp.asarray(np.concatenate([codes, 2 * codes], axis=1)), "int4")
    value = np.asarray(q.value)
    np.testing.assert_array_equal(value[:, 0], codes[0::2, 0] + 16 * codes[1::2, 0])
    np.testing.assert_array_equal(np.asarray(q.scale, np.float32)[:, 0], [[1, 2], [0, 0]])


def test_int4_bytes_are_a_quarter_of_bf16_plus_scales():
    cfg = load_preset("smollm-135m")
    bf16 = planner.weight_bytes(cfg, "bfloat16")
    int4 = planner.weight_bytes(cfg, "bfloat16", quantization="int4")
    d, f = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    linears = [(d, qkv), (cfg.num_heads * cfg.head_dim, d), (d, 2 * f), (f, d)]
    elements = cfg.num_layers * sum(i * o for i, o in linears)
    scales = cfg.num_layers * sum(4 * i * o // quantization.int4_group(i) for i, o in linears)
    head = cfg.vocab_size * d + 4 * cfg.vocab_size  # the tied head's int8 copy and scales
    assert bf16 - int4 == 2 * elements - (elements // 2 + scales) - head


def test_int4_groups_straddling_devices_are_refused(hf_model_dirs):
    cfg = checkpoint.load_config(hf_model_dirs["llama"])  # w_down [128, 64]: one group
    with pytest.raises(ValueError, match=r"groups of 128 rows straddle the 2 devices' shares "
                       r"of w_down \[128, 64\] \(split by input rows, 64 each\): "
                       r"tensor_parallel_size=2 must divide 1"):
        planner.weight_bytes(cfg, "float32", 2, "int4")
    with pytest.raises(ValueError, match="straddle"):
        LLM(hf_model_dirs["llama"], quantization="int4", tensor_parallel_size=2,
            warm_up=False, **SMALL)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A tiny llama whose wo and w_down have 256 inputs: two groups of 128, one a device."""
    path = tmp_path_factory.mktemp("int4-wide")
    testing.make_hf_model(path, "llama", seed=3, head_dim=64, intermediate_size=256)
    return path


def test_int4_tensor_parallel_matches_one_device(wide_dir):
    prompts = [[1, 5, 9, 13, 2, 7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM(wide_dir, quantization="int4", strict_compile=True, **SMALL)
    two = LLM(wide_dir, quantization="int4", tensor_parallel_size=2, strict_compile=True,
              **SMALL)
    assert two.generate(prompts, params)[0].token_ids == one.generate(prompts, params)[0].token_ids
    per_device = collections.Counter()
    for leaf in jax.tree.leaves(two.engine.runner.params):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    cfg = two.engine.model_config
    expected = planner.weight_bytes(cfg, "float32", 2, "int4")
    assert list(per_device.values()) == [expected, expected]
    assert planner.weight_bytes(cfg, "float32", 1, "int4") == one.engine.memory_plan.weight_bytes
    wo = two.engine.runner.params["layers"][0]["wo"]  # split by rows: whole groups each
    assert wo.value.addressable_shards[0].data.shape == (64, 64)
    assert wo.scale.addressable_shards[0].data.shape == (2, 1, 64)


@pytest.fixture(scope="module")
def demo():
    cfg = checkpoint.load_config(DEFAULT_MODEL)
    params = jax.device_get(checkpoint.load_params(DEFAULT_MODEL, cfg, "float32"))
    return cfg, params, Tokenizer.from_dir(DEFAULT_MODEL)


def _held_out_windows(tokenizer, count=4, length=128):
    windows = []
    for text in corpus.read_texts(corpus.corpus_files()[1][:count * 3]):
        ids = tokenizer.encode(text[:4000], add_special_tokens=False)
        if len(ids) >= length:
            windows.append(ids[:length])
    return np.asarray(windows[:count], np.int32)


def _fake_int4(layer: dict) -> dict:
    return layer | {name: awq.fake_int4(np.asarray(layer[name], np.float32))
                    for name in awq.LINEARS}


def test_awq_lowers_the_output_error_on_held_out_activations(demo):
    """Two layers of the demo model calibrated on default windows: on held-out text, each
    layer's output with its four linears through int4 is closer to the float layer's
    with AWQ's folded scales and clipping than with round-to-nearest (measured ratios
    0.91 and 0.87)."""
    cfg, params, tokenizer = demo
    calibration = awq.calibration_token_ids(tokenizer, None, max_len=512, num_windows=8)
    x_cal, x_test = (awq.layers.embed(jnp.asarray(params["embed"]), jnp.asarray(ids))
                     for ids in (calibration, _held_out_windows(tokenizer)))
    for layer in params["layers"][:2]:
        inputs, x_cal = awq.layer_inputs(layer, x_cal, cfg=cfg)
        scaled = awq.calibrate_layer(layer, inputs, cfg)
        _, want = awq.layer_inputs(layer, x_test, cfg=cfg)
        _, rtn = awq.layer_inputs(_fake_int4(layer), x_test, cfg=cfg)
        _, with_awq = awq.layer_inputs(_fake_int4(scaled), x_test, cfg=cfg)
        error_rtn, error_awq = (float(jnp.mean((y - want) ** 2)) for y in (rtn, with_awq))
        assert error_awq < 0.95 * error_rtn, (error_awq, error_rtn)
        x_test = want


def test_calibration_windows_from_a_jsonl_file(demo, tmp_path):
    _, _, tokenizer = demo
    path = tmp_path / "cal.jsonl"
    path.write_text("\n".join(json.dumps({"text": "def f(x):\n    return x + 1\n" * 40})
                              for _ in range(3)) + "\n\n")
    ids = awq.calibration_token_ids(tokenizer, path, max_len=512, num_windows=4, window=64)
    stream = tokenizer.encode(awq.read_calibration_texts(path)[0], add_special_tokens=False)
    assert ids.shape == (4, 64) and ids.dtype == np.int32
    assert list(ids[0]) == stream[:64]


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", r"cal.jsonl:2: not JSON"),
    ('{"txt": "x"}', r'cal.jsonl:2: calibration lines must be \{"text": "..."\} objects'),
    ('["a"]', r"cal.jsonl:2: calibration lines must be"),
])
def test_calibration_file_bad_line_is_named(tmp_path, hf_model_dirs, line, message):
    path = tmp_path / "cal.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message):
        awq.read_calibration_texts(path)
    with pytest.raises(ValueError, match=message):  # through the engine's loading
        LLM(hf_model_dirs["llama"], quantization="int4", calibration_data=str(path),
            warm_up=False, **SMALL)


def test_calibration_data_needs_int4():
    with pytest.raises(ValueError, match="calibration_data='c.jsonl' needs quantization='int4'"):
        EngineConfig(calibration_data="c.jsonl", quantization="int8")


def test_cli_convert_int4_with_calibration_data(hf_model_dirs, tmp_path):
    path = tmp_path / "cal.jsonl"
    path.write_text(json.dumps({"text": "import os\nprint(os.getcwd())\n" * 30}) + "\n")
    out = tmp_path / "int4"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "convert", f"--model={hf_model_dirs['llama']}",
         f"--output={out}", "--quantization=int4", f"--calibration_data={path}"],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert checkpoint.checkpoint_quantization(out) == "int4"
    cfg = checkpoint.load_config(out)
    params = checkpoint.load_params(out, cfg)
    assert quantization.mode_of(params) == "int4"
    assert params["layers"][0]["w_down"].value.dtype == jnp.uint8
