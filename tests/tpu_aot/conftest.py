"""Ahead-of-time TPU compiles: run in `.venv-tpu` (jax[tpu], libtpu), never with a TPU.

`make test-tpu-aot` runs `pytest tests/tpu_aot --confcutdir=tests/tpu_aot` there, so
the CPU suite's conftest (transformers, torch) is not loaded, and the CPU suite never
collects this folder (tests/conftest.py ignores it where libtpu is absent). JAX keeps
the CPU as its platform; libtpu's compiler is reached through topology descriptions.
"""

from __future__ import annotations

import pytest

from jaxinfer import aot

aot.tpu_compile_environment()

GENERATIONS = {"v5e": "v5e-1", "v5p": "v5p-8", "v6e": "v6e-1"}


@pytest.fixture(scope="session")
def chips():
    """generation -> one abstract chip of that generation."""
    from jaxinfer.sizing import accelerators

    return {gen: aot.target_devices(accelerators.get(name))[0]
            for gen, name in GENERATIONS.items()}
