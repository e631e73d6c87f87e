"""Pure-jnp twins of the Pallas kernels, the path the engine runs on CPU:
`ragged_paged_attention` with an online softmax over KV blocks only as far as the
longest KV of the step, every token gathering its own request's pages; bfloat16 pages
stored as uint16 bits on CPU (`BF16_STORAGE`). See docs/kernels.md (#the-entry-point,
#kv-layout).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxinfer.pallas import kv_layout
from jaxinfer.pallas.online_softmax import (
    DEFAULT_MASK_VALUE,
    KV_BLOCK_TOKENS,
    init_carry,
    kv_block_update,
)
from jaxinfer.pallas.settings import DEFAULT_SETTINGS, AttentionSettings

GATHER_BYTES_PER_BLOCK = 64 * 1024 * 1024  # bound on KV gathered per token block
QUERY_BLOCK = 64  # query rows per loop item when a step holds prefill chunks
BF16_STORAGE = jnp.uint16  # page dtype that stores bfloat16 bits (see the module doc)


def write_kv_pages(
    kv_pages: jax.Array,  # [P, K, W, packing, L]
    new_k: jax.Array,  # [T, G, H]
    new_v: jax.Array,  # [T, G, H]
    slot_mapping: jax.Array,  # i32[T], page * K + offset; padding rows -> page 0
    *,
    k_scale: float | None = None,
    v_scale: float | None = None,
    word_rows: bool = False,
) -> jax.Array:
    """Scatter this step's K/V into their page slots, K/V interleaved on heads (padded
    combined heads written as zeros). `word_rows` (the compiled TPU kernel's path): the
    same write as rows of the [P * K * W, packing, L] view, which libtpu keeps in the
    kernel's layout where it picks the pages' own, in loops (docs/aot.md)."""
    page_size, words = kv_pages.shape[1], kv_pages.shape[2]
    tokens, num_kv_heads, head_dim = new_k.shape
    new_k = _quantize(new_k, k_scale, kv_pages.dtype)
    new_v = _quantize(new_v, v_scale, kv_pages.dtype)
    kv = jnp.stack([new_k, new_v], axis=2).reshape(tokens, 2 * num_kv_heads, head_dim)
    padding = kv_layout.padded_heads(kv_pages, head_dim) - 2 * num_kv_heads
    kv = jnp.pad(kv, ((0, 0), (0, padding), (0, 0)))
    if kv_pages.dtype == BF16_STORAGE:
        kv = jax.lax.bitcast_convert_type(kv, BF16_STORAGE)
    if not word_rows:
        return kv_pages.at[slot_mapping // page_size, slot_mapping % page_size].set(
            kv.reshape(tokens, *kv_pages.shape[2:]), mode="drop")
    rows = (slot_mapping[:, None] * words + jnp.arange(words, dtype=jnp.int32)).reshape(-1)
    return kv_pages.reshape(-1, *kv_pages.shape[3:]).at[rows].set(
        kv.reshape(tokens * words, *kv_pages.shape[3:]), mode="drop").reshape(kv_pages.shape)


def _quantize(x: jax.Array, scale: float | None, dtype: jnp.dtype) -> jax.Array:
    if dtype == BF16_STORAGE:
        return x.astype(jnp.bfloat16)
    if scale is not None:
        x = x.astype(jnp.float32) / scale
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        x = jnp.clip(jnp.round(x), info.min, info.max)
    return x.astype(dtype)


def ragged_paged_attention(
    queries: jax.Array,  # f[T, N, H]
    kv_pages: jax.Array,  # [P, K, W, packing, L]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[1]
    settings: AttentionSettings = DEFAULT_SETTINGS,
    *,
    kv_scales: jax.Array | None = None,  # f32[P, K, 2G]: per token and head (kv_quant.py)
    sinks: jax.Array | None = None,  # f32[N]: a softmax sink logit per query head
) -> jax.Array:  # f[T, N, H]
    """Attention of each token over the paged KV of its own request. `max_q_len`
    (static): a promise that no request has more query tokens (decode buckets: 1;
    speculative verify buckets: k + 1), so each request slot gathers its KV once per
    block for all its queries and the per-request loop is not compiled; 0: any mix.
    `settings.impl` and `interpret` are the dispatcher's, unused here."""
    tokens, num_heads, head_dim = queries.shape
    page_size = kv_pages.shape[1]
    num_kv_heads = settings.num_kv_heads or kv_layout.padded_heads(kv_pages, head_dim) // 2
    kv_pages = kv_layout.combined_view(kv_pages, head_dim)  # [P, K, C, H], C >= 2G
    num_slots, pages_per_seq = page_indices.shape
    token = jnp.arange(tokens, dtype=jnp.int32)
    req = jnp.searchsorted(cu_q_lens[1:], token, side="right").astype(jnp.int32)
    req = jnp.minimum(req, num_slots - 1)  # i32[T]
    q_start = cu_q_lens[req]
    q_len = cu_q_lens[req + 1] - q_start
    kv_len = jnp.where(token < cu_q_lens[num_seqs[0]], kv_lens[req], 0)  # padding: none
    q_pos = kv_len - q_len + token - q_start  # i32[T], position of the query in its KV
    pages_per_block = _pages_per_block(KV_BLOCK_TOKENS, page_size, pages_per_seq)
    padded = _round_up(pages_per_seq, pages_per_block)
    padded_rows = jnp.pad(page_indices, ((0, 0), (0, padded - pages_per_seq)))
    mask_value = settings.mask_value
    block = dict(sm_scale=settings.sm_scale, sliding_window=settings.sliding_window,
                 soft_cap=settings.soft_cap,
                 mask_value=DEFAULT_MASK_VALUE if mask_value is None else mask_value,
                 k_scale=settings.k_scale, v_scale=settings.v_scale,
                 pages_per_block=pages_per_block, num_kv_heads=num_kv_heads,
                 kv_scales=kv_scales, sinks=sinks, fixed_order=settings.fixed_order)
    q_lens = jnp.where(jnp.arange(num_slots) < num_seqs[0], cu_q_lens[1:] - cu_q_lens[:-1], 0)
    # Single-token requests in the first `prefix` rows (decodes, which engines put first)
    # gather per token; every other request goes by blocks of its queries, gathering its
    # KV once per block. Each path leaves the other's rows at zero.
    if settings.max_q_len:
        return _attend_by_slots(queries, padded_rows, kv_lens, cu_q_lens, q_lens,
                                settings.max_q_len, kv_pages, **block)
    prefix = min(num_slots, tokens)
    by_token = (q_lens == 1) & (cu_q_lens[:-1] < prefix)  # bool[S]
    mine = by_token[req[:prefix]]
    rows = padded_rows[req[:prefix]]  # i32[prefix, padded]
    out = _attend_by_tokens(queries[:prefix], rows, jnp.where(mine, kv_len[:prefix], 0),
                            q_pos[:prefix], kv_pages, **block)
    out = jnp.pad(out, ((0, tokens - prefix), (0, 0), (0, 0)))
    return out + _attend_by_requests(queries, kv_pages, kv_lens, padded_rows, cu_q_lens,
                                     jnp.where(by_token, 0, q_lens), **block)


def _attend_by_tokens(queries: jax.Array, rows: jax.Array, kv_len: jax.Array,
                      q_pos: jax.Array, kv_pages: jax.Array, **settings: object) -> jax.Array:
    """Every token gathers its own request's pages (cheap when each request has 1 token)."""
    tokens, num_heads, head_dim = queries.shape
    block_bytes = settings["pages_per_block"] * math.prod(kv_pages.shape[1:]) * 4
    block = _token_block(tokens, block_bytes)

    def attend_block(xs: tuple[jax.Array, ...]) -> jax.Array:
        return _attend_tokens(*xs, kv_pages, **settings)

    xs = (queries, rows, kv_len, q_pos)
    if block == tokens:
        return attend_block(xs)
    blocked = jax.tree.map(lambda x: x.reshape(tokens // block, block, *x.shape[1:]), xs)
    out = jax.lax.map(attend_block, blocked)
    return out.reshape(tokens, num_heads, head_dim)


def _attend_by_slots(queries: jax.Array, rows: jax.Array, kv_lens: jax.Array,
                     cu_q_lens: jax.Array, q_lens: jax.Array, max_q_len: int,
                     kv_pages: jax.Array, **settings: object) -> jax.Array:
    """Each slot's (at most `max_q_len`) queries at once over its KV, gathered once per
    block for all of them (`_attend_tokens` with a slot's queries as extra query heads);
    rows no slot owns (padding) stay zero."""
    tokens, num_heads, head_dim = queries.shape
    j = jnp.arange(max_q_len, dtype=jnp.int32)
    valid = j[None, :] < q_lens[:, None]  # [S, Q]
    token_rows = jnp.where(valid, cu_q_lens[:-1, None] + j[None, :], tokens)
    q = jnp.take(queries, token_rows, axis=0, mode="fill", fill_value=0)  # [S, Q, N, H]
    q_pos = kv_lens[:, None] - q_lens[:, None] + j[None, :]  # [S, Q]
    kv_len = jnp.where(q_lens > 0, kv_lens, 0)
    out = _attend_tokens(q, rows, kv_len, q_pos, kv_pages, **settings)  # [S, Q, N, H]
    out = jnp.zeros((tokens + 1, num_heads, head_dim), out.dtype).at[
        token_rows.reshape(-1)].set(out.reshape(-1, num_heads, head_dim), mode="drop")
    return out[:tokens]


def _attend_by_requests(
    queries: jax.Array,  # f[T, N, H]
    kv_pages: jax.Array,  # [P, K, C, H], C >= 2G
    kv_lens: jax.Array,  # i32[S]
    rows: jax.Array,  # i32[S, padded pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S + 1]
    q_lens: jax.Array,  # i32[S], 0 past num_seqs
    *,
    pages_per_block: int,
    mask_value: float,
    num_kv_heads: int,
    sinks: jax.Array | None,
    **settings: float | int | None,
) -> jax.Array:
    """One loop item per (request, block of its queries): the block's KV is gathered once.

    Requests with `q_lens` 0 are skipped. Items run in order and write whole query
    blocks; a request's last block spills zeros into the rows after it, which later
    items overwrite, and which hold zeros if another path owns them.
    """
    tokens, num_heads, head_dim = queries.shape
    block_q, block_kv = QUERY_BLOCK, pages_per_block * kv_pages.shape[1]
    shape = (block_q, num_kv_heads, num_heads // num_kv_heads, head_dim)
    padded = jnp.pad(queries, ((0, block_q), (0, 0), (0, 0))).reshape(tokens + block_q,
                                                                       *shape[1:])
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)

    def item(j: jax.Array, out: jax.Array) -> jax.Array:
        i = jnp.searchsorted(ends, j, side="right")
        first = (j - ends[i] + blocks[i]) * block_q  # first query of the block
        row = cu_q_lens[i] + first
        qg = jax.lax.dynamic_slice(padded, (row, 0, 0, 0), shape)
        local = first + jnp.arange(block_q, dtype=jnp.int32)
        q_pos = kv_lens[i] - q_lens[i] + local
        kv_len = jnp.where(local < q_lens[i], kv_lens[i], 0)

        def body(b: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            pages = jax.lax.dynamic_slice_in_dim(rows[i], b * pages_per_block, pages_per_block)
            pos = b * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
            k, v = _gather_kv(kv_pages, pages, num_kv_heads, settings["k_scale"],
                              settings["v_scale"], settings["kv_scales"])
            return kv_block_update(carry, qg, k, v, pos, kv_len, q_pos,
                                    mask_value=mask_value, **settings)

        init = init_carry(shape, mask_value, sinks)
        needed = jnp.minimum(kv_lens[i], q_pos[-1] + 1)
        _, total, acc = jax.lax.fori_loop(0, (needed + block_kv - 1) // block_kv, body, init)
        result = acc / jnp.where(total > 0, total, 1.0)[..., None]
        return jax.lax.dynamic_update_slice(out, result, (row, 0, 0, 0))

    out = jnp.zeros((tokens + block_q, *shape[1:]), jnp.float32)
    out = jax.lax.fori_loop(0, ends[-1], item, out)
    return out[:tokens].reshape(tokens, num_heads, head_dim).astype(queries.dtype)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pages_per_block(block_tokens: int, page_size: int, pages_per_seq: int) -> int:
    return min(pages_per_seq, max(1, block_tokens // page_size))


def _token_block(tokens: int, bytes_per_token: int) -> int:
    """All tokens if their gathered KV fits the budget, else a power-of-two divisor."""
    if tokens * bytes_per_token <= GATHER_BYTES_PER_BLOCK:
        return tokens
    block = tokens & -tokens  # largest power of two dividing `tokens`
    while block > 1 and block * bytes_per_token > GATHER_BYTES_PER_BLOCK:
        block //= 2
    return block


def _attend_tokens(
    q: jax.Array,  # f[Tb, N, H], or f[Tb, Q, N, H]: Q queries over each row's KV
    rows: jax.Array,  # i32[Tb, pages]: each token's page row, padded to whole KV blocks
    kv_len: jax.Array,  # i32[Tb]
    q_pos: jax.Array,  # i32[Tb] (or i32[Tb, Q])
    kv_pages: jax.Array,  # [P, K, C, H], C >= 2G
    *,
    pages_per_block: int,
    mask_value: float,
    num_kv_heads: int,
    sinks: jax.Array | None,
    **settings: float | int | None,
) -> jax.Array:
    """Online softmax over KV blocks, only as many blocks as the longest KV needs; a
    row's Q queries ride along as extra query heads of each KV head."""
    shape_in = q.shape
    if q.ndim == 3:
        q, q_pos = q[:, None], q_pos[:, None]
    tokens, num_queries, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    qg = q.reshape(tokens, num_queries, num_kv_heads, group, head_dim).transpose(
        0, 2, 1, 3, 4).reshape(tokens, num_kv_heads, num_queries * group, head_dim)
    block_tokens = pages_per_block * kv_pages.shape[1]
    num_blocks = (jnp.max(kv_len) + block_tokens - 1) // block_tokens

    def body(b: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        pages = jax.lax.dynamic_slice_in_dim(rows, b * pages_per_block, pages_per_block, 1)
        pos = b * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        k, v = _gather_kv(kv_pages, pages, num_kv_heads, settings["k_scale"],
                          settings["v_scale"], settings["kv_scales"])
        return kv_block_update(carry, qg, k, v, pos, kv_len, q_pos, mask_value=mask_value,
                                **settings)

    init = init_carry(qg.shape, mask_value, sinks)
    _, total, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]  # padding rows: 0
    out = out.reshape(tokens, num_kv_heads, num_queries, group, head_dim).transpose(
        0, 2, 1, 3, 4)
    return out.reshape(shape_in).astype(q.dtype)


def _gather_kv(kv_pages: jax.Array, pages: jax.Array, num_kv_heads: int,
               k_scale: float | None, v_scale: float | None,
               kv_scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """K and V of `pages` i32[..., n] as f32[..., n * K, G, H] each, gathered apart;
    8-bit rows times their scalar scale or their own scale in `kv_scales` f32[P, K, 2G]."""
    num_pages, page_size, combined, head_dim = kv_pages.shape
    view = kv_pages.reshape(num_pages, page_size, combined // 2, 2, head_dim)

    def half(index: int, scale: float | None) -> jax.Array:
        # [..., n, K, G, H]: one gather of K or V rows of the real heads only
        x = view[pages, :, :num_kv_heads, index]
        if x.dtype == BF16_STORAGE:
            x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
        x = _dequantize(x, scale, jnp.float32)
        if kv_scales is not None:  # [..., n, K, G, 1]: each row's own scale
            rows = kv_scales.reshape(num_pages, page_size, -1, 2)[pages, :, :, index]
            x = x * rows[..., None]
        return x.reshape(*pages.shape[:-1], -1, num_kv_heads, head_dim)

    return half(0, k_scale), half(1, v_scale)


def _dequantize(x: jax.Array, scale: float | None, dtype: jnp.dtype) -> jax.Array:
    if scale is None:
        return x.astype(dtype)
    return (x.astype(jnp.float32) * scale).astype(dtype)
