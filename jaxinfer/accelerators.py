"""TPU slices by their GCP accelerator type: topology, chips, and per-chip peaks.

One table, `ACCELERATORS`, maps the names `gcloud` takes for `--accelerator-type`
(`v5litepod-4`, `v6e-8`, `v5p-8`; `v5e-4` is accepted for `v5litepod-4`) to the JAX
topology name that libtpu's ahead-of-time compiler takes (`v5e:2x2`), the number of
chips, and each chip's HBM, peak bf16 / int8 throughput and HBM bandwidth as Google
publishes them (cloud.google.com/tpu/docs/v5e, /v6e, /v5p), and the HBM a program may
use as libtpu 0.0.42.1's compiler reports it (15.75 / 31.25 / 95.74 GiB). The `aot` command, and the
tensor-parallel presets after it, read only this table. A v5p-N counts TensorCores
(two per chip), so v5p-8 is 4 chips; v5e and v6e count chips. Standard library only.
"""

from __future__ import annotations

import dataclasses

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One TPU generation's chip, as published."""

    generation: str  # JAX topology prefix: "v5e", "v6e", "v5p"
    hbm_bytes: int  # published capacity
    usable_hbm_bytes: int  # what libtpu's compiler lets a program use (its OOM message)
    bf16_flops: float  # peak dense bf16 FLOP/s
    int8_ops: float  # peak int8 OP/s
    hbm_bytes_per_s: float


CHIPS = {
    "v5e": Chip(generation="v5e", hbm_bytes=16 * GIB, usable_hbm_bytes=int(15.75 * GIB),
                bf16_flops=197e12, int8_ops=394e12,
                hbm_bytes_per_s=819e9),
    "v6e": Chip(generation="v6e", hbm_bytes=32 * GIB, usable_hbm_bytes=int(31.25 * GIB),
                bf16_flops=918e12, int8_ops=1836e12,
                hbm_bytes_per_s=1640e9),
    "v5p": Chip(generation="v5p", hbm_bytes=95 * GIB, usable_hbm_bytes=int(95.74 * GIB),
                bf16_flops=459e12, int8_ops=918e12,
                hbm_bytes_per_s=2765e9),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accelerator:
    """A slice: `chips` chips of one generation in the topology `topology`."""

    name: str
    chip: Chip
    chips: int
    topology: str  # for jax.experimental.topologies.get_topology_desc
    chips_per_host: tuple[int, int, int] | None = None  # given to libtpu for 1-chip slices

    @property
    def hbm_bytes(self) -> int:
        return self.chips * self.chip.hbm_bytes


def _slices() -> dict[str, Accelerator]:
    shapes = {"v5e": {1: "1x1", 4: "2x2", 8: "2x4"}, "v6e": {1: "1x1", 4: "2x2", 8: "2x4"},
              "v5p": {4: "2x2x1", 8: "2x2x2"}}
    table = {}
    for generation, sizes in shapes.items():
        for chips, shape in sizes.items():
            count = 2 * chips if generation == "v5p" else chips  # v5p names count cores
            name = f"{generation}-{count}"
            table[name] = Accelerator(
                name=name, chip=CHIPS[generation], chips=chips, topology=f"{generation}:{shape}",
                chips_per_host=(1, 1, 1) if chips == 1 else None)
    return table


ACCELERATORS = _slices()
ALIASES = {f"v5litepod-{n}": f"v5e-{n}" for n in (1, 4, 8)}


def get(name: str) -> Accelerator:
    """The slice called `name` (a GCP accelerator type); ValueError naming the choices."""
    key = ALIASES.get(name, name)
    if key not in ACCELERATORS:
        choices = sorted(ACCELERATORS) + sorted(ALIASES)
        raise ValueError(f"device={name!r} is not a known TPU accelerator type; one of "
                         f"{choices}")
    return ACCELERATORS[key]
