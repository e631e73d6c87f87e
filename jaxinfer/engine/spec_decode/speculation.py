"""Speculative decoding on the host (`Speculation`): between scheduling and the device
step, `add_drafts` asks the policy for k, the proposer for drafts and the scheduler for
their pages (a step with prompt chunks or prompt scoring does not speculate); `record`
feeds back what a step took and accepted. Plain Python, no jax.
See docs/speculative_decoding.md (#a-speculative-step, #metrics).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

from jaxinfer.engine.core.scheduler import Scheduler, StepPlan
from jaxinfer.engine.request import Request
from jaxinfer.engine.spec_decode.policy import Policy
from jaxinfer.engine.spec_decode.proposer import DraftProposer, HeadProposer, NgramProposer

SKIP_REASONS = ("prompt_chunks", "batch_size", "cost", "no_match", "limit", "pages",
                "structured_outputs", "in_flight")


@dataclasses.dataclass
class SpecStats:
    """What speculation did, as vLLM counts it (`llm.metrics()`, Prometheus)."""

    steps: int = 0  # verify steps
    drafts: int = 0  # requests that verified >= 1 draft, summed over verify steps
    draft_tokens: int = 0  # drafts verified
    accepted_tokens: int = 0  # drafts accepted
    request_steps: int = 0  # requests summed over decode and verify steps
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    draft_seconds: float = 0.0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def summary(self, step_seconds: float) -> dict[str, object]:
        return {
            "spec_verify_steps": self.steps,
            "spec_num_drafts": self.drafts,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_acceptance_rate": round(self.accepted_tokens / max(self.draft_tokens, 1), 4),
            # vLLM's mean acceptance length: 1 + accepted drafts per draft run
            "spec_mean_acceptance_length": round(
                1 + self.accepted_tokens / max(self.drafts, 1), 3),
            # tokens a request gains per target step, decode and verify steps alike:
            # one each, plus the accepted drafts
            "spec_tokens_per_request_step": round(
                1 + self.accepted_tokens / max(self.request_steps, 1), 3),
            "spec_accepted_per_position": list(self.accepted_per_position),
            "spec_draft_time_share": round(self.draft_seconds / max(step_seconds, 1e-9), 4),
            **{f"spec_skipped_{reason}": self.skipped[reason] for reason in SKIP_REASONS},
        }


class Speculation:
    """The proposer, the policy and the counts of one engine."""

    def __init__(self, proposer: NgramProposer | DraftProposer | HeadProposer, *,
                 max_drafts: int, adaptive: bool = True,
                 disable_by_batch_size: int | None = None, buckets: object = None) -> None:
        self.proposer = proposer
        self.buckets = buckets  # the runner's BucketSet: a batch's decode slot rung
        self.max_drafts = max_drafts
        self.disable_by_batch_size = disable_by_batch_size
        # a model proposes (a draft model or heads): proposals cost device time, come with
        # their probabilities, and the policy prices each k
        self.draft_model = not isinstance(proposer, NgramProposer)
        self.policy = Policy(max_drafts, adaptive=adaptive, free_proposals=not self.draft_model)
        self.stats = SpecStats(accepted_per_position=[0] * max_drafts)

    def warm_up(self, runner: object, result: dict[str, float]) -> dict[str, float]:
        """After the target's warm-up (`result`: its counts): compile the draft model's
        programs and, for the adaptive policy, time every decode and verify bucket once
        (and the draft's proposal calls of 1 and K + 1 steps) to seed the cost model.
        Returns `result` with the draft's programs and this time added."""
        started = time.perf_counter()
        draft = self.proposer.runner if self.draft_model else None
        programs = draft.warm_up() if draft is not None else 0
        if self.policy.adaptive:
            buckets = runner.buckets
            for decode, verify in zip(buckets.decode(), buckets.verify(), strict=True):
                slots = decode.num_slots
                self.policy.seed("decode", slots, runner.time_bucket(decode))
                self.policy.seed("verify", slots, runner.time_bucket(verify))
                for steps in {1, self.max_drafts + 1} if draft is not None else ():
                    self.policy.seed_draft(slots, steps, draft.time_propose(slots, steps))
        return result | {"buckets": result["buckets"] + programs,
                         "seconds": result["seconds"] + time.perf_counter() - started}

    def add_drafts(self, scheduler: Scheduler, plan: StepPlan, slots: int
                   ) -> tuple[StepPlan, object | None]:
        """`plan` with drafts where the policy speculates (and the draft probabilities on
        device for a draft model's), else `plan` as it was and None. `slots`: the
        decode slot rung of the plan's requests."""
        chunks = plan.chunks
        if not chunks or not all(c.num_tokens == 1 and c.num_samples == 1
                                 and not c.request.scoring_prompt for c in chunks):
            self.stats.skipped["prompt_chunks"] += len(chunks)
            return plan, None
        if self.disable_by_batch_size and len(chunks) >= self.disable_by_batch_size:
            self.stats.skipped["batch_size"] += len(chunks)
            return plan, None
        if not self.policy.may_pay(slots):
            self.stats.skipped["cost"] += len(chunks)
            return plan, None
        room = [max(0, min(c.request.params.max_tokens - len(c.request.output_token_ids),
                           scheduler.max_model_len - c.request.num_tokens) - 1)
                for c in chunks]
        # A request whose token mask the host fills (structured outputs, bad_words,
        # allowed_token_ids) never speculates: its drafts would need a mask per
        # position, each after the drafts before it (engine/structured/grammar.py).
        constrained = [c.request.params.needs_token_mask for c in chunks]
        self.stats.skipped["structured_outputs"] += sum(constrained)
        room = [-1 if c else r for c, r in zip(constrained, room, strict=True)]
        caps = [min(self.max_drafts, max(r, 0)) for r in room]
        requests = [c.request for c in chunks]
        proposals = None
        if not self.draft_model:
            if not self.policy.worth_proposing(requests, slots, caps, self.draft_model):
                self._count_skips(room, caps, None)
                return plan, None
            proposals = [self.proposer.propose(c.request, cap)
                         for c, cap in zip(chunks, caps, strict=True)]
            caps = [len(p) for p in proposals]
        k = self.policy.choose(requests, slots, caps, self.draft_model) if any(caps) else 0
        if k == 0:
            self._count_skips(room, caps, None)
            return plan, None
        wanted = [min(k, cap) for cap in caps]
        granted = scheduler.reserve_drafts(plan, wanted)
        self._count_skips(room, caps, granted)
        if not any(granted):
            return plan, None
        probs = None
        if self.draft_model:
            before = self.proposer.runner.seconds
            proposals, probs = self.proposer.propose(chunks, granted)
            seconds = self.proposer.runner.seconds - before
            self.stats.draft_seconds += seconds
            self.policy.seed_draft(slots, max(granted) + 1, seconds)
        drafts = [p[:g] for p, g in zip(proposals, granted, strict=True)]
        return scheduler.with_drafts(plan, drafts), probs

    def may_speculate(self, requests: Sequence[Request]) -> bool:
        """Whether the policy could speculate in a step of `requests` (decoding): the
        engine then reads the step in flight before it plans, for the proposals need
        every request's last token."""
        if not requests:
            return False
        slots = self.buckets.decode_slots_for(len(requests))
        caps = [self.max_drafts] * len(requests)
        return self.policy.might_speculate(requests, slots, caps, self.draft_model)

    def skip(self, plan: StepPlan) -> None:
        """A step planned while the one before was in flight (`may_speculate` said no):
        it cannot speculate, its requests' last tokens not read yet. It counts as a step
        for the policy's clock, and its requests as skipped `in_flight` (or for their
        prompt chunks)."""
        chunks = plan.chunks
        if all(c.num_tokens == 1 and c.num_samples == 1 for c in chunks):
            self.policy.clock += 1
            self.stats.skipped["in_flight"] += len(chunks)
        else:
            self.stats.skipped["prompt_chunks"] += len(chunks)

    def _count_skips(self, room: Sequence[int], caps: Sequence[int],
                     granted: Sequence[int] | None) -> None:
        """Why each request of a decode step verifies no draft: no room left (`limit`),
        nothing found (`no_match`), the policy said no (`cost`), no pages (`pages`); a
        room of -1: constrained, counted already."""
        for r, cap, got in zip(room, caps, granted or [0] * len(room), strict=True):
            if r < 0:
                continue
            if r == 0:
                self.stats.skipped["limit"] += 1
            elif cap == 0:
                self.stats.skipped["no_match"] += 1
            elif granted is None:
                self.stats.skipped["cost"] += 1
            elif got == 0:
                self.stats.skipped["pages"] += 1

    def record(self, plan: StepPlan, sampled: Sequence[Sequence[int]], slots: int,
               execute_seconds: float) -> None:
        """After a decode or verify step: its time for the cost model, and what each
        request accepted."""
        verified = any(c.draft_token_ids for c in plan.chunks)
        if not verified and not all(c.num_tokens == 1 for c in plan.chunks):
            return  # a step with prompt chunks: its time says nothing of either option
        self.policy.seed("verify" if verified else "decode", slots, execute_seconds)
        self.stats.request_steps += len(plan.chunks)
        if not verified:
            return
        self.stats.steps += 1
        for chunk, tokens in zip(plan.chunks, sampled, strict=True):
            drafts = len(chunk.draft_token_ids)
            if not drafts:
                continue
            accepted = chunk.accepted(tokens)
            self.policy.record_acceptance(chunk.request, drafts, accepted)
            self.stats.drafts += 1
            self.stats.draft_tokens += drafts
            self.stats.accepted_tokens += accepted
            for position in range(accepted):
                self.stats.accepted_per_position[position] += 1
        if self.draft_model:
            self.proposer.verified(plan.chunks)
