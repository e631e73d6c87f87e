"""Bucket ladders: decode buckets (one token per request) and mixed buckets."""

from __future__ import annotations

import pytest

from jaxinfer.engine.core.buckets import Bucket, BucketSet


def test_decode_buckets_have_one_token_per_slot():
    buckets = BucketSet(max_num_batched_tokens=512, max_num_seqs=64)
    assert buckets.decode() == [Bucket(s, s, True) for s in (1, 2, 4, 8, 16, 32, 64)]
    assert buckets.pick(3, 3, decode=True) == Bucket(4, 4, True)
    assert buckets.pick(64, 64, decode=True) == Bucket(64, 64, True)


def test_decode_buckets_respect_min_tokens():
    buckets = BucketSet(max_num_batched_tokens=64, max_num_seqs=4, min_tokens=2)
    assert buckets.decode() == [Bucket(2, 1, True), Bucket(2, 2, True), Bucket(4, 4, True)]
    assert buckets.pick(1, 1, decode=True) == Bucket(2, 1, True)


def test_mixed_buckets_climb_tokens_with_every_slot():
    buckets = BucketSet(max_num_batched_tokens=512, max_num_seqs=64)
    mixed = [b for b in buckets.all() if not b.decode]
    assert mixed == [Bucket(t, 64) for t in (16, 32, 64, 128, 256, 320, 384, 448, 512)]
    assert buckets.pick(300, 5) == Bucket(320, 64)
    assert buckets.pick(385, 33) == Bucket(448, 64)
    assert buckets.pick(17, 3) == Bucket(32, 64)
    assert len(buckets.all()) == 7 + 9  # the old (tokens x slots) ladder had 39


def test_mixed_padding_above_256_stays_under_a_quarter_of_the_step():
    tokens = BucketSet(max_num_batched_tokens=512, max_num_seqs=32).tokens
    for num_tokens in range(257, 513):
        padded = next(t for t in tokens if t >= num_tokens)
        assert padded - num_tokens < 64 and padded / num_tokens <= 1.25


def test_pick_refuses_what_no_bucket_holds():
    buckets = BucketSet(max_num_batched_tokens=64, max_num_seqs=8)
    with pytest.raises(ValueError, match="exceed the largest bucket"):
        buckets.pick(65, 1)
    with pytest.raises(ValueError, match="one token per request"):
        buckets.pick(5, 4, decode=True)
