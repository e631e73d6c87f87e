"""The engine loop the faces drive: add_request / step / abort / has_unfinished. It owns
the scheduler, the runner `loading.load` built, per-request text state and the metrics;
one `step()` plans, dispatches and reads back (async: step t + 1 runs while step t's
tokens become outputs). Imports no jax, numpy, model or checkpoint (an import contract).
See docs/architecture.md (#one-step, #the-host-loop) and docs/sampling.md#the-python-api.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from collections.abc import Sequence

from jaxinfer.config import EngineConfig
from jaxinfer.engine import adapters, checks, loading
from jaxinfer.engine import runner as runner_lib
from jaxinfer.engine import sleep as sleep_mode
from jaxinfer.engine.controls import RolloutControls
from jaxinfer.engine.core import kv_groups
from jaxinfer.engine.core.scheduler import Scheduler, StepPlan
from jaxinfer.engine.detokenize import TextState
from jaxinfer.engine.intake import RequestIntake
from jaxinfer.engine.metrics.clock import Sent, StepClock
from jaxinfer.engine.metrics.summary import Metrics
from jaxinfer.engine.output import TokenTexts, copy_into, output_logprobs, record_prompt_scores
from jaxinfer.engine.pooled import PoolBook, PromptPools
from jaxinfer.engine.request import (
    CompletionOutput,
    PreparedRequest,
    Request,
    RequestOutput,
    SamplingParams,
    fold_seed,
)
from jaxinfer.engine.runner import STOP_WIDTH
from jaxinfer.engine.structured.grammar import Constraints

log = logging.getLogger(__name__)


class Engine(RequestIntake, RolloutControls, adapters.AdapterControls):
    """A model served with continuous batching over a paged KV cache."""

    def __init__(self, model: str | os.PathLike, config: EngineConfig | None = None,
                 *, warm_up: bool = True, replica: int = 0,
                 params_from: dict | None = None) -> None:
        """`replica`, `params_from`: a data-parallel replica (engine/parallel/data_parallel.py)."""
        config = loading.with_served_dtype(model, config or EngineConfig())
        self.config = config
        loaded = loading.load(model, config, replica=replica, params_from=params_from)
        self.model_dir = loaded.model_dir
        self.model_config = loaded.model_config
        self.tokenizer = loaded.tokenizer  # None with skip_tokenizer_init
        self.eos_token_ids = loaded.eos_token_ids
        self.default_params = loaded.default_params  # for requests that give no params
        self.max_model_len = loaded.max_model_len
        self.memory_plan = loaded.memory_plan
        self.runner = loaded.runner
        self.speculation = loaded.speculation  # None without speculative decoding
        self.compiles = self.runner.compiles  # made now, so warm-up's compiles count
        self.sleeper = runner_lib.Sleeper(self.runner)  # sleep mode (docs/rl.md)
        self.adapter_slots = adapters.make_slots(self)  # LoRA (docs/lora.md)
        self.metrics = Metrics(bandwidth_gb_per_s=self.memory_plan.bandwidth_gb_per_s,
                               flop_count=loaded.flops,
                               speculation=self.speculation and self.speculation.stats.summary,
                               expert_tokens=self.model_config.moe and self.runner.expert_tokens)
        self.scheduler = Scheduler(
            kv_groups.from_plan(self.memory_plan.page_groups, page_size=config.page_size,
                                enable_caching=config.enable_prefix_caching,
                                host_pages=self.runner.host_copies and
                                self.runner.host_copies.num_slots),
            page_size=config.page_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
            policy=config.scheduler, adapters=self.adapter_slots)
        self.metrics.page_groups = self.scheduler.pages.usage
        if config.enable_prefix_caching:
            self.metrics.prefix_cache = self._prefix_cache_counts
        if self.runner.host_copies is not None:
            self.metrics.kv_offload = self._kv_offload_counts
        self._rng = random.Random(config.seed)
        self._arrivals = 0
        self._requests: dict[str, list[Request]] = {}  # prompt id -> its n completions
        self._outputs: dict[str, RequestOutput] = {}
        self._texts: dict[str, TextState] = {}  # a completion's request_id -> its text
        self._token_text = TokenTexts(self.tokenizer)  # a token's text, for logprobs
        self.constraints = Constraints(  # host token masks (engine/structured/grammar.py)
            self.model_dir if self.tokenizer else None,
            vocab_size=self.model_config.vocab_size, eos_token_ids=self.eos_token_ids,
            tokenizer=self.tokenizer)
        self.metrics.token_masks = self.runner.masks.counts
        self.async_scheduling = config.async_scheduling
        self.metrics.async_scheduling = self.async_scheduling
        self._in_flight: _Dispatched | None = None  # async: the step the next call reads
        self.paused = False  # pause_generation: no step runs (engine/weights_update.py)
        self.clock = StepClock(self.metrics)  # the loop's timestamps (metrics/clock.py)
        # a pooling model's pooled hidden states per request (engine/pooled.py)
        self.pools = PoolBook() if self.runner.pooling else None
        if warm_up:
            self.warm_up()

    def _prefix_cache_counts(self) -> dict[str, int]:
        pool = self.scheduler.pool
        return self.scheduler.cache_stats | {"evictions": pool.num_evictions,
                                             "cached_pages": pool.num_cached}

    def _kv_offload_counts(self) -> dict[str, float]:
        host, copies = self.scheduler.pool.host, self.runner.host_copies
        return {"host_pages": host.num_slots, "host_pages_held": host.num_held,
                "host_evictions": host.stats["evictions"],
                "copies_saved": host.stats["copies_saved"],  # evicted again, held already
                "pages_dropped": host.stats["dropped"], **copies.stats.as_dict()}

    def warm_up(self) -> None:
        """Compile every bucket now, so that serving never compiles."""
        before = self.compiles.total
        with runner_lib.CacheLoads() as loads:
            result = self.runner.warm_up()
            if self.speculation is not None:
                result = self.speculation.warm_up(self.runner, result)
        self.metrics.warmup_seconds = result["seconds"]
        self.metrics.num_buckets = int(result["buckets"])
        self.metrics.compiles_at_warmup = self.compiles.total
        # A load from the cache counts as a compile too.
        self.metrics.warmup_compiled = self.compiles.total - before - loads.count
        self.metrics.warmup_loaded = loads.count
        log.info("warm-up: %d buckets, %d programs in %.1fs: %d compiled, %d loaded from "
                 "the compilation cache", result["buckets"],
                 self.metrics.warmup_compiled + loads.count, result["seconds"],
                 self.metrics.warmup_compiled, loads.count)
        plan = self.memory_plan
        log.info("memory: planned %d weight + %d KV bytes (%d pages); allocated %d + %d",
                 plan.weight_bytes, plan.kv_cache_bytes, plan.num_pages,
                 runner_lib.tree_bytes(self.runner.params),
                 runner_lib.tree_bytes(self.runner.kv_cache))

    # ---- requests -------------------------------------------------------------------

    def check_params(self, params: SamplingParams) -> tuple[object | None, object | None]:
        """Engine-level limits of sampling parameters (beyond SamplingParams' own); returns
        what fills the request's token mask (engine/structured/): the constraint's
        compiled matcher and the token filter (bad_words, allowed_token_ids), each None
        when not asked. ValueError naming the field."""
        checks.check_params(params, config=self.config, has_tokenizer=self.tokenizer is not None,
                            vocab_size=self.model_config.vocab_size,
                            eos_token_ids=self.eos_token_ids, stop_width=STOP_WIDTH)
        token_filter = self.constraints.token_filter(params)
        return self.constraints.check(params.structured_outputs), token_filter

    def add_request(self, request_id: str, prompt: str | Sequence[int] | None = None,
                    params: SamplingParams | None = None, *, messages: list[dict] | None = None,
                    priority: int = 0, prompt_token_ids: list[int] | None = None,
                    lora_request: object = None) -> None:
        """Queue a prompt (text, token ids, or chat messages) for `params.n` completions
        (with a LoRA adapter: `lora_request`): `prepare`, then `add_prepared`."""
        self.add_prepared(request_id, self.prepare(prompt, params, messages=messages,
                                                   prompt_token_ids=prompt_token_ids,
                                                   lora_request=lora_request),
                          priority=priority)

    def add_prepared(self, request_id: str, prepared: PreparedRequest, *,
                     priority: int = 0) -> None:
        """Queue a request `prepare` made (nothing is checked again)."""
        sleep_mode.refuse_if_asleep(self, f"request {request_id!r}")
        if request_id in self._outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt, ids, params = prepared.prompt, prepared.prompt_token_ids, prepared.params
        seed = params.seed if params.seed is not None else self._rng.randrange(2**31)
        children = []
        for index in range(params.n):
            request = Request(request_id=f"{request_id}#{index}", prompt_token_ids=list(ids),
                              params=params, arrival=self._arrivals,
                              seed=fold_seed(seed, index), priority=priority,
                              group=request_id if params.n > 1 else "",
                              parent_id=request_id, lora=prepared.lora)
            self._arrivals += 1
            self.clock.added(request.request_id)
            detokenizer = self.tokenizer.detokenizer(
                ids, params.skip_special_tokens) if self.tokenizer and params.detokenize else None
            self._texts[request.request_id] = TextState(
                detokenizer, params.stop, keep_stop=params.include_stop_str_in_output)
            self.constraints.add(request, prepared.grammar, prepared.token_filter)
            children.append(request)
        if params.prompt_logprobs is not None:
            children[0].prompt_logprobs = []  # the first completion scores the prompt
        self._requests[request_id] = children
        self._outputs[request_id] = RequestOutput(
            request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids, outputs=[
                CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)])
        for request in children:
            self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        """Stop a prompt's completions now; its pages are freed. Unknown ids are ignored."""
        for request in self._requests.get(request_id, []):
            self.scheduler.finish(request, "abort")
        if request_id in self._outputs:
            self._sync(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def counts(self) -> tuple[int, int, int]:
        """(waiting, running, slots): completions waiting and running, and max_num_seqs."""
        scheduler = self.scheduler
        return len(scheduler.waiting), len(scheduler.running), scheduler.max_num_seqs

    def output(self, request_id: str) -> RequestOutput:
        return self._outputs[request_id]

    def release(self, request_id: str) -> RequestOutput:
        """Forget a finished prompt and return its final output."""
        for request in self._requests.pop(request_id):
            self._texts.pop(request.request_id, None)
            if self.pools is not None:
                self.pools.pop(request.request_id)
            self.constraints.drop(request)
        return self._outputs.pop(request_id)

    def pooled(self, request_id: str) -> PromptPools | None:
        """A pooling model's finished prompt: its chunks' pooled hidden states (taken:
        asked once, before `release`); None where no step pooled it."""
        return self.pools.pop(self._requests[request_id][0].request_id)

    def device_memory_bytes(self) -> int:
        """Bytes of live jax arrays on this engine's devices (JAX's own count)."""
        return runner_lib.live_device_bytes(self.sleeper.devices)

    # ---- the loop -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One device step. Returns the outputs of prompts that changed, with deltas:
        of the step dispatched now, or with `async_scheduling` of the one the previous
        call dispatched (this call's is read by the next)."""
        if self.paused:  # pause_generation: nothing runs until resume_generation
            return []
        self.clock.schedule(device_done=self._in_flight is not None
                            and self.runner.is_done(self._in_flight.step))
        read = []
        if self._reads_first():
            done, self._in_flight = self._in_flight, None
            read = self._complete(done)
        plan = self.scheduler.schedule()
        failed = [self._sync(pid) for pid in dict.fromkeys(  # their adapter unreadable
            r.parent_id for r in self.scheduler.take_failed())]
        if not plan.chunks and self._in_flight is None:
            if self.scheduler.has_unfinished() and not read and not failed:
                raise RuntimeError("the scheduler could not place any waiting request "
                                   "(KV cache smaller than one request?)")
            return read + failed
        compiles = self.compiles.begin()
        dispatched = self._dispatch(plan) if plan.chunks else None
        previous = dispatched
        if self.async_scheduling:
            previous, self._in_flight = self._in_flight, dispatched
        outputs = read or (self._complete(previous) if previous is not None else [])
        self._check_compiles(compiles)
        if not self.has_unfinished():
            self.clock.idle()
        return outputs + failed

    def _reads_first(self) -> bool:
        """Whether the step in flight is read before this call plans: most running
        requests are constrained ones waiting for it (docs/structured_outputs.md), or it
        verified drafts, or this step may."""
        return self._in_flight is not None and bool(
            self.scheduler.held_back_by_tokens() or self._in_flight.plan.has_drafts
            or self.speculation and self.speculation.may_speculate(self.scheduler.running))

    def _dispatch(self, plan: StepPlan) -> _Dispatched:
        """Add drafts (speculative decoding) and start the step on the device."""
        draft_probs, slots = None, 0
        if self.speculation is not None:
            slots = self.runner.buckets.decode_slots_for(len(plan.chunks))
            if self._in_flight is None:
                plan, draft_probs = self.speculation.add_drafts(self.scheduler, plan, slots)
            else:  # planned beside a step in flight: its last tokens are not read yet
                self.speculation.skip(plan)
        sent = self.clock.dispatch()
        step = self.runner.dispatch(plan, draft_probs, self.constraints.rows(plan.chunks))
        return _Dispatched(plan, step, slots, sent, self.runner.last_step_bytes)

    def _complete(self, done: _Dispatched) -> list[RequestOutput]:
        """Read a dispatched step back: collect, update, sync; then count the step."""
        self.clock.collect()
        result = self.runner.collect(done.step)
        self.clock.collected(nothing_in_flight=self._in_flight is None)
        changed, lengths, dropped = self._update(done, result)
        outputs = [self._sync(rid) for rid in changed]
        plan, bucket = done.plan, result.bucket
        seconds = self.clock.synced(done.sent, verified=plan.has_drafts, bytes_sent=done.bytes)
        self.metrics.preemptions = self.scheduler.num_preemptions
        self.metrics.record_plan(
            plan.chunks, lengths, bucket.num_tokens, bucket.num_slots, seconds=seconds,
            dropped=dropped, pages_in_use=self.scheduler.pool.num_used,
            weight_bytes=self.memory_plan.weight_bytes,
            kv_bytes_per_token=self.memory_plan.kv_bytes_per_token)
        self.clock.recorded()
        return outputs

    def _update(self, done: _Dispatched, result: runner_lib.StepResult
                ) -> tuple[list[str], list[int], list[bool]]:
        """Move the step's requests on by its results. Returns the prompts whose outputs
        changed, each chunk's output count before the step, and whether its request had
        stopped before the step was read (its positions discarded)."""
        plan = done.plan
        record_prompt_scores(plan.chunks, result.prompt_scores, self._token_text)
        if result.pooled is not None:
            self.pools.record(plan.chunks, result.pooled)
        dropped = [c.request.finished for c in plan.chunks]
        lengths = [len(c.request.output_token_ids) for c in plan.chunks]
        self.clock.scheduled(c.request.request_id for c in plan.chunks)
        sampled = [[s.token_id for s in chunk] for chunk in result.samples]
        for request, why in self.constraints.failed(plan.chunks):  # a mask it could not fill
            self.scheduler.finish(request, "error", why)
        self.scheduler.update(plan, sampled)
        for request, reason, why in self.constraints.advance(plan.chunks):
            self.scheduler.finish(request, reason, why)  # its grammar complete, or failed
        if self.speculation is not None:
            self.speculation.record(plan, sampled, done.slots,
                                    self.clock.device_seconds(done.sent))
        return self._record_tokens(plan, result.samples, lengths), lengths, dropped

    def _check_compiles(self, span: runner_lib.CompileSpan) -> None:
        new = self.compiles.end(span)
        if new:
            self.metrics.compiles_after_warmup += new
            log.warning("%d compilation(s) after warm-up", new)
            if self.config.strict_compile:
                raise RuntimeError(f"{new} XLA compilation(s) after warm-up "
                                   "(strict_compile=True)")

    def _record_tokens(self, plan: StepPlan, samples: list[list[runner_lib.Sample]],
                       lengths: list[int]) -> list[str]:
        """Logprobs and text of the tokens `Scheduler.update` appended (`lengths`: the
        output counts before it), one at a time: a stop string ends the request at the
        token that completes it and drops the tokens after it."""
        changed: dict[str, None] = {}
        self.clock.update()
        for chunk, chunk_samples, before in zip(plan.chunks, samples, lengths, strict=True):
            request = chunk.request
            added = len(request.output_token_ids) - before
            if added <= 0:
                continue
            self.clock.tokens(request.request_id, added)
            text = self._texts[request.request_id]
            for index, sample in enumerate(chunk_samples[:added]):
                if request.params.logprobs is not None:
                    request.output_logprobs.append(output_logprobs(
                        sample, request.params.logprobs, request.params.greedy,
                        self._token_text))
                text.add([sample.token_id])
                if text.stop_string is not None:
                    self.scheduler.finish(request, "stop", text.stop_string,
                                          num_output_tokens=before + index + 1)
                    break
            changed[request.parent_id] = None
        return list(changed)

    def _sync(self, request_id: str) -> RequestOutput:
        """Copy the completions' state into the prompt's RequestOutput, with deltas."""
        def finished(request: Request) -> None:
            self.clock.finished(request.request_id, request.finish_reason)
        return copy_into(self._outputs[request_id], self._requests[request_id],
                         self._texts, finished)


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    """A step on its way: its plan, the runner's handle, and what `_complete` records."""

    plan: StepPlan
    step: runner_lib.InFlight
    slots: int  # decode slots the speculation policy priced (0 without it)
    sent: Sent  # when it was planned and sent (metrics/clock.py)
    bytes: int  # host-to-device bytes it sent

