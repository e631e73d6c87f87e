"""GET /metrics: the engine's counters in Prometheus text format, under vLLM's names with
a `jaxinfer:` prefix and vLLM's labels (`model_name`; `engine` per data-parallel
replica), built from a `snapshot` the engine thread takes between steps. See
docs/serving.md#metrics and docs/parallelism.md#data-parallelism.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxinfer.engine.engine import Engine
from jaxinfer.engine.metrics.latency import Histogram

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "jaxinfer:"


def snapshot(engine: Engine) -> dict[str, Any]:
    """A copy of the counters and gauges (call on the engine thread); with data-parallel
    replicas, each replica's under "replicas"."""
    if hasattr(engine, "replicas"):
        return {"replicas": [snapshot(replica) for replica in engine.replicas]}
    metrics, scheduler = engine.metrics, engine.scheduler
    pool = scheduler.pool
    return {"summary": metrics.summary(), "latency": copy.deepcopy(metrics.latency),
            "running": len(scheduler.running), "waiting": len(scheduler.waiting),
            "pages_in_use": pool.num_used, "pages": pool.num_pages - 1,
            "page_groups": scheduler.pages.usage(),
            "steps": metrics.steps, "scheduled": metrics.occupied_slots,
            "prefix_cache": metrics.prefix_cache() if metrics.prefix_cache else None}


def exposition(snap: dict[str, Any], model_name: str, extra: Iterable[Metric] = ()) -> bytes:
    """The engine's families, then `extra` (the server's own: server/http_metrics.py)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snap, model_name, extra=extra))
    return generate_latest(registry)


def pooling_exposition(snap: dict[str, int], model_name: str) -> bytes:
    """A pooling model's few figures (server/pooling_loop.py `snapshot`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(snap, model_name, _pooling_families))
    return generate_latest(registry)


def _pooling_families(snap: dict[str, int]) -> Iterator[Metric]:
    yield _gauge("num_requests_running", "inputs being pooled", snap["running"])
    yield _gauge("num_requests_waiting", "inputs queued for the next batch", snap["waiting"])
    yield _counter("pooling_requests", "pooling requests answered", snap["requests"])
    yield _counter("pooling_requests_failed", "pooling requests that failed in the engine",
                   snap["failed_requests"])
    yield _counter("pooling_inputs", "inputs pooled", snap["inputs"])
    yield _counter("prompt_tokens", "input tokens pooled", snap["prompt_tokens"])
    yield _counter("pooling_batches", "engine.pool calls (each batches what was queued)",
                   snap["batches"])


class _Collector:
    def __init__(self, snap: dict[str, Any], model_name: str,
                 families: Callable[[dict[str, Any]], Iterator[Metric]] | None = None,
                 extra: Iterable[Metric] = ()) -> None:
        self.snap = snap
        self.model_name = model_name
        self.families = families or _families
        self.extra = list(extra)

    def collect(self) -> Iterator[Metric]:
        label = {"model_name": self.model_name}
        for family in [*self._unlabelled(), *self.extra]:
            family.samples = [s._replace(labels=label | s.labels) for s in family.samples]
            yield family

    def _unlabelled(self) -> Iterator[Metric]:
        if "replicas" not in self.snap:
            yield from self.families(self.snap)
            return
        merged: dict[str, Metric] = {}
        for index, snap in enumerate(self.snap["replicas"]):
            for family in _families(snap):
                into = merged.setdefault(family.name, family)
                labelled = [sample._replace(labels=sample.labels | {"engine": str(index)})
                            for sample in family.samples]
                if into is family:
                    family.samples = labelled
                else:
                    into.samples.extend(labelled)
        yield from merged.values()


