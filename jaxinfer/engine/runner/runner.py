"""The only bridge between host and device (`Runner`): device params, KV cache and batch
state; `warm_up` compiles every bucket (scoring and verify variants included),
`dispatch` sends a step's delta and starts it, `collect` reads back its one int32 array
(`execute`: both). See docs/architecture.md (#one-step, #the-host-loop, #buckets).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from jaxinfer.config import DEFAULT_OPTIONS, ModelConfig, ModelOptions
from jaxinfer.engine.core.buckets import Bucket, BucketSet
from jaxinfer.engine.core.scheduler import StepPlan
from jaxinfer.engine.runner import exported, kv_offload, results
from jaxinfer.engine.runner import stages as stages_lib
from jaxinfer.engine.runner.compiles import CompileCounter
from jaxinfer.engine.runner.device import tree_bytes
from jaxinfer.engine.runner.inputs import (
    BIAS_WIDTH,
    STOP_WIDTH,
    ScoreSpan,
    score_spans,
    score_targets,
)
from jaxinfer.engine.runner.programs import (
    COMPILE_THREADS,
    input_spec,
    on_shardings,
    pool_step_function,
    score_input_spec,
    score_step_function,
    step_function,
    step_shardings,
    verify_step_function,
)
from jaxinfer.engine.runner.results import PromptScores, Sample, StepResult
from jaxinfer.engine.runner.slots import SlotTable
from jaxinfer.engine.runner.token_masks import TokenMasks
from jaxinfer.model import batch_state, moe, pipeline, scoring, sharding
from jaxinfer.model import lora as lora_lib
from jaxinfer.model import quantization as quantization_lib
from jaxinfer.model.attention import init_kv_cache
from jaxinfer.pallas import DEFAULT_SETTINGS, AttentionSettings, kv_quant

log = logging.getLogger(__name__)
__all__ = ["InFlight", "PromptScores", "Runner", "Sample", "StepResult", "quantize_at_load"]


class InFlight(typing.NamedTuple):
    """A dispatched step: its outputs are device arrays until `Runner.collect`."""

    bucket: Bucket
    chunks: tuple
    packed: jax.Array  # i32[S, Q, 3 + 2k]
    packed_scores: jax.Array | None  # i32[T, 2 + 2k] when the step scores prompts
    spans: list[ScoreSpan | None]
    pooled: tuple[jax.Array, jax.Array] | None = None  # a pooling runner's pools, scores


def quantize_at_load(params: dict, cfg: ModelConfig, mesh: Mesh, mode: str,
                     options: ModelOptions = DEFAULT_OPTIONS) -> dict:
    """Float `params` quantized to `mode` on the device, placed as the step shards them
    (AWQ's int4 scales, if any, already folded in by the checkpoint loader)."""
    # the adapter slots are added after, float, and the layers stacked by pipeline stage
    # (Runner.__init__)
    shardings, _, _ = step_shardings(cfg, mesh, mode, options=dataclasses.replace(
        options, lora=None, pipeline_stages=1))
    if options.pipeline_stages > 1 and pipeline.on_stages(params["layers"]):
        return stages_lib.quantize_on_stages(params, mesh, mode, shardings)
    return jax.jit(functools.partial(quantization_lib.quantize_params, mode=mode),
                   out_shardings=shardings)(params)


def _init_kv_cache(cfg: ModelConfig, *, stages: int, **kwargs: object) -> list:
    """`init_kv_cache`, by layer slot stacked by stage when the layers are pipelined."""
    kv_cache = init_kv_cache(cfg, **kwargs)
    return kv_cache if stages == 1 else pipeline.stack_layers(kv_cache, stages)


class Runner:
    """Device state (params, KV cache, batch state) and the step compiled per bucket."""

    def __init__(self, cfg: ModelConfig, params: dict, *,
                 num_pages: int | typing.Sequence[int], page_size: int,
                 max_model_len: int, buckets: BucketSet | None = None,
                 kv_dtype: str = "float32",
                 eos_token_ids: frozenset[int] = frozenset(),
                 attention: AttentionSettings = DEFAULT_SETTINGS,
                 mesh: Mesh | None = None,
                 enable_prompt_logprobs: bool = False, uses_draft_probs: bool = False,
                 group_windows: typing.Sequence[int | None] = (None,),
                 options: ModelOptions = DEFAULT_OPTIONS, pooling: bool = False) -> None:
        """`num_pages`: the pages of each KV page group (engine/core/kv_groups.py), whose
        layers' windows are `group_windows` (model/attention.py, `page_group`);
        `pooling`: every step is a pooling model's (`pool_step_function`: hidden states
        pooled per request row, nothing sampled);
        `attention`: the attention kernel the engine chose (impl, interpret); `options`:
        the engine's for the model (experts split by expert, features kept for heads)."""
        options.check(cfg)
        if pooling and (enable_prompt_logprobs or uses_draft_probs):
            raise ValueError("a pooling runner samples nothing: no prompt logprobs or "
                             "speculative decoding")
        self.cfg, self.options, self.pooling = cfg, options, pooling
        self.attention = attention
        self.mesh = mesh or sharding.make_mesh(1)
        shards = self.mesh.shape[sharding.MODEL_AXIS]
        param_shardings, kv_shardings, whole = self._place_params(params, kv_dtype)
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.pages_per_seq = -(-max_model_len // page_size)
        self.buckets = buckets or BucketSet(max_num_batched_tokens=16, max_num_seqs=1)
        self.eos_token_ids = eos_token_ids
        self.group_windows = tuple(group_windows)
        # kept: sleep frees the KV cache and state, and wake makes them again with
        # these, as shaped and sharded as the compiled steps take them (memory.py)
        self.init_kv_cache = jax.jit(
            functools.partial(_init_kv_cache, cfg, num_pages=num_pages, page_size=page_size,
                              dtype=kv_quant.storage_dtype(kv_dtype), shards=shards,
                              group_windows=self.group_windows,
                              feature_size=options.feature_size(cfg),
                              stages=options.pipeline_stages),
            out_shardings=kv_shardings)
        self.kv_cache = self.init_kv_cache()
        num_slots = self.buckets.max_num_seqs
        self.slots = SlotTable(num_slots, page_size=page_size, eos_token_ids=eos_token_ids,
                               num_groups=len(self.group_windows))
        self.init_state = jax.jit(functools.partial(
            batch_state.init, num_slots, pages_per_seq=self.pages_per_seq,
            max_model_len=max_model_len, num_stop_ids=STOP_WIDTH, bias_width=BIAS_WIDTH,
            experts=moe.routing_shape(cfg), group_windows=self.group_windows),
            out_shardings=whole)
        self.state = self.init_state()
        self.masks = TokenMasks(cfg.vocab_size, whole)
        self.enable_prompt_logprobs = enable_prompt_logprobs
        self.uses_draft_probs = uses_draft_probs  # verify steps take the draft's q (draft model)
        self._jit_programs(cfg, page_size, param_shardings, kv_shardings, whole)
        self.adapters = None  # LoRA adapter slots (lora.py), set by the loader
        self.bytes_sent = 0  # host-to-device bytes of every step's inputs so far
        self.last_step_bytes = 0
        self.host_copies: kv_offload.HostCopies | None = None  # the host tier's copies

    def enable_host_tier(self, size_gib: float) -> int:
        """Keep up to `size_gib` GiB of evicted full pages in host memory, all devices
        together (kv_offloading_size; kv_offload.py); returns how many pages that is."""
        per_page = kv_offload.page_bytes(self.kv_cache, self.page_size)
        slots = int(size_gib * 2**30 // per_page)
        if slots < 1:
            raise ValueError(f"kv_offloading_size={size_gib} GiB holds no KV page "
                             f"({per_page} bytes a page, every layer)")
        self.host_copies = kv_offload.HostCopies(
            self.kv_cache, num_slots=slots, page_size=self.page_size,
            memory_kind=kv_offload.memory_kind_for(self.mesh.devices.flat[0]))
        return slots

    def _place_params(self, params: dict, kv_dtype: str) -> tuple[object, object, object]:
        """Put `params` where the step takes them, with empty LoRA adapter slots when the
        options hold some (made where they live); returns the step's (params, KV cache,
        replicated) shardings."""
        quantization = quantization_lib.mode_of(params)  # quantized at load, if at all
        head = quantization is None or quantization_lib.has_quantized_head(params)
        shardings = step_shardings(self.cfg, self.mesh, quantization, kv_dtype=kv_dtype,
                                   quantized_head=head, options=self.options)
        stages = self.options.pipeline_stages
        if stages > 1 and len(params["layers"]) == self.cfg.num_layers:
            # by slot, stacked by stage, each stage's on its own devices (another
            # replica's params come stacked)
            params = {**params, "layers": stages_lib.stacked(
                params["layers"], stages, shardings[0]["layers"])}
        slots = self.options.lora
        if slots is not None:
            params = {**params, "lora": jax.jit(
                functools.partial(lora_lib.init, self.cfg, slots),
                out_shardings=shardings[0]["lora"])()}
        self.params = jax.device_put(params, shardings[0])  # no-op when loaded so
        return shardings

    def _jit_programs(self, cfg: ModelConfig, page_size: int, param_shardings: object,
                      kv_shardings: object, whole: object) -> None:
        """The jitted programs: the step (decode-only and mixed), its scoring and verify
        variants and admission; inputs are params, KV cache, batch state, the
        step's delta and its token mask (token_masks.py); KV cache and state donated.
        Each is compiled on first use (or at warm-up) and kept."""
        ins = (param_shardings, kv_shardings, whole, whole, whole)
        outs = (kv_shardings, whole, whole)
        common = dict(page_size=page_size, attention=self.attention, options=self.options)
        # what the programs are built from, for the export cache's key (exported.py)
        self._settings = (cfg, common, self.uses_draft_probs, self.pooling)
        make, pooled = ((pool_step_function, (whole, whole)) if self.pooling
                        else (step_function, ()))
        self._steps = {decode: jax.jit(make(cfg, decode_only=decode, **common),
                                       in_shardings=ins, out_shardings=outs + pooled,
                                       donate_argnums=(1, 2)) for decode in (False, True)}
        self._score_step = jax.jit(score_step_function(cfg, **common),
                                   in_shardings=ins + (whole,), out_shardings=outs + (whole,),
                                   donate_argnums=(1, 2))
        self._verify = jax.jit(verify_step_function(cfg, **common),
                               in_shardings=ins + (whole,) * self.uses_draft_probs,
                               out_shardings=outs, donate_argnums=(1, 2))
        self._admit = jax.jit(batch_state.admit, in_shardings=(whole, whole),
                              out_shardings=whole, donate_argnums=(0,))
        self._compiled: dict[tuple[Bucket, bool], typing.Callable] = {}  # (bucket, scores)
        self._admit_compiled: typing.Callable | None = None
        self._lower_lock = threading.Lock()  # tracing is not thread-safe

    @property
    def weight_bytes(self) -> int:
        return tree_bytes(self.params)

    def warm_up(self, progress: bool = True) -> dict[str, float]:
        """Compile the step for every bucket (and its scoring variant for every mixed one
        with `enable_prompt_logprobs`) and the admission program; returns {"buckets": n,
        "scoring_buckets": m, "seconds": t}.

        Buckets compile on `COMPILE_THREADS` threads (XLA releases the GIL while it
        compiles); each lowering is taken under a lock, as tracing is not thread-safe.
        """
        start = time.perf_counter()
        buckets = self.buckets.all()
        jobs = [(b, False) for b in buckets]
        if self.enable_prompt_logprobs:
            jobs += [(b, True) for b in buckets if not b.decode]
        self._admission_program()
        if self.host_copies is not None:
            self.kv_cache = self.host_copies.warm_up(self.kv_cache)
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

    def _compile(self, bucket: Bucket, scores: bool = False) -> typing.Callable:
        if (bucket, scores) not in self._compiled:
            whole = self.masks.sharding
            spec = on_shardings(input_spec(bucket, page_size=self.page_size,
                                           num_groups=len(self.group_windows)), whole)
            args = [self.params, self.kv_cache, self.state, spec,
                    on_shardings(self.masks.spec(bucket.num_slots), whole)]
            if scores:
                name, jitted = "score", self._score_step
                args.append(on_shardings(score_input_spec(bucket), whole))
            elif bucket.num_positions > 1:
                name, jitted = "verify", self._verify
                args += [jax.ShapeDtypeStruct(
                    (bucket.num_slots, bucket.num_positions, self.cfg.vocab_size),
                    jnp.float32, sharding=whole)][:self.uses_draft_probs]
            else:
                name, jitted = ("decode" if bucket.decode else "mixed"), self._steps[bucket.decode]
            with self._lower_lock, jax.set_mesh(self.mesh):
                lowered = exported.lower(jitted, args, name=name, settings=self._settings,
                                         donate_argnums=(1, 2))
            self._compiled[(bucket, scores)] = lowered.compile()
        return self._compiled[(bucket, scores)]

    def _admission_program(self) -> typing.Callable:
        if self._admit_compiled is None:
            empty = self.slots.empty_admission()
            empty = on_shardings(empty, self.masks.sharding)
            with self._lower_lock, jax.set_mesh(self.mesh):
                lowered = exported.lower(self._admit, (self.state, empty), name="admit",
                                         settings=self._settings, donate_argnums=(0,))
            self._admit_compiled = lowered.compile()
        return self._admit_compiled

    def dispatch(self, plan: StepPlan, draft_probs: jax.Array | None = None,
                 token_masks: typing.Sequence[tuple[int, object]] = ()) -> InFlight:
        """Start one step and return without waiting for it. A plan with draft tokens
        runs in a verify bucket; `draft_probs` f32[S, Q, V] (S its slots) are their q
        when the runner takes them (`uses_draft_probs=True`). `token_masks`: (chunk index,
        MaskRow: matcher and token filter) of the requests the step samples whose mask
        the host fills (token_masks.py)."""
        requests = [c.request for c in plan.chunks]
        spans = score_spans(requests, [(c.start, c.num_tokens) for c in plan.chunks])
        scores = any(span is not None for span in spans)
        if scores and not self.enable_prompt_logprobs:
            raise ValueError("a request asks for prompt_logprobs but this runner was made "
                             "without enable_prompt_logprobs=True")
        verify = any(c.draft_token_ids for c in plan.chunks)
        if verify and (scores or self.uses_draft_probs != (draft_probs is not None)):
            raise ValueError("a verify step scores no prompt and takes draft_probs exactly "
                             "when the runner was made with uses_draft_probs=True")
        bucket = self.buckets.pick(plan.num_tokens, len(plan.chunks), verify=verify,
                                   decode=not scores and all(c.num_tokens == 1
                                                             for c in plan.chunks))
        compiled = self._compile(bucket, scores)
        if plan.transfers:  # the host tier's copies: before the step writes or reads them
            self.kv_cache = self.host_copies.run(self.kv_cache, plan.transfers)
        delta = self._send(plan.chunks, bucket)
        mask, mask_bytes = self.masks.build(token_masks, bucket.num_slots)
        self.last_step_bytes += mask_bytes
        packed_scores = None
        if verify:
            self.kv_cache, self.state, packed = compiled(
                self.params, self.kv_cache, self.state, delta, mask,
                *[draft_probs][:self.uses_draft_probs])
        elif scores:
            targets, num_top = score_targets(requests, spans, num_tokens=bucket.num_tokens)
            self.last_step_bytes += targets.nbytes + num_top.nbytes
            self.kv_cache, self.state, packed, packed_scores = compiled(
                self.params, self.kv_cache, self.state, delta, mask,
                scoring.ScoreInputs(targets, num_top))
        else:
            self.kv_cache, self.state, packed, *pooled = compiled(
                self.params, self.kv_cache, self.state, delta, mask)
        self.bytes_sent += self.last_step_bytes
        return InFlight(bucket, plan.chunks, packed, packed_scores, spans,
                        tuple(pooled) if self.pooling else None)

    def _send(self, chunks: tuple, bucket: Bucket) -> batch_state.StepDelta:
        """The step's delta; admission calls first for newly placed requests (their
        rows, and page or history writes past what a delta carries)."""
        delta, admissions = self.slots.delta(chunks, bucket)
        sent = 0
        for admission in admissions:
            sent += sum(x.nbytes for x in jax.tree.leaves(admission))
            self.state = self._admission_program()(self.state, admission)
        self.last_step_bytes = sent + delta.flat.nbytes
        return delta

    def collect(self, step: InFlight) -> StepResult:
        """Wait for a dispatched step; per chunk, a Sample for each of its `num_samples`
        positions and the PromptScores of the prompt positions it scores (or None)."""
        prompt_scores = [None] * len(step.chunks)
        if step.packed_scores is not None:
            prompt_scores = results.prompt_scores(np.asarray(step.packed_scores), step.spans)
        pooled = None
        if step.pooled is not None:
            pooled = results.pooled(*(np.asarray(x) for x in step.pooled), step.chunks)
        if self.host_copies is not None:
            self.host_copies.flush()  # the pages gathered so far, off the device
        return StepResult(step.bucket, results.samples(np.asarray(step.packed), step.chunks),
                          prompt_scores, pooled)

    def expert_tokens(self) -> dict[int, list[int]]:
        """A mixture of experts' tokens routed to each expert so far, by MoE decoder
        layer (waits for the step in flight, which holds the count)."""
        layers = [i for i in range(self.cfg.num_layers) if self.cfg.is_moe_layer(i)]
        return dict(zip(layers, np.asarray(self.state.expert_tokens).tolist(), strict=True))

    @staticmethod
    def is_done(step: InFlight) -> bool:
        """Whether a dispatched step has finished on the device (never waits)."""
        return step.packed.is_ready()

    def execute(self, plan: StepPlan, draft_probs: jax.Array | None = None) -> StepResult:
        """Run one step and wait for it: `collect(dispatch(plan, draft_probs))`."""
        return self.collect(self.dispatch(plan, draft_probs))

    def time_bucket(self, bucket: Bucket, repeats: int = 5) -> float:
        """Seconds of one step of `bucket` with nothing in it (the median of `repeats`,
        outputs read back): what the speculation policy starts its cost model from."""
        compiled = self._compile(bucket)
        delta, _ = self.slots.delta([], bucket)
        extra = []
        if bucket.num_positions > 1 and self.uses_draft_probs:
            extra = [jax.device_put(np.zeros((bucket.num_slots, bucket.num_positions,
                                               self.cfg.vocab_size), np.float32),
                                    sharding.replicated(self.mesh))]
        times = []
        for _ in range(repeats):
            began = time.perf_counter()
            self.kv_cache, self.state, packed, *_ = compiled(
                self.params, self.kv_cache, self.state, delta,
                self.masks.ones(bucket.num_slots), *extra)
            np.asarray(packed)
            times.append(time.perf_counter() - began)
        return sorted(times)[len(times) // 2]

    @functools.cached_property
    def compiles(self) -> CompileCounter:
        """Counts the XLA compilations of the threads that use this runner (compiles.py);
        made on first use, so use it before `warm_up()` to count warm-up's compiles."""
        return CompileCounter()
