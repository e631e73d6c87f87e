"""Latency histograms from request stamps: buckets as Prometheus counts them (le), TTFT
at the first token, inter-token gaps split over the tokens a step added."""

from __future__ import annotations

import pytest

from jaxinfer.engine.metrics.latency import Histogram, Latency


def test_histogram_buckets_are_cumulative_and_inclusive():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 2.0):
        h.observe(value)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert (h.count, h.sum) == (4, pytest.approx(2.65))


def test_latency_stamps_one_completion():
    lat = Latency()
    lat.added("a", 10.0)
    lat.scheduled("a", 10.5)
    lat.scheduled("a", 11.0)  # only the first scheduling ends the queue time
    lat.tokens("a", 1, 12.0)
    lat.tokens("a", 2, 13.0)  # two tokens in one step: two gaps of 0.5
    lat.tokens("a", 0, 14.0)  # nothing added: nothing observed
    lat.finish("a", "length", 15.0)
    lat.finish("a", "length", 16.0)  # finished once
    assert (lat.queue.count, lat.queue.sum) == (1, 0.5)
    assert (lat.ttft.count, lat.ttft.sum) == (1, 2.0)
    assert (lat.itl.count, lat.itl.sum) == (2, 1.0)
    assert (lat.e2e.count, lat.e2e.sum) == (1, 5.0)
    assert lat.finished == {"length": 1}
    assert lat.summary()["mean_ttft_ms"] == 2000.0
