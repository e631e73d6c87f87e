"""The memory plan (`plan()`): a model's weight bytes and KV bytes per token on one of
`tp` devices, the pages that fit a budget, concurrent requests at full context, and the
decode roofline (a bound: all-reduces not counted). The engine sizes its pool with it
(engine/loading.py) and `python -m jaxinfer plan` prints it. See docs/cli.md#plan and
docs/kv_cache.md#sizing.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxinfer.config import ModelConfig
from jaxinfer.config.lora import LoraSlots
from jaxinfer.model import lora as lora_lib
from jaxinfer.model import sharding
from jaxinfer.model.params_table import EXPERTS
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
from jaxinfer.sizing import pipeline_plan
from jaxinfer.sizing.device_params import (
    by_layer,
    decode_flops,
    device_leaves,
    matmul_flops_split,
    param_counts,
)
from jaxinfer.sizing.memory_plan import GB, MemoryPlan
from jaxinfer.sizing.page_groups import one_request_bytes, page_groups

EXPERT_WEIGHTS = EXPERTS
# a pre-quantized AWQ/GPTQ int4 weight's (step, offset) per group and column: float32 each
# (jaxinfer/checkpoint/prequantized_int4/)
PREQUANTIZED_SCALE_BYTES = 8


def check_tensor_parallel(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> None:
    """ValueError naming the numbers unless `tp` devices can split the model
    (sharding.check_split: heads, KV heads, gate/up blocks, whole experts)."""
    sharding.check_split(cfg, tp, expert_parallel)


def kv_heads_per_device(cfg: ModelConfig, tp: int = 1) -> int:
    """G over `tp` devices: G / tp when tp divides G, else 1 (each device holds a copy)."""
    check_tensor_parallel(cfg, tp)
    return sharding.served_config(cfg, tp).num_kv_heads // tp


def weight_bytes(cfg: ModelConfig, dtype: str, tensor_parallel_size: int = 1,
                 quantization: str | None = None, quantized_head: bool = True,
                 expert_parallel: bool = False, prequantized_group: int | None = None,
                 pipeline_parallel_size: int = 1) -> int:
    """Bytes of every parameter stored in `dtype` (the loader casts all of them) on each
    of `tensor_parallel_size` devices; with `quantization`, each layer's linear weights
    and the LM head (a second copy when tied to the embedding) take one byte per element
    plus a float32 scale per output column held there, int4 half a byte plus its group
    scales (jaxinfer/model/quantization.py `quantized_bytes`; an int4 model's head is int8).
    `quantized_head=False`: the head stays in `dtype` (`checkpoint.quantized_head`);
    `expert_parallel`: each device holds whole experts (ModelOptions);
    `prequantized_group`: int4 weights read from an AWQ or GPTQ checkpoint, in its groups
    of that many rows with float32 step and offset (`prequantized_int4_bytes`).
    mxfp4 packs the experts alone (17 bytes per 32 elements); the rest stays in `dtype`.
    `pipeline_parallel_size`: a device of one stage, holding ceil(layers / stages) layer
    slots (padding slots a whole layer each) and, as every stage, the embedding, final
    norm and head (pipeline_plan.py)."""
    top, per_layer = _weight_split(cfg, dtype, tensor_parallel_size, quantization,
                                   quantized_head, expert_parallel, prequantized_group)
    return top + pipeline_plan.stage_sum(cfg, pipeline_parallel_size, per_layer)


def _weight_split(cfg: ModelConfig, dtype: str, tp: int, quantization: str | None,
                  quantized_head: bool, expert_parallel: bool,
                  prequantized_group: int | None) -> tuple[int, list[int]]:
    """`weight_bytes` on one of `tp` devices as (outside the layers, each layer)."""
    check_tensor_parallel(cfg, tp, expert_parallel)
    check_applies(quantization, cfg)
    linear = linear_mode(quantization)  # mxfp4: the experts alone
    head = quantization if quantized_head and head_mode(quantization) else None
    leaves = []
    for layer, name, shape, n, spec in device_leaves(cfg, tp, expert_parallel):
        if name in EXPERT_WEIGHTS:
            nbytes = _expert_bytes(name, shape, n, spec, dtype, quantization, tp)
        elif linear is not None and name in QUANTIZED_WEIGHTS and prequantized_group:
            nbytes = prequantized_int4_bytes(name, shape, spec, prequantized_group, tp)
        elif linear is not None and name in QUANTIZED_WEIGHTS:
            nbytes = quantized_bytes(name, shape, spec, quantization, tp)
        elif head is not None and name == HEAD:
            nbytes = quantized_bytes(name, shape, spec, head_mode(head), tp)
        else:
            nbytes = n * jnp.dtype(dtype).itemsize
        if name == "embed" and head is not None and cfg.tie_word_embeddings:
            head_spec = PartitionSpec(*reversed((tuple(spec) + (None, None))[:2]))
            nbytes += quantized_bytes(HEAD, shape[::-1], head_spec, head_mode(head), tp)
        leaves.append((layer, nbytes))
    return by_layer(cfg, leaves)


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
                        quantization: str | None = None, expert_parallel: bool = False,
                        pipeline_parallel_size: int = 1) -> int:
    """The expert stacks' bytes on one device (part of `weight_bytes`)."""
    tp = tensor_parallel_size
    _, per_layer = by_layer(cfg, [
        (layer, _expert_bytes(name, shape, n, spec, dtype, quantization, tp))
        for layer, name, shape, n, spec in device_leaves(cfg, tp, expert_parallel)
        if name in EXPERT_WEIGHTS])
    return pipeline_plan.stage_sum(cfg, pipeline_parallel_size, per_layer)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, tensor_parallel_size: int = 1,
                       pipeline_parallel_size: int = 1) -> int:
    """K and V of one token over all layers on one device, as stored: heads padded to
    whole 32-bit words (`pallas/kv_layout.py`; only 8-bit pages with an odd head count
    pad); 8-bit KV ("int8", "fp8") adds a float32 scale per real combined head
    (`pallas/kv_quant.py`). With `pipeline_parallel_size`, one stage's layer slots."""
    heads = kv_heads_per_device(cfg, tensor_parallel_size)
    dtype = kv_quant.storage_dtype(kv_dtype)
    combined = kv_layout.padded_heads_for(heads, dtype)
    scales = 4 * 2 * heads if kv_quant.is_quantized(dtype) else 0
    layers = pipeline_plan.layer_slots(cfg, pipeline_parallel_size)
    return (combined * cfg.head_dim * dtype.itemsize + scales) * layers


