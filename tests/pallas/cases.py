"""One builder for ragged paged-attention test cases, shared by the kernel tests.

`make_case(seq_lens=[(q_len, kv_len), ...])` lays the requests out over a
permuted page pool whose unused pages and slots are NaN, with padding tokens
and padding request slots, and returns the positional arguments of
`ragged_paged_attention` (pages in the packed layout of `kv_layout.py`; padded
combined heads of 8-bit pages hold 99, which no kernel may read).
`combined(args)` gives the same arguments with [P, K, 2G, H] pages for JAX's
`ref_ragged_paged_attention`; `as_pages(combined)` lays [P, K, C, H] pages out in
the packed layout. `check(out, ref, real, dtype)` compares real rows
with the tolerance of `TOL[dtype]` and checks padding rows are finite.
`split_settings(settings, **more)` splits a case's settings dict (JAX's keywords, and
our `kv_scales` and `sinks` arrays) into the `AttentionSettings` and the array keywords
our functions take. `make_sinks(num_heads)` gives attention sinks f32[N];
`dense_attention(args, ...)` is plain float64 numpy attention over float pages that
follows transformers' `eager_attention_forward` of gpt-oss for sinks (the sink joins
the logits, the max and the softmax, then its column is dropped).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxinfer.pallas import AttentionSettings, kv_layout

TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}

SCENARIOS = {
    "decode_only": [(1, 17), (1, 64), (1, 1), (1, 33)],
    "prefill_only": [(20, 20), (7, 7)],
    "mixed": [(1, 40), (13, 13), (5, 50), (1, 16)],
    "page_boundary": [(16, 32), (1, 17), (15, 48)],
    "single_token_prefill": [(1, 1), (1, 1)],
    "prefix_hit": [(9, 41), (1, 30)],
}


def make_case(seq_lens, *, num_heads=8, num_kv_heads=2, head_dim=32, page_size=16,
              dtype=jnp.float32, kv_dtype=None, pad_tokens=5, pad_seqs=2, seed=0):
    """Positional args (queries, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs)."""
    rng = np.random.default_rng(seed + len(seq_lens) * 7 + num_heads)
    pages_per_seq = max(-(-kv // page_size) for _, kv in seq_lens) + 1
    num_slots = len(seq_lens) + pad_seqs
    num_pages = num_slots * pages_per_seq + 1
    kv_pages = np.full((num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)
    order = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((num_slots, pages_per_seq), np.int32)
    for i, (_, kv_len) in enumerate(seq_lens):
        used = -(-kv_len // page_size)
        page_indices[i, :used] = order[i * pages_per_seq:i * pages_per_seq + used]
        flat = rng.standard_normal((used * page_size, 2 * num_kv_heads, head_dim))
        flat[kv_len:] = np.nan  # slots past the KV length are never read
        kv_pages[page_indices[i, :used]] = flat.reshape(used, page_size, -1, head_dim)
    q_lens = [q for q, _ in seq_lens]
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * pad_seqs])
    tokens = sum(q_lens) + pad_tokens
    queries = rng.standard_normal((tokens, num_heads, head_dim)).astype(np.float32)
    kv_lens = np.array([kv for _, kv in seq_lens] + [0] * pad_seqs, np.int32)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    if jnp.issubdtype(kv_dtype, jnp.integer):
        kv_pages = np.clip(np.round(kv_pages * 32), -127, 127)  # NaN stays NaN -> cast below
        kv_pages = np.where(np.isnan(kv_pages), 127, kv_pages)
    shape = kv_layout.kv_cache_shape(num_pages, page_size, num_kv_heads, head_dim, kv_dtype)
    padding = kv_layout.padded_heads_for(num_kv_heads, kv_dtype, head_dim) - 2 * num_kv_heads
    kv_pages = np.pad(kv_pages, ((0, 0), (0, 0), (0, padding), (0, 0)), constant_values=99)
    return (jnp.asarray(queries, dtype), jnp.asarray(kv_pages, kv_dtype).reshape(shape),
            jnp.asarray(kv_lens), jnp.asarray(page_indices), jnp.asarray(cu_q_lens, jnp.int32),
            jnp.array([len(seq_lens)], jnp.int32))


ARRAYS = ("kv_scales", "sinks")  # keyword arrays beside the static AttentionSettings


def split_settings(settings, **more):
    """(AttentionSettings of the static entries of `settings` and `more`, the arrays)."""
    merged = {**settings, **more}
    return (AttentionSettings(**{k: v for k, v in merged.items() if k not in ARRAYS}),
            {k: v for k, v in merged.items() if k in ARRAYS})


def combined(args):
    """The arguments with [P, K, 2G, H] pages (padding dropped), JAX's layout."""
    queries, kv_pages, *meta = args
    return (queries, kv_layout.combined_view(kv_pages, queries.shape[2]), *meta)


