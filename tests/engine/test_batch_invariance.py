"""A row's numerics must not depend on how many other rows share its step: the same
request gives the same greedy tokens whether it decodes alone, in a decode bucket of
16, or beside other requests. XLA:CPU's reduce rounds a row differently with the row
count, so RMSNorm and the attention's softmax sum add each row in a fixed order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import layers
from jaxinfer.pallas import kv_layout, reference


def test_rms_norm_of_a_row_is_the_same_for_any_row_count():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 320)), jnp.float32)
    w = jnp.asarray(rng.random(320) + 0.5, jnp.bfloat16)
    norm = jax.jit(lambda x: layers.rms_norm(x, w, 1e-5))
    full = np.asarray(norm(x))
    for rows in (1, 2, 3, 4, 8, 16, 32):
        np.testing.assert_array_equal(np.asarray(norm(x[:rows])), full[:rows])


def test_decode_attention_of_a_request_is_the_same_for_any_batch():
    heads, head_dim, page_size, pages_per_seq, slots = 5, 64, 16, 8, 32
    rng = np.random.default_rng(0)
    num_pages = slots * pages_per_seq + 1
    kv = jnp.asarray(rng.standard_normal((num_pages, page_size, 2, head_dim)), jnp.bfloat16)
    padding = kv_layout.padded_heads_for(1, reference.BF16_STORAGE, head_dim) - 2
    kv = jnp.pad(kv, ((0, 0), (0, 0), (0, padding), (0, 0)))
    pages = jax.lax.bitcast_convert_type(kv, reference.BF16_STORAGE).reshape(
        kv_layout.kv_cache_shape(num_pages, page_size, 1, head_dim, reference.BF16_STORAGE))
    queries = jnp.asarray(rng.standard_normal((slots, heads, head_dim)), jnp.float32)
    table = jnp.asarray(1 + np.arange(slots * pages_per_seq, dtype=np.int32).reshape(
        slots, pages_per_seq))
    kv_lens = jnp.asarray(rng.integers(20, pages_per_seq * page_size, slots), jnp.int32)
    attend = jax.jit(reference.ragged_paged_attention, static_argnames=("max_q_len",))

    def first_row(requests: int, tokens: int, max_q_len: int) -> np.ndarray:
        cu = np.minimum(np.arange(slots + 1), requests).astype(np.int32)
        q = jnp.pad(queries[:requests], ((0, tokens - requests), (0, 0), (0, 0)))
        lens = jnp.where(jnp.arange(slots) < requests, kv_lens, 0)
        out = attend(q, pages, lens, table, jnp.asarray(cu), jnp.array([requests], jnp.int32),
                     sm_scale=0.125, max_q_len=max_q_len)
        return np.asarray(out[0])

    alone = first_row(1, 2, 1)
    for requests, tokens, max_q_len in ((2, 2, 1), (8, 8, 1), (32, 32, 1), (1, 16, 0),
                                        (16, 16, 0), (32, 64, 0), (32, 512, 0)):
        np.testing.assert_array_equal(first_row(requests, tokens, max_q_len), alone)
