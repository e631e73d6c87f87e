"""Padding ladders: every step is padded to one of a bounded set of shapes.

A `Bucket` is (tokens, request slots); the page-table width is fixed by
max_model_len. Token counts climb powers of two from 16 up to 512, then
linear steps of 512, never past `max_num_batched_tokens` (which is itself the
top rung); slot counts climb powers of two up to `max_num_seqs`. Warm-up
compiles every bucket, so nothing compiles mid-run. Plain Python.
"""

from __future__ import annotations

import bisect
import dataclasses

MIN_TOKENS = 16
LINEAR_FROM = 512  # past this, token rungs grow linearly by this step


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int  # T: padded tokens in the step
    num_slots: int  # S: padded request rows (page table rows, logits rows)


def token_ladder(max_num_batched_tokens: int) -> list[int]:
    rungs, size = [], MIN_TOKENS
    while size < max_num_batched_tokens:
        rungs.append(size)
        size = size * 2 if size < LINEAR_FROM else size + LINEAR_FROM
    return rungs + [max_num_batched_tokens]


def slot_ladder(max_num_seqs: int) -> list[int]:
    rungs, size = [], 1
    while size < max_num_seqs:
        rungs.append(size)
        size *= 2
    return rungs + [max_num_seqs]


class BucketSet:
    """All buckets for one engine configuration, and the pick for a step."""

    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"{max_num_batched_tokens=} must be >= {max_num_seqs=}: each "
                             "scheduled request takes at least one token")
        self.tokens = token_ladder(max_num_batched_tokens)
        self.slots = slot_ladder(max_num_seqs)

    def all(self) -> list[Bucket]:
        """Every bucket a step can pick (slots never exceed tokens)."""
        return [Bucket(t, s) for t in self.tokens for s in self.slots if s <= t]

    def pick(self, num_tokens: int, num_requests: int) -> Bucket:
        """The smallest bucket holding `num_tokens` tokens of `num_requests` requests."""
        if num_tokens > self.tokens[-1] or num_requests > self.slots[-1]:
            raise ValueError(f"{num_tokens} tokens / {num_requests} requests exceed the "
                             f"largest bucket ({self.tokens[-1]}, {self.slots[-1]})")
        slots = self.slots[bisect.bisect_left(self.slots, num_requests)]
        tokens = self.tokens[bisect.bisect_left(self.tokens, max(num_tokens, slots))]
        return Bucket(tokens, slots)
