"""SamplingParams, RequestOutput, and the Request record. Plain Python, no jax.

Invalid sampling values are refused when `SamplingParams` is built, with the
field named, so a bad request never reaches the device.
"""

from __future__ import annotations

import dataclasses
import math

MAX_LOGPROBS = 20  # top-k logprobs the device step always computes


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's names and meanings)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # top-k logprobs per token; the chosen one always added
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                 f"max_tokens={self.max_tokens!r} must be an int >= 1")
        _require(_is_real(self.temperature) and self.temperature >= 0,
                 f"temperature={self.temperature!r} must be a finite number >= 0")
        _require(isinstance(self.top_k, int) and self.top_k >= 0,
                 f"top_k={self.top_k!r} must be an int >= 0 (0 disables it)")
        _require(_is_real(self.top_p) and 0 < self.top_p <= 1,
                 f"top_p={self.top_p!r} must be in (0, 1]")
        _require(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**31),
                 f"seed={self.seed!r} must be None or an int in [0, 2**31)")
        _require(self.logprobs is None or (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs={self.logprobs!r} must be None or an int in [0, {MAX_LOGPROBS}]")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 f"stop_token_ids={self.stop_token_ids!r} must be non-negative ints")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(kw_only=True)
class RequestOutput:
    """What one prompt produced."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" or "length"
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
