"""Ragged paged attention for GPUs: a Pallas kernel with the Triton lowering, the
reference's contract. Grid (query block, KV head, KV split), a jnp prologue cutting
requests into query blocks (`_block_table`), split-K partials merged in jnp
(`_combine`), tuning in `GpuTuning` / `choose_tuning`. See docs/kernels.md#the-gpu-kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxinfer.pallas import kv_layout
from jaxinfer.pallas.settings import DEFAULT_SETTINGS, AttentionSettings

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
META_FIELDS = 5  # per query block: request, first token, tokens, first q_pos, kv_len
MIN_DOT_DIM = 16  # Triton's dot needs every operand dim >= 16
Ref = Any  # a Pallas ref inside the kernel


# ----------------------------------------------------------------------------- tuning


@dataclasses.dataclass(frozen=True, kw_only=True)
class GpuTuning:
    """Block sizes and launch settings of the GPU kernel (all powers of two)."""

    block_rows: int = 16  # query rows (tokens x R heads) per program, >= 16
    block_kv: int = 64  # KV tokens per inner step, >= 16
    k_splits: int = 1  # programs sharing one query block's KV range
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_rows", "block_kv", "k_splits", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a positive power of two")
        for name in ("block_rows", "block_kv"):
            if getattr(self, name) < MIN_DOT_DIM:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {MIN_DOT_DIM}")


DECODE_BLOCK_ROWS = 16  # decode buckets: one request per program, R rows used
PREFILL_BLOCK_ROWS = 64  # buckets with prefill chunks: fewer re-reads of KV
TARGET_PROGRAMS = 256  # about two waves of programs on a 100-SM GPU
MIN_KV_PER_SPLIT = 256  # do not split KV ranges shorter than this
MAX_K_SPLITS = 16
MAX_KV_ROW_BYTES = 256  # bf16 x 128 takes 64-token KV tiles, f32 x 128 takes 32


def choose_tuning(*, tokens: int, slots: int, context: int, num_kv_heads: int, head_dim: int,
                  itemsize: int) -> GpuTuning:
    """Static tuning for a bucket: T tokens, S slots, context = pages_per_seq * K.

    `itemsize` is the query dtype's: K/V tiles are converted to it, and wide
    rows (f32 x 128) get shorter KV tiles to stay under ~100 KB of shared memory.
    """
    decode = tokens <= slots
    block_kv = 64 if head_dim * itemsize <= MAX_KV_ROW_BYTES else 32
    programs = min(tokens, slots) * num_kv_heads  # query blocks of a decode-heavy step
    splits = 1
    while (splits < MAX_K_SPLITS and programs * splits < TARGET_PROGRAMS
           and context // (2 * splits) >= MIN_KV_PER_SPLIT):
        splits *= 2
    return GpuTuning(block_rows=DECODE_BLOCK_ROWS if decode else PREFILL_BLOCK_ROWS,
                     block_kv=block_kv, k_splits=splits, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------- prologue


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _block_table(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, *,
                 tokens: int, bq: int) -> jax.Array:
    """i32[NB, META_FIELDS]: which tokens each query block covers, and their KV.

    Real requests are cut into blocks of `bq` tokens; tokens past the last real
    one form a pseudo-request with kv_len 0. NB bounds sum(cdiv(q_len, bq)).
    """
    slots = kv_lens.shape[0]
    num_blocks = (tokens + (slots + 1) * (bq - 1)) // bq
    real = jnp.arange(slots) < num_seqs[0]
    starts = jnp.clip(cu_q_lens[:-1], 0, tokens)
    q_lens = jnp.where(real, jnp.clip(cu_q_lens[1:], 0, tokens) - starts, 0)
    total = jnp.clip(cu_q_lens[num_seqs[0]], 0, tokens)
    starts = jnp.append(starts, total)
    q_lens = jnp.append(jnp.maximum(q_lens, 0), tokens - total)  # [S + 1]
    kv = jnp.append(jnp.where(real, kv_lens, 0), 0)
    ends = jnp.cumsum((q_lens + bq - 1) // bq)  # block ids end per request
    j = jnp.arange(num_blocks, dtype=jnp.int32)
    req = jnp.minimum(jnp.searchsorted(ends, j, side="right"), slots)
    local = (j - ends[req] + (q_lens[req] + bq - 1) // bq) * bq  # first token in request
    ntok = jnp.where(j < ends[-1], jnp.clip(q_lens[req] - local, 0, bq), 0)
    meta = [jnp.minimum(req, slots - 1), starts[req] + local, ntok,
            kv[req] - q_lens[req] + local, kv[req]]
    return jnp.stack(meta, axis=1).astype(jnp.int32)


# ----------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Static:
    bq: int  # tokens per query block
    heads: int  # Rp: query heads per KV head, padded to a power of two
    block_kv: int
    k_splits: int
    page_size: int
    pages_per_seq: int
    scale: float  # sm_scale * k_scale
    v_scale: float
    sliding_window: int | None
    soft_cap: float | None
    mask_value: float
    scaled: bool = False  # kv_scales given: K and V rows times their own scales
    sinks: bool = False  # sinks given: f32[G, rows], each row's query-head sink


def _kv_range(q_pos0: jax.Array, ntok: jax.Array, kv_len: jax.Array, st: _Static,
              split: jax.Array) -> tuple[jax.Array, jax.Array]:
    """KV blocks [first, end) of this split that any row of the block can see."""
    hi = jnp.clip(q_pos0 + ntok, 0, kv_len)  # causal end of the last row
    lo = jnp.int32(0)
    if st.sliding_window is not None:
        lo = jnp.clip(q_pos0 - st.sliding_window + 1, 0, hi)  # window start, first row
    first, end = lo // st.block_kv, (hi + st.block_kv - 1) // st.block_kv
    per = (end - first + st.k_splits - 1) // st.k_splits
    start = first + split * per
    return start, jnp.maximum(jnp.minimum(start + per, end), start)


def _kv_step(kb: jax.Array, carry: tuple[jax.Array, ...], *, q: jax.Array, q_pos: jax.Array,
             req: jax.Array, kv_len: jax.Array, head: jax.Array, pi_ref: Ref,
             kv_ref: Ref, s_ref: Ref | None, st: _Static) -> tuple[jax.Array, ...]:
    """One online-softmax step over KV tokens [kb * block_kv, (kb + 1) * block_kv)."""
    acc, m, l = carry
    pos = kb * st.block_kv + jnp.arange(st.block_kv, dtype=jnp.int32)  # [Bk]
    page = pi_ref[req, jnp.minimum(pos // st.page_size, st.pages_per_seq - 1)]
    slot = pos % st.page_size
    k = kv_ref[page, slot, 2 * head, :]  # [Bk, H], gathered by page id
    v = kv_ref[page, slot, 2 * head + 1, :]
    if s_ref is not None:  # per-token scales f32[Bk], gathered the same way
        k = k.astype(jnp.float32) * s_ref[page, slot, 2 * head][:, None]
        v = v.astype(jnp.float32) * s_ref[page, slot, 2 * head + 1][:, None]
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    present = pos < kv_len
    v = jnp.where(present[:, None], v, 0)  # unused slots may hold NaN: 0 * NaN = NaN
    s = plgpu.dot(q, k, trans_b=True) * st.scale  # f32[rows, Bk]
    if st.soft_cap is not None:
        s = st.soft_cap * jnp.tanh(s / st.soft_cap)
    visible = present[None, :] & (pos[None, :] <= q_pos[:, None])
    if st.sliding_window is not None:
        visible &= pos[None, :] > q_pos[:, None] - st.sliding_window
    s = jnp.where(visible, s, st.mask_value)
    m_new = jnp.maximum(m, s.max(axis=1))
    correction = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = l * correction + p.sum(axis=1)
    acc = acc * correction[:, None] + plgpu.dot(p.astype(q.dtype), v)
    return acc, m_new, l


def _init_carry(sink_ref: Ref | None, head: jax.Array, split: jax.Array, rows: int,
                head_dim: int, st: _Static) -> tuple[jax.Array, ...]:
    """(acc, running max, sum) before the first KV block.

    A sink is one more logit with no value. Split 0 starts its running max at each row's
    sink and its sum at exp(sink - sink) = 1, so every later rescale, and `_combine`'s
    merge of the splits, carries it exactly (the max is over keys and sink, as in
    transformers). Only one split may hold it, or the merge would count it twice; an
    empty split 0 still hands it over (m = sink, l = 1, acc = 0).
    """
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    if not st.sinks:
        return acc, jnp.full((rows,), st.mask_value, jnp.float32), jnp.zeros((rows,), jnp.float32)
    sink = sink_ref[head, :]  # f32[rows]
    if st.k_splits == 1:
        return acc, sink, jnp.ones((rows,), jnp.float32)
    first = split == 0
    return (acc, jnp.where(first, sink, st.mask_value),
            jnp.where(first, jnp.ones((rows,), jnp.float32), 0.0))


def _kernel(meta_ref: Ref, pi_ref: Ref, q_ref: Ref, kv_ref: Ref, *refs: Ref,
            st: _Static) -> None:
    """One (query block, KV head, KV split) program; `refs`: [kv scales,] [sinks,]
    outputs."""
    s_ref, refs = (refs[0], refs[1:]) if st.scaled else (None, refs)
    sink_ref, out_refs = (refs[0], refs[1:]) if st.sinks else (None, refs)
    block, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    req, tok0, ntok, q_pos0, kv_len = (meta_ref[block, f] for f in range(META_FIELDS))
    rows, head_dim = st.bq * st.heads, q_ref.shape[-1]
    tok_ok = jnp.arange(st.bq, dtype=jnp.int32) < ntok  # [bq]
    tile = (pl.ds(tok0, st.bq), head, slice(None), slice(None))
    mask3 = jnp.broadcast_to(tok_ok[:, None, None], (st.bq, st.heads, head_dim))
    q = plgpu.load(q_ref.at[tile], mask=mask3, other=0).reshape(rows, head_dim)
    q_pos = q_pos0 + jnp.arange(rows, dtype=jnp.int32) // st.heads  # [rows]
    start, end = _kv_range(q_pos0, ntok, kv_len, st, split)
    init = _init_carry(sink_ref, head, split, rows, head_dim, st)
    step = functools.partial(_kv_step, q=q, q_pos=q_pos, req=req, kv_len=kv_len, head=head,
                             pi_ref=pi_ref, kv_ref=kv_ref, s_ref=s_ref, st=st)
    acc, m, l = jax.lax.fori_loop(start, end, step, init)
    if st.k_splits == 1:
        (o_ref,) = out_refs
        out = acc * (st.v_scale / jnp.where(l > 0, l, 1.0))[:, None]
        out = out.astype(o_ref.dtype).reshape(st.bq, st.heads, head_dim)
        plgpu.store(o_ref.at[tile], out, mask=mask3)
        return
    acc_ref, m_ref, l_ref = out_refs
    plgpu.store(acc_ref.at[(split, *tile)], acc.reshape(st.bq, st.heads, head_dim), mask=mask3)
    mask2 = jnp.broadcast_to(tok_ok[:, None], (st.bq, st.heads))
    for ref, value in ((m_ref, m), (l_ref, l)):
        plgpu.store(ref.at[split, pl.ds(tok0, st.bq), head, :],
                    value.reshape(st.bq, st.heads), mask=mask2)


def _combine(acc: jax.Array, m: jax.Array, l: jax.Array, v_scale: float,
             dtype: jnp.dtype) -> jax.Array:
    """Merge split partials: f32[Z, T, G, Rp, H], f32[Z, T, G, Rp] x2 -> [T, G, Rp, H]."""
    m_max = m.max(axis=0)
    weight = jnp.exp(m - m_max[None])  # empty splits have m = mask_value: weight 0
    l_sum = (weight * l).sum(axis=0)
    out = (weight[..., None] * acc).sum(axis=0)
    return (out * (v_scale / jnp.where(l_sum > 0, l_sum, 1.0))[..., None]).astype(dtype)


# ----------------------------------------------------------------------------- entry


def ragged_paged_attention(
    queries: jax.Array,  # f[T, N, H]
    kv_pages: jax.Array,  # [P, K, W, packing, L]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    settings: AttentionSettings = DEFAULT_SETTINGS,
    *,
    tuning: GpuTuning | None = None,
    kv_scales: jax.Array | None = None,  # f32[P, K, 2G]: per token and head
    sinks: jax.Array | None = None,  # f32[N]: a softmax sink logit per query head
) -> jax.Array:  # f[T, N, H]
    """Attention of each token over its own request's paged KV (see module doc);
    `settings.interpret` runs it in the Pallas interpreter."""
    tokens, num_heads, head_dim = queries.shape
    page_size = kv_pages.shape[1]
    slots, pages_per_seq = page_indices.shape
    num_kv_heads = settings.num_kv_heads or kv_layout.padded_heads(kv_pages, head_dim) // 2
    kv_pages = kv_layout.combined_view(kv_pages, head_dim)  # [P, K, C, H], C >= 2G
    if head_dim < MIN_DOT_DIM or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two >= {MIN_DOT_DIM} "
                         "for the GPU kernel")
    tuning = tuning or choose_tuning(tokens=tokens, slots=slots,
                                     context=pages_per_seq * page_size,
                                     num_kv_heads=num_kv_heads, head_dim=head_dim,
                                     itemsize=queries.dtype.itemsize)
    group = num_heads // num_kv_heads
    heads = _next_pow2(group)
    bq = max(1, tuning.block_rows // heads)
    k_scale, v_scale, mask_value = settings.k_scale, settings.v_scale, settings.mask_value
    st = _Static(bq=bq, heads=heads, block_kv=tuning.block_kv, k_splits=tuning.k_splits,
                 page_size=page_size, pages_per_seq=pages_per_seq,
                 scale=settings.sm_scale * (1.0 if k_scale is None else k_scale),
                 v_scale=1.0 if v_scale is None else v_scale,
                 sliding_window=settings.sliding_window, soft_cap=settings.soft_cap,
                 mask_value=DEFAULT_MASK_VALUE if mask_value is None else mask_value,
                 scaled=kv_scales is not None, sinks=sinks is not None)
    q = queries.reshape(tokens, num_kv_heads, group, head_dim)
    if heads != group:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, heads - group), (0, 0)))
    meta = _block_table(cu_q_lens, kv_lens, num_seqs, tokens=tokens, bq=bq)
    kv = (kv_pages,) if kv_scales is None else (kv_pages, kv_scales)
    if sinks is not None:
        kv += (_sink_rows(sinks, num_kv_heads, heads, bq),)
    out = _call(meta, page_indices, q, *kv, st=st, tuning=tuning,
                interpret=settings.interpret)
    return out[:, :, :group].reshape(tokens, num_heads, head_dim)


def _sink_rows(sinks: jax.Array, num_kv_heads: int, heads: int, bq: int) -> jax.Array:
    """f32[G, bq * Rp]: the sink of each row of a query block (row t * Rp + r is query
    head r of its KV head; padded heads get 0 and are never written out)."""
    per_head = sinks.astype(jnp.float32).reshape(num_kv_heads, -1)
    per_head = jnp.pad(per_head, ((0, 0), (0, heads - per_head.shape[1])))
    return jnp.tile(per_head, (1, bq))


def _call(meta: jax.Array, page_indices: jax.Array, q: jax.Array, *kv: jax.Array,
          st: _Static, tuning: GpuTuning, interpret: bool) -> jax.Array:
    """Launch the kernel (and the split combine): f[T, G, Rp, H]; `kv`: the pages [, their
    scales] [, the sinks of each block row]."""
    _, num_kv_heads, heads, _ = q.shape
    splits = st.k_splits
    if splits == 1:
        out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
                     jax.ShapeDtypeStruct((splits, *q.shape[:3]), jnp.float32),
                     jax.ShapeDtypeStruct((splits, *q.shape[:3]), jnp.float32)]
    outs = pl.pallas_call(
        functools.partial(_kernel, st=st),
        grid=(meta.shape[0], num_kv_heads, splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps,
                                             num_stages=tuning.num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_gpu_bq{st.bq}_r{heads}_kv{st.block_kv}_z{splits}",
    )(meta, page_indices, q, *kv)
    if splits == 1:
        return outs[0]
    return _combine(*outs, st.v_scale, q.dtype)
