"""The host's slot table, exactly: placement and release, page ids sent once, rows of
placed requests, tokens still on the device, and what overflows into admissions."""

from __future__ import annotations

import numpy as np

from jaxinfer.engine.core.buckets import Bucket
from jaxinfer.engine.core.scheduler import ScheduledChunk
from jaxinfer.engine.request import Request, SamplingParams, Status
from jaxinfer.engine.runner import slots as slots_lib
from jaxinfer.engine.runner.slots import SlotTable

N, PAGE = 4, 4


def _request(rid: str, prompt: list[int], pages: list[int], **params) -> Request:
    request = Request(request_id=rid, prompt_token_ids=prompt, arrival=0, seed=3,
                      params=SamplingParams(**params))
    request.page_ids = [list(pages)]  # one KV page group
    request.status = Status.RUNNING
    return request


def _writes(delta) -> list[tuple[int, int, int]]:
    (group,) = np.asarray(delta.page_writes).tolist()
    return [tuple(w) for w in group if w[0] <= N]


def test_a_step_sends_new_page_ids_once_and_tokens_on_the_device_as_minus_one():
    table = SlotTable(N, page_size=PAGE)
    a = _request("a", list(range(10, 16)), [7, 8])
    delta, admissions = table.delta([ScheduledChunk(a, 0, 6, 1)], Bucket(8, N))
    assert table.slot(a) == 0
    assert _writes(delta) == [(0, 0, 7), (0, 1, 8)]
    assert delta.token_ids.tolist() == list(range(10, 16)) + [0, 0]
    assert delta.positions.tolist()[:6] == list(range(6))
    assert delta.token_slots.tolist() == [0] * 6 + [N, N]  # padding: the neutral slot
    assert delta.seq_slots.tolist() == [0, N, N, N]
    assert delta.kv_lens.tolist() == [6, 0, 0, 0]
    assert delta.cu_q_lens.tolist() == [0, 6, 6, 6, 6]
    assert delta.logits_indices.tolist() == [5, 0, 0, 0]
    assert delta.sample_slots.tolist() == [0, N, N, N]
    (admission,) = admissions
    assert admission.slots.tolist() == [0] + [N + 1] * (slots_lib.ADMIT_ROWS - 1)
    assert admission.rows.seeds[0] == 3 and admission.rows.prompt_lens[0] == 6
    assert admission.rows.temperature[0] == 1.0 and admission.rows.temperature[1] == 0.0
    # Step t + 1 feeds the token step t sampled before the host has read it: -1.
    a.num_computed_tokens, a.num_output_placeholders = 6, 1
    delta, admissions = table.delta([ScheduledChunk(a, 6, 1, 1)], Bucket(1, 1, True))
    assert admissions == [] and _writes(delta) == []  # position 6 is on page 8, sent
    assert delta.token_ids.tolist() == [-1] and delta.kv_lens.tolist() == [7]
    a.output_token_ids, a.page_ids = [99, 98, 97], [[7, 8, 5]]
    delta, _ = table.delta([ScheduledChunk(a, 8, 1, 1)], Bucket(1, 1, True))
    assert delta.token_ids.tolist() == [97] and _writes(delta) == [(0, 2, 5)]


def test_slots_are_freed_when_requests_finish_or_are_preempted():
    table = SlotTable(N, page_size=PAGE)
    a, b = _request("a", [1, 2], [3]), _request("b", [4, 5], [6])
    table.delta([ScheduledChunk(a, 0, 2, 1), ScheduledChunk(b, 0, 2, 1)], Bucket(4, N))
    assert (table.slot(a), table.slot(b)) == (0, 1)
    a.status = Status.FINISHED
    b.num_preemptions += 1  # preempted and placed again before the table looked
    c = _request("c", [7], [9])
    delta, admissions = table.delta([ScheduledChunk(b, 0, 2, 1), ScheduledChunk(c, 0, 1, 1)],
                                    Bucket(4, N))
    assert table.slot(a) is None and (table.slot(b), table.slot(c)) == (1, 0)  # reused
    assert _writes(delta) == [(1, 0, 6), (0, 0, 9)]  # b's row written again from page 0
    assert admissions[0].slots.tolist()[:2] == [1, 0]


def test_trimmed_pages_are_rewritten_and_long_rows_overflow_into_admissions():
    table = SlotTable(N, page_size=PAGE)
    pages = list(range(1, 301))  # a 1200-token prefix hit: 300 page ids at once
    a = _request("a", list(range(1201)), pages + [400], repetition_penalty=1.5)
    delta, admissions = table.delta([ScheduledChunk(a, 1200, 1, 1)], Bucket(1, 1, True))
    capacity = slots_lib.page_write_capacity(Bucket(1, 1, True), PAGE)
    sent = _writes(delta) + [tuple(w) for adm in admissions
                             for w in adm.page_writes[0].tolist() if w[0] <= N]
    assert sorted(sent) == [(0, k, p) for k, p in enumerate(pages + [400])]
    assert len(_writes(delta)) == capacity
    history = [tuple(w) for adm in admissions for w in adm.history_writes.tolist()
               if w[0] <= N]
    assert history == [(0, p, p) for p in range(1200)]  # the penalized request's past
    assert len(admissions) == -(-1200 // slots_lib.WRITE_WIDTH)
    # Rejected drafts' pages freed and others taken at the same indices: resent.
    a.page_ids[0][-2:] = [500, 501]
    delta, _ = table.delta([ScheduledChunk(a, 1200, 1, 1)], Bucket(1, 1, True))
    assert _writes(delta) == [(0, 299, 500), (0, 300, 501)]
