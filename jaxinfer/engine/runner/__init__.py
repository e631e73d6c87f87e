"""The runner: the engine's only bridge to the device, and its only part that imports
jax, numpy or the model (an import-linter contract in pyproject.toml says so).

`runner.py` holds the device state and the compiled step per bucket; `inputs.py`
turns a step's chunks into padded numpy arrays. The names the rest of the engine
uses are re-exported here.
"""

from jaxinfer.engine.runner.inputs import (
    STOP_WIDTH,
    Chunk,
    build_metadata,
    next_power_of_two,
    sampling_inputs,
)
from jaxinfer.engine.runner.runner import (
    COMPILE_THREADS,
    Runner,
    Sample,
    compile_count,
    compile_steps_for,
    device_memory_limit,
    enable_compilation_cache,
    input_spec,
    measure_memory_bandwidth,
    min_step_tokens,
    resolve_kv_dtype,
    step_function,
    tree_bytes,
)

__all__ = [
    "COMPILE_THREADS", "STOP_WIDTH", "Chunk", "Runner", "Sample", "build_metadata",
    "compile_count", "compile_steps_for", "device_memory_limit", "enable_compilation_cache",
    "input_spec", "measure_memory_bandwidth", "min_step_tokens", "next_power_of_two",
    "resolve_kv_dtype", "sampling_inputs", "step_function", "tree_bytes",
]
