"""What the host tier of the prefix cache (`kv_offloading_size`) runs with, checked on
the engine's settings alone; the model's own check (one page group) is made at load.
See docs/kv_cache.md#the-host-tier.
"""

from __future__ import annotations

from typing import Any


def check_settings(config: Any) -> None:
    """ValueError naming the field unless `config` (an EngineConfig) can keep evicted
    pages in host memory as it asks."""
    size = config.kv_offloading_size
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, int | float) or not size > 0:
        raise ValueError(f"kv_offloading_size={size!r} must be a number of GiB > 0, or "
                         "None (off)")
    if config.kv_offloading_backend != "native":
        raise ValueError(f"kv_offloading_backend={config.kv_offloading_backend!r}: only "
                         "'native' (jaxinfer's host tier) is available")
    refused = {
        "enable_prefix_caching": (not config.enable_prefix_caching,
                                  "the host tier keeps the prefix cache's pages"),
        "pipeline_parallel_size": (config.pipeline_parallel_size > 1,
                                   "pages stored by pipeline stage are not offloaded"),
        "runner": (config.runner == "pooling", "a pooling model keeps no prefix cache"),
        "speculative_config": (
            config.speculative_config is not None
            and config.speculative_config.method != "ngram",
            "a draft model's or heads' own KV pages are not offloaded; n-gram works"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"kv_offloading_size={size} with {name}="
                             f"{getattr(config, name)!r}: not supported ({why})")


def check_page_groups(size: float | None, num_groups: int) -> None:
    """ValueError unless the model keeps one KV page group (every layer every page)."""
    if size is not None and num_groups > 1:
        raise ValueError(f"kv_offloading_size={size} with a model of sliding-window and "
                         "full-attention layers: offloading keeps one page group; set "
                         "disable_hybrid_kv_cache_manager=True")
