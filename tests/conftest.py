"""Shared fixtures: tiny random HF checkpoints per family, built once per session."""

from __future__ import annotations

import atexit
import importlib.util
import os
import pathlib
import shutil
import tempfile

import jax
import pytest

from jaxinfer import testing

# Eight virtual CPU devices for the tensor-parallel tests (set before JAX starts its
# backend; single-device code runs on device 0 as before).
jax.config.update("jax_num_cpu_devices", 8)
# One persistent compilation cache for the run, empty at its start (unless the caller
# names one): most tests build the same few models with the same buckets, so each
# program is compiled once and then loaded, here and in the servers started as
# subprocesses (they inherit the variable). docs/architecture.md, "Tests".
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxinfer-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

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
