"""Ragged paged attention as a TPU (Mosaic) Pallas kernel, the host side: the tuning
constants and block sizes, the queries grouped by KV head and padded, and the two
`pallas_call`s (prefill, then decode) with their grid, scratch buffers and cost
estimate. The body each program runs is rpa_tpu_kernel.py. See
docs/kernels.md#the-tpu-kernel.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.pallas import kv_layout, rpa_tpu_kernel
from jaxinfer.pallas.rpa_tpu_kernel import PassConfig
from jaxinfer.pallas.settings import DEFAULT_SETTINGS, AttentionSettings

# --- Tuning (block sizes only; nothing below assumes particular values) ---------------
PREFILL_QUERY_ROWS = 128  # target query rows (tokens x R heads) per prefill block
KV_BLOCK_TOKENS = 128  # target keys per KV block, rounded to whole pages
# ---------------------------------------------------------------------------------------

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_F32_LOWEST = float(np.finfo(np.float32).min)


def block_sizes(heads_per_kv: int, page_size: int, pages_per_seq: int) -> tuple[int, int]:
    """(tokens per prefill query block, pages per KV block) from the tuning constants."""
    q_block = max(1, PREFILL_QUERY_ROWS // heads_per_kv)
    pages_per_block = min(pages_per_seq, max(1, KV_BLOCK_TOKENS // page_size))
    return q_block, pages_per_block


def heads_per_program(kv_pages: jax.Array, head_dim: int) -> int:
    """KV heads whose K and V share the words one program copies (see module doc)."""
    return max(1, _per_word(kv_pages, head_dim) // 2)


def _per_word(kv_pages: jax.Array, head_dim: int) -> int:
    """Combined heads in one word of every lane: packing * fold."""
    return kv_pages.shape[3] * kv_pages.shape[4] // head_dim


def ragged_paged_attention(
    queries: jax.Array,  # f[T, N, H]
    kv_pages: jax.Array,  # [P, K, W, packing, L]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    settings: AttentionSettings = DEFAULT_SETTINGS,
    *,
    kv_scales: jax.Array | None = None,  # f32[P, K, 2G]: per token and head
    sinks: jax.Array | None = None,  # f32[N]: a softmax sink logit per query head
) -> jax.Array:  # f[T, N, H]
    """Attention of each token over its own request's paged KV (inputs pre-validated).

    `settings.num_kv_heads` defaults to every combined head of the pages (W * packing /
    2). `settings.interpret=True` runs in the TPU interpreter with out-of-bounds reads
    raising; an `InterpretParams` is used as given (e.g. with `detect_races=True`).
    """
    tokens, num_heads, head_dim = queries.shape
    page_size = kv_pages.shape[1]
    num_kv_heads = settings.num_kv_heads or kv_layout.padded_heads(kv_pages, head_dim) // 2
    heads_per_kv = num_heads // num_kv_heads
    per_program = heads_per_program(kv_pages, head_dim)
    programs = -(-num_kv_heads // per_program)
    pages_per_seq = page_indices.shape[1]
    q_block, pages_per_block = block_sizes(heads_per_kv, page_size, pages_per_seq)
    mask_value = settings.mask_value
    mask_value = DEFAULT_MASK_VALUE if mask_value is None else max(mask_value, _F32_LOWEST)
    common = dict(heads_per_kv=heads_per_kv, page_size=page_size,
                  pages_per_block=pages_per_block, pages_per_seq=pages_per_seq,
                  sm_scale=float(settings.sm_scale), sliding_window=settings.sliding_window,
                  soft_cap=settings.soft_cap, mask_value=float(mask_value),
                  k_scale=settings.k_scale, v_scale=settings.v_scale,
                  heads_per_program=per_program,
                  words_per_program=max(1, 2 // _per_word(kv_pages, head_dim)),
                  scaled=kv_scales is not None, sinks=sinks is not None)
    # Token-major, heads grouped by KV head (padded to whole programs), `q_block` padding
    # tokens at the end so a fixed-size block copy starting at any real token stays in
    # bounds.
    grouped = queries.reshape(tokens, num_kv_heads, heads_per_kv, head_dim)
    grouped = jnp.pad(grouped, ((0, q_block), (0, programs * per_program - num_kv_heads),
                                (0, 0), (0, 0)))
    out = jnp.zeros_like(grouped)
    scalars = (kv_lens, page_indices.reshape(-1), cu_q_lens, num_seqs)
    if sinks is not None:  # f32[Gp * R]: padded programs' heads get 0, never written out
        scalars += (jnp.pad(sinks.astype(jnp.float32),
                            (0, (programs * per_program - num_kv_heads) * heads_per_kv)),)
    for decode in (False, True):
        cfg = PassConfig(decode=decode, q_block=1 if decode else q_block, **common)
        out = _attention_pass(cfg, scalars, grouped, kv_pages, kv_scales, out, tokens=tokens,
                              interpret=settings.interpret)
    out = out[:tokens, :num_kv_heads]
    return out.reshape(tokens, num_heads, head_dim)


def _attention_pass(cfg: PassConfig, scalars: tuple[jax.Array, ...], grouped: jax.Array,
                    kv_pages: jax.Array, kv_scales: jax.Array | None, out: jax.Array, *,
                    tokens: int, interpret: bool | pltpu.InterpretParams) -> jax.Array:
    """One pallas_call writing its requests' rows of `out` (aliased in place)."""
    _, padded_heads, heads_per_kv, head_dim = grouped.shape
    num_slots = scalars[0].shape[0]
    block = (cfg.q_block, cfg.heads_per_program, heads_per_kv, head_dim)
    packing = kv_pages.shape[3]
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    scratch = [
        pltpu.VMEM(block, grouped.dtype),  # q_buf
        pltpu.VMEM(block, grouped.dtype),  # o_buf
        pltpu.VMEM((2, cfg.words_per_program, cfg.kv_block, packing, kv_pages.shape[4]),
                   kv_pages.dtype),  # kv_buf
        pltpu.SemaphoreType.DMA((2,)),  # kv_sems
        pltpu.SemaphoreType.DMA((2,)),  # io_sems
    ]
    operands = [grouped, kv_pages]
    if cfg.scaled:  # s_buf: the scales of a KV block, whole pages (all heads) per slot
        operands.append(kv_scales)
        scratch.append(pltpu.VMEM((2, cfg.kv_block, kv_scales.shape[2]), jnp.float32))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(num_slots, padded_heads // cfg.heads_per_program),
        in_specs=[hbm] * (len(operands) + 1), out_specs=hbm, scratch_shapes=scratch)
    kernel = pl.pallas_call(
        functools.partial(rpa_tpu_kernel.kernel, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype),
        grid_spec=grid_spec,
        input_output_aliases={len(scalars) + len(operands): 0},  # `out` updated in place
        cost_estimate=_cost_estimate(cfg, grouped, kv_pages, tokens=tokens,
                                     num_slots=num_slots),
        # "arbitrary" (sequential) on both axes: see `rpa_tpu_kernel._query_block` on spills.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=_interpret_params(interpret),
        name="rpa_decode" if cfg.decode else "rpa_prefill",
    )
    return kernel(*scalars, *operands, out)


