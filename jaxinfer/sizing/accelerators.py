"""Accelerator presets: GCP TPU slices (`ACCELERATORS`, by gcloud's `--accelerator-type`
names, with libtpu's topology) and GPU machines (`GPUS`), each chip's published peaks,
HBM and interconnect, and the hosts a preset's chips sit on and the network between
them; `find_preset` and `chip_for_device_kind` look them up. Sources and assumptions:
docs/cli.md#plan and docs/cli.md#choosing-a-pp-x-tp-x-dp-layout.
"""

from __future__ import annotations

import dataclasses

GIB = 1 << 30
PLATFORMS = ("tpu", "gpu")
# JAX caps its GPU allocator at 75% of the GPU's memory by default
# (XLA_PYTHON_CLIENT_MEM_FRACTION, docs.jax.dev/en/latest/gpu_memory_allocation.html);
# the engine plans within that limit (README: a 57 GB engine on an 80 GB H100).
JAX_GPU_MEMORY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One chip (a TPU chip or a GPU), as its maker publishes it."""

    generation: str  # "v5e", "v6e", "v5p" (JAX topology prefix); "h100-80gb", "l4"...
    platform: str  # "tpu" or "gpu"
    hbm_bytes: int  # published capacity (L4: GDDR6, not HBM)
    usable_hbm_bytes: int  # what one program may allocate (see the table)
    bf16_flops: float  # peak dense bf16 FLOP/s
    int8_ops: float  # peak dense int8 OP/s
    hbm_bytes_per_s: float
    source: str  # where the figures are published
    # The chip-to-chip links: bidirectional bytes/s of all of one chip's links together,
    # as published, and where; the latency of a collective: a fixed cost plus one per
    # ring step (a ring all-reduce over n chips takes 2(n - 1) steps).
    interconnect_bytes_per_s: float
    interconnect_source: str
    collective_latency_s: float
    hop_latency_s: float
    # The chip's link to its host's memory, bytes/s one direction, as published and
    # where: what the host tier's copies take (kv_offloading_size, sizing/host_tier.py);
    # `host_link_note` says so where the figure is assumed.
    host_link_bytes_per_s: float
    host_link_source: str
    host_link_note: str = ""

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"{self.platform=} must be one of {PLATFORMS}")
        for name in ("hbm_bytes", "usable_hbm_bytes", "bf16_flops", "int8_ops",
                     "hbm_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        if self.host_link_bytes_per_s <= 0:
            raise ValueError(f"{self.host_link_bytes_per_s=} must be > 0")
        if self.interconnect_bytes_per_s <= 0:
            raise ValueError(f"{self.interconnect_bytes_per_s=} must be > 0")
        if self.collective_latency_s < 0 or self.hop_latency_s < 0:
            raise ValueError(f"{self.collective_latency_s=} and {self.hop_latency_s=} must "
                             "be >= 0")

    @property
    def ring_bytes_per_s(self) -> float:
        """What one chip sends at once in a ring collective: one direction of its links,
        half the published bidirectional figure. An assumption, and a bound: on a GPU the
        NVSwitch gives every GPU its links' one-way bandwidth to its ring neighbour; on a
        TPU 2-D slice it assumes XLA's all-reduce keeps all four ICI ports busy (a
        single ring over the slice uses two of them: half this)."""
        return self.interconnect_bytes_per_s / 2


A100_DATASHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                  "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
# NCCL's cost model of a ring all-reduce with its low-latency protocol (LL), the one it
# picks for small messages such as a decode step's activations: 6.6 us, plus 0.6 us a
# step over NVLink and 1.0 us over PCIe (github.com/NVIDIA/nccl src/graph/tuning.cc,
# baseLat and hwLat).
NCCL_RING_LATENCY_S = 6.6e-6
NCCL_SOURCE = "https://github.com/NVIDIA/nccl/blob/master/src/graph/tuning.cc"
# The same model's latency a ring step over the network (hwLat, NET, Ring, LL): 2.7 us.
NCCL_NET_HOP_LATENCY_S = 2.7e-6
# GPU machines' network between hosts: each machine type's maximum total bandwidth, as
# published (cloud.google.com/compute/docs/gpus/gpu-network-bandwidth): A3 High 1,000
# Gbps (GPUDirect-TCPX). An upper bound: it counts the general-purpose NIC too.
GPU_NETWORK_SOURCE = "https://cloud.google.com/compute/docs/gpus/gpu-network-bandwidth"
# TPU collectives run inside the compiled program (no launch); no latency is published.
# Assumed: no fixed cost and 1 us a ring step, the ICI link latency ASTRA-sim's TPU
# validation used ("as per TPU research team"; astra-sim.github.io, TPU-v3 validation).
TPU_HOP_LATENCY_S = 1e-6
# A GPU's host link is PCIe x16: NVIDIA's datasheets give it both ways together (H100
# and H200 SXM "PCIe Gen5: 128GB/s", A100 "PCIe Gen4: 64GB/s", L4 "PCIe Gen4 x16
# 64GB/s"); one direction is half.
H100_DATASHEET = ("https://resources.nvidia.com/en-us-tensor-core/"
                  "nvidia-tensor-core-gpu-datasheet")
PCIE_GEN5_X16 = 64e9
PCIE_GEN4_X16 = 32e9
# Google publishes no chip-to-host figure for v5e, v6e or v5p (their pages give HBM and
# ICI only): assumed PCIe Gen4 x16, 32 GB/s each way, an assumption the report names.
TPU_HOST_LINK_NOTE = ("not published for TPUs: assumed PCIe Gen4 x16, 32 GB/s each way "
                      "(16 GT/s x 16 lanes)")


def _gpu(generation: str, gib: int, bytes_per_s: float, bf16: float, int8: float,
         source: str, link_bytes_per_s: float, link_source: str,
         host_link: tuple[float, str], hop_latency_s: float = 0.6e-6) -> Chip:
    return Chip(generation=generation, platform="gpu", hbm_bytes=gib * GIB,
                usable_hbm_bytes=int(gib * GIB * JAX_GPU_MEMORY_FRACTION), bf16_flops=bf16,
                int8_ops=int8, hbm_bytes_per_s=bytes_per_s, source=source,
                interconnect_bytes_per_s=link_bytes_per_s, interconnect_source=link_source,
                collective_latency_s=NCCL_RING_LATENCY_S, hop_latency_s=hop_latency_s,
                host_link_bytes_per_s=host_link[0], host_link_source=host_link[1])


def _tpu(generation: str, ici_bytes_per_s: float, **figures: object) -> Chip:
    url = f"https://cloud.google.com/tpu/docs/{generation}"
    return Chip(generation=generation, platform="tpu", source=url,
                interconnect_bytes_per_s=ici_bytes_per_s, interconnect_source=url,
                collective_latency_s=0.0, hop_latency_s=TPU_HOP_LATENCY_S,
                host_link_bytes_per_s=PCIE_GEN4_X16, host_link_source=url,
                host_link_note=TPU_HOST_LINK_NOTE, **figures)


CHIPS = {
    # cloud.google.com/tpu/docs/v5e: 16 GB HBM2, 819 GB/s, 197 TFLOP/s bf16, 394 TOPS int8;
    # ICI: 400 GB/s bidirectional a chip over 4 ports.
    "v5e": _tpu("v5e", 400e9, hbm_bytes=16 * GIB, usable_hbm_bytes=int(15.75 * GIB),
                bf16_flops=197e12, int8_ops=394e12, hbm_bytes_per_s=819e9),
    # cloud.google.com/tpu/docs/v6e: 32 GB, 1640 GB/s, 918 TFLOP/s bf16, 1836 TOPS int8;
    # ICI: 800 GB/s bidirectional a chip over 4 ports (an earlier version of the page
    # gave 3,584 Gbps).
    "v6e": _tpu("v6e", 800e9, hbm_bytes=32 * GIB, usable_hbm_bytes=int(31.25 * GIB),
                bf16_flops=918e12, int8_ops=1836e12, hbm_bytes_per_s=1640e9),
    # cloud.google.com/tpu/docs/v5p: "95 GB", 2765 GB/s, 459 TFLOP/s bf16, 918 TOPS int8;
    # ICI: 1,200 GB/s bidirectional a chip (3-D torus, 6 ports).
    # The HBM is 96 GiB (six 16 GiB stacks): libtpu lets a program use 95.74 GiB of it.
    "v5p": _tpu("v5p", 1200e9, hbm_bytes=96 * GIB, usable_hbm_bytes=int(95.74 * GIB),
                bf16_flops=459e12, int8_ops=918e12, hbm_bytes_per_s=2765e9),
    # H100 SXM5 80GB (A3 High): 3.35 TB/s HBM3; 989 TFLOP/s bf16 and 1,979 TOPS int8
    # dense (the datasheet's 1,979 / 3,958 are with 2:4 sparsity); NVLink 900 GB/s.
    "h100-80gb": _gpu("h100-80gb", 80, 3.35e12, 989e12, 1979e12,
                      "https://www.nvidia.com/en-us/data-center/h100/", 900e9,
                      "https://www.nvidia.com/en-us/data-center/h100/",
                      (PCIE_GEN5_X16, H100_DATASHEET)),
    # A100 SXM4 40GB (A2 Standard): 1,555 GB/s HBM2; 312 TFLOP/s bf16 and 624 TOPS int8
    # dense (624 / 1,248 with sparsity); NVLink 600 GB/s.
    "a100-40gb": _gpu("a100-40gb", 40, 1.555e12, 312e12, 624e12, A100_DATASHEET, 600e9,
                      A100_DATASHEET, (PCIE_GEN4_X16, A100_DATASHEET)),
    # A100 SXM4 80GB (A2 Ultra): 2,039 GB/s HBM2e; the same peaks and NVLink as the 40GB.
    "a100-80gb": _gpu("a100-80gb", 80, 2.039e12, 312e12, 624e12, A100_DATASHEET, 600e9,
                      A100_DATASHEET, (PCIE_GEN4_X16, A100_DATASHEET)),
    # L4 (G2): 24 GB GDDR6 at 300 GB/s; 121 TFLOP/s bf16 and 242.5 TOPS int8 dense
    # (242 / 485 with sparsity). No NVLink: PCIe Gen4 x16, 64 GB/s.
    "l4": _gpu("l4", 24, 300e9, 121e12, 242.5e12, "https://www.nvidia.com/en-us/data-center/l4/",
               64e9, "https://www.nvidia.com/en-us/data-center/l4/",
               (PCIE_GEN4_X16, "https://www.nvidia.com/en-us/data-center/l4/"),
               hop_latency_s=1.0e-6),
    # H200 SXM: 141 GB HBM3e at 4.8 TB/s; the H100's tensor cores, 989 TFLOP/s bf16 and
    # 1,979 TOPS int8 dense (1,979 / 3,958 with sparsity); NVLink 900 GB/s. Counted in
    # GiB as the others.
    "h200": _gpu("h200", 141, 4.8e12, 989e12, 1979e12,
                 "https://www.nvidia.com/en-us/data-center/h200/", 900e9,
                 "https://www.nvidia.com/en-us/data-center/h200/",
                 (PCIE_GEN5_X16, "https://www.nvidia.com/en-us/data-center/h200/")),
}
# JAX's `device_kind` -> chip. Exact names only: a part of another form factor (H100
# PCIe or NVL, A100 PCIe) has other peaks and is left to the measured fallback.
DEVICE_KINDS = {
    "TPU v5 lite": "v5e", "TPU v5e": "v5e", "TPU v6 lite": "v6e", "TPU v6e": "v6e",
    "TPU v5": "v5p", "TPU v5p": "v5p",
    "NVIDIA H100 80GB HBM3": "h100-80gb", "NVIDIA H200": "h200",
    "NVIDIA A100-SXM4-80GB": "a100-80gb", "NVIDIA A100-SXM4-40GB": "a100-40gb",
    "NVIDIA L4": "l4",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accelerator:
    """A preset: `chips` chips (TPU chips or GPUs) of one kind. TPU slices carry the
    topology libtpu compiles for; GPU machines the GCP machine type."""

    name: str
    chip: Chip
    chips: int
    topology: str | None = None  # TPU: for jax.experimental.topologies.get_topology_desc
    chips_per_host: tuple[int, int, int] | None = None  # given to libtpu for 1-chip slices
    machine_type: str | None = None  # GPU: the GCP machine type (a3-highgpu-8g)
    list_price_per_hour: float | None = None  # USD, the whole preset; None: not known
    list_price_note: str = ""  # where and when the list price was read
    # The hosts: chips on each (a VM, one JAX process; None: all on one), and for GPU
    # machines of several hosts the network between them: what one host's NICs send at
    # once, one direction, as published. A TPU slice's hosts need none: ICI joins every
    # chip of a slice, across hosts too (the data-center network only joins slices).
    host_chips: int | None = None
    network_bytes_per_s: float | None = None
    network_source: str = ""

    def __post_init__(self) -> None:
        if self.chips < 1:
            raise ValueError(f"{self.chips=} must be >= 1")
        if self.host_chips is not None and (self.host_chips < 1
                                            or self.chips % self.host_chips):
            raise ValueError(f"{self.host_chips=} must divide the {self.chips} chips")
        if self.hosts > 1 and self.chip.platform == "gpu" and not (
                self.network_bytes_per_s and self.network_source):
            raise ValueError(f"{self.network_bytes_per_s=} must be > 0, with its source, "
                             f"for {self.hosts} GPU hosts")
        if (self.topology is None) != (self.chip.platform == "gpu"):
            raise ValueError(f"{self.topology=} must be given for TPU slices only")
        if self.list_price_per_hour is not None and not self.list_price_note:
            raise ValueError(f"{self.list_price_note=} must say where and when the list "
                             "price was read")

    @property
    def hbm_bytes(self) -> int:
        return self.chips * self.chip.hbm_bytes

    @property
    def hosts(self) -> int:
        return self.chips // (self.host_chips or self.chips)


def _slices() -> dict[str, Accelerator]:
    shapes = {"v5e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4"},
              "v6e": {1: "1x1", 4: "2x2", 8: "2x4"}, "v5p": {4: "2x2x1", 8: "2x2x2"}}
    table = {}
    for generation, sizes in shapes.items():
        for chips, shape in sizes.items():
            count = 2 * chips if generation == "v5p" else chips  # v5p names count cores
            name = f"{generation}-{count}"
            table[name] = Accelerator(
                name=name, chip=CHIPS[generation], chips=chips, topology=f"{generation}:{shape}",
                chips_per_host=(1, 1, 1) if chips == 1 else None,
                host_chips=_tpu_host_chips(generation, chips))
    return table


def _tpu_host_chips(generation: str, chips: int) -> int:
    """Chips on each VM (host) of a TPU slice: cloud.google.com/tpu/docs/v5e ("Each TPU VM
    in a v5e TPU slice contains 1, 4 or 8 chips": up to 8 on one host, multi-host slices
    of 4-chip VMs, as deploy/tpu_slice.py runs them: 4 workers for v5litepod-16), v6e
    alike; cloud.google.com/tpu/docs/v5p: 4 chips a host (v5p-16 is 2 hosts)."""
    return min(chips, 4) if generation == "v5p" or chips > 8 else chips


# GCP's GPU machine types, cloud.google.com/compute/docs/accelerator-optimized-machines:
# A3 High a3-highgpu-{1,2,4,8}g (H100 80GB), A2 Standard a2-highgpu-{1,2,4,8}g and
# a2-megagpu-16g (A100 40GB), A2 Ultra a2-ultragpu-{1,2,4,8}g (A100 80GB), G2
# g2-standard-{4,24,48,96} (1, 2, 4, 8 L4s; other G2 shapes add vCPUs, not GPUs).
GPU_MACHINES = {
    "h100": ("h100-80gb", {n: f"a3-highgpu-{n}g" for n in (1, 2, 4, 8)}),
    "a100-40gb": ("a100-40gb", {n: f"a2-highgpu-{n}g" for n in (1, 2, 4, 8)}
                  | {16: "a2-megagpu-16g"}),
    "a100-80gb": ("a100-80gb", {n: f"a2-ultragpu-{n}g" for n in (1, 2, 4, 8)}),
    "l4": ("l4", {1: "g2-standard-4", 2: "g2-standard-24", 4: "g2-standard-48",
                  8: "g2-standard-96"}),
}


# GPU presets of several machines: name -> (chip, machine type, machines, network bytes/s
# a machine, one direction). h100-16: two a3-highgpu-8g, 1,000 Gbps each.
MULTI_HOST_GPUS = {"h100-16": ("h100-80gb", "a3-highgpu-8g", 2, 1000e9 / 8)}


def _gpu_machines() -> dict[str, Accelerator]:
    table = {}
    for prefix, (chip, machines) in GPU_MACHINES.items():
        for count, machine_type in machines.items():
            name = f"{prefix}-{count}"
            table[name] = Accelerator(name=name, chip=CHIPS[chip], chips=count,
                                      machine_type=machine_type)
    for name, (chip, machine_type, hosts, network) in MULTI_HOST_GPUS.items():
        per_host = int(name.rsplit("-", 1)[1]) // hosts
        table[name] = Accelerator(name=name, chip=CHIPS[chip], chips=hosts * per_host,
                                  machine_type=f"{hosts}x {machine_type}", host_chips=per_host,
                                  network_bytes_per_s=network,
                                  network_source=GPU_NETWORK_SOURCE)
    return table


ACCELERATORS = _slices()
GPUS = _gpu_machines()
PRESETS = ACCELERATORS | GPUS
ALIASES = ({f"v5litepod-{n}": f"v5e-{n}" for n in (1, 4, 8, 16)}
           | {acc.machine_type: name for name, acc in GPUS.items()})


def get(name: str) -> Accelerator:
    """The TPU slice called `name` (a GCP accelerator type), for `aot`; ValueError naming
    the choices, or saying that a GPU preset is not a TPU."""
    key = ALIASES.get(name, name)
    if key in GPUS:
        raise ValueError(f"device={name!r} is a GPU machine ({GPUS[key].machine_type}); aot "
                         f"compiles for TPU only: one of {sorted(ACCELERATORS)}")
    if key not in ACCELERATORS:
        choices = sorted(ACCELERATORS) + sorted(n for n in ALIASES if n.startswith("v5lite"))
        raise ValueError(f"device={name!r} is not a known TPU accelerator type; one of "
                         f"{choices}")
    return ACCELERATORS[key]


def find_preset(name: str) -> Accelerator:
    """The TPU slice or GPU machine called `name` (or its GCP machine type); ValueError
    naming the choices."""
    key = ALIASES.get(name, name)
    if key not in PRESETS:
        machine_types = sorted(acc.machine_type for acc in GPUS.values())
        raise ValueError(f"device={name!r} is not a known accelerator preset; one of "
                         f"{sorted(PRESETS)}, or a GPU machine type: {machine_types}")
    return PRESETS[key]


def chip_for_device_kind(device_kind: str) -> Chip | None:
    """The chip a JAX device is (`jax.Device.device_kind`), or None when it is none of
    these presets (CPU, another accelerator, another form factor)."""
    name = DEVICE_KINDS.get(device_kind.strip())
    return None if name is None else CHIPS[name]


def describe(acc: Accelerator) -> dict[str, object]:
    """The preset as plain JSON-ready data (per-device figures, one device = one chip)."""
    chip = acc.chip
    return {"name": acc.name, "platform": chip.platform, "machine_type": acc.machine_type,
            "topology": acc.topology, "chip": chip.generation, "devices": acc.chips,
            "device_hbm_bytes": chip.hbm_bytes,
            "device_usable_hbm_bytes": chip.usable_hbm_bytes,
            "device_hbm_bytes_per_s": chip.hbm_bytes_per_s,
            "device_peak_bf16_flops": chip.bf16_flops, "device_peak_int8_ops": chip.int8_ops,
            "list_price_per_hour": acc.list_price_per_hour,
            "list_price_note": acc.list_price_note or None, "source": chip.source,
            "device_interconnect_bytes_per_s": chip.interconnect_bytes_per_s,
            "device_ring_bytes_per_s": chip.ring_bytes_per_s,
            "collective_latency_s": chip.collective_latency_s,
            "hop_latency_s": chip.hop_latency_s,
            "interconnect_source": chip.interconnect_source,
            "device_host_link_bytes_per_s": chip.host_link_bytes_per_s,
            "hosts": acc.hosts, "host_chips": acc.host_chips or acc.chips,
            "network_bytes_per_s": acc.network_bytes_per_s,
            "network_source": acc.network_source or None}