def batch_state_bytes(max_num_seqs: int, max_model_len: int, page_size: int) -> int:
    """Bytes of the rows each slot keeps on the device across steps (model/batch_state.py):
    its token history and page-table row, its last token, its sampling settings and
    16 stop ids; one more row for padding."""
    return (max_num_seqs + 1) * 4 * (max_model_len + -(-max_model_len // page_size) + 28)


def _kv_budget(memory_bytes: int, weights: int, need: int, dtype: str, max_model_len: int,
               tp: int, state: int, pp: int = 1) -> int:
    """The KV bytes left in `memory_bytes` per device (of one stage) after the weights and
    the batch state; ValueError saying by how much it falls short of one request."""
    kv_cache_bytes = memory_bytes - weights - state
    if kv_cache_bytes >= need:
        return kv_cache_bytes
    sizes = [f"tensor_parallel_size={tp}"] * (tp > 1) + [f"pipeline_parallel_size={pp}"] * (pp > 1)
    where = f" per {'device' if tp > 1 else 'stage'} ({', '.join(sizes)})" if sizes else ""
    larger_tp = "" if tp == 1 and weights < memory_bytes else ", raise tensor_parallel_size"
    if pp > 1:
        larger_tp = ", raise tensor_parallel_size or pipeline_parallel_size"
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
                  num_devices: int, pp: int = 1) -> None:
    if (kv_cache_bytes is None) == (memory_bytes is None):
        raise ValueError("give exactly one of kv_cache_bytes or memory_bytes")
    if num_devices < tp * pp:
        stages = "" if pp == 1 else f" x pipeline_parallel_size={pp}"
        raise ValueError(f"tensor_parallel_size={tp}{stages} exceeds "
                         f"num_devices={num_devices}")


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
         prequantized_group: int | None = None, lora: LoraSlots | None = None,
         pipeline_parallel_size: int = 1, pipeline_microbatches: int = 0) -> MemoryPlan:
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
    `lora`: the LoRA adapter slots held beside the weights (model/lora.py).
    `pipeline_parallel_size` stages: the budget is the stages' together (1/pp each), the
    figures a device of one stage's (`num_pages`: each stage's pool; pipeline_plan.py);
    `pipeline_microbatches` (0: one per stage) for the roofline. Raises ValueError when
    not even one request of `max_model_len` fits, saying how much would."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    num_devices = num_devices or tp * pp
    max_model_len = max_model_len or cfg.max_position_embeddings
    _check_budget(kv_cache_bytes, memory_bytes, tp, num_devices, pp)
    pipeline_plan.check_plan(cfg, pp, beside=draft is not None or lora is not None,
                             hybrid=hybrid_kv_cache, page_size=page_size,
                             max_model_len=max_model_len)
    kv_dtype = kv_dtype or dtype
    top, per_layer = _weight_split(cfg, dtype, tp, quantization, quantized_head,
                                   expert_parallel, prequantized_group)
    layer_weights = pipeline_plan.stage_sum(cfg, pp, per_layer)
    adapters = lora_bytes(cfg, lora, tp)
    per_token = kv_bytes_per_token(cfg, kv_dtype, tp, pp)
    draft_weights, draft_per_token = _draft_bytes(draft, dtype, kv_dtype, tp)
    pool = _stage_pool(cfg, per_token, draft_per_token, page_size=page_size,
                       max_model_len=max_model_len, hybrid=hybrid_kv_cache,
                       max_num_batched_tokens=max_num_batched_tokens,
                       max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes,
                       memory_bytes=memory_bytes, pp=pp, tp=tp, dtype=dtype,
                       weights=top + layer_weights + draft_weights + adapters)
    return MemoryPlan(weight_bytes=top + layer_weights, layer_weight_bytes=layer_weights,
                      kv_bytes_per_token=per_token, page_size=page_size,
                      max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      bandwidth_gb_per_s=bandwidth_gb_per_s, tensor_parallel_size=tp,
                      pipeline_parallel_size=pp, pipeline_microbatches=pipeline_microbatches,
                      replicas=num_devices // (tp * pp), peak_flops_per_s=peak_flops_per_s,
                      unsharded_weight_bytes=weight_bytes(cfg, dtype, 1, quantization,
                                                          quantized_head, False,
                                                          prequantized_group),
                      draft_weight_bytes=draft_weights, lora_bytes=adapters,
                      draft_kv_bytes_per_token=draft_per_token, **pool,
                      **_flop_fields(cfg, tp, pp),
                      **_moe_fields(cfg, dtype, tp, quantization, expert_parallel, pp))


