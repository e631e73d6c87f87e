"""Per-request latency histograms (`Latency`): queue time, time to first token,
inter-token latency, end-to-end latency, and finished requests by reason, with vLLM's
bucket boundaries, from the stamps the step clock (clock.py) gives each completion, so
`/metrics` and `llm.metrics()` read the same numbers. Plain Python.
See docs/serving.md#metrics.
"""

from __future__ import annotations

import bisect
import dataclasses

# vLLM v1's bucket upper bounds (seconds), so dashboards built for it read ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclasses.dataclass
class Histogram:
    """Counts per bucket (upper bounds, +Inf last), their sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = dataclasses.field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, observations <= it), +Inf last."""
        out, total = [], 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out

    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0


@dataclasses.dataclass
class _Stamps:
    added: float
    scheduled: float | None = None
    last_token: float | None = None


@dataclasses.dataclass
class Latency:
    """The histograms, and the stamps of completions still in flight."""

    queue: Histogram = dataclasses.field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    ttft: Histogram = dataclasses.field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = dataclasses.field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = dataclasses.field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    finished: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> count
    _stamps: dict[str, _Stamps] = dataclasses.field(default_factory=dict)

    def added(self, key: str, now: float) -> None:
        self._stamps[key] = _Stamps(added=now)

    def scheduled(self, key: str, now: float) -> None:
        """The completion ran in a step for the first time: its queue time ends."""
        stamps = self._stamps.get(key)
        if stamps is not None and stamps.scheduled is None:
            stamps.scheduled = now
            self.queue.observe(now - stamps.added)

    def tokens(self, key: str, count: int, now: float) -> None:
        """`count` tokens joined the output at `now`: the first token's latency, or the
        gap since the previous tokens split evenly over these."""
        stamps = self._stamps.get(key)
        if stamps is None or count <= 0:
            return
        if stamps.last_token is None:
            self.ttft.observe(now - stamps.added)
            if count > 1:
                self.itl.observe(0.0, count - 1)
        else:
            self.itl.observe((now - stamps.last_token) / count, count)
        stamps.last_token = now

    def finish(self, key: str, reason: str, now: float) -> None:
        stamps = self._stamps.pop(key, None)
        if stamps is None:
            return
        self.e2e.observe(now - stamps.added)
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def summary(self) -> dict[str, float | int]:
        """Means in milliseconds and counts, for `llm.metrics()`."""
        return {"requests_finished": sum(self.finished.values()),
                "mean_queue_ms": round(1e3 * self.queue.mean(), 2),
                "mean_ttft_ms": round(1e3 * self.ttft.mean(), 2),
                "mean_itl_ms": round(1e3 * self.itl.mean(), 2),
                "mean_e2e_ms": round(1e3 * self.e2e.mean(), 2)}
