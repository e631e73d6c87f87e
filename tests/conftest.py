"""Shared fixtures: tiny random HF checkpoints per family, built once per session."""

from __future__ import annotations

import gc
import importlib.util
import os
import pathlib

import jax
import pytest

from jaxinfer import testing

# Eight virtual CPU devices for the tensor-parallel tests (set before JAX starts its
# backend; single-device code runs on device 0 as before).
jax.config.update("jax_num_cpu_devices", 8)
# One persistent compilation cache, kept between runs (unless the caller names another
# directory): the tests build the same few tiny models with the same buckets run after
# run, so a warm cache turns most compiles into loads, here and in the servers started
# as subprocesses (they inherit the variable). JAX keys entries by program, options and
# versions, so a stale entry is never used.
# docs/testing.md#time.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.expanduser("~/.cache/jaxinfer/xla-tests"))
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

FAMILIES = tuple(testing.FAMILIES)


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """After each test module, JAX's caches of compiled programs are cleared. Each
    XLA:CPU executable maps its machine code in a few memory regions while it lives,
    and the whole suite in one process kept enough of them to pass the kernel's limit
    of 65,530 mappings (vm.max_map_count): the process then died in an mmap. See
    docs/testing.md#one-process."""
    yield
    gc.collect()
    jax.clear_caches()

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
