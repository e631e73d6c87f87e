"""What the engine asks of the device and of JAX's process-wide state, each asked once:
the persistent compilation cache (set by the faces, never an `Engine`), the probed
memory bandwidth, the chip and its peak FLOP/s (published, else measured), device
memory. "The device" is this process's first local one. See
docs/serving.md#roofline-fraction-and-mfu and docs/sampling.md#the-python-api.
"""

from __future__ import annotations

import functools
import pathlib
import time

import jax
import jax.numpy as jnp

from jaxinfer.sizing import accelerators

DEFAULT_CACHE_DIR = pathlib.Path.home() / ".cache" / "jaxinfer" / "xla"


def use_compilation_cache(path: str | None) -> str | None:
    """Point JAX's persistent compilation cache at `path` and cache every entry, however
    fast to compile. None: the directory this process already uses (JAX's own setting,
    JAX_COMPILATION_CACHE_DIR included), else ~/.cache/jaxinfer/xla; "": leave JAX's
    setting alone. Returns the directory in use. Raises ValueError if this process
    already caches in another directory, as JAX keeps the first one it used."""
    if path == "":
        return jax.config.jax_compilation_cache_dir
    current = jax.config.jax_compilation_cache_dir
    wanted = str(pathlib.Path(path or current or DEFAULT_CACHE_DIR).expanduser().resolve())
    if current is not None and str(pathlib.Path(current).expanduser().resolve()) != wanted:
        raise ValueError(f"compilation_cache_dir={wanted!r}: this process already caches "
                         f"compilations in {current!r} (JAX's cache is one per process)")
    jax.config.update("jax_compilation_cache_dir", wanted)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return wanted


def measure_memory_bandwidth(num_bytes: int = 256 * 1024 * 1024, repeats: int = 5) -> float:
    """GB/s of a jitted float32 sum over `num_bytes`: the device's read bandwidth."""
    data = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(data).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        total(data).block_until_ready()
        times.append(time.perf_counter() - start)
    return num_bytes / sorted(times)[len(times) // 2] / 1e9


def memory_bandwidth(device: jax.Device | None = None) -> float:
    """The default (or given) device's read bandwidth in GB/s, probed once per process."""
    return _bandwidth_of(device or jax.local_devices()[0])


@functools.cache
def _bandwidth_of(device: jax.Device) -> float:
    with jax.default_device(device):
        return measure_memory_bandwidth()


def probe_count() -> int:
    """How many bandwidth probes `memory_bandwidth` ran in this process."""
    return _bandwidth_of.cache_info().misses


def measure_matmul_rate(dtype: str = "bfloat16", size: int = 1024, repeats: int = 5
                        ) -> float:
    """FLOP/s of a jitted square matmul of `dtype` operands (2 size^3 FLOPs), accumulated
    in float32, int32 for integers, as the model's matmuls: the best of `repeats`."""
    operand = jnp.dtype(dtype)
    accumulate = jnp.int32 if jnp.issubdtype(operand, jnp.integer) else jnp.float32
    a = jnp.ones((size, size), operand)
    matmul = jax.jit(lambda x, y: jax.lax.dot(x, y, preferred_element_type=accumulate))
    matmul(a, a).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times)


def peak_flops(dtype: str, device: jax.Device | None = None) -> tuple[float, str]:
    """(FLOP/s, source): the peak of the default (or given) device for matmuls of `dtype`
    operands ("int8": w8a8's int8 x int8 dots, any other: bf16). A known chip
    (`accelerators.chip_for_device_kind`) gives its published dense peak, source
    "preset:<chip>" (float32 weights get the bf16 figure too); any other device (CPU,
    an unknown accelerator) a matmul in `dtype` measured once per process, "measured"."""
    device = device or jax.local_devices()[0]
    chip = device_chip(device)
    if chip is not None:
        peak = chip.int8_ops if jnp.dtype(dtype) == jnp.int8 else chip.bf16_flops
        return peak, f"preset:{chip.generation}"
    return _matmul_rate_of(device, jnp.dtype(dtype).name), "measured"


def device_chip(device: jax.Device | None = None) -> accelerators.Chip | None:
    """The chip the default (or given) device is, by its `device_kind`; None: unknown."""
    return accelerators.chip_for_device_kind((device or jax.local_devices()[0]).device_kind)


@functools.cache
def _matmul_rate_of(device: jax.Device, dtype: str) -> float:
    with jax.default_device(device):
        return measure_matmul_rate(dtype, 1024 if device.platform == "cpu" else 8192)


def flops_probe_count() -> int:
    """How many matmul probes `peak_flops` ran in this process."""
    return _matmul_rate_of.cache_info().misses


def device_memory_limit() -> int | None:
    """Bytes the default device may allocate, when the device reports it (not CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def tree_bytes(tree: object) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))
