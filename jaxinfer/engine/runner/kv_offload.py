"""The host tier's device half (`HostCopies`): the pages a step's plan offloads are
gathered from every layer of the KV cache in one program and kept in host memory, one
numpy array per layer and device (each device's own shard of a page); the pages it
restores go back in one donated scatter program, before the step. Copies batch per step
on a ladder of page counts compiled at warm-up. The host half decides which pages move
(engine/core/host_tier.py). See docs/kv_cache.md#the-host-tier.
"""

from __future__ import annotations

import dataclasses
import time
import typing

import jax
import numpy as np

from jaxinfer.engine.core.host_tier import Transfer, phases

MAX_RUNG = 256  # the largest copy batch; more pages go in several


def memory_kind_for(device: jax.Device) -> str | None:
    """"pinned_host" where the platform stages copies in pinned host memory (TPU, GPU);
    None on CPU, whose device memory is host memory already."""
    kinds = {str(m.kind) for m in device.addressable_memories()}
    return "pinned_host" if device.platform != "cpu" and "pinned_host" in kinds else None


def rungs(num_slots: int) -> list[int]:
    """The copy batch sizes: powers of two up to the tier's size or MAX_RUNG."""
    sizes, size = [], 1
    while size < min(num_slots, MAX_RUNG):
        sizes.append(size)
        size *= 2
    return sizes + [size]


def page_bytes(kv_cache: object, page_size: int) -> int:
    """Bytes of one page in every leaf of `kv_cache` (all devices together)."""
    return sum(int(np.prod(_page_view(x, page_size))) * x.dtype.itemsize
               for x in jax.tree.leaves(kv_cache))


@dataclasses.dataclass
class CopyStats:
    """What the copies moved and the host time they took (dispatch, and waits)."""

    pages_to_host: int = 0
    pages_to_device: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    copy_seconds: float = 0.0
    copy_batches: int = 0

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self) | {"copy_seconds": round(self.copy_seconds, 4)}


class CopyPrograms:
    """The two jitted copies over a KV cache laid out as `kv_cache` (arrays, or
    ShapeDtypeStructs with shardings to compile ahead of time; model/attention.py:
    layers of [P, ...] pages, quantized ones with [P, ...] scales, the feature store
    [P * page_size, F], all page-major): `gather(kv_cache, pages)` -> each leaf's pages,
    split as the leaf is, in `memory_kind`; `scatter(kv_cache, rows, pages)` -> the
    cache (donated) with them written back."""

    def __init__(self, kv_cache: object, page_size: int, memory_kind: str | None) -> None:
        leaves, self.treedef = jax.tree.flatten(kv_cache)
        self.views = [_page_view(x, page_size) for x in leaves]
        self.shardings = [_batch_sharding(x, memory_kind) for x in leaves]
        self.gather = jax.jit(self._gather_fn, out_shardings=self.shardings)
        kv_shardings = jax.tree.map(lambda x: x.sharding, kv_cache)
        self.scatter = jax.jit(self._scatter_fn, donate_argnums=(0,),
                               in_shardings=(kv_shardings, self.shardings, None),
                               out_shardings=kv_shardings)

    def _gather_fn(self, kv_cache: object, pages: jax.Array) -> list[jax.Array]:
        leaves = jax.tree.leaves(kv_cache)
        return [x.reshape(-1, *view)[pages] for x, view in zip(leaves, self.views,
                                                                  strict=True)]

    def _scatter_fn(self, kv_cache: object, rows: list[jax.Array], pages: jax.Array
                    ) -> object:
        leaves = jax.tree.leaves(kv_cache)
        out = []
        for x, r, view, s in zip(leaves, rows, self.views, self.shardings, strict=True):
            if s.memory_kind:  # staged in host memory: moved to the device in here
                r = jax.device_put(r, s.with_memory_kind("device"))
            out.append(x.reshape(-1, *view).at[pages].set(r).reshape(x.shape))
        return jax.tree.unflatten(self.treedef, out)

    def row_specs(self, kv_cache: object, count: int) -> list[jax.ShapeDtypeStruct]:
        """The gathered rows of `count` pages, as ShapeDtypeStructs (for `scatter`)."""
        return [jax.ShapeDtypeStruct((count, *view), x.dtype, sharding=s)
                for x, view, s in zip(jax.tree.leaves(kv_cache), self.views,
                                      self.shardings, strict=True)]


