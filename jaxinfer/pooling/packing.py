"""Many encoder inputs packed into few fixed shapes: rows of L tokens, several inputs to
a row (first fit, longest first), each input a segment that attends only to itself. A
bucket is (rows, row length); both climb by powers of ROW_FACTOR, so few programs
cover every batch, and packing keeps the padding small. See docs/pooling.md#packing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

ROW_FACTOR = 4  # rows and row lengths climb by this factor
MIN_ROW_LEN = 32
TOKENS_PER_INPUT = 8  # a bucket holds up to rows * row_len / this many inputs


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """A packed step's static shape."""

    rows: int
    row_len: int

    @property
    def num_tokens(self) -> int:
        return self.rows * self.row_len

    @property
    def max_inputs(self) -> int:
        return max(self.rows, self.num_tokens // TOKENS_PER_INPUT)


def buckets(max_len: int, budget: int) -> list[Bucket]:
    """Every bucket for inputs of up to `max_len` tokens, at most max(budget, max_len)
    tokens a step."""
    budget = max(budget, max_len)
    lengths = _ladder(MIN_ROW_LEN, max_len)
    return [Bucket(rows, row_len) for row_len in lengths
            for rows in _ladder(1, budget // row_len)]


def _ladder(low: int, high: int) -> list[int]:
    """low, low * ROW_FACTOR, ... below `high`, then `high`."""
    out, value = [], low
    while value < high:
        out.append(value)
        value *= ROW_FACTOR
    return out + [high]


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One step's inputs, numpy: `indices` into the caller's list, and the arrays the
    encoder step takes (model/pooling.py `encoder_step`)."""

    bucket: Bucket
    indices: list[int]
    token_ids: np.ndarray  # i32[R, L]
    type_ids: np.ndarray  # i32[R, L]
    positions: np.ndarray  # i32[R, L]: 0-based within each input
    segments: np.ndarray  # i32[R, L]: 1, 2, ... per input in its row; 0 padding
    owners: np.ndarray  # i32[R, L]: each token's entry of starts; B for padding
    starts: np.ndarray  # i32[B]: each input's first token in the flattened R * L
    lengths: np.ndarray  # i32[B]: its length; 0 for padding entries

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())


def pack(inputs: Sequence[tuple[Sequence[int], Sequence[int]]],
         ladder: Sequence[Bucket]) -> list[PackedBatch]:
    """(ids, type ids) inputs packed into steps of the smallest buckets that hold them,
    longest inputs first; every input fits a row (the caller checked its length)."""
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
    batches = []
    while order:
        longest = len(inputs[order[0]][0])
        largest = max((b for b in ladder if b.row_len >= longest),
                      key=lambda b: (b.rows, -b.row_len))
        taken, rows = _first_fit(order, inputs, largest)
        done = set(taken)
        order = [i for i in order if i not in done]
        bucket = min(b for b in ladder if b.row_len == largest.row_len
                     and b.rows >= len(rows) and b.max_inputs >= len(taken))
        batches.append(_arrays(inputs, taken, rows, bucket))
    return batches


def _first_fit(order: list[int], inputs: Sequence, bucket: Bucket
               ) -> tuple[list[int], list[list[int]]]:
    """The inputs (of `order`, longest first) that fit `bucket`, and each row's."""
    rows: list[list[int]] = []
    free: list[int] = []
    taken = []
    for index in order:
        if len(taken) == bucket.max_inputs:
            break
        length = len(inputs[index][0])
        row = next((r for r, space in enumerate(free) if space >= length), None)
        if row is None:
            if len(rows) == bucket.rows:
                continue
            rows.append([])
            free.append(bucket.row_len)
            row = len(rows) - 1
        rows[row].append(index)
        free[row] -= length
        taken.append(index)
    return taken, rows


def _arrays(inputs: Sequence, taken: list[int], rows: list[list[int]],
            bucket: Bucket) -> PackedBatch:
    shape = (bucket.rows, bucket.row_len)
    token_ids, type_ids, positions, segments = (np.zeros(shape, np.int32) for _ in range(4))
    owners = np.full(shape, bucket.max_inputs, np.int32)
    starts = np.zeros(bucket.max_inputs, np.int32)
    lengths = np.zeros(bucket.max_inputs, np.int32)
    indices = []
    for r, members in enumerate(rows):
        offset = 0
        for segment, index in enumerate(members, start=1):
            ids, types = inputs[index]
            span = slice(offset, offset + len(ids))
            token_ids[r, span], type_ids[r, span] = ids, types
            positions[r, span] = np.arange(len(ids))
            segments[r, span] = segment
            owners[r, span] = len(indices)
            starts[len(indices)] = r * bucket.row_len + offset
            lengths[len(indices)] = len(ids)
            indices.append(index)
            offset += len(ids)
    return PackedBatch(bucket, indices, token_ids, type_ids, positions, segments, owners,
                       starts, lengths)
