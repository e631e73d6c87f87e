"""The draft model's runner (speculative decoding, method "draft_model"): its params and
its own paged KV cache over the target's page ids; `catch_up` (draft_prefill per mixed
bucket) and `propose` (k + 1 draft steps in one call per decode slot rung, q left on the
device for the verify step). See docs/speculative_decoding.md#proposers.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxinfer.config import ModelConfig
from jaxinfer.engine.core.buckets import Bucket, BucketSet
from jaxinfer.engine.request import Request
from jaxinfer.engine.runner.compiles import CompileCounter
from jaxinfer.engine.runner.device import tree_bytes
from jaxinfer.engine.runner.drafter_inputs import catch_up_calls, propose_inputs
from jaxinfer.engine.runner.inputs import Chunk, build_metadata
from jaxinfer.engine.runner.programs import step_shardings
from jaxinfer.model import draft as draft_model
from jaxinfer.model import sharding
from jaxinfer.model import step as model_step
from jaxinfer.model.attention import init_kv_cache
from jaxinfer.pallas import DEFAULT_SETTINGS, AttentionSettings, kv_quant


class DraftRunner:
    """The draft model on the target's mesh and page ids."""

    def __init__(self, cfg: ModelConfig, params: dict, *, mesh: Mesh, num_pages: int,
                 page_size: int, max_model_len: int, buckets: BucketSet,
                 num_positions: int, vocab_size: int, kv_dtype: str = "float32",
                 eos_token_ids: frozenset[int] = frozenset(),
                 attention: AttentionSettings = DEFAULT_SETTINGS) -> None:
        self.cfg, self.mesh, self.buckets = cfg, mesh, buckets
        self.attention = attention  # the engine's attention kernel (impl, interpret)
        self.page_size, self.max_model_len = page_size, max_model_len
        self.pages_per_seq = -(-max_model_len // page_size)
        self.num_positions = num_positions  # K + 1
        self.eos_token_ids = eos_token_ids  # banned while a request is under min_tokens
        param_shardings, kv_shardings, whole = step_shardings(cfg, mesh, kv_dtype=kv_dtype)
        self.params = jax.device_put(params, param_shardings)
        self.kv_cache = jax.jit(functools.partial(
            init_kv_cache, cfg, num_pages=num_pages, page_size=page_size,
            dtype=kv_quant.storage_dtype(kv_dtype), shards=mesh.shape[sharding.MODEL_AXIS]),
            out_shardings=kv_shardings)()
        self._prefill = jax.jit(functools.partial(model_step.draft_prefill, cfg=cfg),
                                in_shardings=(param_shardings, kv_shardings, whole, whole),
                                out_shardings=kv_shardings, donate_argnums=(1,))
        self._propose = jax.jit(
            functools.partial(draft_model.propose, cfg=cfg, page_size=page_size,
                              num_positions=num_positions, vocab_size=vocab_size),
            in_shardings=(param_shardings, kv_shardings, whole),
            out_shardings=(kv_shardings, whole, whole), donate_argnums=(1,))
        self._compiled: dict[Bucket, jax.stages.Compiled] = {}
        self.seconds = 0.0  # spent in catch_up and propose
        self.compiles = CompileCounter()

    @property
    def weight_bytes(self) -> int:
        return tree_bytes(self.params)

    def warm_up(self) -> int:
        """Compile every program now; returns how many."""
        buckets = self.prefill_buckets() + self.buckets.decode()
        for bucket in buckets:
            self._compile(bucket)
        return len(buckets)

    def prefill_buckets(self) -> list[Bucket]:
        return [Bucket(t, self.buckets.max_num_seqs) for t in self.buckets.tokens]

    def _compile(self, bucket: Bucket) -> jax.stages.Compiled:
        if bucket not in self._compiled:
            with jax.set_mesh(self.mesh):
                if bucket.decode:
                    lowered = self._propose.lower(self.params, self.kv_cache,
                                                  self._propose_spec(bucket))
                else:
                    token_ids, md = build_metadata(
                        [], page_size=self.page_size, pages_per_seq=self.pages_per_seq,
                        num_tokens=bucket.num_tokens, num_slots=bucket.num_slots,
                        attention=self.attention)
                    lowered = self._prefill.lower(self.params, self.kv_cache,
                                                  *_specs((token_ids, md)))
            self._compiled[bucket] = lowered.compile()
        return self._compiled[bucket]

    def catch_up(self, segments: Sequence[tuple[Request, int]]) -> None:
        """Write the draft's K/V of each request's tokens from position `done` to its last
        one (exclusive), in calls of at most the token budget and slot count."""
        started = time.perf_counter()
        spans = [(request, done, request.num_tokens - 1) for request, done in segments]
        for chunks, used in catch_up_calls(spans, shift=0, budget=self.buckets.tokens[-1],
                                           slots=self.buckets.max_num_seqs):
            self._prefill_call(chunks, used)
        self.seconds += time.perf_counter() - started

    def _prefill_call(self, chunks: list[Chunk], num_tokens: int) -> None:
        bucket = self.buckets.pick(num_tokens, len(chunks))
        token_ids, md = build_metadata(chunks, page_size=self.page_size,
                                       pages_per_seq=self.pages_per_seq,
                                       num_tokens=bucket.num_tokens, num_slots=bucket.num_slots,
                                       attention=self.attention)
        self.kv_cache = self._compile(bucket)(self.params, self.kv_cache, token_ids, md)

    def propose(self, requests: Sequence[Request], num_steps: int
                ) -> tuple[np.ndarray, jax.Array]:
        """Run `num_steps` (k + 1) draft steps from each request's last token: returns
        (i32[n, K + 1] drafts, host; f32[S, K + 1, V] their q, device), S the decode slot
        rung of n requests; each request's draft K/V must cover all but its last token."""
        if not 1 <= num_steps <= self.num_positions:
            raise ValueError(f"{num_steps=} must be in [1, {self.num_positions}]")
        started = time.perf_counter()
        bucket = self.buckets.pick(len(requests), len(requests), decode=True)
        inputs = self._propose_inputs(requests, bucket, num_steps)
        self.kv_cache, tokens, probs = self._compile(bucket)(self.params, self.kv_cache,
                                                              inputs)
        drafts = np.asarray(tokens)[:len(requests)]
        self.seconds += time.perf_counter() - started
        return drafts, probs

    def time_propose(self, slots: int, num_steps: int, repeats: int = 5) -> float:
        """Seconds of a proposal call of `num_steps` draft steps over `slots` empty slots
        (the median of `repeats`), for the speculation policy's cost model."""
        bucket = self.buckets.pick(slots, slots, decode=True)
        compiled, inputs = self._compile(bucket), self._propose_inputs([], bucket, num_steps)
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            self.kv_cache, tokens, _ = compiled(self.params, self.kv_cache, inputs)
            np.asarray(tokens)
            times.append(time.perf_counter() - began)
        return sorted(times)[len(times) // 2]

    def _propose_inputs(self, requests: Sequence[Request], bucket: Bucket,
                        num_steps: int) -> draft_model.DraftInputs:
        return propose_inputs(requests, bucket, num_steps, shift=0,
                              pages_per_seq=self.pages_per_seq,
                              max_model_len=self.max_model_len,
                              eos_token_ids=self.eos_token_ids, attention=self.attention)

    def _propose_spec(self, bucket: Bucket) -> draft_model.DraftInputs:
        return _specs(self._propose_inputs([], bucket, 1))


def _specs(tree: object) -> object:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype),
                        tree)