class HostCopies:
    """`num_slots` host pages of a KV cache laid out as `kv_cache` (CopyPrograms)."""

    def __init__(self, kv_cache: object, *, num_slots: int, page_size: int,
                 memory_kind: str | None = None) -> None:
        leaves = jax.tree.leaves(kv_cache)
        self.num_slots, self.page_size = num_slots, page_size
        self.rungs = rungs(num_slots)
        self.programs = CopyPrograms(kv_cache, page_size, memory_kind)
        self._gather, self._scatter = self.programs.gather, self.programs.scatter
        self._shardings = self.programs.shardings
        self._devices = [sorted(s.addressable_devices, key=lambda d: d.id)
                         for s in self._shardings]
        self.store = [[np.zeros((num_slots, *s.shard_shape((1, *view))[1:]), x.dtype)
                       for _ in devices]
                      for x, view, s, devices in zip(leaves, self.programs.views,
                                                     self._shardings, self._devices,
                                                     strict=True)]
        self.page_bytes = page_bytes(kv_cache, page_size)
        self._pending: list[tuple[np.ndarray, list[jax.Array]]] = []  # (slots, pages)
        self.stats = CopyStats()

    def warm_up(self, kv_cache: object) -> object:
        """Compile both programs for every rung (gathering and writing back page 0, the
        trash page); returns the cache."""
        for size in self.rungs:
            pages = np.zeros(size, np.int32)
            rows = self._gather(kv_cache, pages)
            kv_cache = self._scatter(kv_cache, rows, pages)
        return kv_cache

    # ---- a step's copies --------------------------------------------------------------

    def run(self, kv_cache: object, transfers: typing.Sequence[Transfer]) -> object:
        """Make the step's copies in queue order (offloads, then restores, per phase);
        returns the cache with the restored pages written."""
        began = time.perf_counter()
        for offloads, restores in phases(transfers):
            for batch in _batches(offloads, self.rungs[-1]):
                self._offload(kv_cache, batch)
            if restores:  # waits only for a gather whose pages a restore reads
                self.flush(wait=True, slots={t.slot for t in restores})
            for batch in _batches(restores, self.rungs[-1]):
                kv_cache = self._restore(kv_cache, batch)
        self.stats.copy_seconds += time.perf_counter() - began
        return kv_cache

    def _offload(self, kv_cache: object, batch: list[Transfer]) -> None:
        size = self._rung(len(batch))
        pages = np.zeros(size, np.int32)
        pages[:len(batch)] = [t.page for t in batch]
        slots = np.array([t.slot for t in batch], np.int64)
        self._pending.append((slots, self._gather(kv_cache, pages)))
        self.stats.pages_to_host += len(batch)
        self.stats.bytes_to_host += len(batch) * self.page_bytes
        self.stats.copy_batches += 1

    def _restore(self, kv_cache: object, batch: list[Transfer]) -> object:
        size = self._rung(len(batch))
        pages = np.zeros(size, np.int32)  # padding rows write the trash page
        pages[:len(batch)] = [t.page for t in batch]
        slots = np.zeros(size, np.int64)
        slots[:len(batch)] = [t.slot for t in batch]
        rows = [self._to_device(store, slots, sharding, devices)
                for store, sharding, devices in zip(self.store, self._shardings,
                                                    self._devices, strict=True)]
        self.stats.pages_to_device += len(batch)
        self.stats.bytes_to_device += len(batch) * self.page_bytes
        self.stats.copy_batches += 1
        return self._scatter(kv_cache, rows, pages)

    def _to_device(self, store: list[np.ndarray], slots: np.ndarray,
                   sharding: jax.sharding.NamedSharding, devices: list) -> jax.Array:
        shards = [jax.device_put(rows[slots], _memory(sharding, device))
                  for rows, device in zip(store, devices, strict=True)]
        shape = _global_shape(sharding, (len(slots), *store[0].shape[1:]))
        return jax.make_array_from_single_device_arrays(shape, sharding, shards)

    def flush(self, wait: bool = False, slots: typing.Collection[int] | None = None
              ) -> None:
        """Move gathered pages into the host store, oldest first (a slot may be written
        twice): the batches whose gather has finished; with `wait`, every batch up to
        the last that writes one of `slots` (default: all), waiting for them."""
        began = time.perf_counter()
        count = 0
        if wait:
            for index, (written, _) in enumerate(self._pending):
                if slots is None or not set(slots).isdisjoint(written.tolist()):
                    count = index + 1
        else:
            while count < len(self._pending) and all(
                    p.is_ready() for p in self._pending[count][1]):
                count += 1
        for written, pages in self._pending[:count]:
            for store, batch, devices in zip(self.store, pages, self._devices, strict=True):
                by_device = {s.device: s.data for s in batch.addressable_shards}
                for rows, device in zip(store, devices, strict=True):
                    rows[written] = np.asarray(by_device[device])[:len(written)]
        self._pending = self._pending[count:]
        self.stats.copy_seconds += time.perf_counter() - began

    def read(self, slot: int) -> list[list[np.ndarray]]:
        """Slot `slot` as stored: per leaf, per device (tests compare pages with it)."""
        self.flush(wait=True)
        return [[rows[slot].copy() for rows in store] for store in self.store]

    def _rung(self, count: int) -> int:
        return next(size for size in self.rungs if size >= count)


def _page_view(x: jax.Array, page_size: int) -> tuple[int, ...]:
    """One page's shape in leaf `x`: its trailing dims, or (page_size, F) for the
    feature store, kept by KV slot."""
    return (page_size, *x.shape[1:]) if x.ndim == 2 else tuple(x.shape[1:])


def _batch_sharding(x: jax.Array, memory_kind: str | None) -> jax.sharding.NamedSharding:
    """A batch of `x`'s pages is split as `x` is (by KV head), in `memory_kind`."""
    spec = x.sharding.spec
    if x.ndim == 2:
        spec = jax.sharding.PartitionSpec(None, None, *spec[1:])
    sharding = jax.sharding.NamedSharding(x.sharding.mesh, spec)
    return sharding.with_memory_kind(memory_kind) if memory_kind else sharding


def _memory(sharding: jax.sharding.NamedSharding, device: jax.Device) -> object:
    kind = sharding.memory_kind
    single = jax.sharding.SingleDeviceSharding(device)
    return single.with_memory_kind(kind) if kind and kind != "device" else single


def _global_shape(sharding: jax.sharding.NamedSharding, shard: tuple[int, ...]
                  ) -> tuple[int, ...]:
    """The whole batch's shape from one device's shard of it."""
    mesh, spec = sharding.mesh, sharding.spec
    shape = list(shard)
    for axis, names in enumerate(spec):
        for name in (names,) if isinstance(names, str) else names or ():
            shape[axis] *= mesh.shape[name]
    return tuple(shape)


def _batches(transfers: list[Transfer], size: int) -> list[list[Transfer]]:
    return [transfers[i:i + size] for i in range(0, len(transfers), size)]


