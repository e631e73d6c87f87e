"""Speculative heads' runner (`HeadRunner`: EAGLE-1/2, EAGLE-3, Medusa): reads the
target's feature store in place; EAGLE keeps a one-layer KV cache over the target's
page ids (`catch_up` per mixed bucket, a ragged `propose` per decode slot rung), Medusa
none. Drafts are drawn as a draft model draws them. See docs/speculative_decoding.md
(#heads-on-the-targets-hidden-states-eagle-12-eagle-3-medusa).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxinfer.config.heads import HeadConfig
from jaxinfer.engine.core.buckets import Bucket, BucketSet
from jaxinfer.engine.request import Request
from jaxinfer.engine.runner.compiles import CompileCounter
from jaxinfer.engine.runner.device import tree_bytes
from jaxinfer.engine.runner.drafter_inputs import catch_up_calls, propose_inputs
from jaxinfer.engine.runner.inputs import Chunk, build_metadata
from jaxinfer.model import eagle, medusa, sharding
from jaxinfer.model.attention import init_kv_cache, kv_cache_shardings
from jaxinfer.pallas import DEFAULT_SETTINGS, AttentionSettings, kv_quant


class HeadRunner:
    """A head's params and programs beside the target's runner (`target`: its params'
    embedding and LM head are shared, its feature store read)."""

    def __init__(self, head: HeadConfig, params: dict, target: object, *, mesh: Mesh,
                 num_pages: int, page_size: int, max_model_len: int, buckets: BucketSet,
                 num_positions: int, vocab_size: int, kv_dtype: str = "float32",
                 eos_token_ids: frozenset[int] = frozenset(),
                 attention: AttentionSettings = DEFAULT_SETTINGS) -> None:
        self.head, self.target, self.mesh, self.buckets = head, target, mesh, buckets
        self.attention = attention  # the engine's attention kernel (impl, interpret)
        self.page_size, self.max_model_len = page_size, max_model_len
        self.pages_per_seq = -(-max_model_len // page_size)
        self.num_positions = num_positions  # K + 1
        self.eos_token_ids = eos_token_ids
        self.whole = sharding.replicated(mesh)
        self._widen = jax.default_backend() == "cpu"
        if self._widen:  # XLA:CPU's DotThunk has no bf16 x bf16 -> f32 dot for some of
            params = _widened(params)  # the drafter loop's shapes
        self.params = jax.device_put(params, self.whole)
        self._shared_cache: tuple[object, dict] | None = None
        self.kv_cache = None
        if self.has_cache:  # split by KV head over the model axis, as the target's pages
            shards = mesh.shape[sharding.MODEL_AXIS]
            if head.layer.num_kv_heads % shards:
                raise ValueError(f"the {head.method} head's num_key_value_heads="
                                 f"{head.layer.num_kv_heads} must be divisible by "
                                 f"tensor_parallel_size={shards}")
            make = functools.partial(init_kv_cache, head.layer, num_pages=num_pages,
                                     page_size=page_size, shards=shards,
                                     dtype=kv_quant.storage_dtype(kv_dtype))
            self.kv_cache = jax.jit(make, out_shardings=kv_cache_shardings(
                mesh, jax.eval_shape(make)))()[0]
        self._jit(vocab_size)
        self._compiled: dict[Bucket, jax.stages.Compiled] = {}
        self.seconds = 0.0  # spent in catch_up and propose
        self.compiles = CompileCounter()

    @property
    def has_cache(self) -> bool:
        """Whether the head keeps K/V (EAGLE) and so catches up over skipped tokens."""
        return self.head.method != "medusa"

    def _jit(self, vocab_size: int) -> None:
        common = dict(cfg=self.head, page_size=self.page_size,
                      num_positions=self.num_positions, vocab_size=vocab_size)
        if self.has_cache:
            self._prefill = jax.jit(functools.partial(eagle.prefill, cfg=self.head),
                                    donate_argnums=(2,))
            self._propose = jax.jit(functools.partial(eagle.propose, **common),
                                    donate_argnums=(2,))
        else:  # Medusa reads nothing of the target's params: `shared` goes unused
            self._propose = jax.jit(lambda params, shared, store, inputs: medusa.propose(
                params, store, inputs, **common))

    @property
    def weight_bytes(self) -> int:
        return tree_bytes(self.params)

    def _shared(self) -> dict:
        """The target's embedding (and untied LM head) the head reads: as they are, or
        on CPU a float32 copy made once per target params (XLA:CPU would otherwise
        widen the whole bf16 table in every call, its convert hoisted out of the
        drafter loop's gather)."""
        params = self.target.params
        shared = {k: params[k] for k in ("embed", "lm_head") if k in params}
        if not self._widen:
            return shared
        if self._shared_cache is None or self._shared_cache[0] is not params:
            self._shared_cache = (params, _widened(shared))
        return self._shared_cache[1]

    def _store(self) -> jax.Array:
        return self.target.kv_cache[-1]

    def warm_up(self) -> int:
        """Compile every program now; returns how many."""
        buckets = (self.prefill_buckets() if self.has_cache else []) + self.buckets.decode()
        for bucket in buckets:
            self._compile(bucket)
        return len(buckets)

    def prefill_buckets(self) -> list[Bucket]:
        return [Bucket(t, self.buckets.max_num_seqs) for t in self.buckets.tokens]

    def _compile(self, bucket: Bucket) -> jax.stages.Compiled:
        if bucket not in self._compiled:
            shared, store = _specs(self._shared()), _specs(self._store())
            with jax.set_mesh(self.mesh):
                if bucket.decode:
                    spec = _specs(self._propose_args([], [], bucket, 1))
                    lowered = self._propose.lower(self.params, shared, *self._cache_arg(),
                                                  store, *spec)
                else:
                    token_ids, md = build_metadata(
                        [], page_size=self.page_size, pages_per_seq=self.pages_per_seq,
                        num_tokens=bucket.num_tokens, num_slots=bucket.num_slots,
                        attention=self.attention)
                    lowered = self._prefill.lower(self.params, shared, self.kv_cache, store,
                                                  *_specs((token_ids, md)))
            self._compiled[bucket] = lowered.compile()
        return self._compiled[bucket]

    def _cache_arg(self) -> tuple:
        return (self.kv_cache,) if self.has_cache else ()

    def catch_up(self, segments: Sequence[tuple[Request, int, int]]) -> None:
        """EAGLE: write the drafter's K/V of each (request, done, end) segment's positions
        [done, end), each fed the token that followed it, in calls of at most the token
        budget and slots."""
        for chunks, used in catch_up_calls(segments, shift=1, budget=self.buckets.tokens[-1],
                                           slots=self.buckets.max_num_seqs):
            bucket = self.buckets.pick(used, len(chunks))
            token_ids, md = build_metadata(
                chunks, page_size=self.page_size, pages_per_seq=self.pages_per_seq,
                num_tokens=bucket.num_tokens, num_slots=bucket.num_slots,
                attention=self.attention)
            self.kv_cache = self._compile(bucket)(self.params, self._shared(), self.kv_cache,
                                                  self._store(), token_ids, md)

    def propose(self, requests: Sequence[Request], num_drafts: int,
                computed: Sequence[int] = ()) -> tuple[np.ndarray, jax.Array]:
        """`num_drafts` (k) drafts after each request's last token: returns (i32[n, K + 1]
        drafts, host; f32[S, K + 1, V] their q, device), S the decode slot rung of n
        requests. EAGLE: `computed[i]` positions of request i have the drafter's K/V;
        the call's first step writes up to K + 1 more, ending at the position before
        the last token, and a catch-up call writes those further behind first."""
        if not 1 <= num_drafts < self.num_positions:
            raise ValueError(f"{num_drafts=} must be in [1, {self.num_positions - 1}]")
        started = time.perf_counter()
        starts = []
        if self.has_cache:
            starts = self._first_starts(requests, computed)
            self.catch_up([(r, done, start) for r, done, start
                           in zip(requests, computed, starts, strict=True) if done < start])
        bucket = self.buckets.pick(len(requests), len(requests), decode=True)
        args = self._propose_args(requests, starts, bucket, num_drafts)
        tokens, probs = self._run_propose(self._compile(bucket), args)
        drafts = np.asarray(tokens)[:len(requests)]
        self.seconds += time.perf_counter() - started
        return drafts, probs

    def _first_starts(self, requests: Sequence[Request], computed: Sequence[int]
                      ) -> list[int]:
        """Where each request's first proposal step starts: at the first position the
        drafter has not seen, at most K + 1 before the last token's (and at that one
        position if it has seen them all: writing the same K/V again is harmless)."""
        return [max(min(done, r.num_tokens - 2), r.num_tokens - 1 - self.num_positions)
                for r, done in zip(requests, computed, strict=True)]

    def _run_propose(self, compiled: jax.stages.Compiled, args: tuple
                     ) -> tuple[jax.Array, jax.Array]:
        out = compiled(self.params, self._shared(), *self._cache_arg(), self._store(), *args)
        if self.has_cache:
            self.kv_cache, *out = out
        return tuple(out)

    def time_propose(self, slots: int, num_steps: int, repeats: int = 5) -> float:
        """Seconds of a proposal of `num_steps - 1` drafts (at least 1) over `slots` empty
        slots, the median of `repeats`: the policy counts a proposal of k drafts as k + 1
        steps, as a draft model's."""
        bucket = self.buckets.pick(slots, slots, decode=True)
        compiled = self._compile(bucket)
        args = self._propose_args([], [], bucket, max(num_steps - 1, 1))
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            tokens, _ = self._run_propose(compiled, args)
            np.asarray(tokens)
            times.append(time.perf_counter() - began)
        return sorted(times)[len(times) // 2]

    def _propose_args(self, requests: Sequence[Request], starts: Sequence[int],
                      bucket: Bucket, num_drafts: int) -> tuple:
        """The proposal call's inputs: EAGLE's ragged first step (token ids and metadata
        of K + 1 tokens a slot, each request's positions from its start) then the
        per-slot `DraftInputs`; Medusa's `DraftInputs` alone."""
        inputs = propose_inputs(requests, bucket, num_drafts, shift=1,
                                pages_per_seq=self.pages_per_seq,
                                max_model_len=self.max_model_len,
                                eos_token_ids=self.eos_token_ids, attention=self.attention)
        if not self.has_cache:
            return (inputs,)
        chunks = [Chunk(r.all_token_ids[start + 1:], start, r.page_ids[0], 1)
                  for r, start in zip(requests, starts, strict=True)]
        first_ids, first_md = build_metadata(
            chunks, page_size=self.page_size, pages_per_seq=self.pages_per_seq,
            num_tokens=bucket.num_slots * self.num_positions, num_slots=bucket.num_slots,
            attention=self.attention)
        return first_ids, first_md, inputs


def _widened(tree: object) -> object:
    """The tree with its floating arrays in float32."""
    return jax.tree.map(lambda x: x.astype(jnp.float32)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _specs(tree: object) -> object:
    """ShapeDtypeStructs of arrays (keeping a device array's sharding) or host values."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype,
        sharding=getattr(x, "sharding", None)), tree)
