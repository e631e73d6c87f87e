"""A row's numerics must not depend on how many other rows share its step: the same
request gives the same greedy tokens whether it decodes alone, in a decode bucket of
16, or beside other requests. XLA:CPU's reduce rounds a row differently with the row
count, so RMSNorm and the attention's softmax sum add each row in a fixed order; the
attention's online softmax takes one KV block size on every path (prompt chunks, tokens
alone, decode slots), since a token can take any of them depending on its batch."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.model import layers
from jaxinfer.pallas import AttentionSettings, kv_layout, reference
from jaxinfer.text.corpus import corpus_files, read_texts
from jaxinfer.text.tokenizer import Tokenizer

DEMO = pathlib.Path(__file__).resolve().parents[2] / "checkpoints" / "demo"


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
    attend = jax.jit(reference.ragged_paged_attention, static_argnums=6)

    def first_row(requests: int, tokens: int, max_q_len: int) -> np.ndarray:
        cu = np.minimum(np.arange(slots + 1), requests).astype(np.int32)
        q = jnp.pad(queries[:requests], ((0, tokens - requests), (0, 0), (0, 0)))
        lens = jnp.where(jnp.arange(slots) < requests, kv_lens, 0)
        out = attend(q, pages, lens, table, jnp.asarray(cu), jnp.array([requests], jnp.int32),
                     AttentionSettings(sm_scale=0.125, max_q_len=max_q_len))
        return np.asarray(out[0])

    alone = first_row(1, 2, 1)
    for requests, tokens, max_q_len in ((2, 2, 1), (8, 8, 1), (32, 32, 1), (1, 16, 0),
                                        (16, 16, 0), (32, 64, 0), (32, 512, 0)):
        np.testing.assert_array_equal(first_row(requests, tokens, max_q_len), alone)


def test_greedy_tokens_of_bf16_requests_do_not_depend_on_their_batching():
    """The same prompts (a shared 200-token prefix, then 1 to 40 tokens of their own)
    give the same greedy tokens in bfloat16 in a static batch of 32 without prefix
    caching and continuously batched 4 at a time with it, where prefix hits and other
    chunk boundaries send some prompt tokens down the per-token attention path. With a
    larger KV block on the prompt-chunk path, request 13 differed from its 14th token."""
    tokenizer = Tokenizer.from_dir(DEMO)
    ids = tokenizer.encode("\n".join(read_texts(corpus_files()[1])[:20]),
                           add_special_tokens=False)
    rng = np.random.default_rng(1)
    shared, prompts = ids[:200], []
    for i in range(32):
        own = 1 if i % 2 == 0 else int(rng.integers(2, 40))
        start = int(rng.integers(200, len(ids) - 50))
        prompts.append(shared + ids[start:start + own])
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    def tokens(**settings: object) -> list[list[int]]:
        llm = LLM(DEMO, dtype="bfloat16", max_model_len=256, max_num_batched_tokens=256,
                  warm_up=False, **settings)
        return [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts, params, use_tqdm=False)]

    static = tokens(scheduler="static", enable_prefix_caching=False, max_num_seqs=32)
    continuous = tokens(max_num_seqs=4, enable_prefix_caching=True)
    assert [i for i in range(32) if static[i] != continuous[i]] == []
