"""The runner's LoRA adapter slots (`DeviceAdapters`): an adapter's host copy (read by
the loader's reader, lora/peft.py) laid out as a slot holds it (`padded`) and written
into one device slot of `params["lora"]` by one program compiled at load, so loading an
adapter never compiles a step. See docs/lora.md#slots.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.model import lora as lora_lib
from jaxinfer.model import sharding

HostAdapter = dict  # layer index -> {target: (a f32[in, r], b f32[r, out])}


class DeviceAdapters:
    """Writes adapters for the model `cfg` (the checkpoint's, before KV heads are
    copied) into `runner`'s slots; `read(lora_request)` makes their host copies."""

    def __init__(self, runner: object, cfg: ModelConfig,
                 read: Callable[[object], HostAdapter]) -> None:
        self.runner, self.cfg, self.read = runner, cfg, read
        self.slots = runner.options.lora
        specs = lora_lib.partition_specs(runner.cfg, self.slots)
        self._write = jax.jit(lora_lib.write, out_shardings=sharding.named(runner.mesh, specs))
        self.write(0, {})  # compiles the write now (slot 0 stays empty)

    def write(self, slot: int, adapter: HostAdapter) -> None:
        host = padded(adapter, self.cfg, self.runner.cfg, self.slots.max_rank)
        self.runner.params["lora"] = self._write(self.runner.params["lora"],
                                                 np.int32(slot), host)


def padded(adapter: HostAdapter, cfg: ModelConfig, served: ModelConfig, max_rank: int
           ) -> list[dict]:
    """The host copy as one device slot holds it (model/lora.py `write`): every layer
    and target, zeros where the adapter has none, ranks padded to `max_rank`, and K/V
    columns copied as `served` copies KV heads (tensor parallelism over more devices
    than KV heads)."""
    replicas = served.num_kv_heads // cfg.num_kv_heads
    out = []
    for index in range(cfg.num_layers):
        layer = {}
        for target in lora_lib.layer_targets(cfg, index):
            fan_in, fan_out = lora_lib.target_dims(served, target)
            a = np.zeros((fan_in, max_rank), np.float32)
            b = np.zeros((max_rank, fan_out), np.float32)
            if target in adapter.get(index, {}):
                a_in, b_in = adapter[index][target]
                if target in ("k", "v") and replicas > 1:
                    heads = b_in.reshape(b_in.shape[0], cfg.num_kv_heads, -1)
                    b_in = np.repeat(heads, replicas, axis=1).reshape(b_in.shape[0], -1)
                a[:, :a_in.shape[1]] = a_in
                b[:b_in.shape[0]] = b_in
            layer[target] = {"a": a, "b": b}
        out.append(layer)
    return out
