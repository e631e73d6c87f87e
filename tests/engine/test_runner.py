"""Host-side step arrays built by the runner: exact metadata for a ragged batch, the
sampled positions, their sampling rows and proposed ids."""

from __future__ import annotations

import pytest

from jaxinfer import testing
from jaxinfer.engine.request import Request, SamplingParams
from jaxinfer.engine.runner import Chunk, build_metadata, next_power_of_two, sampling_inputs
from jaxinfer.engine.runner.inputs import proposed_ids


def test_build_metadata_ragged_batch_exact():
    chunks = [Chunk([11, 12, 13], 0, [7, 2]), Chunk([21], 5, [4, 8]), Chunk([31, 32], 3, [9, 6])]
    token_ids, md = build_metadata(chunks, page_size=4, pages_per_seq=3, num_tokens=8,
                                   num_slots=4)
    assert token_ids.tolist() == [11, 12, 13, 21, 31, 32, 0, 0]
    assert md.positions.tolist() == [0, 1, 2, 5, 3, 4, 0, 0]
    # page * 4 + offset; request 2 crosses from page 9 (slot 3) into page 6 (slot 0)
    assert md.slot_mapping.tolist() == [28, 29, 30, 33, 39, 24, 2, 3]
    assert md.page_indices.tolist() == [[7, 2, 0], [4, 8, 0], [9, 6, 0], [0, 0, 0]]
    assert md.kv_lens.tolist() == [3, 6, 5, 0]
    assert md.cu_q_lens.tolist() == [0, 3, 4, 6, 6]
    assert md.num_seqs.tolist() == [3]
    assert md.logits_indices.tolist() == [2, 3, 5, 0]


def test_build_metadata_all_logits_rows():
    _, md = build_metadata([Chunk([1, 2], 0, [1])], page_size=4, pages_per_seq=1,
                           num_tokens=4, num_slots=1, all_logits=True)
    assert md.logits_indices.tolist() == [0, 1, 2, 3]


def test_build_metadata_padding_writes_only_the_trash_page():
    _, md = build_metadata([Chunk([1], 0, [3])], page_size=8, pages_per_seq=2,
                           num_tokens=16, num_slots=2)
    assert (md.slot_mapping[1:] // 8 == 0).all()


def test_build_metadata_rejects_too_few_pages():
    with pytest.raises(ValueError, match="request 0: 1 pages cannot hold 5 tokens"):
        build_metadata([Chunk([1, 2, 3, 4, 5], 0, [3])], page_size=4, pages_per_seq=2,
                       num_tokens=8, num_slots=1)


def test_build_metadata_rejects_overfull_bucket():
    with pytest.raises(ValueError, match="exceed the bucket"):
        build_metadata([Chunk(list(range(9)), 0, [1, 2, 3])], page_size=4, pages_per_seq=3,
                       num_tokens=8, num_slots=1)


@pytest.mark.parametrize("n, floor, want", [(0, 1, 1), (1, 1, 1), (5, 1, 8), (8, 8, 8),
                                            (9, 8, 16), (3, 8, 8)])
def test_next_power_of_two(n, floor, want):
    got = next_power_of_two(n, floor)
    assert got == want
    assert got >= max(n, floor) and got & (got - 1) == 0  # a power of two that holds n


def _request(rid, prompt, outputs=(), **params):
    return Request(request_id=rid, prompt_token_ids=list(prompt), arrival=0, seed=3,
                   params=SamplingParams(**({"temperature": 0.0} | params)),
                   output_token_ids=list(outputs))


def test_build_metadata_samples_each_chunks_last_positions():
    chunks = [Chunk([11, 12, 13, 14], 0, [1, 2], num_samples=3), Chunk([21], 5, [3, 4]),
              Chunk([31, 32], 0, [5], num_samples=0)]
    _, md = build_metadata(chunks, page_size=4, pages_per_seq=2, num_tokens=8, num_slots=4,
                           num_positions=3)
    # Row s * 3 + q: q-th sampled token of slot s; unused rows point at token 0.
    assert md.logits_indices.tolist() == [1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0, 0]
    assert proposed_ids(chunks, num_slots=4, num_positions=3).tolist() == [
        [13, 14, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match="request 0: 3 samples of 4 tokens, at most 2"):
        build_metadata(chunks, page_size=4, pages_per_seq=2, num_tokens=8, num_slots=4,
                       num_positions=2)


def test_sampling_rows_follow_the_tokens_before_each_position():
    verify = _request("v", [1, 2, 3], [4], min_tokens=2, stop_token_ids=[9], logprobs=2)
    decode = _request("d", [5, 6], [7, 8], temperature=0.5, top_k=4)
    chunks = [Chunk([4, 40, 41], 3, [1], num_samples=3), Chunk([8], 3, [2]),
              Chunk([50, 51], 0, [3], num_samples=0)]
    rows = testing.sample_rows([verify, decode, _request("p", [50, 51, 52])], chunks,
                               num_positions=3)
    assert [None if r is None else (r.request.request_id, list(r.token_ids)) for r in rows] == [
        ("v", [1, 2, 3, 4]), ("v", [1, 2, 3, 4, 40]), ("v", [1, 2, 3, 4, 40, 41]),
        ("d", [5, 6, 7, 8]), None, None, None, None, None]
    inp = sampling_inputs(rows, num_rows=10, history_width=8, eos_token_ids=frozenset({99}))
    assert inp.counters.tolist() == [1, 2, 3, 2, 0, 0, 0, 0, 0, 0]
    assert inp.history_lens.tolist() == [4, 5, 6, 4, 0, 0, 0, 0, 0, 0]
    assert inp.prompt_lens.tolist() == [3, 3, 3, 2, 0, 0, 0, 0, 0, 0]
    assert inp.ban_stop.tolist() == [True] + [False] * 9  # only before the 2nd output
    assert inp.stop_ids[0, :3].tolist() == [9, 99, -1] and (inp.stop_ids[1:] == -1).all()
    assert inp.history[2].tolist() == [1, 2, 3, 4, 40, 41, -1, -1]
    assert inp.history[3].tolist() == [5, 6, 7, 8, -1, -1, -1, -1]
    assert inp.temperature.tolist() == [0, 0, 0, 0.5, 0, 0, 0, 0, 0, 0]
    assert inp.top_k.tolist() == [0, 0, 0, 4, 0, 0, 0, 0, 0, 0]
    assert inp.logprobs.tolist() == [2, 2, 2, 0, 0, 0, 0, 0, 0, 0]
    assert inp.seeds.tolist() == [3] * 4 + [0] * 6
