"""The vectorised jnp ragged paged attention against JAX's shipped reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

from jaxinfer.pallas import reference

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _run_case(seq_lens, *, num_heads=8, num_kv_heads=2, head_dim=32, page_size=16,
              dtype=jnp.float32, pad_tokens=5, pad_seqs=2, **kwargs):
    """Build a ragged batch over a NaN-filled, permuted page pool; compare both refs."""
    rng = np.random.default_rng(len(seq_lens) * 7 + num_heads)
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
    args = (jnp.asarray(queries, dtype), jnp.asarray(kv_pages, dtype), jnp.asarray(kv_lens),
            jnp.asarray(page_indices), jnp.asarray(cu_q_lens, jnp.int32),
            jnp.array([len(seq_lens)], jnp.int32))
    ours = jax.jit(lambda *a: reference.ragged_paged_attention(*a, **kwargs))(*args)
    theirs = ref_ragged_paged_attention(*args, **kwargs)
    real = sum(q_lens)
    assert not np.isnan(np.asarray(ours, np.float32)).any()
    np.testing.assert_allclose(np.asarray(ours[:real], np.float32),
                               np.asarray(theirs, np.float32), atol=TOL[dtype], rtol=TOL[dtype])
    assert not np.asarray(ours[real:], np.float32).any()  # padding rows are zeros


SCENARIOS = {
    "decode_only": [(1, 17), (1, 64), (1, 1), (1, 33)],
    "prefill_only": [(20, 20), (7, 7)],
    "mixed": [(1, 40), (13, 13), (5, 50), (1, 16)],
    "page_boundary": [(16, 32), (1, 17), (15, 48)],
    "single_token_prefill": [(1, 1), (1, 1)],
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_reference_matches_jax_reference(name):
    _run_case(SCENARIOS[name], sm_scale=32 ** -0.5)


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_reference_gqa_ratios(num_heads, num_kv_heads):
    _run_case(SCENARIOS["mixed"], num_heads=num_heads, num_kv_heads=num_kv_heads)


def test_reference_sliding_window_and_soft_cap():
    _run_case(SCENARIOS["mixed"], sliding_window=9, soft_cap=20.0, sm_scale=0.3)


def test_reference_bfloat16():
    _run_case(SCENARIOS["mixed"], dtype=jnp.bfloat16, sm_scale=32 ** -0.5)


def test_reference_blocks_tokens_when_gather_is_large(monkeypatch):
    monkeypatch.setattr(reference, "GATHER_BYTES_PER_BLOCK", 4096)
    _run_case(SCENARIOS["mixed"], pad_tokens=12)  # 72 tokens -> blocks of 8


def test_write_kv_pages_interleaves_k_and_v():
    pages = jnp.zeros((3, 4, 4, 2))
    k = jnp.arange(2 * 2 * 2, dtype=jnp.float32).reshape(2, 2, 2) + 1
    v = -k
    out = reference.write_kv_pages(pages, k, v, jnp.array([9, 2]))  # page 2 slot 1, page 0 slot 2
    np.testing.assert_array_equal(out[2, 1, 0::2], k[0])
    np.testing.assert_array_equal(out[2, 1, 1::2], v[0])
    np.testing.assert_array_equal(out[0, 2, 0::2], k[1])
    assert int((out != 0).sum()) == 16
