"""What one step computes (`StepPlan`): each request's tokens in it (`ScheduledChunk`),
the requests preempted and the host tier's copies to make first. Pure data, made by
the scheduler (scheduler.py) and run by the runner. See docs/architecture.md#one-step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxinfer.engine.core.host_tier import Transfer
from jaxinfer.engine.request import Request


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of one request, from position `start`, in this step.

    The chunk's last `num_samples` positions are sampled, each giving the token that
    follows it: 0 for a prefill chunk that stops short of the request's end, 1 for one
    that reaches it. With k `draft_token_ids` (the last k of its `num_tokens`, not yet
    the request's) it samples k + 1: each draft is checked against the sample before it;
    the runner samples at most its static number of positions per request. Fixed when
    scheduled: `Scheduler.update` moves the request on, not the chunk.
    """

    request: Request
    start: int
    num_tokens: int
    num_samples: int = 0
    draft_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.num_samples <= self.num_tokens:
            raise ValueError(f"num_samples={self.num_samples} must be in [0, num_tokens="
                             f"{self.num_tokens}]")

    @property
    def token_ids(self) -> list[int]:
        """The request's tokens the chunk computes, then its drafts (known tokens only:
        see runner/slots.py for placeholders)."""
        end = self.start + self.num_tokens - len(self.draft_token_ids)
        return self.request.tokens(self.start, end) + list(self.draft_token_ids)

    def accepted(self, sampled: Sequence[int]) -> int:
        """Drafts the target agrees with: the leading drafts equal to the samples before
        them (the samples are the target's tokens, drafts where it accepted them)."""
        count = 0
        for draft, token in zip(self.draft_token_ids, sampled, strict=False):
            if draft != token:
                break
            count += 1
        return count


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one step computes. Pure data."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Request, ...] = ()
    transfers: tuple[Transfer, ...] = ()  # host tier copies to make first, in order

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def has_drafts(self) -> bool:
        """Whether the step verifies drafts (speculative decoding)."""
        return any(c.draft_token_ids for c in self.chunks)
