"""Speculative decoding on the host: when to speculate, how far, and what it achieved.
Plain Python, no jax.

`Speculation.add_drafts(scheduler, plan)` runs between scheduling and the device step.
Only a step whose every chunk is a decode (one token, the request's last; no prompt
chunk, no prompt scoring) speculates: such steps run in verify buckets (Q = K + 1
positions a request, engine/buckets.py); a step with prompt chunks runs as it would
without speculation. For the others the policy (`Policy`) picks k, drafts are asked of
the proposer (engine/proposer.py), pages reserved for them (`Scheduler.reserve_drafts`,
never preempting) and put in the chunks; the verify step's samples then decide
(`Scheduler.update` keeps the accepted drafts and the target's token after them).
`record()` feeds back what a step took and accepted.

The policy (load-adaptive, `adaptive=True`): a request with per-draft acceptance rate a
that verifies k drafts emits E(a, k) = 1 + a + ... + a^k tokens a step (each draft
counts only if the ones before it were accepted). A step over S slots costs t_decode(S)
without speculation, t_verify(S) + t_draft(S, k) with it (the verify bucket is padded to
K + 1 tokens a request whatever k is; t_draft is the proposer's call: a draft model's
k + 1 steps, EAGLE's k, Medusa's heads; 0 for n-gram lookup). The policy takes the k (0 =
no speculation) with the most expected tokens per second. The times are the runner's
own, measured: seeded at warm-up by running each bucket, then the median of the last
`WINDOW` steps of each kind (a median: one step slowed by the rest of the machine must
not switch the policy for long). An option not taken for `EXPLORE_EVERY` steps is
measured again: while speculating, a plain decode step always (an estimate too slow from
a noisy moment must not keep the engine speculating at a loss, and a decode step costs
nothing more); while decoding, a verify step only if its estimate is within
`EXPLORE_WITHIN` of decoding's rate (such a step can cost a draft model's catch-up, and
a wrong guess here only forgoes a gain), or, for n-gram lookup (free proposals),
whatever its estimate while fewer than `TRUSTED_DRAFTS` drafts have been verified (the
prior rate is a guess). Acceptance is counted per request, with the engine's running
rate (starting at `PRIOR_ACCEPTANCE`) as a prior worth `PRIOR_WEIGHT` drafts. Where even
a verify step with every draft accepted (K + 1 tokens a request) would not beat a decode
step, nothing is proposed at all (`may_pay`), and n-gram lookups run only where k drafts
for every request could pay (`worth_proposing`): a batch-bound engine pays a comparison
a step. So when the batch is compute-bound (verifying K + 1 tokens a request costs
nearly K + 1 decode steps) speculation is off, and with low acceptance the draft model
runs fewer steps. `adaptive=False` always speculates with k = K.
`disable_by_batch_size` (vLLM's) is a fixed cut-off checked first: no speculation in a
step of that many requests or more.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
import weakref
from collections.abc import Sequence

from jaxinfer.engine.proposer import DraftProposer, HeadProposer, NgramProposer
from jaxinfer.engine.request import Request
from jaxinfer.engine.scheduler import Scheduler, StepPlan

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0  # drafts' worth of the engine-wide rate in a request's estimate
WINDOW = 16  # step times an estimate is the median of
EXPLORE_EVERY = 64  # steps an option may go unmeasured (per slot rung) ...
EXPLORE_WITHIN = 0.8  # ... if its estimated speed is at least this fraction of the best
TRUSTED_DRAFTS = 64  # drafts verified before the engine's acceptance rate is trusted
SKIP_REASONS = ("prompt_chunks", "batch_size", "cost", "no_match", "limit", "pages",
                "structured_outputs")


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a request emits in a step verifying `drafts` drafts: 1 + a + ... + a^k."""
    if acceptance >= 1:
        return drafts + 1.0
    return (1 - acceptance ** (drafts + 1)) / (1 - acceptance)


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


