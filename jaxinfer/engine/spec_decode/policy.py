"""How far to speculate: the load-adaptive cost model (`Policy`). From measured step times
per bucket and each request's acceptance it picks the k (0 = no speculation) with the
most expected tokens per second, re-measures options not taken, and skips proposing
where no k could pay; `adaptive=False` always takes k = K. Plain Python, no jax.
See docs/speculative_decoding.md#the-load-adaptive-policy.
"""

from __future__ import annotations

import collections
import statistics
import weakref
from collections.abc import Sequence

from jaxinfer.engine.request import Request

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0  # drafts' worth of the engine-wide rate in a request's estimate
WINDOW = 16  # step times an estimate is the median of
EXPLORE_EVERY = 64  # steps an option may go unmeasured (per slot rung) ...
EXPLORE_WITHIN = 0.8  # ... if its estimated speed is at least this fraction of the best
TRUSTED_DRAFTS = 64  # drafts verified before the engine's acceptance rate is trusted

def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a request emits in a step verifying `drafts` drafts: 1 + a + ... + a^k."""
    if acceptance >= 1:
        return drafts + 1.0
    return (1 - acceptance ** (drafts + 1)) / (1 - acceptance)


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
        if self._could_pay(slots):
            return True
        self.clock += 1
        return False

    def _could_pay(self, slots: int) -> bool:
        """`may_pay`'s answer, counting nothing."""
        if not self.adaptive:
            return True
        decode_s, verify_s = self.estimate("decode", slots), self.estimate("verify", slots)
        if decode_s is None or verify_s is None:
            return True
        best_case = (self.max_drafts + 1) * decode_s / verify_s  # over decoding's rate
        return best_case >= 1 or (self._stale("verify", slots) and best_case >= EXPLORE_WITHIN)

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
        return self._exploring(rates, slots)

    def might_speculate(self, requests: Sequence[Request], slots: int, caps: Sequence[int],
                        draft_model: bool) -> bool:
        """Whether `may_pay` and `choose` could speculate this step if request i had
        `caps[i]` drafts, counting nothing (`worth_proposing` counts a step when not; the
        engine's asynchronous loop asks this before it plans)."""
        if not self.adaptive:
            return True
        if not requests or not self._could_pay(slots):
            return False
        rates = self._rates(requests, slots, caps, draft_model)
        if rates is None:
            return True
        speculating = max(rate for k, rate in rates.items() if k)
        return speculating > rates[0] or self._explore_verify(slots, speculating / rates[0])

    def _exploring(self, rates: dict[int, float], slots: int) -> int:
        """While decoding: the k of a verify step to measure again now, else 0."""
        alternative = max((k for k in rates if k), key=rates.get)
        return alternative if self._explore_verify(slots, rates[alternative] / rates[0]) else 0

    def worth_proposing(self, requests: Sequence[Request], slots: int, caps: Sequence[int],
                        draft_model: bool) -> bool:
        """Whether `choose` could speculate if every request had `caps[i]` drafts (the
        most n-gram lookup can find): when not, the step skips the lookups (it counts
        as a step for the policy's clock)."""
        if self.might_speculate(requests, slots, caps, draft_model):
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
