"""Host-side step arrays built by the runner: exact metadata for a ragged batch."""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer.engine.runner import Chunk, build_metadata, next_power_of_two


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
    assert next_power_of_two(n, floor) == want
    assert np.log2(want).is_integer()
