"""Host inputs of a drafter's calls, shared by the draft model's runner (draft.py) and
the heads' (heads.py): catch-up chunks over positions a drafter has not seen, and a
proposal's per-slot inputs. A draft model reads the token at p (`shift` 0); an EAGLE
head reads the feature at p and the token after it (`shift` 1). See
docs/speculative_decoding.md#proposers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from jaxinfer.engine.core.buckets import Bucket
from jaxinfer.engine.request import Request
from jaxinfer.engine.runner.inputs import Chunk, SampleRow, sampling_inputs
from jaxinfer.model.draft import DraftInputs
from jaxinfer.pallas import DEFAULT_SETTINGS, AttentionSettings


def catch_up_calls(segments: Sequence[tuple[Request, int, int]], *, shift: int,
                   budget: int, slots: int) -> Iterator[tuple[list[Chunk], int]]:
    """(chunks, tokens) of each call writing the drafter's K/V of every segment's
    positions [done, end), position p fed the request's token p + `shift`; a call holds
    at most `budget` tokens and `slots` chunks."""
    pending: list[Chunk] = []
    used = 0
    for request, done, end in segments:
        tokens = request.all_token_ids
        while done < end:
            if used == budget or len(pending) == slots:
                yield pending, used
                pending, used = [], 0
            count = min(end - done, budget - used)
            pending.append(Chunk(tokens[done + shift:done + shift + count], done,
                                 request.page_ids[0], 0))
            done, used = done + count, used + count
    if pending:
        yield pending, used


def propose_inputs(requests: Sequence[Request], bucket: Bucket, num_steps: int, *,
                   shift: int, pages_per_seq: int, max_model_len: int,
                   eos_token_ids: frozenset[int],
                   attention: AttentionSettings = DEFAULT_SETTINGS) -> DraftInputs:
    """Slot s: the request's last token at the position the drafter's first step runs
    (its own for a draft model, the one before for a head: `shift`), its page table and
    sampling settings (the history up to the last token); the drafter attends with the
    engine's `attention` settings (impl, interpret)."""
    slots = bucket.num_slots
    token_ids = np.zeros(bucket.num_tokens, np.int32)
    positions = np.zeros(slots, np.int32)
    page_indices = np.zeros((slots, pages_per_seq), np.int32)
    for i, request in enumerate(requests):
        token_ids[i] = request.all_token_ids[-1]
        positions[i] = request.num_tokens - 1 - shift
        pages = request.page_ids[0]  # the KV page group that keeps every page
        page_indices[i, :len(pages)] = pages
    rows = [SampleRow(r, r.all_token_ids) for r in requests]
    sampling = sampling_inputs(rows, num_rows=slots, history_width=max_model_len,
                               eos_token_ids=eos_token_ids)
    return DraftInputs(token_ids=token_ids, positions=positions, page_indices=page_indices,
                       num_seqs=np.array([len(requests)], np.int32), sampling=sampling,
                       num_steps=np.array(num_steps, np.int32), attention=attention)