def _families(snap: dict[str, Any]) -> Iterator[Metric]:
    """One engine's families."""
    yield from _gauges(snap)
    yield from _counters(snap)
    latency = snap["latency"]
    yield _histogram("time_to_first_token_seconds", "time to first token", latency.ttft)
    yield _histogram("inter_token_latency_seconds", "time between output tokens",
                     latency.itl)
    yield _histogram("e2e_request_latency_seconds", "request latency, arrival to finish",
                     latency.e2e)
    yield _histogram("request_queue_time_seconds", "arrival to first scheduled step",
                     latency.queue)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def _gauges(snap: dict[str, Any]) -> Iterator[Metric]:
    summary = snap["summary"]
    yield _gauge("num_requests_running", "completions in the running batch", snap["running"])
    yield _gauge("num_requests_waiting", "completions waiting for a slot", snap["waiting"])
    yield _gauge("kv_cache_usage_perc", "fraction of KV pages held by requests (0-1)",
                 snap["pages_in_use"] / max(snap["pages"], 1))
    yield _gauge("kv_cache_pages_in_use", "KV pages held by requests", snap["pages_in_use"])
    yield _gauge("kv_cache_pages", "KV pages requests can hold", snap["pages"])
    for name, group in list(snap["page_groups"].items())[1:]:  # an attention kind's own
        yield _gauge(f"kv_cache_{name}_pages_in_use", f"KV pages of the {name} page group "
                     "held by requests", group["in_use"])  # pages (docs/kv_cache.md)
        yield _gauge(f"kv_cache_{name}_pages", f"KV pages of the {name} page group "
                     "requests can hold", group["pages"])
    yield _gauge("mean_batch_size", "completions per engine step, mean over the life",
                 summary["mean_requests_per_step"])
    yield _gauge("roofline_fraction", "bytes a step must read over its time, as a fraction "
                 "of the measured memory bandwidth (mean over busy time)",
                 summary["roofline_fraction"])
    if "mfu" in summary:
        yield _gauge("model_flops_utilization", "model FLOPs the steps' real tokens need over "
                     "their time, as a fraction of the mesh's peak (mean over busy time)",
                     summary["mfu"])
        peak = GaugeMetricFamily(PREFIX + "peak_flops_per_second", "the mesh's peak FLOP/s "
                                 "that MFU is against, by source (preset:<chip>, measured)",
                                 labels=["source"])
        peak.add_metric([summary["peak_flops_source"]], summary["peak_tflops"] * 1e12)
        yield peak
    if "expert_load_imbalance" in summary:
        yield _gauge("expert_load_imbalance", "the busiest expert's routed tokens over the "
                     "mean, largest over MoE layers", summary["expert_load_imbalance"])
    if snap["prefix_cache"] is not None:
        yield _gauge("prefix_cache_hit_rate", "prompt tokens served by the prefix cache over "
                     "prompt tokens looked up", summary["prefix_cache_hit_rate"])


