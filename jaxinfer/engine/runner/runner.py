"""The only bridge between host and device: a StepPlan in, sampled tokens out.

Holds the device params and the KV cache. `warm_up()` AOT-compiles the step
for every bucket (KV cache donated) so nothing compiles mid-run; `execute()`
pads a plan to its bucket, builds the step's numpy inputs, runs the compiled
step and unpacks its one int32 result array. With `enable_prompt_logprobs` warm-up
also compiles the scoring variant of the step (model/step.py: `score_step`) for every
mixed bucket; a step that scores some prompt position runs it in the mixed bucket of
its size (never a decode bucket) and returns the scores as a second int32 array.
Compiling it apart keeps the ordinary step free of [T, V] work, and engines that never
score prompts free of its compile time. The runner's `compiles` counter
(compiles.py) counts the compilations of the threads that drive it. Device
questions (bandwidth, memory, the compilation cache) live in device.py.
With speculative decoding the bucket set has verify buckets (Q = k + 1 positions
a request), compiled with `model/step.verify_step`: a step whose chunks carry draft
tokens runs there, given the draft model's probabilities on device
(`draft_probs=True`; engine/runner/draft.py makes them) or none (n-gram proposals).
Multi-host (jaxinfer/distributed.py) needs nothing more here: every process passes the
same numpy inputs, which jit places on this process's devices of the replicated
sharding, and `np.asarray` of the replicated packed output reads this process's copy.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
import typing
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.engine.buckets import Bucket, BucketSet
from jaxinfer.engine.request import MAX_LOGPROBS
from jaxinfer.engine.runner.compiles import CompileCounter
from jaxinfer.engine.runner.device import tree_bytes
from jaxinfer.engine.runner.inputs import (
    Chunk,
    ScoreSpan,
    build_metadata,
    next_power_of_two,
    proposed_ids,
    sample_rows,
    sampling_inputs,
    score_spans,
    score_targets,
)
from jaxinfer.engine.runner.programs import (
    COMPILE_THREADS,
    input_spec,
    score_input_spec,
    score_step_function,
    step_function,
    step_shardings,
)
from jaxinfer.engine.scheduler import StepPlan
from jaxinfer.model import quantization as quantization_lib
from jaxinfer.model import sampler, scoring, sharding
from jaxinfer.model import step as model_step
from jaxinfer.model.attention import (
    init_kv_cache,
)
from jaxinfer.pallas import kv_quant

log = logging.getLogger(__name__)



@dataclasses.dataclass(frozen=True)
class Sample:
    """A token sampled at one position of a request in one step, with its logprobs."""

    token_id: int
    logprob: float
    top_ids: np.ndarray  # i32[MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[MAX_LOGPROBS]
    proposed_logprob: float  # of the token the chunk fed after this position; -inf if none


@dataclasses.dataclass(frozen=True)
class PromptScores:
    """One chunk's scored prompt positions `first` .. `first + n - 1` (position p: prompt
    token p + 1), numpy, from the scoring step."""

    first: int
    logprobs: np.ndarray  # f32[n]: raw logprob of the prompt token
    ranks: np.ndarray  # i32[n]: its rank, >= 1
    top_ids: np.ndarray  # i32[n, MAX_LOGPROBS]
    top_logprobs: np.ndarray  # f32[n, MAX_LOGPROBS]


class StepResult(typing.NamedTuple):
    """What `Runner.execute` returns: per chunk, its samples and its prompt scores."""

    bucket: Bucket
    samples: list[list[Sample]]
    prompt_scores: list[PromptScores | None]


def quantize_at_load(params: dict, cfg: ModelConfig, mesh: Mesh, mode: str) -> dict:
    """Float `params` quantized to `mode` on the device, placed as the step shards them
    (AWQ's int4 scales, if any, already folded in by the checkpoint loader)."""
    shardings, _, _ = step_shardings(cfg, mesh, mode)
    return jax.jit(functools.partial(quantization_lib.quantize_params, mode=mode),
                   out_shardings=shardings)(params)


class Runner:
    """Device state (params, KV cache) and the step compiled for every bucket."""

    def __init__(self, cfg: ModelConfig, params: dict, *, num_pages: int, page_size: int,
                 max_model_len: int, buckets: BucketSet | None = None,
                 kv_dtype: str = "float32",
                 eos_token_ids: frozenset[int] = frozenset(),
                 attention_impl: str | None = None, mesh: Mesh | None = None,
                 enable_prompt_logprobs: bool = False, draft_probs: bool = False) -> None:
        cfg = dataclasses.replace(cfg, attention_impl=attention_impl or cfg.attention_impl)
        self.cfg = cfg
        self.mesh = mesh or sharding.make_mesh(1)
        shards = self.mesh.shape[sharding.MODEL_AXIS]
        quantization = quantization_lib.mode_of(params)  # quantized at load, if at all
        head = quantization is None or quantization_lib.has_quantized_head(params)
        param_shardings, kv_shardings, whole = step_shardings(
            cfg, self.mesh, quantization, kv_dtype=kv_dtype, quantized_head=head)
        self.params = jax.device_put(params, param_shardings)  # no-op when loaded so
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.pages_per_seq = -(-max_model_len // page_size)
        self.buckets = buckets or BucketSet(max_num_batched_tokens=16, max_num_seqs=1)
        self.eos_token_ids = eos_token_ids
        self.kv_cache = jax.jit(
            functools.partial(init_kv_cache, cfg, num_pages=num_pages, page_size=page_size,
                              dtype=kv_quant.storage_dtype(kv_dtype), shards=shards),
            out_shardings=kv_shardings)()
        self._steps = {decode: jax.jit(step_function(cfg, decode_only=decode),
                                       in_shardings=(param_shardings, kv_shardings, whole),
                                       out_shardings=(kv_shardings, whole),
                                       donate_argnums=(1,)) for decode in (False, True)}
        self.enable_prompt_logprobs = enable_prompt_logprobs
        self._score_step = jax.jit(score_step_function(cfg),
                                   in_shardings=(param_shardings, kv_shardings, whole, whole),
                                   out_shardings=(kv_shardings, whole, whole),
                                   donate_argnums=(1,))
        self.draft_probs = draft_probs  # verify steps take the draft's q (draft model)
        self._verify = jax.jit(
            functools.partial(model_step.verify_step, cfg=cfg, num_logprobs=MAX_LOGPROBS),
            in_shardings=(param_shardings, kv_shardings, whole) + (whole,) * draft_probs,
            out_shardings=(kv_shardings, whole), donate_argnums=(1,))
        self._logits = jax.jit(functools.partial(model_step.logits, cfg=cfg),
                               in_shardings=(param_shardings, kv_shardings, whole, whole),
                               out_shardings=(kv_shardings, whole), donate_argnums=(1,))
        self._compiled: dict[tuple[Bucket, bool], jax.stages.Compiled] = {}  # (bucket, scores)
        self._lower_lock = threading.Lock()

    @property
    def weight_bytes(self) -> int:
        return tree_bytes(self.params)

    def warm_up(self, progress: bool = True) -> dict[str, float]:
        """Compile the step for every bucket (and its scoring variant for every mixed one
        with `enable_prompt_logprobs`); returns {"buckets": n, "scoring_buckets": m,
        "seconds": t}.

        Buckets compile on `COMPILE_THREADS` threads (XLA releases the GIL while it
        compiles); each lowering is taken under a lock, as tracing is not thread-safe.
        """
        start = time.perf_counter()
        buckets = self.buckets.all()
        jobs = [(b, False) for b in buckets]
        if self.enable_prompt_logprobs:
            jobs += [(b, True) for b in buckets if not b.decode]
        with concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS) as pool, tqdm(
                total=len(jobs), desc="warming up buckets", disable=not progress) as bar:
            for (bucket, scores), seconds in pool.map(self._timed_compile, jobs):
                log.debug("bucket %s%s ready in %.2fs", bucket,
                          " (scoring)" if scores else "", seconds)
                bar.update()
        return {"buckets": len(buckets), "scoring_buckets": len(jobs) - len(buckets),
                "seconds": time.perf_counter() - start}

    def _timed_compile(self, job: tuple[Bucket, bool]) -> tuple[tuple[Bucket, bool], float]:
        began = time.perf_counter()
        self._compile(*job)
        return job, time.perf_counter() - began

    def _compile(self, bucket: Bucket, scores: bool = False) -> jax.stages.Compiled:
        if (bucket, scores) not in self._compiled:
            spec = input_spec(bucket, page_size=self.page_size,
                              max_model_len=self.max_model_len,
                              num_positions=bucket.num_positions)
            with self._lower_lock, jax.set_mesh(self.mesh):
                if scores:
                    lowered = self._score_step.lower(self.params, self.kv_cache, spec,
                                                     score_input_spec(bucket))
                elif bucket.num_positions > 1:
                    probs = jax.ShapeDtypeStruct(
                        (bucket.num_slots, bucket.num_positions, self.cfg.vocab_size),
                        jnp.float32)
                    lowered = self._verify.lower(self.params, self.kv_cache, spec,
                                                 *[probs][:self.draft_probs])
                else:
                    lowered = self._steps[bucket.decode].lower(self.params, self.kv_cache,
                                                               spec)
            self._compiled[(bucket, scores)] = lowered.compile()
        return self._compiled[(bucket, scores)]

    def _inputs(self, plan_chunks: Sequence, bucket: Bucket) -> model_step.StepInputs:
        q = bucket.num_positions
        chunks = [Chunk(c.token_ids, c.start, c.request.page_ids, c.num_samples)
                  for c in plan_chunks]
        token_ids, md = build_metadata(chunks, page_size=self.page_size,
                                       pages_per_seq=self.pages_per_seq,
                                       num_tokens=bucket.num_tokens,
                                       num_slots=bucket.num_slots, num_positions=q)
        rows = sample_rows([c.request for c in plan_chunks], chunks, num_positions=q)
        sampling = sampling_inputs(rows, num_rows=bucket.num_slots * q,
                                   history_width=self.max_model_len,
                                   eos_token_ids=self.eos_token_ids)
        return model_step.StepInputs(
            token_ids=token_ids, md=md, sampling=sampling,
            proposed_ids=proposed_ids(chunks, num_slots=bucket.num_slots, num_positions=q))

    def execute(self, plan: StepPlan, draft_probs: jax.Array | None = None) -> StepResult:
        """Run one step; per chunk, a Sample for each of its `num_samples` positions and
        the PromptScores of the prompt positions it scores (None when none). A plan with
        draft tokens runs in a verify bucket; `draft_probs` f32[S, Q, V] (S its slots)
        are their q when the runner takes them (`draft_probs=True`)."""
        requests = [c.request for c in plan.chunks]
        spans = score_spans(requests, [Chunk(c.token_ids, c.start, ()) for c in plan.chunks])
        scores = any(span is not None for span in spans)
        if scores and not self.enable_prompt_logprobs:
            raise ValueError("a request asks for prompt_logprobs but this runner was made "
                             "without enable_prompt_logprobs=True")
        verify = any(c.draft_token_ids for c in plan.chunks)
        if verify and (scores or self.draft_probs != (draft_probs is not None)):
            raise ValueError("a verify step scores no prompt and takes draft_probs exactly "
                             "when the runner was made with draft_probs=True")
        bucket = self.buckets.pick(plan.num_tokens, len(plan.chunks), verify=verify,
                                   decode=not scores and all(c.num_tokens == 1
                                                             for c in plan.chunks))
        compiled = self._compile(bucket, scores)
        inputs = self._inputs(plan.chunks, bucket)
        if verify:
            self.kv_cache, packed = compiled(self.params, self.kv_cache, inputs,
                                             *[draft_probs][:self.draft_probs])
            prompt_scores = [None] * len(plan.chunks)
        elif scores:
            targets, num_top = score_targets(requests, spans, num_tokens=bucket.num_tokens)
            self.kv_cache, packed, packed_scores = compiled(
                self.params, self.kv_cache, inputs, scoring.ScoreInputs(targets, num_top))
            prompt_scores = _prompt_scores(np.asarray(packed_scores), spans)
        else:
            self.kv_cache, packed = compiled(self.params, self.kv_cache, inputs)
            prompt_scores = [None] * len(plan.chunks)
        out = sampler.unpack(np.asarray(packed), MAX_LOGPROBS)  # fields [S, Q, ...]
        samples = [[Sample(int(out.token_ids[i, q]), float(out.logprobs[i, q]),
                           out.top_ids[i, q], out.top_logprobs[i, q],
                           float(out.proposed_logprobs[i, q]))
                    for q in range(chunk.num_samples)] for i, chunk in enumerate(plan.chunks)]
        return StepResult(bucket, samples, prompt_scores)

    def time_bucket(self, bucket: Bucket, repeats: int = 5) -> float:
        """Seconds of one step of `bucket` with nothing in it (the median of `repeats`,
        outputs read back): what the speculation policy starts its cost model from."""
        compiled = self._compile(bucket)
        inputs = self._inputs([], bucket)
        extra = []
        if bucket.num_positions > 1 and self.draft_probs:
            extra = [jax.device_put(np.zeros((bucket.num_slots, bucket.num_positions,
                                               self.cfg.vocab_size), np.float32),
                                    sharding.replicated(self.mesh))]
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            self.kv_cache, packed = compiled(self.params, self.kv_cache, inputs, *extra)
            np.asarray(packed)
            times.append(time.perf_counter() - began)
        return sorted(times)[len(times) // 2]

    def logits(self, chunks: Sequence[Chunk]) -> np.ndarray:
        """Write the chunks' K/V and return f32[tokens, V] logits for every real token
        (for parity tests; compiles per shape, outside the bucket set)."""
        total = sum(len(c.token_ids) for c in chunks)
        token_ids, md = build_metadata(chunks, page_size=self.page_size,
                                       pages_per_seq=self.pages_per_seq, all_logits=True,
                                       num_tokens=next_power_of_two(total, 8),
                                       num_slots=next_power_of_two(len(chunks)))
        with jax.set_mesh(self.mesh):
            self.kv_cache, out = self._logits(self.params, self.kv_cache, token_ids, md)
        return np.asarray(out)[:total]

    @functools.cached_property
    def compiles(self) -> CompileCounter:
        """Counts the XLA compilations of the threads that use this runner (compiles.py);
        made on first use, so use it before `warm_up()` to count warm-up's compiles."""
        return CompileCounter()


def _prompt_scores(packed: np.ndarray, spans: Sequence[ScoreSpan | None]
                   ) -> list[PromptScores | None]:
    """Per chunk, its rows of the step's packed i32[T, 2 + 2k] scores."""
    out = scoring.unpack(packed, MAX_LOGPROBS)
    result: list[PromptScores | None] = []
    for span in spans:
        if span is None:
            result.append(None)
            continue
        rows = slice(span.row, span.row + span.count)
        result.append(PromptScores(first=span.first, logprobs=out.logprobs[rows],
                                   ranks=out.ranks[rows], top_ids=out.top_ids[rows],
                                   top_logprobs=out.top_logprobs[rows]))
    return result
