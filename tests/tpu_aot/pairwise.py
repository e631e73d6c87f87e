"""A small deterministic pairwise-covering design: every pair of values of any two
parameters appears in at least one row (greedy, in the spirit of AETG)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def pairwise(params: dict[str, Sequence]) -> list[dict]:
    names = list(params)
    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
                 for va in params[a] for vb in params[b]}
    rows = []
    while uncovered:
        best, best_gain = None, -1
        for values in itertools.product(*(params[n] for n in names)):
            row = dict(zip(names, values, strict=True))
            gain = sum((a, row[a], b, row[b]) in uncovered
                       for a, b in itertools.combinations(names, 2))
            if gain > best_gain:
                best, best_gain = row, gain
        rows.append(best)
        uncovered -= {(a, best[a], b, best[b]) for a, b in itertools.combinations(names, 2)}
    return rows


def covers_all_pairs(params: dict[str, Sequence], rows: list[dict]) -> bool:
    return all(any(r[a] == va and r[b] == vb for r in rows)
               for a, b in itertools.combinations(params, 2)
               for va in params[a] for vb in params[b])