def _stage_pool(cfg: ModelConfig, per_token: int, draft_per_token: int, *, page_size: int,
                max_model_len: int, hybrid: bool, max_num_batched_tokens: int,
                max_num_seqs: int, kv_cache_bytes: int | None, memory_bytes: int | None,
                pp: int, tp: int, dtype: str, weights: int) -> dict:
    """MemoryPlan's page fields for one stage's pool: its share of the budget (1/pp of
    `kv_cache_bytes`, or of `memory_bytes` less `weights` and the batch state);
    ValueError when one request of max_model_len does not fit."""
    pages_per_request = -(-max_model_len // page_size)
    need = one_request_bytes(cfg, per_token, draft_per_token, page_size=page_size,
                             max_model_len=max_model_len, hybrid=hybrid,
                             max_num_batched_tokens=max_num_batched_tokens)
    state = batch_state_bytes(max_num_seqs, max_model_len, page_size)
    kv_cache_bytes = kv_cache_bytes // pp if memory_bytes is None else _kv_budget(
        memory_bytes // pp, weights, need, dtype, max_model_len, tp, state, pp)
    groups = page_groups(cfg, kv_cache_bytes, per_token, draft_per_token, page_size=page_size,
                         max_model_len=max_model_len, hybrid=hybrid,
                         max_num_batched_tokens=max_num_batched_tokens)
    _check_pages(groups, pages_per_request, kv_cache_bytes, max_model_len, need)
    return {"pages_per_request": pages_per_request, "batch_state_bytes": state, **groups}


def _flop_fields(cfg: ModelConfig, tp: int, pp: int) -> dict:
    """MemoryPlan's FLOPs a decoded token on one device of one stage: its matmuls (the
    layer slots' apart) and its attention per cached token."""
    matmul, attention = decode_flops(cfg, tp, pp)
    _, per_layer = matmul_flops_split(cfg, tp)
    return {"matmul_flops_per_token": matmul,
            "layer_matmul_flops_per_token": pipeline_plan.stage_sum(cfg, pp, per_layer),
            "attention_flops_per_context_token": attention}


def _moe_fields(cfg: ModelConfig, dtype: str, tp: int, quantization: str | None,
                expert_parallel: bool, pp: int = 1) -> dict:
    """MemoryPlan's parameter counts and, for a mixture of experts, its routing and the
    experts' bytes on one device."""
    total, active = param_counts(cfg)
    out = {"total_params": total, "active_params": active}
    if cfg.moe is None:
        return out
    return out | {"expert_weight_bytes": expert_weight_bytes(cfg, dtype, tp, quantization,
                                                           expert_parallel, pp),
                  "num_experts": cfg.moe.num_experts,
                  "experts_per_token": cfg.moe.num_experts_per_tok}
