"""The memory plan's record (`MemoryPlan`): one engine configuration's bytes and counts
on one device, as `planner.plan()` works them out, and what follows from them: a decode
step's bytes and FLOPs, the decode roofline, the cost per million output tokens, and
`summary()`, what `python -m jaxinfer plan` prints. See docs/cli.md#plan.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.sizing import pipeline_plan
from jaxinfer.sizing.page_groups import PageGroupPlan, hybrid_summary

GB = 1e9
ROOFLINE_BATCHES = (1, 8, 32, 128)  # plus the largest batch that fits


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Bytes and counts of one engine configuration on one device (`summary()` adds GB,
    rates and costs). Every `*_bytes` is per device; at tensor_parallel_size=1 per device
    is the whole model."""

    weight_bytes: int  # on one device
    kv_bytes_per_token: int  # K and V of one token over all layers, on one device
    page_size: int
    page_bytes: int
    num_pages: int  # in the pool, the trash page included
    kv_cache_bytes: int  # num_pages * page_bytes: what the engine allocates
    max_model_len: int
    pages_per_request: int  # at max_model_len
    max_concurrent_requests: int  # at full context, every one at max_model_len
    max_num_seqs: int
    bandwidth_gb_per_s: float | None  # None: unknown, no roofline
    tensor_parallel_size: int = 1
    # Pipeline stages (sizing/pipeline_plan.py): every figure is a device of one stage's,
    # num_pages each stage's pool; microbatches a step runs in (0: one per stage).
    pipeline_parallel_size: int = 1
    pipeline_microbatches: int = 0
    replicas: int = 1  # copies of the (stages x) tensor-parallel group on the devices
    layer_weight_bytes: int | None = None  # the layer slots' share of weight_bytes
    layer_matmul_flops_per_token: int | None = None  # the layer slots' matmul FLOPs
    unsharded_weight_bytes: int | None = None  # the whole model; None: weight_bytes
    matmul_flops_per_token: int = 0  # on one device, decode
    attention_flops_per_context_token: int = 0  # per new token and cached token, one device
    peak_flops_per_s: float | None = None  # None: the roofline counts bytes only
    # Speculative decoding with a draft model: its weights, and its K/V per token in its
    # own cache of num_pages pages (page_bytes and kv_cache_bytes count both caches).
    draft_weight_bytes: int = 0
    draft_kv_bytes_per_token: int = 0
    batch_state_bytes: int = 0  # the per-slot rows kept on the device (batch_state_bytes)
    lora_bytes: int = 0  # LoRA adapter slots (model/lora.py), on one device
    # Mixture of experts: the stacked experts' bytes on one device (within weight_bytes),
    # and the routing that sets how many of them a decode step reads.
    expert_weight_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    total_params: int = 0
    active_params: int = 0  # per token: the dense parameters and k of the E experts
    # The KV page groups (engine/core/kv_groups.py, sizing/page_groups.py), group 0 first:
    # page_bytes and num_pages are group 0's; with one group, every layer's.
    page_groups: tuple[PageGroupPlan, ...] = ()
    unified_num_pages: int = 0  # pages of every layer the bytes hold: one group's

    def step_weight_bytes(self, batch: int) -> float:
        """The weight bytes a decode step of `batch` requests reads on one device: every
        dense weight, and of the experts those some token chose, expected under uniform
        routing: a fraction 1 - (1 - k/E)^batch of them (`expected_distinct_experts`)."""
        if not self.num_experts:
            return self.weight_bytes
        hit = expected_distinct_experts(self.num_experts, self.experts_per_token, batch)
        return self.weight_bytes - self.expert_weight_bytes * (1 - hit / self.num_experts)

    def microbatches(self, batch: int) -> int:
        """Microbatches a decode step of `batch` requests runs in (1 without stages)."""
        return pipeline_plan.microbatches(batch, self.pipeline_parallel_size,
                                          self.pipeline_microbatches)

    def decode_seconds(self, batch: int, context: int) -> tuple[float, float] | None:
        """(memory, compute) seconds of a decode step of `batch` requests at `context`
        tokens each on one device: its bytes over the bandwidth, its FLOPs over the peak
        (0 when the peak is unknown). None when the bandwidth is unknown. Pipelined, a
        device runs its layer slots once a tick, m + pp - 1 ticks of batch / m requests
        (m microbatches, the bubbles' ticks too: model/pipeline.py), reading the slots'
        weights every tick; the embedding and head once a step."""
        if self.bandwidth_gb_per_s is None:
            return None
        m = self.microbatches(batch)
        ticks, micro = m + self.pipeline_parallel_size - 1, batch / m
        layers = self.weight_bytes if self.layer_weight_bytes is None \
            else self.layer_weight_bytes
        layer_flops = self.matmul_flops_per_token if self.layer_matmul_flops_per_token \
            is None else self.layer_matmul_flops_per_token
        tick_weights = layers - (self.weight_bytes - self.step_weight_bytes(micro))
        step_bytes = (ticks * (tick_weights + micro * context * self.kv_bytes_per_token)
                      + self.weight_bytes - layers)
        flops = (ticks * micro * (layer_flops + context * self.attention_flops_per_context_token)
                 + batch * (self.matmul_flops_per_token - layer_flops))
        compute = flops / self.peak_flops_per_s if self.peak_flops_per_s else 0.0
        return step_bytes / (self.bandwidth_gb_per_s * GB), compute

    def decode_roofline(self, batch: int, context: int) -> float | None:
        """Tokens/s bound of every replica decoding `batch` requests at `context` tokens
        each: the slower of the memory and the compute bound (None when the bandwidth
        is unknown)."""
        seconds = self.decode_seconds(batch, context)
        return None if seconds is None else self.replicas * batch / max(seconds)

    def roofline_rows(self, price_per_hour: float | None = None
                      ) -> list[dict[str, object]] | None:
        """The roofline at max_model_len for a few batch sizes (requests per replica), with
        the cost per million output tokens when `price_per_hour` (all devices) is given."""
        if self.bandwidth_gb_per_s is None:
            return None
        if price_per_hour is not None and price_per_hour <= 0:
            raise ValueError(f"{price_per_hour=} must be > 0")
        largest = max(1, min(self.max_num_seqs, self.max_concurrent_requests))
        rows = []
        for batch in sorted({b for b in ROOFLINE_BATCHES if b < largest} | {largest}):
            memory_s, compute_s = self.decode_seconds(batch, self.max_model_len)
            tokens_per_s = round(self.replicas * batch / max(memory_s, compute_s), 1)
            cost = (None if price_per_hour is None else
                    round(cost_per_million_tokens(price_per_hour, tokens_per_s), 4))
            rows.append({"batch": batch, "context": self.max_model_len,
                         "step_ms": round(max(memory_s, compute_s) * 1e3, 3),
                         "bound": "memory" if memory_s >= compute_s else "compute",
                         "tokens_per_s": tokens_per_s,
                         "cost_per_million_output_tokens": cost})
        return rows

    def summary(self, price_per_hour: float | None = None) -> dict[str, object]:
        batch = max(1, min(self.max_num_seqs, self.max_concurrent_requests))

        def rate(batch: int) -> float | None:
            value = self.decode_roofline(batch, self.max_model_len)
            return None if value is None else round(value, 1)

        rows = self.roofline_rows(price_per_hour)
        unsharded = self.unsharded_weight_bytes or self.weight_bytes
        moe = {} if not self.num_experts else {
            "total_params": self.total_params, "active_params": self.active_params,
            "expert_weight_bytes": self.expert_weight_bytes,
            "num_experts": self.num_experts, "experts_per_token": self.experts_per_token,
            "expected_distinct_experts_per_layer": {
                f"batch_{b}": round(expected_distinct_experts(
                    self.num_experts, self.experts_per_token, b), 2) for b in (1, batch)},
            "step_weight_bytes": {f"batch_{b}": round(self.step_weight_bytes(b))
                                  for b in (1, batch)}}
        stages = {} if self.pipeline_parallel_size == 1 else {
            "pipeline_microbatches": self.microbatches(batch),
            "layer_weight_bytes": self.layer_weight_bytes}
        return moe | {
            "tensor_parallel_size": self.tensor_parallel_size,
            "pipeline_parallel_size": self.pipeline_parallel_size, **stages,
            "replicas": self.replicas,
            "weight_bytes": self.weight_bytes, "weight_gb": round(self.weight_bytes / GB, 3),
            "draft_weight_bytes": self.draft_weight_bytes,
            "draft_kv_bytes_per_token": self.draft_kv_bytes_per_token,
            "unsharded_weight_bytes": unsharded,
            "kv_bytes_per_token": self.kv_bytes_per_token, "page_size": self.page_size,
            "page_bytes": self.page_bytes, "num_pages": self.num_pages,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_cache_gb": round(self.kv_cache_bytes / GB, 3),
            "batch_state_bytes": self.batch_state_bytes,
            "lora_bytes": self.lora_bytes,
            "total_gb": round((self.weight_bytes + self.draft_weight_bytes + self.lora_bytes
                               + self.batch_state_bytes + self.kv_cache_bytes) / GB, 3),
            "kv_tokens": (self.num_pages - 1) * self.page_size,
            **hybrid_summary(self),
            "max_model_len": self.max_model_len,
            "max_concurrent_requests_at_full_context": self.max_concurrent_requests,
            "bandwidth_gb_per_s": self.bandwidth_gb_per_s,
            "peak_flops_per_s": self.peak_flops_per_s,
            "decode_roofline_tokens_per_s_batch_1": rate(1),
            "decode_roofline_batch": batch,
            "decode_roofline_tokens_per_s": rate(batch),
            "price_per_hour": price_per_hour,
            "cost_per_million_output_tokens": None if rows is None
            else rows[-1]["cost_per_million_output_tokens"],
            "decode_roofline": rows,
        }


def expected_distinct_experts(num_experts: int, k: int, batch: int) -> float:
    """Experts of one layer that `batch` tokens choose, expected when each token picks k
    of E uniformly: E (1 - (1 - k/E)^batch)."""
    return num_experts * (1 - (1 - k / num_experts) ** batch)


def cost_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    """What a million output tokens cost at `tokens_per_s`, at `price_per_hour`."""
    return price_per_hour / (tokens_per_s * 3600) * 1e6
