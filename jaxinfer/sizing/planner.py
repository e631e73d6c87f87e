"""The memory plan (`plan()`): a model's weight bytes and KV bytes per token on one of
`tp` devices, the pages that fit a budget, concurrent requests at full context, and the
decode roofline (a bound: all-reduces not counted). The engine sizes its pool with it
(engine/loading.py) and `python -m jaxinfer plan` prints it. See docs/cli.md#plan and
docs/kv_cache.md#sizing.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.config.lora import LoraSlots
from jaxinfer.model import lora as lora_lib
from jaxinfer.model import sharding
from jaxinfer.model.params_table import EXPERTS, LAYER, param_partition_specs, param_shapes
from jaxinfer.model.quantization import (
    HEAD,
    QUANTIZED_WEIGHTS,
    check_applies,
    expert_bytes,
    head_mode,
    linear_mode,
    quantized_bytes,
)
from jaxinfer.pallas import kv_layout, kv_quant
from jaxinfer.sizing.memory_plan import GB, MemoryPlan
from jaxinfer.sizing.page_groups import one_request_bytes, page_groups

EXPERT_WEIGHTS = EXPERTS
# a pre-quantized AWQ/GPTQ int4 weight's (step, offset) per group and column: float32 each
# (jaxinfer/checkpoint/prequantized_int4/)
PREQUANTIZED_SCALE_BYTES = 8


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters: active counts k of the E experts per MoE layer."""
    flat = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    total = sum(math.prod(shape) for shape in flat)
    if cfg.moe is None:
        return total, total
    experts = sum(math.prod(shape) for name, shape, _, _ in _device_shapes(cfg, 1)
                  if name in EXPERT_WEIGHTS)
    return total, total - experts + experts * cfg.moe.num_experts_per_tok // cfg.moe.num_experts


