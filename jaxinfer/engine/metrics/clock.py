"""The engine loop's step clock (`StepClock`): the phases of one `Engine.step()` call
stamped (schedule, dispatch, collect, update, sync) and the intervals between them handed
to the metrics: device idle, a step's and the host's seconds, speculation's device
seconds, each completion's latency stamps. Times are `time.perf_counter()` seconds.
See docs/serving.md#token-counts-and-the-host-loop and docs/architecture.md#the-host-loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from jaxinfer.engine.metrics.summary import Metrics


@dataclasses.dataclass(frozen=True)
class Sent:
    """When a dispatched step was planned (the start of its step() call) and sent."""

    planned: float
    sent: float


class StepClock:
    """The timestamps of the engine loop, and the metrics timed by them."""

    def __init__(self, metrics: Metrics, now: Callable[[], float] = time.perf_counter
                 ) -> None:
        self._metrics = metrics
        self._now = now
        self._started = 0.0  # this step() call began
        self._device_free_at: float | None = None  # since when the device has had no step
        self._waited = self._ready = 0.0  # the step being read: its wait began, its results came
        self._tokens_at = 0.0  # its tokens joined the outputs
        self._last_ready = self._last_end = 0.0  # the last step read: results came, recorded

    # ---- the phases of one step() call, in order ----------------------------------

    def schedule(self, device_done: bool) -> None:
        """A step() call begins; `device_done`: the step in flight has finished, so the
        device is free from now (if not from before)."""
        self._started = self._now()
        if device_done:
            self._device_free_at = self._device_free_at or self._started

    def dispatch(self) -> Sent:
        """A step is sent now: the device's idle gap, if any, ends."""
        now = self._now()
        if self._device_free_at is not None:
            self._metrics.device_idle_seconds += now - self._device_free_at
            self._device_free_at = None
        return Sent(planned=self._started, sent=now)

    def collect(self) -> None:
        """The host starts waiting for a step's results."""
        self._waited = self._now()

    def collected(self, nothing_in_flight: bool) -> None:
        """The results are here; with no other step in flight the device is free from now."""
        self._ready = self._now()
        if nothing_in_flight:
            self._device_free_at = self._ready

    def update(self) -> None:
        """The read step's tokens join the outputs now (`tokens`)."""
        self._tokens_at = self._now()

    def synced(self, sent: Sent, *, verified: bool, bytes_sent: int) -> float:
        """The read step's outputs are synced: records the host's seconds and the bytes the
        step sent; returns the step's seconds. `verified`: it verified drafts."""
        since = max(sent.planned, self._last_end) if verified else self._started
        seconds = self._now() - since
        self._metrics.record_host(seconds=seconds - (self._ready - self._waited),
                                  bytes_sent=bytes_sent)
        return seconds

    def recorded(self) -> None:
        """The read step's counters are recorded: its end, for a verify step read later."""
        self._last_end = self._now()

    def idle(self) -> None:
        """No work left: the wait for the next request is not a gap between steps."""
        self._device_free_at = None

    # ---- what other metrics are timed by ------------------------------------------

    def device_seconds(self, sent: Sent) -> float:
        """The read step's device time, for speculation's cost model: from its dispatch, or
        the last read step's results if later (it queued behind it), to its results."""
        began, self._last_ready = max(sent.sent, self._last_ready), self._ready
        return self._ready - began

    def added(self, request_id: str) -> None:
        self._metrics.latency.added(request_id, self._now())

    def scheduled(self, request_ids: Iterable[str]) -> None:
        """The completions ran in the read step: a first one ends its queue time at the
        start of this call."""
        for request_id in request_ids:
            self._metrics.latency.scheduled(request_id, self._started)

    def tokens(self, request_id: str, count: int) -> None:
        self._metrics.latency.tokens(request_id, count, self._tokens_at)

    def finished(self, request_id: str, reason: str) -> None:
        self._metrics.latency.finish(request_id, reason, self._now())
