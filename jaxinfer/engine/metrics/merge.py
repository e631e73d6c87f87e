"""The metrics of data-parallel replicas (`ReplicaMetrics`): totals under one engine's
summary keys (counts and RATES summed, other means weighted, KEPT from replica 0, MFU
and the hit rate recomputed, latency histograms added) and each replica's own summary
under "replicas". Plain Python. See docs/parallelism.md#data-parallelism ("Metrics").
"""

from __future__ import annotations

from jaxinfer.engine.metrics.latency import Histogram, Latency
from jaxinfer.engine.metrics.summary import Metrics

# kept from replica 0: flags, per-device figures, labels
KEPT = ("async_scheduling", "memory_bandwidth_gb_per_s", "peak_flops_source", "bound",
        "expert_layers")
# means weighted by busy seconds; other floats by steps; MFU and the hit rate recomputed
BY_BUSY = ("roofline_fraction",)
RATES = ("prompt_tokens_per_s", "generated_tokens_per_s", "bytes_read_per_s_gb",
         "achieved_tflops", "peak_tflops", "mean_pages_in_use", "warmup_seconds",
         "grammar_mask_seconds", "kv_offload_copy_seconds")
LATENCY_FIELDS = ("queue", "ttft", "itl", "e2e")


class ReplicaMetrics:
    """The face of `Metrics` the API and server read, over several replicas' Metrics."""

    def __init__(self, replicas: list[Metrics]) -> None:
        self.replicas = replicas

    @property
    def latency(self) -> Latency:
        """The replicas' histograms added together (a copy)."""
        return merge_latency([m.latency for m in self.replicas])

    def summary(self) -> dict[str, object]:
        total = merge_summaries([m.summary() for m in self.replicas],
                                [m.prefix_cache() if m.prefix_cache else None
                                 for m in self.replicas])
        return total | self.latency.summary()


def merge_latency(latencies: list[Latency]) -> Latency:
    merged = Latency()
    for latency in latencies:
        for name in LATENCY_FIELDS:
            _add(getattr(merged, name), getattr(latency, name))
        for reason, count in latency.finished.items():
            merged.finished[reason] = merged.finished.get(reason, 0) + count
    return merged


def _add(into: Histogram, other: Histogram) -> None:
    into.counts = [a + b for a, b in zip(into.counts, other.counts, strict=True)]
    into.sum += other.sum
    into.count += other.count


def merge_summaries(summaries: list[dict], prefix_stats: list[dict | None]
                    ) -> dict[str, object]:
    """Totals over the replicas' summaries (docs/parallelism.md#data-parallelism)."""
    steps = [s["steps"] for s in summaries]
    busy = [s["step_seconds"] for s in summaries]
    total = {}
    for key, first in summaries[0].items():
        values = [s[key] for s in summaries]
        if key in KEPT or isinstance(first, str):
            total[key] = first
        elif key in RATES:
            total[key] = round(sum(values), 6)
        elif isinstance(first, float):
            total[key] = _weighted(values, busy if key in BY_BUSY else steps)
        elif isinstance(first, int):
            total[key] = sum(values)
        else:  # lists of counts (per draft position, per layer and expert)
            total[key] = _add_lists(values)
    total["step_seconds"] = round(max(busy), 3)  # the replicas run at once
    if "mfu" in total and total["peak_tflops"]:
        total["mfu"] = round(total["achieved_tflops"] / total["peak_tflops"], 4)
    if prefix_stats[0] is not None:
        looked_up = sum(stats["prompt_tokens"] for stats in prefix_stats)
        total["prefix_cache_hit_rate"] = round(
            total["prefix_cache_hit_tokens"] / max(looked_up, 1), 4)
    return total | {"data_parallel_size": len(summaries), "replicas": summaries}


def _weighted(values: list[float], weights: list[float]) -> float:
    weight = sum(weights)
    if not weight:
        return values[0]
    return round(sum(v * w for v, w in zip(values, weights, strict=True)) / weight, 4)


def _add_lists(values: list) -> object:
    if not isinstance(values[0], list):
        return values[0]
    return [_add_lists(list(column)) if isinstance(column[0], list) else sum(column)
            for column in zip(*values, strict=True)]
