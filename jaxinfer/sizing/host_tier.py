"""The host tier in a memory plan (`kv_offloading_size`, engine/runner/kv_offload.py):
the pages its GiB hold, counted as the runner counts them, the tokens and max_model_len
contexts that is, and how long copying one context back takes over the chips' host
links. Plain Python. See docs/kv_cache.md#sizing-the-host-tier.
"""

from __future__ import annotations

from jaxinfer.config import offload
from jaxinfer.sizing.accelerators import Chip
from jaxinfer.sizing.memory_plan import MemoryPlan

GIB = 1 << 30


def replica_page_bytes(plan: MemoryPlan) -> int:
    """One page of every layer on all devices of a replica (kv_offload.page_bytes of
    the runner's cache): a device's K/V of page_size tokens, tensor_parallel_size times
    (each device keeps its own KV heads' shard of a page)."""
    return plan.page_size * plan.kv_bytes_per_token * plan.tensor_parallel_size


def host_pages(size_gib: float, page_bytes: int) -> int:
    """Pages `size_gib` GiB hold, as Runner.enable_host_tier counts them."""
    return int(size_gib * 2**30 // page_bytes)


def report(plan: MemoryPlan, size_gib: float, chip: Chip | None = None) -> dict[str, object]:
    """plan's `host_tier` section, per replica: pages, bytes, tokens, full contexts and,
    given the `chip`, its host link and the time to restore one max_model_len context
    (each device copies its shard over its own link). ValueError as the engine refuses
    a tier that holds no page or a model of several page groups."""
    offload.check_page_groups(size_gib, len(plan.page_groups))
    page_bytes = replica_page_bytes(plan)
    pages = host_pages(size_gib, page_bytes)
    if pages < 1:
        raise ValueError(f"kv_offloading_size={size_gib} GiB holds no KV page "
                         f"({page_bytes} bytes a page, every layer)")
    out: dict[str, object] = {
        "kv_offloading_size_gib": size_gib, "host_pages": pages,
        "host_page_bytes": page_bytes, "host_bytes": pages * page_bytes,
        "host_tokens": pages * plan.page_size,
        "host_full_contexts": pages // plan.pages_per_request,
        "replicas": plan.replicas}
    if chip is None:
        return out
    restore_s = restore_seconds(plan, chip.host_link_bytes_per_s)
    return out | {"device_host_link_bytes_per_s": chip.host_link_bytes_per_s,
                  "host_link_source": chip.host_link_source,
                  "host_link_note": chip.host_link_note or None,
                  "restore_full_context_ms": round(restore_s * 1e3, 3)}


def restore_seconds(plan: MemoryPlan, link_bytes_per_s: float) -> float:
    """Seconds to copy one max_model_len context's pages back at `link_bytes_per_s` a
    device: each device moves its own shard of them at once (a bound: no latency, the
    link's full rate)."""
    return plan.pages_per_request * plan.page_size * plan.kv_bytes_per_token / link_bytes_per_s