def _cost_estimate(cfg: PassConfig, grouped: jax.Array, kv_pages: jax.Array, *, tokens: int,
                   num_slots: int) -> pl.CostEstimate:
    """What XLA cannot see inside the kernel, as a bound: every request of the pass at
    the page table's full width (max_model_len), its KV read once per query block.
    The decode pass serves at most min(S, T) requests of one token; the prefill pass
    at most T tokens in ceil(T / bq) blocks."""
    heads, head_dim = grouped.shape[1] * grouped.shape[2], grouped.shape[3]
    context = cfg.pages_per_seq * cfg.page_size
    kv_token_bytes = math.prod(kv_pages.shape[2:]) * kv_pages.dtype.itemsize
    if cfg.scaled:  # f32 scales of every combined head beside the values
        kv_token_bytes += 4 * kv_layout.padded_heads(kv_pages, grouped.shape[3])
    if cfg.decode:
        queries = blocks = min(num_slots, tokens)
    else:
        queries, blocks = tokens, -(-tokens // cfg.q_block)
    q_bytes = 2 * queries * heads * head_dim * grouped.dtype.itemsize  # read and written
    return pl.CostEstimate(flops=4 * queries * heads * head_dim * context,
                           transcendentals=queries * heads * context,
                           bytes_accessed=blocks * context * kv_token_bytes + q_bytes)


def _interpret_params(interpret: bool | pltpu.InterpretParams) -> Any:
    if isinstance(interpret, pltpu.InterpretParams):
        return interpret
    return pltpu.InterpretParams(out_of_bounds_reads="raise") if interpret else False
