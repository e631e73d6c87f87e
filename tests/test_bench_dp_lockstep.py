"""benchmarks/bench_dp_lockstep.py's comparison and host-only simulation (no compile)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

PATH = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_dp_lockstep.py"
_spec = importlib.util.spec_from_file_location("bench_dp_lockstep", PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_dp_lockstep"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)

BUCKETS = bench.BucketSet(max_num_batched_tokens=64, max_num_seqs=8)
SHAPE = bench.Shape(layers=2, num_heads=4, head_dim=8, kv_bytes_per_token=64, q_block=4)


def by_bucket(bucket, step):
    """A cost that grows with the bucket: tokens plus a fixed part."""
    return 10.0 + bucket.num_tokens


def decode(n):
    return bench.Step(n, n, True)


def mixed(tokens, requests):
    return bench.Step(tokens, requests, False)


def test_same_buckets_on_every_replica_cost_the_same_both_ways():
    steps = [decode(3), mixed(40, 5), decode(8)]
    totals = bench.dp_totals(BUCKETS, [steps] * 4, by_bucket)
    assert totals["lockstep_s"] == totals["per_replica_s"] == 14 + 74 + 18
    assert totals["lockstep_over_per_replica"] == 1.0
    assert totals["padding_fraction"] == pytest.approx(0.0)


def test_one_prefilling_replica_pads_the_others():
    busy = [mixed(64, 8), decode(2)]
    calm = [decode(2), decode(2)]
    totals = bench.dp_totals(BUCKETS, [busy, calm], by_bucket)
    assert totals["per_replica_s"] == 74 + 12  # the busy one; the calm one spends 24
    assert totals["lockstep_s"] == 74 + 12  # step 0 runs the mixed bucket on both
    assert totals["padding_fraction"] == pytest.approx(1 - (86 + 24) / (2 * 86))


def test_idle_replica_runs_the_padded_step_and_lockstep_is_never_cheaper():
    totals = bench.dp_totals(BUCKETS, [[decode(1), decode(1)], [None, mixed(17, 2)]],
                             by_bucket)
    assert totals["per_replica_s"] == 42  # the second replica's one mixed step
    assert totals["lockstep_s"] == 11 + 42  # step 0 runs on both; step 1: (32, 8) on both
    assert totals["padding_fraction"] == pytest.approx(1 - (22 + 42) / (2 * 53))
    assert bench.lockstep_bucket(BUCKETS, [None, None]) is None


def test_lockstep_bucket_holds_every_replica_and_decodes_only_when_all_do():
    shared = bench.lockstep_bucket(BUCKETS, [decode(5), mixed(20, 2)])
    assert (shared.num_tokens, shared.num_slots, shared.decode) == (32, 8, False)
    shared = bench.lockstep_bucket(BUCKETS, [decode(3), decode(5), None])
    assert (shared.num_tokens, shared.num_slots, shared.decode) == (8, 8, True)


def test_simulation_serves_every_token_on_the_replica_it_was_dealt_to():
    workload = bench.make_workload(12, "poisson", 0.5, (5, 40), (2, 9), seed=1)
    assert [w[0] for w in workload] == sorted(w[0] for w in workload)
    replicas = bench.simulate(workload, 3, max_num_seqs=4, max_num_batched_tokens=16,
                              max_model_len=64, num_pages=64, page_size=4, shape=SHAPE)
    for index, steps in enumerate(replicas):
        dealt = workload[index::3]
        # each prompt once, each output token but the last fed back as a decode
        expected = sum(prompt + output - 1 for _, prompt, output in dealt)
        assert sum(s.num_tokens for s in steps if s is not None) == expected
    totals = bench.dp_totals(BUCKETS, replicas, by_bucket)
    assert totals["lockstep_s"] >= totals["per_replica_s"]


def test_attention_cost_reads_each_chunks_own_context():
    moved, flops = bench.attention_cost(SHAPE, 9, 1)  # a decode at position 9
    assert moved == 2 * (10 * 64 + 4 * 32) and flops == 2 * 4.0 * 32 * 10
    moved, _ = bench.attention_cost(SHAPE, 0, 9)  # 3 query blocks of 4 over 9 tokens
    assert moved == 2 * (3 * 9 * 64 + 4 * 9 * 32)
