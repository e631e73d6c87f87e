"""Reasoning parsers (`PARSERS`, `parser`, `split`): a reasoning model's output split into
reasoning and answer, whole or streamed, and `MarkedDetokenizer`, which keeps the markers
the engine's text drops. Formats and flags: docs/serving.md#reasoning-models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

# harmony's special tokens (o200k_harmony), as gpt-oss's tokenizer spells them
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
HARMONY_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
MESSAGE_ENDS = (END, RETURN, CALL)
CONTENT_CHANNEL = "final"


@dataclasses.dataclass
class Split:
    """What some text added to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""

    def __iadd__(self, other: Split) -> Split:
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningParser(Protocol):
    markers: tuple[str, ...]  # the special tokens it reads: decode them as text

    def add(self, text: str) -> Split: ...

    def finish(self) -> Split: ...


class MarkerScanner:
    """Text cut into plain runs and whole markers; a tail that may start a marker waits
    for the next piece (or `final`)."""

    def __init__(self, markers: Sequence[str]) -> None:
        # the longest first: a marker that starts another one never cuts it short
        self._markers = tuple(sorted(markers, key=len, reverse=True))
        self._pending = ""

    def scan(self, text: str, final: bool = False) -> list[tuple[bool, str]]:
        """(is a marker, text) runs of the pending text plus `text`, in order."""
        pending, runs = self._pending + text, []
        while pending:
            hits = [(pending.find(m), m) for m in self._markers if m in pending]
            if not hits:
                keep = 0 if final else self._partial_tail(pending)
                runs.append((False, pending[:len(pending) - keep]))
                pending = pending[len(pending) - keep:]
                break
            at, marker = min(hits, key=lambda hit: hit[0])
            runs += [(False, pending[:at]), (True, marker)]
            pending = pending[at + len(marker):]
        self._pending = pending
        return [(is_marker, run) for is_marker, run in runs if run]

    def _partial_tail(self, text: str) -> int:
        """The length of the longest end of `text` that begins a marker."""
        longest = max(map(len, self._markers), default=1) - 1
        for size in range(min(longest, len(text)), 0, -1):
            if any(m.startswith(text[-size:]) for m in self._markers):
                return size
        return 0


class HarmonyParser:
    """gpt-oss's harmony messages: the `final` channel is content, the others reasoning."""

    markers = HARMONY_MARKERS

    def __init__(self, prompt: str = "") -> None:
        self._scanner = MarkerScanner(HARMONY_MARKERS)
        self._started = False  # a marker was seen: text outside messages is a header
        self._in_body = False
        self._to_content = False  # the open message's side
        self._new_message = False  # the open message has no text yet
        self._header = ""  # the open header's text
        self._sides_with_text: set[str] = set()  # for the newline between two messages

    def add(self, text: str) -> Split:
        return self._feed(self._scanner.scan(text))

    def finish(self) -> Split:
        """The held-back tail; a header cut off before its message is dropped."""
        return self._feed(self._scanner.scan("", final=True))

    def _feed(self, runs: list[tuple[bool, str]]) -> Split:
        out = Split()
        for is_marker, run in runs:
            if is_marker:
                self._marker(run)
            elif not self._started:
                out.content += run
                self._sides_with_text.add("content")
            elif self._in_body:
                out += self._body(run)
            else:
                self._header += run
        return out

    def _marker(self, marker: str) -> None:
        self._started = True
        if marker == MESSAGE and not self._in_body:
            channel = self._header.split(CHANNEL)[-1].split()
            # no channel at all (not harmony's rule for assistants): the answer
            self._to_content = CHANNEL not in self._header or channel[:1] == [CONTENT_CHANNEL]
            self._in_body, self._new_message, self._header = True, True, ""
        elif marker == CHANNEL:
            self._in_body, self._header = False, self._header + CHANNEL
        elif marker == CONSTRAIN and not self._in_body:
            self._header += " "  # ends the channel's name: "commentary<|constrain|>json"
        elif marker == START or marker in MESSAGE_ENDS:
            self._in_body, self._header = False, ""

    def _body(self, text: str) -> Split:
        side = "content" if self._to_content else "reasoning"
        if self._new_message and side in self._sides_with_text:
            text = "\n" + text
        self._new_message = False
        self._sides_with_text.add(side)
        return Split(**{side: text})


THINK_START, THINK_END = "<think>", "</think>"


class ThinkParser:
    """Qwen3's (and DeepSeek-R1's) `<think>REASONING</think>ANSWER`. Qwen3's thinking
    templates end the generation prompt with `<think>` (Qwen3-Thinking-2507 always), so
    the output may start inside the block: the prompt's last marker says where it starts.
    Outside a block text is content; a block never closed (cut by max_tokens) stays
    reasoning."""

    markers = (THINK_START, THINK_END)

    def __init__(self, prompt: str = "") -> None:
        self._scanner = MarkerScanner(self.markers)
        self._thinking = prompt.rfind(THINK_START) > prompt.rfind(THINK_END)

    def add(self, text: str) -> Split:
        return self._feed(self._scanner.scan(text))

    def finish(self) -> Split:
        return self._feed(self._scanner.scan("", final=True))

    def _feed(self, runs: list[tuple[bool, str]]) -> Split:
        out = Split()
        for is_marker, run in runs:
            if is_marker:
                self._thinking = run == THINK_START
            elif self._thinking:
                out.reasoning += run
            else:
                out.content += run
        return out


# name (vLLM's `--reasoning_parser` value) -> parser; config.serving.REASONING_PARSERS
# lists the same names for the flag's choices (config cannot import this layer)
PARSERS: dict[str, type] = {"openai_gptoss": HarmonyParser, "qwen3": ThinkParser}
# how much of the prompt's end a parser reads to know where the output starts
PROMPT_TAIL_TOKENS = 64


def parser(name: str, prompt: str = "") -> ReasoningParser:
    """A new parser of that name for an output that follows `prompt` (its end is enough);
    an unknown name is refused with the known ones."""
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser={name!r} is not a known reasoning parser; "
                         f"the known ones are {', '.join(PARSERS)}")
    return PARSERS[name](prompt)


def split(name: str, text: str, prompt: str = "") -> Split:
    """The whole `text` split by the parser `name`."""
    p = parser(name, prompt)
    out = p.add(text)
    out += p.finish()
    return out


class MarkedDetokenizer:
    """Generated ids as text, special tokens skipped (as in the engine's text) except the
    `markers`, which come out as their text: a reasoning parser reads them, though a
    tokenizer may mark them special. Duck-types IncrementalDetokenizer (`add`, `flush`)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 markers: Sequence[str]) -> None:
        self._inner = tokenizer.detokenizer(prompt_token_ids)
        vocab = tokenizer.vocab()
        self._markers = {vocab[m]: m for m in markers if m in vocab}

    def add(self, token_ids: Sequence[int]) -> str:
        out, run = [], []
        for token in token_ids:
            if int(token) not in self._markers:
                run.append(token)
                continue
            out += [self._inner.add(run), self._inner.flush()]
            run = []
            self._inner.add([token])  # context for the next ids; its own text is ours
            out.append(self._markers[int(token)])
        out.append(self._inner.add(run))
        return "".join(out)

    def flush(self) -> str:
        return self._inner.flush()
