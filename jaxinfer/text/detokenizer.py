"""Streamed text deltas of generated token ids (`IncrementalDetokenizer`, made by
`Tokenizer.detokenizer`): bytes held back until a character completes.
See docs/sampling.md#tokenizer-and-chat-template.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxinfer.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# How many prompt tokens seed a detokenizer's window (vLLM's initial offset).
PROMPT_SEED_TOKENS = 5
# Over this many held ids with no complete character boundary are invalid UTF-8: emit them.
MAX_HELD_TOKENS = 16
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated ids into text deltas, holding bytes back until a character completes.

    vLLM's scheme: keep a window `_ids` whose first `_read_offset` ids were already emitted
    (the prefix, kept for context such as sentencepiece's leading space), decode the prefix and
    the whole window, and emit the difference unless the window ends in U+FFFD (an incomplete
    UTF-8 character). After emitting, the old new ids become the prefix. Each call costs
    O(window), not O(total). Seeded with the prompt's tail, the deltas add up to
    `decode(prompt + generated)` minus `decode(prompt)`; unseeded, to `decode(generated)`.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        seed = prompt_token_ids[-PROMPT_SEED_TOKENS:]
        self._ids: list[int] = [int(t) for t in seed]  # prefix (emitted) + held ids
        self._read_offset = len(self._ids)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends generated ids; returns the new text (may be "" while a character is pending)."""
        self._ids.extend(int(t) for t in token_ids)
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self._ids[: self._read_offset])
        cut = len(self._ids)
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT_CHAR):
            cut, text = self._complete_prefix(prefix_text)
        if cut == self._read_offset or len(text) <= len(prefix_text):
            return ""
        delta = text[len(prefix_text) :]
        del self._ids[: self._read_offset]
        self._read_offset = cut - self._read_offset
        self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character shows as U+FFFD)."""
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text = self._decode(self._ids[: self._read_offset])
        delta = self._decode(self._ids)[len(prefix_text):]
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._chunks.append(delta)
        return delta

    def _complete_prefix(self, prefix_text: str) -> tuple[int, str]:
        """(end, text) of the longest window prefix whose text grows and has no trailing U+FFFD.
        (`_read_offset`, prefix_text) holds everything, unless over MAX_HELD_TOKENS ids are
        pending: those are invalid UTF-8 and go out as they are. Runs only mid-character."""
        end, held = len(self._ids), len(self._ids) - self._read_offset
        for cut in range(end - 1, self._read_offset, -1):
            text = self._decode(self._ids[:cut])
            if not text.endswith(REPLACEMENT_CHAR) and len(text) > len(prefix_text):
                return cut, text
        if held > MAX_HELD_TOKENS:
            logger.debug("emitting %d ids that do not decode to valid UTF-8", held)
            return end, self._decode(self._ids)
        return self._read_offset, prefix_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