def check_tensor_parallel(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """ValueError naming the numbers unless `tp` devices can split the model
    (sharding.check_split: heads, KV heads, gate/up blocks, whole experts)."""
    sharding.check_split(cfg, tp, expert_parallel)


def kv_heads_per_device(cfg: ModelConfig, tp: int = 1) -> int:
    """G over `tp` devices: G / tp when tp divides G, else 1 (each device holds a copy)."""
    check_tensor_parallel(cfg, tp)
    return sharding.served_config(cfg, tp).num_kv_heads // tp


def _device_shapes(cfg: ModelConfig, tp: int, expert_parallel: bool = False
                   ) -> list[tuple[str, tuple[int, ...], int, PartitionSpec]]:
    """(name, shape, elements on one device, spec) of every parameter, as the engine places
    them: the served model (KV heads copied when fewer than devices) split by the
    parameter table (model/params_table.py), experts whole with `expert_parallel`."""
    served = sharding.served_config(cfg, tp)
    flat, _ = jax.tree_util.tree_flatten_with_path(
        param_shapes(served), is_leaf=lambda x: isinstance(x, tuple))
    specs = jax.tree.leaves(param_partition_specs(served, tp, expert_parallel),
                            is_leaf=lambda x: isinstance(x, PartitionSpec))
    out = []
    for (path, shape), spec in zip(flat, specs, strict=True):
        split = sum(axis is not None for axis in spec)  # axes split over the model axis
        out.append((path[-1].key, shape, math.prod(shape) // tp ** split, spec))
    return out


def weight_bytes(cfg: ModelConfig, dtype: str, tensor_parallel_size: int = 1,
                 quantization: str | None = None, quantized_head: bool = True,
                 expert_parallel: bool = False, prequantized_group: int | None = None) -> int:
    """Bytes of every parameter stored in `dtype` (the loader casts all of them) on each
    of `tensor_parallel_size` devices; with `quantization`, each layer's linear weights
    and the LM head (a second copy when tied to the embedding) take one byte per element
    plus a float32 scale per output column held there, int4 half a byte plus its group
    scales (jaxinfer/model/quantization.py `quantized_bytes`; an int4 model's head is int8).
    `quantized_head=False`: the head stays in `dtype` (`checkpoint.quantized_head`);
    `expert_parallel`: each device holds whole experts (ModelOptions);
    `prequantized_group`: int4 weights read from an AWQ or GPTQ checkpoint, in its groups
    of that many rows with float32 step and offset (`prequantized_int4_bytes`).
    mxfp4 packs the experts alone (17 bytes per 32 elements); the rest stays in `dtype`."""
    check_tensor_parallel(cfg, tensor_parallel_size, expert_parallel)
    check_applies(quantization, cfg)
    tp, total = tensor_parallel_size, 0
    linear = linear_mode(quantization)  # mxfp4: the experts alone
    head = quantization if quantized_head and head_mode(quantization) else None
    for name, shape, n, spec in _device_shapes(cfg, tp, expert_parallel):
        if name in EXPERT_WEIGHTS:
            total += _expert_bytes(name, shape, n, spec, dtype, quantization, tp)
        elif linear is not None and name in QUANTIZED_WEIGHTS and prequantized_group:
            total += prequantized_int4_bytes(name, shape, spec, prequantized_group, tp)
        elif linear is not None and name in QUANTIZED_WEIGHTS:
            total += quantized_bytes(name, shape, spec, quantization, tp)
        elif head is not None and name == HEAD:
            total += quantized_bytes(name, shape, spec, head_mode(head), tp)
        else:
            total += n * jnp.dtype(dtype).itemsize
        if name == "embed" and head is not None and cfg.tie_word_embeddings:
            head_spec = PartitionSpec(*reversed((tuple(spec) + (None, None))[:2]))
            total += quantized_bytes(HEAD, shape[::-1], head_spec, head_mode(head), tp)
    return total


def prequantized_int4_bytes(name: str, shape: tuple[int, int], spec: PartitionSpec,
                            group: int, tp: int) -> int:
    """Bytes on one of `tp` devices of a pre-quantized int4 weight `name` [I, O] split by
    `spec`: half a byte per element and PREQUANTIZED_SCALE_BYTES per group of `group`
    rows and column. A split of the input rows must give each device whole groups."""
    rows, columns = shape
    split_rows = len(spec) > 0 and spec[0] is not None
    split_columns = len(spec) > 1 and spec[1] is not None
    if split_rows and (rows // tp) % group:
        raise ValueError(f"int4 groups of {group} rows (the checkpoint's group_size) "
                         f"straddle the {tp} devices' shares of {name} [{rows}, {columns}] "
                         f"(split by input rows, {rows // tp} each)")
    elements = rows * columns // tp ** (split_rows + split_columns)
    return elements // 2 + PREQUANTIZED_SCALE_BYTES * elements // group


def _expert_bytes(name: str, shape: tuple[int, ...], elements: int, spec: PartitionSpec,
                  dtype: str, quantization: str | None, tp: int) -> int:
    """One device's bytes of an expert stack [E, O, I]: `elements` of it in `dtype`, or
    quantized (quantization.expert_bytes: one byte each and a float32 scale per expert
    and output row it holds; mxfp4 packed, 17 bytes per 32 elements)."""
    if quantization is None:
        return elements * jnp.dtype(dtype).itemsize
    return expert_bytes(name, shape, spec, quantization, tp)


def expert_weight_bytes(cfg: ModelConfig, dtype: str, tensor_parallel_size: int = 1,
                        quantization: str | None = None, expert_parallel: bool = False
                        ) -> int:
    """The expert stacks' bytes on one device (part of `weight_bytes`)."""
    shapes = _device_shapes(cfg, tensor_parallel_size, expert_parallel)
    return sum(_expert_bytes(name, shape, n, spec, dtype, quantization, tensor_parallel_size)
               for name, shape, n, spec in shapes if name in EXPERT_WEIGHTS)


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


def _draft_bytes(draft: ModelConfig | tuple[int, int] | None, dtype: str, kv_dtype: str,
                 tp: int) -> tuple[int, int]:
    """(weight bytes, bytes per token) of the speculative drafter on one device: a draft
    model's weights in `dtype` (unquantized) and its K/V in `kv_dtype`; speculative heads'
    as given (their K/V and the target's kept features); (0, 0) without a drafter."""
    if draft is None:
        return 0, 0
    if isinstance(draft, tuple):
        weights, per_token = draft
        return weights, per_token
    return weight_bytes(draft, dtype, tp), kv_bytes_per_token(draft, kv_dtype, tp)


def _check_pages(groups: dict[str, int], pages_per_request: int, kv_cache_bytes: int,
                 max_model_len: int, need: int) -> None:
    """ValueError unless the pool's pages, the trash page aside, hold one request of
    `max_model_len`, saying how many bytes would (`need`)."""
    if groups["num_pages"] - 1 < pages_per_request:
        raise ValueError(
            f"a KV cache of {kv_cache_bytes} bytes holds {groups['num_pages']} pages of "
            f"{groups['page_bytes']} bytes; one request of max_model_len={max_model_len} "
            f"needs {pages_per_request} plus the trash page: give kv_cache_memory_bytes >= "
            f"{need} or lower max_model_len")


def _check_budget(kv_cache_bytes: int | None, memory_bytes: int | None, tp: int,
                  num_devices: int) -> None:
    if (kv_cache_bytes is None) == (memory_bytes is None):
        raise ValueError("give exactly one of kv_cache_bytes or memory_bytes")
    if num_devices < tp:
        raise ValueError(f"tensor_parallel_size={tp} exceeds num_devices={num_devices}")


def lora_bytes(cfg: ModelConfig, lora: LoraSlots | None, tp: int = 1) -> int:
    """Bytes of the LoRA adapter slots on one of `tp` devices (0 without LoRA)."""
    if lora is None:
        return 0
    return lora_lib.slot_bytes(sharding.served_config(cfg, tp), lora, tp)


def plan(cfg: ModelConfig, *, dtype: str = "float32", kv_dtype: str | None = None,
         max_model_len: int | None = None, max_num_seqs: int = 32, page_size: int = 16,
         kv_cache_bytes: int | None = None, memory_bytes: int | None = None,
         bandwidth_gb_per_s: float | None = None, tensor_parallel_size: int = 1,
         num_devices: int | None = None, peak_flops_per_s: float | None = None,
         quantization: str | None = None, quantized_head: bool = True,
         draft: ModelConfig | tuple[int, int] | None = None,
         max_num_batched_tokens: int = 512,
         hybrid_kv_cache: bool = True, expert_parallel: bool = False,
         prequantized_group: int | None = None, lora: LoraSlots | None = None
         ) -> MemoryPlan:
    """The plan per device for a KV budget: `kv_cache_bytes` for the cache alone, or
    `memory_bytes` for weights plus cache (exactly one), on each of `tensor_parallel_size`
    devices; `num_devices` (default: tensor_parallel_size) hold its replicas. `draft`: a
    speculative draft model served beside it (in `dtype`, unquantized), its weights and
    its K/V per token (one more cache of the same pages) counted too; or speculative
    heads' (weight bytes, bytes per token: their K/V and the target's kept features).
    `bandwidth_gb_per_s` (GB/s, per device) for the decode roofline, None leaves it out;
    `peak_flops_per_s` adds the compute bound. `hybrid_kv_cache`: a model with both
    sliding-window and full-attention layers gives its sliding layers their own pages
    (`page_groups`). `expert_parallel`: each device holds whole experts (ModelOptions).
    `prequantized_group`: an AWQ or GPTQ checkpoint's int4 groups (`weight_bytes`).
    `lora`: the LoRA adapter slots held beside the weights (model/lora.py). Raises
    ValueError when not even one request of `max_model_len` fits, saying how
    much would."""
    tp, num_devices = tensor_parallel_size, num_devices or tensor_parallel_size
    _check_budget(kv_cache_bytes, memory_bytes, tp, num_devices)
    kv_dtype = kv_dtype or dtype
    max_model_len = max_model_len or cfg.max_position_embeddings
    weights = weight_bytes(cfg, dtype, tp, quantization, quantized_head, expert_parallel,
                           prequantized_group)
    adapters = lora_bytes(cfg, lora, tp)
    per_token = kv_bytes_per_token(cfg, kv_dtype, tp)
    draft_weights, draft_per_token = _draft_bytes(draft, dtype, kv_dtype, tp)
    pages_per_request = -(-max_model_len // page_size)
    need = one_request_bytes(cfg, per_token, draft_per_token, page_size=page_size,
                             max_model_len=max_model_len, hybrid=hybrid_kv_cache,
                             max_num_batched_tokens=max_num_batched_tokens)
    state = batch_state_bytes(max_num_seqs, max_model_len, page_size)
    if memory_bytes is not None:
        kv_cache_bytes = _kv_budget(memory_bytes, weights + draft_weights + adapters, need,
                                    dtype, max_model_len, tp, state)
    groups = page_groups(cfg, kv_cache_bytes, per_token, draft_per_token, page_size=page_size,
                         max_model_len=max_model_len, hybrid=hybrid_kv_cache,
                         max_num_batched_tokens=max_num_batched_tokens)
    _check_pages(groups, pages_per_request, kv_cache_bytes, max_model_len, need)
    matmul_flops, attention_flops = decode_flops(cfg, tp)
    return MemoryPlan(weight_bytes=weights, kv_bytes_per_token=per_token, page_size=page_size,
                      max_model_len=max_model_len, pages_per_request=pages_per_request,
                      max_num_seqs=max_num_seqs, bandwidth_gb_per_s=bandwidth_gb_per_s,
                      tensor_parallel_size=tp, replicas=num_devices // tp,
                      unsharded_weight_bytes=weight_bytes(
                          cfg, dtype, 1, quantization, quantized_head,
                          prequantized_group=prequantized_group),
                      matmul_flops_per_token=matmul_flops,
                      attention_flops_per_context_token=attention_flops,
                      peak_flops_per_s=peak_flops_per_s, draft_weight_bytes=draft_weights,
                      draft_kv_bytes_per_token=draft_per_token, batch_state_bytes=state,
                      lora_bytes=adapters,
                      **_moe_fields(cfg, dtype, tp, quantization, expert_parallel), **groups)


def _moe_fields(cfg: ModelConfig, dtype: str, tp: int, quantization: str | None,
                expert_parallel: bool) -> dict:
    """MemoryPlan's parameter counts and, for a mixture of experts, its routing and the
    experts' bytes on one device."""
    total, active = param_counts(cfg)
    out = {"total_params": total, "active_params": active}
    if cfg.moe is None:
        return out
    return out | {"expert_weight_bytes": expert_weight_bytes(cfg, dtype, tp, quantization,
                                                           expert_parallel),
                  "num_experts": cfg.moe.num_experts,
                  "experts_per_token": cfg.moe.num_experts_per_tok}
