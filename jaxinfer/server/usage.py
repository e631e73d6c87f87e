"""Usage in a stream's chunks: OpenAI's `stream_options.include_usage` and vLLM's
`continuous_usage_stats` (the usage so far in every chunk). See docs/serving.md#routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def per_chunk(options: Any, so_far: Callable[[], dict[str, Any]]
              ) -> Callable[[], dict[str, Any]]:
    """What each chunk carries besides its choices, given the request's `stream_options`
    (None: none given) and `so_far`, the usage up to now."""
    if options is None or not options.include_usage:
        return dict
    if options.continuous_usage_stats:
        return lambda: {"usage": so_far()}
    return lambda: {"usage": None}
