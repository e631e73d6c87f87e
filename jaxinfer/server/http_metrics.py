"""HTTP requests counted by route: `jaxinfer:http_requests_total{handler, method, status}`
in /metrics (the names vLLM's server exports through prometheus-fastapi-instrumentator),
so traffic through /v1/responses, /v1/chat/completions and the rest tells apart; the
engine's own counters cover the requests of every route. See docs/serving.md#metrics.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

NAME = "jaxinfer:http_requests"
UNMATCHED = "none"  # the handler label of a request no route took (vLLM's instrumentator's)


class RequestCounter:
    """ASGI middleware: each HTTP request, once answered, counted under its route's path
    template (`/v1/responses/{response_id}`, never the id itself: bounded labels)."""

    def __init__(self, app: Any, counts: collections.Counter) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # none sent: the request failed before an answer started

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get("route")
            handler = getattr(route, "path", None) or UNMATCHED
            self.counts[(handler, scope["method"], str(status[0]))] += 1


def families(counts: collections.Counter) -> Iterator[Metric]:
    family = CounterMetricFamily(NAME, "HTTP requests answered, by route, method and "
                                 "status", labels=["handler", "method", "status"])
    for (handler, method, status), count in sorted(counts.items()):
        family.add_metric([handler, method, status], count)
    yield family
