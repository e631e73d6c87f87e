"""Sleep and wake of a runner's device memory (vLLM's `sleep`/`wake_up`): the KV cache
and batch state are freed and made again by the runner's own jitted inits (same shapes,
same shardings, so the compiled steps run on as they were); the params go to host
memory (level 1) or are dropped (level 2). `live_device_bytes` is JAX's own count of
what lives on a set of devices. See docs/rl.md#sleeping-and-waking.
"""

from __future__ import annotations

import gc
import logging
import typing

import jax

from jaxinfer.engine.runner.slots import SlotTable

log = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")  # vLLM's names for what wake_up(tags=...) brings back


def live_device_bytes(devices: typing.Iterable[jax.Device]) -> int:
    """Bytes of every live jax array's shards on `devices` (JAX's accounting: arrays
    deleted or garbage collected are gone from it), the engine's and any other's."""
    devices = set(devices)
    gc.collect()  # arrays in reference cycles are unreachable yet still counted until then
    buffers = {}  # (device, address) -> bytes: views of one buffer (a shard's) count once
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if shard.device in devices and shard.data.nbytes:
                buffers[shard.device, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    return sum(buffers.values())


def memory_stats(devices: typing.Iterable[jax.Device]) -> dict[str, int] | None:
    """The allocator's `bytes_in_use` summed over `devices`, where the backend reports
    it (None on CPU, whose `memory_stats()` is None)."""
    stats = [device.memory_stats() for device in devices]
    if any(s is None for s in stats):
        return None
    return {"bytes_in_use": sum(int(s.get("bytes_in_use", 0)) for s in stats),
            "peak_bytes_in_use": sum(int(s.get("peak_bytes_in_use", 0)) for s in stats)}


def _delete(tree: object) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


class Sleeper:
    """What one runner keeps while asleep, and the steps in and out of sleep. `level`:
    0 awake, else the level it sleeps at; `asleep`: the tags not woken yet. Asleep,
    `runner.params` is a tree of `jax.ShapeDtypeStruct`s (shape, dtype, sharding):
    the weight update path (weights.py) places new leaves by them, and a leaf that is
    an array again at wake time was given back."""

    def __init__(self, runner: typing.Any) -> None:
        self.runner = runner
        self.level = 0
        self.asleep: set[str] = set()
        self._host_params: dict | None = None  # leaf path -> its host copy (sleep)
        self._param_specs: object | None = None  # their shapes, dtypes and shardings

    @property
    def devices(self) -> set[jax.Device]:
        return set(self.runner.mesh.devices.flat)

    def sleep(self, level: int) -> None:
        """Free the KV cache and batch state; level 1 copies the params to host memory
        first, level 2 drops them but for the LoRA adapter slots (copied: they are the
        adapters loaded, which no weight update brings back)."""
        runner = self.runner
        jax.block_until_ready((runner.params, runner.kv_cache, runner.state))
        self._param_specs = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            runner.params)
        self._host_params = {  # leaf path -> host copy
            path: leaf for path, leaf in _paths(jax.device_get(runner.params)).items()
            if level == 1 or path.startswith("['lora']")}
        _delete(runner.params)
        _delete(runner.kv_cache)
        _delete(runner.state)
        _delete(runner.masks.drop_ones())
        runner.params, runner.kv_cache, runner.state = self._param_specs, None, None
        self.level, self.asleep = level, set(TAGS)

    def set_params(self, params: object) -> None:
        """Weights given back while asleep (level 2 drops them), the whole tree: placed
        now, as the step shards them; shapes and dtypes must match the ones slept
        with. They replace a level-1 sleep's host copy."""
        if self.level == 0:
            raise RuntimeError("set_params is for a sleeping runner; awake, use "
                               "update_weights")
        check_like(params, self._param_specs)
        self.runner.params = jax.device_put(params, jax.tree.map(
            lambda s: s.sharding, self._param_specs))
        self._host_params = None
        self.asleep.discard("weights")

    def wake_up(self, tags: typing.Sequence[str] | None = None) -> None:
        """Bring back `tags` (None: all): "weights" (each leaf given back while asleep
        kept, the others from host memory at level 1); "kv_cache" (with the batch
        state) from the runner's jitted inits, empty."""
        tags = set(TAGS if tags is None else tags)
        if unknown := tags - set(TAGS):
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; the tags are "
                             f"{list(TAGS)}")
        if "weights" in tags & self.asleep:
            self._wake_weights()
        if "kv_cache" in tags & self.asleep:
            runner = self.runner
            runner.kv_cache = runner.init_kv_cache()
            runner.state = runner.init_state()
            runner.slots = SlotTable(runner.slots.num_slots, page_size=runner.page_size,
                                     eos_token_ids=runner.eos_token_ids,
                                     num_groups=len(runner.group_windows))
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.level, self._param_specs = 0, None

    def _wake_weights(self) -> None:
        """The params' leaves still specs, from the host copy; RuntimeError when there
        is none (level 2) and some were not given back."""
        paths = list(_paths(self.runner.params))
        leaves, treedef = jax.tree.flatten(self.runner.params)
        missing = [i for i, leaf in enumerate(leaves) if not isinstance(leaf, jax.Array)]
        host = self._host_params or {}
        if any(paths[i] not in host for i in missing):
            raise RuntimeError(
                f"the weights were dropped by sleep(level=2) and {len(missing)} of "
                f"{len(leaves)} params leaves are not back: give new ones while asleep "
                "(update_weights(...), or engine.sleeper.set_params(params) with the "
                "tree the engine serves), then wake_up()")
        if missing:
            placed = jax.device_put([host[paths[i]] for i in missing],
                                    [leaves[i].sharding for i in missing])
            for index, leaf in zip(missing, placed, strict=True):
                leaves[index] = leaf
        self.runner.params = jax.tree.unflatten(treedef, leaves)
        self._host_params = None
        self.asleep.discard("weights")


def check_like(params: object, specs: object) -> None:
    """ValueError naming the first leaf whose path, shape or dtype differs."""
    got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    want = dict(jax.tree_util.tree_flatten_with_path(specs)[0])
    if got.keys() != want.keys():
        missing = sorted(map(jax.tree_util.keystr, want.keys() - got.keys()))
        extra = sorted(map(jax.tree_util.keystr, got.keys() - want.keys()))
        raise ValueError(f"params differ in their leaves: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    for path, spec in want.items():
        leaf = got[path]
        if tuple(leaf.shape) != tuple(spec.shape) or leaf.dtype != spec.dtype:
            raise ValueError(f"params{jax.tree_util.keystr(path)}: {leaf.dtype}"
                             f"{list(leaf.shape)}, the engine serves {spec.dtype}"
                             f"{list(spec.shape)}")


def _paths(tree: object) -> dict[str, object]:
    """A pytree's leaves by their key path (jax.tree_util.keystr), in tree order."""
    return {jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
