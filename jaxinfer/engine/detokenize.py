"""The text of one completion as its tokens arrive (`TextState`): incremental
detokenization, stop strings cut (the possible start of one held back while streaming),
and the deltas a stream hands out. Plain Python. See docs/sampling.md
(#sampling-parameters, #checkpoints-without-a-tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxinfer.text.tokenizer import IncrementalDetokenizer


class TextState:
    """The text of one completion as its tokens arrive."""

    def __init__(self, detokenizer: IncrementalDetokenizer | None,
                 stop: Sequence[str] = (), *, keep_stop: bool = False) -> None:
        self._detokenizer = detokenizer
        self._stop = tuple(stop)
        self._keep_stop = keep_stop  # vLLM's include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all text so far, cut before a stop string once one appears
        self._emitted = 0  # characters already handed out as deltas
        self.stop_string: str | None = None

    def add(self, token_ids: Sequence[int]) -> None:
        """Decode new tokens; looks for a stop string in the text they complete."""
        if self.stop_string is not None or self._detokenizer is None:
            return
        before = len(self.text)
        self.text += self._detokenizer.add(token_ids)
        if not self._stop:
            return
        window = max(0, before - self._hold)
        hits = [(self.text.find(s, window), s) for s in self._stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if hits:
            at, self.stop_string = min(hits)
            self.text = self.text[:at + len(self.stop_string) if self._keep_stop else at]

    def finish(self) -> None:
        """The request ended: take the text of any bytes the detokenizer held back."""
        if self.stop_string is None and self._detokenizer is not None:
            self.text += self._detokenizer.flush()

    def delta(self, finished: bool) -> str:
        """Text not handed out yet, holding back a possible stop-string prefix."""
        end = len(self.text) if finished or self.stop_string else len(self.text) - self._hold
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out