def as_pages(combined_pages):
    """[P, K, C, H] pages (no padding) in the packed layout of their dtype: a reshape."""
    num_pages, page_size, heads, head_dim = combined_pages.shape
    return combined_pages.reshape(kv_layout.kv_cache_shape(
        num_pages, page_size, heads // 2, head_dim, combined_pages.dtype))


def check(out, ref, real: int, dtype) -> None:
    """Real rows match `ref` (rows [0, real)); padding rows are finite."""
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all(), "NaN or inf in the output"
    tol = TOL[jnp.dtype(dtype)]
    np.testing.assert_allclose(out[:real], np.asarray(ref, np.float32)[:real], atol=tol,
                               rtol=tol)


def make_scaled_case(seq_lens, *, kv_dtype, dtype=jnp.float32, **layout):
    """(args with 8-bit pages, kv_scales f32[P, K, 2G], args with the dequantized float32
    pages): K/V quantized per token and head (kv_quant.py). Unused slots keep NaN scales
    (and 127 values), so a kernel that reads a scale it must not use is caught."""
    from jaxinfer.pallas import kv_quant

    float_args = make_case(seq_lens, dtype=dtype, kv_dtype=jnp.float32, **layout)
    pages = np.asarray(kv_layout.combined_view(float_args[1], float_args[0].shape[2]))
    # [P, K, 2G, H], NaN unused
    unused = np.isnan(pages).any(axis=-1)  # [P, K, 2G]
    values, scales = kv_quant.quantize_numpy(np.where(np.isnan(pages), 0, pages), kv_dtype)
    values = np.where(unused[..., None], np.asarray(127, values.dtype), values)
    scales = np.where(unused, np.nan, scales).astype(np.float32)
    dequantized = np.where(unused[..., None], np.nan,
                           values.astype(np.float32) * scales[..., None])
    num_pages, page_size, combined_heads, head_dim = pages.shape
    shape = kv_layout.kv_cache_shape(num_pages, page_size, combined_heads // 2, head_dim,
                                     kv_dtype)
    padding = kv_layout.padded_heads_for(combined_heads // 2, kv_dtype, head_dim)
    padded = np.pad(values, ((0, 0), (0, 0), (0, padding - combined_heads), (0, 0)),
                    constant_values=np.asarray(99, values.dtype))
    quantized = (float_args[0], jnp.asarray(padded).reshape(shape), *float_args[2:])
    reference_args = (float_args[0], as_pages(jnp.asarray(dequantized, jnp.float32)),
                      *float_args[2:])
    return quantized, jnp.asarray(scales), reference_args


def make_sinks(num_heads, seed=0):
    """f32[N] sinks in [-1, 3]: comparable to the logits of a few dozen keys, so each
    moves the output well past the tolerance (and no two heads share one)."""
    return jnp.asarray(np.random.default_rng(seed + 101).uniform(-1.0, 3.0, num_heads),
                       jnp.float32)


def dense_attention(args, *, sm_scale=1.0, sliding_window=None, soft_cap=None, sinks=None):
    """f64[T, N, H]: each real token against its request's KV gathered into one dense
    array, the softmax written out as transformers' gpt-oss `eager_attention_forward`
    does (soft cap on key scores only); padding rows are 0. Float pages only."""
    queries = np.asarray(args[0], np.float64)
    pages = np.asarray(kv_layout.combined_view(args[1], args[0].shape[2]),
                       np.float64)  # [P, K, 2G, H]
    kv_lens, page_indices, cu_q_lens, num_seqs = (np.asarray(a) for a in args[2:])
    tokens, num_heads, head_dim = queries.shape
    num_kv_heads = pages.shape[2] // 2
    group = num_heads // num_kv_heads
    out = np.zeros((tokens, num_heads, head_dim))
    for i in range(int(num_seqs[0])):
        q_start, q_end, kv_len = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        kv = pages[page_indices[i]].reshape(-1, pages.shape[2], head_dim)[:kv_len]
        k = np.repeat(kv[:, 0::2], group, axis=1)  # [kv_len, N, H]
        v = np.repeat(kv[:, 1::2], group, axis=1)
        q = queries[q_start:q_end]  # [q_len, N, H]
        q_pos = kv_len - (q_end - q_start) + np.arange(q_end - q_start)
        key_pos = np.arange(kv_len)
        logits = np.einsum("qnh,knh->nqk", q, k) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * np.tanh(logits / soft_cap)
        visible = key_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] > q_pos[:, None] - sliding_window
        logits = np.where(visible[None], logits, -np.inf)
        if sinks is not None:
            sink = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None],
                                   (*logits.shape[:2], 1))
            logits = np.concatenate([logits, sink], axis=-1)
        logits = logits - logits.max(axis=-1, keepdims=True)
        probs = np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
        if sinks is not None:
            probs = probs[..., :-1]  # the sink's column is dropped
        out[q_start:q_end] = np.einsum("nqk,knh->qnh", probs, v)
    return out
