"""Shared fixtures: tiny random HF checkpoints per family, built once per session."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import pytest

from jaxinfer import testing

# Eight virtual CPU devices for the tensor-parallel tests (set before JAX starts its
# backend; single-device code runs on device 0 as before).
jax.config.update("jax_num_cpu_devices", 8)

FAMILIES = tuple(testing.FAMILIES)
# The TPU ahead-of-time checks run in .venv-tpu (`make test-tpu-aot`), never here.
collect_ignore = [] if importlib.util.find_spec("libtpu") else ["tpu_aot"]


@pytest.fixture(scope="session")
def hf_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """family -> directory of a saved tiny HF model (with a byte tokenizer)."""
    out = {}
    for i, family in enumerate(FAMILIES):
        path = tmp_path_factory.mktemp(f"hf-{family}")
        testing.make_hf_model(path, family, seed=i)
        out[family] = path
    return out


@pytest.fixture(scope="session")
def hf_models(hf_model_dirs: dict[str, pathlib.Path]) -> dict:
    """family -> the transformers model loaded back from its directory (float32, eager)."""
    import torch
    import transformers

    return {family: transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
        for family, path in hf_model_dirs.items()}