def _counters(snap: dict[str, Any]) -> Iterator[Metric]:
    summary, latency = snap["summary"], snap["latency"]
    computed, cached = summary["prompt_tokens"], summary["prompt_tokens_cached"]
    yield _counter("prompt_tokens", "prompt tokens of finished prefills (n x prompt length)",
                   computed + cached)
    by_source = CounterMetricFamily(PREFIX + "prompt_tokens_by_source", "prompt tokens by "
                                    "source", labels=["source"])
    by_source.add_metric(["local_compute"], computed)
    by_source.add_metric(["local_cache_hit"], cached)
    yield by_source
    yield _counter("generation_tokens", "tokens generated", summary["generated_tokens"])
    yield _counter("num_preemptions", "requests preempted", summary["preemptions"])
    yield _counter("compilations_after_warmup", "XLA compilations after warm-up",
                   summary["compiles_after_warmup"])
    yield _counter("engine_steps", "device steps run", snap["steps"])
    if "model_flops" in summary:
        yield _counter("model_flops", "model FLOPs of the steps' real tokens (all devices)",
                       summary["model_flops"])
    yield _counter("host_to_device_bytes", "bytes of step inputs sent to the device",
                   summary["host_to_device_bytes"])
    yield _counter("constrained_steps", "steps that sampled a structured-output request "
                   "(sent a token mask)", summary.get("constrained_steps", 0))
    yield _counter("grammar_mask_seconds", "host seconds filling structured outputs' token "
                   "masks", summary.get("grammar_mask_seconds", 0.0))
    if "expert_tokens" in summary:
        routed = CounterMetricFamily(PREFIX + "expert_tokens", "tokens routed to each "
                                     "expert, per MoE decoder layer",
                                     labels=["layer", "expert"])
        for layer, row in zip(summary["expert_layers"], summary["expert_tokens"],
                              strict=True):
            for expert, count in enumerate(row):
                routed.add_metric([str(layer), str(expert)], count)
        yield routed
    yield _counter("scheduled_requests", "completions summed over steps (over engine_steps: "
                   "the mean batch size)", snap["scheduled"])
    success = CounterMetricFamily(PREFIX + "request_success", "finished completions by "
                                  "reason", labels=["finished_reason"])
    for reason in ("stop", "length", "abort"):
        success.add_metric([reason], latency.finished.get(reason, 0))
    yield success
    if snap["prefix_cache"] is not None:
        stats = snap["prefix_cache"]
        yield _counter("prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                       stats["prompt_tokens"])
        yield _counter("prefix_cache_hits", "prompt tokens the prefix cache served",
                       stats["hit_tokens"])
    if "kv_offload_host_pages" in summary:
        yield from _kv_offload(summary)
    if "spec_draft_tokens" in summary:
        yield from _speculation(summary)


def _kv_offload(summary: dict[str, Any]) -> Iterator[Metric]:
    """The prefix cache's host tier (docs/kv_cache.md#the-host-tier)."""
    host = summary["prefix_cache_host_hit_tokens"]
    by_tier = CounterMetricFamily(PREFIX + "prefix_cache_hits_by_tier", "prompt tokens the "
                                  "prefix cache served, by the tier that held them",
                                  labels=["tier"])
    by_tier.add_metric(["device"], summary["prefix_cache_hit_tokens"] - host)
    by_tier.add_metric(["host"], host)
    yield by_tier
    moved = CounterMetricFamily(PREFIX + "kv_offload_bytes", "KV page bytes copied between "
                                "the device pool and the host tier", labels=["direction"])
    moved.add_metric(["to_host"], summary["kv_offload_bytes_to_host"])
    moved.add_metric(["to_device"], summary["kv_offload_bytes_to_device"])
    yield moved
    yield _counter("kv_offload_copy_seconds", "host seconds spent on the host tier's copies",
                   summary["kv_offload_copy_seconds"])
    yield _gauge("kv_offload_host_pages_held", "pages the host tier holds",
                 summary["kv_offload_host_pages_held"])


def _speculation(summary: dict[str, Any]) -> Iterator[Metric]:
    """Speculative decoding, vLLM's `spec_decode_*` counters plus why requests of decode
    steps verified no draft, the acceptance rate and the draft model's time share."""
    yield _counter("spec_decode_num_drafts", "draft runs verified (a request's drafts in "
                   "one step)", summary["spec_num_drafts"])
    yield _counter("spec_decode_num_draft_tokens", "draft tokens verified",
                   summary["spec_draft_tokens"])
    yield _counter("spec_decode_num_accepted_tokens", "draft tokens accepted",
                   summary["spec_accepted_tokens"])
    per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                       "draft tokens accepted at each position",
                                       labels=["position"])
    for position, count in enumerate(summary["spec_accepted_per_position"]):
        per_position.add_metric([str(position)], count)
    yield per_position
    skipped = CounterMetricFamily(PREFIX + "spec_decode_skipped", "requests of a step that "
                                  "verified no draft, by reason", labels=["reason"])
    for key, count in summary.items():
        if key.startswith("spec_skipped_"):
            skipped.add_metric([key.removeprefix("spec_skipped_")], count)
    yield skipped
    yield _gauge("spec_decode_acceptance_rate", "accepted over verified draft tokens",
                 summary["spec_acceptance_rate"])
    yield _gauge("spec_decode_mean_acceptance_length", "tokens a draft run emits, mean",
                 summary["spec_mean_acceptance_length"])
    yield _gauge("spec_decode_draft_time_share", "draft model time over step time",
                 summary["spec_draft_time_share"])


def _histogram(name: str, doc: str, histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(PREFIX + name, doc, unit="")
    family.add_metric([], histogram.cumulative(), sum_value=histogram.sum)
    return family