class Policy:
    """The cost model: measured step times per bucket kind and slot rung, acceptance per
    request; `choose` returns the k with the most expected tokens per second."""

    def __init__(self, max_drafts: int, *, adaptive: bool = True,
                 free_proposals: bool = False) -> None:
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.free_proposals = free_proposals  # n-gram lookup: no draft model to run
        self.samples: dict[tuple[str, int], collections.deque] = {}  # (kind, S) -> seconds
        self.draft_samples: dict[int, dict[int, collections.deque]] = {}  # S -> {steps: ...}
        self.last_taken: dict[tuple[str, int], int] = {}  # option -> step it was last run
        self.clock = 0
        self.accepted, self.reached = 0, 0  # engine-wide, for the prior
        self._per_request: weakref.WeakKeyDictionary[Request, list[int]] = (
            weakref.WeakKeyDictionary())

    def acceptance(self, request: Request) -> float:
        """The request's per-draft acceptance estimate (its counts plus the prior)."""
        prior = (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (
            self.reached + PRIOR_WEIGHT)
        accepted, reached = self._per_request.get(request, (0, 0))
        return min((accepted + prior * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT), 0.999)

    def estimate(self, kind: str, slots: int) -> float | None:
        """The estimated seconds of a "decode" or "verify" step over S slots; None if
        never measured."""
        window = self.samples.get((kind, slots))
        return statistics.median(window) if window else None

    def seed(self, kind: str, slots: int, seconds: float) -> None:
        """A measured step time (warm-up's or a step's)."""
        key = (kind, slots)
        self.samples.setdefault(key, collections.deque(maxlen=WINDOW)).append(seconds)
        self.last_taken[key] = self.clock

    def seed_draft(self, slots: int, steps: int, seconds: float) -> None:
        """A proposal call's time over `steps` draft model steps."""
        by_steps = self.draft_samples.setdefault(slots, {})
        by_steps.setdefault(steps, collections.deque(maxlen=WINDOW)).append(seconds)

    def draft_seconds(self, slots: int, drafts: int) -> float:
        """Estimated time of a proposal of `drafts` drafts (drafts + 1 steps): measured,
        else the line through the nearest measured step counts (0 if none)."""
        times = {steps: statistics.median(window)
                 for steps, window in self.draft_samples.get(slots, {}).items()}
        steps = drafts + 1
        if steps in times or not times:
            return times.get(steps, 0.0)
        if len(times) == 1:
            ((measured, seconds),) = times.items()
            return seconds * steps / measured
        (a, ta), (b, tb) = sorted(times.items(), key=lambda item: abs(item[0] - steps))[:2]
        return max(ta + (tb - ta) * (steps - a) / (b - a), 0.0)

    def may_pay(self, slots: int) -> bool:
        """Whether speculation could beat decoding at S slots even if every draft were
        accepted (K + 1 tokens a request for a verify step's time), or is due to be
        measured again: when not, a step skips proposing at all."""
        if not self.adaptive:
            return True
        decode_s, verify_s = self.estimate("decode", slots), self.estimate("verify", slots)
        if decode_s is None or verify_s is None:
            return True
        best_case = (self.max_drafts + 1) * decode_s / verify_s  # over decoding's rate
        stale = self.clock - self.last_taken.get(("verify", slots), 0) >= EXPLORE_EVERY
        if best_case >= 1 or (stale and best_case >= EXPLORE_WITHIN):
            return True
        self.clock += 1
        return False

    def choose(self, requests: Sequence[Request], slots: int, caps: Sequence[int],
               draft_model: bool) -> int:
        """k for this step: 0 (no speculation) .. K; `caps[i]`: the most drafts request i
        can use (its proposal's length for n-gram, its room left)."""
        self.clock += 1
        if not self.adaptive:
            return self.max_drafts
        rates = self._rates(requests, slots, caps, draft_model)
        if rates is None:
            return self.max_drafts  # unmeasured: try it, then it is
        best = max(rates, key=rates.get)
        if best:  # speculating: a plain decode step now and then, whatever its estimate
            return 0 if self._stale("decode", slots) else best
        alternative = max((k for k in rates if k), key=rates.get)
        return alternative if self._explore_verify(slots, rates[alternative] / rates[0]) else 0

    def worth_proposing(self, requests: Sequence[Request], slots: int, caps: Sequence[int],
                        draft_model: bool) -> bool:
        """Whether `choose` could speculate if every request had `caps[i]` drafts (the
        most n-gram lookup can find): when not, the step skips the lookups (it counts
        as a step for the policy's clock)."""
        if not self.adaptive:
            return True
        rates = self._rates(requests, slots, caps, draft_model)
        if rates is None:
            return True
        speculating = max(rate for k, rate in rates.items() if k)
        if speculating > rates[0] or self._explore_verify(slots, speculating / rates[0]):
            return True
        self.clock += 1
        return False

    def _rates(self, requests: Sequence[Request], slots: int, caps: Sequence[int],
               draft_model: bool) -> dict[int, float] | None:
        """Expected tokens per second of decoding (k = 0) and of speculating with k
        drafts; None until both step kinds were measured at S slots."""
        decode_s, verify_s = self.estimate("decode", slots), self.estimate("verify", slots)
        if decode_s is None or verify_s is None:
            return None
        rates = {0: len(requests) / decode_s}
        alphas = [self.acceptance(r) for r in requests]
        for k in (range(1, self.max_drafts + 1) if draft_model else [self.max_drafts]):
            tokens = sum(expected_tokens(a, min(k, cap)) for a, cap in zip(alphas, caps,
                                                                           strict=True))
            cost = verify_s + (self.draft_seconds(slots, k) if draft_model else 0)
            rates[k] = tokens / cost
        return rates

    def _stale(self, kind: str, slots: int) -> bool:
        return self.clock - self.last_taken.get((kind, slots), 0) >= EXPLORE_EVERY

    def _explore_verify(self, slots: int, relative_rate: float) -> bool:
        """While decoding: measure a verify step again when its turn has come and its
        estimated rate is within EXPLORE_WITHIN of decoding's, or (proposals costing
        nothing, n-gram lookup) whatever it is while the engine's acceptance rate rests on
        fewer than TRUSTED_DRAFTS drafts. A draft model's verify step is not tried on
        the prior alone: it costs the draft's catch-up over every token it skipped."""
        return self._stale("verify", slots) and (
            relative_rate >= EXPLORE_WITHIN
            or (self.free_proposals and self.reached < TRUSTED_DRAFTS))

    def record_acceptance(self, request: Request, drafts: int, accepted: int) -> None:
        """A request verified `drafts` drafts and `accepted` of them: the drafts reached are
        those up to the first rejection."""
        reached = accepted + (accepted < drafts)
        counts = self._per_request.setdefault(request, [0, 0])
        counts[0] += accepted
        counts[1] += reached
        self.accepted += accepted
        self.reached += reached


class Speculation:
    """The proposer, the policy and the counts of one engine."""

    def __init__(self, proposer: NgramProposer | DraftProposer | HeadProposer, *,
                 max_drafts: int,
                 adaptive: bool = True, disable_by_batch_size: int | None = None) -> None:
        self.proposer = proposer
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
        # A constrained request never speculates: its drafts would need a mask per
        # position, each after the drafts before it (engine/grammar.py).
        constrained = [c.request.params.structured_outputs is not None for c in chunks]
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
