"""The continuous-batching scheduler (vLLM v1's rule): add / schedule / update / finish
over a token budget, with preemption, prefix-cache hits, speculative drafts and
placeholders for tokens not yet read back; "static" batches are the benchmarks'
baseline. Plain Python, no jax. See docs/architecture.md (#the-scheduling-rule,
#the-host-loop), docs/kv_cache.md#admission-and-preemption and
docs/speculative_decoding.md#a-speculative-step.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection, Sequence

from jaxinfer.config import SCHEDULERS
from jaxinfer.engine.core.host_tier import Transfer
from jaxinfer.engine.core.kv_groups import FullAttentionPages, PageGroup, PageGroups
from jaxinfer.engine.core.page_pool import ROOT, PagePool
from jaxinfer.engine.core.plan import ScheduledChunk, StepPlan
from jaxinfer.engine.request import Request, Status

__all__ = ["CACHE_STATS", "ScheduledChunk", "Scheduler", "StepPlan"]

CACHE_STATS = ("prompt_tokens", "hit_tokens", "host_hit_tokens",
               "miss_tokens_no_shared_prefix", "miss_tokens_shared_below_page")


class Scheduler:
    """Decides which tokens of which requests each step computes."""

    def __init__(self, pages: PagePool | Sequence[PageGroup], *, page_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_ids: Collection[int] = (), policy: str = "continuous",
                 adapters: object = None) -> None:
        """`pages`: the page groups (engine/core/kv_groups.py), or the pool of one group
        that keeps every page of every layer. `adapters`: the LoRA slots
        (lora/slots.py `AdapterSlots`), which a request with an adapter must get one of
        to be admitted."""
        if policy not in SCHEDULERS:
            raise ValueError(f"scheduler={policy!r} must be one of {SCHEDULERS}")
        if isinstance(pages, PagePool):
            pages = [FullAttentionPages(pages, page_size)]
        self.pages = PageGroups(pages)
        if self.pages.page_size != page_size:
            raise ValueError(f"page groups of {self.pages.page_size} tokens a page, not "
                             f"{page_size=}")
        self.pool = self.pages.pool  # the first group's: it holds the prefix cache's chain
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy = policy
        self.adapters = adapters
        self.failed: list[Request] = []  # finished with an error while scheduled
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []  # sorted by (priority, arrival)
        self.num_preemptions = 0
        self.cache_stats = dict.fromkeys(CACHE_STATS, 0)
        self._static_quota = 0  # static mode: requests the current batch may still admit
        self._step_pages: set[int] = set()  # pages the step being planned registers
        self._step_hits: set[Request] = set()  # admitted on some of those pages

    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        budget = self.max_num_batched_tokens
        self._step_pages, self._step_hits = set(), set()
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            count = min(_target(request) - request.num_computed_tokens, budget)
            if count <= 0 or self._ends_in_flight(request) or self._awaits_token(request):
                index += 1
                continue
            if not self._reserve_or_preempt(request, count, preempted):
                continue  # `request` itself was preempted; the next one moved up
            chunks.append(_chunk(request, count))
            self._register_pages(request)  # seen by this step's admissions (device order)
            budget -= count
            index += 1
        if self.policy == "static" and not self.running:
            self._static_quota = self.max_num_seqs  # the next batch may form
        if not preempted:
            budget = self._admit(budget, chunks)
        # Single-token chunks (decodes) first: attention gathers their KV per token. A
        # chunk reading pages this step writes stays behind their writer (a pipeline's
        # microbatches write and read in token order).
        chunks.sort(key=lambda c: c.num_tokens > 1 or c.request in self._step_hits)
        return StepPlan(tuple(chunks), tuple(preempted), self._transfers(chunks))

    def _transfers(self, chunks: Sequence[ScheduledChunk]) -> tuple[Transfer, ...]:
        """The host tier's queued copies, which go with a step that runs (kept queued
        for the next one otherwise)."""
        host = self.pool.host
        return host.take_transfers() if host is not None and chunks else ()

    def _ends_in_flight(self, request: Request) -> bool:
        """Whether the tokens in flight bring the request to `max_tokens` or
        `max_model_len`: it finishes when they are read, and computes nothing more."""
        pending = request.num_output_placeholders
        return pending > 0 and (
            len(request.output_token_ids) + pending >= request.params.max_tokens
            or request.num_tokens + pending >= self.max_model_len)

    @staticmethod
    def _awaits_token(request: Request) -> bool:
        """Whether a request whose token mask the host fills (structured outputs,
        bad_words, allowed_token_ids) has a token in flight: its next token's mask needs
        that one on the host, so it sits out this step (the others do not wait;
        engine/structured/grammar.py)."""
        return request.num_output_placeholders > 0 and request.params.needs_token_mask

    def held_back_by_tokens(self) -> bool:
        """Whether at least half the running requests are constrained ones with a token
        in flight: planning now would leave them out, so the engine reads the step in
        flight first (a step of half its requests costs nearly a full one)."""
        waiting = sum(self._awaits_token(r) for r in self.running)
        return waiting > 0 and 2 * waiting >= len(self.running)

    def _reserve_or_preempt(self, request: Request, count: int,
                            preempted: list[Request]) -> bool:
        """Pages for `count` more tokens of `request`, preempting from the back as needed."""
        start = request.num_computed_tokens
        while not self.pages.reserve(request, start + count, first_query=start):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> int:
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            if self.policy == "static" and self._static_quota == 0:
                break  # the batch is formed: no newcomers until it has finished
            request = self.waiting[index]
            if self._waits_for_sibling(request) or request.num_output_placeholders:
                index += 1
                continue
            if not self._takes_adapter(request):
                index += not request.finished  # a failed one left the queue
                continue
            restored = 0
            if self.pool.enable_caching and not request.scoring_prompt:
                restored = self.pages.take_cached(request)  # a scoring prompt runs all (vLLM)
                if self._step_pages.intersection(request.page_ids[0]):
                    self._step_hits.add(request)
            start = request.num_computed_tokens
            count = min(_target(request) - start, budget)
            if not self.pages.reserve(request, start + count, first_query=start):
                self._release(request)  # the cached pages it took, if any
                request.num_computed_tokens = 0
                break
            if request.num_cached_tokens is None:
                self._record_lookup(request)
                self.cache_stats["host_hit_tokens"] += restored * self.page_size
            self.waiting.pop(index)
            self._static_quota -= self.policy == "static"
            request.status = Status.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            chunks.append(_chunk(request, count))
            self._register_pages(request)
            budget -= count
        return budget

    def _takes_adapter(self, request: Request) -> bool:
        """Whether the request runs on the base model or got a slot holding its adapter
        (else it waits, as for pages, while requests of other adapters go on). An
        adapter that can no longer be read (its host copy dropped, its files gone) ends
        the request with an error, the others unharmed."""
        if request.lora is None:
            return True
        try:
            return self.adapters.acquire(request)
        except ValueError as e:
            self.finish(request, "error", f"lora_request: {e}")
            self.failed.append(request)
            return False

    def take_failed(self) -> list[Request]:
        """The requests `schedule` ended with an error since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def _waits_for_sibling(self, request: Request) -> bool:
        """An n > 1 sibling waits while another computes their shared prompt pages."""
        if not (self.pool.enable_caching and request.group):
            return False
        if len(request.prompt_token_ids) <= self.page_size:
            return False  # no full page to share
        shared = (len(request.prompt_token_ids) - 1) // self.page_size
        return any(r.group == request.group and (
            r.num_computed_tokens < len(r.prompt_token_ids)
            or len(r.page_serials) < shared) for r in self.running)

    def _record_lookup(self, request: Request) -> None:
        """The prefix cache's hit and its misses, split by cause, at first admission."""
        prompt, hit = len(request.prompt_token_ids), request.num_computed_tokens
        request.num_cached_tokens = hit
        parent = request.page_serials[-1] if request.page_serials else ROOT
        shared = 0
        if self.pool.enable_caching:
            shared = min(prompt - hit, self.pool.partial_overlap(
                parent, request.prompt_token_ids[hit:hit + self.page_size],
                request.cache_key))
        stats = self.cache_stats
        stats["prompt_tokens"] += prompt
        stats["hit_tokens"] += hit
        stats["miss_tokens_shared_below_page"] += shared
        stats["miss_tokens_no_shared_prefix"] += prompt - hit - shared

    def _register_pages(self, request: Request) -> None:
        """Register the request's newly computed full pages in the prefix cache (those
        of a chunk being scheduled: requests admitted later in the step hit them, as in
        vLLM, for a layer writes the step's K/V before it attends)."""
        known = len(request.page_serials)
        self.pages.register(request)
        if request.page_ids:
            self._step_pages.update(request.page_ids[0][known:len(request.page_serials)])

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request)

    def _release(self, request: Request) -> None:
        """Give back the request's pages in every group (cached ones stay cached) and its
        adapter slot."""
        self.pages.release(request)
        if request.adapter_slot >= 0:
            self.adapters.release(request)

    def reserve_drafts(self, plan: StepPlan, wanted: Sequence[int]) -> list[int]:
        """Pages for up to `wanted[i]` draft tokens after chunk i (a decode: its one token
        is the request's last); returns how many each got: fewer where the context ends
        or the pool runs short (drafts never preempt)."""
        granted = []
        for chunk, count in zip(plan.chunks, wanted, strict=True):
            end = chunk.start + chunk.num_tokens
            count = max(0, min(count, self.max_model_len - end))
            while count and not self.pages.reserve(chunk.request, end + count):
                count -= 1
            granted.append(count)
        return granted

    def with_drafts(self, plan: StepPlan, drafts: Sequence[Sequence[int]]) -> StepPlan:
        """`plan` with each chunk followed by its drafts (pages from `reserve_drafts`)."""
        chunks = tuple(dataclasses.replace(
            chunk, num_tokens=chunk.num_tokens + len(draft),
            num_samples=chunk.num_samples + len(draft), draft_token_ids=tuple(draft))
            if draft else chunk for chunk, draft in zip(plan.chunks, drafts, strict=True))
        for chunk in chunks:
            chunk.request.num_computed_tokens += len(chunk.draft_token_ids)
        # the drafts' pages may have evicted cached ones: their offloads go first
        return dataclasses.replace(plan, chunks=chunks,
                                   transfers=plan.transfers + self._transfers(chunks))

    def update(self, plan: StepPlan, sampled: Sequence[Sequence[int]]) -> list[Request]:
        """Advance each chunk's request and append its sampled tokens, in order, checking
        the stop conditions after each: the tokens after a stop token, `max_tokens` or
        `max_model_len` are dropped. `sampled` has one list per chunk, of at most its
        `num_samples` tokens. A chunk with drafts keeps the accepted ones and the target's
        token after them (`ScheduledChunk.accepted`); its computed length rolls back to
        them and pages past the request's tokens are freed. A request preempted while
        the step ran keeps its tokens (it recomputes them); one that finished meanwhile
        (aborted, or a stop one step earlier) takes none. Returns the requests that
        finished."""
        finished = []
        for chunk, tokens in zip(plan.chunks, sampled, strict=True):
            if len(tokens) > chunk.num_samples:
                raise ValueError(f"{len(tokens)} tokens for a chunk of "
                                 f"{chunk.request.request_id!r} that samples "
                                 f"{chunk.num_samples}")
            request = chunk.request
            request.num_output_placeholders -= chunk.num_samples > 0  # _chunk's one
            if request.finished:
                continue
            if chunk.draft_token_ids:
                accepted = chunk.accepted(tokens)
                request.num_computed_tokens -= len(chunk.draft_token_ids) - accepted
                tokens = tokens[:accepted + 1]
            reason = self._append(request, tokens)
            if request.status is Status.RUNNING:
                self._register_pages(request)  # after the append: accepted drafts fill pages
            if reason is not None:
                self.finish(request, *reason)
                finished.append(request)
            elif chunk.draft_token_ids:
                self.pages.trim(request)
        return finished

    def _append(self, request: Request, tokens: Sequence[int]
                ) -> tuple[str, int | None] | None:
        """Append sampled tokens up to the first that stops the request; its reason."""
        for token in tokens:
            request.output_token_ids.append(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                return reason
        return None

    def _stop_reason(self, request: Request, token: int) -> tuple[str, int | None] | None:
        params = request.params
        count = len(request.output_token_ids)
        if count >= params.min_tokens:
            if token in params.stop_token_ids:
                return "stop", token
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
        if count >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length", None
        return None

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None,
               *, num_output_tokens: int | None = None) -> None:
        """End a request (stop, length, a stop string, or abort) and free its pages.

        `num_output_tokens` keeps only that many of its outputs: the engine found a stop
        string before the last token a step appended. The later tokens are dropped, and
        with them whatever end they had caused: this reason replaces it.
        """
        if num_output_tokens is not None and num_output_tokens < len(request.output_token_ids):
            del request.output_token_ids[num_output_tokens:]
            if request.finished:
                request.finish_reason, request.stop_reason = reason, stop_reason
                return
        if request.finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason


def _target(request: Request) -> int:
    """Tokens the request's K/V must cover: prompt, outputs, and placeholders."""
    return request.num_tokens + request.num_output_placeholders


def _chunk(request: Request, count: int) -> ScheduledChunk:
    """The next `count` tokens of `request`, one sample if they reach its last token;
    the request's computed count and placeholders move on."""
    start = request.num_computed_tokens
    samples = int(start + count == _target(request))
    request.num_computed_tokens += count
    request.num_output_placeholders += samples
    return ScheduledChunk(request, start, count, samples)
