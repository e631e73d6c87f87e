"""The only bridge between host and device: padded numpy in, numpy out.

Holds the device params and the KV cache, pads each step's requests to a
bucket (powers of two for tokens and request rows), and runs the jitted step
with the KV cache donated. Imports jax, model, config and engine.request.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig
from jaxinfer.engine.request import MAX_LOGPROBS, SamplingParams
from jaxinfer.model import step as model_step
from jaxinfer.model.attention import AttentionMetadata, init_kv_cache
from jaxinfer.model.sampler import SampleOutput, SamplingInputs


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One request's new tokens in one step."""

    token_ids: Sequence[int]
    start: int  # tokens of this request already in the KV cache
    page_ids: Sequence[int]  # the request's pages, enough for start + len(token_ids)


def next_power_of_two(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def build_metadata(chunks: Sequence[Chunk], *, page_size: int, pages_per_seq: int,
                   num_tokens: int, num_slots: int, all_logits: bool = False
                   ) -> tuple[np.ndarray, AttentionMetadata]:
    """Token ids and attention metadata (numpy) for chunks padded to a bucket."""
    total = sum(len(c.token_ids) for c in chunks)
    if total > num_tokens or len(chunks) > num_slots:
        raise ValueError(f"{total} tokens / {len(chunks)} requests exceed the bucket "
                         f"({num_tokens}, {num_slots})")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.arange(num_tokens, dtype=np.int32) % page_size  # trash page 0
    page_indices = np.zeros((num_slots, pages_per_seq), np.int32)
    kv_lens = np.zeros(num_slots, np.int32)
    cu_q_lens = np.zeros(num_slots + 1, np.int32)
    last = np.zeros(num_slots, np.int32)
    offset = 0
    for i, chunk in enumerate(chunks):
        n, end = len(chunk.token_ids), chunk.start + len(chunk.token_ids)
        if len(chunk.page_ids) * page_size < end or len(chunk.page_ids) > pages_per_seq:
            raise ValueError(f"request {i}: {len(chunk.page_ids)} pages cannot hold {end} "
                             f"tokens (page_size {page_size}, at most {pages_per_seq} pages)")
        pos = np.arange(chunk.start, end, dtype=np.int32)
        pages = np.asarray(chunk.page_ids, np.int32)
        token_ids[offset:offset + n] = chunk.token_ids
        positions[offset:offset + n] = pos
        slot_mapping[offset:offset + n] = pages[pos // page_size] * page_size + pos % page_size
        page_indices[i, :len(pages)] = pages
        kv_lens[i] = end
        offset += n
        cu_q_lens[i + 1:] = offset
        last[i] = offset - 1
    rows = np.arange(num_tokens, dtype=np.int32) if all_logits else last
    md = AttentionMetadata(positions=positions, slot_mapping=slot_mapping,
                           page_indices=page_indices, kv_lens=kv_lens, cu_q_lens=cu_q_lens,
                           num_seqs=np.array([len(chunks)], np.int32), logits_indices=rows)
    return token_ids, md


def sampling_inputs(params: Sequence[SamplingParams], counters: Sequence[int],
                    seeds: Sequence[int], num_slots: int) -> SamplingInputs:
    """Per-row sampling arrays; rows past len(params) are greedy padding."""
    pad = num_slots - len(params)
    temperature = np.array([p.temperature for p in params] + [0.0] * pad, np.float32)
    top_k = np.array([p.top_k for p in params] + [0] * pad, np.int32)
    top_p = np.array([p.top_p for p in params] + [1.0] * pad, np.float32)
    return SamplingInputs(temperature=temperature, top_k=top_k, top_p=top_p,
                          seeds=np.array(list(seeds) + [0] * pad, np.uint32),
                          counters=np.array(list(counters) + [0] * pad, np.int32))


def resolve_kv_dtype(kv_cache_dtype: str, dtype: str) -> str:
    """The KV page dtype: "auto" is the weights' dtype, except float32 on CPU.

    On XLA:CPU a bfloat16 page pool is upcast whole for every K/V write (see
    pallas/reference.py), so float32 pages are much faster there.
    """
    if kv_cache_dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"{kv_cache_dtype=} must be 'auto', 'float32' or 'bfloat16'")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "float32" if jax.default_backend() == "cpu" else dtype


class Runner:
    """Device state (params, KV cache) and the compiled step functions."""

    def __init__(self, cfg: ModelConfig, params: dict, *, num_pages: int, page_size: int,
                 max_model_len: int, kv_dtype: str | jnp.dtype = jnp.float32) -> None:
        self.cfg = cfg
        self.params = params
        self.page_size = page_size
        self.pages_per_seq = -(-max_model_len // page_size)
        self.kv_cache = init_kv_cache(cfg, num_pages=num_pages, page_size=page_size,
                                      dtype=jnp.dtype(kv_dtype))
        self._step = jax.jit(functools.partial(
            model_step.step, cfg=cfg, num_logprobs=MAX_LOGPROBS), donate_argnums=(1,))
        self._logits = jax.jit(functools.partial(model_step.logits, cfg=cfg),
                               donate_argnums=(1,))

    def _bucket(self, chunks: Sequence[Chunk]) -> dict[str, int]:
        total = sum(len(c.token_ids) for c in chunks)
        return {"num_tokens": next_power_of_two(total, 8),
                "num_slots": next_power_of_two(len(chunks))}

    def execute(self, chunks: Sequence[Chunk], params: Sequence[SamplingParams],
                counters: Sequence[int], seeds: Sequence[int]) -> SampleOutput:
        """Run one step and sample one token per chunk; results as numpy, trimmed."""
        bucket = self._bucket(chunks)
        token_ids, md = build_metadata(chunks, page_size=self.page_size,
                                       pages_per_seq=self.pages_per_seq, **bucket)
        inputs = model_step.StepInputs(token_ids=token_ids, md=md, sampling=sampling_inputs(
            params, counters, seeds, bucket["num_slots"]))
        self.kv_cache, out = self._step(self.params, self.kv_cache, inputs)
        out = jax.device_get(out)
        return jax.tree.map(lambda x: x[:len(chunks)], out)

    def logits(self, chunks: Sequence[Chunk]) -> np.ndarray:
        """Write the chunks' K/V and return f32[tokens, V] logits for every real token."""
        bucket = self._bucket(chunks)
        token_ids, md = build_metadata(chunks, page_size=self.page_size,
                                       pages_per_seq=self.pages_per_seq, all_logits=True,
                                       **bucket)
        self.kv_cache, out = self._logits(self.params, self.kv_cache, token_ids, md)
        return np.asarray(out)[:sum(len(c.token_ids) for c in chunks)]
