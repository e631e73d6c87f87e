"""Helpers of the server tests (importable as `serving`, see pyproject's pythonpath)."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families


def greedy(llm, max_tokens: int, **overrides):
    """The params the server builds for a request giving temperature 0: the checkpoint's
    defaults with those fields replaced."""
    return dataclasses.replace(llm.engine.default_params, temperature=0,
                               max_tokens=max_tokens, **overrides)


def metric_values(server) -> dict[str, float]:
    """Every sample of /metrics by name (labels folded into the name)."""
    text = server.get("/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values
