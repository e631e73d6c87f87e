"""The whole engine step compiles for one v5e chip, with the Mosaic kernel and bf16 pages.

Params, KV cache and inputs are ShapeDtypeStructs (nothing allocated); the KV pool is
sized by the memory planner as the engine would size it on the chip. Models: a
Qwen3-0.6B shape, and Llama-3.1-8B's layer shapes with as many layers as fit one 16 GiB
chip (the whole 8B needs tensor parallelism). The default run compiles the smallest,
the largest and one mixed bucket of each; `slow` compiles every bucket.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from jaxinfer import aot, aot_rows
from jaxinfer.config import DEFAULT_MODEL, load_preset
from jaxinfer.engine.core.buckets import BucketSet
from jaxinfer.sizing import accelerators, planner

SETTINGS = aot.Settings(dtype="bfloat16", kv_dtype="bfloat16", max_num_seqs=64,
                        max_num_batched_tokens=512, max_model_len=2048, page_size=16)
WEIGHT_FRACTION = 0.8  # of the chip's HBM: the rest holds the KV pool and temporaries


def llama_layers_that_fit() -> tuple[object, int]:
    cfg = load_preset("llama3.1-8b")
    hbm = accelerators.get("v5e-1").chip.usable_hbm_bytes
    layers = cfg.num_layers
    while planner.weight_bytes(dataclasses.replace(cfg, num_layers=layers),
                               "bfloat16") > WEIGHT_FRACTION * hbm:
        layers -= 1
    return dataclasses.replace(cfg, num_layers=layers), layers


MODELS = {"qwen3-0.6b": lambda: load_preset("qwen3-0.6b"),
          "llama3.1-8b-layers": lambda: llama_layers_that_fit()[0]}


def _check_report(report: dict, cfg) -> None:
    assert report["fits"], report
    rows = report["buckets"]
    assert all(r["compiled"] for r in rows)
    plan = report["plan"]
    kv_shape = f"bf16[{plan['num_pages']},16,{cfg.num_kv_heads},2,{cfg.head_dim}]"
    for row in rows:
        assert row["mosaic_kernels"] == 2 * cfg.num_layers  # prefill + decode pass a layer
        assert row["kv_pages"] == [kv_shape]  # bf16 pages, packed layout, no uint16
        assert aot_rows.agreement(report["planned_argument_bytes"], row["argument_bytes"]) < 0.01
        assert row["total_bytes"] <= report["chip_usable_hbm_bytes"]
        assert row["roofline_estimate_ms"] > 0 and row["flops"] > 0


# Qwen3's layers compile in the default run through test_quantized_step_compiles (its
# 4-layer shape); its whole model here takes ~110 s, so it runs with the slow tests.
@pytest.mark.parametrize("model", [pytest.param("qwen3-0.6b", marks=pytest.mark.slow),
                                   "llama3.1-8b-layers"])
def test_step_compiles_for_v5e_smallest_mixed_largest(model):
    cfg = MODELS[model]()
    report = aot.compile_report(cfg, device="v5e-1", settings=SETTINGS, buckets="ends")
    assert len(report["buckets"]) == 3
    _check_report(report, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_step_compiles_for_v5e_every_bucket(model):
    cfg = MODELS[model]()
    report = aot.compile_report(cfg, device="v5e-1", settings=SETTINGS, buckets="all")
    every = BucketSet(max_num_batched_tokens=SETTINGS.max_num_batched_tokens,
                      max_num_seqs=SETTINGS.max_num_seqs).all()
    assert len(report["buckets"]) == len(every)
    _check_report(report, cfg)


def test_llama_layers_that_fit_leave_room_for_kv():
    cfg, layers = llama_layers_that_fit()
    assert 20 <= layers < 32  # the whole 8B (16.06 GB) does not fit a 16 GiB chip


def test_oversized_kv_pool_is_reported_with_the_compilers_message():
    """Llama-3.1-8B bf16 with KV for 64 requests of 8,192 tokens on one v5e chip: the
    weights alone fit, the pool does not. The smallest buckets (one decode, one mixed)
    are enough to show it."""
    cfg = load_preset("llama3.1-8b")
    kv_bytes = 64 * 8192 * planner.kv_bytes_per_token(cfg, "bfloat16")
    settings = dataclasses.replace(SETTINGS, max_model_len=8192, max_num_seqs=1,
                                   max_num_batched_tokens=16, kv_cache_memory_bytes=kv_bytes)
    report = aot.compile_report(cfg, device="v5e-1", settings=settings, buckets="all")
    assert not report["fits"]
    assert [row["decode"] for row in report["buckets"]] == [True, False]
    for row in report["buckets"]:
        assert not row["compiled"]
        assert "RESOURCE_EXHAUSTED" in row["error"] and "HBM" in row["error"]



def test_aot_command_prints_progress_and_none_of_libtpus_start_up_noise():
    """`python -m jaxinfer aot` in a fresh process (where libtpu loads): stderr holds its
    progress lines, one as each bucket's compile ends, and nothing else; without the
    settings `aot.tpu_compile_environment` makes, libtpu prints an `INVALID_ARGUMENT ...
    unexpected worker hostname` error as it loads. The demo model's smallest bucket with
    a 0.1 GB pool: about 10 s."""
    made_here = ("TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES", "TPU_HOST_BOUNDS")
    env = {k: v for k, v in os.environ.items() if k not in made_here}  # the command's own
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "aot", f"--model={DEFAULT_MODEL}",
         "--device=v5e-1", "--buckets=smallest", "--kv_cache_memory_bytes=100000000"],
        capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == ("aot: compiling 1 step (1 bucket) for v5e-1 (DP 1 x TP 1), one at "
                        "a time: tens of seconds to minutes each on a CPU host")
    assert len(lines) == 2 and lines[1].startswith(
        "aot: bucket 1/1: 1 token x 1 seq (decode) compiled in "), result.stderr
    table = result.stdout.splitlines()
    assert table[-1].split()[:2] == ["1", "1"] and "does not compile" not in table[-1]


def _check_quantized(device: str, mode: str, cfg) -> None:
    settings = dataclasses.replace(SETTINGS, quantization=mode)
    report = aot.compile_report(cfg, device=device, settings=settings, buckets="ends")
    _check_report(report, cfg)  # includes: argument bytes within 1% of the planner's
    bf16 = planner.weight_bytes(cfg, "bfloat16")
    linear = sum(cfg.num_layers * n for n in (  # elements of the four linear weights
        cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
        cfg.num_heads * cfg.head_dim * cfg.hidden_size,
        cfg.hidden_size * 2 * cfg.intermediate_size, cfg.intermediate_size * cfg.hidden_size))
    columns = cfg.num_layers * ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                                + 2 * cfg.hidden_size + 2 * cfg.intermediate_size)
    head = cfg.vocab_size * cfg.hidden_size  # int8 head: a copy when tied, else 2 -> 1 byte
    head_bytes = (head if cfg.tie_word_embeddings else -head) + 4 * cfg.vocab_size
    if mode == "int4":  # half a byte a weight, bf16 step and offset per 128 rows (Qwen3)
        quantized = bf16 - 2 * linear + linear // 2 + linear // 32
    else:
        quantized = bf16 - linear + 4 * columns
    assert report["plan"]["weight_bytes"] == quantized + head_bytes


@pytest.mark.parametrize("device, mode", [  # v6e's w8a8 takes ~130 s: slow, as its int4
    ("v5e-1", "w8a8"), pytest.param("v6e-1", "w8a8", marks=pytest.mark.slow),
    ("v5e-1", "int4"), pytest.param("v6e-1", "int4", marks=pytest.mark.slow),
    pytest.param("v5e-1", "int8", marks=pytest.mark.slow)])
def test_quantized_step_compiles(device, mode):
    """Quantized weights (jaxinfer/model/quantization.py) in the compiled step of a 4-layer
    Qwen3-0.6B shape: libtpu's argument bytes match the planner's quantized bytes (one
    byte per linear weight and LM head element plus f32 column scales, int4 half a byte
    plus bf16 group scales with an int8 head; embedding and norms bf16)."""
    _check_quantized(device, mode, dataclasses.replace(MODELS["qwen3-0.6b"](), num_layers=4))


@pytest.mark.slow
@pytest.mark.parametrize("device, mode", [("v5e-1", "w8a8"), ("v6e-1", "w8a8"),
                                          ("v5e-1", "int8")])
def test_quantized_step_compiles_whole_model(device, mode):
    _check_quantized(device, mode, MODELS["qwen3-0.6b"]())


# A 2 GB pool: with the whole chip's pool the compile runs out of HBM, as the f32 scales
# [P, K, 2G] are re-laid out with their minor axis padded to 128 lanes, a temporary of
# one layer's scales x 128 / 2G (see pallas/kv_quant.py).
QUANT_KV_SETTINGS = dataclasses.replace(SETTINGS, max_num_seqs=16, max_num_batched_tokens=128,
                                        max_model_len=1024, kv_cache_memory_bytes=2 * 10**9)


@pytest.mark.parametrize("kv_dtype, device", [
    ("int8", "v5e-1"), ("fp8", "v6e-1"),  # about 80 s each here
    pytest.param("fp8", "v5e-1", marks=pytest.mark.slow),
    pytest.param("int8", "v6e-1", marks=pytest.mark.slow)])
def test_step_with_8bit_kv_and_scales_compiles(kv_dtype, device):
    """A small model (Qwen3-0.6B's layers, 2 of them) with 8-bit pages and their f32
    scales per token and KV head (pallas/kv_quant.py): the Mosaic kernel reads both."""
    cfg = dataclasses.replace(load_preset("qwen3-0.6b"), num_layers=2)
    settings = dataclasses.replace(QUANT_KV_SETTINGS, kv_dtype=kv_dtype)
    report = aot.compile_report(cfg, device=device, settings=settings, buckets="ends")
    assert report["fits"], report
    stored = {"int8": "s8", "fp8": "f8e4m3fn"}[kv_dtype]
    pages = report["plan"]["num_pages"]
    for row in report["buckets"]:
        assert row["mosaic_kernels"] == 2 * cfg.num_layers
        assert row["kv_pages"] == [f"{stored}[{pages},16,{cfg.num_kv_heads // 2},4,"
                                   f"{cfg.head_dim}]"]
        assert row["args_vs_plan"] < 0.001  # pages + scales, as planned
