"""`plan --device`: the DP x TP layout table and its recommendation, `--data_parallel_size`
(alone or with `--tensor_parallel_size`) choosing the layout planned."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from jaxinfer.config import load_preset
from jaxinfer.sizing import accelerators, layout

ROOT = pathlib.Path(__file__).resolve().parents[2]
INT8_8B = ("--model=llama3.1-8b", "--quantization=int8", "--dtype=bfloat16",
           "--kv_cache_dtype=bfloat16")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxinfer", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def _plan(*args: str) -> dict:
    result = _cli("plan", *args, "--format=json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _expected_layout(device: str, max_model_len: int, max_num_seqs: int) -> dict:
    acc = accelerators.find_preset(device)
    kwargs = dict(dtype="bfloat16", kv_dtype="bfloat16", quantization="int8",
                  max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  memory_bytes=int(acc.chip.usable_hbm_bytes * 0.9),
                  bandwidth_gb_per_s=acc.chip.hbm_bytes_per_s / 1e9,
                  peak_flops_per_s=acc.chip.bf16_flops)
    splits = layout.splits(load_preset("llama3.1-8b"), acc, **kwargs)
    return layout.report(splits, splits[-1], acc, max_model_len)


@pytest.mark.parametrize("device, max_model_len, max_num_seqs, recommended", [
    ("v5e-8", 1024, 32, (8, 1)), ("v6e-8", 16384, 64, (2, 4))])
def test_plan_recommends_a_layout_and_plans_every_chip_tensor_parallel_by_default(
        device, max_model_len, max_num_seqs, recommended):
    report = _plan(*INT8_8B, f"--device={device}", f"--max_model_len={max_model_len}",
                   f"--max_num_seqs={max_num_seqs}")
    assert (report["data_parallel_size"], report["tensor_parallel_size"]) == (1, 8)
    assert report["layout"] == _expected_layout(device, max_model_len, max_num_seqs)
    best = report["layout"]["recommended"]
    assert (best["data_parallel_size"], best["tensor_parallel_size"]) == recommended
    assert report["layout"]["planned"]["tensor_parallel_size"] == 8
    rows = report["layout"]["splits"]
    assert [(r["data_parallel_size"], r["tensor_parallel_size"]) for r in rows] == [
        (8, 1), (4, 2), (2, 4), (1, 8)]
    assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in rows)


def test_data_parallel_size_chooses_the_layout_planned():
    alone = _plan(*INT8_8B, "--device=v5e-8", "--max_model_len=1024",
                  "--data_parallel_size=8")
    assert (alone["data_parallel_size"], alone["tensor_parallel_size"],
            alone["replicas"]) == (8, 1, 8)
    assert alone["weight_bytes"] == alone["unsharded_weight_bytes"]  # replicas: whole
    planned = alone["layout"]["planned"]
    assert (planned["data_parallel_size"], planned["tensor_parallel_size"]) == (8, 1)
    assert planned == alone["layout"]["recommended"]
    both = _plan(*INT8_8B, "--device=v5e-8", "--max_model_len=1024",
                 "--data_parallel_size=2", "--tensor_parallel_size=2")  # 4 of 8 chips
    assert (both["data_parallel_size"], both["tensor_parallel_size"], both["replicas"]) == (
        2, 2, 2)
    assert both["layout"]["planned"]["tensor_parallel_size"] == 2
    assert both["layout"]["planned"]["tokens_per_s"] < both["layout"]["recommended"][
        "tokens_per_s"]  # half the chips


def test_plan_text_shows_the_table_and_the_recommendation():
    result = _cli("plan", *INT8_8B, "--device=v5e-8", "--max_model_len=1024")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line.split() for line in lines if "communication_ms" in line)
    assert header[:3] == ["data_parallel_size", "tensor_parallel_size", "fits"]
    assert "tokens_per_s" in header and any("recommended:" in line for line in lines)


@pytest.mark.parametrize("args, message", [
    (("--quantization=int8", "--data_parallel_size=3"),
     "--data_parallel_size=3 must divide the 8 devices of --device=v5e-8"),
    (("--quantization=int8", "--data_parallel_size=4", "--tensor_parallel_size=4"),
     "--data_parallel_size=4 x --tensor_parallel_size=4 needs 16 devices"),
    (("--data_parallel_size=8",),  # 16 GB of bf16 weights on each 16 GB chip
     "short: give at least 16.197 GB, raise tensor_parallel_size or lower max_model_len "
     "(recommended here: --data_parallel_size=4 --tensor_parallel_size=2)"),
])
def test_plan_refuses_a_layout_the_device_cannot_hold(args, message):
    result = _cli("plan", "--model=llama3.1-8b", "--dtype=bfloat16", "--max_model_len=1024",
                  "--device=v5e-8", *args)
    assert result.returncode == 1, result.stderr
    assert message in result.stderr.splitlines()[-1]


def test_plan_and_aot_take_data_parallel_size():
    for command in ("plan", "aot"):
        assert "--data_parallel_size (int;" in _cli(command, "--help").stdout
