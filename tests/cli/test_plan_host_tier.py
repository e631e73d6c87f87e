"""`plan --kv_offloading_size`: the host tier's section (sizing/host_tier.py) from the
real command line, and the settings the engine refuses refused here too."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxinfer.sizing import accelerators

ROOT = pathlib.Path(__file__).resolve().parents[2]
LLAMA = ("--model=llama3.1-8b", "--max_model_len=8192", "--kv_cache_dtype=bfloat16")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxinfer", "plan", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_plan_reports_the_host_tier_and_its_link():
    """Llama-3.1-8B bf16 over an h100-4's 4 GPUs: a page of every layer is 2 MiB over the
    4 (sizing/test_host_tier.py), so 8 GiB hold 4,096 pages, 8 contexts of 8,192 tokens;
    one context back over each GPU's PCIe Gen5 x16 (64 GB/s) takes 4.194 ms."""
    result = _cli(*LLAMA, "--device=h100-4", "--kv_offloading_size=8", "--format=json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["tensor_parallel_size"] == 4
    assert report["host_tier"] == {
        "kv_offloading_size_gib": 8.0, "host_pages": 4096, "host_page_bytes": 2 * 2**20,
        "host_bytes": 8 * 2**30, "host_tokens": 65536, "host_full_contexts": 8,
        "replicas": 1, "device_host_link_bytes_per_s": 64e9,
        "host_link_source": accelerators.H100_DATASHEET, "host_link_note": None,
        "restore_full_context_ms": 4.194}
    assert report["device"]["device_host_link_bytes_per_s"] == 64e9
    table = _cli(*LLAMA, "--device=v5e-4", "--kv_offloading_size=8")
    assert table.returncode == 0, table.stderr
    lines = [line.split(None, 1) for line in table.stdout.splitlines()]
    assert ["host_tier:"] in lines
    assert ["host_pages", "4096"] in lines and ["host_full_contexts", "8"] in lines
    assert ["host_link_source", "https://cloud.google.com/tpu/docs/v5e"] in lines
    assert ["restore_full_context_ms", "8.389"] in lines  # 32 GB/s assumed, and said so
    assert any(k == "host_link_note" and "not published" in v for k, *rest in lines
               for v in rest)
    assert "host_tier" not in _cli(*LLAMA, "--device=v5e-4").stdout  # off by default


@pytest.mark.parametrize("flags,code,message", [
    (("--kv_offloading_size=0",), 2, "--kv_offloading_size=0.0 must be a number of GiB > 0"),
    (("--kv_offloading_size=8", "--enable_prefix_caching=false"), 2,
     "with enable_prefix_caching=False: not supported"),
    (("--kv_offloading_size=8", "--device=h100-8", "--pipeline_parallel_size=2"), 2,
     "with pipeline_parallel_size=2: not supported"),
    (("--kv_offloading_size=0.0001",), 1, "holds no KV page"),
])
def test_plan_refuses_what_the_engine_refuses(flags, code, message):
    result = _cli(*LLAMA, "--memory_gb=80", *flags)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr and message in result.stderr


def test_plan_refuses_page_groups_unless_the_hybrid_cache_is_off():
    gemma = ("--model=gemma-3-27b", "--max_model_len=8192", "--device=h100-4",
             "--kv_offloading_size=8")
    result = _cli(*gemma)
    assert result.returncode == 1 and "disable_hybrid_kv_cache_manager=True" in result.stderr
    result = _cli(*gemma, "--disable_hybrid_kv_cache_manager", "--format=json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["host_tier"]["host_pages"] > 0


def test_plan_of_an_encoder_refuses_a_host_tier(tmp_path):
    from jaxinfer import testing

    testing.make_encoder_model(tmp_path, "bert")
    result = _cli(f"--model={tmp_path}", "--memory_gb=1", "--kv_offloading_size=1")
    assert result.returncode == 2, result.stderr
    assert "with runner='pooling': not supported" in result.stderr
