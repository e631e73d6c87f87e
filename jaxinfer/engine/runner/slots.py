"""The host's side of the device batch state, in numpy: which request holds which slot,
and each step's delta and admissions (model/batch_state.py). The host mirrors the page
ids it wrote, so a step's work is a loop over its requests and tokens. See
docs/architecture.md#the-host-loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxinfer.engine.core.buckets import Bucket
from jaxinfer.engine.request import Request, Status
from jaxinfer.engine.runner.inputs import (
    PADDING_PARAMS,
    PARAM_FLOATS,
    STOP_WIDTH,
    device_temperature,
    stop_ids,
)
from jaxinfer.model.batch_state import Admission, SlotRows, StepDelta

ADMIT_ROWS = 8  # slots one admission call writes
BIAS_WRITES = 32  # logit_bias pairs one admission call writes (few requests have any)
WRITE_WIDTH = 256  # page or history writes one admission call carries
TAIL = 8  # a slot's last page ids compared with the request's each step


@dataclasses.dataclass
class _Slot:
    request: Request
    preemptions: int  # the request's count when placed: a new count means a new placement
    pages: list[list[int]]  # page ids written to the device row, per KV page group


class SlotTable:
    """Slots of the requests in flight, and the deltas that keep their rows current."""

    def __init__(self, num_slots: int, *, page_size: int,
                 eos_token_ids: frozenset[int] = frozenset(), num_groups: int = 1) -> None:
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_groups = num_groups  # KV page groups (engine/core/kv_groups.py): a row each
        self.eos_token_ids = eos_token_ids
        self._slots: dict[int, _Slot] = {}  # slot -> its request
        self._slot_of: dict[Request, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest
        self._bias_held = [0] * num_slots  # logit_bias pairs written to each slot's row

    def slot(self, request: Request) -> int | None:
        return self._slot_of.get(request)

    def release_done(self) -> None:
        """Free the slots of requests that finished or were preempted."""
        for slot, held in list(self._slots.items()):
            request = held.request
            if (request.status is not Status.RUNNING
                    or request.num_preemptions != held.preemptions):
                del self._slots[slot], self._slot_of[request]
                self._free.append(slot)

    def delta(self, chunks: Sequence, bucket: Bucket) -> tuple[StepDelta, list[Admission]]:
        """A step's delta and the admission calls to run before it, numpy. Built in
        Python lists, converted once: per-element numpy writes cost more."""
        self.release_done()
        n, q, num_slots = self.num_slots, bucket.num_positions, bucket.num_slots
        if len(chunks) > num_slots:
            raise ValueError(f"{len(chunks)} requests exceed the bucket's {num_slots} slots")
        placed: list[tuple[int, Request, int]] = []
        writes: list[list[tuple[int, int, int]]] = [[] for _ in range(self.num_groups)]
        tokens: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        seq_slots, kv_lens, cu_q_lens = [n] * num_slots, [0] * num_slots, [0]
        rows, sample_slots, proposed = [0] * (num_slots * q), [n] * (num_slots * q), \
            [-1] * (num_slots * q)
        for i, chunk in enumerate(chunks):
            request = chunk.request
            slot = self._slot_of.get(request)
            if slot is None:
                slot = self._place(request)
                placed.append((slot, request, chunk.start))
            fed = _fed_tokens(chunk)
            end = chunk.start + len(fed)
            for group, mirror, ids in zip(writes, self._slots[slot].pages, request.page_ids,
                                          strict=True):
                group.extend(self._page_writes(slot, mirror, ids, end))
            tokens += fed
            positions += range(chunk.start, end)
            token_slots += [slot] * len(fed)
            seq_slots[i], kv_lens[i] = slot, end
            cu_q_lens.append(len(tokens))
            m = chunk.num_samples
            if m > q:
                raise ValueError(f"request {i}: {m} samples, at most {q} per request")
            rows[i * q:i * q + m] = range(len(tokens) - m, len(tokens))
            sample_slots[i * q:i * q + m] = [slot] * m
            proposed[i * q:i * q + max(m - 1, 0)] = fed[len(fed) - m + 1:]
        if len(tokens) > bucket.num_tokens:
            raise ValueError(f"{len(tokens)} tokens exceed the bucket's {bucket.num_tokens}")
        capacity = page_write_capacity(bucket, self.page_size)
        pad = bucket.num_tokens - len(tokens)
        values = (tokens + [0] * pad + positions + [0] * pad + token_slots + [n] * pad
                  + seq_slots + kv_lens
                  + cu_q_lens + [len(tokens)] * (num_slots + 1 - len(cu_q_lens))
                  + [len(chunks)] + rows + sample_slots + proposed)
        for group in writes:
            in_step = group[:capacity]
            for write in in_step:
                values += write
            values += [n + 1, 0, 0] * (capacity - len(in_step))
        delta = StepDelta.from_list(values, num_tokens=bucket.num_tokens, num_slots=num_slots,
                                    num_positions=q, num_page_writes=capacity,
                                    num_groups=self.num_groups)
        return delta, self._admissions(placed, [group[capacity:] for group in writes])

    def _place(self, request: Request) -> int:
        if not self._free:
            raise RuntimeError(f"more than {self.num_slots} requests in flight")
        slot = self._free.pop()
        self._slots[slot] = _Slot(request, request.num_preemptions,
                                  [[] for _ in range(self.num_groups)])
        self._slot_of[request] = slot
        return slot

    def _page_writes(self, slot: int, mirror: list[int], ids: list[int], end: int
                     ) -> list[tuple[int, int, int]]:
        """(slot, index, page id) of the request's pages `ids` up to position `end` that
        the device row (mirrored by `mirror`) lacks; pages past the mirror's common tail
        are rewritten. A 0 in `ids` over a written id is a page given back as no query
        sees it any more: the row keeps the old id, which no query reads
        (engine/core/kv_groups.py)."""
        common = min(len(mirror), len(ids))
        low = max(0, common - TAIL)
        changed = [k for k in range(low, common) if mirror[k] != ids[k] and ids[k]]
        if changed:
            common = changed[0]
        del mirror[common:]
        needed = min(-(-end // self.page_size), len(ids))
        new = ids[len(mirror):needed]
        out = [(slot, len(mirror) + k, page) for k, page in enumerate(new)]
        mirror.extend(new)
        return out

    def _admissions(self, placed: list[tuple[int, Request, int]],
                    overflow: list[list[tuple[int, int, int]]]) -> list[Admission]:
        """Admission calls: the placed slots' rows, page writes past the step's capacity
        (per page group), and the history a penalized request has before its first fed
        token."""
        history: list[tuple[int, int, int]] = []
        for slot, request, start in placed:
            if request.params.penalized and start:
                history += [(slot, p, t) for p, t in enumerate(request.tokens(0, start))]
        bias = [pair for slot, request, _ in placed for pair in self._bias_writes(slot, request)]
        calls = []
        while placed or any(overflow) or history or bias:
            batch, placed = placed[:ADMIT_ROWS], placed[ADMIT_ROWS:]
            pages = [group[:WRITE_WIDTH] for group in overflow]
            overflow = [group[WRITE_WIDTH:] for group in overflow]
            past, history = history[:WRITE_WIDTH], history[WRITE_WIDTH:]
            pairs, bias = bias[:BIAS_WRITES], bias[BIAS_WRITES:]
            calls.append(self._admission(batch, pages, past, pairs))
        return calls

    def _bias_writes(self, slot: int, request: Request) -> list[tuple[int, int, int, float]]:
        """(slot, index, token id, bias) of the request's logit_bias, then -1 over the
        pairs the slot's last request left in its row (no clearing on the device)."""
        pairs = sorted((request.params.logit_bias or {}).items())
        held, self._bias_held[slot] = self._bias_held[slot], len(pairs)
        return ([(slot, k, token, bias) for k, (token, bias) in enumerate(pairs)]
                + [(slot, k, -1, 0.0) for k in range(len(pairs), held)])

    def _admission(self, placed: list[tuple[int, Request, int]],
                   pages: list[list[tuple[int, int, int]]],
                   history: list[tuple[int, int, int]],
                   bias: list[tuple[int, int, int, float]]) -> Admission:
        """One admission call's arrays (padded: slot N + 1, dropped on the device)."""
        n = self.num_slots
        return Admission(
            slots=np.array([s for s, _, _ in placed] + [n + 1] * (ADMIT_ROWS - len(placed)),
                           np.int32),
            rows=self._rows([r for _, r, _ in placed]),
            page_writes=np.stack([_triples(group, WRITE_WIDTH, n + 1) for group in pages]),
            history_writes=_triples(history, WRITE_WIDTH, n + 1),
            bias_writes=_triples([pair[:3] for pair in bias], BIAS_WRITES, n + 1),
            bias_values=np.array([pair[3] for pair in bias] + [0.0] * (BIAS_WRITES - len(bias)),
                                 np.float32))

    def empty_admission(self) -> Admission:
        """An admission call that writes nothing (its shapes compile the program)."""
        return self._admission([], [[] for _ in range(self.num_groups)], [], [])

    def _rows(self, requests: Sequence[Request]) -> SlotRows:
        """SlotRows of ADMIT_ROWS rows: the requests', then greedy padding."""
        params = [r.params for r in requests] + [PADDING_PARAMS] * (ADMIT_ROWS - len(requests))
        values = {name: np.array([getattr(p, name) for p in params], np.float32)
                  for name in PARAM_FLOATS}
        values["temperature"] = np.array([device_temperature(p) for p in params], np.float32)
        banned = np.full((ADMIT_ROWS, STOP_WIDTH), -1, np.int32)
        for i, p in enumerate(params[:len(requests)]):
            stops = stop_ids(p, self.eos_token_ids)
            banned[i, :len(stops)] = stops
        pad = [0] * (ADMIT_ROWS - len(requests))
        return SlotRows(
            **values, top_k=np.array([p.top_k for p in params], np.int32),
            seeds=np.array([r.seed for r in requests] + pad, np.uint32),
            prompt_lens=np.array([len(r.prompt_token_ids) for r in requests] + pad, np.int32),
            min_tokens=np.array([p.min_tokens for p in params], np.int32),
            logprobs=np.array([p.logprobs or 0 for p in params], np.int32), stop_ids=banned,
            adapter=np.array([r.adapter_slot for r in requests] + [-1] * len(pad), np.int32))


def page_write_capacity(bucket: Bucket, page_size: int) -> int:
    """Page ids a step's delta carries: enough for every request to cross into a new
    page and for its tokens to fill new ones (more, placed requests' cached pages, go
    in an admission call)."""
    return bucket.num_slots + bucket.num_tokens // page_size + 1


def _fed_tokens(chunk: object) -> list[int]:
    """The chunk's tokens: the request's known ones, -1 for those still on the device
    (sampled by a step whose output the host has not read), then its drafts."""
    request, drafts = chunk.request, list(chunk.draft_token_ids)
    start, end = chunk.start, chunk.start + chunk.num_tokens - len(drafts)
    known = min(end, request.num_tokens)
    return request.tokens(start, known) + [-1] * (end - max(known, start)) + drafts


def _triples(items: list[tuple[int, int, int]], width: int, pad_row: int) -> np.ndarray:
    out = np.zeros((width, 3), np.int32)
    out[:, 0] = pad_row
    if items:
        out[:len(items)] = items
    return out
