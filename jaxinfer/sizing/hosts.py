"""Where a layout's collectives run: the host of each device of a DP x PP x TP layout (the
mesh's ("data", "stage", "model") rows over JAX's global device order, a host's chips
consecutive: model/sharding.py `layout_mesh`), whether a TP group or a stage hand-off
crosses hosts, and the link it then takes (`Link`): the chips' own (ICI, NVLink) within a
host and between a TPU slice's hosts, the hosts' network between GPU machines. See
docs/cli.md#choosing-a-pp-x-tp-x-dp-layout.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.sizing.accelerators import NCCL_NET_HOP_LATENCY_S, Accelerator, Chip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Link:
    """What a chip's collectives get over a link: the bytes it sends at once, one
    direction (as Chip.ring_bytes_per_s), a fixed latency a collective and one a step."""

    name: str
    ring_bytes_per_s: float
    collective_latency_s: float
    hop_latency_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """DP replicas of PP stages of TP devices on a preset's chips."""

    dp: int
    pp: int
    tp: int


def chip_link(chip: Chip) -> Link:
    """The chips' own links: ICI on a TPU, NVLink (PCIe on an L4) inside a GPU machine."""
    return Link(name="ICI" if chip.platform == "tpu" else "GPU links",
                ring_bytes_per_s=chip.ring_bytes_per_s,
                collective_latency_s=chip.collective_latency_s,
                hop_latency_s=chip.hop_latency_s)


def host_link(acc: Accelerator) -> Link:
    """The link between two of the preset's hosts: a TPU slice's ICI (it joins every chip
    of the slice), else each GPU's share of its machine's network (NCCL's latencies:
    its fixed cost, 2.7 us a step over the network)."""
    if acc.network_bytes_per_s is None:
        return chip_link(acc.chip)
    return Link(name="network", ring_bytes_per_s=acc.network_bytes_per_s / acc.host_chips,
                collective_latency_s=acc.chip.collective_latency_s,
                hop_latency_s=NCCL_NET_HOP_LATENCY_S)


def host(acc: Accelerator, layout: Layout, replica: int, stage: int, rank: int) -> int:
    """The host of device (replica, stage, rank in the TP group)."""
    device = (replica * layout.pp + stage) * layout.tp + rank
    return device // (acc.host_chips or acc.chips)


def tp_crosses_hosts(acc: Accelerator, layout: Layout) -> bool:
    """Whether some TP group (a stage of a replica) spans more than one host."""
    return any(len({host(acc, layout, r, s, k) for k in range(layout.tp)}) > 1
               for r in range(layout.dp) for s in range(layout.pp))


def pair_crosses_hosts(acc: Accelerator, layout: Layout, sender: int, receiver: int
                       ) -> bool:
    """Whether stage `sender` hands a device's rows to a peer of stage `receiver` (same
    rank) on another host, in some replica."""
    return any(host(acc, layout, r, sender, k) != host(acc, layout, r, receiver, k)
               for r in range(layout.dp) for k in range(layout.tp))


def boundaries_crossing_hosts(acc: Accelerator, layout: Layout) -> int:
    """Of a replica's pp - 1 stage boundaries, those some hand-off crosses hosts at."""
    return sum(pair_crosses_hosts(acc, layout, s, s + 1) for s in range(layout.pp - 1))


def pair_link(acc: Accelerator, layout: Layout, sender: int, receiver: int) -> Link:
    """The link a stage-to-stage hand-off takes."""
    if pair_crosses_hosts(acc, layout, sender, receiver):
        return host_link(acc)
    return chip_link(acc.chip)


def tp_link(acc: Accelerator, layout: Layout) -> Link:
    """The link a TP group's all-reduces take: the host link when a group spans hosts
    (its slowest part), else the chips' own."""
    return host_link(acc) if tp_crosses_hosts(acc, layout) else chip_link(acc.chip)
