"""The memory plan: what a model and its KV cache need per device, what fits, how fast.

`plan()` takes a model config, the weight and KV dtypes, the context length, a
tensor-parallel degree and a per-device budget (bytes for the KV cache, or for
weights plus KV) and returns a `MemoryPlan`: weight bytes and KV bytes per token on
one device, the pages that fit (page 0 is the trash page), concurrent requests at full
context, and the decode roofline (tokens/s bounded by each device reading its weights
once plus its share of each request's KV per step at a given memory bandwidth, and by
its FLOPs at a given peak; left out when no bandwidth is given). The engine sizes its
page pool with it (through loading.py), so the plan and the allocation agree to the
byte. `python -m jaxinfer plan` prints it.

Tensor parallelism over `tp` devices (Megatron style): q/k/v/o and gate/up/down are
split 1/tp by heads and MLP columns, the embedding and LM head along the vocabulary
when `tp` divides it (else replicated), the q/k/v biases with their heads, norms
replicated. KV heads are split when `tp` divides them, else (tp a multiple of them)
each device holds one, replicated. The all-reduces between devices are not counted:
the roofline is a bound.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.model import sharding
from jaxinfer.model.params_table import EXPERTS, LAYER, param_partition_specs, param_shapes
from jaxinfer.model.quantization import HEAD, QUANTIZED_WEIGHTS, head_mode, quantized_bytes
from jaxinfer.pallas import kv_layout, kv_quant
from jaxinfer.sizing.page_groups import hybrid_summary, one_request_bytes, page_groups

GB = 1e9
EXPERT_WEIGHTS = EXPERTS
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
    replicas: int = 1  # copies of the tensor-parallel group on the devices planned for
    unsharded_weight_bytes: int | None = None  # the whole model; None: weight_bytes
    matmul_flops_per_token: int = 0  # on one device, decode
    attention_flops_per_context_token: int = 0  # per new token and cached token, one device
    peak_flops_per_s: float | None = None  # None: the roofline counts bytes only
    # Speculative decoding with a draft model: its weights, and its K/V per token in its
    # own cache of num_pages pages (page_bytes and kv_cache_bytes count both caches).
    draft_weight_bytes: int = 0
    draft_kv_bytes_per_token: int = 0
    batch_state_bytes: int = 0  # the per-slot rows kept on the device (batch_state_bytes)
    # Mixture of experts: the stacked experts' bytes on one device (within weight_bytes),
    # and the routing that sets how many of them a decode step reads.
    expert_weight_bytes: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    total_params: int = 0
    active_params: int = 0  # per token: the dense parameters and k of the E experts
    # The hybrid KV cache (engine/kv_groups.py): the sliding-window layers' own pages.
    # page_bytes and num_pages are then the full-attention layers' (and a draft's);
    # 0 pages: one group, every layer keeps every page.
    num_sliding_pages: int = 0  # the trash page included
    sliding_page_bytes: int = 0
    sliding_window_pages: int = 0  # ceil(window / page_size) + 1: a decode's sliding pages
    unified_num_pages: int = 0  # pages of every layer the bytes hold: without the hybrid

    def step_weight_bytes(self, batch: int) -> float:
        """The weight bytes a decode step of `batch` requests reads on one device: every
        dense weight, and of the experts those some token chose, expected under uniform
        routing: a fraction 1 - (1 - k/E)^batch of them (`expected_distinct_experts`)."""
        if not self.num_experts:
            return self.weight_bytes
        hit = expected_distinct_experts(self.num_experts, self.experts_per_token, batch)
        return self.weight_bytes - self.expert_weight_bytes * (1 - hit / self.num_experts)

    def decode_seconds(self, batch: int, context: int) -> tuple[float, float] | None:
        """(memory, compute) seconds of a decode step of `batch` requests at `context`
        tokens each on one device: its bytes over the bandwidth, its FLOPs over the peak
        (0 when the peak is unknown). None when the bandwidth is unknown."""
        if self.bandwidth_gb_per_s is None:
            return None
        step_bytes = self.step_weight_bytes(batch) + batch * context * self.kv_bytes_per_token
        flops = batch * (self.matmul_flops_per_token
                         + context * self.attention_flops_per_context_token)
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
        return moe | {
            "tensor_parallel_size": self.tensor_parallel_size, "replicas": self.replicas,
            "weight_bytes": self.weight_bytes, "weight_gb": round(self.weight_bytes / GB, 3),
            "draft_weight_bytes": self.draft_weight_bytes,
            "draft_kv_bytes_per_token": self.draft_kv_bytes_per_token,
            "unsharded_weight_bytes": unsharded,
            "kv_bytes_per_token": self.kv_bytes_per_token, "page_size": self.page_size,
            "page_bytes": self.page_bytes, "num_pages": self.num_pages,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_cache_gb": round(self.kv_cache_bytes / GB, 3),
            "batch_state_bytes": self.batch_state_bytes,
            "total_gb": round((self.weight_bytes + self.draft_weight_bytes
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


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters: active counts k of the E experts per MoE layer."""
    flat = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    total = sum(math.prod(shape) for shape in flat)
    if cfg.moe is None:
        return total, total
    experts = sum(math.prod(shape) for name, shape, _, _ in _device_shapes(cfg, 1)
                  if name in EXPERT_WEIGHTS)
    return total, total - experts + experts * cfg.moe.num_experts_per_tok // cfg.moe.num_experts


