"""Padding ladders: every step is padded to one of a bounded set of shapes (`Bucket`:
tokens, request slots, decode?, sampled positions), all compiled at warm-up;
`BucketSet.pick` finds a step's. The decode, verify and mixed ladders, and why mixed
steps keep every slot: docs/architecture.md#buckets. Plain Python.
"""

from __future__ import annotations

import bisect
import dataclasses

MIN_TOKENS = 16
FINE_FROM, FINE_STEP = 256, 64  # from FINE_FROM to LINEAR_FROM, rungs every FINE_STEP
LINEAR_FROM = 512  # past this, token rungs grow linearly by this step


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    num_tokens: int  # T: padded tokens in the step
    num_slots: int  # S: padded request rows (page table rows, logits rows)
    decode: bool = False  # every request has one token: token i belongs to request i
    num_positions: int = 1  # Q: sampled positions per request (k + 1 in a verify bucket)


def token_ladder(max_num_batched_tokens: int) -> list[int]:
    """Mixed steps' token rungs: powers of two up to FINE_FROM, every FINE_STEP up to
    LINEAR_FROM, every LINEAR_FROM after, and the budget (docs/architecture.md#buckets)."""
    rungs, size = [], MIN_TOKENS
    while size < max_num_batched_tokens:
        rungs.append(size)
        if size < FINE_FROM:
            size *= 2
        else:
            size += FINE_STEP if size < LINEAR_FROM else LINEAR_FROM
    return rungs + [max_num_batched_tokens]


def slot_ladder(max_num_seqs: int) -> list[int]:
    rungs, size = [], 1
    while size < max_num_seqs:
        rungs.append(size)
        size *= 2
    return rungs + [max_num_seqs]


class BucketSet:
    """All buckets for one engine configuration, and the pick for a step."""

    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int,
                 min_tokens: int = 1, verify_positions: int = 0) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"{max_num_batched_tokens=} must be >= {max_num_seqs=}: each "
                             "scheduled request takes at least one token")
        self.tokens = token_ladder(max_num_batched_tokens)
        self.max_num_seqs = max_num_seqs
        self.decode_slots = slot_ladder(max_num_seqs)
        self.min_tokens = min_tokens
        self.verify_positions = verify_positions  # Q of verify buckets; 0: none

    def all(self) -> list[Bucket]:
        """Every bucket a step can pick: decode buckets, mixed ones, then verify ones."""
        return self.decode() + [Bucket(t, self.max_num_seqs) for t in self.tokens] + (
            self.verify())

    def decode(self) -> list[Bucket]:
        return [Bucket(max(s, self.min_tokens), s, True) for s in self.decode_slots]

    def verify(self) -> list[Bucket]:
        """One bucket per decode slot rung holding Q tokens per request (none when off)."""
        q = self.verify_positions
        return [self._verify_bucket(s) for s in self.decode_slots] if q else []

    def _verify_bucket(self, slots: int) -> Bucket:
        q = self.verify_positions
        return Bucket(max(slots * q, self.min_tokens), slots, num_positions=q)

    def pick(self, num_tokens: int, num_requests: int, *, decode: bool = False,
             verify: bool = False) -> Bucket:
        """The smallest bucket holding `num_tokens` tokens of `num_requests` requests;
        `decode`: every request has exactly one token (so num_tokens == num_requests);
        `verify`: each has at most Q (`verify_positions`) tokens, all sampled."""
        if verify:
            return self._pick_verify(num_tokens, num_requests)
        if num_tokens > self.tokens[-1] or num_requests > self.max_num_seqs:
            raise ValueError(f"{num_tokens} tokens / {num_requests} requests exceed the "
                             f"largest bucket ({self.tokens[-1]}, {self.max_num_seqs})")
        if decode:
            if num_tokens != num_requests:
                raise ValueError(f"a decode step has one token per request, not "
                                 f"{num_tokens} tokens for {num_requests} requests")
            slots = self.decode_slots[bisect.bisect_left(self.decode_slots, num_requests)]
            return Bucket(max(slots, self.min_tokens), slots, True)
        return Bucket(self.tokens[bisect.bisect_left(self.tokens, num_tokens)],
                      self.max_num_seqs)

    def decode_slots_for(self, num_requests: int) -> int:
        """The decode slot rung (S of decode and verify buckets) of `num_requests`."""
        return self.decode_slots[bisect.bisect_left(self.decode_slots, num_requests)]

    def _pick_verify(self, num_tokens: int, num_requests: int) -> Bucket:
        if not self.verify_positions:
            raise ValueError("no verify buckets: speculative decoding is off")
        if num_requests > self.max_num_seqs or num_tokens > num_requests * self.verify_positions:
            raise ValueError(f"{num_tokens} tokens / {num_requests} requests exceed the verify "
                             f"buckets ({self.verify_positions} tokens a request, at most "
                             f"{self.max_num_seqs} requests)")
        return self._verify_bucket(self.decode_slots_for(num_requests))
