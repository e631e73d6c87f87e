"""dtype "auto" (vLLM's): the checkpoint's own dtype, resolved alike by the engine and
`plan`; float16 refused with its reason. docs/models.md#dtype."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxinfer import LLM, testing
from jaxinfer.config import EngineConfig, ModelConfig, served_dtype

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=128)
SMALL = dict(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, page_size=8,
             compilation_cache_dir="")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """saved dtype -> a tiny random Llama saved in it."""
    return {dtype: testing.make_random_model(tmp_path_factory.mktemp(dtype), TINY, seed=3,
                                             dtype=dtype)
            for dtype in ("float32", "bfloat16")}


def _weight_bytes(llm: LLM) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(llm.engine.runner.params))


def _plan_dtype(model: pathlib.Path, *flags: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "jaxinfer", "plan", f"--model={model}", "--memory_gb=1",
         "--format=json", *flags], capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["dtype"]


def test_a_bfloat16_checkpoint_is_served_in_bfloat16_with_half_the_bytes(checkpoints):
    bf16 = LLM(model=checkpoints["bfloat16"], warm_up=False, **SMALL)
    f32 = LLM(model=checkpoints["float32"], warm_up=False, **SMALL)
    assert bf16.engine.config.dtype == "bfloat16"
    assert f32.engine.config.dtype == "float32"  # on CPU, where bfloat16 can be slower
    assert {leaf.dtype for leaf in jax.tree.leaves(bf16.engine.runner.params)} == {
        np.dtype("bfloat16")}
    assert _weight_bytes(bf16) * 2 == _weight_bytes(f32)


def test_plan_reports_the_dtype_the_engine_serves(checkpoints):
    for saved, path in checkpoints.items():
        assert _plan_dtype(path) == saved  # no --device: this machine, as the engine
        assert _plan_dtype(path, "--dtype=float") == "float32"
    # On an accelerator a float32 checkpoint is served in bfloat16, as vLLM's auto.
    assert _plan_dtype(checkpoints["float32"], "--device=v5e-1") == "bfloat16"


def test_an_explicit_dtype_wins_over_the_checkpoints(checkpoints):
    llm = LLM(model=checkpoints["bfloat16"], dtype="float32", warm_up=False, **SMALL)
    assert llm.engine.config.dtype == "float32"
    assert {leaf.dtype for leaf in jax.tree.leaves(llm.engine.runner.params)} == {
        np.dtype("float32")}


@pytest.mark.parametrize("saved,platform,served", [
    ("float32", "cpu", "float32"), ("float32", "tpu", "bfloat16"),
    ("float32", "gpu", "bfloat16"), ("bfloat16", "cpu", "bfloat16"),
    ("float16", "gpu", "bfloat16"), (None, "cpu", "float32"), (None, "tpu", "bfloat16"),
])
def test_auto_follows_vllm(saved, platform, served):
    hf = {} if saved is None else {"torch_dtype": saved}
    assert served_dtype("auto", hf, platform) == served
    nested = {"text_config": hf}  # a multimodal config's text tower
    assert served_dtype("auto", nested, platform) == served


@pytest.mark.parametrize("dtype", ["float16", "half"])
def test_float16_is_refused_with_the_reason(dtype):
    with pytest.raises(ValueError, match=f"dtype='{dtype}' is not served: jaxinfer's "
                       "attention kernels and KV cache take float32 or bfloat16"):
        EngineConfig(dtype=dtype)


def test_float_means_float32():
    assert EngineConfig(dtype="float").dtype == "float32"
