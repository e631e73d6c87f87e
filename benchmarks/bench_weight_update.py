"""Weight-sync time for RL rollouts: `LLM.update_weights` on the demo model (or
`--model`), from a params pytree already on the devices, from HF-named numpy arrays
(read from the checkpoint's safetensors) and from the same as jax.Arrays sharded over
every device along their first axis (a trainer's FSDP layout: fused and resharded on
device). Prints one JSON line: per input,
the median seconds over `--repeats` (each waited for) and the bytes sent from host.
See docs/rl.md#updating-weights and docs/benchmarks.md#weight-updates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors.numpy import load_file

from jaxinfer import LLM, testing


def timed(llm: LLM, weights: object, repeats: int) -> dict:
    seconds, report = [], {}
    for _ in range(repeats):
        start = time.perf_counter()
        report = llm.update_weights(weights)
        jax.block_until_ready(llm.engine.runner.params)
        seconds.append(time.perf_counter() - start)
    return {"seconds": round(statistics.median(seconds), 4),
            "bytes_from_host": report["bytes_from_host"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a model directory (demo model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default=None,
                        help="a random model of this preset's shape instead of --model")
    parser.add_argument("--tensor_parallel_size", type=int, default=1)
    parser.add_argument("--cpu_devices", type=int, default=0,
                        help="this many virtual CPU devices (set before JAX starts)")
    args = parser.parse_args()
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.preset:
            model = str(testing.make_random_model(tmp, args.preset, dtype=args.dtype,
                                                  max_position_embeddings=1024))
        run(model, args)


def run(model: str | os.PathLike | None, args: argparse.Namespace) -> None:
    settings = dict(dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    if args.preset:
        settings |= dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64)
    llm = LLM(model, **settings) if model else LLM(**settings)
    runner = llm.engine.runner
    tensors = {}
    for path in sorted(llm.engine.model_dir.glob("*.safetensors")):
        tensors |= load_file(str(path))
    copy = jax.tree.map(lambda x: x + 0, runner.params)  # a trainer's fresh arrays
    print(json.dumps({
        "model": f"random {args.preset} shape" if args.preset else str(llm.engine.model_dir),
        "dtype": args.dtype, "tensor_parallel_size": args.tensor_parallel_size,
        "weight_bytes": runner.weight_bytes, "devices": len(jax.devices()),
        "pytree_on_device": timed(llm, copy, args.repeats),
        "hf_numpy": timed(llm, tensors, args.repeats),
        "hf_on_device": timed(llm, fsdp_sharded(tensors), args.repeats)}))


def fsdp_sharded(tensors: dict) -> dict:
    """`tensors` put on every device, each split along its first axis the device count
    divides (else replicated): a trainer's FSDP layout, not the engine's."""
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("fsdp",))
    out = {}
    for name, value in tensors.items():
        axes = [a for a in range(value.ndim) if value.shape[a] % len(devices) == 0]
        spec = [None] * value.ndim
        if axes:
            spec[axes[0]] = "fsdp"
        out[name] = jax.device_put(value, NamedSharding(mesh, PartitionSpec(*spec)))
    return jax.block_until_ready(out)


if __name__ == "__main__":
    main()
