"""The runner: the engine's only bridge to the device, and its only part that imports
jax, numpy or the model (an import contract). runner.py holds the device state and the
compiled steps; the other modules are its parts (docs/architecture.md#2-layout lists
them). The names the rest of the engine uses are re-exported here.
"""

from jaxinfer.engine.runner.compiles import CacheLoads, CompileCounter, CompileSpan
from jaxinfer.engine.runner.device import (
    device_chip,
    device_memory_limit,
    flops_probe_count,
    measure_matmul_rate,
    measure_memory_bandwidth,
    memory_bandwidth,
    peak_flops,
    probe_count,
    tree_bytes,
    use_compilation_cache,
)
from jaxinfer.engine.runner.inputs import (
    STOP_WIDTH,
    Chunk,
    build_metadata,
    next_power_of_two,
    sampling_inputs,
)
from jaxinfer.engine.runner.lora import DeviceAdapters
from jaxinfer.engine.runner.memory import Sleeper, live_device_bytes, memory_stats
from jaxinfer.engine.runner.programs import (
    COMPILE_THREADS,
    compile_steps_for,
    input_spec,
    make_mesh,
    min_step_tokens,
    step_function,
)
from jaxinfer.engine.runner.runner import (
    InFlight,
    PromptScores,
    Runner,
    Sample,
    StepResult,
    quantize_at_load,
)

__all__ = [
    "COMPILE_THREADS", "STOP_WIDTH", "CacheLoads", "Chunk", "CompileCounter", "CompileSpan",
    "DeviceAdapters",
    "InFlight", "PromptScores", "Runner", "Sample", "Sleeper", "StepResult", "build_metadata",
    "compile_steps_for",
    "device_chip", "device_memory_limit", "flops_probe_count", "input_spec", "quantize_at_load",
    "live_device_bytes", "make_mesh", "measure_matmul_rate", "memory_stats",
    "measure_memory_bandwidth", "memory_bandwidth",
    "min_step_tokens", "next_power_of_two", "peak_flops",
    "probe_count", "sampling_inputs", "step_function", "tree_bytes", "use_compilation_cache",
]
