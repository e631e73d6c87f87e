"""Engine counters (`Metrics`), model FLOPs per token (`FlopCount`), and the summary
`llm.metrics()` reports: token counts as vLLM counts them, the host loop's figures, the
roofline fraction, MFU and `bound`. Plain Python. See docs/serving.md (#metrics,
#token-counts-and-the-host-loop, #roofline-fraction-and-mfu).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from jaxinfer.engine.metrics.latency import Latency


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlopCount:
    """What a token costs in model FLOPs, the whole model (all devices together), and the
    peak it is measured against. A chunk's tokens each multiply every weight matrix
    (k of the E experts of a MoE layer); the LM head runs only at the positions whose
    logits are sampled (prompt-logprob scoring's other rows are not counted); each layer
    attends a token's position + 1 tokens, at most its window."""

    matmul_per_token: int  # 2 x the layers' matrices a token multiplies (LM head apart)
    head_per_sample: int  # 2 x hidden x vocab: the LM head at one sampled position
    attention_per_position: int  # 4 x heads x head_dim: one layer, one attended token
    windows: tuple[tuple[int | None, int], ...]  # (window or None: all, layers with it)
    peak_flops_per_s: float  # the mesh's: one device's peak x devices
    peak_source: str  # "preset:<chip>" or "measured"
    devices: int = 1  # in the mesh
    chip_bytes_per_s: float | None = None  # a known chip's published bandwidth, one device

    def chunk(self, start: int, num_tokens: int, num_samples: int) -> int:
        """FLOPs of `num_tokens` new tokens at positions start.., `num_samples` sampled."""
        attended = sum(layers * attended_positions(start, num_tokens, window)
                       for window, layers in self.windows)
        return (num_tokens * self.matmul_per_token + num_samples * self.head_per_sample
                + attended * self.attention_per_position)


def attended_positions(start: int, num_tokens: int, window: int | None = None) -> int:
    """Tokens that positions start .. start + num_tokens - 1 attend in one layer, summed:
    min(p + 1, window) each."""
    def triangle(n: int) -> int:
        return n * (n + 1) // 2

    end = start + num_tokens
    if window is None:
        return triangle(end) - triangle(start)
    beyond = max(end - max(start, window), 0)  # positions that see a whole window
    return triangle(min(end, window)) - triangle(min(start, window)) + window * beyond


@dataclasses.dataclass
class Metrics:
    """Accumulated over the engine's life; `summary()` derives the rates."""

    bandwidth_gb_per_s: float = 0.0
    warmup_seconds: float = 0.0
    num_buckets: int = 0
    compiles_at_warmup: int = 0
    warmup_compiled: int = 0  # programs warm-up compiled
    warmup_loaded: int = 0  # programs warm-up loaded from the persistent compilation cache
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed, once per request (no cache hits)
    prompt_tokens_cached: int = 0  # prompt tokens the prefix cache served, once per request
    generated_tokens: int = 0  # tokens appended to the requests' outputs
    padded_tokens: int = 0
    real_tokens: int = 0
    occupied_slots: int = 0
    padded_slots: int = 0
    pages_in_use_total: int = 0
    peak_pages_in_use: int = 0
    preemptions: int = 0
    compiles_after_warmup: int = 0
    step_seconds: float = 0.0
    bytes_read: int = 0
    async_scheduling: bool = False
    host_seconds: float = 0.0  # the host's work per step: schedule, inputs, outputs
    device_idle_seconds: float = 0.0  # the device had no step queued (seen from the host)
    host_to_device_bytes: int = 0  # step inputs sent, admission calls included
    discarded_tokens: int = 0  # positions computed for requests that had stopped
    flop_count: FlopCount | None = None  # None: no MFU
    model_flops: int = 0  # what the steps' real tokens needed (FlopCount)
    prefix_cache: Callable[[], dict[str, int]] | None = None  # the cache's counts, read live
    kv_offload: Callable[[], dict[str, float]] | None = None  # the host tier's, read live
    # speculative decoding's counts given the step seconds (engine/spec_decode/speculation.py)
    speculation: Callable[[float], dict[str, object]] | None = None
    # a mixture of experts' tokens routed per expert, by MoE decoder layer, read live
    expert_tokens: Callable[[], dict[int, list[int]]] | None = None
    # pages in use and free per page group, read live (engine/core/kv_groups.py)
    page_groups: Callable[[], dict[str, dict[str, int]]] | None = None
    # structured outputs: (seconds, steps) the host spent filling token masks, read live
    # (runner/token_masks.py)
    token_masks: Callable[[], tuple[float, int]] | None = None
    latency: Latency = dataclasses.field(default_factory=Latency)  # per-request histograms
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def record_step(self, *, real_tokens: int, padded_tokens: int, requests: int, slots: int,
                    prompt_tokens: int, prompt_tokens_cached: int, generated: int,
                    pages_in_use: int, seconds: float, bytes_read: int) -> None:
        self.steps += 1
        self.real_tokens += real_tokens
        self.padded_tokens += padded_tokens
        self.occupied_slots += requests
        self.padded_slots += slots
        self.prompt_tokens += prompt_tokens
        self.prompt_tokens_cached += prompt_tokens_cached
        self.generated_tokens += generated
        self.pages_in_use_total += pages_in_use
        self.peak_pages_in_use = max(self.peak_pages_in_use, pages_in_use)
        self.step_seconds += seconds
        self.bytes_read += bytes_read

    def record_plan(self, chunks: Sequence, lengths: Sequence[int], padded_tokens: int,
                    slots: int, *, seconds: float, dropped: Sequence[bool], pages_in_use: int,
                    weight_bytes: int, kv_bytes_per_token: int) -> None:
        """Count a step from its chunks (`lengths`: each request's output count before
        the step's tokens were appended; `dropped`: the chunks of requests that had
        stopped before the step was read, their positions discarded): tokens generated
        are those appended (after stops); a request's prompt counts once, at its first
        token, split into the tokens computed and those the prefix cache served."""
        attended = sum(c.start + c.num_tokens for c in chunks)
        generated = computed = cached = discarded = 0
        for chunk, before, drop in zip(chunks, lengths, dropped, strict=True):
            request = chunk.request
            added = len(request.output_token_ids) - before
            generated += max(added, 0)
            if before == 0 and added > 0:
                hits = request.num_cached_tokens or 0
                computed += len(request.prompt_token_ids) - hits
                cached += hits
            if drop:
                discarded += chunk.num_tokens
            elif self.flop_count is not None:
                self.model_flops += self.flop_count.chunk(chunk.start, chunk.num_tokens,
                                                          chunk.num_samples)
        self.discarded_tokens += discarded
        self.record_step(
            real_tokens=sum(c.num_tokens for c in chunks) - discarded,
            padded_tokens=padded_tokens, requests=len(chunks), slots=slots,
            prompt_tokens=computed, prompt_tokens_cached=cached, generated=generated,
            pages_in_use=pages_in_use, seconds=seconds,
            bytes_read=weight_bytes + attended * kv_bytes_per_token)

    def record_host(self, *, seconds: float, bytes_sent: int) -> None:
        self.host_seconds += seconds
        self.host_to_device_bytes += bytes_sent

    def summary(self) -> dict[str, float | int]:
        steps, busy = max(self.steps, 1), max(self.step_seconds, 1e-9)
        achieved = self.bytes_read / busy / 1e9
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_cached": self.prompt_tokens_cached,
            "generated_tokens": self.generated_tokens,
            "computed_tokens": self.real_tokens,
            "prompt_tokens_per_s": round(self.prompt_tokens / busy, 1),
            "generated_tokens_per_s": round(self.generated_tokens / busy, 1),
            "step_seconds": round(self.step_seconds, 3),
            "mean_batch_occupancy": round(self.occupied_slots / max(self.padded_slots, 1), 3),
            "mean_requests_per_step": round(self.occupied_slots / steps, 2),
            "padding_waste": round(1 - self.real_tokens / max(self.padded_tokens, 1), 3),
            "peak_pages_in_use": self.peak_pages_in_use,
            "mean_pages_in_use": round(self.pages_in_use_total / steps, 1),
            "preemptions": self.preemptions,
            "buckets": self.num_buckets,
            "warmup_seconds": round(self.warmup_seconds, 2),
            "warmup_compiled": self.warmup_compiled,
            "warmup_loaded": self.warmup_loaded,
            "compiles_after_warmup": self.compiles_after_warmup,
            "async_scheduling": int(self.async_scheduling),
            "discarded_tokens": self.discarded_tokens,
            "host_to_device_bytes": self.host_to_device_bytes,
            "host_to_device_bytes_per_step": round(
                self.host_to_device_bytes / steps, 1),
            "host_ms_per_step": round(1e3 * self.host_seconds / steps, 3),
            "device_idle_ms_per_step": round(
                1e3 * self.device_idle_seconds / steps, 3),
            **self._grammar_summary(steps),
            "bytes_read_per_s_gb": round(achieved, 2),
            "memory_bandwidth_gb_per_s": round(self.bandwidth_gb_per_s, 2),
            "roofline_fraction": round(achieved / self.bandwidth_gb_per_s, 3)
            if self.bandwidth_gb_per_s else 0.0,
            **self._flops_summary(busy),
            **self.latency.summary(),
            **self._prefix_cache_summary(),
            **{f"kv_pages_{group}_{key}": value for group, counts in (
                self.page_groups() if self.page_groups else {}).items()
               for key, value in counts.items() if key != "pages"},
            **self._expert_summary(),
            **(self.speculation(self.step_seconds) if self.speculation else {}),
        }

    def _grammar_summary(self, steps: int) -> dict[str, float | int]:
        """Structured outputs: steps that sent a token mask and the host's time filling
        masks, per step (all steps) and per constrained step."""
        seconds, masked = self.token_masks() if self.token_masks else (0.0, 0)
        return {"constrained_steps": masked, "grammar_mask_seconds": round(seconds, 4),
                "grammar_mask_ms_per_step": round(1e3 * seconds / steps, 3),
                "grammar_mask_ms_per_constrained_step": round(
                    1e3 * seconds / max(masked, 1), 3)}

    def _flops_summary(self, busy: float) -> dict[str, object]:
        """Model FLOPs, their rate, the mesh's peak and MFU; `bound`: the longer of the
        ideal memory time (bytes / bandwidth) and compute time (FLOPs / peak), at a known
        chip's published bandwidth, else the probed one."""
        count = self.flop_count
        if count is None:
            return {}
        achieved = self.model_flops / busy
        out = {"model_flops": self.model_flops,
               "achieved_tflops": round(achieved / 1e12, 6),
               "peak_tflops": round(count.peak_flops_per_s / 1e12, 6),
               "peak_flops_source": count.peak_source,
               "mfu": round(achieved / count.peak_flops_per_s, 4)}
        bandwidth = count.chip_bytes_per_s or self.bandwidth_gb_per_s * 1e9
        if bandwidth:  # bytes_read is the mesh's: both times at one device's rates
            memory_s = self.bytes_read / bandwidth
            compute_s = self.model_flops * count.devices / count.peak_flops_per_s
            out["bound"] = "memory" if memory_s >= compute_s else "compute"
        return out

    def _expert_summary(self) -> dict[str, object]:
        """Tokens routed to each expert, per MoE layer (padding not counted), and the
        load imbalance: the busiest expert's count over the mean, per layer and the
        largest of them (1.0: even; E / k: every token to the same experts)."""
        if self.expert_tokens is None:
            return {}
        by_layer = self.expert_tokens()
        counts = list(by_layer.values())
        per_layer = [round(max(row) * len(row) / sum(row), 3) if sum(row) else 1.0
                     for row in counts]
        return {"expert_tokens": counts, "expert_layers": list(by_layer),
                "expert_load_imbalance_per_layer": per_layer,
                "expert_load_imbalance": max(per_layer, default=1.0)}

    def _prefix_cache_summary(self) -> dict[str, float | int]:
        """Hit rate in prompt tokens; misses split by cause (nothing shared, or a shared
        run shorter than one page); evictions; pages cached now."""
        if self.prefix_cache is None:
            return {}
        stats = self.prefix_cache()
        looked_up = max(stats["prompt_tokens"], 1)
        return {"prefix_cache_hit_rate": round(stats["hit_tokens"] / looked_up, 4),
                "prefix_cache_hit_tokens": stats["hit_tokens"],
                "prefix_cache_miss_tokens_no_shared_prefix":
                    stats["miss_tokens_no_shared_prefix"],
                "prefix_cache_miss_tokens_shared_below_page":
                    stats["miss_tokens_shared_below_page"],
                "prefix_cache_evictions": stats["evictions"],
                "prefix_cache_pages": stats["cached_pages"],
                **self._kv_offload_summary(stats)}

    def _kv_offload_summary(self, stats: dict[str, int]) -> dict[str, float | int]:
        """The host tier (kv_offloading_size): hits from it, what moved each way, the
        host time the copies took (docs/kv_cache.md#the-host-tier)."""
        if self.kv_offload is None:
            return {}
        tier = self.kv_offload()
        return {"prefix_cache_host_hit_tokens": stats["host_hit_tokens"],
                **{f"kv_offload_{key}": value for key, value in tier.items()},
                "kv_offload_copy_ms_per_step": round(
                    1000 * tier["copy_seconds"] / max(self.steps, 1), 3)}
