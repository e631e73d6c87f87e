"""The body of the TPU ragged paged attention kernel, what one program (request slot,
group of KV heads) does: its query blocks, double-buffered copies of whole KV words
per KV block into VMEM, K and V unpacked (tpu_words.py) and scaled, and an online
softmax per KV head started from the sinks. See docs/kernels.md#the-tpu-kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxinfer.pallas import tpu_words


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassConfig:
    """Static settings of one pass (hashable: a `functools.partial` argument)."""

    decode: bool  # the decode pass (q_len == 1) or the prefill pass (q_len > 1)
    q_block: int  # tokens per query block (1 in the decode pass)
    heads_per_kv: int  # R = N / G
    page_size: int  # K
    pages_per_block: int
    pages_per_seq: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    mask_value: float
    k_scale: float | None
    v_scale: float | None
    heads_per_program: int  # KV heads one program serves: max(1, packing * fold // 2)
    words_per_program: int  # words of each token it copies: max(1, 2 // (packing * fold))
    scaled: bool = False  # kv_scales given: a scale per token and combined head
    sinks: bool = False  # sinks given: a softmax sink logit per query head (SMEM)

    @property
    def kv_block(self) -> int:
        return self.pages_per_block * self.page_size


class _Refs(NamedTuple):
    page_table: Any  # SMEM i32[S * pages_per_seq]
    queries: Any  # HBM f[T + bq, Gp, R, H], Gp = programs * heads_per_program
    kv_pages: Any  # HBM [P, K, W, packing, L]
    out: Any  # HBM f[T + bq, Gp, R, H]
    q_buf: Any  # VMEM f[bq, heads_per_program, R, H]
    o_buf: Any  # VMEM f[bq, heads_per_program, R, H]
    kv_buf: Any  # VMEM [2 slots, words_per_program, kv_block, packing, L]
    kv_sems: Any  # DMA semaphores [2], one per KV slot
    io_sems: Any  # DMA semaphores [2]: query copy, output copy
    scales: Any = None  # HBM f32[P, K, C] (kv_scales), or None
    s_buf: Any = None  # VMEM f32[2 slots, kv_block, C], or None
    sinks: Any = None  # SMEM f32[Gp * R], or None


class _Request(NamedTuple):
    """Scalars of the request slot and KV-head group a program works on."""

    slot: jax.Array
    group: jax.Array  # program index along the heads: heads [group * hpp, + hpp)
    q_start: jax.Array
    q_len: jax.Array
    kv_len: jax.Array


class _KeyRange(NamedTuple):
    """Keys one query block can see: [lo, hi) with 0 <= lo < hi <= kv_len."""

    lo: jax.Array
    hi: jax.Array


def kernel(kv_lens_ref: Any, page_table_ref: Any, cu_q_lens_ref: Any, num_seqs_ref: Any,
           *refs: Any, cfg: PassConfig) -> None:
    """Program (request slot, KV-head group): every query block of the request, if ours.
    `refs`: [the sinks (scalar prefetch),] q, kv pages, [kv scales,] the aliased out (the
    same buffer as out), out, q_buf, o_buf, kv_buf, kv_sems, io_sems[, s_buf]."""
    sinks_ref, refs = (refs[0], refs[1:]) if cfg.sinks else (None, refs)
    if cfg.scaled:
        q_hbm, kv_hbm, s_hbm, _, o_hbm, *scratch, s_buf = refs
    else:
        (q_hbm, kv_hbm, _, o_hbm, *scratch), s_hbm, s_buf = refs, None, None
    refs = _Refs(page_table_ref, q_hbm, kv_hbm, o_hbm, *scratch, scales=s_hbm, s_buf=s_buf,
                 sinks=sinks_ref)
    slot, group = pl.program_id(0), pl.program_id(1)
    q_start = cu_q_lens_ref[slot]
    q_len = cu_q_lens_ref[slot + 1] - q_start
    ours = (q_len == 1) if cfg.decode else (q_len > 1)

    @pl.when(jnp.logical_and(slot < num_seqs_ref[0], ours))
    def _run() -> None:
        req = _Request(slot, group, q_start, q_len, kv_lens_ref[slot])
        num_blocks = 1 if cfg.decode else _cdiv(q_len, cfg.q_block)

        def body(j: jax.Array, carry: int) -> int:
            _query_block(refs, req, j, cfg)
            return carry

        lax.fori_loop(0, num_blocks, body, 0)


def _query_block(refs: _Refs, req: _Request, j: jax.Array, cfg: PassConfig) -> None:
    """Attention of query block j of `req` for the program's KV heads, into `refs.out`.

    The copies move whole blocks of `q_block` tokens, so the last block of a request
    may spill past its end: it reads later tokens' queries (or the padding at the end of
    the queries) and writes zeros to those rows. That is safe because both grid axes are
    sequential and rows only spill forward: any later request's rows are rewritten
    afterwards by a later program of this pass or by the decode pass, and rows past the
    last request are padding. Each output copy is awaited before the next one starts.
    """
    first = j * cfg.q_block  # index of the block's first token within the request
    t0 = req.q_start + first
    heads = pl.ds(req.group * cfg.heads_per_program, cfg.heads_per_program)
    q_copy = pltpu.make_async_copy(refs.queries.at[pl.ds(t0, cfg.q_block), heads],
                                   refs.q_buf, refs.io_sems.at[0])
    q_copy.start()
    first_pos = req.kv_len - req.q_len + first  # KV position of the block's first query
    hi = jnp.minimum(req.kv_len, first_pos + cfg.q_block)
    lo = jnp.zeros_like(hi)
    if cfg.sliding_window is not None:
        lo = jnp.maximum(first_pos - cfg.sliding_window + 1, 0)
    keys = _KeyRange(lo, hi)
    kb_lo, kb_hi = lax.div(lo, cfg.kv_block), _cdiv(hi, cfg.kv_block)

    @pl.when(kb_lo < kb_hi)
    def _prefetch() -> None:
        _kv_copies(refs, req, keys, kb_lo, 0, cfg, lambda c: c.start())

    q_copy.wait()
    # f[bq * R, H] per KV head of the program, row = token * R + query head
    qs = [tpu_words.fold(refs.q_buf[:, h]) for h in range(cfg.heads_per_program)]

    def body(kb: jax.Array, carry: tuple[tuple[jax.Array, ...], ...]
             ) -> tuple[tuple[jax.Array, ...], ...]:
        slot = lax.rem(kb - kb_lo, 2)

        @pl.when(kb + 1 < kb_hi)
        def _next() -> None:  # double buffering: fetch block kb + 1 while computing kb
            _kv_copies(refs, req, keys, kb + 1, 1 - slot, cfg, lambda c: c.start())

        _kv_copies(refs, req, keys, kb, slot, cfg, lambda c: c.wait())
        words = [pltpu.bitcast(refs.kv_buf[slot, w], jnp.uint32).reshape(cfg.kv_block, -1)
                 for w in range(cfg.words_per_program)]  # u32[kv_block, H] each
        return tuple(
            _online_softmax(q, *tpu_words.unpack_kv(words, h, refs.kv_buf.dtype,
                                                    q.shape[1]), carry[h],
                            kb * cfg.kv_block, first_pos, keys, cfg,
                            _scales(refs, slot, req.group * cfg.heads_per_program + h, cfg))
            for h, q in enumerate(qs))

    carry = lax.fori_loop(kb_lo, kb_hi, body, _init_carry(refs, req, *qs[0].shape, cfg))
    _write_block(refs, carry, req.q_len - first, refs.out.at[pl.ds(t0, cfg.q_block), heads],
                 cfg)


def _init_carry(refs: _Refs, req: _Request, rows: int, head_dim: int, cfg: PassConfig
                ) -> tuple[tuple[jax.Array, ...], ...]:
    """(running max, sum, acc) of each of the program's KV heads before the first KV block.

    A sink is one more logit with no value. Starting a row's running max at its head's
    sink and its sum at exp(sink - sink) = 1 makes every later rescale carry the sink:
    exact (the max is over keys and sink, as in transformers) and free inside the KV
    loop. Row token * R + r belongs to query head r of its KV head.
    """
    if not cfg.sinks:
        init = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
                jnp.zeros((rows, head_dim), jnp.float32))
        return (init,) * cfg.heads_per_program
    head_of_row = lax.rem(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), cfg.heads_per_kv)
    carries = []
    for h in range(cfg.heads_per_program):
        first = (req.group * cfg.heads_per_program + h) * cfg.heads_per_kv
        m = jnp.full((rows, 1), refs.sinks[first], jnp.float32)
        for r in range(1, cfg.heads_per_kv):  # R static selects, once per query block
            m = jnp.where(head_of_row == r, refs.sinks[first + r], m)
        carries.append((m, jnp.ones((rows, 1), jnp.float32),
                        jnp.zeros((rows, head_dim), jnp.float32)))
    return tuple(carries)


def _scales(refs: _Refs, slot: jax.Array, head: jax.Array, cfg: PassConfig) -> tuple:
    """(K scale, V scale) of KV head `head` for the block in `slot`: per-token columns
    (tpu_words.scale_columns), or the scalar scales."""
    if not cfg.scaled:
        return cfg.k_scale, cfg.v_scale
    return tpu_words.scale_columns(refs.s_buf[slot], head)


def _write_block(refs: _Refs, carry: tuple[tuple[jax.Array, ...], ...], valid: jax.Array,
                 dst: Any, cfg: PassConfig) -> None:
    """Normalise each head's accumulator, zero rows of tokens past `valid` (spilled rows),
    and copy the block to `dst`, waiting for the copy."""
    for h, (_, l, acc) in enumerate(carry):
        out = acc / jnp.where(l == 0.0, 1.0, l)
        token = lax.div(lax.broadcasted_iota(jnp.int32, out.shape, 0), cfg.heads_per_kv)
        out = jnp.where(token < valid, out, 0.0)
        refs.o_buf[:, h] = out.reshape(refs.o_buf.shape[0], *refs.o_buf.shape[2:]).astype(
            refs.o_buf.dtype)
    o_copy = pltpu.make_async_copy(refs.o_buf, dst, refs.io_sems.at[1])
    o_copy.start()
    o_copy.wait()


def _kv_copies(refs: _Refs, req: _Request, keys: _KeyRange, kb: jax.Array, slot: jax.Array,
               cfg: PassConfig, action: Callable[[Any], None]) -> None:
    """Start or wait for the copies of KV block kb (the program's words) into `slot`.

    Only pages holding keys in [keys.lo, keys.hi) are copied; the rest of the slot keeps
    stale data, which `_online_softmax` masks out (scores and V rows).
    """
    page_lo = lax.div(keys.lo, cfg.page_size)
    page_hi = _cdiv(keys.hi, cfg.page_size)
    for p in range(cfg.pages_per_block):
        page = kb * cfg.pages_per_block + p
        copy = functools.partial(_copy_page, refs, req, page, p, slot, cfg, action)
        pl.when(jnp.logical_and(page >= page_lo, page < page_hi))(copy)


def _copy_page(refs: _Refs, req: _Request, page: jax.Array, p: int, slot: jax.Array,
               cfg: PassConfig, action: Callable[[Any], None]) -> None:
    """Start or wait for the copies of the program's words of one page into row block p."""
    physical = refs.page_table[req.slot * cfg.pages_per_seq + page]
    rows = pl.ds(p * cfg.page_size, cfg.page_size)
    for w in range(cfg.words_per_program):
        src = refs.kv_pages.at[physical, :, req.group * cfg.words_per_program + w]  # [K, pk, H]
        action(pltpu.make_async_copy(src, refs.kv_buf.at[slot, w, rows], refs.kv_sems.at[slot]))
    if cfg.scaled:  # the page's scales of every head: [K, C], a whole-page copy
        action(pltpu.make_async_copy(refs.scales.at[physical], refs.s_buf.at[slot, rows],
                                     refs.kv_sems.at[slot]))


def _online_softmax(
    q: jax.Array,  # f[rows, H]
    k: jax.Array,  # [kv_block, H]
    v: jax.Array,  # [kv_block, H]
    carry: tuple[jax.Array, ...],  # running max f32[rows, 1], sum f32[rows, 1], acc
    kv_start: jax.Array,  # KV position of the block's first key
    first_pos: jax.Array,  # KV position of the query block's first token
    keys: _KeyRange,
    cfg: PassConfig,
    scales: tuple[jax.Array | float | None, jax.Array | float | None],  # K, V (_scales)
) -> tuple[jax.Array, ...]:
    """Fold one KV block into the running softmax of the query rows."""
    m_prev, l_prev, acc_prev = carry
    k = tpu_words.dequantize(k, scales[0], q.dtype)
    v = tpu_words.dequantize(v, scales[1], q.dtype)
    key_row = kv_start + lax.broadcasted_iota(jnp.int32, v.shape, 0)
    v = jnp.where((key_row >= keys.lo) & (key_row < keys.hi), v, 0)  # stale slots: NaN*0
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * cfg.sm_scale
    if cfg.soft_cap is not None:
        s = cfg.soft_cap * jnp.tanh(s / cfg.soft_cap)
    shape = s.shape
    key_pos = kv_start + lax.broadcasted_iota(jnp.int32, shape, 1)
    q_pos = first_pos + lax.div(lax.broadcasted_iota(jnp.int32, shape, 0), cfg.heads_per_kv)
    visible = (key_pos <= q_pos) & (key_pos < keys.hi)
    if cfg.sliding_window is not None:
        visible &= key_pos > q_pos - cfg.sliding_window
    s = jnp.where(visible, s, cfg.mask_value)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next)
    l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)
    return m_next, l_next, alpha * acc_prev + pv


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    """Ceil division of a non-negative scalar (lax.div: no sign fix-ups to lower)."""
    return lax.div(a + (b - 1), b)
