"""Many encoder inputs packed into few fixed shapes: rows of L tokens, several inputs to
a row (first fit, longest first), each input a segment that attends only to itself. A
bucket is (rows, row length); both climb by powers of ROW_FACTOR, so few programs
cover every batch, and packing keeps the padding small. See docs/pooling.md#packing.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

ROW_FACTOR = 4  # row lengths climb by this factor
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
    tokens a step: row lengths by ROW_FACTOR, rows by powers of two (the last step of a
    long job is padded to at most twice its rows)."""
    budget = max(budget, max_len)
    return [Bucket(rows, row_len) for row_len in _ladder(MIN_ROW_LEN, max_len, ROW_FACTOR)
            for rows in _ladder(1, budget // row_len, 2)]


def _ladder(low: int, high: int, factor: int) -> list[int]:
    """low, low * factor, ... below `high`, then `high`."""
    out, value = [], low
    while value < high:
        out.append(value)
        value *= factor
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
    """(ids, type ids) inputs packed into rows of the shortest row length that holds the
    longest (best fit, longest first, over all rows: small inputs fill the ends of rows
    of long ones), the rows then cut into steps of the fewest buckets; every input fits
    a row (the caller checked its length)."""
    longest = max(len(ids) for ids, _ in inputs)
    row_len = min(b.row_len for b in ladder if b.row_len >= longest)
    largest = max(b for b in ladder if b.row_len == row_len)
    rows = _best_fit(inputs, row_len)
    batches, step, count = [], [], 0
    for row in rows:
        if step and (len(step) == largest.rows or count + len(row) > largest.max_inputs):
            batches.append(_step(inputs, step, ladder, row_len))
            step, count = [], 0
        step.append(row)
        count += len(row)
    return batches + [_step(inputs, step, ladder, row_len)]


def _best_fit(inputs: Sequence, row_len: int) -> list[list[int]]:
    """Input indices by row: each input, longest first, into the row it fills most
    tightly, or a new row."""
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i][0]))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, row), sorted
    for index in order:
        length = len(inputs[index][0])
        at = bisect.bisect_left(free, (length, -1))
        if at == len(free):
            rows.append([])
            space, row = row_len, len(rows) - 1
        else:
            space, row = free.pop(at)
        rows[row].append(index)
        # a row holds at most its share of a bucket's inputs (max_inputs)
        if space - length > 0 and len(rows[row]) < row_len // TOKENS_PER_INPUT:
            bisect.insort(free, (space - length, row))
    return rows


def _step(inputs: Sequence, rows: list[list[int]], ladder: Sequence[Bucket],
          row_len: int) -> PackedBatch:
    count = sum(len(row) for row in rows)
    bucket = min(b for b in ladder if b.row_len == row_len and b.rows >= len(rows)
                 and b.max_inputs >= count)
    return _arrays(inputs, [i for row in rows for i in row], rows, bucket)


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