def cost_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    """What a million output tokens cost at `tokens_per_s`, at `price_per_hour`."""
    return price_per_hour / (tokens_per_s * 3600) * 1e6


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    """ValueError naming the numbers unless `tp` devices can split the model
    (sharding.check_split: heads, KV heads, gate/up blocks)."""
    sharding.check_split(cfg, tp)


def kv_heads_per_device(cfg: ModelConfig, tp: int = 1) -> int:
    """G over `tp` devices: G / tp when tp divides G, else 1 (each device holds a copy)."""
    check_tensor_parallel(cfg, tp)
    return sharding.served_config(cfg, tp).num_kv_heads // tp


def _device_shapes(cfg: ModelConfig, tp: int
                   ) -> list[tuple[str, tuple[int, ...], int, PartitionSpec]]:
    """(name, shape, elements on one device, spec) of every parameter, as the engine places
    them: the served model (KV heads copied when fewer than devices) split by the
    parameter table (model/params_table.py)."""
    served = sharding.served_config(cfg, tp)
    flat, _ = jax.tree_util.tree_flatten_with_path(
        param_shapes(served), is_leaf=lambda x: isinstance(x, tuple))
    specs = jax.tree.leaves(param_partition_specs(served, tp),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))
    out = []
    for (path, shape), spec in zip(flat, specs, strict=True):
        split = sum(axis is not None for axis in spec)  # axes split over the model axis
        out.append((path[-1].key, shape, math.prod(shape) // tp ** split, spec))
    return out


def weight_bytes(cfg: ModelConfig, dtype: str, tensor_parallel_size: int = 1,
                 quantization: str | None = None, quantized_head: bool = True) -> int:
    """Bytes of every parameter stored in `dtype` (the loader casts all of them) on each
    of `tensor_parallel_size` devices; with `quantization`, each layer's linear weights
    and the LM head (a second copy when tied to the embedding) take one byte per element
    plus a float32 scale per output column held there, int4 half a byte plus its group
    scales (jaxinfer/model/quantization.py `quantized_bytes`; an int4 model's head is int8).
    `quantized_head=False`: the head stays in `dtype` (`checkpoint.quantized_head`)."""
    check_tensor_parallel(cfg, tensor_parallel_size)
    tp, total = tensor_parallel_size, 0
    head = quantization if quantized_head else None
    for name, shape, n, spec in _device_shapes(cfg, tp):
        if name in EXPERT_WEIGHTS:
            total += _expert_bytes(shape, n, spec, dtype, quantization, tp)
        elif quantization is not None and name in QUANTIZED_WEIGHTS:
            total += quantized_bytes(name, shape, spec, quantization, tp)
        elif head is not None and name == HEAD:
            total += quantized_bytes(name, shape, spec, head_mode(head), tp)
        else:
            total += n * jnp.dtype(dtype).itemsize
        if name == "embed" and head is not None and cfg.tie_word_embeddings:
            head_spec = PartitionSpec(*reversed((tuple(spec) + (None, None))[:2]))
            total += quantized_bytes(HEAD, shape[::-1], head_spec, head_mode(head), tp)
    return total


def _expert_bytes(shape: tuple[int, ...], elements: int, spec: PartitionSpec, dtype: str,
                  quantization: str | None, tp: int) -> int:
    """One device's bytes of an expert stack [E, O, I]: `elements` of it in `dtype`, or
    one byte each and a float32 scale per expert and output row it holds."""
    if quantization is None:
        return elements * jnp.dtype(dtype).itemsize
    split = sum(axis is not None for axis in tuple(spec)[:2])
    return elements + 4 * shape[0] * shape[1] // tp ** split


def expert_weight_bytes(cfg: ModelConfig, dtype: str, tensor_parallel_size: int = 1,
                        quantization: str | None = None) -> int:
    """The expert stacks' bytes on one device (part of `weight_bytes`)."""
    return sum(_expert_bytes(shape, n, spec, dtype, quantization, tensor_parallel_size)
               for name, shape, n, spec in _device_shapes(cfg, tensor_parallel_size)
               if name in EXPERT_WEIGHTS)


def decode_flops(cfg: ModelConfig, tensor_parallel_size: int = 1) -> tuple[int, int]:
    """FLOPs of one decoded token on one device: (matmuls, attention per cached token).
    Matmuls: 2 x the matrices a token multiplies: k of E experts (their biases [E, n] are
    none), a tied embedding once, as the LM head. Attention: 4 x heads x head_dim x layers."""
    shapes = _device_shapes(cfg, tensor_parallel_size)
    stacked = {p.key for p in LAYER if p.experts} | {"embed"}  # below, or not a matmul
    matmul = sum(n for name, shape, n, _ in shapes if len(shape) == 2 and name not in stacked)
    if cfg.moe is not None:  # each token runs k of the E experts
        matmul += sum(n for name, _, n, _ in shapes if name in EXPERT_WEIGHTS
                      ) * cfg.moe.num_experts_per_tok // cfg.moe.num_experts
    if cfg.tie_word_embeddings:
        matmul += next(n for name, _, n, _ in shapes if name == "embed")
    heads = cfg.num_heads // tensor_parallel_size
    return 2 * matmul, 4 * heads * cfg.head_dim * cfg.num_layers  # q.k and p.v


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, tensor_parallel_size: int = 1) -> int:
    """K and V of one token over all layers on one device, as stored: heads padded to
    whole 32-bit words (`pallas/kv_layout.py`; only 8-bit pages with an odd head count
    pad); 8-bit KV ("int8", "fp8") adds a float32 scale per real combined head
    (`pallas/kv_quant.py`)."""
    heads = kv_heads_per_device(cfg, tensor_parallel_size)
    dtype = kv_quant.storage_dtype(kv_dtype)
    combined = kv_layout.padded_heads_for(heads, dtype)
    scales = 4 * 2 * heads if kv_quant.is_quantized(dtype) else 0
    return (combined * cfg.head_dim * dtype.itemsize + scales) * cfg.num_layers


def batch_state_bytes(max_num_seqs: int, max_model_len: int, page_size: int) -> int:
    """Bytes of the rows each slot keeps on the device across steps (model/batch_state.py):
    its token history and page-table row, its last token, its sampling settings and
    16 stop ids; one more row for padding."""
    return (max_num_seqs + 1) * 4 * (max_model_len + -(-max_model_len // page_size) + 28)


def _kv_budget(memory_bytes: int, weights: int, need: int, dtype: str, max_model_len: int,
               tp: int, state: int) -> int:
    """The KV bytes left in `memory_bytes` per device after the weights and the batch
    state; ValueError saying by how much it falls short of one request."""
    kv_cache_bytes = memory_bytes - weights - state
    if kv_cache_bytes >= need:
        return kv_cache_bytes
    where = "" if tp == 1 else f" per device (tensor_parallel_size={tp})"
    larger_tp = "" if tp == 1 and weights < memory_bytes else ", raise tensor_parallel_size"
    raise ValueError(
        f"{memory_bytes / GB:.3f} GB{where} holds the {weights / GB:.3f} GB of {dtype} weights, "
        f"{state / GB:.3f} GB of per-request state and {max(kv_cache_bytes, 0) / GB:.3f} GB of "
        f"KV cache; one request of max_model_len={max_model_len} needs {need / GB:.3f} GB of KV, "
        f"{(weights + state + need - memory_bytes) / GB:.3f} GB short: give at least "
        f"{(weights + state + need) / GB:.3f} GB{larger_tp} or lower max_model_len")


def plan(cfg: ModelConfig, *, dtype: str = "float32", kv_dtype: str | None = None,
         max_model_len: int | None = None, max_num_seqs: int = 32, page_size: int = 16,
         kv_cache_bytes: int | None = None, memory_bytes: int | None = None,
         bandwidth_gb_per_s: float | None = None, tensor_parallel_size: int = 1,
         num_devices: int | None = None, peak_flops_per_s: float | None = None,
         quantization: str | None = None, quantized_head: bool = True,
         draft: ModelConfig | tuple[int, int] | None = None,
         max_num_batched_tokens: int = 512,
         hybrid_kv_cache: bool = True) -> MemoryPlan:
    """The plan per device for a KV budget: `kv_cache_bytes` for the cache alone, or
    `memory_bytes` for weights plus cache (exactly one), on each of `tensor_parallel_size`
    devices; `num_devices` (default: tensor_parallel_size) hold its replicas. `draft`: a
    speculative draft model served beside it (in `dtype`, unquantized), its weights and
    its K/V per token (one more cache of the same pages) counted too; or speculative
    heads' (weight bytes, bytes per token: their K/V and the target's kept features).
    `bandwidth_gb_per_s` (GB/s, per device) for the decode roofline, None leaves it out;
    `peak_flops_per_s` adds the compute bound. `hybrid_kv_cache`: a model with both
    sliding-window and full-attention layers gives its sliding layers their own pages
    (`page_groups`). Raises ValueError when not even one request of `max_model_len`
    fits, saying how much would."""
    if (kv_cache_bytes is None) == (memory_bytes is None):
        raise ValueError("give exactly one of kv_cache_bytes or memory_bytes")
    tp, num_devices = tensor_parallel_size, num_devices or tensor_parallel_size
    if num_devices < tp:
        raise ValueError(f"tensor_parallel_size={tp} exceeds num_devices={num_devices}")
    kv_dtype = kv_dtype or dtype
    max_model_len = max_model_len or cfg.max_position_embeddings
    weights = weight_bytes(cfg, dtype, tp, quantization, quantized_head)
    per_token = kv_bytes_per_token(cfg, kv_dtype, tp)
    draft_weights = draft_per_token = 0
    if isinstance(draft, tuple):  # heads: (weight bytes, K/V and feature bytes per token)
        draft_weights, draft_per_token = draft
    elif draft is not None:
        draft_weights = weight_bytes(draft, dtype, tp)
        draft_per_token = kv_bytes_per_token(draft, kv_dtype, tp)
    pages_per_request = -(-max_model_len // page_size)
    need = one_request_bytes(cfg, per_token, draft_per_token, page_size=page_size,
                             max_model_len=max_model_len, hybrid=hybrid_kv_cache,
                             max_num_batched_tokens=max_num_batched_tokens)
    state = batch_state_bytes(max_num_seqs, max_model_len, page_size)
    if memory_bytes is not None:
        kv_cache_bytes = _kv_budget(memory_bytes, weights + draft_weights, need, dtype,
                                    max_model_len, tp, state)
    groups = page_groups(cfg, kv_cache_bytes, per_token, draft_per_token, page_size=page_size,
                         max_model_len=max_model_len, hybrid=hybrid_kv_cache,
                         max_num_batched_tokens=max_num_batched_tokens)
    if groups["num_pages"] - 1 < pages_per_request:
        raise ValueError(
            f"a KV cache of {kv_cache_bytes} bytes holds {groups['num_pages']} pages of "
            f"{groups['page_bytes']} bytes; one request of max_model_len={max_model_len} "
            f"needs {pages_per_request} plus the trash page: give kv_cache_memory_bytes >= "
            f"{need} or lower max_model_len")
    matmul_flops, attention_flops = decode_flops(cfg, tp)
    return MemoryPlan(weight_bytes=weights, kv_bytes_per_token=per_token, page_size=page_size,
                      max_model_len=max_model_len, pages_per_request=pages_per_request,
                      max_num_seqs=max_num_seqs, bandwidth_gb_per_s=bandwidth_gb_per_s,
                      tensor_parallel_size=tp, replicas=num_devices // tp,
                      unsharded_weight_bytes=weight_bytes(cfg, dtype, 1, quantization,
                                                          quantized_head),
                      matmul_flops_per_token=matmul_flops,
                      attention_flops_per_context_token=attention_flops,
                      peak_flops_per_s=peak_flops_per_s, draft_weight_bytes=draft_weights,
                      draft_kv_bytes_per_token=draft_per_token, batch_state_bytes=state,
                      **_moe_fields(cfg, dtype, tp, quantization), **groups)


def _moe_fields(cfg: ModelConfig, dtype: str, tp: int, quantization: str | None) -> dict:
    """MemoryPlan's parameter counts and, for a mixture of experts, its routing and the
    experts' bytes on one device."""
    total, active = param_counts(cfg)
    out = {"total_params": total, "active_params": active}
    if cfg.moe is None:
        return out
    return out | {"expert_weight_bytes": expert_weight_bytes(cfg, dtype, tp, quantization),
                  "num_experts": cfg.moe.num_experts,
                  "experts_per_token": cfg.moe.num_experts_per_tok}
