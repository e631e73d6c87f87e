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
import numpy as np

from jaxinfer.pallas import kv_layout
from jaxinfer.pallas.row_sum import row_sum
from jaxinfer.pallas.settings import DEFAULT_SETTINGS, AttentionSettings

DEFAULT_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
GATHER_BYTES_PER_BLOCK = 64 * 1024 * 1024  # bound on KV gathered per token block
# KV positions per step of the online softmax, one size on every path: the running max
# and sum are rescaled at block boundaries, so a size per path rounded a token's
# attention differently with the path its batching sent it down.
KV_BLOCK_TOKENS = 32
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
            return _kv_block_update(carry, qg, k, v, pos, kv_len, q_pos,
                                    mask_value=mask_value, **settings)

        init = _init_carry(shape, mask_value, sinks)
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
        return _kv_block_update(carry, qg, k, v, pos, kv_len, q_pos, mask_value=mask_value,
                                **settings)

    init = _init_carry(qg.shape, mask_value, sinks)
    _, total, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]  # padding rows: 0
    out = out.reshape(tokens, num_kv_heads, num_queries, group, head_dim).transpose(
        0, 2, 1, 3, 4)
    return out.reshape(shape_in).astype(q.dtype)


def _init_carry(shape: tuple[int, ...], mask_value: float, sinks: jax.Array | None
                ) -> tuple[jax.Array, ...]:
    """(running max, sum, acc) before the first KV block, for queries f[..., G, Q * R, H]
    (row q * R + r of KV head g is query head g * R + r).

    A sink is one more logit with no value. Starting the running max at it and the sum
    at exp(sink - sink) = 1 makes every later rescale carry it, so the result is exact
    (the max is taken over the keys and the sink, as in transformers), and the sum is
    never below 1, also for rows that see no key (their output stays 0).
    """
    if sinks is None:
        return (jnp.full(shape[:-1], mask_value, jnp.float32),
                jnp.zeros(shape[:-1], jnp.float32), jnp.zeros(shape, jnp.float32))
    num_kv_heads, rows = shape[-3], shape[-2]
    per_row = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, -1),
                       (1, rows * num_kv_heads // sinks.shape[0]))  # [G, Q * R]
    return (jnp.broadcast_to(per_row, shape[:-1]), jnp.ones(shape[:-1], jnp.float32),
            jnp.zeros(shape, jnp.float32))


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


def _kv_block_update(
    carry: tuple[jax.Array, ...],  # running max f32[Tb, G, R], sum f32[Tb, G, R], acc
    qg: jax.Array,  # f[Tb, G, R, H]
    k: jax.Array,  # f32[Tb, Cb, G, H] per token, or f32[Cb, G, H] shared by all rows
    v: jax.Array,  # like k
    pos: jax.Array,  # i32[Cb]: KV positions of this block
    kv_len: jax.Array,  # i32[Tb]
    q_pos: jax.Array,  # i32[Tb], or i32[Tb, Q]: R = Q x query heads per KV head
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    mask_value: float,
    k_scale: float | None,
    v_scale: float | None,
    kv_scales: jax.Array | None,
    fixed_order: bool = False,
) -> tuple[jax.Array, ...]:
    """One KV block of the online softmax, per-token KV or one block shared by all rows;
    `fixed_order`: its two dots as products summed by `row_sum`, whose rounding no
    shape changes (XLA:CPU's dots with a head_dim under 64 round by the batch)."""
    del k_scale, v_scale, kv_scales  # applied by _gather_kv
    running_max, total, acc = carry
    shared = k.ndim == 3
    present = pos[None, :] < kv_len[:, None]  # [Tb, Cb]: slots holding real KV
    v = jnp.where((present[0] if shared else present)[..., None, None], v, 0.0)  # NaN-safe
    # Scores as [Tb, G, R, Cb]: with these operand orders both dots lower to XLA:CPU's
    # fast (ynn) path; other orders fall back to a loop of small dots several times slower.
    spec = "tgrh,cgh->tgrc" if shared else "tgrh,tcgh->tgrc"
    if fixed_order:
        kt = (k.transpose(1, 0, 2) if shared else k.transpose(0, 2, 1, 3))[..., None, :, :]
        scores = row_sum(qg.astype(jnp.float32)[..., None, :] * kt) * sm_scale
    else:
        scores = jnp.einsum(spec, qg.astype(jnp.float32), k) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    q_pos = q_pos if q_pos.ndim == 2 else q_pos[:, None]  # [Tb, Q]
    visible = present[:, None, :] & (pos <= q_pos[..., None])  # [Tb, Q, Cb]
    if sliding_window is not None:
        visible &= pos > q_pos[..., None] - sliding_window
    tokens, num_queries, block = visible.shape
    if num_queries == 1:
        visible = visible[:, :, None, :]  # [Tb, 1, 1, Cb]
    else:  # [Tb, 1, Q x R, Cb]: query q's R heads share its row
        group = qg.shape[2] // num_queries
        visible = jnp.broadcast_to(visible[:, None, :, None, :], (
            tokens, 1, num_queries, group, block)).reshape(tokens, 1, -1, block)
    scores = jnp.where(visible, scores, mask_value)
    new_max = jnp.maximum(running_max, scores.max(axis=3))  # [Tb, G, R]
    probs = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
    scale = jnp.exp(running_max - new_max)
    total = total * scale + row_sum(probs)
    if fixed_order:  # [Tb, G, R, H, Cb] products, summed over the block's keys
        vt = (v.transpose(1, 2, 0) if shared else v.transpose(0, 2, 3, 1))[..., None, :, :]
        update = row_sum(probs[..., None, :] * vt)
    else:
        update = jnp.einsum("tgrc,cgh->tgrh" if shared else "tgrc,tcgh->tgrh", probs, v)
    return new_max, total, acc * scale[..., None] + update


def _dequantize(x: jax.Array, scale: float | None, dtype: jnp.dtype) -> jax.Array:
    if scale is None:
        return x.astype(dtype)
    return (x.astype(jnp.float32) * scale).astype(dtype)


def causal_attention_by_blocks(
    q: jax.Array,  # f32[B, T, N, H]
    k: jax.Array,  # f32[B, T, G, H]
    v: jax.Array,  # f32[B, T, G, H]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[N]
    fixed_order: bool = True,
) -> jax.Array:  # f32[B, T, N, H]
    """Causal attention over whole sequences with the paged path's arithmetic: the same
    online softmax over KV blocks of KV_BLOCK_TOKENS, each query with its own copy of
    the block's KV, so a token's output rounds as the engine's step rounds it (the
    batch-invariant dense forward, docs/rl.md#batch-invariant-mode)."""
    batch, tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    num_blocks = -(-tokens // KV_BLOCK_TOKENS)
    pad = ((0, 0), (0, num_blocks * KV_BLOCK_TOKENS - tokens), (0, 0), (0, 0))
    k, v = jnp.pad(k.astype(jnp.float32), pad), jnp.pad(v.astype(jnp.float32), pad)
    qg = q.reshape(batch * tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
    q_pos = jnp.tile(jnp.arange(tokens, dtype=jnp.int32), batch)
    kv_len = jnp.full((batch * tokens,), tokens, jnp.int32)
    carry = _init_carry(qg.shape, DEFAULT_MASK_VALUE, sinks)
    for b in range(num_blocks):
        pos = b * KV_BLOCK_TOKENS + jnp.arange(KV_BLOCK_TOKENS, dtype=jnp.int32)
        k_own, v_own = (_each_token_block(x, b, tokens) for x in (k, v))
        carry = _kv_block_update(carry, qg, k_own, v_own, pos, kv_len, q_pos,
                                 sm_scale=sm_scale, sliding_window=sliding_window,
                                 soft_cap=soft_cap, mask_value=DEFAULT_MASK_VALUE,
                                 k_scale=None, v_scale=None, kv_scales=None,
                                 fixed_order=fixed_order)
    _, total, acc = carry
    out = acc / jnp.where(total > 0, total, 1.0)[..., None]
    return out.reshape(batch, tokens, num_heads, head_dim)


def _each_token_block(x: jax.Array, block: int, tokens: int) -> jax.Array:
    """KV block `block` of x f32[B, T', G, H], one copy per query token:
    f32[B * tokens, KV_BLOCK_TOKENS, G, H] (the step's per-token gather)."""
    rows = x[:, None, block * KV_BLOCK_TOKENS:(block + 1) * KV_BLOCK_TOKENS]
    batch, _, width, heads, head_dim = rows.shape
    return jnp.broadcast_to(rows, (batch, tokens, width, heads, head_dim)).reshape(
        batch * tokens, width, heads, head_dim)
