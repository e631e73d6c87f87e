"""The step clock's intervals on a scripted time source: device idle, a step's seconds,
the host's share, speculation's device seconds and the latency stamps."""

from __future__ import annotations

import pytest

from jaxinfer.engine.metrics.clock import StepClock
from jaxinfer.engine.metrics.summary import Metrics


def _clock(*times):
    metrics, ticks = Metrics(), iter(times)
    return StepClock(metrics, now=lambda: next(ticks)), metrics


def test_a_synchronous_step_then_the_device_gap_before_the_next():
    clock, metrics = _clock(0.0, 1.0, 2.0, 5.0, 6.0, 7.0, 8.0, 10.0, 11.0)
    clock.schedule(device_done=False)  # 0
    sent = clock.dispatch()  # 1: nothing was idle yet
    assert (sent.planned, sent.sent, metrics.device_idle_seconds) == (0.0, 1.0, 0.0)
    clock.collect()  # 2
    clock.collected(nothing_in_flight=True)  # 5: the device is free from here
    clock.update()  # 6
    seconds = clock.synced(sent, verified=False, bytes_sent=64)  # 7
    assert seconds == 7.0  # from the start of the call
    assert (metrics.host_seconds, metrics.host_to_device_bytes) == (4.0, 64)  # less 3 waited
    clock.recorded()  # 8
    clock.schedule(device_done=False)  # 10
    clock.dispatch()  # 11
    assert metrics.device_idle_seconds == 6.0  # from the results (5) to the dispatch


def test_the_device_is_free_from_the_call_that_finds_its_step_done():
    clock, metrics = _clock(3.0, 4.0, 9.0)
    clock.schedule(device_done=True)  # 3
    clock.schedule(device_done=True)  # 4: still free since 3
    clock.dispatch()  # 9
    assert metrics.device_idle_seconds == 6.0


def test_running_out_of_work_is_no_gap_between_steps():
    clock, metrics = _clock(0.0, 1.0, 2.0, 50.0)
    clock.schedule(device_done=False)
    clock.collect()
    clock.collected(nothing_in_flight=True)  # 2
    clock.idle()
    clock.dispatch()  # 50
    assert metrics.device_idle_seconds == 0.0


def test_a_verify_step_read_later_is_timed_from_the_last_step_recorded():
    # call 1 plans and sends the verify step at 0/1; call 2 (started 2) first reads the
    # step before it, recorded at 4, then reads the verify step and syncs it at 9.
    clock, metrics = _clock(0.0, 1.0, 2.0, 4.0, 5.0, 6.0, 9.0)
    clock.schedule(device_done=False)
    sent = clock.dispatch()
    clock.schedule(device_done=False)  # 2
    clock.recorded()  # 4: the step before it
    clock.collect()  # 5
    clock.collected(nothing_in_flight=True)  # 6
    assert clock.synced(sent, verified=True, bytes_sent=0) == pytest.approx(5.0)  # 9 - 4
    assert metrics.host_seconds == pytest.approx(4.0)


def test_device_seconds_start_after_the_last_step_read():
    clock, _ = _clock(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 8.0)
    clock.schedule(device_done=False)  # 0
    first = clock.dispatch()  # 1
    second = clock.dispatch()  # 2: queued behind the first
    clock.collect()  # 3
    clock.collected(nothing_in_flight=False)  # 4
    assert clock.device_seconds(first) == 3.0  # 4 - 1
    clock.collect()  # 5
    clock.collected(nothing_in_flight=True)  # 7
    assert clock.device_seconds(second) == 3.0  # 7 - 4, not 7 - 2


def test_latency_stamps():
    clock, metrics = _clock(1.0, 2.0, 4.0, 7.0)
    clock.added("a")  # 1
    clock.schedule(device_done=False)  # 2
    clock.scheduled(["a"])  # the start of the call: queued 1
    clock.update()  # 4
    clock.tokens("a", 1)  # first token at 4: TTFT 3
    clock.finished("a", "length")  # 7: end to end 6
    latency = metrics.latency
    assert (latency.queue.sum, latency.ttft.sum, latency.e2e.sum) == (1.0, 3.0, 6.0)
    assert latency.finished == {"length": 1}
