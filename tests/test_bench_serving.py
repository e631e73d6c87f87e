"""benchmarks/bench_serving.py's pure parts: the arrival schedule, the per-request timings
and their summary, the /metrics counters and the JSON document. No server."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import sys
import types

import numpy as np
import pytest

PATH = pathlib.Path(__file__).parents[1] / "benchmarks" / "bench_serving.py"
sys.path.insert(0, str(PATH.parent))  # its sibling modules, as when run as a script
_spec = importlib.util.spec_from_file_location("bench_serving", PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_serving"] = bench  # dataclasses look their module up
_spec.loader.exec_module(bench)


def test_arrival_offsets_seeded_with_the_mean_rate():
    offsets = bench.arrival_offsets(20_000, 4.0, seed=3)
    assert offsets[0] == 0.0
    assert np.all(np.diff(offsets) >= 0)
    np.testing.assert_array_equal(offsets, bench.arrival_offsets(20_000, 4.0, seed=3))
    assert not np.array_equal(offsets, bench.arrival_offsets(20_000, 4.0, seed=4))
    rate = (len(offsets) - 1) / offsets[-1]
    assert rate == pytest.approx(4.0, rel=0.03)
    gaps = np.diff(offsets)  # exponential: the standard deviation equals the mean
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.05)


def test_arrival_offsets_infinite_rate_sends_all_at_once():
    np.testing.assert_array_equal(bench.arrival_offsets(5, math.inf, seed=0), np.zeros(5))


def _usage(prompt: int, completion: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(prompt_tokens=prompt, completion_tokens=completion)


def test_request_result_times_from_chunk_timestamps():
    result = bench.request_result(10.0, [10.5, 10.6, 10.8, 11.1], 11.2,
                                  usage=_usage(30, 4), requested_tokens=4)
    assert result.ok
    assert result.ttft == pytest.approx(0.5)
    assert result.e2e == pytest.approx(1.2)
    np.testing.assert_allclose(result.itl, [0.1, 0.2, 0.3])
    assert (result.prompt_tokens, result.output_tokens) == (30, 4)


def test_request_result_without_usage_or_tokens_fails():
    assert bench.request_result(0.0, [1.0], 2.0, usage=None, requested_tokens=1).error == (
        "no usage chunk")
    assert bench.request_result(0.0, [], 2.0, usage=_usage(3, 0),
                                requested_tokens=1).error == "no tokens"


def test_summarize_percentiles_tpot_and_throughput():
    a = bench.request_result(0.0, [0.1, 0.2, 0.3, 0.4, 0.5], 0.5, usage=_usage(10, 5),
                             requested_tokens=5)  # TPOT (0.5 - 0.1) / 4 = 0.1
    b = bench.request_result(1.0, [1.3, 1.9], 1.9, usage=_usage(20, 2),
                             requested_tokens=3)  # TPOT (0.9 - 0.3) / 1 = 0.6
    failed = bench.RequestResult(ok=False, error="APIError: boom", requested_tokens=7)
    summary = bench.summarize([a, b, failed], duration=2.0)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["errors"] == ["APIError: boom"]
    assert summary["request_throughput"] == 1.0
    assert summary["output_throughput"] == 3.5
    assert summary["total_token_throughput"] == 18.5
    assert (summary["prompt_tokens"], summary["output_tokens"]) == (30, 7)
    assert summary["output_len_mismatches"] == 1
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(350.0)
    assert summary["tpot_ms"]["p99"] == pytest.approx(100 + 0.99 * 500)
    itl = [100.0, 100.0, 100.0, 100.0, 600.0]
    assert summary["itl_ms"]["p50"] == pytest.approx(np.percentile(itl, 50))
    assert summary["itl_ms"]["p90"] == pytest.approx(np.percentile(itl, 90))
    assert summary["e2e_ms"]["mean"] == pytest.approx(700.0)


def test_summarize_all_failed_gives_none_latencies():
    summary = bench.summarize([bench.RequestResult(ok=False, error="x")], duration=1.0)
    assert summary["completed"] == 0
    assert summary["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}


METRICS = """\
# HELP jaxinfer:generation_tokens_total tokens generated
# TYPE jaxinfer:generation_tokens_total counter
jaxinfer:generation_tokens_total 120.0
# HELP jaxinfer:prompt_tokens_total prompt tokens
# TYPE jaxinfer:prompt_tokens_total counter
jaxinfer:prompt_tokens_total 300.0
# HELP jaxinfer:engine_steps_total steps
# TYPE jaxinfer:engine_steps_total counter
jaxinfer:engine_steps_total 10.0
# HELP jaxinfer:scheduled_requests_total slots
# TYPE jaxinfer:scheduled_requests_total counter
jaxinfer:scheduled_requests_total 40.0
# HELP jaxinfer:num_requests_running running
# TYPE jaxinfer:num_requests_running gauge
jaxinfer:num_requests_running 3.0
"""


def test_counters_and_deltas_tolerate_absent_metrics():
    before = bench.counters(METRICS)
    assert before == {"generation_tokens_total": 120.0, "prompt_tokens_total": 300.0,
                      "engine_steps_total": 10.0, "scheduled_requests_total": 40.0}
    after = {"generation_tokens_total": 220.0, "engine_steps_total": 30.0,
             "scheduled_requests_total": 100.0}
    assert bench.counter_deltas(before, after) == {
        "generation_tokens_total": 100.0, "engine_steps_total": 20.0,
        "scheduled_requests_total": 60.0, "mean_batch_size": 3.0}
    assert bench.counter_deltas({}, bench.counters("")) == {}


def test_build_report_structure_and_ratios():
    runs = [{"request_rate": 2.0, "output_throughput": 50.0},
            {"request_rate": "inf", "output_throughput": 150.0}]
    report = bench.build_report({"num_prompts": 4}, {"mode": "started"},
                                {"output_throughput": 100.0}, runs)
    assert set(report) == {"settings", "server", "offline_baseline", "rates"}
    assert [r["vs_offline"] for r in report["rates"]] == [0.5, 1.5]
    json.dumps(report)
    alone = bench.build_report({}, {}, None, [{"output_throughput": 1.0}])
    assert alone["rates"][0]["vs_offline"] is None


def test_make_workload_seeded_and_in_range():
    prompts, lengths = bench.make_workload(8, (100, 200), (16, 32), seed=1)
    assert (prompts, lengths) == bench.make_workload(8, (100, 200), (16, 32), seed=1)
    assert all(100 <= len(p) <= 200 for p in prompts)
    assert all(16 <= n <= 32 for n in lengths)
